"""The models, each a folder, built only from hpctrain.nn and declaring the protocol
of ``hpctrain.models.protocol``; ``registry`` names them by kind."""

from hpctrain.models.build import build_model
from hpctrain.models.gpt import GPT, Block, Embed, FeedForward, GPTCache, Head, HeadCache
from hpctrain.models.mlp import MLPCache, MLPClassifier
from hpctrain.models.protocol import Model, Pieces, TensorPlan

__all__ = [
    "GPT",
    "Block",
    "Embed",
    "FeedForward",
    "GPTCache",
    "Head",
    "HeadCache",
    "MLPCache",
    "MLPClassifier",
    "Model",
    "Pieces",
    "TensorPlan",
    "build_model",
]
