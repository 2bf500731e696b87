"""The Chrome trace of a parallel run: valid JSON, one track per rank, every span.

The layout follows the world size N: pp=2 at N = 2, and tp=2 x pp=2 (with dp = N / 4)
at N = 4 and 8. Three steps of a tiny GPT are traced with ``hpctrain.train.train``;
rank 0 checks the file and draws the pipeline picture from it.
"""

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from mpi4py import MPI

from hpctrain import config as config_mod
from hpctrain.testing import assert_all, tiny_corpus_config
from hpctrain.train import train

WORLD = MPI.COMM_WORLD
SIZE = WORLD.Get_size()
TP = 2 if SIZE % 4 == 0 else 1
PP = 2
MICROBATCHES = 4
STEPS = 3

TINY = """
[model]
kind = "gpt"
vocab_size = 256
seq_len = 16
n_layer = 4
n_head = 4
d_model = 32

[train]
steps = 3
batch_size = 8
eval_interval = 0
warmup_steps = 1

[data]
path = "{data}"
"""

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def traced():
    """Train STEPS steps with --trace; every rank gets (trace path, run dir)."""
    folder = tempfile.mkdtemp(prefix="hpctrain-trace-") if WORLD.Get_rank() == 0 else None
    folder = Path(WORLD.bcast(folder))
    if WORLD.Get_rank() == 0:
        tiny_corpus_config(folder, TINY, "to be or not to be, that is the question", 400)
    WORLD.Barrier()
    cfg = config_mod.load(folder / "tiny.toml", {
        "parallel.tp": TP, "parallel.pp": PP, "parallel.microbatches": MICROBATCHES,
        "train.run_dir": str(folder / "run")}).validate(SIZE)
    path = folder / "trace.json"
    train(cfg, WORLD, quiet=True, trace_path=str(path))
    yield path, folder / "run"
    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        shutil.rmtree(folder)


def test_trace_is_valid_chrome_json_with_every_rank_and_span(traced):
    path, _ = traced
    problems = []
    if WORLD.Get_rank() == 0:
        doc = json.loads(path.read_text())  # valid JSON, or this raises
        events = doc["traceEvents"]
        other = doc["otherData"]
        if (other["format"], other["world_size"], other["tp"], other["pp"]) != \
                ("hpctrain-trace", SIZE, TP, PP):
            problems.append(f"otherData {other}")
        for e in events:
            if e["ph"] == "X" and not (e["dur"] >= 0 and e["ts"] >= 0 and e["pid"] < SIZE):
                problems.append(f"bad span {e}")
            if e["ph"] not in ("X", "M") or not isinstance(e["name"], str):
                problems.append(f"bad event {e}")
        tracks = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
        if tracks != set(range(SIZE)):
            problems.append(f"process tracks {sorted(tracks)}, expected 0..{SIZE - 1}")
        for rank in range(SIZE):
            mine = [e for e in events if e["ph"] == "X" and e["pid"] == rank]
            for step in range(1, STEPS + 1):
                for verb in "FB":
                    mbs = sorted(e["args"]["mb"] for e in mine if e["name"] == verb
                                 and e["args"].get("step") == step)
                    if mbs != list(range(MICROBATCHES)):
                        problems.append(f"rank {rank} step {step}: {verb} of mbs {mbs}")
            cats = {e["cat"] for e in mine}
            wanted = {"compute", "pp_wait", "optimizer", "data"} | ({"tp_comm"} if TP > 1
                                                                    else set())
            if not wanted <= cats:
                problems.append(f"rank {rank}: categories {sorted(cats)} lack "
                                f"{sorted(wanted - cats)}")
    assert_all(WORLD, not problems, "; ".join(problems[:5]))


def test_breakdown_adds_up_to_the_step(traced):
    _, run = traced
    problems = []
    if WORLD.Get_rank() == 0:
        records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
        for r in records:
            if "time_s" in r:
                total = sum(r["time_s"].values())
                # the breakdown is a mean over ranks, step_time_s rank 0's wall time; in
                # step 1 the ranks arrive from setup at different moments, and a rank
                # that came early counts its wait for the others, which rank 0's wall
                # time does not hold (8.5 against 6.2 ms seen once): from step 2 on the
                # ranks start each step together
                if r["step"] > 1 and not 0.8 * r["step_time_s"] < total < 1.2 * r["step_time_s"]:
                    problems.append(f"step {r['step']}: {total} s vs {r['step_time_s']} s")
                if r["time_s"]["pp_wait"] <= 0:
                    problems.append(f"step {r['step']}: no pipeline wait")
    assert_all(WORLD, not problems, "; ".join(problems))


def test_plot_draws_the_traced_schedule(traced):
    path, _ = traced
    ok, what = True, ""
    if WORLD.Get_rank() == 0:
        from hpctrain.plot import pipeline_spans, plot_pipeline

        trace = json.loads(path.read_text())
        spans = pipeline_spans(trace, STEPS)
        out = plot_pipeline(trace, path.with_name("pipeline.png"))
        ok = sorted(spans) == list(range(SIZE)) and \
            out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        what = f"ranks {sorted(spans)}, file {out}"
    assert_all(WORLD, ok, what)
