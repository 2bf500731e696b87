"""Heterogeneity-aware batches: each data-parallel rank's share of the global batch
follows its speed, so unequal nodes finish their part of a step together.

Shares ``b_r`` (``[parallel] shares``): "equal" (B / dp each), "fixed" (``batch_shares``)
or "measured": rank r's speed ``s_r``, the median over the steps since the last
measurement of its samples / compute seconds (a median: one step slowed by a neighbour
or the OS does not move it), and ``b_r`` proportional to it (``proportional``: largest
remainders, each a positive multiple of the microbatches); first set after step
``FIRST`` from the steps after ``WARMUP``, then every ``remeasure_every`` steps.

The update stays the global-batch mean: rank r scales the gradient of its mean loss
by ``b_r / B`` and the data group sums, ``sum_r b_r / B mean_r = (1 / B) sum_i g_i``; the
reported loss is likewise ``sum_r b_r loss_r / B``. Rank r reads samples ``[o_r, o_r +
b_r)`` of every global batch, ``o_r = sum_{q < r} b_q`` (``Loader.set_share``): the
global batch is the same whatever the shares, so a change of shares at a step
boundary, or a resume with other shares, loses and repeats nothing.

Collective over the data group: ``after_step`` gathers every rank's compute time (one
small all-gather per step, whose figures also go into metrics.jsonl as
``rank_compute_s``). The shards of one replica (its tensor, pipeline and spatial
ranks, ``model_comm``) hold one share between them: a measurement takes the slowest
shard's speed as the replica's (one small all-reduce over the replica), so each of
the replica's data groups chooses the same shares.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

WARMUP = 3  # first steps never measured (allocation, caches)
FIRST = 10  # the step after which measured shares are first set


def proportional(speeds: list[float], total: int, multiple: int = 1) -> tuple[int, ...]:
    """Shares of ``total`` proportional to ``speeds``, each a positive multiple of
    ``multiple``, summing to ``total`` (largest remainders). Pure."""
    units, n = total // multiple, len(speeds)
    if total % multiple or units < n:
        raise ValueError(f"total ({total}) must be a multiple of {multiple} with at least "
                         f"one unit of {multiple} for each of {n} ranks")
    speeds = [max(float(s), 0.0) for s in speeds]
    if not all(math.isfinite(s) for s in speeds) or sum(speeds) <= 0:
        speeds = [1.0] * n
    ideal = [units * v / sum(speeds) for v in speeds]
    got = [max(1, math.floor(x)) for x in ideal]
    while sum(got) < units:  # the largest remainder first, ties to the lower rank
        r = max(range(n), key=lambda q: (ideal[q] - got[q], -q))
        got[r] += 1
    while sum(got) > units:  # a rank raised to one unit takes it from the fullest
        r = max((q for q in range(n) if got[q] > 1), key=lambda q: (got[q] - ideal[q], -q))
        got[r] -= 1
    return tuple(g * multiple for g in got)


def offsets(shares: tuple[int, ...]) -> tuple[int, ...]:
    """Where each rank's samples start in the global batch."""
    return tuple(int(o) for o in np.concatenate([[0], np.cumsum(shares)[:-1]]))


class ShareBalancer:
    """This rank's share of the global batch, and its re-measurement (module docstring).

    ``share`` (b_r / B) is ``train_step``'s gradient scale and loss weight; the loader
    is moved to the new samples whenever the shares change."""

    def __init__(self, par: Any, batch_size: int, dp_comm: Any, loader: Any = None,
                 multiple: int | None = None, model_comm: Any = None):
        """``multiple``: what every share is a multiple of (default: the microbatches;
        weighted local SGD: a local step's samples). ``model_comm``: the other shards
        of this rank's replica (None or one rank: the rank is the whole replica)."""
        self.mode, self.every = par.shares, par.remeasure_every
        self.batch, self.multiple = batch_size, multiple or par.microbatches
        self.comm, self.rank = dp_comm, dp_comm.Get_rank()
        self.model_comm = model_comm
        self.loader = loader
        dp = dp_comm.Get_size()
        self.shares = (tuple(par.batch_shares) if par.shares == "fixed"
                       else (batch_size // dp,) * dp)
        self._rates: list[float] = []  # this rank's samples / compute second per step
        self._last = [0.0] * dp
        self.changed = False
        self._apply()

    @property
    def share(self) -> float:
        return self.shares[self.rank] / self.batch

    def _apply(self) -> None:
        if self.loader is not None and self.mode != "equal":
            self.loader.set_share(offsets(self.shares)[self.rank], self.shares[self.rank])

    def after_step(self, step: int, compute_s: float) -> None:
        """Record this rank's compute time of ``step``; gather every rank's; with
        "measured", re-balance after the warm-up and every ``remeasure_every`` steps."""
        self._last = self.comm.allgather(float(compute_s)) if self.comm.Get_size() > 1 \
            else [float(compute_s)]
        self.changed = False
        if self.mode != "measured":
            return
        if step > WARMUP:
            self._rates.append(self.shares[self.rank] / max(compute_s, 1e-9))
        due = step == FIRST or (step > FIRST and step % self.every == 0)
        if not due or not self._rates:
            return
        speed = float(np.median(self._rates))
        if self.model_comm is not None and self.model_comm.Get_size() > 1:
            from mpi4py import MPI  # the replica runs at its slowest shard's speed

            speed = self.model_comm.allreduce(speed, op=MPI.MIN)
        speeds = self.comm.allgather(speed) if self.comm.Get_size() > 1 else [speed]
        new = proportional(speeds, self.batch, self.multiple)
        self._rates = []
        if new != self.shares:
            self.shares, self.changed = new, True
            self._apply()

    def metrics(self) -> dict:
        if self.mode == "equal":
            return {}
        return {"batch_shares": list(self.shares), "rank_compute_s": list(self._last)}

    def state(self) -> dict:
        return {"shares": list(self.shares)}

    def load_state(self, saved: dict | None) -> str | None:
        """Measured shares: take a checkpoint's back (``state()``) when they fit this
        run, else keep the equal start, measured again like a fresh run's. Returns
        why they did not fit (None: taken, or nothing to take); the same on every rank.
        A checkpoint saved at another dp, batch or number of microbatches loads, so its
        shares may be for other ranks, or not a multiple of this run's microbatches."""
        if not saved or self.mode != "measured":
            return None
        shares = tuple(int(n) for n in saved["shares"])
        why = misfit(shares, self.comm.Get_size(), self.batch, self.multiple)
        if why is None:
            self.shares = shares
            self._apply()
        return why


def misfit(shares: tuple[int, ...], dp: int, total: int, multiple: int) -> str | None:
    """Why ``shares`` cannot be the shares of ``dp`` ranks in a batch of ``total``, each
    a positive multiple of ``multiple`` (None: they can). Pure."""
    if len(shares) != dp:
        return f"{len(shares)} shares for dp {dp}"
    if sum(shares) != total:
        return f"they sum to {sum(shares)}, not batch_size {total}"
    if any(n <= 0 or n % multiple for n in shares):
        return f"not each a positive multiple of {multiple}"
    return None
