"""Data parallelism and ZeRO at dp = the world size: the bucketed sum is exact for any
bucket size, hooks or none; ZeRO-1 holds 1/dp of the optimizer state with the losses
of plain data parallelism; measured memory is the formula; the norm is the serial one."""

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.nn import Parameter
from hpctrain.parallel.data import GradBuckets, allreduce_launcher
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.topology import Topology
from hpctrain.parallel.zero import expected_memory
from hpctrain.testing import assert_all, assert_close_all, train_losses
from hpctrain.train import make_data_parallel, train_step

GPT_TINY = ModelConfig(n_layer=2, d_model=16, n_head=2, seq_len=8, vocab_size=32,
                       dtype="float64", init_std=0.3)
MLP_TINY = ModelConfig(kind="mlp", input_dim=12, hidden=(8,), n_classes=3, dtype="float64")


def config(comm, model=GPT_TINY, *, zero=0, optimizer="adamw", bucket_mb=0.002,
           microbatches=2, batch=None):
    batch = batch or 2 * microbatches * comm.Get_size()
    return Config(model=model,
                  parallel=ParallelConfig(zero=zero, bucket_mb=bucket_mb,
                                          microbatches=microbatches),
                  train=TrainConfig(batch_size=batch, optimizer=optimizer, lr=1e-2,
                                    warmup_steps=2, grad_clip=1.0)).validate(comm.Get_size())


def gpt_batches(cfg, steps=5, seed=0):
    r, m = np.random.default_rng(seed), cfg.model
    shape = (cfg.train.batch_size, m.seq_len)
    return [(r.integers(0, m.vocab_size, shape), r.integers(0, m.vocab_size, shape))
            for _ in range(steps)]


@pytest.mark.mpi
@pytest.mark.parametrize("bucket_mb", [1e-5, 1e-4, 100.0])
@pytest.mark.parametrize("hooked, helper", [(False, False), (True, False), (True, True)])
def test_bucketed_sum_is_exact_for_any_bucket_size(comm, bucket_mb, hooked, helper):
    rank, size = comm.Get_rank(), comm.Get_size()
    params = [Parameter(np.zeros(n)) for n in (7, 30, 1, 64, 5)]
    grads = GradBuckets(params, allreduce_launcher(comm), bucket_mb=bucket_mb,
                        poll_interval=1e-4 if helper else 0.0)
    for step in range(2):  # twice: zero() must start the second step afresh
        grads.zero()
        for k, p in enumerate(params):  # integers: the sum is exact in any order
            p.grad += (rank + 1) * (k + 1) + np.arange(p.size) + step
        if hooked:  # backward order, as an engine reports
            for p in reversed(params[2:]):
                grads.mark_ready([p])
        grads.wait()
        ok = all(np.array_equal(p.grad, size * (size + 1) // 2 * (k + 1) +
                                size * (np.arange(p.size) + step))
                 for k, p in enumerate(params))
        assert_all(comm, ok, f"bucketed sum, bucket_mb {bucket_mb}, hooked {hooked}, "
                             f"helper thread {helper}")
        # every bucket counted once as reduced (overlap.py watches the count); none
        # launched on one rank
        want = len(grads.buckets) if size > 1 else 0
        assert_all(comm, grads.reduced == want, f"reduced {grads.reduced}, want {want}")


@pytest.mark.mpi
def test_the_gpt_launches_buckets_during_backward(comm):
    cfg = config(comm)
    topo = Topology.build(comm, cfg.parallel)
    engine = build_engine(cfg, topo)
    dp = make_data_parallel(cfg, engine, topo)
    dp.grads.poll_interval = 0.0  # the hooks launch: no helper thread to race with
    x, y = gpt_batches(cfg, steps=1)[0]
    b = len(x) // comm.Get_size()
    rows = slice(comm.Get_rank() * b, (comm.Get_rank() + 1) * b)
    train_step(engine, dp, x[rows], y[rows], lr=1e-3, grad_clip=1.0)
    early, total = dp.metrics()["dp_buckets_early"], len(dp.grads.buckets)
    # the embedding's report completes the last bucket: wait launches nothing
    assert_all(comm, total > 3 and early == total, f"{early} of {total} buckets early")
    topo.free()


@pytest.mark.mpi
def test_a_model_without_hooks_still_averages_correctly(comm):
    cfg = config(comm, MLP_TINY, bucket_mb=1e-4)
    r = np.random.default_rng(3)
    batches = [(r.random((cfg.train.batch_size, 12)), r.integers(0, 3, cfg.train.batch_size))
               for _ in range(4)]
    serial = config(MPI.COMM_SELF, MLP_TINY, batch=cfg.train.batch_size, microbatches=1)
    expected = train_losses(serial, MPI.COMM_SELF, batches)
    assert_close_all(comm, train_losses(cfg, comm, batches), expected, rtol=1e-10,
                     what="MLP losses at dp = world size")


def run_measuring(cfg, comm, batches):
    """Losses of train_losses' loop, plus the memory and the norms of the last step."""
    topo = Topology.build(comm, cfg.parallel)
    engine = build_engine(cfg, topo)
    dp = make_data_parallel(cfg, engine, topo)
    b = cfg.train.batch_size // topo.dp_size
    rows = slice(topo.dp_rank * b, (topo.dp_rank + 1) * b)
    losses, norms = [], []
    for x, y in batches:
        loss, norm = train_step(engine, dp, x[rows], y[rows], lr=1e-2, grad_clip=1.0)
        losses.append(loss)
        norms.append(norm)
    numel = sum(p.size for p in engine.params)
    padded = sum(dp.grads.sizes.values())
    states = len(type(dp.optimizer)._state_lists) if dp.optimizer is not None else 0
    topo.free()
    return losses, norms, dp.memory(), numel, padded, states


@pytest.mark.mpi
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_zero_1_holds_1_over_dp_of_the_optimizer_state_with_equal_losses(comm, optimizer):
    dp = comm.Get_size()
    runs = {}
    for zero in (0, 1, 2):
        cfg = config(comm, zero=zero, optimizer=optimizer)
        runs[zero] = run_measuring(cfg, comm, gpt_batches(cfg))
    losses0, norms0, mem0, numel, _, states = runs[0]
    for zero in (1, 2):
        losses, norms, mem, _, padded, _ = runs[zero]
        assert_close_all(comm, losses, losses0, rtol=1e-12, what=f"zero {zero} losses")
        assert_close_all(comm, norms, norms0, rtol=1e-12, what=f"zero {zero} norms")
        assert_all(comm, mem == expected_memory(numel, padded, dp, zero, states, 8),
                   f"zero {zero}: measured {mem} vs the formula")
        # 1/dp of plain data parallelism, up to the bucket padding (< dp per bucket)
        ratio = mem["optim_bytes"] * dp / mem0["optim_bytes"]
        assert_all(comm, 1.0 <= ratio <= padded / numel, f"zero {zero}: optimizer ratio "
                   f"{ratio:.4f} vs 1 (padding {padded} for {numel})")
    assert_all(comm, mem0 == expected_memory(numel, numel, dp, 0, states, 8),
               f"zero 0: measured {mem0}")


@pytest.mark.mpi
@pytest.mark.parametrize("zero", [0, 1, 2])
def test_the_clipped_norm_is_the_serial_norm(comm, zero):
    cfg = config(comm, zero=zero)
    batches = gpt_batches(cfg, steps=3)
    serial = config(MPI.COMM_SELF, batch=cfg.train.batch_size, microbatches=1)
    _, expected, *_ = run_measuring(serial, MPI.COMM_SELF, batches)
    _, norms, *_ = run_measuring(cfg, comm, batches)
    assert_all(comm, expected[0] > cfg.train.grad_clip, f"clipping engaged ({expected[0]})")
    assert_close_all(comm, norms, expected, rtol=1e-12, what=f"norms at zero {zero}")
