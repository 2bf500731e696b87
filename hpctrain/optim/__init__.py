"""Optimizers, the learning-rate schedule and gradient clipping."""

from hpctrain.optim.clip import clip_grads, grad_norm, grad_sq_sum
from hpctrain.optim.optimizers import SGD, AdamW, Optimizer
from hpctrain.optim.schedule import lr_at

__all__ = ["SGD", "AdamW", "Optimizer", "clip_grads", "grad_norm", "grad_sq_sum", "lr_at"]
