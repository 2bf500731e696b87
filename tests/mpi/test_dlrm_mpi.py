"""The DLRM with its tables replicated over the data group (sparse gradients gathered
each step) follows the serial run in float64: losses, every table and every dense
weight, at any world size. Every rank also trains serially (COMM_SELF) for the
reference."""

import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/test_dlrm.py
from test_dlrm import batch, model_cfg  # noqa: E402

from hpctrain.config import Config, ParallelConfig, TrainConfig  # noqa: E402
from hpctrain.testing import assert_all, assert_close_all  # noqa: E402

BATCH = 32  # global: 4 samples a rank at 8 ranks


def config(size, sparse_optimizer, microbatches=1):
    return Config(model=model_cfg(),
                  parallel=ParallelConfig(microbatches=microbatches),
                  train=TrainConfig(steps=10, batch_size=BATCH, lr=1e-2, warmup_steps=1,
                                    grad_clip=0.5, sparse_lr=0.05,
                                    sparse_optimizer=sparse_optimizer)).validate(size)


def train(cfg, comm, batches):
    """Losses of every step and the final parameters (the loop of ``train_losses``)."""
    from hpctrain.optim import schedule
    from hpctrain.parallel.engine import build_engine
    from hpctrain.parallel.topology import Topology
    from hpctrain.train import make_data_parallel, train_step

    topo = Topology.build(comm, cfg.parallel)
    engine = build_engine(cfg, topo)
    dp = make_data_parallel(cfg, engine, topo)
    t, losses = cfg.train, []
    for step, (x, y) in enumerate(batches):
        b = len(x) // topo.dp_size
        rows = slice(topo.dp_rank * b, (topo.dp_rank + 1) * b)
        lr = schedule.lr_at(step, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps,
                            total_steps=len(batches))
        losses.append(train_step(engine, dp, x[rows], y[rows], lr=lr,
                                 grad_clip=t.grad_clip)[0])
    params = {name: p.data.copy() for name, p in engine.named_params}
    topo.free()
    return losses, params


@pytest.mark.mpi
@pytest.mark.parametrize("sparse_optimizer", ["rowwise_adagrad", "adam"])
@pytest.mark.parametrize("microbatches", [1, 2])
def test_replicated_tables_follow_the_serial_run(comm, sparse_optimizer, microbatches):
    size = comm.Get_size()
    batches = [batch(BATCH, seed=s) for s in range(10)]
    serial, serial_params = train(config(1, sparse_optimizer), MPI.COMM_SELF, batches)
    got, params = train(config(size, sparse_optimizer, microbatches), comm, batches)
    what = f"dlrm at dp={size}, {sparse_optimizer}, microbatches {microbatches}"
    assert_close_all(comm, np.array(got), np.array(serial), rtol=1e-10, atol=1e-12,
                     what=f"{what}: losses")
    for name in serial_params:
        assert_close_all(comm, params[name], serial_params[name], rtol=1e-10, atol=1e-12,
                         what=f"{what}: {name}")
    # the replicas hold bitwise the same tables
    first = comm.bcast(params, root=0)
    assert_all(comm, all(np.array_equal(first[n], params[n]) for n in params),
               f"{what}: replicas equal")
