"""Activation recomputation under MPI: at pp = 2 (GPipe, 1F1B, interleaved) and tp = 2
(with and without sequence parallelism), with data parallelism over the other ranks
and its overlapped all-reduce, full, selective and attention recomputation give the gradients,
and the loss curve, of the same layout without recomputation, bit for bit."""

from dataclasses import replace

import numpy as np
import pytest

from hpctrain.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.topology import Topology
from hpctrain.testing import assert_all, copy_task_batches, train_losses

ROWS, V, T = 4, 32, 8  # ROWS: sequences per data-parallel rank and step
MODEL = ModelConfig(dtype="float64", vocab_size=V, seq_len=T, n_layer=4, n_head=2,
                    d_model=16)
MODES = [("full", ()), ("selective", ()), ("attention", ()),
         ("full", ("first", "middle.0", "last"))]


def layouts(n):
    """(name, [parallel]) for this world size: pp = 2 and tp = 2 where 2 divides it."""
    if n % 2:
        return [("dp", dict(dp=n, microbatches=2))]
    d = n // 2
    return [("pp2-gpipe", dict(dp=d, pp=2, microbatches=2, schedule="gpipe")),
            ("pp2-1f1b", dict(dp=d, pp=2, microbatches=4, schedule="1f1b")),
            ("pp2-interleaved", dict(dp=d, pp=2, microbatches=2, schedule="interleaved",
                                     virtual_stages=2)),
            ("tp2", dict(dp=d, tp=2)),
            ("tp2-sp", dict(dp=d, tp=2, sequence_parallel=True)),
            ("dp", dict(dp=n, microbatches=2))]


def config(n, parallel, mode="none", pieces=(), dtype="float64", tie=False):
    dp = parallel["dp"]
    return Config(model=replace(MODEL, dtype=dtype, tie_embeddings=tie),
                  parallel=ParallelConfig(**parallel),
                  train=TrainConfig(batch_size=dp * ROWS, lr=1e-2, warmup_steps=1,
                                    recompute=mode, recompute_pieces=pieces)).validate(n)


def batches(dp, steps=3, seed=0):
    return copy_task_batches(dp * ROWS, T, V, steps, seed)


def gradients(comm, cfg):
    """This rank's gradients after one forward_backward of the engine (no dp sum)."""
    topo = Topology.build(comm, cfg.parallel)
    engine = build_engine(cfg, topo)
    (x, y), = batches(cfg.parallel.dp, steps=1)
    rows = slice(topo.dp_rank * ROWS, (topo.dp_rank + 1) * ROWS)
    engine.zero_grad()
    loss = engine.forward_backward(x[rows], y[rows])
    out = [(n, p.grad.copy()) for n, p in engine.named_params]
    topo.free()
    return loss, out


def same_bits(a, b) -> bool:
    (la, ga), (lb, gb) = a, b
    return la == lb and [n for n, _ in ga] == [n for n, _ in gb] and all(
        u.dtype == v.dtype and np.array_equal(u, v) for (_, u), (_, v) in zip(ga, gb,
                                                                              strict=True))


@pytest.mark.mpi
@pytest.mark.timeout(240)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_gradients_are_bitwise_at_every_layout(comm, dtype):
    n = comm.Get_size()
    for name, parallel in layouts(n):
        tie = name.endswith("1f1b")  # the tied table's gradient crosses the stages
        plain = gradients(comm, config(n, parallel, dtype=dtype, tie=tie))
        assert_all(comm, any(g.any() for _, g in plain[1]), f"{name}: no gradients")
        for mode, pieces in MODES:
            again = gradients(comm, config(n, parallel, mode, pieces, dtype, tie))
            assert_all(comm, same_bits(plain, again),
                       f"{name} {dtype}: recompute {mode} {list(pieces)} changed the "
                       f"gradients")


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_training_with_the_overlapped_all_reduce_is_bitwise(comm):
    """Three optimizer steps through the data-parallel wrapper (its buckets start from
    the engine's hook during the recomputed backward): the same losses, exactly."""
    n = comm.Get_size()
    for name, parallel in layouts(n)[1::2] if n % 2 == 0 else layouts(n):
        ref = train_losses(config(n, parallel), comm, batches(parallel["dp"]))
        for mode, pieces in MODES[:2]:
            got = train_losses(config(n, parallel, mode, pieces), comm,
                               batches(parallel["dp"]))
            assert_all(comm, got == ref, f"{name}: losses with recompute {mode} {got} "
                                         f"differ from {ref}")
