"""Local-loss pipeline training: every stage learns from a loss of its own, and nothing
travels backward between stages (``[parallel] pipeline_training = "local"``).

Backpropagation locks a pipeline: stage r waits for the forward of the stages before
it and for the backward of every stage after it. Here each stage but the last ends
with an *auxiliary head* the model declares (``Model.aux_head``, e.g. a Linear to the
classes) and trains on the cross-entropy of its output through that head against the
microbatch's targets; the last stage trains on the model's own head and loss. With
stage s holding parameters theta_s and head phi_s, and a_s its output::

    a_0 = x                          a_s = f_s(a_{s-1}; theta_s)
    L_s = CE(h_s(a_s; phi_s), y)     (s < pp - 1)      L_{pp-1} = the model's loss
    grad theta_s, phi_s = d L_s / d (theta_s, phi_s), with a_{s-1} held constant

so the objective is the sum of the stages' losses with the gradient stopped at every
stage boundary (decoupled greedy learning). **No gradient flows one stage back**: a
stage's input gradient is never sent (nor computed: ``ModelChunk.backward(...,
input_grad=False)`` skips the first layer's input-gradient GEMM where the piece allows
it), so a stage never waits for a later one and the backward half of the
point-to-point traffic is gone. (Letting L_s reach stage s - 1,
the overlapping variant, would bring back a wait on the next stage's backward for
every microbatch: the lock this mode exists to remove.)

The schedule: each stage receives microbatch i's activation, runs its forward and its
head, sends the activation on *before* its own backward, then runs that backward. The
pipeline fills once and then every stage stays busy; there is no wait for gradients.
Forward 1 unit, local backward 2 (lower case ``b``: from the stage's own head),
pp = 4, m = 4; idle (p - 1) / (3 m + p - 1) = 3/15 against 1F1B's 3/7 at this m::

    rank 0 |F1b1==F2b2==F3b3==F4b4==......
    rank 1 |..F1b1==F2b2==F3b3==F4b4==....
    rank 2 |....F1b1==F2b2==F3b3==F4b4==..
    rank 3 |......F1B1==F2B2==F3B3==F4B4==

Gradients accumulate over the step's microbatches and every stage updates its own
parameters (heads included) in the training loop's optimizer step, so data
parallelism (the gradient all-reduce over the data group), clipping by the global
norm of the local objective's gradient, the non-finite guard and checkpoints work
unchanged; heads are saved as ``aux_heads.<k>.*`` (k: the last middle piece of the
stage). The loss reported is the last stage's (the model's); ``metrics`` adds every
stage's local loss.

``LocalLossEngine`` is the Engine for pp > 1 (collective over ``pp_comm`` in every
call, ``model_comm`` in ``grad_norm``). ``LocalLossReference`` computes the same
objective with every stage on one rank, for the tests. pp = 1 is refused by
``Config.validate``: one stage has no local loss but the model's, which is backprop.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpctrain import trace
from hpctrain.optim import clip
from hpctrain.parallel import stages
from hpctrain.parallel.pipeline import PipelineEngine, Stage


def decoupled(stage, m: int) -> None:
    """One loop, the same on every stage: forward, send on, backward from the own head.

    The only wait is ``recv_forward``: for microbatch 0 the fill, afterwards the
    previous stage is one forward ahead (see the module's diagram).
    """
    for i in range(m):
        x = stage.recv_forward(i)
        y = stage.forward_step(i, x)
        stage.send_forward(i, y)  # first: the next stage starts while this one learns
        stage.local_backward_step(i)


def local_idle_theory(pp: int, microbatches: int) -> float:
    """Idle fraction of every rank with equal stages, forward 1 and backward 2:
    ``(p - 1) / (3 m + p - 1)`` (only the fill and the drain)."""
    return (pp - 1) / (3 * microbatches + pp - 1)


class LocalStage(Stage):
    """A ``Stage`` whose training forward also runs the auxiliary head (``head``; None
    on the last stage, whose chunk ends with the model's loss) and whose backward
    starts from that head's loss. Evaluation runs as ``Stage`` does.
    ``local_sum``: the mean over the step's microbatches of this stage's loss."""

    def __init__(self, chunks, p2p, act_shape, head):
        self.head = head
        super().__init__(chunks, p2p, act_shape)

    def begin(self, x, y, m, *, dloss=0.0, training=False) -> None:
        super().begin(x, y, m, dloss=dloss, training=training)
        self.local_sum = 0.0

    def forward_step(self, i: int, x: np.ndarray | None, c: int = 0) -> np.ndarray | None:
        if not self.training:
            return super().forward_step(i, x, c)
        chunk, m = self.parts[c], len(self.xs)
        with trace.span("F", "compute", mb=i, chunk=self.chunk_index(c)):
            out, cache = chunk.forward(self.xs[i] if x is None else x, self.ys[i])
            if chunk.last is None:
                loss, head_cache = self.head.forward(out, self.ys[i])  # out: (mb, ...)
            else:  # the model's own loss
                loss, head_cache, out = out, None, None
                self.loss_sum += loss / m
        self.local_sum += loss / m
        self.caches[(c, i)] = (cache, head_cache, x)
        self.live += 1
        self.peak = max(self.peak, self.live)
        return out

    def local_backward_step(self, i: int, c: int = 0) -> None:
        """Backward of microbatch i from this stage's own loss; nothing is sent."""
        chunk = self.parts[c]
        cache, head_cache, x = self.caches.pop((c, i))
        self.live -= 1
        with trace.span("B", "compute", mb=i, chunk=self.chunk_index(c)):
            dy = self.dloss if head_cache is None else self.head.backward(self.dloss,
                                                                           head_cache)
            chunk.backward(dy, cache, input_grad=False)  # nothing goes back a stage
        self.p2p.release(x)
        if i == len(self.xs) - 1 and self.on_chunk_done is not None:
            self.on_chunk_done(c)


class LocalLossEngine(PipelineEngine):
    """This rank's stage of ``model`` and, but on the last stage, its auxiliary head.

    The stage cut is ``PipelineEngine``'s (``stages.plan``); the head reads the
    activation leaving the stage's last middle piece k and is the model's
    ``aux_head(k, seed)``, the same at any layout. Evaluation (``loss``,
    ``eval_metrics``) runs the model end to end, heads unused.
    """

    def __init__(self, model: Any, cfg: Any, topo: Any):
        super().__init__(model, cfg, topo)
        self.schedule = decoupled
        chunk = self.stage.parts[0]
        self.head, head_params = None, []
        if chunk.last is None:
            k = chunk.spec.stop - 1
            self.head = model.aux_head(k, cfg.train.seed)
            head_params = [(f"aux_heads.{k}.{n}", p) for n, p in self.head.named_parameters()]
        self.stage = LocalStage(self.stage.parts, self.p2p, self.stage.activation_shape,
                                self.head)
        self.stage.on_chunk_done = self._chunk_done
        self.named_params = self.named_params + head_params
        self.params = [p for _, p in self.named_params]
        self._norm_params = self._norm_params + [p for _, p in head_params]
        self._final[0] = self._final[0] + [p for _, p in head_params]
        self._local = 0.0
        self.dp_comm = topo.dp_comm

    def forward_backward(self, x: np.ndarray, y: np.ndarray, scale: float = 1.0) -> float:
        """Every stage: the gradients of ``scale *`` its mean local loss over this rank's
        batch; returns the model's mean loss (the last stage's), on every stage."""
        loss = super().forward_backward(x, y, scale)
        self._local = self.stage.local_sum
        return loss

    def metrics(self) -> dict[str, Any]:
        """``PipelineEngine``'s figures with this schedule's idle theory, and each
        stage's local loss of the last step, the mean over the global batch (collective
        over ``pp_comm`` and ``dp_comm``)."""
        figures = super().metrics()
        figures["bubble_theory"] = local_idle_theory(self.pp_size, self.microbatches)
        local = self._local
        if self.dp_comm.Get_size() > 1:
            local = self.dp_comm.allreduce(local) / self.dp_comm.Get_size()
        figures["local_losses"] = [float(v) for v in self.pp_comm.allgather(local)]
        return figures


class LocalLossReference:
    """The local-loss objective of ``pp`` stages with every stage on this rank: the
    serial reference of ``LocalLossEngine`` (the Engine interface of ``LocalEngine``).

    Microbatch by microbatch, stage by stage: forward, the head's loss, backward to
    the stage's input and no further; the next stage starts from the activation as
    data. Same cut (``stages.plan``), same heads, same parameter names.
    """

    def __init__(self, model: Any, cfg: Any, pp: int):
        par = cfg.parallel
        specs = stages.plan(model.piece_costs(cfg.model), pp, 1, par.balance)
        self.model, self.microbatches = model, par.microbatches
        self.chunks = [stages.ModelChunk(s, model) for s in specs]
        self.heads = [model.aux_head(s.stop - 1, cfg.train.seed) for s in specs[:-1]]
        self.named_params = model.named_parameters() + [
            (f"aux_heads.{s.stop - 1}.{n}", p)
            for s, head in zip(specs, self.heads, strict=False) for n, p in head.named_parameters()]
        self.params = [p for _, p in self.named_params]
        self.on_grads_ready = None
        self.local_losses = [0.0] * pp

    def zero_grad(self) -> None:
        for p in self.params:
            p.zero_grad()

    def forward_backward(self, x: np.ndarray, y: np.ndarray, scale: float = 1.0) -> float:
        m = self.microbatches
        self.local_losses = [0.0] * len(self.chunks)
        for xs, ys in zip(np.split(x, m), np.split(y, m), strict=True):
            act = xs
            for s, chunk in enumerate(self.chunks):
                out, cache = chunk.forward(act, ys)
                if s < len(self.heads):
                    loss, head_cache = self.heads[s].forward(out, ys)
                    chunk.backward(self.heads[s].backward(scale / m, head_cache), cache,
                                   input_grad=False)
                    del head_cache
                else:
                    loss = out
                    chunk.backward(scale / m, cache, input_grad=False)
                del cache  # not held through the next stage's or microbatch's forward
                self.local_losses[s] += loss / m
                act = out  # the next stage's input: data, no gradient goes back
        return self.local_losses[-1]

    def loss(self, x: np.ndarray, y: np.ndarray) -> float:
        return self.model.eval_loss(x, y)

    def eval_metrics(self, x: np.ndarray, y: np.ndarray) -> dict[str, tuple[float, int]]:
        return self.model.eval_metrics(x, y)

    def grad_norm(self) -> float:
        return clip.grad_norm(self.params)

    def metrics(self) -> dict[str, Any]:
        return {"local_losses": [float(v) for v in self.local_losses]}


__all__ = ["LocalLossEngine", "LocalLossReference", "decoupled", "local_idle_theory"]
