"""A multi-layer perceptron classifier, built from hpctrain.nn.

    h_0 = x                                  (B, input_dim), floats scaled to [0, 1]
    h_i = gelu(h_{i-1} @ W_i + b_i)          (B, hidden[i-1])   for each hidden layer
    logits = h_L @ W_out + b_out             (B, n_classes)
    loss = cross_entropy(logits, targets)

Initialisation: one ``np.random.default_rng(seed)`` consumed in layer order; hidden
weights normal(0, sqrt(2 / fan_in)) (He), output weights normal(0, sqrt(1 / fan_in)),
biases zero. ``init_std`` (sized for the GPT's wide residual stream) is not used: with
it the activations of a 784-input MLP would start out vanishingly small.

Pipeline pieces: the first hidden layer, the other hidden layers one piece each, and
the output layer with the loss; the activation between pieces is (B, hidden[0]), so
pipelining needs equal hidden widths. Auxiliary heads (local losses): a Linear to the
classes and the cross-entropy, like the output layer, drawn from ``aux_rng``.
"""

from __future__ import annotations

import math
from itertools import pairwise
from typing import NamedTuple

import numpy as np

from hpctrain.config import ConfigError, ModelConfig
from hpctrain.data.format import IMAGES
from hpctrain.models.protocol import Model, Pieces, aux_rng
from hpctrain.nn import (
    GELU,
    CrossEntropyCache,
    GELUCache,
    Linear,
    LinearCache,
    Module,
    cross_entropy,
    cross_entropy_backward,
)


class MLPCache(NamedTuple):
    hidden: list[tuple[LinearCache, GELUCache]]
    out: LinearCache
    ce: CrossEntropyCache  # holds the logits, (B, n_classes)

    @property
    def logits(self) -> np.ndarray:
        """(B, n_classes)"""
        return self.ce.logits


class MLPLayer(Module):
    """One hidden layer as a pipeline piece: ``h = gelu(x @ W + b)``, (B, n_in) -> (B, n_out).
    ``need_dx`` False on the first layer, whose input is data; ``backward(...,
    need_dx=False)`` skips the input gradient's GEMM for one call (a local-loss stage's
    first layer: nothing goes back a stage)."""

    def __init__(self, linear: Linear, act: GELU, need_dx: bool = True):
        self.linear, self.act, self.need_dx = linear, act, need_dx

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, tuple[LinearCache, GELUCache]]:
        h, lin = self.linear.forward(x)
        h, act = self.act.forward(h)
        return h, (lin, act)

    def backward(self, dy: np.ndarray, cache: tuple[LinearCache, GELUCache],
                 need_dx: bool = True) -> np.ndarray | None:
        lin, act = cache
        return self.linear.backward(self.act.backward(dy, act), lin,
                                    need_dx=self.need_dx and need_dx)


class MLPHead(Module):
    """The output layer and the loss as a pipeline piece (and as an auxiliary head):
    ``loss = cross_entropy(h @ W + b, targets)``, h (B, C), targets (B,)."""

    def __init__(self, linear: Linear):
        self.linear = linear

    def forward(self, h: np.ndarray, targets: np.ndarray) -> tuple[float, tuple]:
        logits, lin = self.linear.forward(h)  # (B, n_classes)
        loss, ce = cross_entropy(logits, targets)
        return loss, (lin, ce)

    def backward(self, dloss: float, cache: tuple) -> np.ndarray:
        lin, ce = cache
        return self.linear.backward(cross_entropy_backward(dloss, ce), lin)  # (B, C)

    def eval_metrics(self, h: np.ndarray, y: np.ndarray) -> dict[str, tuple[float, int]]:
        """Accuracy of the classes this head predicts from h (B, C)."""
        logits = self.linear.forward(h)[0]
        return {"accuracy": (int((logits.argmax(axis=1) == y).sum()), len(y))}


class MLPClassifier(Model):
    """Hidden Linear + GELU layers of widths ``cfg.hidden``, then a Linear to the classes.

    Declares (``hpctrain.models.protocol``) its config rules, model FLOPs and accuracy,
    pipeline pieces (equal hidden widths) and auxiliary heads; no tensor plan.
    """

    name = "MLP classifier"
    runs_its_pieces = False  # forward runs its layers; the pieces serve a pipeline
    splits_batch = True  # loss a mean over B; no state but the gradients
    data_format = IMAGES
    config_keys = ("input_dim", "hidden", "n_classes")

    def __init__(self, cfg: ModelConfig, seed: int):
        rng = np.random.default_rng(seed)
        dtype = np.dtype(cfg.dtype)
        sizes = (cfg.input_dim, *cfg.hidden)
        self.cfg = cfg
        self.hidden = [Linear(n_in, n_out, rng=rng, dtype=dtype, std=math.sqrt(2.0 / n_in))
                       for n_in, n_out in pairwise(sizes)]
        self.act = GELU()
        self.out = Linear(sizes[-1], cfg.n_classes, rng=rng, dtype=dtype,
                          std=math.sqrt(1.0 / sizes[-1]))

    def _features(self, x: np.ndarray) -> tuple[np.ndarray, list]:
        # x (B, input_dim) -> h (B, hidden[-1]), or x itself with no hidden layers
        caches = []
        for layer in self.hidden:
            x, lin = layer.forward(x)
            x, act = self.act.forward(x)
            caches.append((lin, act))
        return x, caches

    def forward(self, x: np.ndarray, targets: np.ndarray) -> tuple[float, MLPCache]:
        # x (B, input_dim) float, targets (B,) int -> loss, mean over B
        h, hidden = self._features(x)
        logits, out = self.out.forward(h)  # (B, n_classes)
        loss, ce = cross_entropy(logits, targets)
        return loss, MLPCache(hidden, out, ce)

    def backward(self, cache: MLPCache, dloss: float = 1.0, *,
                 input_grad: bool = False) -> np.ndarray | None:
        """Add the gradients of ``dloss * loss`` into every parameter's ``.grad``.

        Returns the input gradient (B, input_dim) if ``input_grad``, else None (and
        skips the GEMM that would compute it).
        """
        dlogits = cross_entropy_backward(dloss, cache.ce)  # (B, n_classes)
        dh = self.out.backward(dlogits, cache.out, need_dx=input_grad or bool(self.hidden))
        for i in reversed(range(len(self.hidden))):
            lin, act = cache.hidden[i]
            dh = self.act.backward(dh, act)
            dh = self.hidden[i].backward(dh, lin, need_dx=input_grad or i > 0)
        return dh  # (B, input_dim) or None

    def logits(self, x: np.ndarray) -> np.ndarray:
        # x (B, input_dim) -> logits (B, n_classes)
        return self.out.forward(self._features(x)[0])[0]

    def predict(self, x: np.ndarray) -> np.ndarray:
        # x (B, input_dim) -> class indices (B,)
        return self.logits(x).argmax(axis=1)

    # -----------------------------------------------------------------------------
    # what the engine reads (hpctrain.models.protocol)

    @classmethod
    def check_config(cls, m: ModelConfig, par) -> None:
        if not (m.input_dim >= 1 and m.n_classes >= 2):
            raise ConfigError(f"input_dim ({m.input_dim}) must be >= 1 and n_classes "
                              f"({m.n_classes}) >= 2")
        if not all(h >= 1 for h in m.hidden):
            raise ConfigError(f"hidden sizes ({list(m.hidden)}) must be positive")
        if par.pp > 1 and len(set(m.hidden)) > 1:
            raise ConfigError(f"pipelining the MLP (pp {par.pp}) needs equal hidden widths "
                              f"(hidden is {list(m.hidden)}): one activation shape runs "
                              f"between stages")

    @classmethod
    def model_flops(cls, m: ModelConfig, samples: int) -> float:
        """``3 * samples * sum 2 n_in n_out`` over the layers: forward once, backward twice."""
        sizes = (m.input_dim, *m.hidden, m.n_classes)
        return 3.0 * samples * sum(2 * a * b for a, b in pairwise(sizes))

    def eval_metrics(self, x: np.ndarray, y: np.ndarray) -> dict[str, tuple[float, int]]:
        """Accuracy: (correct predictions, samples) of x (B, input_dim), y (B,)."""
        return {"accuracy": (int((self.predict(x) == y).sum()), len(y))}

    @classmethod
    def piece_costs(cls, m: ModelConfig) -> Pieces[float] | None:
        """Weights per piece: the first hidden layer, the other ones, the output layer."""
        if not m.hidden:
            return None
        c = m.hidden[0]
        return Pieces(float(m.input_dim * c), [float(a * b) for a, b in pairwise(m.hidden)],
                      float(m.hidden[-1] * m.n_classes))

    def pipeline_pieces(self) -> Pieces[Module]:
        # built once, kept in a dict (not walked for parameters): wrappers put on the
        # pieces (recompute, precision) stay on the pieces the pipeline runs
        built = self.__dict__.setdefault("_built", {})
        if "pieces" not in built:
            first, *rest = self.hidden
            built["pieces"] = Pieces(MLPLayer(first, self.act, need_dx=False),
                                     [MLPLayer(layer, self.act) for layer in rest],
                                     MLPHead(self.out))
        return built["pieces"]

    @classmethod
    def activation_shape(cls, m: ModelConfig, x_shape: tuple[int, ...]) -> tuple[int, ...]:
        return (x_shape[0], m.hidden[0])  # (B, input_dim) -> (B, C)

    @classmethod
    def has_aux_heads(cls, m: ModelConfig) -> bool:
        return bool(m.hidden)

    def aux_head(self, k: int, seed: int) -> MLPHead:
        """A linear classifier on the activation middle piece ``k`` outputs (B, C)."""
        c = self.cfg.hidden[k + 1]
        return MLPHead(Linear(c, self.cfg.n_classes, rng=aux_rng(seed, k),
                              dtype=np.dtype(self.cfg.dtype), std=math.sqrt(1.0 / c)))
