"""Every (dp, tp, pp) layout of the world reproduces the serial loss curve.

For the world size N this suite runs at (2, 4 and 8 in ``make test``), every
factorisation N = dp * tp * pp the tiny GPT allows (tp divides its 4 heads, pp is at
most its 4 layers), with the 1F1B schedule and, where valid (pp > 1, two layers per
rank), the interleaved one with two chunks per rank, each with ZeRO stage 0 to 3,
trains 10 steps in float64 and must give the loss of every step of the serial run
to 1e-8 relative. Clipping is engaged in the first steps (norm above ``grad_clip``)
and weight decay is on, so the global norm and the decay masks are checked too.
The tied-embedding GPT (its token table on the first and the last stage) runs at
ZeRO 2 and 3; ZeRO 3 also with its gathered parameters kept from forward to backward
(``reshard_after_forward = False``). Some layouts run twice and must agree bitwise.
"""

import itertools
from dataclasses import replace

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.testing import assert_all, assert_close_all, train_losses

SIZE = MPI.COMM_WORLD.Get_size()
MODEL = ModelConfig(n_layer=4, d_model=16, n_head=4, seq_len=8, vocab_size=32,
                    dtype="float64", init_std=0.3)
TRAIN = TrainConfig(batch_size=16, lr=1e-2, warmup_steps=2, weight_decay=0.1,
                    grad_clip=1.0, steps=10)
STEPS = 10
RTOL = 1e-8


def layouts(n: int) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) with dp * tp * pp = n that the tiny model allows."""
    return [(dp, tp, n // (dp * tp)) for dp, tp in itertools.product(range(1, n + 1), repeat=2)
            if n % (dp * tp) == 0 and MODEL.n_head % tp == 0 and n // (dp * tp) <= MODEL.n_layer]


def runs(n: int) -> list[tuple[int, int, int, str, int]]:
    """(dp, tp, pp, schedule, virtual stages) for every layout and valid schedule."""
    out = []
    for dp, tp, pp in layouts(n):
        out.append((dp, tp, pp, "1f1b", 1))
        if pp > 1 and 2 * pp <= MODEL.n_layer:
            out.append((dp, tp, pp, "interleaved", 2))
    return out


def parallel(dp, tp, pp, schedule, v, zero, reshard=True) -> ParallelConfig:
    m = 2 * pp if TRAIN.batch_size % (dp * 2 * pp) == 0 else pp  # > pp: a steady 1F1B phase
    return ParallelConfig(dp=dp, tp=tp, pp=pp, schedule=schedule, virtual_stages=v,
                          microbatches=max(m, 2), zero=zero, bucket_mb=0.002,
                          reshard_after_forward=reshard)


def run_id(run, zero):
    dp, tp, pp, schedule, _ = run
    return f"dp{dp}-tp{tp}-pp{pp}-{schedule}-zero{zero}"


def richest(candidates):
    """The run using the most kinds of parallelism (ties: the first)."""
    return max(candidates, key=lambda r: (r[0] > 1) + (r[1] > 1) + (r[2] > 1) + (r[4] > 1))


MATRIX = [(run, zero) for run in runs(SIZE) for zero in (0, 1, 2, 3)]
TWICE = [(richest(runs(SIZE)), zero) for zero in (0, 2, 3)]


@pytest.fixture(scope="module")
def batches():
    r = np.random.default_rng(0)
    shape = (TRAIN.batch_size, MODEL.seq_len)
    return [(r.integers(0, MODEL.vocab_size, shape), r.integers(0, MODEL.vocab_size, shape))
            for _ in range(STEPS)]


@pytest.fixture(scope="module")
def serial(batches):
    """The serial loss curves, untied and tied, computed on every rank alone."""
    return {tie: train_losses(Config(model=replace(MODEL, tie_embeddings=tie),
                                     train=TRAIN).validate(1), MPI.COMM_SELF, batches)
            for tie in (False, True)}


def losses(comm, batches, run, zero, tie=False, reshard=True):
    model = replace(MODEL, tie_embeddings=tie)
    cfg = Config(model=model, parallel=parallel(*run, zero, reshard), train=TRAIN)
    return train_losses(cfg.validate(comm.Get_size()), comm, batches)


@pytest.mark.mpi
@pytest.mark.parametrize("run, zero", MATRIX, ids=[run_id(r, z) for r, z in MATRIX])
def test_every_layout_reproduces_the_serial_loss_curve(comm, batches, serial, run, zero):
    assert_close_all(comm, losses(comm, batches, run, zero), serial[False], rtol=RTOL,
                     what=f"losses at {run_id(run, zero)}")


@pytest.mark.mpi
@pytest.mark.parametrize("run", runs(SIZE), ids=[run_id(r, 2) for r in runs(SIZE)])
def test_tied_embeddings_reproduce_the_serial_curve_at_zero_2(comm, batches, serial, run):
    assert_close_all(comm, losses(comm, batches, run, 2, tie=True), serial[True], rtol=RTOL,
                     what=f"tied losses at {run_id(run, 2)}")


@pytest.mark.mpi
@pytest.mark.parametrize("run", runs(SIZE), ids=[run_id(r, 3) for r in runs(SIZE)])
def test_tied_embeddings_reproduce_the_serial_curve_at_zero_3(comm, batches, serial, run):
    assert_close_all(comm, losses(comm, batches, run, 3, tie=True), serial[True], rtol=RTOL,
                     what=f"tied losses at {run_id(run, 3)}")


@pytest.mark.mpi
@pytest.mark.parametrize("run", runs(SIZE), ids=[run_id(r, 3) for r in runs(SIZE)])
def test_zero_3_keeping_the_gathered_pieces_reproduces_the_serial_curve(comm, batches, serial,
                                                                         run):
    assert_close_all(comm, losses(comm, batches, run, 3, tie=True, reshard=False),
                     serial[True], rtol=RTOL,
                     what=f"tied losses at {run_id(run, 3)}, reshard_after_forward False")


@pytest.mark.mpi
def test_clipping_is_engaged_in_the_first_step(comm, batches):
    from hpctrain.parallel.engine import build_engine
    from hpctrain.parallel.topology import Topology
    from hpctrain.train import make_data_parallel, train_step

    cfg = Config(model=MODEL, train=TRAIN).validate(1)
    topo = Topology.build(MPI.COMM_SELF, cfg.parallel)
    engine = build_engine(cfg, topo)
    dp = make_data_parallel(cfg, engine, topo)
    _, norm = train_step(engine, dp, *batches[0], lr=TRAIN.lr, grad_clip=TRAIN.grad_clip)
    assert_all(comm, norm > TRAIN.grad_clip, f"serial norm {norm} above {TRAIN.grad_clip}")


@pytest.mark.mpi
@pytest.mark.parametrize("run, zero", TWICE, ids=[run_id(r, z) for r, z in TWICE])
def test_the_same_layout_twice_is_bitwise_identical(comm, batches, run, zero):
    first, second = (losses(comm, batches, run, zero) for _ in range(2))
    assert_all(comm, first == second, f"two runs at {run_id(run, zero)}: {first} vs {second}")
