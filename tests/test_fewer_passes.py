"""Work folded into passes that already run, each the same bits as the separate pass it
replaces, with numba's kernels and with NumPy's:

* LayerNorm's backward adds the residual's skip path (``LayerNorm.backward(skip=)``);
* AdamW's update scales the clipped gradient as it reads it (``AdamW.step(grad_scale=)``,
  what ``DataParallel.clip`` now asks for instead of a pass over the gradients);
* data parallelism's flat buckets, once zeroed, are not zeroed again by the engine's
  ``zero_grad`` (``Parameter.mark_zero``);
* the MLP's first bias is added by GELU's forward pass (``Linear.forward(add_bias=
  False)``, ``GELU.forward(bias=)``), not by a pass of its own.
"""

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.nn import GELU, LayerNorm, Linear, kernels
from hpctrain.nn.kernels import NUMPY_KERNELS
from hpctrain.nn.module import Parameter
from hpctrain.optim import AdamW
from hpctrain.optim.clip import clip_grads
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.topology import Topology
from hpctrain.train import make_data_parallel, train_step


def kernel_sets():
    sets = [("numpy", NUMPY_KERNELS)]
    try:
        from hpctrain.nn import fused
    except ImportError:
        return sets
    return sets + [("numba", fused.KERNELS)]


@pytest.fixture(params=[name for name, _ in kernel_sets()])
def chosen(request):
    kernels.set_kernels(dict(kernel_sets())[request.param])
    yield request.param
    kernels.set_kernels(None)


def rows(shape, dtype, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 8), (7, 24), (2, 65, 384)])
def test_gelu_adds_the_linear_bias_in_its_pass_as_the_linear_did(chosen, dtype, shape):
    fc = Linear(shape[-1], 3 * shape[-1], rng=np.random.default_rng(4), dtype=dtype)
    fc.bias.data[:] = rows(fc.bias.shape, dtype, 5)
    x = rows(shape, dtype, 6)
    h, _ = fc.forward(x)
    want, want_cache = GELU().forward(h)
    bare, _ = fc.forward(x, add_bias=False)
    assert not np.array_equal(bare, h)
    got, cache = GELU().forward(bare, fc.bias.data)
    assert got.dtype == want.dtype and np.array_equal(got, want)
    # the cache holds GELU's input, the biased product, so the backward is the same too
    assert np.array_equal(cache.x, want_cache.x) and np.array_equal(cache.s, want_cache.s)


def test_a_row_parallel_linear_refuses_to_leave_its_bias_to_the_caller():
    from hpctrain.parallel.tensor import NoCommunication, RowParallelLinear

    row = RowParallelLinear(Parameter(np.ones((4, 3))), Parameter(np.ones(3)),
                            NoCommunication(), tp_rank=0)
    with pytest.raises(ValueError, match="add_bias must be True"):
        row.forward(np.ones((2, 4)), add_bias=False)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 8), (7, 24), (130, 384)])
def test_layernorm_backward_adds_the_skip_path_as_the_separate_add_did(chosen, dtype,
                                                                       shape):
    ln = LayerNorm(shape[-1], dtype=dtype)
    ln.weight.data[:] = rows(shape[-1:], dtype, 1)
    _, cache = ln.forward(rows(shape, dtype, 0))
    dy, skip = rows(shape, dtype, 2), rows(shape, dtype, 3)
    want = ln.backward(dy, cache)
    want += skip
    got = ln.backward(dy, cache, skip=skip)
    assert got.dtype == want.dtype and np.array_equal(got, want)
    assert np.array_equal(skip, rows(shape, dtype, 3))  # read, not written


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_adamw_with_a_gradient_scale_is_clip_then_step(chosen, dtype):
    """Three steps, a matrix above PARALLEL_MIN_SIZE (split over threads) and a bias:
    the scale inside the update against clip_grads' pass and a plain update."""
    results = []
    for inside in (False, True):
        params = [("w", Parameter(rows((300, 300), dtype, 0))),
                  ("b", Parameter(rows((300,), dtype, 1)))]
        opt = AdamW(params, lr=1e-2, weight_decay=0.1)
        for step in range(3):
            for i, (_, p) in enumerate(params):
                p.grad[...] = rows(p.shape, dtype, 10 * step + i + 2) * 7
            norm = float(np.sqrt(sum(np.sum(p.grad.astype(np.float64) ** 2)
                                     for _, p in params)))
            if inside:
                opt.step(grad_scale=1.0 / (norm + 1e-6))
            else:
                clip_grads([p for _, p in params], 1.0, norm)
                opt.step()
        results.append([p.data for _, p in params] + opt.m + opt.v)
    for got, want in zip(results[1], results[0], strict=True):
        assert np.array_equal(got, want)


def tiny_engine(zero=0):
    cfg = Config(model=ModelConfig(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=64),
                 parallel=ParallelConfig(zero=zero),
                 train=TrainConfig(batch_size=4, grad_clip=0.1)).validate(1)
    topo = Topology.build(MPI.COMM_SELF, cfg.parallel)
    engine = build_engine(cfg, topo)
    return cfg, engine, make_data_parallel(cfg, engine, topo)


def test_data_parallel_clips_inside_the_update_and_trains_the_same_bits(chosen):
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, 64, (4, 16)) for _ in range(2))
    results = []
    for inside in (False, True):
        cfg, engine, dp = tiny_engine()
        assert dp._scale_in_update  # AdamW, dense gradients
        dp._scale_in_update = inside
        norms = [train_step(engine, dp, x, y, lr=1e-2, grad_clip=0.1)[1] for _ in range(3)]
        assert min(norms) > 0.1  # every step was clipped
        results.append([p.data.copy() for p in engine.params])
    for got, want in zip(results[1], results[0], strict=True):
        assert np.array_equal(got, want)


def test_zeroed_buckets_are_marked_and_only_their_own_arrays():
    _, engine, dp = tiny_engine()
    p = next(p for p in engine.params if p.data.ndim == 2)
    a = np.ones((p.shape[0], 1), p.data.dtype)
    b = np.ones((1, p.shape[1]), p.data.dtype)
    p.grad[...] = 3.0
    dp.zero_grad()  # the buckets filled and marked; the engine's zero_grad skips them
    p.add_product(a, b)  # written into the bucket's view
    assert np.all(p.grad == 1.0)
    p.grad[...] = 3.0
    engine.zero_grad()  # read since the mark: filled again
    assert not p.grad.any()
    p.grad[...] = 4.0
    p.mark_zero(np.zeros(p.shape, p.data.dtype))  # another array than its gradient
    p.add_product(a, b)
    assert np.all(p.grad == 5.0)  # added, not written over
