"""The coordinator: turn a serial model into this rank's part of a parallel layout.

``build_engine(cfg, topo)`` is the one short place that decides how parallelism is
applied. The model itself (``hpctrain.models``) knows nothing of it:

1. build the full model from the global seed, identically on every rank, so the
   parameters are the same whatever the layout;
2. tensor parallelism (``tp > 1``) swaps sharded layers in, following a plan written
   as data (``hpctrain.parallel.tensor``);
3. pipeline parallelism (``pp > 1``) keeps only this rank's stage(s) and runs a
   schedule of microbatches (``hpctrain.parallel.pipeline``);
4. data parallelism is applied by the training loop around whatever engine results.

An engine exposes what the training loop needs (``LocalEngine`` is the reference):

* ``named_params`` / ``params``: this rank's parameter shards;
* ``zero_grad()``;
* ``forward_backward(x, y, scale=1.0) -> float``: accumulate the gradients of
  ``scale * mean loss`` over the microbatches of this rank's batch; return the mean
  loss, the same value on every rank of the model replica;
* ``loss(x, y) -> float``: forward only (evaluation), same on every rank of the replica;
* ``grad_norm() -> float``: the global gradient norm of the whole model replica,
  each replicated parameter counted once (collective over the model group);
* ``metrics() -> dict``: extra per-step figures for ``metrics.jsonl``;
* ``on_grads_ready``: None, or a callable the data-parallel wrapper sets
  (``hpctrain.parallel.data``). During the *last* microbatch's backward the engine may
  call it with parameters whose gradients are now final for the step, so their
  bucket's all-reduce starts while backward goes on; each parameter at most once.
  Calling it is an optimisation only: whatever is never reported is reduced after
  ``forward_backward`` returns. Gradients are accumulated into ``param.grad`` in place
  (the wrapper makes them views of its flat buffers).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpctrain import trace
from hpctrain.models.build import build_model
from hpctrain.models.gpt import GPT
from hpctrain.optim import clip


class LocalEngine:
    """The whole model on this rank (serial, or pure data parallelism).

    Gradient accumulation: ``forward_backward`` splits this rank's batch into
    ``microbatches`` equal chunks and accumulates the gradient of the mean loss. With
    ``on_grads_ready`` set, the last microbatch of a GPT runs backward piece by piece
    (head, then each block's MLP and attention halves, then the embedding) and reports
    each piece's parameters when their gradients are final.
    """

    def __init__(self, model: Any, microbatches: int):
        self.model = model
        self.microbatches = microbatches
        self.named_params = model.named_parameters()
        self.params = [p for _, p in self.named_params]
        self.on_grads_ready = None
        self._final = _final_after_each_piece(model) if isinstance(model, GPT) else None

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
        return float(self.model.forward(x, y)[0])

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Class predictions (classifiers only)."""
        return self.model.logits(x).argmax(axis=-1)

    def grad_norm(self) -> float:
        return clip.grad_norm(self.params)

    def metrics(self) -> dict[str, float]:
        """Extra per-step figures for metrics.jsonl (communication volume, bubble, ...)."""
        return {}


def _final_after_each_piece(gpt: GPT) -> list[list]:
    """The parameters whose gradient is complete after each piece of ``gpt.backward``
    (``backward_pieces``): a shared parameter (the tied token table) belongs to the
    last piece using it."""
    pieces = gpt.backward_pieces()
    last = {id(p): k for k, piece in enumerate(pieces) for p in piece}
    return [[p for p in piece if last[id(p)] == k] for k, piece in enumerate(pieces)]


def build_engine(cfg: Any, topo: Any):
    """This rank's engine for a validated config and its topology."""
    model = build_model(cfg.model, cfg.train.seed)
    if topo.tp_size > 1:
        from hpctrain.parallel.tensor import apply_tensor_parallel

        model = apply_tensor_parallel(model, cfg, topo.tp_comm)
    if topo.pp_size > 1:
        from hpctrain.parallel.pipeline import PipelineEngine

        return PipelineEngine(model, cfg, topo)
    if topo.tp_size > 1:
        from hpctrain.parallel.tensor import TensorParallelEngine

        return TensorParallelEngine(model, cfg, topo)
    return LocalEngine(model, cfg.parallel.microbatches)
