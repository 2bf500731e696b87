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

Pipeline pieces (``pp > 1``): the first piece prepares the images (reshape and pad, no
parameters), every conv3x3-BatchNorm-ReLU is a middle piece (the second of a stage
with the stage's max pool), the last is the head and the loss; the activations
between pieces differ in shape (``activation_shape_after``). BatchNorm's statistics
are those of each microbatch; evaluation runs the pieces with the running ones.
Auxiliary heads (local losses): the model's head on a middle piece's output (flatten,
a Linear to the classes, the cross-entropy), drawn from ``aux_rng``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from hpctrain.config import ConfigError, ModelConfig
from hpctrain.data.format import IMAGES
from hpctrain.models.protocol import Model, Pieces, Space, aux_rng
from hpctrain.nn import (
    ConvBNReLU,
    ConvBNReLUCache,
    CrossEntropyCache,
    Linear,
    LinearCache,
    MaxPool2d,
    MaxPoolCache,
    Module,
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


def layer_output(m: ModelConfig, i: int) -> tuple[int, int]:
    """(channels, side) leaving conv layer i (after the stage's pool on its last conv)."""
    stage, within = divmod(i, CONVS_PER_STAGE)
    side = padded_side(m) // 2 ** stage
    return m.channels[stage], side // 2 if within == CONVS_PER_STAGE - 1 else side


# one stage along one axis: two 3x3 convolutions (padding 1), a 2x2 max pool
STAGE_WINDOWS = [(3, 1, 1, (1, 1))] * CONVS_PER_STAGE + [(2, 2, 1, (0, 0))]


class CNNInput(Module):
    """The first pipeline piece: x (B, S*S) -> images (B, 1, S + 2p, S + 2p); nothing
    to learn, so no gradient reaches it (``ModelChunk`` skips the first conv's dx)."""

    def __init__(self, side: int, pad: int):
        self.side, self.pad = side, pad

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, None]:
        h = x.reshape(len(x), 1, self.side, self.side)  # (B, 1, S, S)
        p = self.pad
        return (np.pad(h, ((0, 0), (0, 0), (p, p), (p, p))) if p else h), None

    def backward(self, dy: np.ndarray | None, cache: None) -> None:
        return None


class CNNLayer(Module):
    """One conv3x3-BatchNorm-ReLU as a pipeline piece, with its stage's 2x2 max pool
    after it on the stage's last conv: (B, C, S, S) -> (B, O, S', S')."""

    def __init__(self, layer: ConvBNReLU, pool: MaxPool2d | None):
        self.layer, self.pool = layer, pool

    def forward(self, x: np.ndarray, train: bool = True) -> tuple[np.ndarray, tuple]:
        h, conv = self.layer.forward(x, train)
        pool = None
        if self.pool is not None:
            h, pool = self.pool.forward(h)  # (B, O, S // 2, S // 2)
        return h, (conv, pool)

    def backward(self, dy: np.ndarray, cache: tuple, need_dx: bool = True) -> np.ndarray | None:
        conv, pool = cache
        if self.pool is not None:
            dy = self.pool.backward(dy, pool)
        return self.layer.backward(dy, conv, need_dx)  # (B, C, S, S) or None


class CNNHead(Module):
    """Flatten, a Linear to the classes and the cross-entropy: the last pipeline piece
    and the auxiliary heads. h (B, C, S, S), targets (B,) -> the mean loss."""

    def __init__(self, linear: Linear):
        self.linear = linear

    def forward(self, h: np.ndarray, targets: np.ndarray) -> tuple[float, tuple]:
        logits, lin = self.linear.forward(h.reshape(len(h), -1))  # (B, n_classes)
        loss, ce = cross_entropy(logits, targets)
        return loss, (lin, ce, h.shape)

    def backward(self, dloss: float, cache: tuple) -> np.ndarray:
        lin, ce, shape = cache
        return self.linear.backward(cross_entropy_backward(dloss, ce), lin).reshape(shape)

    def eval_metrics(self, h: np.ndarray, y: np.ndarray) -> dict[str, tuple[float, int]]:
        """Accuracy of the classes this head predicts from h (B, C, S, S)."""
        logits = self.linear.forward(h.reshape(len(h), -1))[0]
        return {"accuracy": (int((logits.argmax(axis=1) == y).sum()), len(y))}


class CNNClassifier(Model):
    """Stages of two conv3x3-BatchNorm-ReLU and a 2x2 max pool, widths ``cfg.channels``,
    then a Linear from the flattened features to the classes (module docstring).

    Declares (``hpctrain.models.protocol``) its config rules, model FLOPs, accuracy,
    evaluation with BatchNorm's running statistics and ``share_batch``, spatial
    parallelism, pipeline pieces and auxiliary heads; no tensor plan.
    """

    name = "CNN classifier"
    batch_statistics = True  # BatchNorm (share_batch)
    runs_its_pieces = False  # forward runs its layers (and spatial halos) itself
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
        # the pipeline pieces, built once so that wrappers put on them (precision) stay;
        # in a dict, which the parameter and buffer walks do not enter
        self._built: dict[str, Pieces] = {}

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
        if par.pp > 1 and par.sp > 1:
            raise ConfigError(f"the CNN runs pipeline (pp {par.pp}) or spatial (sp {par.sp}) "
                              f"parallelism, not both")
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

    @classmethod
    def piece_costs(cls, m: ModelConfig) -> Pieces[float]:
        """Multiply-adds per sample: none for the image preparation, ``9 C O S^2`` per
        convolution, the head's Linear (FLOPs balance the stages, not parameters)."""
        costs, c_in = [], 1
        for i in range(CONVS_PER_STAGE * len(m.channels)):
            c, _ = layer_output(m, i)
            side = padded_side(m) // 2 ** (i // CONVS_PER_STAGE)
            costs.append(float(9 * c_in * c * side * side))
            c_in = c
        return Pieces(0.0, costs, float(c_in * feature_side(m) ** 2 * m.n_classes))

    def pipeline_pieces(self) -> Pieces[Module]:
        if "pieces" not in self._built:
            last = CONVS_PER_STAGE - 1
            self._built["pieces"] = Pieces(
                CNNInput(self.side, self.pad),
                [CNNLayer(layer, self.pool if i % CONVS_PER_STAGE == last else None)
                 for i, layer in enumerate(self.layers)], CNNHead(self.out))
        return self._built["pieces"]

    @classmethod
    def activation_shape_after(cls, m: ModelConfig, x_shape: tuple[int, ...],
                               j: int) -> tuple[int, ...]:
        """The activation leaving middle piece (conv layer) j: (B, c, s, s)."""
        c, side = layer_output(m, j)
        return (x_shape[0], c, side, side)

    @classmethod
    def activation_shape(cls, m: ModelConfig, x_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The first conv layer's output; the others: ``activation_shape_after``."""
        return cls.activation_shape_after(m, x_shape, 0)

    @classmethod
    def has_aux_heads(cls, m: ModelConfig) -> bool:
        return True

    def aux_head(self, k: int, seed: int) -> CNNHead:
        """A linear classifier on the flattened output of middle piece (conv layer) k."""
        c, side = layer_output(self.cfg, k)
        n_in = c * side * side
        return CNNHead(Linear(n_in, self.cfg.n_classes, rng=aux_rng(seed, k),
                              dtype=np.dtype(self.cfg.dtype), std=math.sqrt(1.0 / n_in)))
