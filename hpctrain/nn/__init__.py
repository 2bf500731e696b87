"""Layers with side-by-side forward and backward passes (see ``layers.py``)."""

from hpctrain.nn.attention import AttentionCache, CausalSelfAttention
from hpctrain.nn.batchnorm import BatchNorm, BatchNormCache, serial_sum
from hpctrain.nn.blocks import ConvBNReLU, ConvBNReLUCache, ResidualBlock, ResidualBlockCache
from hpctrain.nn.conv import (
    Conv2d,
    Conv3d,
    ConvCache,
    ConvNd,
    ConvTranspose2d,
    ConvTranspose3d,
    ConvTransposeCache,
    ConvTransposeNd,
    ReLU,
    Upsample,
)
from hpctrain.nn.embedding import EmbeddingBag, EmbeddingBagCache
from hpctrain.nn.interaction import DotInteraction, DotInteractionCache
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
from hpctrain.nn.module import Module, Parameter, SparseGrad, SparseParameter, is_sparse
from hpctrain.nn.pool import (
    AvgPool2d,
    AvgPool3d,
    AvgPoolNd,
    MaxPool2d,
    MaxPool3d,
    MaxPoolCache,
    MaxPoolNd,
)

__all__ = [
    "GELU",
    "AttentionCache",
    "AvgPool2d",
    "AvgPool3d",
    "AvgPoolNd",
    "BatchNorm",
    "BatchNormCache",
    "CausalSelfAttention",
    "Conv2d",
    "ConvBNReLU",
    "ConvBNReLUCache",
    "Conv3d",
    "ConvCache",
    "ConvNd",
    "ConvTranspose2d",
    "ConvTranspose3d",
    "ConvTransposeCache",
    "ConvTransposeNd",
    "CrossEntropyCache",
    "DotInteraction",
    "DotInteractionCache",
    "Embedding",
    "EmbeddingBag",
    "EmbeddingBagCache",
    "EmbeddingCache",
    "GELUCache",
    "LayerNorm",
    "LayerNormCache",
    "Linear",
    "LinearCache",
    "MaxPool2d",
    "MaxPool3d",
    "MaxPoolCache",
    "MaxPoolNd",
    "Module",
    "Parameter",
    "ReLU",
    "Residual",
    "SparseGrad",
    "SparseParameter",
    "ResidualBlock",
    "ResidualBlockCache",
    "Upsample",
    "cross_entropy",
    "cross_entropy_backward",
    "init_normal",
    "is_sparse",
    "serial_sum",
]
