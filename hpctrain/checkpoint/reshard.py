"""Which part of a global tensor one rank holds, as boxes of the global array.

A checkpoint stores every tensor as *pieces*: boxes ``[start, stop)`` of its global
array, so a checkpoint saved at one layout loads at any other. A rank's array is
described by a ``Sharding``: the tensor-parallel split of ``shards.take_shard``
(``tp_split``, ``tp_blocks``, this rank of ``tp_size``) and, for ZeRO, the flat range
``[lo, hi)`` of that local shard the rank owns.

``segments(sharding)`` cuts the rank's array into ``Segment``s, each one global box.
The qkv weight ``(C, 3C)`` with C = 4 at tp = 2, on tp rank 1, whose local shard
``(4, 6)`` is ``[q_1 | k_1 | v_1]``, two columns each; ZeRO gives this data-parallel
rank the flat range ``[5, 11)`` of that shard::

    local shard (4, 6)         flat range [5, 11) -> runs contiguous in flat order
      q_1   k_1   v_1
    | .  . | .  . | .  5 |     run 0: row 0, column 5     offset 0 -> 1 global box
    | 6  7 | 8  9 | 10 . |     run 1: row 1, columns 0:5  offset 1 -> 3 global boxes
    | ...                |

    local columns  0:2 (q_1)   2:4 (k_1)   4:6 (v_1)
    global columns 2:4         6:8         10:12        (q, k, v each 4 wide)

    segments: (row 0, column 11), (row 1, columns 2:4), (row 1, columns 6:8),
              (row 1, column 10)

Every segment records where it sits in the rank's array (``offset`` into the flat
array, the ``outer`` shape of the contiguous run there, the ``inner`` box of that
run) and the global ``box`` it covers, so saving (``extract``) and loading
(``place``) are the same walk in opposite directions. Pure maths, no MPI.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

Box = tuple[tuple[int, int], ...]  # (start, stop) per axis


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def box_volume(box: Box) -> int:
    return math.prod(box_shape(box))


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None if they do not overlap."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def slices(box: Box, origin: Box | None = None) -> tuple[slice, ...]:
    """Index ``box`` in an array whose first element is ``origin``'s start."""
    base = [0] * len(box) if origin is None else [a for a, _ in origin]
    return tuple(slice(a - o, b - o) for (a, b), o in zip(box, base, strict=True))


def box_name(box: Box) -> str:
    """``"0:16,8:24"``: a box as a dataset name (``"scalar"`` for 0-d)."""
    return ",".join(f"{a}:{b}" for a, b in box) or "scalar"


@dataclass(frozen=True)
class Sharding:
    """What one rank holds of a global array of ``global_shape``.

    ``tp_split`` None: the whole array (replicated over tp). Otherwise the shard
    ``take_shard(full, tp_split, tp_rank, tp_size, tp_blocks)``. ``flat``: only the
    elements ``[lo, hi)`` of that shard flattened in C order (a ZeRO slice), held as
    a 1-D array. ``box``: instead of a tensor-parallel shard, exactly this box of the
    global array (a sharded embedding table's rows or columns, ``parallel.tables``).
    """

    global_shape: tuple[int, ...]
    tp_split: int | None = None
    tp_blocks: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    flat: tuple[int, int] | None = None
    box: Box | None = None

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.box is not None:
            return box_shape(self.box)
        shape = list(self.global_shape)
        if self.tp_split is not None:
            n, parts = shape[self.tp_split], self.tp_blocks * self.tp_size
            if n % parts:
                raise ValueError(f"cannot split axis {self.tp_split} of {self.global_shape} "
                                 f"into {self.tp_blocks} block(s) of {self.tp_size} shard(s)")
            shape[self.tp_split] = n // self.tp_size
        return tuple(shape)

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the array the rank holds."""
        if self.flat is None:
            return self.local_shape
        return (self.flat[1] - self.flat[0],)


@dataclass(frozen=True)
class Segment:
    """``array.reshape(-1)[offset : offset + prod(outer)].reshape(outer)[inner]`` is
    the global ``box``."""

    offset: int
    outer: tuple[int, ...]
    inner: Box
    box: Box


def flat_runs(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[int, Box]]:
    """Cut the flat range ``[lo, hi)`` of a C-order array of ``shape`` into boxes,
    each contiguous in flat order: ``(offset from lo, box)``, in order. At most
    ``2 ndim - 1`` boxes: a ragged head, whole rows, a ragged tail, recursively."""
    if lo >= hi:
        return []
    if not shape:
        return [(0, ())]
    row = math.prod(shape[1:])
    a, ra = divmod(lo, row)
    b, rb = divmod(hi, row)
    if a == b:  # inside one row along axis 0
        return [(off, ((a, a + 1), *sub)) for off, sub in flat_runs(shape[1:], ra, rb)]
    runs, pos = [], 0
    if ra:  # the ragged head: the end of row a
        runs += [(off, ((a, a + 1), *sub)) for off, sub in flat_runs(shape[1:], ra, row)]
        pos, a = row - ra, a + 1
    if b > a:  # whole rows
        runs.append((pos, ((a, b), *full_box(shape[1:]))))
        pos += (b - a) * row
    if rb:  # the ragged tail: the start of row b
        runs += [(pos + off, ((b, b + 1), *sub)) for off, sub in flat_runs(shape[1:], 0, rb)]
    return runs


def _to_global(local: Box, sh: Sharding) -> list[tuple[Box, Box]]:
    """A box of the local shard -> ``(inner box relative to it, global box)`` pairs,
    cut where the split axis crosses from one of the ``tp_blocks`` parts to the next."""
    rel = full_box(box_shape(local))
    if sh.box is not None:  # the held array is the box itself
        return [(rel, tuple((a + b0, b + b0) for (a, b), (b0, _)
                            in zip(local, sh.box, strict=True)))]
    if sh.tp_split is None:
        return [(rel, local)]
    ax = sh.tp_split
    piece = sh.local_shape[ax] // sh.tp_blocks  # this rank's width in each block
    part = sh.global_shape[ax] // sh.tp_blocks  # one block's global width
    start, stop = local[ax]
    out = []
    for k in range(start // piece, -(-stop // piece)):
        a, b = max(start, k * piece), min(stop, (k + 1) * piece)
        g0 = k * part + sh.tp_rank * piece + (a - k * piece)
        inner = rel[:ax] + ((a - start, b - start),) + rel[ax + 1:]
        out.append((inner, local[:ax] + ((g0, g0 + b - a),) + local[ax + 1:]))
    return out


def segments(sh: Sharding) -> list[Segment]:
    """The global boxes of what ``sh`` holds, with where each sits in the held array.

    The boxes are disjoint and together hold every element of the array once."""
    local = sh.local_shape
    if sh.flat is None:
        runs = [(0, full_box(local))]
    else:
        lo, hi = sh.flat
        if not 0 <= lo <= hi <= math.prod(local):
            raise ValueError(f"flat range [{lo}, {hi}) is outside the shard {local}")
        runs = flat_runs(local, lo, hi)
    out = []
    for offset, run in runs:
        for inner, box in _to_global(run, sh):
            out.append(Segment(offset, box_shape(run), inner, box))
    return out


def region(array: np.ndarray, seg: Segment) -> np.ndarray:
    """The view of the held ``array`` that holds ``seg.box`` (shape of the box)."""
    if not array.flags.c_contiguous:
        raise ValueError("a held array must be C-contiguous (it is written in place)")
    run = array.reshape(-1)[seg.offset:seg.offset + math.prod(seg.outer)].reshape(seg.outer)
    return run[slices(seg.inner)]


def extract(array: np.ndarray, seg: Segment) -> np.ndarray:
    """The values of ``seg.box`` from the held ``array`` (a contiguous copy)."""
    return np.ascontiguousarray(region(array, seg))


def place(array: np.ndarray, seg: Segment, values: np.ndarray) -> None:
    """Write the values of ``seg.box`` into the held ``array``, in place."""
    region(array, seg)[...] = values


def tiles(boxes: list[Box], shape: tuple[int, ...]) -> str | None:
    """None if ``boxes`` cover the array of ``shape`` exactly once; else what is wrong
    (``tiles_bounds``)."""
    inside = full_box(shape)
    if len(boxes) == 1 and boxes[0] == inside:  # one whole piece: most tensors
        return None
    for box in boxes:
        if len(box) != len(shape):
            return f"piece {box_name(box)} lies outside the shape {shape}"
    ends = np.array(boxes, dtype=np.int64).reshape(len(boxes), len(shape), 2)
    return tiles_bounds(ends[:, :, 0], ends[:, :, 1], shape)


def tiles_bounds(lo: np.ndarray, hi: np.ndarray, shape: tuple[int, ...]) -> str | None:
    """None if the boxes ``[lo[k], hi[k])`` (``(n, ndim)`` int64 each: a version 4
    index's piece table, as it is) cover the array of ``shape`` exactly once; else
    what is wrong.

    In NumPy, for the indexes of many ranks (1,024 pieces a tensor and more): the
    boxes sorted by their start along the axis that leaves the fewest candidate pairs
    (on a grid of pieces, an axis it is cut along), and only the pairs that meet along
    that axis compared on every axis."""
    n, d = lo.shape[0], len(shape)

    def box(k: int) -> Box:
        return tuple(zip(lo[k].tolist(), hi[k].tolist(), strict=True))

    if lo.shape != (n, d) or hi.shape != (n, d):
        return f"pieces of {lo.shape[1:]} axes lie outside the shape {shape}"
    if d == 0:  # a scalar: one piece; two or more overlap, none misses it
        if n == 0:
            return "the pieces cover 0 of 1 elements (a piece is missing)"
        return None if n == 1 else "pieces scalar and scalar overlap"
    outside = ((lo < 0) | (hi > np.array(shape)) | (lo >= hi)).any(axis=1)
    if outside.any():
        return f"piece {box_name(box(int(np.argmax(outside))))} lies outside the shape {shape}"
    if n == 1:  # inside, so it covers the shape once if it has its volume
        covered = int((hi - lo).prod())
    else:
        first = _overlapping(lo, hi)
        if first is not None:
            a, b = sorted((box(first[0]), box(first[1])))
            return f"pieces {box_name(a)} and {box_name(b)} overlap"
        covered = int((hi - lo).prod(axis=1).sum())
    if covered != math.prod(shape):
        return (f"the pieces cover {covered} of {math.prod(shape)} elements "
                f"(a piece is missing)")
    return None


def _overlapping(lo: np.ndarray, hi: np.ndarray, chunk: int = 1 << 22
                 ) -> tuple[int, int] | None:
    """Two boxes (rows of ``lo``/``hi``, non-empty) that overlap, or None."""
    n, best = len(lo), None
    for axis in range(lo.shape[1]):  # the axis with the fewest pairs that meet along it
        order = np.argsort(lo[:, axis], kind="stable")
        reach = np.searchsorted(lo[order, axis], hi[order, axis], side="left")
        counts = np.maximum(reach - np.arange(n) - 1, 0)  # later boxes starting inside
        if best is None or counts.sum() < best[0].sum():
            best = counts, order
    counts, order = best
    rows = np.flatnonzero(counts)
    # the pairs (i, j) of sorted positions, i < j < reach[i], about `chunk` at a time
    upto = np.cumsum(counts[rows])
    cuts = np.searchsorted(upto, np.arange(chunk, int(upto[-1]) if len(rows) else 0, chunk))
    for some in np.split(rows, np.unique(cuts)):
        if not len(some):
            continue
        k = counts[some]
        i = np.repeat(some, k)
        j = i + 1 + np.arange(len(i)) - np.repeat(np.cumsum(k) - k, k)
        a, b = order[i], order[j]
        meet = (np.maximum(lo[a], lo[b]) < np.minimum(hi[a], hi[b])).all(axis=1)
        if meet.any():
            first = int(np.argmax(meet))
            return int(a[first]), int(b[first])
    return None
