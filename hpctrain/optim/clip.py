"""Global gradient-norm clipping, in two parts so a parallel caller can reduce between.

    norm  = sqrt(sum over parameters of sum(grad^2))            grad_norm
    scale = min(1, max_norm / (norm + 1e-6));  grad *= scale     clip_grads

A data- or tensor-parallel caller sums the squared local norms across ranks and hands
the global norm to ``clip_grads``; every rank then scales by the same factor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from hpctrain.nn.module import Parameter

_CHUNK = 1 << 16  # elements converted to float64 at a time


def grad_sq_sum(params: Iterable[Parameter]) -> float:
    """sum(grad^2) over all parameters, accumulated in float64."""
    total = 0.0
    for p in params:
        g = p.grad.reshape(-1)
        if g.dtype == np.float64:
            total += float(np.dot(g, g))
            continue
        for start in range(0, g.size, _CHUNK):  # bounded float64 temporaries
            chunk = g[start:start + _CHUNK].astype(np.float64)
            total += float(np.dot(chunk, chunk))
    return total


def grad_norm(params: Iterable[Parameter]) -> float:
    """The global 2-norm of all gradients (float64 accumulation)."""
    return math.sqrt(grad_sq_sum(params))


def clip_grads(params: Iterable[Parameter], max_norm: float, total_norm: float) -> float:
    """Scale every ``.grad`` by ``min(1, max_norm / (total_norm + 1e-6))``; return the scale.

    ``max_norm <= 0`` disables clipping (scale 1).
    """
    if max_norm <= 0 or total_norm <= max_norm:
        return 1.0
    scale = max_norm / (total_norm + 1e-6)
    for p in params:
        p.grad *= scale
    return scale
