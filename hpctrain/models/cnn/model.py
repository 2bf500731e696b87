"""A small convolutional classifier (VGG-style), built from hpctrain.nn.

    x (B, input_dim) -> (B, 1, S, S)            S = sqrt(input_dim), floats in [0, 1]
    for each stage i (width c_i = channels[i]):
        x = relu(bn(conv3x3(x)))  twice          (B, c_i, S_i, S_i), padding 1
        x = maxpool2(x)                          (B, c_i, S_i // 2, S_i // 2)
    logits = flatten(x) @ W_out + b_out          (B, n_classes)
    loss = cross_entropy(logits, targets)

The convolutions have no bias (the BatchNorm after each one has its own). With the
default ``channels = [32, 64]`` on 28 x 28 images: 28 -> 14 -> 7, a 64 * 7 * 7 = 3,136
input head.

BatchNorm, train and eval: ``forward(x, targets)`` (training) normalises with the
statistics of the batch and updates the running ones; ``eval_loss`` and
``eval_metrics`` (evaluation) use the running statistics, so a prediction does not
depend on the rest of its batch and evaluation does not move them. Under data
parallelism the engine hands the model the sum over the data group
(``share_batch``), so the statistics are those of the global batch: dp ranks train
exactly as one serial rank would (synchronised BatchNorm, two small all-reduces per
BatchNorm and step) and their running statistics agree. The running statistics are
buffers, not parameters: checkpoints hold them (``model/layers.0.bn.running_mean``),
no optimizer sees them.

Initialisation: one ``np.random.default_rng(seed)`` consumed in layer order;
convolutions He normal ``sqrt(2 / (C k^2))``, the head ``sqrt(1 / fan_in)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from hpctrain.config import ConfigError, ModelConfig
from hpctrain.data.format import IMAGES
from hpctrain.models.protocol import Model
from hpctrain.nn import (
    BatchNorm,
    BatchNormCache,
    Conv2d,
    ConvCache,
    CrossEntropyCache,
    Linear,
    LinearCache,
    MaxPool2d,
    MaxPoolCache,
    Module,
    ReLU,
    cross_entropy,
    cross_entropy_backward,
    serial_sum,
)

CONVS_PER_STAGE = 2


class ConvBNReLUCache(NamedTuple):
    conv: ConvCache
    bn: BatchNormCache
    relu: np.ndarray  # the ReLU's mask


class ConvBNReLU(Module):
    """``y = relu(bn(conv3x3(x)))``, padding 1: (N, C, H, W) -> (N, O, H, W)."""

    def __init__(self, in_channels: int, out_channels: int, *, rng: np.random.Generator,
                 dtype, reduce: Callable[[np.ndarray], np.ndarray] = serial_sum):
        self.conv = Conv2d(in_channels, out_channels, 3, padding=1, bias=False, rng=rng,
                           dtype=dtype)
        self.bn = BatchNorm(out_channels, reduce=reduce, dtype=dtype)
        self.relu = ReLU()

    def forward(self, x: np.ndarray, train: bool = True
                ) -> tuple[np.ndarray, ConvBNReLUCache]:
        # x (N, C, H, W) -> y (N, O, H, W)
        h, conv = self.conv.forward(x)
        h, bn = self.bn.forward(h, train)
        y, relu = self.relu.forward(h)
        return y, ConvBNReLUCache(conv, bn, relu)

    def backward(self, dy: np.ndarray, cache: ConvBNReLUCache,
                 need_dx: bool = True) -> np.ndarray | None:
        # dy (N, O, H, W) -> dx (N, C, H, W), or None with need_dx=False (the first layer)
        d = self.relu.backward(dy, cache.relu)
        d = self.bn.backward(d, cache.bn)
        return self.conv.backward(d, cache.conv, need_dx)


class CNNCache(NamedTuple):
    layers: list[ConvBNReLUCache]
    pools: list[MaxPoolCache]
    feature_shape: tuple[int, ...]  # (B, c_last, S_last, S_last), before flattening
    out: LinearCache
    ce: CrossEntropyCache  # holds the logits, (B, n_classes)

    @property
    def logits(self) -> np.ndarray:
        """(B, n_classes)"""
        return self.ce.logits


def image_side(input_dim: int) -> int:
    """The side S of the square images of ``input_dim = S * S`` values (0 if not square)."""
    s = math.isqrt(max(input_dim, 0))
    return s if s * s == input_dim else 0


def feature_side(m: ModelConfig) -> int:
    """The side of the last stage's output: S halved (floor) once per stage."""
    return image_side(m.input_dim) // 2 ** len(m.channels)


class CNNClassifier(Model):
    """Stages of two conv3x3-BatchNorm-ReLU and a 2x2 max pool, widths ``cfg.channels``,
    then a Linear from the flattened features to the classes (module docstring).

    Declares (``hpctrain.models.protocol``) its config rules, model FLOPs, accuracy,
    evaluation with BatchNorm's running statistics and ``share_batch``; no pipeline
    pieces or tensor plan: data parallelism only.
    """

    name = "CNN classifier"
    data_format = IMAGES
    config_keys = ("input_dim", "channels", "n_classes")

    def __init__(self, cfg: ModelConfig, seed: int):
        rng = np.random.default_rng(seed)
        dtype = np.dtype(cfg.dtype)
        self.cfg = cfg
        self.side = image_side(cfg.input_dim)
        widths = [c for c in cfg.channels for _ in range(CONVS_PER_STAGE)]
        self.layers = [ConvBNReLU(c_in, c_out, rng=rng, dtype=dtype)
                       for c_in, c_out in zip([1, *widths[:-1]], widths, strict=True)]
        self.pool = MaxPool2d(2)
        n_in = cfg.channels[-1] * feature_side(cfg) ** 2
        self.out = Linear(n_in, cfg.n_classes, rng=rng, dtype=dtype, std=math.sqrt(1.0 / n_in))

    def share_batch(self, reduce: Callable[[np.ndarray], np.ndarray]) -> None:
        """Compute BatchNorm's statistics over every rank whose batch ``reduce`` sums."""
        for layer in self.layers:
            layer.bn.reduce = reduce

    def _features(self, x: np.ndarray, train: bool) -> tuple[np.ndarray, list, list]:
        # x (B, S*S) -> h (B, c_last, S_last, S_last)
        h = x.reshape(len(x), 1, self.side, self.side)  # (B, 1, S, S)
        layers, pools = [], []
        for i, layer in enumerate(self.layers):
            h, cache = layer.forward(h, train)
            layers.append(cache)
            if i % CONVS_PER_STAGE == CONVS_PER_STAGE - 1:
                h, pool = self.pool.forward(h)  # (B, c_i, S_i // 2, S_i // 2)
                pools.append(pool)
        return h, layers, pools

    def forward(self, x: np.ndarray, targets: np.ndarray, train: bool = True
                ) -> tuple[float, CNNCache]:
        # x (B, input_dim) float, targets (B,) int -> loss, mean over B
        h, layers, pools = self._features(x, train)
        logits, out = self.out.forward(h.reshape(len(h), -1))  # (B, n_classes)
        loss, ce = cross_entropy(logits, targets)
        return loss, CNNCache(layers, pools, h.shape, out, ce)

    def backward(self, cache: CNNCache, dloss: float = 1.0) -> None:
        """Add the gradients of ``dloss * loss`` into every parameter's ``.grad``."""
        dlogits = cross_entropy_backward(dloss, cache.ce)  # (B, n_classes)
        dh = self.out.backward(dlogits, cache.out).reshape(cache.feature_shape)
        for i in reversed(range(len(self.layers))):
            if i % CONVS_PER_STAGE == CONVS_PER_STAGE - 1:
                dh = self.pool.backward(dh, cache.pools[i // CONVS_PER_STAGE])
            dh = self.layers[i].backward(dh, cache.layers[i], need_dx=i > 0)

    def logits(self, x: np.ndarray) -> np.ndarray:
        # x (B, input_dim) -> logits (B, n_classes), with the running statistics
        h = self._features(x, train=False)[0]
        return self.out.forward(h.reshape(len(h), -1))[0]

    def predict(self, x: np.ndarray) -> np.ndarray:
        # x (B, input_dim) -> class indices (B,)
        return self.logits(x).argmax(axis=1)

    # -----------------------------------------------------------------------------
    # what the engine reads (hpctrain.models.protocol)

    @classmethod
    def check_config(cls, m: ModelConfig, par) -> None:
        side = image_side(m.input_dim)
        if side == 0:
            raise ConfigError(f"input_dim ({m.input_dim}) must be the size of a square "
                              f"image, S * S (784 = 28 * 28 for Fashion-MNIST)")
        if m.n_classes < 2:
            raise ConfigError(f"n_classes ({m.n_classes}) must be at least 2")
        if not m.channels or not all(c >= 1 for c in m.channels):
            raise ConfigError(f"channels ({list(m.channels)}) must be one or more positive "
                              f"widths, one per stage")
        if feature_side(m) < 1:
            raise ConfigError(f"{len(m.channels)} stages (channels {list(m.channels)}) "
                              f"halve the image side {side} to 0: use at most "
                              f"{side.bit_length() - 1} stages for input_dim {m.input_dim}")

    @classmethod
    def model_flops(cls, m: ModelConfig, samples: int) -> float:
        """``3 * samples * (sum over convs 2 * 9 C O S_i^2 + 2 * n_in * n_classes)``:
        forward once, backward twice (BatchNorm, ReLU and pooling are not counted)."""
        flops, c_in, side = 0, 1, image_side(m.input_dim)
        for c in m.channels:
            for _ in range(CONVS_PER_STAGE):
                flops += 2 * 9 * c_in * c * side * side
                c_in = c
            side //= 2
        flops += 2 * c_in * side * side * m.n_classes
        return 3.0 * samples * flops

    def eval_loss(self, x: np.ndarray, targets: np.ndarray) -> float:
        """The loss with BatchNorm's running statistics (no collective, nothing updated)."""
        return float(self.forward(x, targets, train=False)[0])

    def eval_metrics(self, x: np.ndarray, y: np.ndarray) -> dict[str, tuple[float, int]]:
        """Accuracy: (correct predictions, samples) of x (B, input_dim), y (B,)."""
        return {"accuracy": (int((self.predict(x) == y).sum()), len(y))}
