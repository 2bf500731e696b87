"""Data parallelism with each rank's batch split over threads (``batch_threads``):
the overlapped bucketed sum and ZeRO 1/2 send each piece only once every thread has
added its gradients, so the loss curve is the serial one, at any world size."""

from dataclasses import replace

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.parallel.batch_threads import BatchThreadsEngine
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.topology import Topology
from hpctrain.testing import assert_all, assert_close_all, train_losses

GPT = ModelConfig(n_layer=2, d_model=16, n_head=2, seq_len=8, vocab_size=32,
                  dtype="float64", init_std=0.3, tie_embeddings=True)
TRAIN = TrainConfig(lr=1e-2, warmup_steps=2, grad_clip=1.0, weight_decay=0.1)
STEPS = 5


def config(world: int, *, threads: int, zero: int = 0, microbatches: int = 2) -> Config:
    # 3 rows a microbatch and rank: a split into unequal parts (2 + 1, or 1 + 1 + 1)
    return Config(model=GPT, parallel=ParallelConfig(zero=zero, bucket_mb=0.002,
                                                     microbatches=microbatches,
                                                     batch_threads=threads),
                  train=replace(TRAIN, batch_size=3 * microbatches * world)).validate(world)


def batches(cfg: Config) -> list:
    r = np.random.default_rng(0)
    shape = (cfg.train.batch_size, GPT.seq_len)
    return [(r.integers(0, GPT.vocab_size, shape), r.integers(0, GPT.vocab_size, shape))
            for _ in range(STEPS)]


@pytest.mark.mpi
@pytest.mark.parametrize("threads, zero, microbatches",
                         [(2, 0, 2), (3, 0, 1), (2, 1, 2), (2, 2, 1)])
def test_split_ranks_reproduce_the_serial_curve(comm, threads, zero, microbatches):
    world = comm.Get_size()
    cfg = config(world, threads=threads, zero=zero, microbatches=microbatches)
    topo = Topology.build(comm, cfg.parallel)
    engine = build_engine(cfg, topo)
    topo.free()
    assert_all(comm, isinstance(engine, BatchThreadsEngine) and engine.threads == threads,
               "the split engine built")
    data = batches(cfg)
    whole = replace(cfg, parallel=ParallelConfig(microbatches=microbatches * world))
    serial = train_losses(whole.validate(1), MPI.COMM_SELF, data)
    got = train_losses(cfg, comm, data)
    assert_close_all(comm, got, serial, rtol=1e-10,
                     what=f"losses, batch_threads {threads}, zero {zero}")
    assert_all(comm, serial[-1] < serial[0], "the serial run learns")
