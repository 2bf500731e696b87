"""The element-wise kernels of the layers and AdamW, in NumPy, and which set runs.

GELU, LayerNorm, attention's causal softmax and AdamW's update are formulas over each
element (and sums over a row); their kernels work on a block of rows, results written in place, so
that ``threads.over_rows`` and ``threads.products_over_rows`` can split a layer's rows
over the rank's threads. Each kernel exists twice, with the same signature: here in
NumPy, one operation (one pass over memory) at a time, and in ``hpctrain.nn.fused``
compiled by numba into one pass. ``kernels(dtype)`` says which set a layer calls:

    kernel              arguments (rows of ...)            writes
    gelu_forward        x, s, y[, b]                       s = 1 / (1 + exp(-2u)), y = x s
                                                           (with b: x += b first)
    gelu_backward       x, s, dy, dx                       dx
    layernorm_forward   x, xhat, rstd, y, w, b, eps        xhat, rstd (n, 1), y
    layernorm_backward  dy, xhat, rstd, dx, w              dx
    causal_softmax      S (..., T, T)                      P, in place (0 above the diagonal)
    softmax_backward    dP (..., rows, cols), P            dS, in place in dP
    adamw_update        p, g, m, v, tmp (flat), scalars    p, m, v (``optim.AdamW``)

numba's kernels run for float32 and float64 when numba can be imported (the ``fused``
extra); NumPy's otherwise, and for any other dtype. ``HPCTRAIN_FUSED`` in the
environment, read on first use: unset or ``auto`` as just said; ``0`` NumPy's always;
``1`` numba's, an error if numba is missing.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

# ---------------------------------------------------------------------------------
# LayerNorm: y = w xhat + b, xhat = (x - mean) rstd, rstd = 1 / sqrt(var + eps)


def layernorm_forward(x: np.ndarray, xhat: np.ndarray, rstd: np.ndarray, y: np.ndarray,
                      w: np.ndarray, b: np.ndarray, eps: float) -> None:
    # rows (n, C) of x -> xhat, rstd (n, 1) and y, written in place
    np.subtract(x, x.mean(axis=-1, keepdims=True), out=xhat)  # centred
    np.mean(np.square(xhat), axis=-1, keepdims=True, out=rstd)  # variance
    rstd += eps
    np.sqrt(rstd, out=rstd)
    np.divide(1.0, rstd, out=rstd)
    xhat *= rstd
    np.multiply(xhat, w, out=y)
    y += b


def layernorm_backward(dy: np.ndarray, xhat: np.ndarray, rstd: np.ndarray, dx: np.ndarray,
                       w: np.ndarray, skip: np.ndarray | None = None) -> None:
    # rows -> dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy w, written in place;
    # plus skip if given (a residual's other path: one pass fewer in numba's kernel)
    c = dy.shape[-1]
    np.multiply(dy, w, out=dx)  # g
    mean_gx = np.einsum("nc,nc->n", dx, xhat)[:, None] / c  # (n, 1)
    dx -= dx.mean(axis=-1, keepdims=True)
    dx -= xhat * mean_gx
    dx *= rstd
    if skip is not None:
        dx += skip


# ---------------------------------------------------------------------------------
# GELU (tanh approximation, as in GPT-2): y = x s, s = 1 / (1 + exp(-2u)),
# u = k (x + a x^3)

GELU_K = math.sqrt(2.0 / math.pi)
GELU_A = 0.044715


def gelu_forward(x: np.ndarray, s: np.ndarray, y: np.ndarray,
                 b: np.ndarray | None = None) -> None:
    # rows of x -> s = 1 / (1 + exp(-2u)), y = x s, written in place; with a bias row
    # b, x += b first (in place: x is then GELU's input)
    if b is not None:
        x += b
    np.multiply(x, x, out=s)
    s *= -2.0 * GELU_K * GELU_A
    s -= 2.0 * GELU_K
    s *= x  # -2u
    with np.errstate(over="ignore"):  # exp(-2u) = inf for x < -10: s = 0, y = -0, exact
        np.exp(s, out=s)
    s += 1.0
    np.divide(1.0, s, out=s)
    np.multiply(x, s, out=y)


def gelu_backward(x: np.ndarray, s: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> None:
    # rows -> dx = dy (s + 2 x s (1 - s) k (1 + 3 a x^2)), one scratch block
    np.multiply(x, x, out=dx)
    dx *= 6.0 * GELU_K * GELU_A
    dx += 2.0 * GELU_K
    dx *= x  # 2 x k (1 + 3 a x^2)
    tmp = np.subtract(1.0, s)
    tmp *= s
    dx *= tmp  # 2 x s (1 - s) k (1 + 3 a x^2)
    dx += s
    dx *= dy


# ---------------------------------------------------------------------------------
# attention's causal softmax: P_ij = exp(S_ij - m_i) / sum_{j' <= i} exp(S_ij' - m_i)
# for j <= i (m_i the row's maximum over j <= i), P_ij = 0 for j > i

SOFTMAX_BLOCK = 32  # query rows per block: column blocks right of it are all masked


def causal_softmax(s: np.ndarray) -> None:
    # s (..., T, T) scores -> probabilities, in place. Query rows i0:i1 only see keys
    # :i1, so each block of rows works on its first i1 columns and sets the rest to 0:
    # about half the exp of a whole-row pass. Entries above the diagonal are never read.
    T = s.shape[-1]
    mask = future_mask(T)
    for i0 in range(0, T, SOFTMAX_BLOCK):
        i1 = min(i0 + SOFTMAX_BLOCK, T)
        rows = s[..., i0:i1, :i1]
        np.copyto(rows[..., i0:], -np.inf, where=mask[i0:i1, i0:i1])
        rows -= rows.max(axis=-1, keepdims=True)  # the diagonal is never masked: finite
        np.exp(rows, out=rows)
        rows /= rows.sum(axis=-1, keepdims=True)
        s[..., i0:i1, i1:] = 0.0


def softmax_backward(ds: np.ndarray, p: np.ndarray) -> None:
    # ds (..., rows, cols) holds dP; becomes dS = P * (dP - rowsum(dP * P)), in place
    # (a block of query rows and the columns they see)
    ds -= np.einsum("...ij,...ij->...i", ds, p)[..., None]
    ds *= p  # masked entries have p == 0, so they get no gradient


@functools.lru_cache(maxsize=8)
def future_mask(T: int) -> np.ndarray:
    """(T, T) boolean, True where key position j > query position i (read-only: shared)."""
    mask = np.triu(np.ones((T, T), dtype=bool), k=1)
    mask.flags.writeable = False
    return mask


# ---------------------------------------------------------------------------------
# AdamW's update (hpctrain.optim.AdamW), on flat slices of a parameter and its state


def adamw_update(data: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray,
                 tmp: np.ndarray, shrink: float, b1: float, b2: float, rsqrt_bc2: float,
                 eps: float, step_size: float, gscale: float = 1.0) -> None:
    # data *= shrink (decoupled decay; skipped at 1); m = b1 m + (1 - b1) g;
    # v = b2 v + (1 - b2) g^2; data -= step_size m / (sqrt(v) rsqrt_bc2 + eps), in
    # place; tmp is scratch; g is first scaled by gscale (a clipped gradient, rounded
    # as clip_grads' g *= scale would; g itself is left as it is). Scalars take the
    # arrays' dtype (NumPy's rule for Python floats), each product and sum rounded in
    # this order: fused.adamw_update is bitwise
    if gscale != 1.0:
        g = g * gscale  # a temporary: NumPy's kernels are the fallback
    if shrink != 1.0:
        data *= shrink
    m *= b1
    np.multiply(g, 1.0 - b1, out=tmp)
    m += tmp
    v *= b2
    np.multiply(g, g, out=tmp)
    tmp *= 1.0 - b2
    v += tmp
    np.sqrt(v, out=tmp)
    tmp *= rsqrt_bc2
    tmp += eps  # sqrt(v_hat) + eps
    np.divide(m, tmp, out=tmp)
    tmp *= step_size
    data -= tmp


# ---------------------------------------------------------------------------------
# Which kernels run: NumPy's above, or numba's (hpctrain.nn.fused)


class Kernels(NamedTuple):
    """One set of the element-wise kernels (signatures in the module docstring)."""

    gelu_forward: Callable[..., None]
    gelu_backward: Callable[..., None]
    layernorm_forward: Callable[..., None]
    layernorm_backward: Callable[..., None]
    causal_softmax: Callable[..., None]
    softmax_backward: Callable[..., None]
    adamw_update: Callable[..., None]


NUMPY_KERNELS = Kernels(gelu_forward, gelu_backward, layernorm_forward, layernorm_backward,
                        causal_softmax, softmax_backward, adamw_update)
FUSED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))  # what numba's are built for

_kernels: Kernels | None = None  # chosen on first use


def kernels(dtype: np.dtype) -> Kernels:
    """The kernels for arrays of ``dtype``: numba's fused ones (``hpctrain.nn.fused``)
    for float32 and float64 when numba can be imported, NumPy's otherwise; see the
    module docstring for ``HPCTRAIN_FUSED``."""
    global _kernels
    if _kernels is None:
        _kernels = _kernels_from_environment()
    return _kernels if dtype in FUSED_DTYPES else NUMPY_KERNELS


def fused_running(dtype) -> bool:
    """Whether arrays of ``dtype`` run numba's kernels in this process (the planner
    prices the passes of the kernels that run)."""
    return NUMPY_KERNELS is not kernels(np.dtype(dtype))


def load(dtype) -> Kernels:
    """The kernels for ``dtype``, each run once on a few elements, so that numba's
    machine code is loaded (from its cache, or compiled) now and not inside the first
    training step, whose time and traced memory it would otherwise join (``train``
    calls it first thing; so do the benchmarks that trace memory)."""
    dt = np.dtype(dtype)
    chosen = kernels(dt)
    if chosen is NUMPY_KERNELS:
        return chosen
    x, dy = np.linspace(-1, 1, 8, dtype=dt).reshape(2, 4), np.ones((2, 4), dt)
    s, y, dx, xhat = (np.empty_like(x) for _ in range(4))
    rstd, w = np.empty((2, 1), dt), np.ones(4, dt)
    chosen.gelu_forward(x, s, y)
    chosen.gelu_backward(x, s, dy, dx)
    chosen.layernorm_forward(x, xhat, rstd, y, w, w, 1e-5)
    chosen.layernorm_backward(dy, xhat, rstd, dx, w)
    p = np.zeros((1, 4, 4), dt)
    chosen.causal_softmax(p)
    chosen.softmax_backward(np.ones_like(p), p)
    flat = [np.ones(4, dt) for _ in range(5)]
    chosen.adamw_update(*flat, 1.0, 0.9, 0.95, 1.0, 1e-8, 1e-3)
    return chosen


def set_kernels(chosen: Kernels | None) -> None:
    """Run ``chosen`` from now on (tests, benchmarks: NUMPY_KERNELS, fused.KERNELS or a
    mix); None: choose again from the environment on next use."""
    global _kernels
    _kernels = chosen


def _kernels_from_environment() -> Kernels:
    mode = os.environ.get("HPCTRAIN_FUSED", "auto")
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"HPCTRAIN_FUSED ({mode!r}) must be 0 (NumPy's kernels), "
                         "1 (numba's) or auto (numba's when numba is installed)")
    if mode == "0":
        return NUMPY_KERNELS
    try:
        import numba  # noqa: F401  (0.3 s: only here, on first use)
    except ImportError as err:  # not installed, or built for another NumPy
        if mode == "1":
            raise ImportError(f"HPCTRAIN_FUSED=1 asks for numba's kernels, but {err}: "
                              "pip install numba, or unset HPCTRAIN_FUSED") from err
        return NUMPY_KERNELS
    from hpctrain.nn import fused

    return fused.KERNELS
