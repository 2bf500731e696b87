"""The elementary layers, each forward followed at once by its backward.

Every layer follows one contract:

* ``forward(x) -> (y, cache)``: ``cache`` is a small NamedTuple holding exactly what the
  backward pass needs; nothing is kept on ``self``.
* ``backward(dy, cache) -> dx``: returns the gradient with respect to the input and
  *adds* the parameter gradients into ``Parameter.grad``, so calling forward/backward
  once per microbatch accumulates over the microbatches.

Shapes: ``N`` is any number of leading dimensions flattened (``B * T`` in the GPT).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from hpctrain.nn.kernels import kernels
from hpctrain.nn.module import Module, Parameter
from hpctrain.nn.threads import over_rows


def init_normal(rng: np.random.Generator, shape: tuple[int, ...], std: float,
                dtype) -> np.ndarray:
    """normal(0, std) drawn in float64 and then cast, so a float32 and a float64 model
    built from the same seed hold the same weights up to rounding. Scaled in place:
    one float64 array alive, not two (a model's build peaks at its largest weight)."""
    w = rng.standard_normal(shape)
    w *= std
    return w.astype(dtype, copy=False)


# ---------------------------------------------------------------------------------
# Linear


class LinearCache(NamedTuple):
    x: np.ndarray  # (..., in), the input: dW = x^T dy


class Linear(Module):
    """``y = x @ W + b`` with ``W (in, out)``, ``b (out,)``, on any leading dims.

    Backward: ``dW += x^T dy``, ``db += sum_N dy``, ``dx = dy W^T``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 rng: np.random.Generator, dtype=np.float32, std: float = 0.02):
        self.weight = Parameter(init_normal(rng, (in_features, out_features), std, dtype))
        self.bias = Parameter(np.zeros(out_features, dtype)) if bias else None

    @property
    def in_features(self) -> int:
        return self.weight.shape[0]

    @property
    def out_features(self) -> int:
        return self.weight.shape[1]

    def forward(self, x: np.ndarray, add_bias: bool = True) -> tuple[np.ndarray, LinearCache]:
        # x (..., in) -> y (..., out); add_bias=False: the product only, for a caller
        # that adds ``bias.data`` in a pass of its own (``GELU.forward(bias=)``)
        y = x.reshape(-1, x.shape[-1]) @ self.weight.data  # (N, out)
        if self.bias is not None and add_bias:
            y += self.bias.data
        return y.reshape(*x.shape[:-1], y.shape[-1]), LinearCache(x)

    def again(self, cache: LinearCache) -> np.ndarray:
        """The output forward made from the input it cached, bit for bit: the local
        product only (a tensor-parallel layer caches its input after the collective
        that entered it, and its exit's collective is not run again)."""
        return Linear.forward(self, cache.x)[0]

    def backward(self, dy: np.ndarray, cache: LinearCache,
                 need_dx: bool = True) -> np.ndarray | None:
        # dy (..., out) -> dx (..., in), or None with need_dx=False (a network's first
        # layer, whose input needs no gradient: saves one of the three GEMMs)
        x = cache.x.reshape(-1, cache.x.shape[-1])  # (N, in)
        dy = dy.reshape(-1, dy.shape[-1])  # (N, out)
        self.weight.add_product(x.T, dy)  # += x^T dy (in, out); = when it is zero
        if self.bias is not None:
            self.bias.grad += dy.sum(axis=0)  # (out,)
        if not need_dx:
            return None
        dx = dy @ self.weight.data.T  # (N, in)
        return dx.reshape(cache.x.shape)


# ---------------------------------------------------------------------------------
# Embedding


class EmbeddingCache(NamedTuple):
    idx: np.ndarray  # (...) integer row indices


class Embedding(Module):
    """Row lookup ``y[...] = W[idx[...]]`` with ``W (num, dim)``.

    Backward scatters: ``dW[i] += sum of dy over the positions where idx == i``. The
    input is integer, so there is no input gradient and backward returns None.
    """

    def __init__(self, num: int, dim: int, *, rng: np.random.Generator,
                 dtype=np.float32, std: float = 0.02):
        self.weight = Parameter(init_normal(rng, (num, dim), std, dtype))

    def forward(self, idx: np.ndarray) -> tuple[np.ndarray, EmbeddingCache]:
        # idx (...) int -> y (..., dim)
        return self.weight.data[idx], EmbeddingCache(idx)

    def backward(self, dy: np.ndarray, cache: EmbeddingCache) -> None:
        # dy (..., dim); repeated indices must add up, hence ufunc.at rather than +=.
        # Flattened to 1-D indices, where numpy's add.at is fast.
        dim = self.weight.shape[1]
        rows = cache.idx.reshape(-1, 1).astype(np.int64)  # (N, 1); tokens may be uint16
        flat = (rows * dim + np.arange(dim)).reshape(-1)  # (N * dim,)
        grad = np.reshape(self.weight.grad, -1, copy=False)  # raises rather than copy
        np.add.at(grad, flat, dy.reshape(-1))
        return None


# ---------------------------------------------------------------------------------
# LayerNorm


class LayerNormCache(NamedTuple):
    xhat: np.ndarray  # (..., C) normalised input
    rstd: np.ndarray  # (..., 1) 1 / sqrt(var + eps)


class LayerNorm(Module):
    """``y = w * xhat + b`` with ``xhat = (x - mean) / sqrt(var + eps)`` over the last axis.

    Backward, with ``g = dy * w`` and means over the last axis:
    ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))``,
    ``dw += sum_N dy * xhat``, ``db += sum_N dy``.
    """

    def __init__(self, dim: int, eps: float = 1e-5, *, dtype=np.float32):
        self.eps = eps
        self.weight = Parameter(np.ones(dim, dtype))
        self.bias = Parameter(np.zeros(dim, dtype))

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, LayerNormCache]:
        # x (..., C) -> y (..., C); rows are independent, so they are split over threads
        x = np.ascontiguousarray(x)  # rows as views; no copy when x already is
        xhat, y = np.empty_like(x), np.empty_like(x)
        rstd = np.empty((*x.shape[:-1], 1), dtype=x.dtype)
        w, b, eps = self.weight.data, self.bias.data, self.eps
        forward = kernels(x.dtype).layernorm_forward
        over_rows(lambda *rows: forward(*rows, w, b, eps),
                  _rows(x), _rows(xhat), _rows(rstd), _rows(y))
        return y, LayerNormCache(xhat, rstd)

    def backward(self, dy: np.ndarray, cache: LayerNormCache,
                 skip: np.ndarray | None = None) -> np.ndarray:
        # dy (..., C) -> dx (..., C); the parameter gradients sum over all rows, here.
        # skip (..., C): added to dx in the same pass (a residual's skip path)
        xhat, rstd = cache
        dy = np.ascontiguousarray(dy)
        c = dy.shape[-1]
        self.weight.grad += np.einsum("nc,nc->c", dy.reshape(-1, c), xhat.reshape(-1, c))
        self.bias.grad += dy.reshape(-1, c).sum(axis=0)
        dx = np.empty_like(dy)
        w = self.weight.data
        backward = kernels(dy.dtype).layernorm_backward
        if skip is None:
            over_rows(lambda *rows: backward(*rows, w),
                      _rows(dy), _rows(xhat), _rows(rstd), _rows(dx))
        else:
            skip = np.ascontiguousarray(skip)
            over_rows(lambda d, xh, r, out, s: backward(d, xh, r, out, w, s),
                      _rows(dy), _rows(xhat), _rows(rstd), _rows(dx), _rows(skip))
        return dx


# ---------------------------------------------------------------------------------
# GELU (tanh approximation, as in GPT-2; its kernels in hpctrain.nn.kernels)


class GELUCache(NamedTuple):
    x: np.ndarray  # (...) input
    s: np.ndarray  # (...) sigmoid(2 u) = (1 + tanh(u)) / 2, u = k (x + a x^3)


class GELU(Module):
    """``y = x/2 (1 + tanh(u))``, ``u = k (x + a x^3)``, ``k = sqrt(2/pi)``, ``a = 0.044715``.

    Computed as ``y = x s`` with ``s = (1 + tanh(u))/2 = 1 / (1 + exp(-2u))``, the same
    function: NumPy's exp costs about two thirds of its tanh, and it is the one
    transcendental of the pass.
    Backward: ``dy/dx = s + 2 x s (1 - s) k (1 + 3 a x^2)``.
    """

    def forward(self, x: np.ndarray, bias: np.ndarray | None = None
                ) -> tuple[np.ndarray, GELUCache]:
        # x (...) -> y (...); s and y are the only arrays allocated. With ``bias``
        # (the preceding Linear's, which left it out: ``Linear.forward(add_bias=False)``)
        # x is the bare product: x += bias, in place, in the same pass, and the cache
        # keeps that sum, GELU's input
        s, y = np.empty_like(x), np.empty_like(x)
        kernel = kernels(x.dtype).gelu_forward
        if bias is not None:
            def kernel(xs, ss, ys, run=kernel):  # every block adds the whole bias row
                run(xs, ss, ys, bias)
        over_rows(kernel, _rows(x), _rows(s), _rows(y))
        return y, GELUCache(x, s)

    def backward(self, dy: np.ndarray, cache: GELUCache) -> np.ndarray:
        # dy (...) -> dx (...); dx is the only array allocated
        x, s = cache
        dx = np.empty_like(x)
        over_rows(kernels(x.dtype).gelu_backward, _rows(x), _rows(s), _rows(dy), _rows(dx))
        return dx


def _rows(a: np.ndarray) -> np.ndarray:
    """(..., C) -> (N, C), a view: raises rather than copy (the arrays are fresh)."""
    return np.reshape(a, (-1, a.shape[-1]), copy=False)


# ---------------------------------------------------------------------------------
# Residual add


class Residual(Module):
    """``y = a + b``; backward hands ``dy`` unchanged to both branches."""

    def forward(self, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, None]:
        # a, b (..., C) -> y (..., C)
        return a + b, None

    def backward(self, dy: np.ndarray, cache: None) -> tuple[np.ndarray, np.ndarray]:
        # dy (..., C) -> (da, db), both (..., C)
        return dy, dy
