"""A small 3-D U-Net: per-voxel tissue classes of a volume, built from hpctrain.nn.

    x (B, 1, D, H, W)                              the image crop, floats in [0, 1]
    encoder, level i = 0 .. L (width c_i = channels[i], L = len(channels) - 1):
        e_i = convbnrelu(convbnrelu(x_i))          (B, c_i, D / 2^i, ...)
        x_{i+1} = maxpool2(e_i)                    (for i < L)
    decoder, level i = L - 1 .. 0:
        u = upsample2(d_{i+1})  (d_L = e_L)        (B, c_{i+1}, D / 2^i, ...)
        d_i = convbnrelu(convbnrelu([u, e_i]))     the skip joined on channels
    logits = conv1x1(d_0)                          (B, K, D, H, W), K = n_classes
    loss = mean over the valid voxels of cross_entropy(logits, targets)

Targets equal to ``IGNORE`` (255: the padding of evaluation tiles beyond the volume)
count in neither the loss nor the Dice. Like every mean loss under data parallelism,
the loss is the mean over each data-parallel rank's valid voxels, averaged over the
ranks: the serial mean when the ranks hold equally many (every training crop lies in
the volume; the Dice sums are exact whatever the counts). Every 3 x 3 x 3 convolution
has padding 1 and no bias (BatchNorm's), so the crop's side must be divisible by 2^L.

Spatial parallelism (``sp > 1``, ``hpctrain.parallel.spatial_engine``) splits D: each
rank holds a slab of depth of every activation; the engine puts the convolutions and
pools on slabs, upsampling and the skip joins are slab-local, BatchNorm sums over the
spatial and data groups. The model takes its rows of image and targets
(``space.take``) and returns its share of the loss: its slab's cross-entropy sum over
the valid voxels of the whole batch (``space.sum`` counts them). The Dice sums of
``eval_metrics`` are likewise the slab's.

Evaluation: ``eval_metrics`` gives, for each tissue class k >= 1, the Dice score's
numerator and denominator, ``dice_k = (2 |P_k and T_k|, |P_k| + |T_k|)`` over the
valid voxels, so that the training loop's sums over batches and ranks give the Dice
of the whole volume.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from hpctrain.config import ConfigError, ModelConfig
from hpctrain.data.format import VOLUMES
from hpctrain.models.protocol import Model, Space
from hpctrain.nn import (
    ConvBNReLU,
    ConvBNReLUCache,
    ConvCache,
    ConvNd,
    CrossEntropyCache,
    MaxPool3d,
    MaxPoolCache,
    Upsample,
    cross_entropy,
    cross_entropy_backward,
)
from hpctrain.parallel.spatial import check_chain

IGNORE = 255  # a target voxel outside the volume (hpctrain.data.volumes)

_CONV = (3, 1, 1, (1, 1))  # kernel, stride, dilation, padding along the split axis
_POOL = (2, 2, 1, (0, 0))
_HEAD = (1, 1, 1, (0, 0))


class VoxelLossCache(NamedTuple):
    ce: CrossEntropyCache | None  # over the valid voxels of this slab (None: none)
    valid: np.ndarray  # (M,) bool, M = B D H W of the slab
    logits_shape: tuple[int, ...]  # (B, K, D, H, W)
    scale: float  # n_local / n_total: the slab's share of the mean


def voxel_cross_entropy(logits: np.ndarray, targets: np.ndarray, space: Space
                        ) -> tuple[float, VoxelLossCache]:
    """This slab's share of the mean cross-entropy over the valid voxels of the batch.

    logits (B, K, *S), targets (B, *S) int with IGNORE for no voxel."""
    k = logits.shape[1]
    z = np.moveaxis(logits, 1, -1).reshape(-1, k)  # (M, K)
    t = targets.reshape(-1)
    valid = t != IGNORE
    n_local = int(valid.sum())
    n_total = int(space.sum(np.array([n_local], np.int64))[0])
    if n_local == 0:
        return 0.0, VoxelLossCache(None, valid, logits.shape, 0.0)
    loss, ce = cross_entropy(z[valid], t[valid])
    scale = n_local / n_total
    return loss * scale, VoxelLossCache(ce, valid, logits.shape, scale)


def voxel_cross_entropy_backward(dloss: float, cache: VoxelLossCache, dtype) -> np.ndarray:
    # dloss scalar -> dlogits (B, K, *S), zero at the ignored voxels
    b, k, *size = cache.logits_shape
    dz = np.zeros((cache.valid.size, k), dtype)  # (M, K)
    if cache.ce is not None:
        dz[cache.valid] = cross_entropy_backward(dloss * cache.scale, cache.ce)
    return np.ascontiguousarray(np.moveaxis(dz.reshape(b, *size, k), -1, 1))


class Seg3DCache(NamedTuple):
    encoder: list[ConvBNReLUCache]
    pools: list[MaxPoolCache]
    decoder: list[ConvBNReLUCache]
    skip_channels: list[int]  # c_i of each join, to split its gradient
    head: ConvCache
    loss: VoxelLossCache


class Seg3D(Model):
    """A 3-D U-Net of ``len(channels)`` levels (module docstring) predicting
    ``n_classes`` per voxel from crops of shape ``crop``.

    Declares (``hpctrain.models.protocol``) its config rules, FLOPs, Dice, evaluation
    with BatchNorm's running statistics, ``share_batch`` and a spatial split along D.
    """

    name = "3-D segmentation net"
    batch_statistics = True  # BatchNorm (share_batch)
    data_format = VOLUMES
    config_keys = ("channels", "n_classes", "crop")

    def __init__(self, cfg: ModelConfig, seed: int):
        rng = np.random.default_rng(seed)
        dtype = np.dtype(cfg.dtype)
        self.cfg = cfg
        c = list(cfg.channels)
        self.encoder = []
        for i, width in enumerate(c):
            c_in = 1 if i == 0 else c[i - 1]
            self.encoder += [ConvBNReLU(3, c_in, width, rng=rng, dtype=dtype),
                             ConvBNReLU(3, width, width, rng=rng, dtype=dtype)]
        self.decoder = []
        for i in reversed(range(len(c) - 1)):
            self.decoder += [ConvBNReLU(3, c[i + 1] + c[i], c[i], rng=rng, dtype=dtype),
                             ConvBNReLU(3, c[i], c[i], rng=rng, dtype=dtype)]
        self.pool = MaxPool3d(2)
        self.up = Upsample(3, 2)
        self.head = ConvNd(3, c[0], cfg.n_classes, 1, rng=rng, dtype=dtype,
                           std=math.sqrt(1.0 / c[0]))

    def share_batch(self, reduce) -> None:
        """Compute BatchNorm's statistics over every rank whose batch ``reduce`` sums."""
        for layer in self.encoder + self.decoder:
            layer.bn.reduce = reduce

    def split_space(self, space: Space) -> None:
        """Hold the depth slab ``space.take`` of every activation."""
        self.space = space

    def _logits(self, x: np.ndarray, train: bool):
        # x (B, 1, D / sp, H, W) -> logits (B, K, D / sp, H, W), and the caches
        levels = len(self.cfg.channels)
        encoder, pools, decoder, skips, joins = [], [], [], [], []
        h = x
        for i in range(levels):
            for layer in self.encoder[2 * i:2 * i + 2]:
                h, cache = layer.forward(h, train)
                encoder.append(cache)
            if i < levels - 1:
                skips.append(h)  # (B, c_i, D_i, H_i, W_i)
                h, cache = self.pool.forward(h)
                pools.append(cache)
        for j, skip in enumerate(reversed(skips)):
            h = np.concatenate([self.up.forward(h)[0], skip], axis=1)  # (B, c_{i+1} + c_i, ...)
            joins.append(skip.shape[1])
            for layer in self.decoder[2 * j:2 * j + 2]:
                h, cache = layer.forward(h, train)
                decoder.append(cache)
        logits, head = self.head.forward(h)
        return logits, (encoder, pools, decoder, joins, head)

    def forward(self, x: np.ndarray, targets: np.ndarray, train: bool = True
                ) -> tuple[float, Seg3DCache]:
        # x (B, 1, D, H, W) float, targets (B, D, H, W) int -> this slab's share of the
        # mean loss over the valid voxels of the batch
        x, targets = self.space.take(x), self.space.take(targets, axis=1)
        logits, parts = self._logits(x, train)
        loss, cache = voxel_cross_entropy(logits, targets, self.space)
        return loss, Seg3DCache(*parts, cache)

    def backward(self, cache: Seg3DCache, dloss: float = 1.0) -> None:
        """Add the gradients of ``dloss * loss`` (this slab's share) into every ``.grad``."""
        dh = voxel_cross_entropy_backward(dloss, cache.loss, self.head.weight.data.dtype)
        dh = self.head.backward(dh, cache.head)
        dskips = {}  # join j -> the gradient of its skip, e_{L-2-j}
        for j in reversed(range(len(cache.skip_channels))):
            c_skip = cache.skip_channels[j]
            for k in (2 * j + 1, 2 * j):
                dh = self.decoder[k].backward(dh, cache.decoder[k])
            dskips[j] = dh[:, -c_skip:]
            dh = self.up.backward(dh[:, :-c_skip], None)
        levels = len(self.cfg.channels)
        for i in reversed(range(levels)):
            if i < levels - 1:
                dh = self.pool.backward(dh, cache.pools[i]) + dskips[levels - 2 - i]
            for k in (2 * i + 1, 2 * i):
                dh = self.encoder[k].backward(dh, cache.encoder[k], need_dx=k > 0)

    def predict(self, x: np.ndarray) -> np.ndarray:
        # x (B, 1, D, H, W) -> classes (B, D / sp, H, W) of this slab, running statistics
        return self._logits(self.space.take(x), train=False)[0].argmax(axis=1)

    # -----------------------------------------------------------------------------
    # what the engine reads (hpctrain.models.protocol)

    @classmethod
    def check_config(cls, m: ModelConfig, par) -> None:
        if m.n_classes < 2:
            raise ConfigError(f"n_classes ({m.n_classes}) must be at least 2")
        if not m.channels or not all(c >= 1 for c in m.channels):
            raise ConfigError(f"channels ({list(m.channels)}) must be one or more positive "
                              f"widths, one per level")
        if len(m.crop) != 3 or not all(n >= 1 for n in m.crop):
            raise ConfigError(f"crop ({list(m.crop)}) must be three positive sides D, H, W")
        step = 2 ** (len(m.channels) - 1)
        if any(n % step for n in m.crop):
            raise ConfigError(f"crop ({list(m.crop)}) must be divisible by 2^(levels - 1) "
                              f"= {step} on every axis ({len(m.channels)} levels: channels "
                              f"{list(m.channels)})")

    @classmethod
    def model_flops(cls, m: ModelConfig, samples: int) -> float:
        """``3 * samples * (sum over 3x3x3 convs 2 * 27 C O V_level + 2 c_0 K V)``."""
        c, voxels = list(m.channels), math.prod(m.crop)
        flops = 0.0
        for i, width in enumerate(c):
            v = voxels / 8 ** i
            c_in = 1 if i == 0 else c[i - 1]
            flops += 2 * 27 * (c_in * width + width * width) * v
            if i < len(c) - 1:
                flops += 2 * 27 * ((c[i + 1] + width) * width + width * width) * v
        flops += 2 * c[0] * m.n_classes * voxels
        return 3.0 * samples * flops

    @classmethod
    def spatial_axes(cls, m: ModelConfig) -> tuple[int, ...]:
        return (2,)  # depth (D) of (N, C, D, H, W)

    @classmethod
    def check_spatial(cls, m: ModelConfig, sp: int) -> None:
        """Every level's depth must split into sp slabs at least as thick as the halos."""
        levels = len(m.channels)
        chain = ([_CONV, _CONV, _POOL] * (levels - 1) + [_CONV, _CONV]
                 + [2, _CONV, _CONV] * (levels - 1) + [_HEAD])
        try:
            check_chain(m.crop[0], sp, chain, "layer")
        except ValueError as err:
            raise ConfigError(f"sp ({sp}) does not fit the crop depth {m.crop[0]} of the "
                              f"{cls.name} ({levels} levels): {err}; use a crop depth "
                              f"divisible by sp * 2^(levels - 1) with at least 1 row per "
                              f"rank at the deepest level") from None

    def eval_loss(self, x: np.ndarray, targets: np.ndarray) -> float:
        """The loss with BatchNorm's running statistics (nothing updated)."""
        return float(self.forward(x, targets, train=False)[0])

    @classmethod
    def eval_weight(cls, y: np.ndarray) -> int:
        """The valid voxels of the tiles: the loss is their mean."""
        return int((y != IGNORE).sum())

    def eval_metrics(self, x: np.ndarray, y: np.ndarray) -> dict[str, tuple[float, int]]:
        """``dice_k``: (2 |P_k and T_k|, |P_k| + |T_k|) over this slab's valid voxels,
        for each class k >= 1."""
        pred, y = self.predict(x), self.space.take(y, axis=1)
        valid = y != IGNORE
        figures = {}
        for k in range(1, self.cfg.n_classes):
            p, t = (pred == k) & valid, y == k
            figures[f"dice_{k}"] = (2 * int((p & t).sum()), int(p.sum() + t.sum()))
        return figures
