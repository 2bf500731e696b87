"""Pipeline parallelism without MPI: stage partitioning, the schedules' order of
operations (complete, deadlock-free, the textbook bubble, the caches in flight), the
model chunks against the whole GPT, and the engine at pp = 1 against LocalEngine."""

import itertools
from dataclasses import replace

import numpy as np
import pytest

from hpctrain.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.models.gpt import GPT
from hpctrain.parallel import pipeline, stages, timeline
from hpctrain.parallel.engine import LocalEngine

SCHEDULES = {"gpipe": pipeline.gpipe, "1f1b": pipeline.one_f_one_b}


def valid_layouts():
    """(schedule, pp, m, v) for every schedule the config accepts, small sizes."""
    for pp, m in itertools.product((1, 2, 3, 4, 8), (1, 2, 3, 4, 8, 16)):
        yield from (("gpipe", pp, m, 1), ("1f1b", pp, m, 1))
        if pp > 1 and m % pp == 0:
            yield from (("interleaved", pp, m, v) for v in (1, 2, 3, 4))


LAYOUTS = list(valid_layouts())


def run_order(name, pp, m, v):
    fn = pipeline.SCHEDULES[name]
    return timeline.record(fn, pp, m, v)


# ---- stage partitioning ------------------------------------------------------------


@pytest.mark.parametrize("n, k", [(8, 1), (8, 2), (8, 3), (8, 8), (12, 5), (4, 4)])
def test_balance_by_layers_is_an_even_split_earlier_chunks_taking_the_rest(n, k):
    sizes = stages.partition([1.0] * n, k)
    assert sizes == [len(a) for a in np.array_split(np.arange(n), k)]


def worst_run(costs, sizes, first, last):
    bounds = np.cumsum([0, *sizes])
    runs = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
    runs[0] += first
    runs[-1] += last
    return max(runs)


def test_partition_minimises_the_largest_chunk_against_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(60):
        n = int(rng.integers(1, 9))
        k = int(rng.integers(1, n + 1))
        costs = [float(c) for c in rng.integers(1, 10, n)]
        first, last = float(rng.integers(0, 15)), float(rng.integers(0, 15))
        best = min(worst_run(costs, [b - a for a, b in itertools.pairwise((0, *cut, n))],
                             first, last)
                   for cut in itertools.combinations(range(1, n), k - 1))
        sizes = stages.partition(costs, k, first=first, last=last)
        assert len(sizes) == k and min(sizes) >= 1 and sum(sizes) == n
        assert worst_run(costs, sizes, first, last) == best


def test_balance_by_params_moves_blocks_away_from_a_heavy_embedding_and_head():
    m = ModelConfig(vocab_size=4096, d_model=32, n_layer=8, seq_len=16)
    by_layers = [len(s.blocks) for s in stages.plan(m, 4, balance="layers")]
    by_params = [len(s.blocks) for s in stages.plan(m, 4, balance="params")]
    assert by_layers == [2, 2, 2, 2]
    assert by_params[0] < 2 and by_params[-1] < 2 and sum(by_params) == 8
    block = stages.block_params(m)
    assert block == GPT(replace(m, n_layer=1), seed=0).blocks[0].num_parameters()


def test_chunk_c_of_rank_r_holds_model_chunk_c_pp_plus_r():
    m = ModelConfig(n_layer=8)
    specs = stages.plan(m, pp=2, virtual_stages=2)
    assert [(s.start, s.stop) for s in specs] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [s.index for s in stages.rank_chunks(specs, 0, 2)] == [0, 2]
    assert [s.index for s in stages.rank_chunks(specs, 1, 2)] == [1, 3]
    assert specs[0].has_embed and specs[3].has_head and not specs[1].has_head
    for k in range(4):
        r, c = stages.chunk_owner(k, 2)
        assert stages.model_chunk(c, r, 2) == k


def test_model_chunks_chained_equal_the_whole_gpt():
    cfg = ModelConfig(dtype="float64", vocab_size=32, seq_len=8, n_layer=5, n_head=2,
                      d_model=16, tie_embeddings=True)
    whole, split = GPT(cfg, seed=3), GPT(cfg, seed=3)
    rng = np.random.default_rng(1)
    idx, tgt = rng.integers(0, 32, (3, 8)), rng.integers(0, 32, (3, 8))
    loss, cache = whole.forward(idx, tgt)
    whole.backward(cache, dloss=0.7)
    chunks = [stages.ModelChunk(s, split) for s in stages.plan(cfg, 3)]
    x, caches = idx, []
    for chunk in chunks:
        x, c = chunk.forward(x, tgt)
        caches.append(c)
    assert x == loss
    d = 0.7
    for chunk, c in zip(reversed(chunks), reversed(caches), strict=True):
        d = chunk.backward(d, c)
    assert d is None
    for (name, a), (_, b) in zip(whole.named_parameters(), split.named_parameters(),
                                 strict=True):
        np.testing.assert_allclose(b.grad, a.grad, rtol=1e-12, atol=1e-15, err_msg=name)


# ---- the schedules' order of operations ----------------------------------------------


@pytest.mark.parametrize("name, pp, m, v", LAYOUTS, ids=lambda x: str(x))
def test_every_schedule_is_complete_deadlock_free_and_has_the_textbook_bubble(name, pp, m, v):
    tl = timeline.check(run_order(name, pp, m, v), m, v)
    assert tl.bubble() == pytest.approx(timeline.bubble_theory(pp, m, v), abs=1e-12)


@pytest.mark.parametrize("pp, m", list(itertools.product((1, 2, 4, 8), (1, 2, 4, 8, 16))))
def test_1f1b_holds_at_most_pp_caches_gpipe_all_m(pp, m):
    one = [timeline.peak_live(ops) for ops in run_order("1f1b", pp, m, 1)]
    assert one == [min(pp - r, m) for r in range(pp)]
    assert max(one) <= pp
    assert [timeline.peak_live(ops) for ops in run_order("gpipe", pp, m, 1)] == [m] * pp


def test_interleaved_holds_its_warm_up_plus_one():
    pp, m, v = 4, 8, 2
    peaks = [timeline.peak_live(ops) for ops in run_order("interleaved", pp, m, v)]
    assert peaks == [2 * (pp - r - 1) + (v - 1) * pp + 1 for r in range(pp)]


@pytest.mark.parametrize("name, pp, m, v", LAYOUTS, ids=lambda x: str(x))
def test_the_closed_form_peak_caches_are_the_recorded_orders(name, pp, m, v):
    # the planner prices memory by pipeline.peak_caches without recording the schedule
    assert pipeline.peak_caches(name, pp, m, v) == \
        tuple(timeline.peak_live(ops) for ops in run_order(name, pp, m, v))


@pytest.mark.parametrize("name, pp, m, v", LAYOUTS, ids=lambda x: str(x))
def test_recording_only_the_compute_gives_the_compute_of_the_whole_order(name, pp, m, v):
    whole = run_order(name, pp, m, v)
    compute = timeline.record_compute(pipeline.SCHEDULES[name], pp, m, v)
    assert compute == [[(timeline.COMPUTE[op.verb], op.chunk, op.mb) for op in ops
                        if op.verb in timeline.COMPUTE] for ops in whole]
    played = timeline.replay([[(*op, 1.0 if op[0] == "F" else 2.0) for op in ops]
                              for ops in compute], pp * v)
    assert played.bubble() == pytest.approx(timeline.bubble_theory(pp, m, v), abs=1e-12)


def test_a_schedule_with_a_missing_backward_is_caught():
    def broken(stage, m):
        pipeline.gpipe(stage, m)
        stage.ops.pop()  # drop the last send_backward
    with pytest.raises(AssertionError, match="not between"):
        timeline.check(timeline.record(broken, 2, 2), 2)


def test_replay_reports_a_deadlock():
    # rank 0 waits for B(0, 0) before running F(0, 0): nothing can start
    compute = [[("B", 0, 0, 2.0), ("F", 0, 0, 1.0)], [("F", 1, 0, 1.0), ("B", 1, 0, 2.0)]]
    with pytest.raises(RuntimeError, match="deadlock"):
        timeline.replay(compute, n_chunks=2)


@pytest.mark.parametrize("fn, args", [(pipeline.gpipe, (4, 4, 1)),
                                      (pipeline.one_f_one_b, (4, 8, 1)),
                                      (pipeline.interleaved, (4, 4, 2))])
def test_the_docstring_diagrams_are_what_the_schedules_do(fn, args):
    pp, m, v = args
    drawn = timeline.render(timeline.check(timeline.record(fn, pp, m, v), m, v))
    assert drawn in "\n".join(line.strip() for line in fn.__doc__.splitlines())


def test_bubble_theory():
    assert timeline.bubble_theory(4, 4) == pytest.approx(3 / 7)
    assert timeline.bubble_theory(4, 8, 2) == pytest.approx(3 / 19)
    assert timeline.bubble_theory(1, 8) == 0.0


# ---- the engine at pp = 1 (the degenerate pipeline) -----------------------------------


def tiny_config(**parallel):
    model = ModelConfig(dtype="float64", vocab_size=32, seq_len=8, n_layer=3, n_head=2,
                        d_model=16, tie_embeddings=True)
    return Config(model=model, parallel=ParallelConfig(**parallel),
                  train=TrainConfig(batch_size=8, lr=1e-2, warmup_steps=1)).validate(1)


def losses_of(engine, cfg, batches):
    from hpctrain.optim.optimizers import AdamW

    opt = AdamW(engine.named_params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    out = []
    for x, y in batches:
        engine.zero_grad()
        out.append(engine.forward_backward(x, y))
        assert engine.grad_norm() > 0
        opt.step()
    return out


@pytest.mark.parametrize("schedule, m", [("gpipe", 4), ("1f1b", 4), ("1f1b", 1)])
def test_pipeline_engine_at_pp1_equals_local_engine(schedule, m):
    from mpi4py import MPI

    from hpctrain.parallel.pipeline import PipelineEngine
    from hpctrain.parallel.topology import Topology

    cfg = tiny_config(microbatches=m, schedule=schedule)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 32, (8, 8)), rng.integers(0, 32, (8, 8))) for _ in range(4)]
    topo = Topology.build(MPI.COMM_SELF, cfg.parallel)
    engine = PipelineEngine(GPT(cfg.model, cfg.train.seed), cfg, topo)
    local = LocalEngine(GPT(cfg.model, cfg.train.seed), m)
    got, ref = losses_of(engine, cfg, batches), losses_of(local, cfg, batches)
    np.testing.assert_allclose(got, ref, rtol=1e-12)
    assert engine.peak_live_caches == (m if schedule == "gpipe" else 1)
    assert engine.loss(*batches[0]) == pytest.approx(local.loss(*batches[0]), rel=1e-12)
    metrics = engine.metrics()
    assert metrics["bubble_theory"] == 0.0
    assert metrics["peak_live_caches"] == engine.peak_live_caches
    topo.free()


# ---- the command line ---------------------------------------------------------------

CLI_CONFIG = """
[model]
dtype = "float64"
vocab_size = 256
seq_len = 16
n_layer = 4
n_head = 2
d_model = 16
tie_embeddings = true

[train]
steps = 4
batch_size = 8
warmup_steps = 1
eval_interval = 2
eval_batches = 2
log_interval = 1

[data]
path = "{data}"
"""


@pytest.mark.slow
def test_hpctrain_train_pp_2_matches_serial_and_reports_the_bubble(tmp_path):
    """``--pp --microbatches --schedule --virtual-stages`` under ``mpiexec -n 2``."""
    import json
    import sys

    from click.testing import CliRunner

    from data_prep.cli import main as prep
    from hpctrain.testing import run_mpi

    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"line {i}: to be, or not to be.\n" for i in range(300)))
    data = tmp_path / "corpus.h5"
    result = CliRunner().invoke(prep, ["text", str(text), "-o", str(data), "-q"])
    assert result.exit_code == 0, result.output
    config = tmp_path / "tiny.toml"
    config.write_text(CLI_CONFIG.format(data=data))

    def run(ranks, *flags):
        run_dir = tmp_path / "_".join(["run", str(ranks), *flags]).replace("-", "")
        done = run_mpi(ranks, [sys.executable, "-m", "hpctrain.cli", "train", "--config",
                               str(config), "--run-dir", str(run_dir), "--quiet", *flags],
                       timeout=120)
        assert done.returncode == 0, done.stderr
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]

    serial = run(1, "--microbatches", "4")
    for flags in (["--schedule", "1f1b"], ["--schedule", "gpipe"],
                  ["--schedule", "interleaved", "--virtual-stages", "2"]):
        records = run(2, "--pp", "2", "--microbatches", "4", *flags)
        for key in ("loss", "val_loss"):
            want = [r[key] for r in serial if key in r]
            got = [r[key] for r in records if key in r]
            assert len(got) == len(want) > 0
            np.testing.assert_allclose(got, want, rtol=1e-8, err_msg=f"{key} {flags}")
        steps = [r for r in records if "loss" in r]
        v = 2 if "interleaved" in flags else 1
        assert all(r["bubble_theory"] == pytest.approx(1 / (4 * v + 1)) for r in steps)
        assert all(0 <= r["bubble_fraction"] < 1 and r["p2p_bytes"] > 0 for r in steps)
        assert steps[-1]["peak_live_caches"] == {"1f1b": 2, "gpipe": 4}.get(flags[1], 5)
