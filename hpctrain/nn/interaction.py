"""DLRM's pairwise dot-product interaction of feature vectors.

The bottom MLP's output ``z (b, d)`` and the F pooled embeddings ``e (b, F, d)`` are
stacked into ``T (b, n, d)``, ``n = F + 1``; every pair of distinct vectors meets once:

    Z = T T^T                               (b, n, n)
    y = [z, Z[:, i, j] for i < j]           (b, d + n (n - 1) / 2), pairs row by row

    backward   dZ[:, i, j] = dy's pair (i, j) for i < j, 0 elsewhere
               dT = (dZ + dZ^T) T;   dz = dy[:, :d] + dT[:, 0];   de = dT[:, 1:]
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from hpctrain.nn.module import Module


def pairs(n: int) -> int:
    """The number of pairs of ``n`` vectors: n (n - 1) / 2."""
    return n * (n - 1) // 2


class DotInteractionCache(NamedTuple):
    T: np.ndarray  # (b, n, d) the stacked vectors


class DotInteraction(Module):
    """No parameters; ``forward(z, e)`` and ``backward(dy, cache) -> (dz, de)``."""

    def forward(self, z: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, DotInteractionCache]:
        # z (b, d), e (b, F, d) -> y (b, d + n (n - 1) / 2)
        T = np.concatenate([z[:, None, :], e], axis=1)  # (b, n, d)
        Z = T @ T.transpose(0, 2, 1)  # (b, n, n)
        i, j = np.triu_indices(T.shape[1], k=1)
        return np.concatenate([z, Z[:, i, j]], axis=1), DotInteractionCache(T)

    def backward(self, dy: np.ndarray,
                 cache: DotInteractionCache) -> tuple[np.ndarray, np.ndarray]:
        # dy (b, d + n (n - 1) / 2) -> dz (b, d), de (b, F, d)
        T = cache.T
        b, n, d = T.shape
        i, j = np.triu_indices(n, k=1)
        dZ = np.zeros((b, n, n), T.dtype)
        dZ[:, i, j] = dy[:, d:]
        dT = (dZ + dZ.transpose(0, 2, 1)) @ T  # (b, n, d)
        return dy[:, :d] + dT[:, 0], dT[:, 1:]
