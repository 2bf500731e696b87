"""The registered models: kind (``[model] kind`` in the config) -> model class.

Adding a model is one folder under ``hpctrain/models/`` and one line here. Each class
declares what ``hpctrain.models.protocol`` lists: its config check, its data format,
its pipeline pieces and tensor-parallel plan, if any.
"""

from __future__ import annotations

from hpctrain.config import ConfigError
from hpctrain.models.cnn import CNNClassifier
from hpctrain.models.dlrm import DLRM
from hpctrain.models.gpt import GPT
from hpctrain.models.mlp import MLPClassifier
from hpctrain.models.protocol import Model
from hpctrain.models.seg3d import Seg3D

MODELS: dict[str, type[Model]] = {
    "gpt": GPT,
    "mlp": MLPClassifier,
    "cnn": CNNClassifier,
    "seg3d": Seg3D,
    "dlrm": DLRM,
}


def model_class(kind: str) -> type[Model]:
    """The class registered under ``kind``; a ConfigError naming the kinds if none."""
    if kind not in MODELS:
        raise ConfigError(f"model kind ({kind!r}) must be one of {', '.join(MODELS)}")
    return MODELS[kind]


def kinds_for(data_format: str) -> list[str]:
    """The kinds of model that train on ``data_format``, in registry order."""
    return [kind for kind, cls in MODELS.items() if cls.data_format == data_format]
