"""Build the model a ModelConfig describes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hpctrain.config import ModelConfig
from hpctrain.models.protocol import Model
from hpctrain.models.registry import model_class


def build_model(model_cfg: ModelConfig, seed: int,
                on_piece: Callable[[Any], None] | None = None) -> Model:
    """The registered model of ``model_cfg.kind``; same seed, same weights.

    ``on_piece``: called on each pipeline piece, in order, as soon as it is built when
    the model ``builds_by_piece`` (its weights the same), else not at all (the caller
    takes the pieces of the whole model).
    """
    cls = model_class(model_cfg.kind)
    if on_piece is not None and cls.builds_by_piece:
        return cls(model_cfg, seed, on_piece=on_piece)
    return cls(model_cfg, seed)
