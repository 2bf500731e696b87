"""A multi-layer perceptron classifier, built from hpctrain.nn.

    h_0 = x                                  (B, input_dim), floats scaled to [0, 1]
    h_i = gelu(h_{i-1} @ W_i + b_i)          (B, hidden[i-1])   for each hidden layer
    logits = h_L @ W_out + b_out             (B, n_classes)
    loss = cross_entropy(logits, targets)

Initialisation: one ``np.random.default_rng(seed)`` consumed in layer order; hidden
weights normal(0, sqrt(2 / fan_in)) (He), output weights normal(0, sqrt(1 / fan_in)),
biases zero. ``init_std`` (sized for the GPT's wide residual stream) is not used: with
it the activations of a 784-input MLP would start out vanishingly small.
"""

from __future__ import annotations

import math
from itertools import pairwise
from typing import NamedTuple

import numpy as np

from hpctrain.config import ConfigError, ModelConfig
from hpctrain.data.format import IMAGES
from hpctrain.models.protocol import Model
from hpctrain.nn import (
    GELU,
    CrossEntropyCache,
    GELUCache,
    Linear,
    LinearCache,
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


class MLPClassifier(Model):
    """Hidden Linear + GELU layers of widths ``cfg.hidden``, then a Linear to the classes.

    Declares (``hpctrain.models.protocol``) its config rules, model FLOPs and accuracy;
    no pipeline pieces or tensor plan: data parallelism only.
    """

    name = "MLP classifier"
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

    @classmethod
    def model_flops(cls, m: ModelConfig, samples: int) -> float:
        """``3 * samples * sum 2 n_in n_out`` over the layers: forward once, backward twice."""
        sizes = (m.input_dim, *m.hidden, m.n_classes)
        return 3.0 * samples * sum(2 * a * b for a, b in pairwise(sizes))

    def eval_metrics(self, x: np.ndarray, y: np.ndarray) -> dict[str, tuple[float, int]]:
        """Accuracy: (correct predictions, samples) of x (B, input_dim), y (B,)."""
        return {"accuracy": (int((self.predict(x) == y).sum()), len(y))}
