"""Spatially-parallel convolution, pooling and BatchNorm equal the serial layers, at any
world size, in float64 to 1e-10 (relative to the largest entry of the compared array).

Every rank builds the serial layer from the same seed and runs it on the whole input;
the spatial layer runs on the rank's slab. Layouts (built here with ``Split``; library
code takes communicators as arguments), for the world size ``p``:

    "h"   p slabs along H
    "hw"  a grid of ph x pw slabs along (H, W), ph * pw = p, ph >= pw (4 ranks: 2 x 2)
    "wh"  the grid transposed: pw x ph along (H, W)
    dp    the world split into dp replicas of a spatial group (the docstring table of
          ``hpctrain/parallel/spatial.py``), for the end-to-end stack

Whether a configuration is refused is computed from the pure slab arithmetic (tested
serially in tests/test_spatial.py): the layer must then raise the same error on every
rank before any transfer, and otherwise give the serial numbers.
"""

from contextlib import nullcontext

import numpy as np
import pytest

from hpctrain.nn.batchnorm import BatchNorm
from hpctrain.nn.conv import Conv2d, Conv3d, ReLU
from hpctrain.nn.pool import AvgPool2d, AvgPool3d, MaxPool2d, MaxPool3d
from hpctrain.parallel.spatial import (
    SpatialConv,
    SpatialPool,
    batchnorm_reduce,
    halo_exchange,
    halo_scatter_add,
    sum_gradients,
    take_slab,
    window_halo,
)
from hpctrain.testing import assert_all, assert_close_all

RTOL = 1e-10
ROWS = 4  # input rows per rank along a split axis


def close(comm, actual, expected, what):
    scale = float(np.max(np.abs(expected))) if np.size(expected) else 1.0
    assert_close_all(comm, actual, expected, rtol=RTOL, atol=RTOL * scale, what=what)


def grid(size):
    """(ph, pw), ph * pw = size, as square as possible with ph >= pw."""
    pw = max(d for d in range(1, size + 1) if size % d == 0 and d * d <= size)
    return size // pw, pw


class Spy:
    """A communicator that records every call but the size and rank queries."""

    def __init__(self, comm):
        self.comm, self.calls = comm, []

    def Get_size(self):
        return self.comm.Get_size()

    def Get_rank(self):
        return self.comm.Get_rank()

    def __getattr__(self, name):
        self.calls.append(name)
        return getattr(self.comm, name)


class Layout:
    """dp replicas of a ph x pw spatial grid: ``rank = (dp_rank * ph + h) * pw + w``."""

    def __init__(self, comm, dp, ph, pw, axes):
        assert dp * ph * pw == comm.Get_size()
        self.dp, self.ph, self.pw = dp, ph, pw
        self.dp_rank, sp_rank = divmod(comm.Get_rank(), ph * pw)
        self.h, self.w = divmod(sp_rank, pw)
        self.sp_comm = comm.Split(color=self.dp_rank, key=sp_rank)
        self.dp_comm = comm.Split(color=sp_rank, key=self.dp_rank)
        h_comm = self.sp_comm.Split(color=self.w, key=self.h)
        w_comm = self.sp_comm.Split(color=self.h, key=self.w)
        self.comms = [self.sp_comm, self.dp_comm, h_comm, w_comm]
        self.spies = [Spy(h_comm), Spy(w_comm)][:len(axes)]
        self.splits = list(zip(axes, self.spies, strict=True))
        self.coords = [(self.h, ph), (self.w, pw)][:len(axes)]

    def slab(self, x):
        for (axis, _), (r, p) in zip(self.splits, self.coords, strict=True):
            x = take_slab(x, axis, r, p)
        return x

    def shard(self, x):
        b = x.shape[0] // self.dp
        return x[self.dp_rank * b:(self.dp_rank + 1) * b]

    def transfers(self):
        return sum(len(s.calls) for s in self.spies)

    def free(self):
        for c in self.comms:
            c.Free()


def layout(comm, name, axes=(2, 3), dp=1):
    p = comm.Get_size() // dp
    ph, pw = grid(p)
    if name == "h":
        return Layout(comm, dp, p, 1, axes[:1])
    if name == "hw":
        return Layout(comm, dp, ph, pw, axes)
    return Layout(comm, dp, pw, ph, axes)


def table_error(window, lay, global_shape):
    """The pure arithmetic's refusal for this layer and layout, or None."""
    dilation = getattr(window, "dilation", (1,) * window.nd)
    try:
        for (axis, comm), _ in zip(lay.splits, lay.coords, strict=True):
            i = axis - 2
            window_halo(global_shape[axis], comm.Get_size(), window.kernel_size[i],
                        window.stride[i], dilation[i], window.pads[i])
    except ValueError as e:
        return str(e).split(": ", 1)[1]  # without the layer's name
    return None


def refused_alike(comm, lay, run, expected):
    """Run ``run()``; True if it raised. Checks on every rank that it raised exactly
    when the table refuses, the same message everywhere, before any transfer."""
    try:
        run()
        err = None
    except ValueError as e:
        err = str(e)
    errs = comm.allgather(err)
    ok = (err is None) == (expected is None) and all(e == errs[0] for e in errs)
    ok &= expected is None or (expected in err and lay.transfers() == 0)
    assert_all(comm, ok, f"refusal (expected {expected!r}, got {err!r})")
    return err is not None


def check_window(comm, lay, make, x, what):
    """``make(rng)`` builds a conv or a pool; its spatial wrapper must equal it."""
    serial, layer = make(np.random.default_rng(5)), make(np.random.default_rng(5))
    wrap = SpatialConv if hasattr(layer, "weight") else SpatialPool
    par = wrap(layer, lay.splits)
    out = {}
    def run():
        out.update(zip("yc", par.forward(lay.slab(x)), strict=True))

    if refused_alike(comm, lay, run, table_error(layer, lay, x.shape)):
        return
    y_ref, cache = serial.forward(x)
    dy = np.random.default_rng(6).standard_normal(y_ref.shape)
    dx_ref = serial.backward(dy, cache)
    close(comm, out["y"], lay.slab(y_ref), f"{what}: output")
    close(comm, par.backward(lay.slab(dy), out["c"]), lay.slab(dx_ref), f"{what}: dx")
    sum_gradients(par.parameters(), lay.sp_comm)
    for (name, p), q in zip(par.named_parameters(), serial.parameters(), strict=True):
        close(comm, p.grad, q.grad, f"{what}: grad {name}")


# name, maker, global shape (rows along split axes = ROWS * ranks on that axis)
F64 = dict(dtype=np.float64)
CONVS = [
    ("2d k3 same", lambda r: Conv2d(3, 4, 3, padding=1, rng=r, **F64)),
    ("2d k3 s2 p1", lambda r: Conv2d(3, 4, 3, stride=2, padding=1, rng=r, **F64)),
    ("2d k5 p2", lambda r: Conv2d(3, 2, 5, padding=2, rng=r, **F64)),
    ("2d k4 'same'", lambda r: Conv2d(3, 2, 4, padding="same", rng=r, **F64)),
    ("2d k2 s2", lambda r: Conv2d(3, 4, 2, stride=2, rng=r, **F64)),
    ("2d k3 d2 p2", lambda r: Conv2d(3, 2, 3, padding=2, dilation=2, rng=r, **F64)),
    ("2d k3 valid", lambda r: Conv2d(3, 2, 3, rng=r, **F64)),  # per-rank halos
    ("2d k1 s2", lambda r: Conv2d(3, 4, 1, stride=2, rng=r, **F64)),  # drops a row
    ("2d k5 d2 p4 (halo 4 = slab)", lambda r: Conv2d(3, 2, 5, padding=4, dilation=2,
                                                     rng=r, **F64)),
    ("2d k6 d2 p5 s2 (halo 5 > slab)", lambda r: Conv2d(3, 2, 6, padding=5, dilation=2,
                                                        stride=2, rng=r, **F64)),
    ("3d k3 same", lambda r: Conv3d(2, 3, 3, padding=1, rng=r, **F64)),
    ("3d k3 s2 p1", lambda r: Conv3d(2, 3, 3, stride=2, padding=1, rng=r, **F64)),
    ("3d k2 s2", lambda r: Conv3d(2, 3, 2, stride=2, rng=r, **F64)),
    ("3d k4 d2 'same'", lambda r: Conv3d(2, 2, 4, padding="same", dilation=2, rng=r, **F64)),
]
POOLS = [
    ("max 2", lambda r: MaxPool2d(2)),
    ("max 3 s2 p1", lambda r: MaxPool2d(3, stride=2, padding=1)),
    ("avg 2", lambda r: AvgPool2d(2)),
    ("avg 3 s1 p1", lambda r: AvgPool2d(3, stride=1, padding=1)),
    ("max3d 2", lambda r: MaxPool3d(2)),
    ("avg3d 3 s2 p1", lambda r: AvgPool3d(3, stride=2, padding=1)),
]


def global_input(lay, nd, channels, batch=2, seed=0):
    rows = [ROWS * lay.ph, ROWS * lay.pw if len(lay.splits) > 1 else 6, 5][:nd]
    return np.random.default_rng(seed).standard_normal((batch, channels, *rows))


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["h", "hw", "wh"])
@pytest.mark.parametrize("case", CONVS, ids=[c[0] for c in CONVS])
def test_conv_equals_serial(comm, case, name):
    what, make = case
    lay = layout(comm, name)
    try:
        nd = make(np.random.default_rng(0)).nd
        check_window(comm, lay, make, global_input(lay, nd, 3 if nd == 2 else 2),
                     f"{what} [{name}]")
    finally:
        lay.free()


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["h", "hw"])
@pytest.mark.parametrize("case", POOLS, ids=[c[0] for c in POOLS])
def test_pool_equals_serial(comm, case, name):
    what, make = case
    lay = layout(comm, name)
    try:
        nd = make(None).nd
        check_window(comm, lay, make, global_input(lay, nd, 3), f"{what} [{name}]")
    finally:
        lay.free()


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["h", "hw"])
def test_batchnorm_statistics_over_the_spatial_group(comm, name):
    lay = layout(comm, name)
    try:
        x = global_input(lay, 2, 3) * 2.0 + 0.5
        serial = BatchNorm(3, dtype=np.float64)
        par = BatchNorm(3, reduce=batchnorm_reduce(lay.sp_comm), dtype=np.float64)
        for bn in (serial, par):  # a non-trivial affine map
            bn.weight.data[:] = [0.5, 1.5, -1.0]
            bn.bias.data[:] = [0.1, -0.2, 0.3]
        y_ref, cache_ref = serial.forward(x)
        y, cache = par.forward(lay.slab(x))
        close(comm, y, lay.slab(y_ref), "batchnorm output")
        close(comm, par.running_var, serial.running_var, "running variance")
        dy = np.random.default_rng(1).standard_normal(x.shape)
        close(comm, par.backward(lay.slab(dy), cache), lay.slab(serial.backward(dy, cache_ref)),
              "batchnorm dx")
        sum_gradients(par.parameters(), lay.sp_comm)
        close(comm, par.weight.grad, serial.weight.grad, "batchnorm dw")
        close(comm, par.bias.grad, serial.bias.grad, "batchnorm db")
    finally:
        lay.free()


def stack(rng, splits=None, reduce=None):
    """conv-bn-relu-pool-conv, serial (splits None) or spatial over ``splits``."""
    # no bias before BatchNorm: its gradient would be zero up to rounding
    conv1 = Conv2d(2, 4, 3, padding=1, bias=False, rng=rng, dtype=np.float64)
    bn = BatchNorm(4, dtype=np.float64) if reduce is None else \
        BatchNorm(4, reduce=reduce, dtype=np.float64)
    pool, conv2 = MaxPool2d(2), Conv2d(4, 3, 3, stride=2, padding=1, rng=rng, dtype=np.float64)
    if splits is None:
        return [conv1, bn, ReLU(), pool, conv2]
    return [SpatialConv(conv1, splits), bn, ReLU(), SpatialPool(pool, splits),
            SpatialConv(conv2, splits)]


def run_stack(layers, x, dy):
    caches = []
    for layer in layers:
        x, cache = layer.forward(x)
        caches.append(cache)
    for layer, cache in zip(reversed(layers), reversed(caches), strict=True):
        dy = layer.backward(dy, cache)
    return x, dy


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["h", "hw"])
@pytest.mark.parametrize("dp", [1, 2])
def test_stack_end_to_end_with_data_parallelism(comm, dp, name):
    """Each dp replica runs a shard of the batch, BatchNorm statistics over its spatial
    group; the parameter gradients summed over the spatial group, then the data group,
    are the sum of the serial gradients of the shards."""
    if comm.Get_size() % dp:
        pytest.skip(f"dp {dp} does not divide the world size {comm.Get_size()}")
    lay = layout(comm, name, dp=dp)
    try:
        rows = [2 * ROWS * lay.ph, 2 * ROWS * lay.pw if name == "hw" else 8]
        x = np.random.default_rng(2).standard_normal((2 * dp, 2, *rows))
        dy = np.random.default_rng(3).standard_normal((2 * dp, 3, rows[0] // 4, rows[1] // 4))
        serial = stack(np.random.default_rng(4))
        par = stack(np.random.default_rng(4), lay.splits, batchnorm_reduce(lay.sp_comm))
        y_ref = dx_ref = None
        for d in range(dp):  # the serial model on every shard, gradients accumulating
            b = slice(2 * d, 2 * d + 2)
            y_d, dx_d = run_stack(serial, x[b], dy[b])
            if d == lay.dp_rank:
                y_ref, dx_ref = y_d, dx_d
        y, dx = run_stack(par, lay.slab(lay.shard(x)), lay.slab(lay.shard(dy)))
        close(comm, y, lay.slab(y_ref), "stack output")
        close(comm, dx, lay.slab(dx_ref), "stack dx")
        params = [p for layer in par for p in layer.parameters()]
        sum_gradients(params, lay.sp_comm)
        sum_gradients(params, lay.dp_comm)
        ref = [p for layer in serial for p in layer.parameters()]
        for i, (p, q) in enumerate(zip(params, ref, strict=True)):
            close(comm, p.grad, q.grad, f"stack grad {i} {p.shape}")
    finally:
        lay.free()


@pytest.mark.mpi
def test_exchange_and_scatter_add_are_a_conjugate_pair(comm):
    """Arbitrary per-rank halos (crops included): E x cuts the global array, and
    <E x, g> = <x, E^T g> summed over the ranks."""
    p, r = comm.Get_size(), comm.Get_rank()
    rng = np.random.default_rng(7)
    before, after = rng.integers(-2, ROWS + 1, p), rng.integers(-2, ROWS + 1, p)
    xg = rng.standard_normal((2, 3, ROWS * p, 2))
    x = take_slab(xg, 2, r, p)
    xp = halo_exchange(x, 2, before, after, comm, fill=-5.0)
    rows = np.arange(r * ROWS - before[r], (r + 1) * ROWS + after[r])
    expected = np.full((2, 3, len(rows), 2), -5.0)
    inside = (rows >= 0) & (rows < ROWS * p)
    expected[:, :, inside] = xg[:, :, rows[inside]]
    assert_all(comm, np.array_equal(xp, expected), "halo rows")
    g = np.random.default_rng(8 + r).standard_normal(xp.shape)
    dx = halo_scatter_add(g, 2, before, after, comm)
    xp0 = halo_exchange(x, 2, before, after, comm)  # zero padding: linear in x
    lhs = comm.allreduce(float(np.sum(xp0 * g)))
    rhs = comm.allreduce(float(np.sum(x * dx)))
    assert_all(comm, dx.shape == x.shape and abs(lhs - rhs) <= 1e-12 * abs(lhs),
               f"adjoint: {lhs} vs {rhs}")


@pytest.mark.mpi
def test_bad_inputs_are_refused_on_every_rank_before_any_transfer(comm):
    p = comm.Get_size()
    lay = layout(comm, "h")
    try:
        x = np.zeros((1, 3, ROWS * p, 6))
        cases = [  # (layer, message), the message expected at this world size
            (Conv2d(3, 2, (1, 7), rng=np.random.default_rng(0), **F64),
             r"kernel 7 \(dilation 1, extent 7\) is larger than the padded input 6"),
            (Conv2d(3, 2, (ROWS * p + 3, 1), padding=(1, 0), rng=np.random.default_rng(0),
                    **F64), f"larger than the padded input {ROWS * p} \\+ 1 \\+ 1"),
            (Conv2d(3, 2, 3, rng=np.random.default_rng(0), **F64),
             None if 2 % p == 0 else f"spatial size \\({p}\\) must divide the output length"),
            (Conv2d(3, 2, 11, padding=5, rng=np.random.default_rng(0), **F64),
             None if p == 1 else "needs a halo of 5 rows from rank 1, whose slab holds only 4"),
        ]
        for layer, message in cases:
            for spy in lay.spies:
                spy.calls.clear()
            par = SpatialConv(layer, lay.splits)
            with pytest.raises(ValueError, match=message) if message else nullcontext():
                par.forward(lay.slab(x))
            assert_all(comm, message is None or lay.transfers() == 0, f"no transfer: {message}")
        if p > 1:  # a global length the spatial size does not divide
            with pytest.raises(ValueError, match=rf"spatial size \({p}\) must divide the "
                                                 rf"length \({ROWS * p + 1}\)"):
                take_slab(np.zeros((1, 3, ROWS * p + 1, 6)), 2, lay.h, p)
    finally:
        lay.free()
