"""The non-finite guard: a diverging step updates nothing on any rank, a run that keeps
diverging stops with a named error, and its last checkpoint stays finite and loads."""

from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain import config as config_mod
from hpctrain.checkpoint import verify, writer
from hpctrain.checkpoint.format import INDEX_NAME, latest_checkpoint, read_index, step_of
from hpctrain.checkpoint.rankfile import all_finite
from hpctrain.checkpoint.state import held_tensors
from hpctrain.checkpoint.training import NonFiniteState, save_training
from hpctrain.guard import EXIT_DIVERGED, DivergenceError, NonFiniteGuard, describe
from hpctrain.metrics import read_metrics
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.topology import Topology
from hpctrain.testing import run_train
from hpctrain.train import make_data_parallel, train, train_step

CONFIG = """
[model]
seq_len = 16
n_layer = 2
n_head = 2
d_model = 32
dtype = "float32"
[train]
steps = 30
batch_size = 4
lr = {lr}
warmup_steps = 2
eval_interval = 0
log_interval = 1
seed = 3
max_skipped_steps = 3
[data]
path = "{data}"
"""


def test_describe_names_each_value_and_its_ranks():
    text = describe(12, [(1.0, math.inf), (math.nan, math.inf), (2.0, 3.0)])
    assert text == "step 12: loss nan on rank 1; gradient norm inf on ranks 0, 1"


def test_guard_skips_counts_and_stops_at_the_limit():
    guard = NonFiniteGuard(MPI.COMM_SELF, max_skipped=2)
    assert guard.check(1, 2.5, 1.0) and not guard.skipped_last
    assert not guard.check(2, math.nan, 1.0) and guard.skipped_last
    assert guard.metrics() == {"skipped_steps": 1, "skipped": True}
    assert guard.check(3, 2.0, 1.0)  # a finite step ends the streak
    assert guard.metrics() == {"skipped_steps": 1}
    assert not guard.check(4, 2.0, math.inf)
    with pytest.raises(DivergenceError, match=r"step 5: loss inf on rank 0.*4-5"):
        guard.check(5, math.inf, math.nan)


def test_the_guards_counts_go_on_after_a_resume():
    guard = NonFiniteGuard(MPI.COMM_SELF, max_skipped=2)
    assert not guard.check(7, math.nan, 1.0)
    resumed = NonFiniteGuard(MPI.COMM_SELF, max_skipped=2)
    resumed.load_state(guard.state())
    assert resumed.metrics() == {"skipped_steps": 1}
    with pytest.raises(DivergenceError, match=r"2 steps in a row, 7-8"):
        resumed.check(8, math.nan, 1.0)  # the second in a row, across the resume
    fresh = NonFiniteGuard(MPI.COMM_SELF, max_skipped=2)
    fresh.load_state(None)  # a checkpoint from before the counts were kept
    assert fresh.metrics() == {"skipped_steps": 0}
    with pytest.raises(ValueError, match="max_skipped"):
        NonFiniteGuard(MPI.COMM_SELF, max_skipped=0)


def _tiny(tmp_path, datasets, lr=1e-3):
    data = tmp_path / "tokens.h5"
    if not data.exists():
        datasets.make_tokens(data)
    path = tmp_path / "tiny.toml"
    path.write_text(CONFIG.format(lr=lr, data=data))
    return path


def test_a_skipped_step_leaves_parameters_and_optimizer_state_alone(tmp_path, datasets):
    cfg = config_mod.load(_tiny(tmp_path, datasets)).validate(1)
    topo = Topology.build(MPI.COMM_SELF, cfg.parallel)
    engine = build_engine(cfg, topo)
    dp = make_data_parallel(cfg, engine, topo)
    guard = NonFiniteGuard(MPI.COMM_SELF, max_skipped=5)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (4, 16))
    train_step(engine, dp, x, x, lr=1e-3, grad_clip=1.0, guard=guard, step=1)
    before = [h.array.copy() for h in held_tensors(engine, dp, 0, 1)]
    t = dp.optimizer.t
    bad = x.copy()
    engine.params[0].data[0, 0] = np.nan  # the embedding row of token 0 -> nan loss
    bad[:, 0] = 0
    loss, norm = train_step(engine, dp, bad, bad, lr=1e-3, grad_clip=1.0, guard=guard, step=2)
    assert not math.isfinite(loss) and guard.skipped_last
    after = [h.array for h in held_tensors(engine, dp, 0, 1)]
    same = [np.array_equal(a, b, equal_nan=True) for a, b in zip(before[1:], after[1:],
                                                                 strict=True)]
    assert all(same) and dp.optimizer.t == t
    with pytest.raises(NonFiniteState, match=r"step 2 is not finite: model/\S+ holds nan"):
        save_training(cfg, topo, engine, dp, step=2, loader_state=None, root=tmp_path / "c")
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())
    held = held_tensors(engine, dp, 0, 1)
    assert [h.name for h in held if not all_finite(h.array)] == [held[0].name]
    topo.free()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's overflow notes
def test_divergence_stops_keeps_the_last_healthy_checkpoint_and_a_resumed_run_goes_on(
        tmp_path, datasets, capsys):
    run = str(tmp_path / "run")
    healthy = config_mod.load(_tiny(tmp_path, datasets, lr=1e-3),
                              {"train.run_dir": run, "train.steps": 6,
                               "train.save_interval": 2, "train.keep_checkpoints": 1}
                              ).validate(1)
    train(healthy, MPI.COMM_WORLD)
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for p in root.iterdir() if step_of(p) is not None] == ["step-000006"]
    # the same run continued with a learning rate of 1e6: one update wrecks the weights
    # (finite but huge), the next steps are nan
    wild = config_mod.load(_tiny(tmp_path, datasets, lr=1e6),
                           {"train.run_dir": run, "train.save_interval": 2,
                            "train.keep_checkpoints": 1}).validate(1)
    with pytest.raises(DivergenceError, match=r"diverged at step \d+: .* on rank 0") as err:
        train(wild, MPI.COMM_WORLD, resume="auto", reset_schedule=True)
    assert f"{root / 'step-000006'} is the newest checkpoint whose next step was finite" \
        in str(err.value)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    skipped = [r["step"] for r in records if r.get("skipped")]
    # max_skipped_steps = 3: two skipped steps recorded, the third stops the run
    assert len(skipped) == 2 and records[-1]["skipped_steps"] == 2
    assert f"diverged at step {skipped[-1] + 1}" in str(err.value)
    assert (root / "step-000008").is_dir()  # written (finite), never trusted
    # the guard's counts are kept with it: a run resumed from it goes on counting
    kept = read_index(root / "step-000008" / INDEX_NAME).meta["guard"]
    assert kept["skipped"] == sum(1 for r in records if r.get("skipped") and r["step"] <= 8)
    assert latest_checkpoint(root) == root / "step-000006"
    _, problems = verify(root)
    assert problems == []  # whole, and every value finite
    out = capsys.readouterr().out
    assert "skipped step" in out and "no update" in out

    # continued with a sane learning rate, from the healthy checkpoint
    sane = config_mod.load(_tiny(tmp_path, datasets, lr=1e-3),
                           {"train.run_dir": run, "train.steps": 10}).validate(1)
    summary = train(sane, MPI.COMM_WORLD, resume="auto", reset_schedule=True)
    assert len(summary.losses) == 4 and all(math.isfinite(v) for v in summary.losses)
    assert summary.losses[-1] < 6  # a byte-level model that trains, not one that diverged
    assert "resumed from" in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_run_that_diverges_before_any_healthy_checkpoint_says_start_afresh(
        tmp_path, datasets):
    cfg = config_mod.load(_tiny(tmp_path, datasets, lr=1e6),
                          {"train.run_dir": str(tmp_path / "run"), "train.save_interval": 1,
                           "train.keep_checkpoints": 1}).validate(1)
    with pytest.raises(DivergenceError, match="start afresh with a lower learning rate"):
        train(cfg, MPI.COMM_WORLD, quiet=True)


def test_verify_names_a_tensor_that_is_not_finite(tmp_path, datasets):
    cfg = config_mod.load(_tiny(tmp_path, datasets)).validate(1)
    topo = Topology.build(MPI.COMM_SELF, cfg.parallel)
    engine = build_engine(cfg, topo)
    dp = make_data_parallel(cfg, engine, topo)
    name, param = next((n, p) for n, p in engine.named_params if n.endswith("ln_f.weight"))
    param.data[0] = np.nan
    # the writer itself, below save_training's refusal: a checkpoint from elsewhere
    path = writer.save(tmp_path / "c", 1, held_tensors(engine, dp, 0, 1), {}, MPI.COMM_SELF)
    _, problems = verify(path)
    assert problems == [f"{path / 'index.h5'}: tensor model/{name} is not finite: 1 nan and "
                        f"0 inf of {param.data.size} values"]
    topo.free()


@pytest.mark.parametrize("layout", [["--dp", "2"], ["--zero", "2"], ["--tp", "2"],
                                    ["--pp", "2", "--microbatches", "2"]])
def test_a_diverging_job_on_two_ranks_exits_4_with_one_message(tmp_path, datasets, layout):
    result = run_train(2, _tiny(tmp_path, datasets, lr=1e6), tmp_path / "run",
                       "--save-interval", "2", "--keep", "1", *layout, timeout=120)
    assert result.returncode == EXIT_DIVERGED, result.stderr
    assert result.stderr.count("training diverged at step") == 1, result.stderr
    assert "Traceback" not in result.stderr
    _, problems = verify(tmp_path / "run")
    assert problems == []
