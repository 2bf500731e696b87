"""Convolutional layers on channel-first arrays, each forward followed at once by its
backward: N-d convolution as one GEMM, transposed convolution, nearest upsampling,
ReLU (pooling is in ``pool.py``, BatchNorm in ``batchnorm.py``).

Layout: ``x (N, C, *S)`` with ``S = (H, W)`` in 2-D and ``(D, H, W)`` in 3-D; one N-d
code path serves both. ``K`` is the number of kernel offsets (``prod(kernel)``), ``P``
the number of output positions (``prod(So)``).

Convolution, for kernel offsets ``k`` and output positions ``p`` (vectors, one entry
per spatial axis), on the padded input ``xp``:

    y[n, o, p] = b[o] + sum_{c, k} w[o, c, k] xp[n, c, p * stride + k * dilation]

im2col lays every window out as a column, ``cols[(c, k), (n, p)] = xp[n, c, p s + k d]``
``(C K, N P)``, so the forward is one GEMM ``y = w2 @ cols`` with ``w2 = w (O, C K)``,
and the backward two: ``dw2 += dy2 @ cols^T``, ``dcols = w2^T @ dy2``; col2im then
adds ``dcols`` back where ``cols`` was read from. Both move data with one strided copy
per kernel offset (``K`` slices, no ``np.add.at``).

Padding is kept apart from the convolution so that a spatially-parallel wrapper can
supply its neighbours' halo rows instead of zeros: ``forward(x)`` is
``forward_padded(pad(x))`` and ``backward`` is ``unpad(backward_padded(dy))``, and the
wrapper calls the ``_padded`` pair itself (its halo scatter-add is the adjoint of its
halo exchange, as ``unpad`` is the adjoint of ``pad``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from hpctrain.nn.layers import init_normal
from hpctrain.nn.module import Module, Parameter
from hpctrain.nn.threads import over_rows

Pads = tuple[tuple[int, int], ...]  # (before, after) per spatial axis


# ---------------------------------------------------------------------------------
# shape arithmetic and validation


def _ints(value, nd: int, name: str) -> tuple[int, ...]:
    """An int, or nd ints, as a tuple of nd ints."""
    t = (value,) * nd if isinstance(value, (int, np.integer)) else value
    if (not isinstance(t, (tuple, list)) or len(t) != nd
            or not all(isinstance(v, (int, np.integer)) for v in t)):
        raise ValueError(f"{name} {value!r} must be an int or {nd} ints")
    return tuple(int(v) for v in t)


def _positive(value, nd: int, name: str) -> tuple[int, ...]:
    t = _ints(value, nd, name)
    if min(t) < 1:
        raise ValueError(f"{name} {value!r} must be positive")
    return t


def _padding(padding, nd: int, kernel, stride, dilation) -> Pads:
    """``padding`` (int, nd ints or "same") as (before, after) per axis; "same" keeps the
    size at stride 1, the odd extra row going after (as PyTorch and TensorFlow)."""
    if isinstance(padding, str):
        if padding != "same":
            raise ValueError(f"padding {padding!r} must be 'same', an int or {nd} ints")
        if max(stride) != 1:
            raise ValueError(f"padding 'same' needs stride 1, got stride {stride}")
        total = [d * (k - 1) for k, d in zip(kernel, dilation, strict=True)]
        return tuple((t // 2, t - t // 2) for t in total)
    p = _ints(padding, nd, "padding")
    if min(p) < 0:
        raise ValueError(f"padding {padding!r} must be non-negative")
    return tuple((v, v) for v in p)


def _conv_settings(nd: int, in_channels: int, out_channels: int, kernel_size, stride,
                   padding, dilation) -> tuple[tuple[int, ...], tuple[int, ...],
                                               tuple[int, ...], Pads]:
    """A convolution's settings, validated: (kernel, stride, dilation, pads)."""
    if in_channels < 1 or out_channels < 1:
        raise ValueError(f"channels must be positive, got in {in_channels}, "
                         f"out {out_channels}")
    kernel = _positive(kernel_size, nd, "kernel_size")
    stride = _positive(stride, nd, "stride")
    dilation = _positive(dilation, nd, "dilation")
    return kernel, stride, dilation, _padding(padding, nd, kernel, stride, dilation)


def _out_shape(size, kernel, stride, dilation) -> tuple[int, ...]:
    """Output size per axis of a window ``dilation (kernel - 1) + 1`` sliding by ``stride``
    over an (already padded) input of ``size``."""
    return tuple((n - d * (k - 1) - 1) // s + 1
                 for n, k, s, d in zip(size, kernel, stride, dilation, strict=True))


def _check_input(layer: str, x: np.ndarray, nd: int, channels: int | None, kernel,
                 dilation, pads: Pads) -> None:
    """Raise, before any work, if ``x`` is not ``(N, channels, *S)`` with ``nd`` spatial axes
    each at least as large, padded, as the dilated kernel."""
    if x.ndim != nd + 2:
        raise ValueError(f"{layer} takes (N, C, {nd} spatial axes), ndim {nd + 2}; "
                         f"got shape {x.shape}")
    if channels is not None and x.shape[1] != channels:
        raise ValueError(f"{layer} expects {channels} input channels, got {x.shape[1]} "
                         f"(input shape {x.shape})")
    for axis, (n, k, d, (lo, hi)) in enumerate(zip(x.shape[2:], kernel, dilation, pads,
                                                   strict=True)):
        if n + lo + hi < d * (k - 1) + 1:
            raise ValueError(f"{layer}: kernel {k} (dilation {d}, extent {d * (k - 1) + 1}) "
                             f"is larger than the padded input {n} + {lo} + {hi} on "
                             f"spatial axis {axis} (input shape {x.shape})")


def _flat(x: np.ndarray) -> np.ndarray:
    """(N, C, *S) -> (N, C, P)."""
    return x.reshape(*x.shape[:2], -1)


def _per_channel(v: np.ndarray, ndim: int) -> np.ndarray:
    """(C,) -> (C, 1, ..., 1), to broadcast against (N, C, *S)."""
    return v.reshape(-1, *([1] * (ndim - 2)))


# ---------------------------------------------------------------------------------
# padding, im2col and their adjoints


def pad(x: np.ndarray, pads: Pads, value: float = 0.0) -> np.ndarray:
    """x (N, C, *S) -> (N, C, *(S + before + after)), ``value`` around the spatial axes."""
    if not any(lo or hi for lo, hi in pads):
        return x
    return np.pad(x, ((0, 0), (0, 0), *pads), constant_values=value)


def unpad(xp: np.ndarray, pads: Pads) -> np.ndarray:
    """The adjoint of ``pad``: the interior of xp (N, C, *Sp), a view."""
    inner = tuple(slice(lo, n - hi) for (lo, hi), n in zip(pads, xp.shape[2:], strict=True))
    return xp[(slice(None), slice(None), *inner)]


def _window(offset, stride, dilation, out) -> tuple[slice, ...]:
    """Index of the entries kernel offset ``offset`` reads for all outputs: on each axis
    ``k d, k d + s, ..., k d + s (out - 1)``, a strided slice."""
    sl = tuple(slice(k * d, k * d + s * (o - 1) + 1, s)
               for k, s, d, o in zip(offset, stride, dilation, out, strict=True))
    return (slice(None), slice(None), *sl)


def im2col(xp: np.ndarray, kernel, stride, dilation) -> np.ndarray:
    """xp (N, C, *Sp) -> cols (C, K, N, *So), ``cols[c, k, n, p] = xp[n, c, p s + k d]``:
    one strided copy per kernel offset, blocks of the batch on the rank's threads."""
    n, c = xp.shape[:2]
    out = _out_shape(xp.shape[2:], kernel, stride, dilation)
    windows = [_window(k, stride, dilation, out) for k in np.ndindex(*kernel)]
    cols = np.empty((c, len(windows), n, *out), xp.dtype)

    def copy(xp: np.ndarray, cols: np.ndarray) -> None:
        # a block of the batch: xp (n, C, *Sp), cols (n, C, K, *So) (a view)
        for i, window in enumerate(windows):
            cols[:, :, i] = xp[window]

    over_rows(copy, xp, np.moveaxis(cols, 2, 0))
    return cols


def col2im(cols: np.ndarray, xp_shape, kernel, stride, dilation) -> np.ndarray:
    """The adjoint of im2col: cols (C, K, N, *So) -> dxp (N, C, *Sp),
    ``dxp[n, c, p s + k d] += cols[c, k, n, p]``; windows overlap, hence ``+=``."""
    windows = [_window(k, stride, dilation, cols.shape[3:]) for k in np.ndindex(*kernel)]
    dxp = np.zeros(xp_shape, cols.dtype)

    def add(dxp: np.ndarray, cols: np.ndarray) -> None:
        # a block of the batch: dxp (n, C, *Sp), cols (n, C, K, *So) (a view)
        for i, window in enumerate(windows):
            dxp[window] += cols[:, :, i]

    over_rows(add, dxp, np.moveaxis(cols, 2, 0))
    return dxp


# ---------------------------------------------------------------------------------
# Convolution


class ConvCache(NamedTuple):
    cols: np.ndarray  # (C K, N P) im2col of the padded input: dw = dy cols^T
    xp_shape: tuple[int, ...]  # (N, C, *Sp) the padded input's shape, for col2im


class ConvNd(Module):
    """``y[n, o, p] = b[o] + sum_{c, k} w[o, c, k] xp[n, c, p stride + k dilation]``,
    ``w (O, C, *kernel)``, ``b (O,)``, as one GEMM on im2col (module docstring).

    Backward: ``dw += dy2 cols^T``, ``db += sum_{n, p} dy``, ``dx = unpad(col2im(w2^T dy2))``.
    The cache holds the im2col matrix, ``K`` times the input: the price of a backward
    without a second im2col. ``std`` defaults to He's ``sqrt(2 / (C K))``.
    """

    def __init__(self, nd: int, in_channels: int, out_channels: int, kernel_size,
                 stride=1, padding=0, dilation=1, bias: bool = True, *,
                 rng: np.random.Generator, dtype=np.float32, std: float | None = None):
        self.nd = nd
        kernel, self.stride, self.dilation, self.pads = _conv_settings(
            nd, in_channels, out_channels, kernel_size, stride, padding, dilation)
        std = math.sqrt(2.0 / (in_channels * math.prod(kernel))) if std is None else std
        self.weight = Parameter(init_normal(rng, (out_channels, in_channels, *kernel), std,
                                            dtype))
        self.bias = Parameter(np.zeros(out_channels, dtype)) if bias else None

    @property
    def kernel_size(self) -> tuple[int, ...]:
        return self.weight.shape[2:]

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, ConvCache]:
        # x (N, C, *S) -> y (N, O, *So)
        _check_input(type(self).__name__, x, self.nd, self.weight.shape[1], self.kernel_size,
                     self.dilation, self.pads)
        return self.forward_padded(pad(x, self.pads))

    def backward(self, dy: np.ndarray, cache: ConvCache,
                 need_dx: bool = True) -> np.ndarray | None:
        # dy (N, O, *So) -> dx (N, C, *S), or None with need_dx=False (first layer)
        dxp = self.backward_padded(dy, cache, need_dx)
        return None if dxp is None else unpad(dxp, self.pads)

    def forward_padded(self, xp: np.ndarray) -> tuple[np.ndarray, ConvCache]:
        # xp (N, C, *Sp), padded already (zeros, or a neighbour's halo) -> y (N, O, *So)
        no_pads = ((0, 0),) * self.nd
        _check_input(type(self).__name__, xp, self.nd, self.weight.shape[1],
                     self.kernel_size, self.dilation, no_pads)
        o = self.weight.shape[0]
        cols = im2col(xp, self.kernel_size, self.stride, self.dilation)  # (C, K, N, *So)
        n, out = xp.shape[0], cols.shape[3:]
        cols = cols.reshape(-1, n * math.prod(out))  # (C K, N P)
        y = self.weight.data.reshape(o, -1) @ cols  # (O, N P): the one GEMM
        y = np.ascontiguousarray(y.reshape(o, n, *out).swapaxes(0, 1))  # (N, O, *So)
        if self.bias is not None:
            y += _per_channel(self.bias.data, y.ndim)
        return y, ConvCache(cols, xp.shape)

    def backward_padded(self, dy: np.ndarray, cache: ConvCache,
                        need_dx: bool = True) -> np.ndarray | None:
        # dy (N, O, *So) -> dxp (N, C, *Sp), the gradient of the padded input
        o, c = self.weight.shape[:2]
        n, out = dy.shape[0], dy.shape[2:]
        dy2 = dy.swapaxes(0, 1).reshape(o, -1)  # (O, N P), a copy
        # (cols dy2^T)^T, not dy2 cols^T: the same sums, but OpenBLAS runs the long
        # inner dimension N P ten times faster this way round (measured, float32)
        self.weight.grad += (cache.cols @ dy2.T).T.reshape(self.weight.shape)  # (O, C K)
        if self.bias is not None:
            self.bias.grad += dy2.sum(axis=1)
        if not need_dx:
            return None
        dcols = self.weight.data.reshape(o, -1).T @ dy2  # (C K, N P)
        dcols = dcols.reshape(c, -1, n, *out)  # (C, K, N, *So)
        return col2im(dcols, cache.xp_shape, self.kernel_size, self.stride, self.dilation)


class Conv2d(ConvNd):
    """``ConvNd`` on (N, C, H, W)."""

    def __init__(self, *args, **kwargs):
        super().__init__(2, *args, **kwargs)


class Conv3d(ConvNd):
    """``ConvNd`` on (N, C, D, H, W)."""

    def __init__(self, *args, **kwargs):
        super().__init__(3, *args, **kwargs)


# ---------------------------------------------------------------------------------
# Transposed convolution: the convolution's backward as a forward


class ConvTransposeCache(NamedTuple):
    x2: np.ndarray  # (C, N P) the input, channels first: dw = x2 cols(dy)^T
    x_shape: tuple[int, ...]  # (N, C, *S)


class ConvTransposeNd(Module):
    """The adjoint of ``ConvNd`` (same stride, padding, dilation), ``w (C, O, *kernel)``:

        y[n, o, i s + k d - pad] += x[n, c, i] w[c, o, k],   then  y += b[o]

    computed as col2im of ``w2^T @ x2``; output size ``(S - 1) s - 2 pad + d (k - 1) + 1
    + output_padding``, ``output_padding < stride`` adding rows at the end.
    Backward, im2col of the zero-padded ``dy``: ``dw2 += x2 cols^T``, ``dx = w2 @ cols``.
    """

    def __init__(self, nd: int, in_channels: int, out_channels: int, kernel_size,
                 stride=1, padding=0, dilation=1, output_padding=0, bias: bool = True, *,
                 rng: np.random.Generator, dtype=np.float32, std: float | None = None):
        self.nd = nd
        kernel, self.stride, self.dilation, self.pads = _conv_settings(
            nd, in_channels, out_channels, kernel_size, stride, padding, dilation)
        self.output_padding = _ints(output_padding, nd, "output_padding")
        for op, s in zip(self.output_padding, self.stride, strict=True):
            if not 0 <= op < s:
                raise ValueError(f"output_padding {output_padding!r} must be in [0, stride) "
                                 f"with stride {self.stride}")
        std = math.sqrt(2.0 / (in_channels * math.prod(kernel))) if std is None else std
        self.weight = Parameter(init_normal(rng, (in_channels, out_channels, *kernel), std,
                                            dtype))
        self.bias = Parameter(np.zeros(out_channels, dtype)) if bias else None

    @property
    def kernel_size(self) -> tuple[int, ...]:
        return self.weight.shape[2:]

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, ConvTransposeCache]:
        # x (N, C, *S) -> y (N, O, *So)
        name, (c, o), kernel = type(self).__name__, self.weight.shape[:2], self.kernel_size
        one = (1,) * self.nd
        _check_input(name, x, self.nd, c, one, one, ((0, 0),) * self.nd)
        full = tuple((n - 1) * s + d * (k - 1) + 1 + op for n, k, s, d, op in
                     zip(x.shape[2:], kernel, self.stride, self.dilation, self.output_padding,
                         strict=True))  # before the crop by padding
        if any(f - lo - hi < 1 for f, (lo, hi) in zip(full, self.pads, strict=True)):
            raise ValueError(f"{name}: padding {self.pads} leaves no output of the "
                             f"uncropped size {full} (input shape {x.shape})")
        x2 = x.swapaxes(0, 1).reshape(c, -1)  # (C, N P), a copy
        cols = self.weight.data.reshape(c, -1).T @ x2  # (O K, N P): the one GEMM
        cols = cols.reshape(o, -1, x.shape[0], *x.shape[2:])  # (O, K, N, *S)
        y = col2im(cols, (x.shape[0], o, *full), kernel, self.stride, self.dilation)
        y = np.ascontiguousarray(unpad(y, self.pads))  # (N, O, *So)
        if self.bias is not None:
            y += _per_channel(self.bias.data, y.ndim)
        return y, ConvTransposeCache(x2, x.shape)

    def backward(self, dy: np.ndarray, cache: ConvTransposeCache) -> np.ndarray:
        # dy (N, O, *So) -> dx (N, C, *S)
        x2, x_shape = cache
        c = self.weight.shape[0]
        if self.bias is not None:
            self.bias.grad += dy.sum(axis=(0, *range(2, dy.ndim)))
        cols = im2col(pad(dy, self.pads), self.kernel_size, self.stride, self.dilation)
        cols = cols.reshape(-1, x2.shape[1])  # (O K, N P); output_padding < s: P matches
        self.weight.grad += (x2 @ cols.T).reshape(self.weight.shape)  # (C, O K)
        dx2 = self.weight.data.reshape(c, -1) @ cols  # (C, N P)
        return np.ascontiguousarray(dx2.reshape(c, x_shape[0], *x_shape[2:]).swapaxes(0, 1))


class ConvTranspose2d(ConvTransposeNd):
    """``ConvTransposeNd`` on (N, C, H, W)."""

    def __init__(self, *args, **kwargs):
        super().__init__(2, *args, **kwargs)


class ConvTranspose3d(ConvTransposeNd):
    """``ConvTransposeNd`` on (N, C, D, H, W)."""

    def __init__(self, *args, **kwargs):
        super().__init__(3, *args, **kwargs)


# ---------------------------------------------------------------------------------
# Nearest upsampling by an integer factor


class Upsample(Module):
    """``y[n, c, i] = x[n, c, i // f]`` on every spatial axis (nearest, integer factor f).

    Backward sums each f-block: ``dx[n, c, j] = sum_{i // f = j} dy[n, c, i]``.
    """

    def __init__(self, nd: int, factor=2):
        self.nd = nd
        self.factor = _positive(factor, nd, "factor")

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, None]:
        # x (N, C, *S) -> y (N, C, *(S f)), through the view (N, C, S0, 1, S1, 1, ...)
        _check_input("Upsample", x, self.nd, None, (1,) * self.nd, (1,) * self.nd,
                      ((0, 0),) * self.nd)
        n, c, size = x.shape[0], x.shape[1], x.shape[2:]
        blocks = [d for s, f in zip(size, self.factor, strict=True) for d in (s, f)]
        xb = x.reshape(n, c, *[d for s in size for d in (s, 1)])
        y = np.broadcast_to(xb, (n, c, *blocks))
        return y.reshape(n, c, *[s * f for s, f in zip(size, self.factor, strict=True)]), None

    def backward(self, dy: np.ndarray, cache: None) -> np.ndarray:
        # dy (N, C, *(S f)) -> dx (N, C, *S)
        n, c = dy.shape[:2]
        size = [s // f for s, f in zip(dy.shape[2:], self.factor, strict=True)]
        blocks = [d for s, f in zip(size, self.factor, strict=True) for d in (s, f)]
        return dy.reshape(n, c, *blocks).sum(axis=tuple(range(3, 3 + 2 * self.nd, 2)))


# ---------------------------------------------------------------------------------
# ReLU


class ReLU(Module):
    """``y = max(x, 0)``; backward ``dx = dy [x > 0]``. The cache is the mask (one byte)."""

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # x (...) -> y (...)
        mask = x > 0
        return np.maximum(x, 0), mask

    def backward(self, dy: np.ndarray, cache: np.ndarray) -> np.ndarray:
        # dy (...) -> dx (...)
        return dy * cache
