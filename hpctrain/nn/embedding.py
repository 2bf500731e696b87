"""EmbeddingBag: pooled row lookups of a table, with a sparse gradient.

A sample holds ``w`` slots of ids into a table ``W (rows, dim)``; ``-1`` marks an empty
slot (a bag with fewer members than ``w``). With ``s_bj = 1`` for a filled slot and
``0`` for an empty one, and ``c_b = sum_j s_bj`` the bag's size:

    sum pooling    y_b = sum_j  s_bj W[ids_bj]                       (b, dim)
    mean pooling   y_b = sum_j (s_bj / max(c_b, 1)) W[ids_bj]        (an empty bag: 0)

    backward       dW[r] = sum over (b, j) with ids_bj = r of a_bj dy_b

where ``a_bj`` is the slot's factor above. Backward hands the table's ``SparseGrad``
only the rows of the batch and their summed gradient: no (rows, dim) array is
allocated or zeroed per step, so a step costs the same for a table of ten thousand
rows as for one of ten million (``benchmarks/bench_embedding.py``).

A layer that shards the table over ranks replaces this one by keeping its interface:
``forward(ids) -> (y, cache)``, ``backward(dy, cache) -> None`` (ids take no gradient),
the gradient left in its own table's ``SparseGrad`` (rows of its shard).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from hpctrain.nn.module import Module, SparseParameter

POOLINGS = ("sum", "mean")


class EmbeddingBagCache(NamedTuple):
    ids: np.ndarray  # (b, w) int64, -1 in empty slots
    factor: np.ndarray  # (b, w) each slot's weight in the pool: 0 empty, 1 or 1/c_b


def check_ids(ids: np.ndarray, rows: int, name: str) -> None:
    """Raise ValueError naming the table and the values if an id of ``ids`` is not in
    [-1, rows) (-1: an empty slot)."""
    if ids.size == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < -1 or hi >= rows:
        bad = ids[(ids < -1) | (ids >= rows)]
        raise ValueError(f"table {name!r}: ids must lie in [0, {rows}) (or be -1, an empty "
                         f"slot); the batch holds {bad.size} outside, e.g. "
                         f"{sorted(set(bad.tolist()))[:5]} (smallest {lo}, largest {hi})")


class EmbeddingBag(Module):
    """A table ``weight (rows, dim)`` (a ``SparseParameter``) pooled over each sample's
    slots by ``pooling`` ("sum" or "mean"); ``name`` is the table's name in messages.

    ``init`` (rows, dim) is the initial table (the model draws it).
    """

    def __init__(self, init: np.ndarray, *, pooling: str = "sum", name: str = "table"):
        if pooling not in POOLINGS:
            raise ValueError(f"table {name!r}: pooling ({pooling!r}) must be one of "
                             f"{', '.join(POOLINGS)}")
        self.weight = SparseParameter(init)
        self.pooling, self.name = pooling, name

    @property
    def rows(self) -> int:
        return self.weight.shape[0]

    @property
    def dim(self) -> int:
        return self.weight.shape[1]

    def forward(self, ids: np.ndarray) -> tuple[np.ndarray, EmbeddingBagCache]:
        # ids (b, w) int, -1 empty -> y (b, dim)
        ids = np.asarray(ids, np.int64)
        check_ids(ids, self.rows, self.name)
        W = self.weight.data
        filled = ids >= 0  # (b, w)
        factor = filled.astype(W.dtype)
        if self.pooling == "mean":
            factor /= np.maximum(factor.sum(axis=1, keepdims=True), 1)
        if ids.shape[1] == 1:  # one slot: no (b, w, dim) temporary
            y = W[np.maximum(ids[:, 0], 0)] * factor  # (b, dim)
        else:
            y = np.einsum("bw,bwd->bd", factor, W[np.maximum(ids, 0)])  # (b, dim)
        return y, EmbeddingBagCache(ids, factor)

    def backward(self, dy: np.ndarray, cache: EmbeddingBagCache) -> None:
        # dy (b, dim): the rows of the batch get sum a_bj dy_b (SparseGrad.add sums repeats)
        b, j = np.nonzero(cache.ids >= 0)  # (n,) the filled slots
        values = dy[b] * cache.factor[b, j][:, None]  # (n, dim)
        self.weight.grad.add(cache.ids[b, j], values)
        return None
