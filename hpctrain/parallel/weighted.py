"""Throughput-weighted local SGD for unequal ranks: faster ranks take more local steps,
and the meeting weighs each rank by the steps it took (biased local SGD, arXiv
2508.08540; ``[parallel] averaging = "periodic"`` with ``shares`` "fixed" or "measured").

A *round* is one step of the training loop: the global batch of B samples is cut into
units of ``u = B / (dp * microbatches)`` samples, rank r holds ``b_r`` of them
(``hpctrain.parallel.shares``: fixed, or in proportion to its measured speed) and takes
``k_r = b_r / u`` local optimizer steps, one per unit, so every rank spends about the
same time on a round. Every ``average_every`` rounds the ranks meet:

    params = sum_r w_r params_r / sum_r w_r,   w_r = local steps of r since the meeting

With equal shares every rank takes ``microbatches`` steps a round and the weights are
equal: plain local SGD (with ``microbatches = 1``, exactly ``periodic``, which a test
checks bitwise). The engine runs each local step as one microbatch.

The non-finite guard sees a round at once (its loss, the largest gradient norm): a
round it skips is undone, parameters and optimizer state restored from a copy taken
before it, and still counts as one of the period's rounds (a meeting due then takes
place; with every round since the last one skipped, the ranks are at the anchor
already). Each rank's step count since the meeting is saved with its own state
(``local/dp<r>/steps``), so a resume mid-period is bitwise too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpctrain import trace
from hpctrain.parallel.averaging import LocalDataParallel


def unit(batch_size: int, dp: int, microbatches: int) -> int:
    """Samples per local step: ``B / (dp * microbatches)``."""
    return batch_size // (dp * microbatches)


class WeightedLocalDataParallel(LocalDataParallel):
    """``LocalDataParallel`` whose ranks take unequal numbers of local steps a round
    and meet by a weighted average (module docstring). ``train_step`` hands it whole
    rounds (``local_round``)."""

    def __init__(self, engine: Any, optimizer: Any, topo: Any, par: Any, batch_size: int):
        super().__init__(engine, optimizer, topo, par)
        self.unit = unit(batch_size, self.dp_size, par.microbatches)
        self.batch_size = batch_size
        engine.microbatches = 1  # a local step is one unit, one microbatch
        self.steps = np.zeros(1, np.int64)  # local steps since the last meeting
        self.optimizer_t = np.zeros(1, np.int64)  # this rank's own step count, saved
        self.last_round = 0

    def local_round(self, engine: Any, x: np.ndarray, y: np.ndarray, *, lr: float,
                    grad_clip: float, guard=None, step: int = 0,
                    share: float | None = None,
                    before_update=None) -> tuple[float, float]:
        """This rank's ``len(x) / unit`` local steps, then (every H rounds) the weighted
        meeting; returns (the round's loss over the global batch, the largest norm).
        Collective over the data group at the guard, the loss and the meeting.
        ``share`` (``len(x) / B``) is implied by ``x``: taken for train_step's call.
        ``before_update``: as ``train_step``'s, called before the round's first update
        (a background checkpoint's copy of the state must be taken by then)."""
        from hpctrain.optim import clip as clip_mod
        from hpctrain.train import mean_over

        k = len(x) // self.unit
        saved = self._snapshot() if guard is not None else None
        losses, norm = [], 0.0
        for xs, ys in zip(np.split(x, k), np.split(y, k), strict=True):
            with trace.span("zero_grad", "optimizer"):
                engine.zero_grad()
            losses.append(engine.forward_backward(xs, ys, scale=1.0))
            with trace.span("optimizer", "optimizer"):
                if before_update is not None:  # at once after the first
                    before_update()
                g = engine.grad_norm()
                norm = max(norm, g)
                if grad_clip > 0:
                    clip_mod.clip_grads(self.params, grad_clip, g)
                self.optimizer.step(lr)
        loss = float(np.mean(losses))
        if guard is not None and not guard.check(step, loss, norm):
            self._restore(saved)  # the round never happened, but counts in the period
            self.last_round = 0  # (LocalDataParallel.skip_step)
        else:
            self.steps += k
            self.last_round = k
        self.t += 1
        if self.schedule.averages(self.t):
            self._weighted_average()
        # sum_r b_r loss_r / B (b_r = len(x), this rank's share), as mean_over's mean
        return mean_over(self.dp_comm, loss * len(x) * self.dp_size / self.batch_size), norm

    def _weighted_average(self) -> None:
        """params = sum_r w_r params_r / sum_r w_r over the data group; the anchor too."""
        w = float(self.steps[0])
        total = np.array([w])
        if self.dp_size > 1:
            from mpi4py import MPI

            self.dp_comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
        if total[0] == 0:  # every round since the meeting skipped: all at the anchor
            return
        data = [p.data for p in self.params]
        for a in data:
            a *= w
        self._sum_into(data, self.dp_comm, "param_all_reduce")
        for a, anchor in zip(data, self.anchor, strict=True):
            a /= total[0]
            anchor[...] = a
        self.steps[0] = 0

    def _snapshot(self) -> tuple[list[np.ndarray], dict]:
        state = {k: np.array(v, copy=True) for k, v in self.optimizer.state_arrays().items()}
        return [p.data.copy() for p in self.params], state

    def _restore(self, saved) -> None:
        params, state = saved
        for p, a in zip(self.params, params, strict=True):
            p.data[...] = a
        self.optimizer.load_state_arrays(state)

    def metrics(self) -> dict[str, float]:
        return {**super().metrics(), "local_steps": self.last_round}

    def meta(self) -> dict:
        return {**super().meta(), "weighted": True}

    def held_tensors(self, engine: Any, tp_rank: int, tp_size: int) -> list:
        from hpctrain.checkpoint.reshard import Sharding
        from hpctrain.checkpoint.state import Held

        self.optimizer_t[0] = self.optimizer.t  # the checkpoint's own counter is the max
        mine = f"local/dp{self.dp_rank}"
        return [*super().held_tensors(engine, tp_rank, tp_size),
                Held(f"{mine}/steps", self.steps, Sharding((1,))),
                Held(f"{mine}/optimizer_t", self.optimizer_t, Sharding((1,)))]

    def after_load(self) -> None:
        """The ranks took unequal numbers of steps: each takes back its own count
        (AdamW's bias correction depends on it)."""
        self.optimizer.t = int(self.optimizer_t[0])
