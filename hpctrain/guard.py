"""The non-finite guard: a diverging step is skipped everywhere, and a run that keeps
diverging stops with an error that names the step, the value and the rank.

A step whose loss or gradient norm is not finite (nan or inf) on *any* rank must not
update the parameters on *any* rank: an update from nan gradients turns every
parameter into nan, and the ranks of one model must never disagree on whether a step
happened. So after the gradient norm and before the update, every rank contributes
one flag to an all-reduce over the world (``check``): all see the same verdict in the
same step. On a bad step nothing is updated (the optimizer's moments and step
counter stay as they were), the batch is consumed, and the step is counted; after
``max_skipped`` bad steps in a row the run stops with ``DivergenceError`` on every
rank together.

Cost: one 1-element ``Allreduce`` per step; only on a bad step one ``allgather`` of
each rank's ``(loss, grad norm)``, to name the ranks that saw it.

The guard keeps bad numbers out of the optimizer. It cannot undo an update that left
finite but harmful parameters (a learning rate of 1e6 gives finite, huge weights
first); those surface as non-finite losses one or two steps later, and the last
checkpoint written before them is finite, since ``checkpoint.training.save_training``
refuses non-finite state.
"""

from __future__ import annotations

import math
from typing import Any

from hpctrain import trace
from hpctrain.runtime import CollectiveError

EXIT_DIVERGED = 4


class DivergenceError(CollectiveError):
    """Raised on every rank together when the run has diverged."""

    exit_code = EXIT_DIVERGED


def _finite(loss: float, norm: float) -> bool:
    return math.isfinite(loss) and math.isfinite(norm)


def describe(step: int, values: list[tuple[float, float]]) -> str:
    """What was not finite at ``step``, given every rank's ``(loss, grad norm)``:
    ``"step 12: loss nan on rank 1; gradient norm inf on ranks 0, 1"``."""
    parts = []
    for k, what in enumerate(("loss", "gradient norm")):
        by_value: dict[str, list[int]] = {}
        for rank, pair in enumerate(values):
            if not math.isfinite(pair[k]):
                by_value.setdefault(repr(float(pair[k])), []).append(rank)
        for value, ranks in by_value.items():
            noun = "rank" if len(ranks) == 1 else "ranks"
            parts.append(f"{what} {value} on {noun} {', '.join(map(str, ranks))}")
    return f"step {step}: " + "; ".join(parts)


class NonFiniteGuard:
    """Decides, collectively over ``comm`` (the world), whether each step may update.

    ``skipped``: bad steps so far; ``consecutive``: bad steps in a row up to now;
    ``skipped_last``: whether the last checked step was skipped.
    """

    def __init__(self, comm: Any, max_skipped: int):
        if max_skipped < 1:
            raise ValueError(f"max_skipped ({max_skipped}) must be at least 1")
        self.comm, self.max_skipped = comm, max_skipped
        self.skipped = 0
        self.consecutive = 0
        self.skipped_last = False
        self.first_bad_step: int | None = None  # of the current run of bad steps

    def check(self, step: int, loss: float, norm: float) -> bool:
        """True if the step may update (finite everywhere); False to skip it. Raises
        ``DivergenceError`` on every rank at the ``max_skipped``-th bad step in a row.
        Collective over ``comm``."""
        bad = not _finite(loss, norm)
        if self.comm.Get_size() > 1:
            from mpi4py import MPI

            with trace.span("finite_check", "optimizer", comm="world_comm"):
                bad = bool(self.comm.allreduce(int(bad), op=MPI.MAX))
        self.skipped_last = bad
        if not bad:
            self.consecutive, self.first_bad_step = 0, None
            return True
        if self.comm.Get_size() > 1:
            values = self.comm.allgather((float(loss), float(norm)))
        else:
            values = [(float(loss), float(norm))]
        self.skipped += 1
        self.consecutive += 1
        if self.first_bad_step is None:
            self.first_bad_step = step
        self.last_problem = describe(step, values)
        if self.consecutive >= self.max_skipped:
            since = ("" if self.consecutive == 1 else
                     f" ({self.consecutive} steps in a row, {self.first_bad_step}-{step}, "
                     f"were not finite)")
            raise DivergenceError(
                f"training diverged at {self.last_problem}{since}; no update was made from "
                f"them and no checkpoint written from non-finite state. Lower the "
                f"learning rate ([train] lr) and continue from the last checkpoint with "
                f"--resume auto --reset-schedule")
        return False

    def state(self) -> dict[str, Any]:
        """The counts a checkpoint keeps, so that a resumed run goes on counting."""
        return {"skipped": self.skipped, "consecutive": self.consecutive,
                "first_bad_step": self.first_bad_step}

    def load_state(self, saved: dict[str, Any] | None) -> None:
        """Take a checkpoint's counts back (``state()``; None: a checkpoint from before
        they were saved, counted from 0)."""
        if saved:
            self.skipped, self.consecutive = int(saved["skipped"]), int(saved["consecutive"])
            first = saved.get("first_bad_step")
            self.first_bad_step = None if first is None else int(first)

    def metrics(self) -> dict[str, Any]:
        """The step's record entries: ``skipped`` on a bad step, the running count."""
        out: dict[str, Any] = {"skipped_steps": self.skipped}
        if self.skipped_last:
            out["skipped"] = True
        return out
