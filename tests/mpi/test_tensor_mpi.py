"""Tensor and sequence parallelism equal the serial model, at any world size.

The tensor size is the largest of 1, 2, 4, 8 dividing both the world size and the
heads; any remaining ranks are data-parallel replicas. Every rank also builds the
serial model from the same seed and compares against it, and every assertion is
collective.
"""

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.models.build import build_model
from hpctrain.nn import cross_entropy, cross_entropy_backward
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.shards import join_shards
from hpctrain.parallel.tensor import apply_tensor_parallel
from hpctrain.parallel.tensor_gpt import (
    sequence_parallel_saving,
    tp_comm_bytes,
    vocab_parallel_cross_entropy,
    vocab_parallel_cross_entropy_backward,
)
from hpctrain.parallel.topology import Topology
from hpctrain.testing import assert_all, assert_close_all, train_losses
from hpctrain.train import make_data_parallel, train_step

N_HEAD = 8
BATCH = 8  # global, in sequences
TOL = {"float64": dict(logits=1e-10, grads=1e-9, curve=1e-8),
       "float32": dict(logits=1e-4, grads=1e-4, curve=1e-4)}


def largest_tp(size: int) -> int:
    return max(t for t in (1, 2, 4, 8) if size % t == 0 and N_HEAD % t == 0)


def make_cfg(size, *, tp, sp=False, dtype="float64", tied=False, microbatches=2, steps=20):
    model = ModelConfig(dtype=dtype, vocab_size=64, seq_len=8, n_layer=2, n_head=N_HEAD,
                        d_model=32, tie_embeddings=tied)
    return Config(model=model,
                  parallel=ParallelConfig(tp=tp, microbatches=microbatches,
                                          sequence_parallel=sp),
                  train=TrainConfig(steps=steps, batch_size=BATCH, lr=3e-3, min_lr=3e-4,
                                    warmup_steps=3, grad_clip=0.3, seed=7)).validate(size)


def batches(cfg, n, seed=0):
    """n global batches of a learnable task: the next token is the current one plus 1."""
    rng = np.random.default_rng(seed)
    xs = [rng.integers(0, cfg.model.vocab_size, (BATCH, cfg.model.seq_len)) for _ in range(n)]
    return [(x, (x + 1) % cfg.model.vocab_size) for x in xs]


def sharded(cfg, comm):
    topo = Topology.build(comm, cfg.parallel)
    model = apply_tensor_parallel(build_model(cfg.model, cfg.train.seed), cfg, topo.tp_comm)
    return topo, model


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_logits_loss_and_gradients_equal_serial(comm, sp, tied, dtype):
    size = comm.Get_size()
    cfg = make_cfg(size, tp=largest_tp(size), sp=sp, dtype=dtype, tied=tied)
    topo, model = sharded(cfg, comm)
    serial = build_model(cfg.model, cfg.train.seed)
    x, y = batches(cfg, 1)[0]
    tol = TOL[dtype]

    assert_close_all(comm, model.logits(x), serial.logits(x), rtol=tol["logits"],
                     atol=tol["logits"], what="logits")
    loss, cache = model.forward(x, y)
    model.backward(cache, dloss=1.0)
    serial_loss, serial_cache = serial.forward(x, y)
    serial.backward(serial_cache, dloss=1.0)
    assert_close_all(comm, loss, serial_loss, rtol=tol["logits"], what="loss")
    assert_all(comm, len(set(topo.tp_comm.allgather(loss))) == 1, "one loss in the tp group")

    # every gathered gradient, relative to its parameter's largest serial entry
    reference = dict(serial.named_parameters())
    actual, expected, replicated_same = [], [], True
    for name, p in model.named_parameters():
        shards = topo.tp_comm.allgather(p.grad)
        full = join_shards(shards, p.tp_split, p.tp_blocks)
        want = reference[name].grad
        scale = float(np.abs(want).max()) or 1.0
        actual.append((full / scale).reshape(-1) if full.shape == want.shape else np.inf)
        expected.append(want.reshape(-1) / scale)
        if p.tp_split is None:
            replicated_same &= all(np.array_equal(s, shards[0]) for s in shards)
    assert_close_all(comm, np.hstack(actual), np.hstack(expected), rtol=tol["grads"],
                     atol=tol["grads"], what="gathered gradients")
    assert_all(comm, replicated_same, "replicated gradients identical over the tp group")
    topo.free()


@pytest.mark.mpi
@pytest.mark.parametrize("layout, dtype", [("tp", "float64"), ("tp", "float32"),
                                           ("tp2-dp", "float64")])  # dp x tp: float64 only
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_twenty_steps_follow_the_serial_loss_curve(comm, sp, dtype, layout):
    size = comm.Get_size()
    tp = largest_tp(size) if layout == "tp" else min(2, largest_tp(size))
    cfg = make_cfg(size, tp=tp, sp=sp, dtype=dtype)
    data = batches(cfg, 4)  # cycled over the steps
    serial = train_losses(make_cfg(1, tp=1, dtype=dtype), MPI.COMM_SELF, data)
    parallel = train_losses(cfg, comm, data)
    assert_close_all(comm, parallel, serial, rtol=TOL[dtype]["curve"], what="loss curve")
    assert_all(comm, serial[-1] < serial[0], "the serial curve goes down")


@pytest.mark.mpi
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_communication_volume_matches_the_formula(comm, sp):
    size = comm.Get_size()
    cfg = make_cfg(size, tp=largest_tp(size), sp=sp)
    topo = Topology.build(comm, cfg.parallel)
    engine = build_engine(cfg, topo)
    x, y = batches(cfg, 1)[0]
    b = BATCH // topo.dp_size
    rows = slice(topo.dp_rank * b, (topo.dp_rank + 1) * b)
    train_step(engine, make_data_parallel(cfg, engine, topo), x[rows], y[rows], lr=1e-3,
               grad_clip=1.0)
    measured = engine.metrics().get("tp_comm_bytes", 0.0)
    expected = tp_comm_bytes(cfg.model, b, cfg.parallel.microbatches,
                             topo.tp_size, sp)
    assert_close_all(comm, measured, expected, rtol=1e-12, what="tp_comm_bytes")
    topo.free()


@pytest.mark.mpi
def test_sequence_parallelism_saves_the_layernorm_activations(comm):
    size = comm.Get_size()
    tp = largest_tp(size)
    measured = {}
    for sp in (False, True):
        cfg = make_cfg(size, tp=tp, sp=sp, microbatches=1)
        topo = Topology.build(comm, cfg.parallel)
        engine = build_engine(cfg, topo)
        x, y = batches(cfg, 1)[0]
        b = BATCH // topo.dp_size
        engine.forward_backward(x[:b], y[:b])
        measured[sp] = engine.metrics()
        topo.free()
    if tp == 1:
        return  # the local engine: nothing to compare
    saved = measured[False]["activation_bytes"] - measured[True]["activation_bytes"]
    expected = sequence_parallel_saving(cfg.model, BATCH // (size // tp), cfg.model.seq_len, tp)
    assert_all(comm, saved == expected == measured[True]["sp_activation_bytes_saved"],
               f"saved activation bytes {saved} vs formula {expected}")


@pytest.mark.mpi
def test_vocab_parallel_cross_entropy_equals_serial_on_large_logits(comm):
    size = comm.Get_size()
    rng = np.random.default_rng(3)
    n, v = 12, 16 * size
    logits = 300.0 * rng.standard_normal((n, v))  # exp would overflow without the max
    targets = rng.integers(0, v, n)
    loss, cache = cross_entropy(logits.copy(), targets)
    dlogits = cross_entropy_backward(0.5, cache)
    local = slice(comm.Get_rank() * 16, (comm.Get_rank() + 1) * 16)
    ploss, pcache = vocab_parallel_cross_entropy(logits[:, local].copy(), targets,
                                                 local.start, comm)
    pdlogits = vocab_parallel_cross_entropy_backward(0.5, pcache)
    assert_close_all(comm, ploss, loss, rtol=1e-12, what="loss")
    assert_close_all(comm, pdlogits, dlogits[:, local], rtol=1e-12, atol=1e-15,
                     what="dlogits")
