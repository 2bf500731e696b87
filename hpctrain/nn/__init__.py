"""Layers with side-by-side forward and backward passes (see ``layers.py``)."""

from hpctrain.nn.attention import AttentionCache, CausalSelfAttention
from hpctrain.nn.layers import (
    GELU,
    Embedding,
    EmbeddingCache,
    GELUCache,
    LayerNorm,
    LayerNormCache,
    Linear,
    LinearCache,
    Residual,
    init_normal,
)
from hpctrain.nn.loss import CrossEntropyCache, cross_entropy, cross_entropy_backward
from hpctrain.nn.module import Module, Parameter

__all__ = [
    "GELU",
    "AttentionCache",
    "CausalSelfAttention",
    "CrossEntropyCache",
    "Embedding",
    "EmbeddingCache",
    "GELUCache",
    "LayerNorm",
    "LayerNormCache",
    "Linear",
    "LinearCache",
    "Module",
    "Parameter",
    "Residual",
    "cross_entropy",
    "cross_entropy_backward",
    "init_normal",
]
