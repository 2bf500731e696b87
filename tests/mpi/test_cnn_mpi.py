"""The CNN at dp = the world size trains as one serial rank does, in float64: its
BatchNorm statistics are summed over the data group (``Model.share_batch``), so the
losses, the weights and the running statistics are the serial ones, and evaluation
(running statistics, no collective) gives the serial loss and accuracy. Without the
shared statistics (per-rank BatchNorm) the curve departs from the serial one."""

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.models.cnn import CNNClassifier
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.topology import Topology
from hpctrain.testing import assert_all, assert_close_all
from hpctrain.train import evaluate, make_data_parallel, train_step

CNN_TINY = ModelConfig(kind="cnn", input_dim=36, channels=(2, 3), n_classes=4,
                       dtype="float64")


def config(size, batch, zero=0):
    # one microbatch: BatchNorm's statistics are those of each microbatch
    return Config(model=CNN_TINY, parallel=ParallelConfig(microbatches=1, zero=zero),
                  train=TrainConfig(batch_size=batch, lr=1e-2, warmup_steps=1,
                                    grad_clip=1.0)).validate(size)


def batches(batch, steps=4):
    r = np.random.default_rng(7)
    return [(r.random((batch, 36)), r.integers(0, 4, batch)) for _ in range(steps)]


def run(cfg, comm, data):
    """Losses of each step, then the parameters, running statistics and evaluation of
    the global batch data[0] (each rank its slice)."""
    topo = Topology.build(comm, cfg.parallel)
    engine = build_engine(cfg, topo)
    dp = make_data_parallel(cfg, engine, topo)
    b = cfg.train.batch_size // topo.dp_size
    rows = slice(topo.dp_rank * b, (topo.dp_rank + 1) * b)
    losses = [train_step(engine, dp, x[rows], y[rows], lr=1e-2, grad_clip=1.0)[0]
              for x, y in data]
    params = np.concatenate([p.data.ravel() for p in engine.params])
    stats = np.concatenate([np.concatenate([layer.bn.running_mean, layer.bn.running_var])
                            for layer in engine.model.layers])
    x, y = data[0]
    val_loss, figures = evaluate(cfg, engine, [(x[rows], y[rows])], topo.dp_comm)
    topo.free()
    return losses, params, stats, [val_loss, figures["accuracy"]]


@pytest.mark.mpi
@pytest.mark.parametrize("zero", [0, 1])
def test_the_cnn_at_dp_world_size_is_the_serial_run(comm, zero):
    size = comm.Get_size()
    batch = 4 * size
    data = batches(batch)
    serial = run(config(1, batch), MPI.COMM_SELF, data)
    parallel = run(config(size, batch, zero), comm, data)
    for what, got, want in zip(["losses", "parameters", "running statistics", "evaluation"],
                               parallel, serial, strict=True):
        assert_close_all(comm, got, want, rtol=1e-10, atol=1e-12,
                         what=f"CNN {what} at dp={size}, zero {zero}")


@pytest.mark.mpi
def test_per_rank_batchnorm_departs_from_the_serial_curve(comm, monkeypatch):
    size = comm.Get_size()
    if size == 1:
        pytest.skip("one rank: its batch is the global batch")
    monkeypatch.setattr(CNNClassifier, "share_batch", lambda self, reduce: None)
    batch = 4 * size
    data = batches(batch)
    serial = run(config(1, batch), MPI.COMM_SELF, data)[0]
    per_rank = run(config(size, batch), comm, data)[0]
    assert_all(comm, not np.allclose(per_rank, serial, rtol=1e-6),
               f"per-rank BatchNorm at dp={size} should differ from serial")
