"""Convolutional layers against central finite differences (float64) and against
direct loop-based references: convolution, transposed convolution, upsampling,
pooling, BatchNorm (also split over a group of threads standing in for ranks), ReLU
and the residual block; then validation, float32 and the layer contract."""

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from hpctrain.nn.batchnorm import BatchNorm
from hpctrain.nn.blocks import ResidualBlock
from hpctrain.nn.conv import Conv2d, Conv3d, ConvNd, ConvTransposeNd, ReLU, Upsample
from hpctrain.nn.gradcheck import check_array, check_parameters, rel_error
from hpctrain.nn.pool import AvgPoolNd, MaxPool2d, MaxPoolNd
from hpctrain.nn.threads import MIN_ROWS_PER_THREAD, set_threads, threads

TOL = 1e-7


def rng(seed=0):
    return np.random.default_rng(seed)


def check_layer(layer, x, seed=1, **forward_kw):
    """Check dx and every parameter gradient of ``sum(layer(x) * w)`` for a random w."""
    y, _ = layer.forward(x, **forward_kw)
    w = rng(seed).standard_normal(y.shape)
    layer.zero_grad()
    y, cache = layer.forward(x, **forward_kw)
    dx = layer.backward(w, cache)

    def loss():
        return float(np.sum(layer.forward(x, **forward_kw)[0] * w))

    errors = check_parameters(loss, layer.named_parameters())  # every entry
    errors["input"] = check_array(loss, x, dx)
    assert max(errors.values()) < TOL, errors
    return errors


def expand(v, nd):
    return (v,) * nd if isinstance(v, int) else tuple(v)


def explicit_pads(padding, kernel, dilation):
    """(before, after) per axis, written out independently of the layer."""
    if padding == "same":
        return [((d * (k - 1)) // 2, d * (k - 1) - (d * (k - 1)) // 2)
                for k, d in zip(kernel, dilation, strict=True)]
    return [(p, p) for p in expand(padding, len(kernel))]


# ---------------------------------------------------------------------------------
# convolution

# nd, input shape, out channels, kernel, stride, padding, dilation, bias
CONV_CASES = [
    (2, (2, 3, 7, 6), 4, 3, 1, 0, 1, True),
    (2, (2, 3, 7, 6), 4, 3, 2, 1, 1, True),
    (2, (2, 2, 8, 7), 3, 2, 1, "same", 1, False),  # even kernel: the odd row after
    (2, (2, 2, 9, 8), 3, 3, 1, 2, 2, True),
    (2, (2, 3, 6, 9), 2, (2, 3), (2, 1), (1, 0), (1, 2), True),
    (2, (3, 2, 5, 5), 3, 4, 2, 1, 1, True),
    (2, (2, 2, 6, 7), 2, 3, 1, "same", 2, True),
    (3, (2, 2, 4, 5, 3), 3, 3, 1, 1, 1, True),
    (3, (2, 2, 5, 4, 6), 2, 2, 2, 0, 1, True),
    (3, (2, 1, 5, 6, 5), 2, 3, (1, 2, 1), 1, 2, False),
]


def make_conv(case, dtype=np.float64):
    nd, shape, out, kernel, stride, padding, dilation, bias = case
    conv = ConvNd(nd, shape[1], out, kernel, stride, padding, dilation, bias, rng=rng(),
                  dtype=dtype, std=0.5)
    if bias:
        conv.bias.data[:] = rng(2).standard_normal(out)
    return conv, rng(3).standard_normal(shape).astype(dtype)


def conv_reference(x, w, b, stride, pads, dilation):
    """The definition, one output position and kernel offset at a time."""
    xp = np.pad(x, ((0, 0), (0, 0), *pads))
    kernel = w.shape[2:]
    out = [(n - d * (k - 1) - 1) // s + 1
           for n, k, s, d in zip(xp.shape[2:], kernel, stride, dilation, strict=True)]
    y = np.zeros((x.shape[0], w.shape[0], *out))
    for p in np.ndindex(*out):
        for k in np.ndindex(*kernel):
            at = tuple(pi * s + ki * d for pi, ki, s, d in zip(p, k, stride, dilation, strict=True))
            y[(..., *p)] += xp[(..., *at)] @ w[(..., *k)].T  # (N, C) @ (C, O)
    if b is not None:
        y += b.reshape(-1, *[1] * len(kernel))
    return y


@pytest.mark.parametrize("case", CONV_CASES, ids=str)
def test_conv_gradcheck(case):
    conv, x = make_conv(case)
    check_layer(conv, x)


@pytest.mark.parametrize("case", CONV_CASES, ids=str)
def test_conv_matches_loop_reference(case):
    conv, x = make_conv(case)
    nd, _, _, kernel, stride, padding, dilation, _ = case
    kernel, stride, dilation = (expand(v, nd) for v in (kernel, stride, dilation))
    ref = conv_reference(x, conv.weight.data, conv.bias and conv.bias.data, stride,
                         explicit_pads(padding, kernel, dilation), dilation)
    y = conv.forward(x)[0]
    assert y.shape == ref.shape
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)
    if padding == "same":
        assert y.shape[2:] == x.shape[2:]


def test_conv_padded_pair_is_the_layer_on_a_padded_input():
    """forward_padded on a pre-padded input is what a spatial wrapper with halos calls."""
    conv, x = make_conv(CONV_CASES[1])
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    y, cache = conv.forward(x)
    yp, cache_p = conv.forward_padded(xp)
    np.testing.assert_array_equal(y, yp)
    dy = rng(4).standard_normal(y.shape)
    dxp = conv.backward_padded(dy, cache_p)
    np.testing.assert_array_equal(conv.backward(dy, cache), dxp[:, :, 1:-1, 1:-1])


def test_conv_accumulates_and_skips_dx_on_request():
    conv, x = make_conv(CONV_CASES[0])
    dy = rng(4).standard_normal(conv.forward(x)[0].shape)
    conv.zero_grad()
    conv.backward(dy, conv.forward(x)[1])
    once = [p.grad.copy() for p in conv.parameters()]
    assert conv.backward(dy, conv.forward(x)[1], need_dx=False) is None
    for g, p in zip(once, conv.parameters(), strict=True):
        np.testing.assert_allclose(p.grad, 2 * g, rtol=1e-14)


def test_im2col_and_col2im_over_threads_give_the_same_bits():
    """Blocks of the batch on two threads, as on a rank with two cores."""
    conv, _ = make_conv(CONV_CASES[1])
    x = rng(3).standard_normal((2 * MIN_ROWS_PER_THREAD, 3, 7, 6))  # two blocks
    before, results = threads(), []
    try:
        for n in (1, 2):
            set_threads(n)
            conv.zero_grad()
            y, cache = conv.forward(x)
            results.append((y, conv.backward(y, cache), conv.weight.grad.copy()))
    finally:
        set_threads(before)
    for one, two in zip(*results, strict=True):
        np.testing.assert_array_equal(one, two)


# ---------------------------------------------------------------------------------
# transposed convolution and upsampling

# nd, input shape, out channels, kernel, stride, padding, dilation, output_padding
TRANSPOSE_CASES = [
    (2, (2, 3, 4, 5), 2, 3, 2, 1, 1, 1),
    (2, (2, 2, 3, 4), 3, 4, 2, 1, 1, 0),
    (2, (2, 2, 4, 3), 2, 3, 1, 0, 2, 0),
    (2, (2, 3, 3, 4), 2, (2, 3), (2, 1), (0, 1), 1, (1, 0)),
    (3, (2, 2, 3, 2, 3), 2, 3, 2, 1, 1, (1, 0, 1)),
]


def make_transpose(case, dtype=np.float64):
    nd, shape, out, kernel, stride, padding, dilation, output_padding = case
    layer = ConvTransposeNd(nd, shape[1], out, kernel, stride, padding, dilation,
                            output_padding, rng=rng(), dtype=dtype, std=0.5)
    layer.bias.data[:] = rng(2).standard_normal(out)
    return layer, rng(3).standard_normal(shape).astype(dtype)


def transpose_reference(x, w, b, stride, padding, dilation, output_padding):
    """The definition: each input entry scatters ``x[n, c, i] w[c, o, k]`` to
    ``i s + k d - pad``, kept when inside the output."""
    kernel = w.shape[2:]
    out = [(n - 1) * s - 2 * p + d * (k - 1) + 1 + op for n, k, s, p, d, op in
           zip(x.shape[2:], kernel, stride, padding, dilation, output_padding, strict=True)]
    y = np.zeros((x.shape[0], w.shape[1], *out))
    for i in np.ndindex(*x.shape[2:]):
        for k in np.ndindex(*kernel):
            at = tuple(ii * s + ki * d - p
                       for ii, ki, s, d, p in zip(i, k, stride, dilation, padding, strict=True))
            if all(0 <= a < o for a, o in zip(at, out, strict=True)):
                y[(..., *at)] += x[(..., *i)] @ w[(..., *k)]  # (N, C) @ (C, O)
    return y + b.reshape(-1, *[1] * len(kernel))


@pytest.mark.parametrize("case", TRANSPOSE_CASES, ids=str)
def test_conv_transpose_gradcheck(case):
    layer, x = make_transpose(case)
    check_layer(layer, x)


@pytest.mark.parametrize("case", TRANSPOSE_CASES, ids=str)
def test_conv_transpose_matches_its_definition_and_is_the_adjoint(case):
    layer, x = make_transpose(case)
    nd, _, _, kernel, stride, padding, dilation, output_padding = case
    stride, padding, dilation, output_padding = (expand(v, nd) for v in
                                                 (stride, padding, dilation, output_padding))
    y = layer.forward(x)[0]
    ref = transpose_reference(x, layer.weight.data, layer.bias.data, stride, padding,
                              dilation, output_padding)
    assert y.shape == ref.shape
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)
    # <conv(z), x> = <z, conv^T(x)>, the same array as weight: (C, O) of conv^T is the
    # (out, in) of conv; no bias
    conv = ConvNd(nd, y.shape[1], x.shape[1], kernel, stride, padding, dilation, False,
                  rng=rng(), dtype=np.float64)
    conv.weight.data[:] = layer.weight.data
    z = rng(5).standard_normal(y.shape)
    assert conv.forward(z)[0].shape == x.shape
    lhs = np.sum(conv.forward(z)[0] * x)
    rhs = np.sum(z * (y - layer.bias.data.reshape(-1, *[1] * nd)))
    assert abs(lhs - rhs) < 1e-10 * abs(lhs)


@pytest.mark.parametrize("nd, shape, factor", [(2, (2, 3, 3, 4), 2), (2, (1, 2, 2, 3), (3, 2)),
                                               (3, (2, 2, 2, 3, 2), (2, 1, 3))])
def test_upsample_gradcheck_and_definition(nd, shape, factor):
    layer, x = Upsample(nd, factor), rng(1).standard_normal(shape)
    check_layer(layer, x)
    ref = x
    for axis, f in enumerate(expand(factor, nd)):
        ref = np.repeat(ref, f, axis=2 + axis)  # y[..., i] = x[..., i // f]
    np.testing.assert_array_equal(layer.forward(x)[0], ref)


# ---------------------------------------------------------------------------------
# pooling

# nd, input shape, kernel, stride, padding: overlapping (stride < kernel) and not
POOL_CASES = [
    (2, (2, 3, 6, 8), 2, None, 0),
    (2, (2, 2, 7, 6), 3, 2, 1),
    (2, (2, 2, 5, 6), (3, 2), 1, 0),
    (3, (2, 2, 4, 6, 4), 2, None, 0),
    (3, (1, 2, 5, 4, 5), 3, 2, 1),
]


def distinct(shape, seed=1):
    """Entries 0.01 apart at least, shuffled: no ties for max pooling to break."""
    size = int(np.prod(shape))
    return (rng(seed).permutation(size) * 0.01 - size * 0.005).reshape(shape)


def pool_reference(x, kernel, stride, padding, reduce, fill):
    xp = np.pad(x, ((0, 0), (0, 0), *[(p, p) for p in padding]), constant_values=fill)
    out = [(n - k) // s + 1 for n, k, s in zip(xp.shape[2:], kernel, stride, strict=True)]
    y = np.zeros((*x.shape[:2], *out))
    for p in np.ndindex(*out):
        window = tuple(slice(pi * s, pi * s + k)
                       for pi, s, k in zip(p, stride, kernel, strict=True))
        y[(..., *p)] = reduce(xp[(..., *window)].reshape(*x.shape[:2], -1), axis=-1)
    return y


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("case", POOL_CASES, ids=str)
def test_pool_gradcheck_and_reference(kind, case):
    nd, shape, kernel, stride, padding = case
    layer = (MaxPoolNd if kind == "max" else AvgPoolNd)(nd, kernel, stride, padding)
    x = distinct(shape)
    check_layer(layer, x)
    kernel = expand(kernel, nd)
    stride = kernel if stride is None else expand(stride, nd)
    reduce, fill = (np.max, -np.inf) if kind == "max" else (np.mean, 0.0)
    ref = pool_reference(x, kernel, stride, expand(padding, nd), reduce, fill)
    np.testing.assert_allclose(layer.forward(x)[0], ref, rtol=1e-13, atol=1e-15)


def test_max_pool_routes_the_gradient_to_the_maximum_only():
    x = np.array([[[[1.0, 5.0], [3.0, 2.0]]]])
    layer = MaxPool2d(2)
    y, cache = layer.forward(x)
    assert y.item() == 5.0
    np.testing.assert_array_equal(layer.backward(np.full((1, 1, 1, 1), 7.0), cache),
                                  [[[[0.0, 7.0], [0.0, 0.0]]]])


# ---------------------------------------------------------------------------------
# BatchNorm


def make_bn(channels, dtype=np.float64, **kw):
    bn = BatchNorm(channels, dtype=dtype, **kw)
    bn.weight.data[:] = rng(4).standard_normal(channels)
    bn.bias.data[:] = rng(5).standard_normal(channels)
    return bn


@pytest.mark.parametrize("shape", [(3, 2, 4, 5), (2, 3, 3, 2, 4), (6, 4)])
def test_batchnorm_train_gradcheck(shape):
    check_layer(make_bn(shape[1]), rng(6).standard_normal(shape) * 3.0 + 1.0)


def test_batchnorm_eval_gradcheck():
    bn = make_bn(3)
    bn.running_mean[:] = [0.5, -1.0, 2.0]
    bn.running_var[:] = [2.0, 0.5, 1.5]
    check_layer(bn, rng(6).standard_normal((2, 3, 4, 3)), train=False)


def test_batchnorm_normalises_per_channel_and_keeps_running_statistics():
    bn = BatchNorm(3, momentum=0.1, dtype=np.float64)
    x = rng(1).standard_normal((4, 3, 5, 6)) * np.array([1.0, 2.0, 3.0])[:, None, None] + 4.0
    y, _ = bn.forward(x)
    np.testing.assert_allclose(y.mean(axis=(0, 2, 3)), 0.0, atol=1e-12)
    np.testing.assert_allclose(y.var(axis=(0, 2, 3)), 1.0, rtol=1e-4)  # var / (var + eps)
    mean, var = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3), ddof=1)
    np.testing.assert_allclose(bn.running_mean, 0.1 * mean, rtol=1e-12)
    np.testing.assert_allclose(bn.running_var, 0.9 + 0.1 * var, rtol=1e-12)
    # eval mode: the running statistics, whatever the batch
    z = rng(2).standard_normal((2, 3, 5, 6))
    ref = (z - bn.running_mean[:, None, None]) / np.sqrt(bn.running_var[:, None, None] + 1e-5)
    np.testing.assert_allclose(bn.forward(z, train=False)[0], ref, rtol=1e-12)
    np.testing.assert_allclose(bn.forward(z[:1], train=False)[0], ref[:1], rtol=1e-12)
    before = bn.running_mean.copy()
    bn.forward(z, train=False)
    np.testing.assert_array_equal(bn.running_mean, before)  # eval leaves them alone


class ThreadGroup:
    """An all-reduce among threads, standing in for the MPI group that shares a batch:
    every member posts its array, then each sums them all in rank order."""

    def __init__(self, size):
        self.barrier = threading.Barrier(size, timeout=20)  # a bug fails, never hangs
        self.posted = [None] * size
        self.calls = [0] * size

    def member(self, rank):
        def reduce(a):
            self.calls[rank] += 1
            self.posted[rank] = a.copy()
            self.barrier.wait()
            total = np.sum(self.posted, axis=0)
            self.barrier.wait()  # nobody posts again before all have summed
            return total
        return reduce


def split(a, pieces):
    """a (N, C, H, W) cut into blocks by ``pieces = [(batch slice, H slice), ...]``."""
    return [a[nb, :, hb] for nb, hb in pieces]


@pytest.mark.parametrize("pieces", [
    [(slice(0, 2), slice(None)), (slice(2, 5), slice(None))],  # data parallel, uneven
    [(slice(None), slice(0, 3)), (slice(None), slice(3, 7))],  # spatial, uneven
    [(slice(0, 2), slice(0, 4)), (slice(0, 2), slice(4, 7)),
     (slice(2, 5), slice(0, 4)), (slice(2, 5), slice(4, 7))],  # both
])
def test_batchnorm_over_a_group_matches_the_whole_batch(pieces):
    x = rng(1).standard_normal((5, 3, 7, 4)) * 2.0 + 1.0
    dy = rng(2).standard_normal(x.shape)
    whole = make_bn(3)
    y, cache = whole.forward(x)
    dx = whole.backward(dy, cache)

    group = ThreadGroup(len(pieces))
    layers = [make_bn(3, reduce=group.member(r)) for r in range(len(pieces))]

    def run(rank):
        bn, xr, dyr = layers[rank], split(x, pieces)[rank], split(dy, pieces)[rank]
        yr, cr = bn.forward(xr)
        return yr, bn.backward(dyr, cr)

    with ThreadPoolExecutor(len(pieces)) as pool:
        results = list(pool.map(run, range(len(pieces))))
    assert group.calls == [2] * len(pieces)  # one reduction in each pass
    parts = zip(results, split(y, pieces), split(dx, pieces), strict=True)
    for (yr, dxr), y_part, dx_part in parts:
        np.testing.assert_allclose(yr, y_part, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(dxr, dx_part, rtol=1e-10, atol=1e-12)
    for name in ("weight", "bias"):  # local sums, which the data-parallel reduction adds
        total = sum(getattr(bn, name).grad for bn in layers)
        np.testing.assert_allclose(total, getattr(whole, name).grad, rtol=1e-12)
    for bn in layers:  # every rank keeps the group's running statistics
        np.testing.assert_allclose(bn.running_mean, whole.running_mean, rtol=1e-12)
        np.testing.assert_allclose(bn.running_var, whole.running_var, rtol=1e-12)


# ---------------------------------------------------------------------------------
# ReLU and the residual block


def test_relu_gradcheck_and_values():
    x = distinct((2, 3, 4, 5)) + 0.005  # nothing within eps of the kink
    check_layer(ReLU(), x)
    np.testing.assert_array_equal(ReLU().forward(x)[0], np.maximum(x, 0))


@pytest.mark.parametrize("nd, shape, out, stride", [
    (2, (2, 3, 5, 6), 3, 1),  # identity skip
    (2, (2, 3, 6, 5), 4, 2),  # projection: channels and stride change
    (3, (2, 2, 4, 3, 4), 3, 2),
])
def test_residual_block_gradcheck(nd, shape, out, stride):
    block = ResidualBlock(nd, shape[1], out, stride, rng=rng(), dtype=np.float64)
    assert (block.proj is None) == (shape[1] == out and stride == 1)
    for bn in (block.bn1, block.bn2, block.proj_bn):
        if bn is not None:
            bn.weight.data[:] = rng(7).uniform(0.5, 1.5, out)
            bn.bias.data[:] = rng(8).uniform(0.5, 1.0, out)  # most of the ReLUs open
    x = rng(9).standard_normal(shape)
    y, _ = block.forward(x)
    assert y.shape == (shape[0], out, *[-(-s // stride) for s in shape[2:]])
    errors = check_layer(block, x)
    assert len(errors) == len(block.parameters()) + 1


# ---------------------------------------------------------------------------------
# validation: errors name the value and the rule, before any work


@pytest.mark.parametrize("make, x_shape, match", [
    (lambda: Conv2d(1, 2, 5, padding=1, rng=rng()), (1, 1, 2, 6),
     r"kernel 5 .* larger than the padded input 2 \+ 1 \+ 1 on spatial axis 0"),
    (lambda: Conv2d(1, 2, 3, dilation=3, rng=rng()), (1, 1, 6, 9),
     r"dilation 3, extent 7\) is larger than the padded input 6"),
    (lambda: Conv2d(3, 2, 3, rng=rng()), (1, 2, 5, 5), "expects 3 input channels, got 2"),
    (lambda: Conv2d(1, 2, 3, rng=rng()), (1, 1, 5, 5, 5), r"ndim 4; got shape \(1, 1, 5"),
    (lambda: Conv3d(1, 2, 3, rng=rng()), (1, 5, 5), "ndim 5"),
    (lambda: BatchNorm(3), (2, 4, 5), r"expects \(N, 3, ...\), got shape \(2, 4, 5\)"),
    (lambda: MaxPool2d(3), (1, 1, 2, 4), "larger than the padded input 2"),
])
def test_forward_rejects_bad_inputs(make, x_shape, match):
    with pytest.raises(ValueError, match=match):
        make().forward(np.zeros(x_shape))


@pytest.mark.parametrize("make, match", [
    (lambda: Conv2d(1, 2, 3, stride=0, rng=rng()), "stride 0 must be positive"),
    (lambda: Conv2d(1, 2, (3, 0), rng=rng()), r"kernel_size \(3, 0\) must be positive"),
    (lambda: Conv2d(1, 2, 3, padding=-1, rng=rng()), "padding -1 must be non-negative"),
    (lambda: Conv2d(1, 2, 3, stride=2, padding="same", rng=rng()),
     r"'same' needs stride 1, got stride \(2, 2\)"),
    (lambda: Conv3d(1, 2, (3, 3), rng=rng()), r"kernel_size \(3, 3\) must be an int or 3"),
    (lambda: Conv2d(0, 2, 3, rng=rng()), "channels must be positive, got in 0"),
    (lambda: ConvTransposeNd(2, 1, 1, 3, 2, output_padding=2, rng=rng()),
     r"output_padding 2 must be in \[0, stride\)"),
    (lambda: MaxPool2d(2, padding=2), "padding 2 must be at most half the kernel"),
    (lambda: BatchNorm(3, momentum=1.5), "momentum 1.5"),
])
def test_constructors_reject_bad_settings(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ---------------------------------------------------------------------------------
# float32 in, float32 out, close to float64


def test_float32_stays_float32_and_matches_float64():
    x64 = rng(1).standard_normal((2, 3, 8, 7))
    x32 = x64.astype(np.float32)
    layers = [
        lambda dt: make_conv(CONV_CASES[1], dt)[0],
        lambda dt: make_transpose(TRANSPOSE_CASES[0], dt)[0],
        lambda dt: MaxPoolNd(2, 3, 2, 1),
        lambda dt: AvgPoolNd(2, 2),
        lambda dt: Upsample(2, 2),
        lambda dt: make_bn(3, dt),
        lambda dt: ReLU(),
        lambda dt: ResidualBlock(2, 3, 4, 2, rng=rng(), dtype=dt),
    ]
    for make in layers:
        outs = {}
        for dt, x in ((np.float32, x32), (np.float64, x64)):
            layer = make(dt)
            y, cache = layer.forward(x)
            dy = rng(2).standard_normal(y.shape).astype(dt)  # not ones: BatchNorm's dx = 0
            dx = layer.backward(dy, cache)
            assert y.dtype == dt and dx.dtype == dt, (type(layer).__name__, y.dtype, dx.dtype)
            assert all(p.grad.dtype == dt for p in layer.parameters())
            outs[dt] = (y, dx)
        for a, b in zip(outs[np.float32], outs[np.float64], strict=True):
            assert rel_error(a, b) < 1e-5, type(make(np.float64)).__name__
