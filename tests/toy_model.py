"""A third model for the protocol tests: a token model of residual MLP blocks, no
attention, declaring just what ``hpctrain.models.protocol`` asks, so that the engine
runs it at every layout without knowing it. Registered by the tests (``register``).

    x = wte[idx]                                  first    (B, T) -> (B, T, C)
    x = x + gelu(x @ W_fc + b_fc) @ W_proj + b    middle   (B, T, C), n_layer of them
    loss = cross_entropy(x @ W_out, targets)      last     (B, T, V)

Its tensor plan is Megatron's MLP: fc column-parallel, proj row-parallel, the rest
replicated, all with the engine's generic styles.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from hpctrain.config import ConfigError, ModelConfig
from hpctrain.data.format import TOKENS
from hpctrain.models.protocol import Model, Pieces, TensorPlan
from hpctrain.nn import (
    GELU,
    CrossEntropyCache,
    Embedding,
    GELUCache,
    Linear,
    LinearCache,
    Module,
    cross_entropy,
    cross_entropy_backward,
)

KIND = "toy"


class ResidualMLPCache(NamedTuple):
    fc: LinearCache
    gelu: GELUCache
    proj: LinearCache


class ResidualMLP(Module):
    def __init__(self, c: int, f: int, *, rng, dtype, std: float):
        self.fc = Linear(c, f, rng=rng, dtype=dtype, std=std)
        self.gelu = GELU()
        self.proj = Linear(f, c, rng=rng, dtype=dtype, std=std)

    def forward(self, x):
        # x (B, T, C) -> y (B, T, C); x is not modified
        h, fc = self.fc.forward(x)
        h, gelu = self.gelu.forward(h)
        h, proj = self.proj.forward(h)
        h += x
        return h, ResidualMLPCache(fc, gelu, proj)

    def backward(self, dy, cache: ResidualMLPCache):
        dh = self.proj.backward(dy, cache.proj)
        dh = self.gelu.backward(dh, cache.gelu)
        dx = self.fc.backward(dh, cache.fc)
        dx += dy  # the skip path
        return dx


class OutCache(NamedTuple):
    lin: LinearCache
    ce: CrossEntropyCache


class Out(Module):
    def __init__(self, c: int, v: int, *, rng, dtype, std: float):
        self.lin = Linear(c, v, bias=False, rng=rng, dtype=dtype, std=std)

    def forward(self, x, targets):
        # x (B, T, C), targets (B, T) -> loss, mean over B T
        logits, lin = self.lin.forward(x)
        loss, ce = cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return loss, OutCache(lin, ce)

    def backward(self, dloss, cache: OutCache):
        dlogits = cross_entropy_backward(dloss, cache.ce)
        return self.lin.backward(dlogits.reshape(*cache.lin.x.shape[:-1], -1), cache.lin)


def _nothing() -> None:
    pass


class ToyLM(Model):
    name = "toy residual MLP"
    data_format = TOKENS
    config_keys = ("vocab_size", "seq_len", "n_layer", "d_model", "d_ff")

    def __init__(self, cfg: ModelConfig, seed: int):
        rng = np.random.default_rng(seed)
        dtype, std = np.dtype(cfg.dtype), cfg.init_std
        self.cfg = cfg
        self.wte = Embedding(cfg.vocab_size, cfg.d_model, rng=rng, dtype=dtype, std=std)
        self.blocks = [ResidualMLP(cfg.d_model, cfg.ffn_dim, rng=rng, dtype=dtype, std=std)
                       for _ in range(cfg.n_layer)]
        self.out = Out(cfg.d_model, cfg.vocab_size, rng=rng, dtype=dtype, std=std)

    def forward(self, idx, targets):
        x, first = self.wte.forward(idx)
        caches = []
        for block in self.blocks:
            x, cache = block.forward(x)
            caches.append(cache)
        loss, last = self.out.forward(x, targets)
        return loss, (first, caches, last)

    def backward(self, cache, dloss=1.0, after_piece=_nothing):
        first, caches, last = cache
        dx = self.out.backward(dloss, last)
        after_piece()
        for block, c in zip(reversed(self.blocks), reversed(caches), strict=True):
            dx = block.backward(dx, c)
            after_piece()
        self.wte.backward(dx, first)
        after_piece()

    # what the engine reads
    @classmethod
    def check_config(cls, m, par):
        if m.ffn_dim % par.tp:
            raise ConfigError(f"tp ({par.tp}) must divide d_ff ({m.ffn_dim})")

    @classmethod
    def model_flops(cls, m, samples):
        c, f, v = m.d_model, m.ffn_dim, m.vocab_size
        return 3.0 * samples * m.seq_len * (m.n_layer * 2 * 2 * c * f + 2 * c * v)

    @classmethod
    def sample_len(cls, m):
        return m.seq_len

    @classmethod
    def piece_costs(cls, m):
        c, f, v = m.d_model, m.ffn_dim, m.vocab_size
        return Pieces(float(v * c), [float(2 * c * f + f + c)] * m.n_layer, float(c * v))

    def pipeline_pieces(self):
        return Pieces(self.wte, self.blocks, self.out)

    @classmethod
    def activation_shape(cls, m, x_shape):
        return (*x_shape, m.d_model)

    @classmethod
    def tensor_plan(cls, sequence_parallel):
        if sequence_parallel:
            return None
        return TensorPlan((("blocks.*.fc", "column"), ("blocks.*.proj", "row")))

    def backward_pieces(self):
        return ([self.out.parameters()] + [b.parameters() for b in reversed(self.blocks)]
                + [self.wte.parameters()])


TOY = ModelConfig(kind=KIND, dtype="float64", vocab_size=32, seq_len=8, n_layer=4,
                  d_model=16, d_ff=32)


def register(monkeypatch) -> None:
    """Register the toy under kind "toy" for one test (pytest's monkeypatch undoes it)."""
    from hpctrain.models import registry

    monkeypatch.setitem(registry.MODELS, KIND, ToyLM)
