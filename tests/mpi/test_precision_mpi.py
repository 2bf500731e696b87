"""Reduced precision under MPI: the bfloat16 gradient sum (``parallel/bf16_reduce.py``)
gives every rank the same bits, close to the float32 all-reduce, for half the bytes;
bf16 storage trains at dp, pp = 2 and tp = 2 along the serial bf16 loss curve."""

from dataclasses import replace

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.topology import Topology
from hpctrain.testing import assert_all, assert_close_all, copy_task_batches, train_losses
from hpctrain.train import make_data_parallel

ROWS, V, T = 4, 32, 8  # ROWS: sequences per data-parallel rank and step
MODEL = ModelConfig(vocab_size=V, seq_len=T, n_layer=2, n_head=2, d_model=16)


def config(n, parallel, precision="fp32", grad_comm="fp32"):
    parallel = {"dp": n, **parallel}
    return Config(model=MODEL,
                  parallel=ParallelConfig(**parallel, grad_comm_dtype=grad_comm,
                                          bucket_mb=0.002),  # several buckets in flight
                  train=TrainConfig(batch_size=parallel["dp"] * ROWS, lr=1e-2,
                                    warmup_steps=1, precision=precision)).validate(n)


def batches(dp, steps=4, seed=0):
    return copy_task_batches(dp * ROWS, T, V, steps, seed)


def summed(comm, cfg):
    """Every gradient after one step's data-parallel sum, and the step's dp_bytes."""
    topo = Topology.build(comm, cfg.parallel)
    engine = build_engine(cfg, topo)
    dp = make_data_parallel(cfg, engine, topo)
    (x, y), = batches(topo.dp_size, steps=1, seed=topo.dp_rank)
    dp.zero_grad()
    engine.forward_backward(x[:ROWS], y[:ROWS], scale=1.0 / topo.dp_size)
    dp.finish_grads()
    grads = {name: p.grad.copy() for name, p in engine.named_params}
    sent = dp.metrics()["dp_bytes"]
    if hasattr(dp.grads.launch, "free"):
        dp.grads.launch.free()
    topo.free()
    return grads, sent


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_bf16_gradient_sum_is_the_same_everywhere_close_to_fp32_and_half_the_bytes(comm):
    n = comm.Get_size()
    exact, sent32 = summed(comm, config(n, {}))
    low, sent16 = summed(comm, config(n, {}, grad_comm="bf16"))
    assert_all(comm, exact.keys() == low.keys(), "parameter names")
    flat = np.concatenate([g.ravel() for g in low.values()])
    first = comm.bcast(flat, root=0)
    assert_all(comm, np.array_equal(flat, first), "the same summed bits on every rank")
    for name, g in exact.items():  # bf16 has 8 significant bits: within 2^-8 relative
        err = np.linalg.norm(low[name] - g) / max(np.linalg.norm(g), 1e-30)
        assert_all(comm, err < 1e-2, f"{name}: bf16 sum within 1% of fp32 ({err:.2e})")
    assert_close_all(comm, sent16, 0.5 * sent32, rtol=1e-12, what="dp_bytes halved")
    assert_all(comm, (sent32 > 0) == (n > 1), "dp_bytes counted")


def layouts(n):
    """(name, [parallel], grad_comm) for this world size: pp = 2 and tp = 2 where 2
    divides it, and plain data parallelism with the bf16 gradient sum."""
    out = [("dp-bf16-comm", {"dp": n, "microbatches": 2}, "bf16")]
    if n % 2 == 0:
        d = n // 2
        out += [("pp2-1f1b", {"dp": d, "pp": 2, "microbatches": 2}, "bf16"),
                ("tp2", {"dp": d, "tp": 2}, "fp32"),
                ("zero1", {"dp": n, "zero": 1}, "fp32")]
    return out


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_bf16_trains_along_the_serial_bf16_curve_at_every_layout(comm):
    n = comm.Get_size()
    for name, parallel, grad_comm in layouts(n):
        cfg = config(n, parallel, "bf16", grad_comm)
        dp = cfg.parallel.dp
        data = batches(dp)
        serial_cfg = replace(cfg, parallel=ParallelConfig(dp=1)).validate(1)
        serial = train_losses(serial_cfg, MPI.COMM_SELF, data)
        fp32 = train_losses(replace(serial_cfg, train=replace(serial_cfg.train,
                                                              precision="fp32")),
                            MPI.COMM_SELF, data)
        losses = train_losses(cfg, comm, data)
        # the same storage rounding, summed in another order: within bf16's rounding
        assert_close_all(comm, losses, serial, rtol=0, atol=2e-2, what=f"{name} vs serial")
        assert_close_all(comm, losses, fp32, rtol=0, atol=5e-2, what=f"{name} vs fp32")
