"""Softmax cross-entropy, mean over the rows.

    loss = (1/N) sum_n [ logsumexp(z_n) - z_n[t_n] ]
    dz   = dloss/N * (softmax(z) - onehot(t))

logsumexp subtracts the row maximum first, so large logits do not overflow. The cache
keeps the logits and the per-row logsumexp (not the probabilities), which is all the
backward pass needs and lets the caller read the logits back.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class CrossEntropyCache(NamedTuple):
    logits: np.ndarray  # (N, V)
    lse: np.ndarray  # (N, 1) logsumexp of each row
    targets: np.ndarray  # (N,) int


def cross_entropy(logits: np.ndarray, targets: np.ndarray) -> tuple[float, CrossEntropyCache]:
    # logits (N, V) float, targets (N,) int -> loss, the mean over N
    rows = np.arange(logits.shape[0])
    zmax = logits.max(axis=1, keepdims=True)  # (N, 1)
    e = logits - zmax  # (N, V)
    np.exp(e, out=e)
    lse = np.log(e.sum(axis=1, keepdims=True))  # (N, 1)
    lse += zmax
    nll = lse[:, 0] - logits[rows, targets]  # (N,)
    loss = float(np.mean(nll, dtype=np.float64))
    return loss, CrossEntropyCache(logits, lse, targets)


def cross_entropy_backward(dloss: float, cache: CrossEntropyCache) -> np.ndarray:
    # dloss scalar -> dlogits (N, V)
    logits, lse, targets = cache
    n = logits.shape[0]
    dlogits = logits - lse  # (N, V), log softmax
    np.exp(dlogits, out=dlogits)  # softmax
    dlogits[np.arange(n), targets] -= 1.0
    dlogits *= float(dloss) / n
    return dlogits
