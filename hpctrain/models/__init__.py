"""The GPT and the MLP classifier, built only from hpctrain.nn."""

from hpctrain.models.build import build_model
from hpctrain.models.gpt import GPT, Block, Embed, FeedForward, GPTCache, Head, HeadCache
from hpctrain.models.mlp import MLPCache, MLPClassifier

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
    "build_model",
]
