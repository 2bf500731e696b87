"""The MLP classifier (``model.py``): data parallelism only."""

from hpctrain.models.mlp.model import MLPCache, MLPClassifier

__all__ = ["MLPCache", "MLPClassifier"]
