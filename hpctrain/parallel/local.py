"""``LocalEngine``: the whole model on this rank (serial, or pure data parallelism),
the reference every other engine follows (see ``engine.py`` for the interface)."""

from __future__ import annotations

from typing import Any

import numpy as np

from hpctrain import trace
from hpctrain.optim import clip


class LocalEngine:
    """The whole model on this rank (serial, or pure data parallelism).

    Gradient accumulation: ``forward_backward`` splits this rank's batch into
    ``microbatches`` equal chunks and accumulates the gradient of the mean loss. With
    ``on_grads_ready`` set, the last microbatch of a model declaring
    ``backward_pieces`` (the GPT: head, then each block's MLP and attention halves,
    then the embedding) runs backward piece by piece and reports each piece's
    parameters when their gradients are final.
    """

    def __init__(self, model: Any, microbatches: int):
        self.model = model
        self.microbatches = microbatches
        self.named_params = model.named_parameters()
        self.params = [p for _, p in self.named_params]
        self.named_buffers = model.named_buffers()  # (BatchNorm's running statistics)
        self.on_grads_ready = None
        pieces = model.backward_pieces()
        self._final = None if pieces is None else _final_after_each_piece(pieces)

    def zero_grad(self) -> None:
        self.model.zero_grad()

    def forward_backward(self, x: np.ndarray, y: np.ndarray, scale: float = 1.0) -> float:
        """Accumulate gradients of ``scale * mean loss``; return the mean loss (unscaled).

        x, y: (b, ...) with b divisible by ``microbatches``.
        """
        total = 0.0
        m = self.microbatches
        for i, (xs, ys) in enumerate(zip(np.split(x, m), np.split(y, m), strict=True)):
            with trace.span("F", "compute", mb=i, chunk=0):
                loss, cache = self.model.forward(xs, ys)
            with trace.span("B", "compute", mb=i, chunk=0):
                self.backward(cache, scale / m, last=i == m - 1)
            # dropped now: bound to the name, it would live through the next
            # microbatch's forward, two microbatches' activations at the peak
            del cache
            total += loss / m
        return total

    def backward(self, cache: Any, dloss: float, *, last: bool) -> None:
        """``model.backward(cache, dloss)``; on the ``last`` microbatch of a step, with
        a hook set, reporting each piece's final gradients as backward goes."""
        if not (last and self.on_grads_ready is not None and self._final is not None):
            self.model.backward(cache, dloss=dloss)
            return
        ready, final = self.on_grads_ready, iter(self._final)
        self.model.backward(cache, dloss=dloss, after_piece=lambda: ready(next(final)))

    def loss(self, x: np.ndarray, y: np.ndarray) -> float:
        return self.model.eval_loss(x, y)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Class predictions (classifiers only)."""
        return self.model.logits(x).argmax(axis=-1)

    def eval_metrics(self, x: np.ndarray, y: np.ndarray) -> dict[str, tuple[float, int]]:
        """The model's evaluation figures beyond the loss, ``{name: (sum, count)}``."""
        return self.model.eval_metrics(x, y)

    def grad_norm(self) -> float:
        return clip.grad_norm(self.params)

    def metrics(self) -> dict[str, float]:
        """Extra per-step figures for metrics.jsonl (communication volume, bubble, ...)."""
        return {}


def _final_after_each_piece(pieces: list[list]) -> list[list]:
    """The parameters whose gradient is complete after each piece of ``model.backward``
    (``model.backward_pieces()``): a shared parameter (the GPT's tied token table)
    belongs to the last piece using it."""
    last = {id(p): k for k, piece in enumerate(pieces) for p in piece}
    return [[p for p in piece if last[id(p)] == k] for k, piece in enumerate(pieces)]
