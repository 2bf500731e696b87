"""Build the model a ModelConfig describes."""

from __future__ import annotations

from hpctrain.config import MODEL_KINDS, ModelConfig
from hpctrain.models.gpt import GPT
from hpctrain.models.mlp import MLPClassifier
from hpctrain.nn import Module


def build_model(model_cfg: ModelConfig, seed: int) -> Module:
    """A GPT for kind 'gpt', an MLPClassifier for kind 'mlp'; same seed, same weights."""
    if model_cfg.kind == "gpt":
        return GPT(model_cfg, seed)
    if model_cfg.kind == "mlp":
        return MLPClassifier(model_cfg, seed)
    raise ValueError(f"model kind ({model_cfg.kind!r}) must be one of {', '.join(MODEL_KINDS)}")
