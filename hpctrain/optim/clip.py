"""Global gradient-norm clipping, in two parts so a parallel caller can reduce between.

    norm  = sqrt(sum over parameters of sum(grad^2))            grad_norm
    scale = min(1, max_norm / (norm + 1e-6));  grad *= scale     clip_grads

A data- or tensor-parallel caller sums the squared local norms across ranks and hands
the global norm to ``clip_grads``; every rank then scales by the same factor. A table's
sparse gradient (``SparseGrad``: the rows a batch touched) counts its values, and
scales them, exactly as the dense gradient it stands for.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from hpctrain.nn.module import Parameter, is_sparse
from hpctrain.nn.threads import over_rows

_CHUNK = 1 << 16  # elements converted to float64 at a time


def grad_sq_sum(params: Iterable[Parameter]) -> float:
    """sum(grad^2) over all parameters, accumulated in float64.

    Each chunk's sum is taken on the rank's element-wise threads, then the chunk sums
    are added in order: the same float at any thread count.
    """
    params = list(params)
    chunks = [g[start:start + _CHUNK] for g in (p.grad.reshape(-1) for p in params
                                                if not is_sparse(p))
              for start in range(0, g.size, _CHUNK)]
    sums = np.empty(len(chunks))
    over_rows(lambda idx, out: _sq_sums(chunks, idx, out), np.arange(len(chunks)), sums)
    return float(sum(sums.tolist()) + sum(p.grad.sq_sum() for p in params if is_sparse(p)))


def _sq_sums(chunks: list[np.ndarray], idx: np.ndarray, out: np.ndarray) -> None:
    # out[j] = sum(chunks[idx[j]]^2) in float64 (bounded float64 temporaries)
    for j, i in enumerate(idx):
        chunk = chunks[i].astype(np.float64, copy=False)
        out[j] = np.dot(chunk, chunk)


def grad_norm(params: Iterable[Parameter]) -> float:
    """The global 2-norm of all gradients (float64 accumulation)."""
    return math.sqrt(grad_sq_sum(params))


def clip_scale(max_norm: float, total_norm: float) -> float:
    """``min(1, max_norm / (total_norm + 1e-6))``; 1 when ``max_norm <= 0`` (no clipping)
    or the norm is within it."""
    if max_norm <= 0 or total_norm <= max_norm:
        return 1.0
    return max_norm / (total_norm + 1e-6)


def clip_grads(params: Iterable[Parameter], max_norm: float, total_norm: float) -> float:
    """Scale every ``.grad`` by ``clip_scale(max_norm, total_norm)``; return the scale.

    ``max_norm <= 0`` disables clipping (scale 1).
    """
    scale = clip_scale(max_norm, total_norm)
    if scale == 1.0:
        return 1.0
    for p in params:
        p.grad *= scale
    return scale
