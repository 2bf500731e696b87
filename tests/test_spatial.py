"""Slab and halo arithmetic of spatial parallelism, without MPI: known tables, the
refusals (naming their values), and a sweep over kernels, strides, dilations, paddings,
rank counts and slab sizes in which every configuration is either refused or gives
the serial convolution exactly when each emulated rank convolves its padded slab cut
out of the global array by the table (forward and input gradient). Then the layers on
a communicator of one rank, the degenerate case."""

import itertools

import numpy as np
import pytest

from hpctrain.nn.conv import Conv2d, Conv3d, pad, unpad
from hpctrain.nn.pool import AvgPool2d, MaxPool2d
from hpctrain.parallel.spatial import (
    SpatialConv,
    SpatialPool,
    batchnorm_reduce,
    halo_exchange,
    halo_scatter_add,
    slab_rows,
    sum_gradients,
    take_slab,
    window_halo,
)


class Solo:
    """A communicator of one rank: the layers must never call into it."""

    def Get_size(self):
        return 1

    def Get_rank(self):
        return 0


# ---------------------------------------------------------------------------------
# slabs


def test_slab_rows_are_equal_consecutive_blocks():
    assert [slab_rows(12, r, 4) for r in range(4)] == [slice(0, 3), slice(3, 6), slice(6, 9),
                                                       slice(9, 12)]
    assert slab_rows(5, 0, 1) == slice(0, 5)
    x = np.arange(24).reshape(1, 1, 6, 4)
    assert take_slab(x, 2, 1, 3).tolist() == [[[[8, 9, 10, 11], [12, 13, 14, 15]]]]
    assert take_slab(x, 3, 1, 2)[0, 0, :, 0].tolist() == [2, 6, 10, 14, 18, 22]


@pytest.mark.parametrize("length, rank, size, match", [
    (10, 0, 4, r"spatial size \(4\) must divide the length \(10\)"),
    (3, 0, 2, r"spatial size \(2\) must divide the length \(3\)"),
    (8, 4, 4, r"rank \(4\) must be in \[0, size \(4\)\)"),
    (8, -1, 4, r"rank \(-1\)"),
    (8, 0, 0, r"size \(0\)"),
])
def test_slab_rows_refuses(length, rank, size, match):
    with pytest.raises(ValueError, match=match):
        slab_rows(length, rank, size)


# ---------------------------------------------------------------------------------
# halo tables

# length, size, kernel, stride, dilation, pads -> out_length, before, after
TABLES = [
    # 3x3 'same': one row each side, zero padding at the global borders
    (8, 2, 3, 1, 1, (1, 1), 8, (1, 1), (1, 1)),
    (12, 4, 3, 1, 1, (1, 1), 12, (1, 1, 1, 1), (1, 1, 1, 1)),
    # stride 2, stride divides the slab: the same halo everywhere, none after
    (8, 2, 3, 2, 1, (1, 1), 4, (1, 1), (0, 0)),
    # 1x1 stride 2: the slab's last row is never read, dropped
    (8, 2, 1, 2, 1, (0, 0), 4, (0, 0), (-1, -1)),
    # even kernel, 'same' (0 before, 1 after)
    (8, 4, 2, 1, 1, (0, 1), 8, (0, 0, 0, 0), (1, 1, 1, 1)),
    (8, 2, 4, 1, 1, (1, 2), 8, (1, 1), (2, 2)),
    # dilation 2, 'same' for kernel 3: two rows each side
    (12, 3, 3, 1, 2, (2, 2), 12, (2, 2, 2), (2, 2, 2)),
    # valid convolution, output slabs shifted against the input slabs: per-rank halos
    (10, 2, 3, 1, 1, (0, 0), 8, (0, 1), (1, 0)),
    (10, 2, 3, 2, 1, (0, 0), 4, (0, 1), (0, -1)),
    # pooling 2 stride 2: no halo at all
    (8, 4, 2, 2, 1, (0, 0), 4, (0, 0, 0, 0), (0, 0, 0, 0)),
    # pooling 3 stride 2 pad 1
    (8, 2, 3, 2, 1, (1, 1), 4, (1, 1), (0, 0)),
    # one rank: padding only, trailing rows a stride never reaches dropped
    (8, 1, 3, 2, 1, (0, 0), 3, (0,), (-1,)),
]


@pytest.mark.parametrize("length, size, k, s, d, pads, out, before, after", TABLES)
def test_halo_tables(length, size, k, s, d, pads, out, before, after):
    h = window_halo(length, size, k, s, d, pads)
    assert (h.out_length, h.before, h.after) == (out, before, after)
    assert h.rows == length // size and h.out_rows == out // size
    for b, a in zip(h.before, h.after, strict=True):  # every padded slab gives out_rows
        assert ((h.rows + b + a) - (d * (k - 1) + 1)) // s + 1 == h.out_rows


@pytest.mark.parametrize("length, size, k, s, d, pads, match", [
    (10, 4, 3, 1, 1, (1, 1), r"spatial size \(4\) must divide the length \(10\)"),
    (10, 2, 3, 1, 1, (0, 0), None),  # accepted (out 8): the contrast to the next
    (12, 4, 3, 1, 1, (0, 0), r"spatial size \(4\) must divide the output length \(10"),
    (8, 4, 5, 1, 1, (2, 2), None),  # halo 2 == slab 2: accepted
    (8, 4, 7, 1, 1, (3, 3), r"rank 0 of 4 needs a halo of 3 rows from rank 1, whose "
                            r"slab holds only 2 of the 8 rows"),
    (8, 4, 3, 1, 3, (3, 3), r"halo of 3 rows .* only 2"),  # dilation 3
    (8, 8, 3, 1, 1, (1, 1), None),  # one row per rank, halo 1
    (8, 8, 4, 1, 1, (1, 2), r"rank 0 of 8 needs a halo of 2 rows from rank 1"),
    (4, 1, 7, 1, 1, (1, 1), r"kernel 7 \(dilation 1, extent 7\) is larger than the "
                            r"padded input 4 \+ 1 \+ 1"),
    (4, 1, 3, 1, 3, (0, 0), r"extent 7\) is larger"),
])
def test_halo_refusals_name_their_values(length, size, k, s, d, pads, match):
    if match is None:
        window_halo(length, size, k, s, d, pads)
        return
    with pytest.raises(ValueError, match=match):
        window_halo(length, size, k, s, d, pads)


def emulate(conv, x, size):
    """Every rank of ``size`` along H convolves its padded slab, cut from the globally
    padded input by the table; the backward scatters each slab's input gradient back
    into the global padded gradient (what halo_exchange / halo_scatter_add do over MPI).
    Returns (y, dx) as the serial layer lays them out, or raises as the table does."""
    (lo, hi), w_pads = conv.pads[0], ((0, 0), conv.pads[1])
    h = window_halo(x.shape[2], size, conv.kernel_size[0], conv.stride[0], conv.dilation[0],
                    (lo, hi))
    n, m = h.rows, h.out_rows
    xg = pad(x, ((lo, hi), (0, 0)))
    rng = np.random.default_rng(3)
    dy = rng.standard_normal((x.shape[0], conv.weight.shape[0], h.out_length, _out_w(conv, x)))
    ys, dxg = [], np.zeros_like(xg)
    for r in range(size):
        rows = slice(r * n - h.before[r] + lo, (r + 1) * n + h.after[r] + lo)
        xr = pad(xg[:, :, rows], w_pads)
        y, cache = conv.forward_padded(xr)
        ys.append(y)
        dxr = conv.backward_padded(dy[:, :, r * m:(r + 1) * m], cache)
        dxg[:, :, rows] += unpad(dxr, w_pads)
    return np.concatenate(ys, axis=2), unpad(dxg, ((lo, hi), (0, 0))), dy


def _out_w(conv, x):
    (lo, hi), k, s, d = conv.pads[1], conv.kernel_size[1], conv.stride[1], conv.dilation[1]
    return (x.shape[3] + lo + hi - d * (k - 1) - 1) // s + 1


def test_every_configuration_is_refused_or_exact():
    """The issue's rule: error or correct, never wrong."""
    accepted = refused = 0
    for k, s, d, padding, size, n in itertools.product(
            (1, 2, 3, 4, 5), (1, 2, 3), (1, 2), (0, 1, 2, "same"), (1, 2, 3, 4), (1, 2, 3, 5)):
        if padding == "same" and s != 1:
            continue
        conv = Conv2d(2, 3, (k, 2), stride=(s, 1), padding=padding if padding == "same"
                      else (padding, 0), dilation=(d, 1), rng=np.random.default_rng(k),
                      dtype=np.float64)
        x = np.random.default_rng(n).standard_normal((2, 2, n * size, 3))
        try:
            y, dx, dy = emulate(conv, x, size)
        except ValueError:
            refused += 1
            continue
        accepted += 1
        y_ref, cache = conv.forward(x)
        dx_ref = conv.backward(dy, cache)
        np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(dx, dx_ref, rtol=1e-12, atol=1e-12)
    assert accepted > 300 and refused > 100, (accepted, refused)


# ---------------------------------------------------------------------------------
# one rank: the degenerate case


def test_exchange_on_one_rank_pads_crops_and_is_adjoint():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 5, 4))
    xp = halo_exchange(x, 2, 2, -1, Solo(), fill=-7.0)
    assert xp.shape == (2, 3, 6, 4)
    assert np.all(xp[:, :, :2] == -7.0) and np.array_equal(xp[:, :, 2:], x[:, :, :4])
    g = rng.standard_normal(xp.shape)
    dx = halo_scatter_add(g, 2, 2, -1, Solo())
    assert dx.shape == x.shape
    # <E x, g> == <x, E^T g> with zero padding
    assert np.isclose(np.sum(halo_exchange(x, 2, 2, -1, Solo()) * g), np.sum(x * dx))
    with pytest.raises(ValueError, match=r"needs 1 entries .* got 2"):
        halo_exchange(x, 2, (1, 1), 0, Solo())


@pytest.mark.parametrize("make, shape, axes", [
    (lambda r: Conv2d(3, 4, 3, stride=2, padding=1, rng=r, dtype=np.float64),
     (2, 3, 9, 8), (2,)),
    (lambda r: Conv2d(3, 4, 4, padding="same", dilation=2, rng=r, dtype=np.float64),
     (2, 3, 7, 6), (2, 3)),
    (lambda r: Conv3d(2, 3, 2, stride=(2, 1, 1), rng=r, dtype=np.float64),
     (1, 2, 5, 4, 3), (4, 2)),
])
def test_spatial_conv_on_one_rank_is_the_conv(make, shape, axes):
    x = np.random.default_rng(1).standard_normal(shape)
    conv, ref = make(np.random.default_rng(2)), make(np.random.default_rng(2))
    layer = SpatialConv(conv, [(a, Solo()) for a in axes])
    y, cache = layer.forward(x)
    y_ref, cache_ref = ref.forward(x)
    np.testing.assert_allclose(y, y_ref, rtol=1e-13)
    dy = np.random.default_rng(3).standard_normal(y.shape)
    np.testing.assert_allclose(layer.backward(dy, cache), ref.backward(dy, cache_ref),
                               rtol=1e-12, atol=1e-14)
    sum_gradients(layer.parameters(), Solo())
    np.testing.assert_allclose(conv.weight.grad, ref.weight.grad, rtol=1e-12)
    # the conv's own names: a model's parameter names do not depend on sp
    assert [n for n, _ in layer.named_parameters()] == ["weight", "bias"]


@pytest.mark.parametrize("pool", [MaxPool2d(3, stride=2, padding=1), AvgPool2d(2),
                                  AvgPool2d(3, stride=1, padding=1)])
def test_spatial_pool_on_one_rank_is_the_pool(pool):
    x = np.random.default_rng(1).standard_normal((2, 3, 8, 6))
    layer = SpatialPool(pool, [(2, Solo()), (3, Solo())])
    y, cache = layer.forward(x)
    y_ref, cache_ref = pool.forward(x)
    np.testing.assert_array_equal(y, y_ref)
    dy = np.random.default_rng(3).standard_normal(y.shape)
    np.testing.assert_allclose(layer.backward(dy, cache), pool.backward(dy, cache_ref),
                               rtol=1e-14)


def test_layers_refuse_bad_splits_and_shapes():
    conv = Conv2d(3, 4, 3, rng=np.random.default_rng(0), dtype=np.float64)
    for splits in ([], [(1, Solo())], [(4, Solo())], [(2, Solo()), (2, Solo())]):
        with pytest.raises(ValueError, match=r"must be distinct spatial axes"):
            SpatialConv(conv, splits)
    with pytest.raises(ValueError, match=r"kernel 3 .* larger than the padded input 2"):
        SpatialConv(conv, [(2, Solo())]).forward(np.zeros((1, 3, 2, 5)))
    with pytest.raises(ValueError, match=r"expects 3 input channels, got 2"):
        SpatialConv(conv, [(2, Solo())]).forward(np.zeros((1, 2, 5, 5)))
    assert batchnorm_reduce(Solo())(np.ones(3)).tolist() == [1, 1, 1]
