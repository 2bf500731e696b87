"""Max and average pooling on channel-first arrays (``x (N, C, *S)``, 2-D or 3-D), each
forward followed by its backward: one strided slice per kernel offset, as in
``conv.im2col``. Max pooling pads with -inf and gives a tie to the first offset;
average pooling counts the padding zeros."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from hpctrain.nn.conv import _check_input, _out_shape, _padding, _positive, _window, pad, unpad
from hpctrain.nn.module import Module


class _Pool(Module):
    """Windows of ``kernel`` moved by ``stride`` (default: the kernel, no overlap), padding
    at most half the kernel so that every window holds an input entry."""

    def __init__(self, nd: int, kernel_size, stride=None, padding=0):
        self.nd = nd
        self.kernel_size = _positive(kernel_size, nd, "kernel_size")
        self.stride = self.kernel_size if stride is None else _positive(stride, nd, "stride")
        self.pads = _padding(padding, nd, self.kernel_size, self.stride, (1,) * nd)
        if any(lo > k // 2 for (lo, _), k in zip(self.pads, self.kernel_size, strict=True)):
            raise ValueError(f"padding {padding!r} must be at most half the kernel "
                             f"{self.kernel_size}")

    def _out_shape(self, x: np.ndarray) -> tuple[int, ...]:
        # x (N, C, *S) -> (N, C, *So), after checking x
        _check_input(type(self).__name__, x, self.nd, None, self.kernel_size, (1,) * self.nd,
                     self.pads)
        size = [n + lo + hi for n, (lo, hi) in zip(x.shape[2:], self.pads, strict=True)]
        return (*x.shape[:2], *_out_shape(size, self.kernel_size, self.stride, (1,) * self.nd))

    def _windows(self, out: tuple[int, ...]) -> list[tuple[slice, ...]]:
        # per kernel offset, the entries of xp it reads for the outputs (N, C, *So)
        one = (1,) * self.nd
        return [_window(k, self.stride, one, out[2:]) for k in np.ndindex(*self.kernel_size)]


class MaxPoolCache(NamedTuple):
    argmax: np.ndarray  # (N, C, *So) the kernel offset holding each window's maximum
    xp_shape: tuple[int, ...]  # (N, C, *Sp)


class MaxPoolNd(_Pool):
    """``y[n, c, p] = max_k xp[n, c, p s + k]``, xp padded with -inf; a tie goes to the
    first offset. Backward routes ``dy`` to the arg max: ``dxp[n, c, p s + k*] += dy``."""

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, MaxPoolCache]:
        # x (N, C, *S) -> y (N, C, *So)
        windows = self._windows(self._out_shape(x))
        xp = pad(x, self.pads, -np.inf)
        y = xp[windows[0]].copy()
        argmax = np.zeros(y.shape, np.min_scalar_type(len(windows)))
        for i, window in enumerate(windows[1:], start=1):
            v = xp[window]
            larger = v > y
            np.copyto(y, v, where=larger)
            argmax[larger] = i
        return y, MaxPoolCache(argmax, xp.shape)

    def backward(self, dy: np.ndarray, cache: MaxPoolCache) -> np.ndarray:
        # dy (N, C, *So) -> dx (N, C, *S)
        dxp = np.zeros(cache.xp_shape, dy.dtype)
        for i, window in enumerate(self._windows(dy.shape)):
            dxp[window] += np.where(cache.argmax == i, dy, 0)
        return unpad(dxp, self.pads)


class AvgPoolNd(_Pool):
    """``y[n, c, p] = 1/K sum_k xp[n, c, p s + k]``, xp zero-padded (the zeros count).
    Backward: ``dxp[n, c, p s + k] += dy[n, c, p] / K``."""

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
        # x (N, C, *S) -> y (N, C, *So); the cache is the padded shape
        out = self._out_shape(x)
        xp = pad(x, self.pads)
        y = np.zeros(out, x.dtype)
        for window in self._windows(out):
            y += xp[window]
        y /= math.prod(self.kernel_size)
        return y, xp.shape

    def backward(self, dy: np.ndarray, cache: tuple[int, ...]) -> np.ndarray:
        # dy (N, C, *So) -> dx (N, C, *S)
        dxp = np.zeros(cache, dy.dtype)
        share = dy / math.prod(self.kernel_size)
        for window in self._windows(dy.shape):
            dxp[window] += share
        return unpad(dxp, self.pads)


class MaxPool2d(MaxPoolNd):
    def __init__(self, *args, **kwargs):
        super().__init__(2, *args, **kwargs)


class MaxPool3d(MaxPoolNd):
    def __init__(self, *args, **kwargs):
        super().__init__(3, *args, **kwargs)


class AvgPool2d(AvgPoolNd):
    def __init__(self, *args, **kwargs):
        super().__init__(2, *args, **kwargs)


class AvgPool3d(AvgPoolNd):
    def __init__(self, *args, **kwargs):
        super().__init__(3, *args, **kwargs)
