"""The tracer's accounting, the element-wise threads, the plot command and the
benchmark's FLOP count (serial; the multi-rank trace is tests/mpi/test_trace_mpi.py)."""

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from click.testing import CliRunner

from hpctrain import trace
from hpctrain.bench import model_flops, summarise
from hpctrain.cli import main
from hpctrain.config import ModelConfig
from hpctrain.nn import GELU, CausalSelfAttention, LayerNorm
from hpctrain.nn import threads as nn_threads
from hpctrain.testing import run_train, tiny_corpus_config

PNG = b"\x89PNG\r\n\x1a\n"

TINY = """
[model]
kind = "gpt"
vocab_size = 256
seq_len = 16
n_layer = 2
n_head = 2
d_model = 16

[train]
steps = 4
batch_size = 4
eval_interval = 2
eval_batches = 2
warmup_steps = 1

[data]
path = "{data}"
"""


# ---- the tracer -------------------------------------------------------------------


def test_nested_spans_count_exclusively_and_add_up():
    tracer = trace.Tracer()
    with trace.recording(tracer):
        t0 = time.perf_counter()
        with trace.span("step", "other"):
            with trace.span("F", "compute", mb=0):
                time.sleep(0.02)
                with trace.span("all_reduce", "tp_comm"):
                    time.sleep(0.03)
            with trace.span("optimizer", "optimizer"):
                time.sleep(0.01)
        wall = time.perf_counter() - t0
    totals = tracer.take_totals()
    assert 0.03 <= totals["tp_comm"] < 0.045
    assert 0.02 <= totals["compute"] < 0.035  # not also the nested all-reduce
    assert sum(totals.values()) == pytest.approx(wall, rel=0.05)
    assert tracer.take_totals() == dict.fromkeys(trace.CATEGORIES, 0.0)  # reset
    assert [e[0] for e in tracer.events] == ["all_reduce", "F", "optimizer", "step"]
    assert trace.active().span("x", "compute") is trace.active().span("y", "data")  # null


def test_helper_thread_spans_are_traced_but_not_counted():
    tracer = trace.Tracer()

    def work():
        with trace.span("bucket 0", "dp_comm"):
            time.sleep(0.01)

    with trace.recording(tracer):
        helper = threading.Thread(target=work, name="helper")
        helper.start()
        helper.join()
    assert tracer.take_totals()["dp_comm"] == 0.0
    events = tracer.chrome_events(0, "rank 0")
    spans = [e for e in events if e["ph"] == "X"]
    assert [(e["name"], e["tid"]) for e in spans] == [("bucket 0", 1)]
    assert {"ph": "M", "name": "thread_name", "pid": 0, "tid": 1,
            "args": {"name": "helper"}} in events


# ---- element-wise threads ----------------------------------------------------------


def test_threaded_kernels_are_bitwise_the_single_thread_ones():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64, 48)).astype(np.float32)
    attn = CausalSelfAttention(48, 4, rng=rng)
    results = []
    for n in (1, 2, 3):
        nn_threads.set_threads(n)
        ln = LayerNorm(48)
        y, gc = GELU().forward(x)
        a, ac = attn.forward(x)
        h, lc = ln.forward(x)
        results.append((y, GELU().backward(x, gc), a, attn.backward(x, ac), h,
                        ln.backward(x, lc), ln.weight.grad))
    nn_threads.set_threads(1)
    for other in results[1:]:
        for got, want in zip(other, results[0], strict=True):
            assert np.array_equal(got, want)


def test_products_over_rows_runs_each_block_on_one_blas_thread_and_restores_the_pool():
    from threadpoolctl import threadpool_info, threadpool_limits

    def blas_threads():
        return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]

    seen = []

    def kernel(a, out):
        seen.append((len(a), blas_threads()))
        np.matmul(a, a, out=out)

    a = np.random.default_rng(0).standard_normal((5, 16, 16))
    out = np.empty_like(a)
    with threadpool_limits(2, user_api="blas"):
        nn_threads.set_threads(2)
        try:
            nn_threads.products_over_rows(kernel, a, out)
            assert sorted(rows for rows, _ in seen) == [2, 3]  # one block per thread
            assert all(set(counts) == {1} for _, counts in seen)
            assert np.array_equal(out, a @ a)
            assert set(blas_threads()) == {2}  # the pool is back
            with pytest.raises(ZeroDivisionError):
                nn_threads.products_over_rows(lambda a: 1 / 0, a)
            assert set(blas_threads()) == {2}  # ... also after a block raised
            seen.clear()
            nn_threads.set_threads(8)  # more threads than rows: one plain call
            nn_threads.products_over_rows(kernel, a, out)
            assert seen == [(5, [2])]  # BLAS keeps its threads for the products
        finally:
            nn_threads.set_threads(1)


# ---- memory kept between steps -------------------------------------------------------

_FAULTS_PER_ROUND = """
import resource, sys
import numpy as np
from hpctrain.runtime import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rounds = []
for _ in range(3):  # a step's worth of activations: allocated, touched, all freed
    before = faults()
    arrays = [np.ones((1024, 1024), np.float32) for _ in range(40)]  # 40 x 4 MB
    arrays += [np.ones((4096, 4096), np.float32) for _ in range(2)]  # 2 x 64 MB
    del arrays
    rounds.append(faults() - before)
print(*rounds)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_kept_memory_is_not_faulted_in_again_the_next_step():
    def rounds(mode):
        out = subprocess.run([sys.executable, "-c", _FAULTS_PER_ROUND, mode], check=True,
                             capture_output=True, text=True, timeout=60).stdout
        return [int(n) for n in out.split()]

    pages = 40 * 4 * 2**20 // 4096  # of the small arrays: the large ones may use huge pages
    default, kept = rounds("default"), rounds("keep")
    assert min(default[1:]) > pages // 2  # glibc gives it back: every step faults again
    assert kept[0] > pages // 2  # the first step maps its memory once ...
    assert max(kept[1:]) < pages // 200  # ... and later steps reuse it, large blocks too


_SPIN_AFTER_PRODUCT = """
import sys, time
if sys.argv[1] == "hpctrain":
    import hpctrain  # sets OPENBLAS_THREAD_TIMEOUT before NumPy loads OpenBLAS
import numpy as np
from threadpoolctl import threadpool_limits
from hpctrain.runtime import blas_spin_warning, blas_thread_timeout
threadpool_limits(2, user_api="blas")
warned = blas_spin_warning(2) is not None and blas_spin_warning(1) is None
a = np.ones((512, 512), np.float32)
a @ a
cpu, wall = time.process_time(), time.perf_counter()
time.sleep(0.05)  # the BLAS workers spin or sleep meanwhile
print(blas_thread_timeout(), (time.process_time() - cpu) / (time.perf_counter() - wall),
      warned)
"""


def _without_blas_timeout() -> dict[str, str]:
    """This environment without OPENBLAS_THREAD_TIMEOUT (the package sets it on import)."""
    return {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}

def test_importing_hpctrain_first_makes_blas_workers_sleep_after_a_product():
    def run(first, **env):
        out = subprocess.run([sys.executable, "-c", _SPIN_AFTER_PRODUCT, first],
                             env=_without_blas_timeout() | env, check=True, capture_output=True,
                             text=True, timeout=60).stdout.split()
        # the timeout read, busy cores while sleeping, whether train() would warn
        return int(out[0]), float(out[1]), out[2] == "True"

    timeout, busy, warned = run("numpy")  # NumPy first: OpenBLAS's default spin
    assert timeout == 0 and busy > 0.5 and warned
    timeout, busy, warned = run("hpctrain")
    assert timeout == 4 and busy < 0.2 and not warned
    assert run("hpctrain", OPENBLAS_THREAD_TIMEOUT="12")[0] == 12  # a user's value stays


def test_bench_step_script_rates_steps_with_openblas_started_after_hpctrain():
    # the A/B script of benchmarks/README.md: one timed step of the benchmark GPT
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "bench_step.py"
    out = subprocess.run([sys.executable, str(script), "--steps", "1", "--threads", "1"],
                         env=_without_blas_timeout(), check=True, capture_output=True, text=True,
                         timeout=120).stdout
    mfu = float(out.split("MFU ")[1].split("%")[0])
    assert 1 < mfu < 100, out
    assert out.rstrip().endswith("OPENBLAS_THREAD_TIMEOUT 4"), out


# ---- the benchmark's figures ---------------------------------------------------------


def test_model_flops_counts_every_matrix_product():
    m = ModelConfig(vocab_size=10, seq_len=4, n_layer=1, n_head=1, d_model=2, d_ff=3)
    # per token: qkv 2*2*6, proj 2*2*2, fc 2*2*3, fc-proj 2*3*2, S 2*4*2, PV 2*4*2, head 2*2*10
    forward_per_token = 24 + 8 + 12 + 12 + 16 + 16 + 40
    assert model_flops(m, sequences=5) == 3 * 5 * 4 * forward_per_token


def test_summarise_leaves_out_the_warmup_and_rates_each_step_against_its_probes():
    # step times 9, 2, 1, 3 s; GEMM probes on 2 ranks before step 1 and after each step
    probes = [[10.0, 15.0], [20.0, 20.0], [10.0, 10.0], [30.0, 30.0], [5.0, 15.0]]
    records = [{"step": 0, "val_loss": 2.0}] + [
        {"step": s, "loss": 1.0, "step_time_s": t, "time_s": {"compute": t},
         "gemm_flops_per_rank": probes[s]} for s, t in [(1, 9.0), (2, 2.0), (3, 1.0), (4, 3.0)]]
    out = summarise(records, warmup=1, flops=120.0, first_peaks=probes[0], tokens=50)
    assert out["step_time_s"] == 2.0 and out["steps_timed"] == 3
    # each step's peak: the mean of the summed probes before and after it
    peaks = {2: (40 + 20) / 2, 3: (20 + 60) / 2, 4: (60 + 20) / 2}
    want = sorted(120.0 / t / peaks[s] for s, t in [(2, 2.0), (3, 1.0), (4, 3.0)])
    assert out["mfu"] == pytest.approx(want[1])
    assert out["peak_flops_per_s"] == pytest.approx(40.0)
    assert out["peak_flops_per_rank"] == [10.0, 15.0]
    assert out["time_s"]["compute"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="after the 4 warm-up steps"):
        summarise(records, warmup=4, flops=1.0, first_peaks=[1.0, 1.0], tokens=1)


def test_bench_refuses_a_missing_dataset(tmp_path):
    result = CliRunner().invoke(main, ["bench", "--data", str(tmp_path / "none.h5")])
    assert result.exit_code == 2
    assert "none.h5 does not exist" in result.output and "make data" in result.output


# ---- plots ---------------------------------------------------------------------------


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_plot_writes_loss_and_schedule_pngs_of_a_traced_run(tmp_path):
    cfg = tiny_corpus_config(tmp_path, TINY, "the quality of mercy is not strained", 300)
    run = tmp_path / "run"
    done = run_train(1, cfg, run, "--trace", str(run / "trace.json"), "--quiet")
    assert done.returncode == 0, done.stderr
    result = CliRunner().invoke(main, ["plot", str(run), "--trace", str(run / "trace.json")])
    assert result.exit_code == 0, result.output
    for name in ("loss.png", "pipeline.png"):
        width, height = _png_size(run / name)
        assert width > 400 and height > 200
    records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert all(set(r["time_s"]) == set(trace.CATEGORIES) for r in records if "loss" in r)


def test_the_spans_of_each_row_of_a_data_parallel_trace_nest(tmp_path):
    # the buckets' spans, seen complete from the main thread, went on its row and
    # overlapped its backward and dp_wait spans, which trace viewers draw only nested
    cfg = tiny_corpus_config(tmp_path, TINY, "the quality of mercy is not strained", 300)
    run = tmp_path / "run"
    done = run_train(2, cfg, run, "--bucket-mb", "0.01", "--trace", str(run / "t.json"),
                     "--quiet")
    assert done.returncode == 0, done.stderr
    events = json.loads((run / "t.json").read_text())["traceEvents"]
    rows: dict = {}
    for e in events:
        if e["ph"] == "X":
            rows.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    assert any(e["ph"] == "X" and e["name"].startswith("bucket") for e in events)
    for row, spans in rows.items():
        open_ends: list = []
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= start + 1e-3:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1] + 1e-3, \
                f"row {row}: a span [{start}, {end}] crosses the end of its parent"
            open_ends.append(end)


def test_plot_of_an_earlier_runs_records_keeps_the_current_plot(tmp_path):
    # plot RUN/metrics.1.jsonl wrote RUN/loss.png over the current run's plot, and every
    # plot said tokens, whatever the model
    from hpctrain.plot_cli import _counts_tokens

    run = tmp_path / "run"
    run.mkdir()
    records = "".join(json.dumps({"step": s, "loss": 2.0 / s, "tokens_per_s": 100.0}) + "\n"
                      for s in range(1, 5))
    (run / "metrics.jsonl").write_text(records)
    (run / "metrics.1.jsonl").write_text(records)
    (run / "config.1.json").write_text(json.dumps({"model": {"kind": "mlp"}}))
    assert CliRunner().invoke(main, ["plot", str(run)]).exit_code == 0
    before = (run / "loss.png").read_bytes()
    result = CliRunner().invoke(main, ["plot", str(run / "metrics.1.jsonl")])
    assert result.exit_code == 0, result.output
    assert (run / "loss.1.png").is_file() and (run / "loss.png").read_bytes() == before
    other = tmp_path / "records.jsonl"  # any other name: loss.png beside it
    other.write_text(records)
    assert CliRunner().invoke(main, ["plot", str(other)]).exit_code == 0
    assert (tmp_path / "loss.png").is_file()
    assert not _counts_tokens(run / "config.1.json")  # samples / s, not tokens
    assert _counts_tokens(run / "config.json")  # none: a token model, as before


def test_plot_errors_name_the_value(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["plot", str(tmp_path)])
    assert result.exit_code != 0 and "metrics.jsonl does not exist" in result.output
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"traceEvents": [], "otherData": {"format": "x"}}))
    result = runner.invoke(main, ["plot", "--trace", str(bad)])
    assert result.exit_code != 0 and "'x' is not 'hpctrain-trace'" in result.output
    good = {"traceEvents": [{"ph": "X", "name": "F", "cat": "compute", "pid": 0, "tid": 0,
                             "ts": 0, "dur": 5, "args": {"step": 1, "mb": 0}}],
            "otherData": {"format": "hpctrain-trace"}}
    bad.write_text(json.dumps(good))
    result = runner.invoke(main, ["plot", "--trace", str(bad), "--step", "7"])
    assert result.exit_code != 0 and "step 7 is not in the trace (steps 1..1)" in result.output
    # a binary file as the trace, a record without its step, a PNG folder under a file:
    # each one line naming it, no traceback
    binary = tmp_path / "data.h5"
    binary.write_bytes(b"\x89HDF\r\n\x1a\n\xff\xfe" * 8)
    result = runner.invoke(main, ["plot", "--trace", str(binary)])
    assert result.exit_code == 2 and f"{binary} is not a JSON trace" in result.output
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    for line in ('{"loss": 1.5}', '{"tokens_per_s": 100.0}'):
        metrics.write_text('{"step": 1, "loss": 2.0}\n' + line + "\n")
        result = runner.invoke(main, ["plot", str(metrics)])
        assert result.exit_code == 1, result.output
        assert "record 2 has a loss or a throughput but no step" in result.output
    metrics.write_text('{"step": 1, "loss": 2.0}\n')
    (tmp_path / "file").write_text("")
    result = runner.invoke(main, ["plot", str(metrics), "--out", str(tmp_path / "file" / "x")])
    assert result.exit_code == 2 and "the PNG cannot be written there" in result.output
    for r in (result,):
        assert r.exception is None or isinstance(r.exception, SystemExit), r.output


def test_importing_the_plot_module_does_not_import_matplotlib():
    code = "import hpctrain.plot, hpctrain.cli, sys; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_progress_line_names_its_throughput_unit():
    from hpctrain.metrics import progress_line

    rec = {"step": 3, "loss": 1.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 12.0,
           "step_time_s": 0.1, "val_dice_1": 0.9}
    assert "12 tok/s" in progress_line(rec, 10)
    line = progress_line(rec, 10, "samp/s")
    assert "12 samp/s" in line and "dice 1 0.9000" in line


def test_an_earlier_runs_metrics_and_config_are_kept_under_the_first_free_number(tmp_path):
    from hpctrain.metrics import keep_earlier

    assert keep_earlier(tmp_path) == []  # nothing there
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "config.json").write_text("{}")
    assert keep_earlier(tmp_path) == []  # no records: nothing to keep
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "config.2.json").write_text("{}")  # 2 is taken by a config alone
    assert keep_earlier(tmp_path) == [tmp_path / "metrics.1.jsonl", tmp_path / "config.1.json"]
    (tmp_path / "metrics.jsonl").write_text('{"step": 2}\n')  # a run without a config
    assert keep_earlier(tmp_path) == [tmp_path / "metrics.3.jsonl"]
    assert (tmp_path / "metrics.1.jsonl").read_text() == '{"step": 1}\n'
    assert (tmp_path / "metrics.3.jsonl").read_text() == '{"step": 2}\n'
    assert not (tmp_path / "metrics.jsonl").exists()
