"""Spatial (domain) parallelism: every activation split into slabs along spatial axes.

The ranks of a spatial group hold the same parameters and the same samples, and each
holds an equal slab of every activation ``(N, C, *S)`` along one spatial axis, or a
grid of slabs along two (or more): one ``Split(axis, comm)`` per split axis, ``comm``
ordering the ranks along that axis. A window operation (convolution, pooling) reads
a few rows beyond its slab: the *halo*, received from the neighbours before the
operation, whose gradient goes back to them and is added there after it:

    forward   halo_exchange     my edge rows -> neighbours, theirs -> my halo;
                                the global borders get the padding value instead
    backward  halo_scatter_add  my halo's gradient -> its owner, who adds it;
                                the padding's gradient is dropped

over the split axis's communicator, point to point with the two neighbours only
(a conjugate pair, like ``pad``/``unpad`` in ``nn.conv``). Two split axes compose:
exchange along H, then along W on the H-extended slab, so the corners arrive with
the second exchange; backward runs the two adjoints in the reverse order.

Slab arithmetic (``slab_rows``, ``window_halo``, pure). Rank ``r`` of ``p`` holds input
rows ``[r n, (r + 1) n)``, ``n = L / p``, and must produce the serial output rows
``[r m, (r + 1) m)``, ``m = Lo / p``. With kernel ``k``, stride ``s``, dilation ``d``
(extent ``e = d (k - 1) + 1``) and padding ``(lo, hi)``, output row ``j`` reads input
rows ``j s - lo ... j s - lo + e - 1``, so rank ``r`` reads ``[r m s - lo, (r + 1) m s
- s + e - lo)``: its halo is ``before = r (n - m s) + lo`` rows and ``after =
(r + 1) (m s - n) - s + e - lo`` rows (negative: rows of its own slab it does not
read, cropped). When ``m s = n`` (stride dividing the slab) the halo is the same on
every rank; otherwise it differs per rank, and the table holds every rank's entry.
Refused, with the values named: ``p`` not dividing ``L`` or ``Lo``, a kernel wider than
the padded input, and a halo wider than the neighbour's slab (a halo comes from the
nearest neighbour only: error, never a wrong answer).

Layers: ``SpatialConv`` wraps a ``ConvNd`` (halo exchange, then ``forward_padded``;
``backward_padded``, then halo scatter-add), ``SpatialPool`` a max or average pool.
Parameter gradients stay local partial sums: ``sum_gradients(params, comm)`` adds
them over the spatial group (and the data group, with its own call or a communicator
that spans both). BatchNorm needs its statistics over the whole spatial group:
``batchnorm_reduce(comm)`` is its ``reduce`` hook. Communicators are arguments; in a
training run they would come from ``Topology`` (see the end of this docstring).
Spans use the ``halo`` category of the step breakdown (``hpctrain.trace``).

Proposed grid with a fourth axis ``sp`` (not yet in ``Topology``), between tensor
and data parallelism so that a spatial group sits on one node::

    rank = ((pp_rank * dp + dp_rank) * sp + sp_rank) * tp + tp_rank
    sp_rank = h_rank * sp_w + w_rank           (sp = sp_h * sp_w slabs)

8 ranks, dp = 2, sp = 4 as 2 x 2 slabs of (H, W), tp = pp = 1 (the layout
``tests/mpi/test_spatial_mpi.py`` builds)::

    rank | dp sp (h w) | spatial group  H comm  W comm | data group
    -----+-------------+-------------------------------+-----------
      0  |  0  0 (0 0) |   [0..3]       [0, 2]  [0, 1] |  [0, 4]
      1  |  0  1 (0 1) |   [0..3]       [1, 3]  [0, 1] |  [1, 5]
      2  |  0  2 (1 0) |   [0..3]       [0, 2]  [2, 3] |  [2, 6]
      3  |  0  3 (1 1) |   [0..3]       [1, 3]  [2, 3] |  [3, 7]
      4  |  1  0 (0 0) |   [4..7]       [4, 6]  [4, 5] |  [0, 4]
      5  |  1  1 (0 1) |   [4..7]       [5, 7]  [4, 5] |  [1, 5]
      6  |  1  2 (1 0) |   [4..7]       [4, 6]  [6, 7] |  [2, 6]
      7  |  1  3 (1 1) |   [4..7]       [5, 7]  [6, 7] |  [3, 7]
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from hpctrain import trace
from hpctrain.nn.batchnorm import serial_sum
from hpctrain.nn.conv import ConvCache, ConvNd, _check_input, pad, unpad
from hpctrain.nn.module import Module, Parameter
from hpctrain.nn.pool import MaxPoolNd, _Pool

# message tags: forward halos travel to the right (the receiver's `before`) or left
_TO_RIGHT, _TO_LEFT, _GRAD_TO_RIGHT, _GRAD_TO_LEFT = 0, 1, 2, 3


# ---------------------------------------------------------------------------------
# slab arithmetic (pure)


def slab_rows(length: int, rank: int, size: int) -> slice:
    """The rows ``[r n, (r + 1) n)``, ``n = length / size``, of a global axis rank r holds."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"rank ({rank}) must be in [0, size ({size}))")
    if length % size:
        raise ValueError(f"the spatial size ({size}) must divide the length ({length}) "
                         f"of the split axis")
    n = length // size
    return slice(rank * n, (rank + 1) * n)


def take_slab(x: np.ndarray, axis: int, rank: int, size: int) -> np.ndarray:
    """Rank ``rank``'s slab of the global array ``x`` along ``axis`` (a view)."""
    return _take(x, axis, slab_rows(x.shape[axis], rank, size))


class Halo(NamedTuple):
    """One window operation along one split axis, for every rank of its group.

    ``before[r]``/``after[r]``: rows rank r adds before/after its slab (from its
    neighbours, or the padding value at a global border); negative: rows of its own
    slab it drops. Its padded slab then has ``(out_rows - 1) s + e`` rows.
    """

    length: int  # L, global input rows
    out_length: int  # Lo, global output rows
    before: tuple[int, ...]
    after: tuple[int, ...]

    @property
    def rows(self) -> int:
        return self.length // len(self.before)

    @property
    def out_rows(self) -> int:
        return self.out_length // len(self.before)


def window_halo(length: int, size: int, kernel: int, stride: int = 1, dilation: int = 1,
                pads: tuple[int, int] = (0, 0), what: str = "window") -> Halo:
    """The halo table of a window (kernel, stride, dilation, padding (lo, hi)) over a
    global axis of ``length`` rows split over ``size`` ranks (module docstring)."""
    lo, hi = pads
    extent = dilation * (kernel - 1) + 1
    if length + lo + hi < extent:
        raise ValueError(f"{what}: kernel {kernel} (dilation {dilation}, extent {extent}) is "
                         f"larger than the padded input {length} + {lo} + {hi}")
    n = slab_rows(length, 0, size).stop
    out = (length + lo + hi - extent) // stride + 1
    if out % size:
        raise ValueError(f"{what}: the spatial size ({size}) must divide the output length "
                         f"({out}, from input length {length}, kernel {kernel}, stride "
                         f"{stride}, dilation {dilation}, padding {pads})")
    m = out // size
    before = tuple(r * (n - m * stride) + lo for r in range(size))
    after = tuple((r + 1) * (m * stride - n) - stride + extent - lo for r in range(size))
    for r in range(size):
        for side, rows, peer in (("before", before[r], r - 1), ("after", after[r], r + 1)):
            if 0 <= peer < size and rows > n:
                raise ValueError(f"{what}: rank {r} of {size} needs a halo of {rows} rows "
                                 f"from rank {peer}, whose slab holds only {n} of the "
                                 f"{length} rows (a slab thinner than the halo; use fewer "
                                 f"spatial ranks or a larger input)")
            if rows < -n:
                raise ValueError(f"{what}: rank {r} of {size} would drop {-rows} rows "
                                 f"{side} its slab of {n}: its output rows lie beyond its "
                                 f"input slab (use fewer spatial ranks)")
    return Halo(length, out, before, after)


def check_chain(length: int, size: int, chain: Sequence, what: str = "layer") -> int:
    """Walk a model's operations along its split axis over ``size`` slabs (pure): each
    entry a window ``(kernel, stride, dilation, (lo, hi))`` checked by ``window_halo``,
    or an int ``f``, nearest upsampling by f. Returns the final global length; raises
    ValueError naming the first operation that does not fit."""
    for i, op in enumerate(chain):
        if isinstance(op, int):
            length *= op
            continue
        kernel, stride, dilation, pads = op
        length = window_halo(length, size, kernel, stride, dilation, pads,
                             f"{what} {i}").out_length
    return length


# ---------------------------------------------------------------------------------
# the conjugate pair


def halo_exchange(x: np.ndarray, axis: int, before, after, comm: Any,
                  fill: float = 0.0) -> np.ndarray:
    """Forward: this rank's slab ``x (..., n, ...)`` along ``axis`` -> its padded slab
    ``(..., before + n + after, ...)``. ``before``/``after``: an int, the same on every
    rank, or one per rank of ``comm`` (``Halo.before``). Over ``comm``, point to point:
    my first ``after[r-1]`` rows go to rank r-1, my last ``before[r+1]`` to rank r+1;
    ``fill`` at the global borders. Its conjugate in backward: ``halo_scatter_add``."""
    p, r = comm.Get_size(), comm.Get_rank()
    before, after = _per_rank(before, p), _per_rank(after, p)
    n, b, a = x.shape[axis], before[r], after[r]
    sends = {}
    if r > 0 and after[r - 1] > 0:
        sends[(r - 1, _TO_LEFT)] = _take(x, axis, slice(0, after[r - 1]))
    if r < p - 1 and before[r + 1] > 0:
        sends[(r + 1, _TO_RIGHT)] = _take(x, axis, slice(n - before[r + 1], n))
    recvs = {}
    if r > 0 and b > 0:
        recvs[(r - 1, _TO_RIGHT)] = _rows_like(x, axis, b)
    if r < p - 1 and a > 0:
        recvs[(r + 1, _TO_LEFT)] = _rows_like(x, axis, a)
    _transfer(comm, sends, recvs, "halo_exchange", axis)
    left = recvs.get((r - 1, _TO_RIGHT), _rows_like(x, axis, max(b, 0), fill))
    right = recvs.get((r + 1, _TO_LEFT), _rows_like(x, axis, max(a, 0), fill))
    mid = _take(x, axis, slice(max(-b, 0), n - max(-a, 0)))
    return np.concatenate([left, mid, right], axis=axis)


def halo_scatter_add(dxp: np.ndarray, axis: int, before, after, comm: Any) -> np.ndarray:
    """Backward of ``halo_exchange``: the gradient of the padded slab ``dxp (..., before
    + n + after, ...)`` -> that of the slab ``(..., n, ...)``. Over ``comm``: my halo's
    gradient goes back to the neighbour that sent the rows, which adds it to them;
    the padding's gradient is dropped and cropped rows get zero."""
    p, r = comm.Get_size(), comm.Get_rank()
    before, after = _per_rank(before, p), _per_rank(after, p)
    b, a = before[r], after[r]
    length = dxp.shape[axis]
    n = length - b - a
    sends = {}
    if r > 0 and b > 0:
        sends[(r - 1, _GRAD_TO_LEFT)] = _take(dxp, axis, slice(0, b))
    if r < p - 1 and a > 0:
        sends[(r + 1, _GRAD_TO_RIGHT)] = _take(dxp, axis, slice(length - a, length))
    recvs = {}
    if r > 0 and after[r - 1] > 0:
        recvs[(r - 1, _GRAD_TO_RIGHT)] = _rows_like(dxp, axis, after[r - 1])
    if r < p - 1 and before[r + 1] > 0:
        recvs[(r + 1, _GRAD_TO_LEFT)] = _rows_like(dxp, axis, before[r + 1])
    _transfer(comm, sends, recvs, "halo_scatter_add", axis)
    dx = _rows_like(dxp, axis, n, 0.0)
    _take(dx, axis, slice(max(-b, 0), n - max(-a, 0)))[...] = \
        _take(dxp, axis, slice(max(b, 0), length - max(a, 0)))
    if (r - 1, _GRAD_TO_RIGHT) in recvs:
        _take(dx, axis, slice(0, after[r - 1]))[...] += recvs[(r - 1, _GRAD_TO_RIGHT)]
    if (r + 1, _GRAD_TO_LEFT) in recvs:
        _take(dx, axis, slice(n - before[r + 1], n))[...] += recvs[(r + 1, _GRAD_TO_LEFT)]
    return dx


def _transfer(comm: Any, sends: dict, recvs: dict, name: str, axis: int) -> None:
    """Post every receive, then every send, and wait for all: ``(peer, tag) -> array``.
    Both sides derive the same messages from the same table, so every send has its
    receive; a rank with no neighbour to talk to returns at once."""
    if not sends and not recvs:
        return
    from mpi4py import MPI

    nbytes = sum(v.nbytes for v in sends.values())
    with trace.span(name, "halo", axis=axis, bytes=nbytes):
        reqs = [comm.Irecv(buf, source=peer, tag=tag) for (peer, tag), buf in recvs.items()]
        keep = [np.ascontiguousarray(v) for v in sends.values()]  # alive until Waitall
        reqs += [comm.Isend(buf, dest=peer, tag=tag)
                 for ((peer, tag), _), buf in zip(sends.items(), keep, strict=True)]
        MPI.Request.Waitall(reqs)


def _per_rank(rows, p: int) -> tuple[int, ...]:
    if isinstance(rows, (int, np.integer)):
        return (int(rows),) * p
    rows = tuple(int(v) for v in rows)
    if len(rows) != p:
        raise ValueError(f"a halo per rank needs {p} entries (the communicator size), "
                         f"got {len(rows)}")
    return rows


def _take(x: np.ndarray, axis: int, rows: slice) -> np.ndarray:
    return x[(slice(None),) * axis + (rows,)]


def _rows_like(x: np.ndarray, axis: int, rows: int, fill: float | None = None) -> np.ndarray:
    shape = (*x.shape[:axis], rows, *x.shape[axis + 1:])
    return np.empty(shape, x.dtype) if fill is None else np.full(shape, fill, x.dtype)


# ---------------------------------------------------------------------------------
# layers


class Split(NamedTuple):
    axis: int  # array axis of (N, C, *S): 2 is the first spatial axis
    comm: Any  # the ranks holding the slabs along it, in order


def _splits(splits: Sequence[tuple[int, Any]], nd: int) -> tuple[Split, ...]:
    out = tuple(Split(int(a), c) for a, c in splits)
    axes = [s.axis for s in out]
    if not out or len(set(axes)) != len(axes) or not all(2 <= a < nd + 2 for a in axes):
        raise ValueError(f"split axes {axes} must be distinct spatial axes of (N, C, *S) "
                         f"with {nd} spatial axes: in [2, {nd + 2})")
    return out


def _global_view(x: np.ndarray, splits: tuple[Split, ...]) -> np.ndarray:
    """A zero-memory array with the global shape, for shape checks before any transfer."""
    shape = list(x.shape)
    for s in splits:
        shape[s.axis] *= s.comm.Get_size()
    return np.broadcast_to(np.zeros((), x.dtype), tuple(shape))


def _plan(x: np.ndarray, splits: tuple[Split, ...], kernel, stride, dilation, pads,
          what: str) -> tuple[Halo, ...]:
    """The halo table of each split axis, refusing bad shapes on every rank alike."""
    halos = []
    for s in splits:
        i = s.axis - 2
        halos.append(window_halo(x.shape[s.axis] * s.comm.Get_size(), s.comm.Get_size(),
                                 kernel[i], stride[i], dilation[i], pads[i],
                                 f"{what} on axis {s.axis}"))
    return tuple(halos)


def _exchange(x, splits, halos, fill: float = 0.0) -> np.ndarray:
    for s, h in zip(splits, halos, strict=True):
        x = halo_exchange(x, s.axis, h.before, h.after, s.comm, fill)
    return x


def _scatter_add(dxp, splits, halos) -> np.ndarray:
    for s, h in reversed(tuple(zip(splits, halos, strict=True))):
        dxp = halo_scatter_add(dxp, s.axis, h.before, h.after, s.comm)
    return dxp


def _local_pads(pads, splits) -> tuple[tuple[int, int], ...]:
    """The layer's padding with the split axes' removed (their halo exchange pads)."""
    split = {s.axis - 2 for s in splits}
    return tuple((0, 0) if i in split else p for i, p in enumerate(pads))


class SpatialConvCache(NamedTuple):
    conv: ConvCache
    halos: tuple[Halo, ...]  # one per split, in split order


class SpatialConv(Module):
    """A ``ConvNd`` on slabs: ``y = conv.forward_padded(pad(exchange(x)))``, exactly the
    serial output's slab. Backward: ``backward_padded``, then the halo scatter-add.
    The weight and bias gradients are this rank's share: ``sum_gradients`` over the
    spatial group gives the serial ones. Transfers over each split's communicator."""

    def __init__(self, conv: ConvNd, splits: Sequence[tuple[int, Any]]):
        # the conv's parameters first, under its own names (``weight``, ``bias``): a
        # model's parameter names, and so its checkpoints, do not depend on sp
        self.weight, self.bias = conv.weight, conv.bias
        self.conv = conv
        self.splits = _splits(splits, conv.nd)
        self.local_pads = _local_pads(conv.pads, self.splits)

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, SpatialConvCache]:
        # x (N, C, *S) this rank's slab -> y (N, O, *So) its slab of the serial output
        c = self.conv
        _check_input(type(c).__name__, _global_view(x, self.splits), c.nd, c.weight.shape[1],
                     c.kernel_size, c.dilation, c.pads)
        halos = _plan(x, self.splits, c.kernel_size, c.stride, c.dilation, c.pads,
                      type(c).__name__)
        xp = pad(_exchange(x, self.splits, halos), self.local_pads)
        y, cache = c.forward_padded(xp)
        return y, SpatialConvCache(cache, halos)

    def backward(self, dy: np.ndarray, cache: SpatialConvCache,
                 need_dx: bool = True) -> np.ndarray | None:
        # dy (N, O, *So) -> dx (N, C, *S); need_dx=False (the first layer) on every rank
        dxp = self.conv.backward_padded(dy, cache.conv, need_dx)
        if dxp is None:
            return None
        return _scatter_add(unpad(dxp, self.local_pads), self.splits, cache.halos)


class SpatialPoolCache(NamedTuple):
    pool: Any  # the local pool's cache
    halos: tuple[Halo, ...]


class SpatialPool(Module):
    """A max or average pool (``MaxPoolNd``/``AvgPoolNd``) on slabs: the halo exchange
    pads the split axes' global borders as the pool would (-inf for max, 0 for
    average), then the pool runs on the padded slab without padding along them."""

    def __init__(self, pool: _Pool, splits: Sequence[tuple[int, Any]]):
        self.pool = pool
        self.splits = _splits(splits, pool.nd)
        self.fill = -np.inf if isinstance(pool, MaxPoolNd) else 0.0
        self.local = copy.copy(pool)
        self.local.pads = _local_pads(pool.pads, self.splits)

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, SpatialPoolCache]:
        # x (N, C, *S) this rank's slab -> y (N, C, *So) its slab of the serial output
        p = self.pool
        p._out_shape(_global_view(x, self.splits))  # checks the global shape
        halos = _plan(x, self.splits, p.kernel_size, p.stride, (1,) * p.nd, p.pads,
                      type(p).__name__)
        y, cache = self.local.forward(_exchange(x, self.splits, halos, self.fill))
        return y, SpatialPoolCache(cache, halos)

    def backward(self, dy: np.ndarray, cache: SpatialPoolCache) -> np.ndarray:
        # dy (N, C, *So) -> dx (N, C, *S)
        return _scatter_add(self.local.backward(dy, cache.pool), self.splits, cache.halos)


# ---------------------------------------------------------------------------------
# sums over the spatial group


def batchnorm_reduce(comm: Any, category: str = "halo"
                     ) -> Callable[[np.ndarray], np.ndarray]:
    """BatchNorm's ``reduce`` hook over ``comm`` (the spatial group, or spatial x data for
    statistics over the whole batch; the data group for synchronised BatchNorm): an
    all-reduce SUM of the float64 statistics, collective, once in forward and once in
    backward, traced under ``category``; ``serial_sum`` for one rank."""
    if comm.Get_size() == 1:
        return serial_sum

    def reduce(a: np.ndarray) -> np.ndarray:
        from mpi4py import MPI

        total = np.ascontiguousarray(a, dtype=np.float64).copy()
        with trace.span("batchnorm_all_reduce", category, bytes=total.nbytes):
            comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
        return total

    return reduce


def sum_gradients(params: Sequence[Parameter], comm: Any) -> None:
    """``p.grad = sum over comm of p.grad`` for every parameter, as one all-reduce of
    the packed gradients (the same parameters, in the same order, on every rank).
    Collective; nothing for one rank."""
    if comm.Get_size() == 1 or not params:
        return
    from mpi4py import MPI

    dtype = np.result_type(*[p.grad.dtype for p in params])
    flat = np.concatenate([p.grad.ravel().astype(dtype, copy=False) for p in params])
    with trace.span("sum_gradients", "halo", bytes=flat.nbytes):
        comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
    start = 0
    for p in params:
        p.grad[...] = flat[start:start + p.size].reshape(p.shape)
        start += p.size
