"""Blocks built from the convolutional layers, forward and backward side by side.

``ConvBNReLU`` is the plain unit of VGG-style and U-Net-style networks, 2-D or 3-D:
``y = relu(bn(conv3(x)))``, padding 1, no convolution bias (BatchNorm has one).

``ResidualBlock`` is ResNet's basic block (He et al. 2015), on 2-D or 3-D inputs:

    x -> conv3 (stride s) -> bn -> relu -> conv3 -> bn --+-> relu -> y
    |                                                   |
    +------ identity, or conv1 (stride s) -> bn --------+

The skip is a 1x1 projection with its own BatchNorm when the channels or the stride
change, so that both branches have the same shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from hpctrain.nn.batchnorm import BatchNorm, BatchNormCache, serial_sum
from hpctrain.nn.conv import ConvCache, ConvNd, ReLU
from hpctrain.nn.module import Module


class ConvBNReLUCache(NamedTuple):
    conv: ConvCache
    bn: BatchNormCache
    relu: np.ndarray  # the ReLU's mask


class ConvBNReLU(Module):
    """``y = relu(bn(conv3(x)))``, padding 1: (N, C, *S) -> (N, O, *S)."""

    def __init__(self, nd: int, in_channels: int, out_channels: int, *,
                 rng: np.random.Generator, dtype=np.float32,
                 reduce: Callable[[np.ndarray], np.ndarray] = serial_sum):
        self.conv = ConvNd(nd, in_channels, out_channels, 3, padding=1, bias=False, rng=rng,
                           dtype=dtype)
        self.bn = BatchNorm(out_channels, reduce=reduce, dtype=dtype)
        self.relu = ReLU()

    def forward(self, x: np.ndarray, train: bool = True
                ) -> tuple[np.ndarray, ConvBNReLUCache]:
        # x (N, C, *S) -> y (N, O, *S)
        h, conv = self.conv.forward(x)
        h, bn = self.bn.forward(h, train)
        y, relu = self.relu.forward(h)
        return y, ConvBNReLUCache(conv, bn, relu)

    def backward(self, dy: np.ndarray, cache: ConvBNReLUCache,
                 need_dx: bool = True) -> np.ndarray | None:
        # dy (N, O, *S) -> dx (N, C, *S), or None with need_dx=False (the first layer)
        d = self.relu.backward(dy, cache.relu)
        d = self.bn.backward(d, cache.bn)
        return self.conv.backward(d, cache.conv, need_dx)


class ResidualBlockCache(NamedTuple):
    conv1: ConvCache
    bn1: BatchNormCache
    relu1: np.ndarray
    conv2: ConvCache
    bn2: BatchNormCache
    proj: ConvCache | None  # None with the identity skip
    proj_bn: BatchNormCache | None
    relu_out: np.ndarray


class ResidualBlock(Module):
    """``y = relu(bn2(conv2(relu(bn1(conv1(x))))) + skip(x))`` (module docstring).

    Backward: the two branches run backward from the same ``dh``, the gradient after
    the final ReLU, and their input gradients add: ``dx = dx_main + dx_skip``.
    ``reduce`` is handed to every BatchNorm (the group that shares the batch).
    """

    def __init__(self, nd: int, in_channels: int, out_channels: int, stride: int = 1, *,
                 rng: np.random.Generator, dtype=np.float32,
                 reduce: Callable[[np.ndarray], np.ndarray] = serial_sum):
        self.conv1 = ConvNd(nd, in_channels, out_channels, 3, stride, 1, bias=False,
                            rng=rng, dtype=dtype)
        self.bn1 = BatchNorm(out_channels, reduce=reduce, dtype=dtype)
        self.relu1 = ReLU()
        self.conv2 = ConvNd(nd, out_channels, out_channels, 3, 1, 1, bias=False,
                            rng=rng, dtype=dtype)
        self.bn2 = BatchNorm(out_channels, reduce=reduce, dtype=dtype)
        self.proj, self.proj_bn = None, None
        if in_channels != out_channels or stride != 1:
            self.proj = ConvNd(nd, in_channels, out_channels, 1, stride, 0, bias=False,
                               rng=rng, dtype=dtype)
            self.proj_bn = BatchNorm(out_channels, reduce=reduce, dtype=dtype)
        self.relu_out = ReLU()

    def forward(self, x: np.ndarray, train: bool = True
                ) -> tuple[np.ndarray, ResidualBlockCache]:
        # x (N, C, *S) -> y (N, O, *So), So = ceil(S / stride)
        h, c1 = self.conv1.forward(x)
        h, b1 = self.bn1.forward(h, train)
        h, r1 = self.relu1.forward(h)
        h, c2 = self.conv2.forward(h)
        h, b2 = self.bn2.forward(h, train)
        skip, cp, bp = x, None, None
        if self.proj is not None:
            skip, cp = self.proj.forward(x)
            skip, bp = self.proj_bn.forward(skip, train)
        y, r2 = self.relu_out.forward(h + skip)
        return y, ResidualBlockCache(c1, b1, r1, c2, b2, cp, bp, r2)

    def backward(self, dy: np.ndarray, cache: ResidualBlockCache) -> np.ndarray:
        # dy (N, O, *So) -> dx (N, C, *S)
        dh = self.relu_out.backward(dy, cache.relu_out)  # into both branches
        d = self.bn2.backward(dh, cache.bn2)
        d = self.conv2.backward(d, cache.conv2)
        d = self.relu1.backward(d, cache.relu1)
        d = self.bn1.backward(d, cache.bn1)
        dx = self.conv1.backward(d, cache.conv1)
        if self.proj is None:
            return dx + dh
        d = self.proj_bn.backward(dh, cache.proj_bn)
        return dx + self.proj.backward(d, cache.proj)
