"""Parameter and Module: named attributes instead of string-keyed dictionaries.

A ``Parameter`` is an array and its gradient, side by side. A ``Module`` finds its
parameters by walking its own attributes in the order they were assigned, so the
dotted names (``blocks.0.attn.qkv.weight``) follow the constructor and are the same
on every rank. Layers never keep activations on ``self``: ``forward`` returns an
explicit cache that the caller hands back to ``backward``, so one layer can have
several microbatches in flight at once.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

ALIGN = 64  # bytes: where a parameter's or optimizer state's first byte lies


def aligned_empty(shape: tuple[int, ...], dtype, zeros: bool = False) -> np.ndarray:
    """A C-contiguous array whose first byte is on an ``ALIGN``-byte boundary, carved
    from a heap buffer ``ALIGN`` bytes longer (``zeros``: from ``np.zeros``, whose
    large buffers are untouched pages until written, as ``np.zeros`` of the array's
    own would be). NumPy aligns its own buffers to 16 bytes only, and the kernel's
    copy of a checkpoint out of the page cache runs at full speed only into memory
    aligned as the file offset is (the pieces lie on 64-byte boundaries there):
    the benchmark GPT's load took 25.6 ms into NumPy's arrays, 23.2 into aligned ones
    (``benchmarks/README.md``)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    buf = (np.zeros if zeros else np.empty)(nbytes + ALIGN, np.uint8)
    skip = -buf.ctypes.data % ALIGN
    return buf[skip:skip + nbytes].view(dtype).reshape(shape)


def aligned(a: np.ndarray) -> np.ndarray:
    """``a`` if it is C-contiguous and ``ALIGN``-aligned already, else an aligned copy
    (``aligned_empty``): how a Parameter takes the array it is given."""
    if a.flags.c_contiguous and a.ctypes.data % ALIGN == 0:
        return a
    out = aligned_empty(a.shape, a.dtype)
    out[...] = a
    return out


class _Unallocated(NamedTuple):
    """A new Parameter's gradient until it is first read: its shape and dtype only."""

    shape: tuple[int, ...]
    dtype: np.dtype


class Parameter:
    """A trainable array ``data`` and its gradient ``grad`` (same shape and dtype).

    ``backward`` methods accumulate into ``grad`` (``+=``); call ``zero_grad`` once per
    optimizer step, not once per microbatch.

    ``grad`` is allocated (zeros of ``data``'s shape and dtype at construction) when it
    is first read, not in the constructor: a model handed to a wrapper that brings
    gradient buffers of its own (data parallelism's flat buckets, ZeRO's shards) never
    holds a second whole copy of itself while it is built.

    ``add_product(a, b)`` is ``grad += a @ b`` (a weight gradient), written straight
    into ``grad`` when the gradient is known to be zero: unallocated, or untouched
    since ``zero_grad`` (or ``mark_zero``). Any read of ``grad`` forgets that it is
    zero, so whatever else changes it (``+=`` reads it first) makes the next product
    add again, and the next ``zero_grad`` fill it.
    """

    __slots__ = ("data", "_grad", "_zero")

    def __init__(self, data: np.ndarray):
        self.data = aligned(np.ascontiguousarray(data))  # 64-byte aligned: aligned_empty
        self._grad = _Unallocated(self.data.shape, self.data.dtype)
        self._zero = False  # _grad holds zeros that nothing has read since

    @property
    def grad(self):
        g = self._grad
        if type(g) is _Unallocated:
            g = self._grad = np.zeros(g.shape, g.dtype)
        self._zero = False
        return g

    @grad.setter
    def grad(self, value) -> None:
        self._grad = value
        self._zero = False

    def add_product(self, a: np.ndarray, b: np.ndarray) -> None:
        """``grad += a @ b``; with the gradient known to be zero, the product is
        written into it instead (``np.matmul(..., out=)``: no temporary, no pass
        adding it, the same values)."""
        g = self._grad
        if type(g) is _Unallocated:
            self._grad = np.matmul(a, b).astype(g.dtype, copy=False)
        elif self._zero and g.flags.c_contiguous and g.dtype == np.result_type(a, b):
            np.matmul(a, b, out=g)
        else:
            g += a @ b
        self._zero = False

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def size(self) -> int:
        return self.data.size

    def zero_grad(self) -> None:
        if type(self._grad) is not _Unallocated and not self._zero:  # else zeros already
            self._grad.fill(0)
            self._zero = True

    def mark_zero(self, filled: np.ndarray) -> None:
        """The owner of ``grad``'s memory (data parallelism's flat buckets) has just
        filled ``filled`` with zeros: if that is this gradient, ``zero_grad`` need not
        fill it again and ``add_product`` may write into it."""
        if self._grad is filled:
            self._zero = True

    def __repr__(self) -> str:
        return f"Parameter(shape={self.data.shape}, dtype={self.data.dtype})"


def coalesce(rows: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """rows (n,) int, values (n, dim) -> (unique rows ascending (u,), their sums (u, dim)).

    A stable sort then ``np.add.reduceat``: each row's values are added in the order
    given, so the same input gives the same floats on every rank.
    """
    rows = np.asarray(rows, np.int64)
    if len(rows) == 0:
        return rows, values
    order = np.argsort(rows, kind="stable")
    rows = rows[order]
    starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
    return rows[starts], np.add.reduceat(values[order], starts, axis=0)


class SparseGrad:
    """The gradient of a table (rows, dim) by rows: ``rows`` (n,) int64 unique and
    ascending, ``values`` (n, dim) their gradient; every other row's gradient is zero.

    Its cost follows the rows a batch touches, never the table's size: ``add`` merges
    (``coalesce``), ``zero`` empties it, ``grad *= s`` scales the values (clipping),
    ``sq_sum`` is the squared norm. ``to_dense`` allocates the whole table: for tests.
    """

    __slots__ = ("dtype", "rows", "shape", "values")

    def __init__(self, shape: tuple[int, int], dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.zero()

    def zero(self) -> None:
        self.rows = np.empty(0, np.int64)
        self.values = np.empty((0, self.shape[1]), self.dtype)

    def add(self, rows: np.ndarray, values: np.ndarray) -> None:
        """Accumulate ``values`` (n, dim) into ``rows`` (n,), repeats allowed."""
        if len(self.rows):
            rows = np.concatenate([self.rows, rows])
            values = np.concatenate([self.values, values])
        self.rows, self.values = coalesce(rows, values.astype(self.dtype, copy=False))

    def __imul__(self, scale: float) -> SparseGrad:
        self.values *= scale
        return self

    def sq_sum(self) -> float:
        """sum(grad^2), accumulated in float64."""
        v = self.values.reshape(-1).astype(np.float64, copy=False)
        return float(np.dot(v, v))

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes + self.values.nbytes

    def to_dense(self) -> np.ndarray:
        dense = np.zeros(self.shape, self.dtype)
        dense[self.rows] = self.values
        return dense


class SparseParameter(Parameter):
    """A table whose ``grad`` is a ``SparseGrad`` (the rows a batch touched), never a
    dense array: an embedding table (``hpctrain.nn.embedding.EmbeddingBag``).

    Code that reads ``.grad`` as an array refuses it: dense optimizers
    (``hpctrain.optim.optimizers``) and the bucketed all-reduce
    (``hpctrain.parallel.data``) raise naming it. Clipping and the gradient norm
    (``hpctrain.optim.clip``) take both. Its optimizers are in ``hpctrain.optim.sparse``,
    its data-parallel exchange in ``hpctrain.parallel.sparse_data``; checkpoints save
    its ``data`` like any parameter's.
    """

    __slots__ = ()

    def __init__(self, data: np.ndarray):
        self.data = aligned(np.ascontiguousarray(data))
        if self.data.ndim != 2:
            raise ValueError(f"a sparse parameter is a table (rows, dim), not shape "
                             f"{self.data.shape}")
        self.grad = SparseGrad(self.data.shape, self.data.dtype)

    def zero_grad(self) -> None:
        self.grad.zero()

    def __repr__(self) -> str:
        return f"SparseParameter(shape={self.data.shape}, dtype={self.data.dtype})"


def is_sparse(p: Parameter) -> bool:
    return isinstance(p, SparseParameter)


class Module:
    """Base class: parameter discovery by attribute walk; no behaviour of its own.

    Attributes holding a ``Parameter``, a ``Module`` or a list/tuple of Modules are
    walked in definition order. A Parameter reached twice (a tied weight) is listed
    once, under the first name it was reached by.
    """

    def named_parameters(self, prefix: str = "") -> list[tuple[str, Parameter]]:
        named, seen = [], set()
        for name, p in self._walk(prefix):
            if id(p) not in seen:
                seen.add(id(p))
                named.append((name, p))
        return named

    def _walk(self, prefix: str):
        for name, value in vars(self).items():
            if isinstance(value, Parameter):
                yield prefix + name, value
            elif isinstance(value, Module):
                yield from value._walk(f"{prefix}{name}.")
            elif isinstance(value, (list, tuple)):
                for i, item in enumerate(value):
                    if isinstance(item, Module):
                        yield from item._walk(f"{prefix}{name}.{i}.")

    # names of this module's array attributes that are state but not trained (BatchNorm's
    # running statistics): checkpoints save them, optimizers never see them
    buffer_names: tuple[str, ...] = ()

    def named_buffers(self, prefix: str = "") -> list[tuple[str, np.ndarray]]:
        """Every ``buffer_names`` array, walked like the parameters: ``bn.running_mean``."""
        named = [(prefix + name, getattr(self, name)) for name in self.buffer_names]
        for path, child in self._children():
            named += child.named_buffers(f"{prefix}{path}.")
        return named

    def _children(self):
        """(name, module) of each Module attribute, a list's items named ``name.i``."""
        for name, value in vars(self).items():
            if isinstance(value, Module):
                yield name, value
            elif isinstance(value, (list, tuple)):
                for i, item in enumerate(value):
                    if isinstance(item, Module):
                        yield f"{name}.{i}", item

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.zero_grad()

    def num_parameters(self) -> int:
        return sum(p.size for p in self.parameters())
