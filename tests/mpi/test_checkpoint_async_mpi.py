"""Asynchronous checkpoints under MPI, at any world size N: the background thread's
collectives (over ``Topology.ckpt_comm``) run beside the training's, the checkpoint
holds the state of the save call on every rank, and an I/O error on one rank is
raised on every rank by ``wait``, as is a non-finite piece (synchronous saves too).

The layout is dp = N with ZeRO 1 (every rank writes a share of the pieces)."""

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.checkpoint import CheckpointError, load_training, save_training, writer
from hpctrain.checkpoint.background import BackgroundWriter
from hpctrain.checkpoint.state import held_tensors
from hpctrain.checkpoint.training import NonFiniteState
from hpctrain.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.topology import Topology
from hpctrain.testing import assert_all
from hpctrain.train import make_data_parallel, train_step

WORLD = MPI.COMM_WORLD
MODEL = ModelConfig(n_layer=2, d_model=16, n_head=2, seq_len=8, vocab_size=32, dtype="float64")

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]


def build():
    cfg = Config(model=MODEL, parallel=ParallelConfig(zero=1, bucket_mb=0.001),
                 train=TrainConfig(batch_size=2 * WORLD.Get_size(), keep_checkpoints=2)
                 ).validate(WORLD.Get_size())
    topo = Topology.build(WORLD, cfg.parallel)
    engine = build_engine(cfg, topo)
    return cfg, topo, engine, make_data_parallel(cfg, engine, topo)


@pytest.fixture
def root():
    path = WORLD.bcast(tempfile.mkdtemp(prefix="ckpt-async-") if WORLD.Get_rank() == 0
                       else None)
    yield Path(path) / "checkpoints"
    writer.wait_for_pruning()
    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def held(topo, engine, dp) -> dict[str, np.ndarray]:
    return {h.name: h.array.copy() for h in held_tensors(engine, dp, topo.tp_rank,
                                                        topo.tp_size)}


def test_background_write_holds_the_saved_state_on_every_rank(root):
    cfg, topo, engine, dp = build()
    rng = np.random.default_rng(topo.dp_rank)

    def step():
        x, y = (rng.integers(0, 32, (2, 8)) for _ in range(2))
        train_step(engine, dp, x, y, lr=1e-2, grad_clip=1.0)

    background = BackgroundWriter(topo.ckpt_comm)
    step()
    at_save = held(topo, engine, dp)
    path = save_training(cfg, topo, engine, dp, step=1, loader_state={"step": 1}, root=root,
                         background=background)
    step()  # the training's collectives while the writer's run over ckpt_comm
    step()
    assert_all(WORLD, background.wait() == path, "the write committed its folder")
    _, topo2, engine2, dp2 = build()
    load_training(path, cfg, topo2, engine2, dp2, root=root)
    got = held(topo2, engine2, dp2)
    assert_all(WORLD, all(np.array_equal(got[k], at_save[k]) for k in at_save),
               "loaded == the state at the save call")
    topo.free()
    topo2.free()


def test_an_error_on_one_rank_is_raised_on_every_rank(root):
    cfg, topo, engine, dp = build()
    background = BackgroundWriter(topo.ckpt_comm)
    last = WORLD.Get_size() - 1

    def disk_full(kind, path):
        if kind == "dataset" and WORLD.Get_rank() == last:
            raise OSError(28, "No space left on device")

    save_training(cfg, topo, engine, dp, step=1, loader_state=None, root=root,
                  background=background, on_event=disk_full)
    try:
        background.wait()
        message = ""
    except CheckpointError as err:
        message = str(err)
    assert_all(WORLD, f"on rank(s) [{last}]" in message and "No space left" in message,
               "every rank raises the error of the failing rank")
    topo.free()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_non_finite_piece_on_one_rank_is_refused_on_every_rank(root, mode):
    """ZeRO 1: each rank writes the optimizer slices it owns, and checks them; a nan in
    the last rank's is NonFiniteState on every rank, naming it, and nothing is left."""
    cfg, topo, engine, dp = build()
    last = WORLD.Get_size() - 1
    background = BackgroundWriter(topo.ckpt_comm) if mode == "async" else None
    save_training(cfg, topo, engine, dp, step=1, loader_state=None, root=root,
                  background=background)
    if background is not None:
        background.wait()
    mine = [h for h in held_tensors(engine, dp, topo.tp_rank, topo.tp_size)
            if h.name.startswith("optim/m/") and h.array.size]
    if WORLD.Get_rank() == last:
        mine[-1].array[-1] = np.nan
    message = ""
    try:
        save_training(cfg, topo, engine, dp, step=2, loader_state=None, root=root,
                      background=background)
        if background is not None:
            background.wait()
    except NonFiniteState as err:
        message = str(err)
    where = "" if WORLD.Get_size() == 1 else f" on rank {last}"
    name = mine[-1].name if WORLD.Get_rank() == last else None
    name = WORLD.bcast(name, root=last)
    assert_all(WORLD, message == f"the state after step 2 is not finite: {name}{where} holds "
                                 f"nan or inf; no checkpoint written", "every rank refuses")
    WORLD.Barrier()
    left = sorted(p.name for p in root.iterdir())
    assert_all(WORLD, left == ["latest", "step-000001"], f"only step 1 is left: {left}")
    topo.free()
