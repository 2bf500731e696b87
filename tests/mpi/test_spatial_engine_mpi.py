"""Whole models split in space (``sp``), alone and with data parallelism, train as one
serial rank does, in float64: the CNN classifier (rows of each image split, gathered
before the head) and the 3-D U-Net (depth split, a per-voxel loss), with BatchNorm's
statistics summed over the data and spatial groups. Losses, weights, running
statistics and evaluation (loss and the model's figures) equal the serial ones at
every (dp, sp) the world size allows; and a checkpoint of the weights is the same
set of names at any sp."""

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.models.seg3d.model import IGNORE
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.topology import Topology
from hpctrain.testing import assert_close_all
from hpctrain.train import evaluate, make_data_parallel, train_step

CNN = ModelConfig(kind="cnn", input_dim=64, image_pad=4, channels=(2, 3), n_classes=4,
                  dtype="float64")  # 8 x 8 images padded to 16 x 16: 16 -> 8 -> 4 rows
SEG = ModelConfig(kind="seg3d", channels=(2, 3), n_classes=3, crop=(8, 4, 4),
                  dtype="float64")


def batches(m: ModelConfig, batch: int, steps: int = 3):
    r = np.random.default_rng(7)
    out = []
    for _ in range(steps):
        if m.kind == "cnn":
            out.append((r.random((batch, m.input_dim)), r.integers(0, m.n_classes, batch)))
        else:
            y = r.integers(0, m.n_classes, (batch, *m.crop))
            # a tile's padding, counted nowhere: the last 3 of 8 depth rows, so the
            # spatial ranks' slabs hold unequal valid counts. Each sample holds as many
            # (the loss is a mean per data-parallel rank, as with any mean loss)
            y[:, -3:] = IGNORE
            out.append((r.random((batch, 1, *m.crop)), y))
    return out


def config(m: ModelConfig, size: int, sp: int, batch: int, zero: int = 0) -> Config:
    return Config(model=m, parallel=ParallelConfig(sp=sp, zero=zero),
                  train=TrainConfig(batch_size=batch, lr=1e-2, warmup_steps=1,
                                    grad_clip=1.0)).validate(size)


def run(cfg: Config, comm, data):
    """Losses of each step, the parameters, the buffers and the evaluation of data[0]."""
    topo = Topology.build(comm, cfg.parallel)
    engine = build_engine(cfg, topo)
    assert (type(engine).__name__ == "SpatialEngine") == (cfg.parallel.sp > 1)
    dp = make_data_parallel(cfg, engine, topo)
    b = cfg.train.batch_size // topo.dp_size
    rows = slice(topo.dp_rank * b, (topo.dp_rank + 1) * b)
    losses = [train_step(engine, dp, x[rows], y[rows], lr=1e-2, grad_clip=1.0)[0]
              for x, y in data]
    params = np.concatenate([p.data.ravel() for p in engine.params])
    buffers = np.concatenate([a.ravel() for _, a in engine.named_buffers])
    x, y = data[0]
    val_loss, figures = evaluate(cfg, engine, [(x[rows], y[rows])], topo.dp_comm)
    names = [n for n, _ in engine.named_params]
    topo.free()
    return losses, params, buffers, [val_loss, *figures.values()], names


def layouts(size: int) -> list[int]:
    return [sp for sp in (2, 4) if size % sp == 0]


@pytest.mark.mpi
@pytest.mark.parametrize("model", [CNN, SEG], ids=["cnn", "seg3d"])
def test_spatial_and_data_parallel_equal_serial(comm, model):
    size = comm.Get_size()
    if not layouts(size):
        pytest.skip(f"{size} rank(s): no spatial size 2 or 4 divides it")
    for sp in layouts(size):
        batch = 2 * (size // sp)
        data = batches(model, batch)
        serial = run(config(model, 1, 1, batch), MPI.COMM_SELF, data)
        for zero in (0, 1) if size // sp > 1 else (0,):
            got = run(config(model, size, sp, batch, zero), comm, data)
            where = f"{model.kind} at dp={size // sp} sp={sp} zero={zero}"
            for what, a, b in zip(["losses", "parameters", "buffers", "evaluation"],
                                  got[:4], serial[:4], strict=True):
                assert_close_all(comm, a, b, rtol=1e-10, atol=1e-12, what=f"{what}, {where}")
            assert got[4] == serial[4], f"parameter names differ at {where}"


@pytest.mark.mpi
def test_a_checkpoint_saved_split_in_space_loads_whole(comm):
    """Saved at sp = 2 (every rank holds whole weights), loaded on one rank: the same
    weights, BatchNorm buffers and AdamW state, bitwise."""
    import shutil
    import tempfile
    from pathlib import Path

    from hpctrain.checkpoint import load_training, save_training
    from hpctrain.checkpoint.state import held_tensors

    size = comm.Get_size()
    if size % 2:
        pytest.skip("needs an even world")
    root = Path(comm.bcast(tempfile.mkdtemp(prefix="hpctrain-sp-") if comm.Get_rank() == 0
                           else None))
    batch = size  # dp = size / 2: two samples per data-parallel rank
    data = batches(SEG, batch)
    cfg = config(SEG, size, 2, batch)
    topo = Topology.build(comm, cfg.parallel)
    engine = build_engine(cfg, topo)
    dp = make_data_parallel(cfg, engine, topo)
    b = batch // topo.dp_size
    rows = slice(topo.dp_rank * b, (topo.dp_rank + 1) * b)
    for x, y in data:
        train_step(engine, dp, x[rows], y[rows], lr=1e-2, grad_clip=1.0)
    path = save_training(cfg, topo, engine, dp, step=len(data), loader_state=None, root=root)
    saved = {h.name: h.array.copy() for h in held_tensors(engine, dp, 0, 1)}
    topo.free()
    ok = True
    if comm.Get_rank() == 0:
        serial = config(SEG, 1, 1, batch)
        solo = Topology.build(MPI.COMM_SELF, serial.parallel)
        e1 = build_engine(serial, solo)
        d1 = make_data_parallel(serial, e1, solo)
        load_training(path, serial, solo, e1, d1, root=root / "elsewhere")
        loaded = {h.name: h.array for h in held_tensors(e1, d1, 0, 1)}
        ok = saved.keys() == loaded.keys() and all(np.array_equal(saved[k], loaded[k])
                                                   for k in saved)
        solo.free()
        shutil.rmtree(root, ignore_errors=True)
    from hpctrain.testing import assert_all

    assert_all(comm, ok, "weights saved at sp=2 load bitwise on one rank")
