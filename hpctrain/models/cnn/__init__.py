"""The CNN classifier (``model.py``): data parallelism only, BatchNorm synchronised
over the data group; its running statistics are buffers (``Module.named_buffers``),
saved in checkpoints beside the parameters."""

from hpctrain.models.cnn.model import CNNCache, CNNClassifier

__all__ = ["CNNCache", "CNNClassifier"]
