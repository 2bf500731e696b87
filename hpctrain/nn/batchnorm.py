"""BatchNorm over a group of ranks: per-channel statistics summed by a ``reduce`` hook
(the data-parallel and spatial ranks that share a batch; the identity when serial),
so the layer needs no MPI."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from hpctrain.nn.conv import _flat, _per_channel
from hpctrain.nn.module import Module, Parameter


def serial_sum(a: np.ndarray) -> np.ndarray:
    """The reduction over a group of one rank: the identity."""
    return a


class BatchNormCache(NamedTuple):
    xhat: np.ndarray  # (N, C, *S) normalised input
    rstd: np.ndarray  # (C,) 1 / sqrt(var + eps), of the batch (train) or running (eval)
    count: float | None  # entries per channel summed over the group; None in eval mode


class BatchNorm(Module):
    """``y = w xhat + b``, ``xhat = (x - mean) / sqrt(var + eps)`` per channel, the mean and
    (biased) variance over the axes (N, *S) of *every rank that shares the batch*.

    ``reduce(a)`` returns the element-wise sum of ``a`` over that group (data-parallel
    and spatial ranks; an MPI all-reduce, or ``serial_sum``). In train mode it runs once
    in forward on ``[sum x, sum x^2, count]`` and once in backward on
    ``[sum dy, sum dy xhat]``, float64 ``(3, C)`` and ``(2, C)``, on every rank.
    Backward, with means over the group (``g = dy w``, the derivative of both stats):
    ``dx = rstd (g - mean(g) - xhat mean(g xhat))``; ``dw += sum dy xhat`` and
    ``db += sum dy`` over this rank's entries only, like any parameter gradient.
    The variance is ``E[x^2] - mean^2`` (one reduction), summed in float64.
    ``forward(x, train=False)`` uses the running statistics, an affine map with
    ``dx = dy w rstd``; train mode updates them with ``momentum`` (unbiased variance).
    """

    buffer_names = ("running_mean", "running_var")  # saved in checkpoints (Module)

    def __init__(self, channels: int, eps: float = 1e-5, momentum: float = 0.1, *,
                 reduce: Callable[[np.ndarray], np.ndarray] = serial_sum, dtype=np.float32):
        if channels < 1 or not 0.0 <= momentum <= 1.0:
            raise ValueError(f"BatchNorm needs channels >= 1 and momentum in [0, 1], got "
                             f"channels {channels}, momentum {momentum}")
        self.eps, self.momentum, self.reduce = eps, momentum, reduce
        self.weight = Parameter(np.ones(channels, dtype))
        self.bias = Parameter(np.zeros(channels, dtype))
        self.running_mean = np.zeros(channels, dtype)  # buffers, not parameters
        self.running_var = np.ones(channels, dtype)

    def forward(self, x: np.ndarray, train: bool = True) -> tuple[np.ndarray, BatchNormCache]:
        # x (N, C, *S) -> y (N, C, *S)
        channels = self.weight.shape[0]
        if x.ndim < 2 or x.shape[1] != channels:
            raise ValueError(f"BatchNorm expects (N, {channels}, ...), got shape {x.shape}")
        if train:
            axes = (0, *range(2, x.ndim))
            local = np.stack([x.sum(axis=axes, dtype=np.float64),
                              np.square(x).sum(axis=axes, dtype=np.float64),
                              np.full(channels, x.size / channels)])  # (3, C)
            total = self.reduce(local)
            count = float(total[2, 0])
            mean = total[0] / count
            var = np.maximum(total[1] / count - mean**2, 0.0)
            m = self.momentum
            self.running_mean[:] = (1 - m) * self.running_mean + m * mean
            self.running_var[:] = (1 - m) * self.running_var + m * var * count / max(count - 1, 1)
        else:
            mean, var, count = self.running_mean, self.running_var, None
        rstd = (1.0 / np.sqrt(var + self.eps)).astype(x.dtype)
        xhat = (x - _per_channel(mean.astype(x.dtype), x.ndim)) * _per_channel(rstd, x.ndim)
        y = xhat * _per_channel(self.weight.data, x.ndim) + _per_channel(self.bias.data, x.ndim)
        return y, BatchNormCache(xhat, rstd, count)

    def backward(self, dy: np.ndarray, cache: BatchNormCache) -> np.ndarray:
        # dy (N, C, *S) -> dx (N, C, *S)
        xhat, rstd, count = cache
        axes = (0, *range(2, dy.ndim))
        local = np.stack([dy.sum(axis=axes, dtype=np.float64),
                          np.einsum("ncp,ncp->c", _flat(dy), _flat(xhat), dtype=np.float64)])
        self.bias.grad += local[0]
        self.weight.grad += local[1]
        scale = _per_channel(self.weight.data * rstd, dy.ndim)  # w rstd
        if count is None:  # eval: the statistics are constants
            return dy * scale
        total = self.reduce(local) / count  # [mean dy, mean dy xhat] over the group
        mean_dy, mean_dy_xhat = (_per_channel(t.astype(dy.dtype), dy.ndim) for t in total)
        return scale * (dy - mean_dy - xhat * mean_dy_xhat)
