"""A small convolutional classifier (VGG-style), built from hpctrain.nn.

    x (B, input_dim) -> (B, 1, S, S)            S = sqrt(input_dim), floats in [0, 1]
    for each stage i (width c_i = channels[i]):
        x = relu(bn(conv3x3(x)))  twice          (B, c_i, S_i, S_i), padding 1
        x = maxpool2(x)                          (B, c_i, S_i // 2, S_i // 2)
    logits = flatten(x) @ W_out + b_out          (B, n_classes)
    loss = cross_entropy(logits, targets)

The convolutions have no bias (the BatchNorm after each one has its own). With the
default ``channels = [32, 64]`` on 28 x 28 images: 28 -> 14 -> 7, a 64 * 7 * 7 = 3,136
input head. ``image_pad`` adds zero pixels around each image first: 2 makes 28 x 28 a
32 x 32, 32 -> 16 -> 8, which 2 and 4 spatial ranks divide at every stage.

Spatial parallelism (``sp > 1``, ``hpctrain.parallel.spatial_engine``): each rank holds
a slab of rows (H) of every activation; the engine puts the convolutions and pools on
slabs, and the model takes its rows of the image (``space.take``) and gathers the
last stage's rows before the head (``space.gather``; in backward
``space.gather_backward``). Every rank then computes the whole head and loss, so its
share of the loss is ``loss / sp`` and accuracy is counted on spatial rank 0.

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
from hpctrain.models.protocol import Model, Space
from hpctrain.nn import (
    ConvBNReLU,
    ConvBNReLUCache,
    CrossEntropyCache,
    Linear,
    LinearCache,
    MaxPool2d,
    MaxPoolCache,
    cross_entropy,
    cross_entropy_backward,
)
from hpctrain.parallel.spatial import check_chain

CONVS_PER_STAGE = 2


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


def padded_side(m: ModelConfig) -> int:
    """The side of the images the first convolution sees: S + 2 image_pad."""
    return image_side(m.input_dim) + 2 * m.image_pad


def feature_side(m: ModelConfig) -> int:
    """The side of the last stage's output: the padded side halved (floor) per stage."""
    return padded_side(m) // 2 ** len(m.channels)


# one stage along one axis: two 3x3 convolutions (padding 1), a 2x2 max pool
STAGE_WINDOWS = [(3, 1, 1, (1, 1))] * CONVS_PER_STAGE + [(2, 2, 1, (0, 0))]


class CNNClassifier(Model):
    """Stages of two conv3x3-BatchNorm-ReLU and a 2x2 max pool, widths ``cfg.channels``,
    then a Linear from the flattened features to the classes (module docstring).

    Declares (``hpctrain.models.protocol``) its config rules, model FLOPs, accuracy,
    evaluation with BatchNorm's running statistics and ``share_batch``; no pipeline
    pieces or tensor plan: data parallelism only.
    """

    name = "CNN classifier"
    data_format = IMAGES
    config_keys = ("input_dim", "channels", "n_classes", "image_pad")

    def __init__(self, cfg: ModelConfig, seed: int):
        rng = np.random.default_rng(seed)
        dtype = np.dtype(cfg.dtype)
        self.cfg = cfg
        self.side = image_side(cfg.input_dim)
        self.pad = cfg.image_pad
        widths = [c for c in cfg.channels for _ in range(CONVS_PER_STAGE)]
        self.layers = [ConvBNReLU(2, c_in, c_out, rng=rng, dtype=dtype)
                       for c_in, c_out in zip([1, *widths[:-1]], widths, strict=True)]
        self.pool = MaxPool2d(2)
        n_in = cfg.channels[-1] * feature_side(cfg) ** 2
        self.out = Linear(n_in, cfg.n_classes, rng=rng, dtype=dtype, std=math.sqrt(1.0 / n_in))

    def share_batch(self, reduce: Callable[[np.ndarray], np.ndarray]) -> None:
        """Compute BatchNorm's statistics over every rank whose batch ``reduce`` sums."""
        for layer in self.layers:
            layer.bn.reduce = reduce

    def split_space(self, space: Space) -> None:
        """Hold rows ``space.take`` of every activation (spatial parallelism)."""
        self.space = space

    def _features(self, x: np.ndarray, train: bool) -> tuple[np.ndarray, list, list]:
        # x (B, S*S) -> h (B, c_last, S_last / sp, S_last): this rank's rows
        h = x.reshape(len(x), 1, self.side, self.side)  # (B, 1, S, S)
        if self.pad:
            p = self.pad
            h = np.pad(h, ((0, 0), (0, 0), (p, p), (p, p)))  # (B, 1, S + 2p, S + 2p)
        h = self.space.take(h)  # (B, 1, Sp / sp, Sp)
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
        # x (B, input_dim) float, targets (B,) int -> loss, mean over B (its share: / sp)
        h, layers, pools = self._features(x, train)
        h = self.space.gather(h)  # (B, c_last, S_last, S_last)
        logits, out = self.out.forward(h.reshape(len(h), -1))  # (B, n_classes)
        loss, ce = cross_entropy(logits, targets)
        return loss / self.space.size, CNNCache(layers, pools, h.shape, out, ce)

    def backward(self, cache: CNNCache, dloss: float = 1.0) -> None:
        """Add the gradients of ``dloss * loss`` (its share) into every ``.grad``."""
        dlogits = cross_entropy_backward(dloss / self.space.size, cache.ce)  # (B, n_classes)
        dh = self.out.backward(dlogits, cache.out).reshape(cache.feature_shape)
        dh = self.space.gather_backward(dh)  # (B, c_last, S_last / sp, S_last)
        for i in reversed(range(len(self.layers))):
            if i % CONVS_PER_STAGE == CONVS_PER_STAGE - 1:
                dh = self.pool.backward(dh, cache.pools[i // CONVS_PER_STAGE])
            dh = self.layers[i].backward(dh, cache.layers[i], need_dx=i > 0)

    def logits(self, x: np.ndarray) -> np.ndarray:
        # x (B, input_dim) -> logits (B, n_classes), with the running statistics
        h = self.space.gather(self._features(x, train=False)[0])
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
        if m.image_pad < 0:
            raise ConfigError(f"image_pad ({m.image_pad}) must not be negative")
        if feature_side(m) < 1:
            side = padded_side(m)
            raise ConfigError(f"{len(m.channels)} stages (channels {list(m.channels)}) "
                              f"halve the image side {side} to 0: use at most "
                              f"{side.bit_length() - 1} stages for input_dim {m.input_dim}")

    @classmethod
    def spatial_axes(cls, m: ModelConfig) -> tuple[int, ...]:
        return (2,)  # rows (H) of (N, C, H, W)

    @classmethod
    def check_spatial(cls, m: ModelConfig, sp: int) -> None:
        """Every stage's rows must split into sp slabs at least as thick as the halos."""
        side = padded_side(m)
        try:
            check_chain(side, sp, STAGE_WINDOWS * len(m.channels), "window")
        except ValueError as err:
            raise ConfigError(f"sp ({sp}) does not fit the CNN's {side}-row images "
                              f"(input_dim {m.input_dim}, image_pad {m.image_pad}, "
                              f"{len(m.channels)} stages): {err}; try image_pad so that "
                              f"sp * 2^stages divides the side") from None

    @classmethod
    def model_flops(cls, m: ModelConfig, samples: int) -> float:
        """``3 * samples * (sum over convs 2 * 9 C O S_i^2 + 2 * n_in * n_classes)``:
        forward once, backward twice (BatchNorm, ReLU and pooling are not counted)."""
        flops, c_in, side = 0, 1, padded_side(m)
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
        """Accuracy: (correct predictions, samples) of x (B, input_dim), y (B,); under
        spatial parallelism counted on spatial rank 0 (every rank predicts alike)."""
        correct = int((self.predict(x) == y).sum())
        return {"accuracy": (correct, len(y)) if self.space.rank == 0 else (0, 0)}
