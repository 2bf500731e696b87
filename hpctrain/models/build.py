"""Build the model a ModelConfig describes."""

from __future__ import annotations

from hpctrain.config import ModelConfig
from hpctrain.models.protocol import Model
from hpctrain.models.registry import model_class


def build_model(model_cfg: ModelConfig, seed: int) -> Model:
    """The registered model of ``model_cfg.kind``; same seed, same weights."""
    return model_class(model_cfg.kind)(model_cfg, seed)
