"""Fused element-wise kernels: one pass over memory where NumPy makes five to eight.

NumPy runs an element-wise formula one operation at a time, each a full pass that
reads its operands from memory and writes a temporary back. GELU's forward is eight
such passes over (N, d_ff), its backward nine, LayerNorm's forward five over (N, C)
plus two reductions; each pass is cheap, their number is the cost. The kernels here
are the same formulas compiled by numba: each element is loaded once, every step of
the formula stays in registers, and the results are stored once. LLVM vectorises the
loops (AVX-512 where the CPU has it).

    kernel              reads             writes         NumPy passes it replaces
    gelu_forward        x                 s, y           8 (s = sigmoid(-2u), y = x s)
      with a bias b     x, b              x += b, s, y   9 (and the Linear's bias add)
    gelu_backward       x, s, dy          dx             9
    layernorm_forward   x (row in cache)  xhat, rstd, y  5 and 2 row reductions
    layernorm_backward  dy, xhat, rstd    dx             4 and 2 row reductions
    causal_softmax      S on and below the diagonal, in place (5 passes a block)
    softmax_backward    dP, P             dS, in place   2 and 1 row reduction
    adamw_update        p, g, m, v        p, m, v        14 (bitwise the same)

Each kernel has the name and signature of the NumPy kernel it replaces
(``hpctrain.nn.kernels``, which also says which set runs) and works on the same
blocks of rows: the element-wise threads (``threads.over_rows``) still split the
rows, and the kernels release the GIL (``nogil``), so the blocks run at once on the
rank's cores and the thread count stays the one ``runtime.set_blas_threads`` gave BLAS. numba's own
``parallel=True`` pool would be a second pool beside BLAS's, one that must not be
launched from inside attention's threads, and it was about as fast (0-0.1 ms a call
faster with its workqueue layer, slower with its OpenMP one: ``benchmarks/bench_fused.py``).

Every row is computed by the same machine code whatever block it lands in, so a
result does not depend on the number of threads (bitwise), as with NumPy. Against
NumPy itself:

* GELU's backward is the same operations in the same order: bitwise equal.
* Sums over a row (LayerNorm's mean, variance and the two backward means, the
  softmax's normaliser) are vectorised, so added in another order than NumPy's
  pairwise sum: float64 results differ in the last bits (a few 1e-16, relative).
* ``exp`` in float64 is the C library's (``math.exp``), as accurate as NumPy's. In
  float32 it is written here (``_expf_nonpositive``: Cephes' range reduction and
  polynomial, within 1 ulp of the exact value, where NumPy's is within 2.4), because
  the C library's ``expf`` is a call LLVM cannot vectorise: GELU's forward took 3.6 ns
  an element with it, 0.65 with this one (one thread). Float32 GELU and softmax
  differ from NumPy's by a few ulp; where NumPy's float32 GELU rounds s to 0 (exp
  overflows, x < -9.5) this one keeps the denormal.

numba compiles a kernel for each dtype on its first call (GELU's and LayerNorm's
four: about 1 s a dtype here; the two softmax kernels 0.4 s) and keeps the machine
code on disk (``cache=True``: in ``NUMBA_CACHE_DIR`` if set, else ``__pycache__``
beside this file, else numba's user-wide cache when that is read-only); a later
process loads all four in 0.15 s. With no writable place at all every process
compiles again. Importing this module imports numba (0.13 s): ``hpctrain.nn.kernels``
does so only when a layer first runs, and not at all when numba is missing or
``HPCTRAIN_FUSED=0``.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic, overload

from hpctrain.nn.kernels import GELU_A, GELU_K, Kernels


def _jit(fastmath: bool | set[str] = False):
    """numba's ``njit`` as every kernel here uses it: no GIL; NumPy's error model
    (1/0 is inf, as in NumPy, and the loops vectorise: Python's raises, and its
    check in every division keeps LLVM from vectorising); the machine code cached
    on disk when numba finds a writable place for it."""
    options = dict(nogil=True, error_model="numpy", fastmath=fastmath)

    def decorate(fn):
        try:
            return numba.njit(cache=True, **options)(fn)
        except RuntimeError:  # "no locator available": nowhere to cache; compile per process
            return numba.njit(**options)(fn)

    return decorate


# Sums over a row may be reordered, so that LLVM vectorises them (with several
# accumulators). Only reassociation: infinities and NaNs keep their IEEE meaning.
_REDUCE = {"reassoc"}


# ---------------------------------------------------------------------------------
# exp, vectorisable


@intrinsic
def _float32_from_bits(typingctx, bits):
    """The float32 whose IEEE bits are the int32 ``bits``."""
    if bits != types.int32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


_EXPF_LO = np.float32(-104.0)  # exp below it rounds to 0 in float32 (denormals above)
_TWO_M64 = np.float32(2.0**-64)
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)  # ln 2 = _LN2_HI + _LN2_LO, _LN2_HI exact in 9 bits
_LN2_LO = np.float32(-2.12194440e-4)
_EXPF_P = tuple(np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3,
                                        4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1))


@_jit()
def _expf_nonpositive(a):
    # float32 exp(a) for a <= 0 (Cephes' expf): a = n ln2 + r with |r| <= ln2 / 2, exp(r)
    # by a degree-7 polynomial, times 2^n made from exponent bits: 2^(n + 64), exact,
    # then 2^-64, which rounds once into the denormals below 2^-126. Branch-free, so
    # LLVM vectorises the loop that calls it. 0 below _EXPF_LO, NaN stays NaN.
    ac = max(a, _EXPF_LO)
    n = np.int32(ac * _LOG2E - np.float32(0.5))  # round(a log2 e): a <= 0, int32() truncates
    fn = np.float32(n)
    r = ac - fn * _LN2_HI
    r = r - fn * _LN2_LO
    p0, p1, p2, p3, p4, p5 = _EXPF_P
    p = (((((p0 * r + p1) * r + p2) * r + p3) * r + p4) * r + p5) * (r * r) + r + np.float32(1)
    e = p * _float32_from_bits(np.int32((n + 191) << 23)) * _TWO_M64  # n + 191 in [41, 191]
    return e if a >= _EXPF_LO else (np.float32(0) if a < _EXPF_LO else a)


def _exp_nonpositive(a):
    """exp(a) for a <= 0 in numba kernels: float32 here, float64 the C library's."""
    raise NotImplementedError("numba kernels only")


@overload(_exp_nonpositive)
def _exp_nonpositive_typed(a):
    if a == types.float32:
        return lambda a: _expf_nonpositive(a)
    return lambda a: math.exp(a)


def _sigmoid_neg(t):
    """1 / (1 + exp(t)) in numba kernels."""
    raise NotImplementedError("numba kernels only")


@overload(_sigmoid_neg)
def _sigmoid_neg_typed(t):
    if t == types.float32:
        def sigmoid_neg_f32(t):  # exp of -|t| only: it never overflows
            one = np.float32(1)
            e = _expf_nonpositive(-abs(t))
            return one / (one + e) if t <= np.float32(0) else e / (one + e)

        return sigmoid_neg_f32

    def sigmoid_neg(t):  # float64: NumPy's formula, op for op (exp(t) = inf gives 0)
        return 1.0 / (1.0 + math.exp(t))

    return sigmoid_neg


# ---------------------------------------------------------------------------------
# GELU: y = x s, s = 1 / (1 + exp(-2u)), u = k (x + a x^3)   (hpctrain.nn.kernels)


@_jit()
def _gelu_forward_rows(x, s, y):
    n, c = x.shape
    c3 = x.dtype.type(-2.0 * GELU_K * GELU_A)
    c1 = x.dtype.type(2.0 * GELU_K)
    for i in range(n):
        for j in range(c):
            v = x[i, j]
            sv = _sigmoid_neg((v * v * c3 - c1) * v)  # exp(-2u), as NumPy orders it
            s[i, j] = sv
            y[i, j] = v * sv


@_jit()
def _bias_gelu_forward_rows(x, b, s, y):
    # _gelu_forward_rows of x + b, the sum stored back into x: one pass where the
    # Linear's bias add and GELU made two
    n, c = x.shape
    c3 = x.dtype.type(-2.0 * GELU_K * GELU_A)
    c1 = x.dtype.type(2.0 * GELU_K)
    for i in range(n):
        for j in range(c):
            v = x[i, j] + b[j]
            x[i, j] = v
            sv = _sigmoid_neg((v * v * c3 - c1) * v)
            s[i, j] = sv
            y[i, j] = v * sv


def gelu_forward(x: np.ndarray, s: np.ndarray, y: np.ndarray,
                 b: np.ndarray | None = None) -> None:
    # rows (n, C) of x -> s = 1 / (1 + exp(-2u)), y = x s, written in place; with a
    # bias row b, x += b first, in the same pass
    if b is None:
        _gelu_forward_rows(x, s, y)
    else:
        _bias_gelu_forward_rows(x, b, s, y)


@_jit()
def _gelu_backward_rows(x, s, dy, dx):
    n, c = x.shape
    one = x.dtype.type(1)
    c6 = x.dtype.type(6.0 * GELU_K * GELU_A)
    c2 = x.dtype.type(2.0 * GELU_K)
    for i in range(n):
        for j in range(c):
            v, sv = x[i, j], s[i, j]
            d = (v * v * c6 + c2) * v  # 2 x k (1 + 3 a x^2)
            d = d * ((one - sv) * sv)  # 2 x s (1 - s) k (1 + 3 a x^2)
            dx[i, j] = (d + sv) * dy[i, j]


def gelu_backward(x: np.ndarray, s: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> None:
    # rows -> dx = dy (s + 2 x s (1 - s) k (1 + 3 a x^2)), written in place
    _gelu_backward_rows(x, s, dy, dx)


# ---------------------------------------------------------------------------------
# LayerNorm: y = w xhat + b, xhat = (x - mean) rstd, rstd = 1 / sqrt(var + eps)


@_jit(_REDUCE)
def _layernorm_forward_rows(x, xhat, rstd, y, w, b, eps):
    n, c = x.shape
    one, count, eps = x.dtype.type(1), x.dtype.type(c), x.dtype.type(eps)  # x's dtype
    for i in range(n):
        row = x[i]
        total = x.dtype.type(0)
        for j in range(c):
            total += row[j]
        mean = total / count
        total = x.dtype.type(0)
        for j in range(c):  # the row is in L1 now: two passes, not E[x^2] - mean^2
            d = row[j] - mean
            total += d * d
        r = one / math.sqrt(total / count + eps)
        rstd[i, 0] = r
        for j in range(c):
            h = (row[j] - mean) * r
            xhat[i, j] = h
            y[i, j] = h * w[j] + b[j]


def layernorm_forward(x: np.ndarray, xhat: np.ndarray, rstd: np.ndarray, y: np.ndarray,
                      w: np.ndarray, b: np.ndarray, eps: float) -> None:
    # rows (n, C) of x -> xhat, rstd (n, 1) and y, written in place; w, b (C,)
    _layernorm_forward_rows(x, xhat, rstd, y, w, b, eps)


@_jit(_REDUCE)
def _layernorm_backward_rows(dy, xhat, rstd, dx, w, skip, add_skip):
    n, c = dy.shape
    count = dy.dtype.type(c)  # an int would make the means float64
    for i in range(n):
        sum_g = dy.dtype.type(0)
        sum_gx = dy.dtype.type(0)
        for j in range(c):
            g = dy[i, j] * w[j]
            sum_g += g
            sum_gx += g * xhat[i, j]
        mean_g, mean_gx, r = sum_g / count, sum_gx / count, rstd[i, 0]
        if add_skip:
            for j in range(c):
                d = (dy[i, j] * w[j] - mean_g - xhat[i, j] * mean_gx) * r
                dx[i, j] = d + skip[i, j]
        else:
            for j in range(c):
                dx[i, j] = (dy[i, j] * w[j] - mean_g - xhat[i, j] * mean_gx) * r


def layernorm_backward(dy: np.ndarray, xhat: np.ndarray, rstd: np.ndarray, dx: np.ndarray,
                       w: np.ndarray, skip: np.ndarray | None = None) -> None:
    # rows -> dx = rstd (g - mean(g) - xhat mean(g xhat)) (+ skip), g = dy w, in place
    _layernorm_backward_rows(dy, xhat, rstd, dx, w, dy if skip is None else skip,
                             skip is not None)


# ---------------------------------------------------------------------------------
# causal softmax (hpctrain.nn.attention): P_ij = exp(S_ij - m_i) / sum_j' exp(S_ij' - m_i)
# over j, j' <= i, m_i = max_{j <= i} S_ij; P_ij = 0 for j > i.
#
# Attention hands these kernels views: a block of query rows and the columns they see,
# (b, H, rows, cols) with rows T apart. numba compiles a view as an array of unknown
# strides, and then LLVM does not vectorise (6x slower here); so the kernels take the
# memory as a 1-D contiguous array and the strides in elements (``_strided``), and
# each row they slice from it is contiguous.


@_jit(_REDUCE)
def _causal_softmax_rows(s, stride_m, stride_r, m, t):
    for k in range(m):
        for i in range(t):
            row = s[k * stride_m + i * stride_r:][:t]
            top = row[0]
            for j in range(1, i + 1):  # keys after i are never read: they may be garbage
                v = row[j]
                top = v if v > top else top  # a NaN is skipped here, and its exp is NaN
            total = s.dtype.type(0)
            for j in range(i + 1):
                e = _exp_nonpositive(row[j] - top)
                row[j] = e
                total += e
            for j in range(i + 1):
                row[j] = row[j] / total
            for j in range(i + 1, t):
                row[j] = 0


def causal_softmax(s: np.ndarray) -> None:
    """(..., T, T) scores -> causal attention probabilities, in place: row i of each
    (T, T) matrix is the softmax of its first i + 1 entries, followed by zeros. Only
    the entries on and below the diagonal are read (as ``kernels.causal_softmax``)."""
    if s.shape[-1] != s.shape[-2]:
        raise ValueError(f"causal_softmax needs square (..., T, T) scores, not {s.shape}")
    _over_matrices(lambda a: _causal_softmax_rows(*_strided(a), len(a), a.shape[-1]), s)


@_jit(_REDUCE)
def _softmax_backward_rows(ds, ds_m, ds_r, p, p_m, p_r, m, r, c):
    for k in range(m):
        for i in range(r):
            ds_row = ds[k * ds_m + i * ds_r:][:c]
            p_row = p[k * p_m + i * p_r:][:c]
            dot = ds.dtype.type(0)
            for j in range(c):
                dot += ds_row[j] * p_row[j]
            for j in range(c):
                ds_row[j] = (ds_row[j] - dot) * p_row[j]


def softmax_backward(ds: np.ndarray, p: np.ndarray) -> None:
    """ds (..., rows, cols) holds dP; becomes dS = P * (dP - rowsum(dP * P)), in place.
    As ``kernels.softmax_backward``: ``ds`` and ``p`` may be views of a block of
    query rows and the columns they see."""
    if ds.shape != p.shape:
        raise ValueError(f"softmax_backward: ds {ds.shape} and p {p.shape} must match")
    _over_matrices(lambda d, q: _softmax_backward_rows(*_strided(d), *_strided(q), *d.shape),
                   ds, p)


def _over_matrices(kernel, *arrays: np.ndarray) -> None:
    """``kernel`` on (m, rows, cols) views of arrays (..., rows, cols) whose rows are
    contiguous, in place. Leading axes are merged where that needs no copy, else walked
    one by one; an array whose rows are not contiguous is worked on in a copy."""
    if any(a.size == 0 for a in arrays):
        return
    if arrays[0].ndim == 2:
        arrays = tuple(a[None] for a in arrays)
    if not all(_rows_contiguous(a) for a in arrays):
        copies = [np.ascontiguousarray(a) for a in arrays]
        _over_matrices(kernel, *copies)
        for a, copy in zip(arrays, copies, strict=True):
            if copy is not a:
                a[...] = copy
        return
    try:
        views = [np.reshape(a, (-1, *a.shape[-2:]), copy=False) for a in arrays]
    except ValueError:  # leading axes that do not merge (a transposed batch, say)
        for parts in zip(*arrays, strict=True):
            _over_matrices(kernel, *parts)
        return
    kernel(*views)


def _rows_contiguous(a: np.ndarray) -> bool:
    """Each row contiguous and every stride non-negative (so ``_strided`` can span it)."""
    return a.strides[-1] == a.itemsize and all(st >= 0 for st in a.strides)


def _strided(a: np.ndarray) -> tuple[np.ndarray, int, int]:
    """a (m, rows, cols), rows contiguous -> (flat, stride_m, stride_r): flat a 1-D
    contiguous view of a's memory from its first element to its last, the strides of
    its matrices and rows in elements. Element (k, i, j) is flat[k stride_m + i stride_r + j]."""
    m, r, c = a.shape
    stride_m, stride_r = a.strides[0] // a.itemsize, a.strides[1] // a.itemsize
    span = (m - 1) * stride_m + (r - 1) * stride_r + c
    flat = np.lib.stride_tricks.as_strided(a, shape=(span,), strides=(a.itemsize,))
    return flat, stride_m, stride_r


# ---------------------------------------------------------------------------------
# AdamW's update (kernels.adamw_update): the same operations in the same order, each
# rounded to the dtype (no contraction into fused multiply-adds: numba asks LLVM for
# none without fastmath), so bitwise NumPy's


@_jit()
def _adamw_flat(data, g, m, v, shrink, b1, c1, b2, c2, rsqrt_bc2, eps, step_size, gscale):
    decay = shrink != data.dtype.type(1)
    scaled = gscale != data.dtype.type(1)
    for i in range(data.shape[0]):
        p = data[i] * shrink if decay else data[i]
        gi = g[i] * gscale if scaled else g[i]
        mi = m[i] * b1 + gi * c1
        vi = v[i] * b2 + (gi * gi) * c2
        m[i] = mi
        v[i] = vi
        data[i] = p - mi / (math.sqrt(vi) * rsqrt_bc2 + eps) * step_size


def adamw_update(data: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray,
                 tmp: np.ndarray, shrink: float, b1: float, b2: float, rsqrt_bc2: float,
                 eps: float, step_size: float, gscale: float = 1.0) -> None:
    """``kernels.adamw_update`` in one pass (``tmp`` unused); flat arrays of one dtype;
    the clipped gradient (``gscale``) is scaled as it is read, not stored."""
    t = data.dtype.type
    _adamw_flat(data, g, m, v, t(shrink), t(b1), t(1.0 - b1), t(b2), t(1.0 - b2),
                t(rsqrt_bc2), t(eps), t(step_size), t(gscale))


KERNELS = Kernels(gelu_forward, gelu_backward, layernorm_forward, layernorm_backward,
                  causal_softmax, softmax_backward, adamw_update)
