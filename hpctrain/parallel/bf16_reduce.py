"""Gradient sums sent in bfloat16, added in float32: half the bytes on the link.

``[parallel] grad_comm_dtype = "bf16"``: each bucket of the float32 gradient is
rounded to bfloat16 and summed over the data group as a reduce-scatter followed by an
all-gather, both of bf16 values, with the additions done locally in float32. dp = 3,
a bucket cut into one chunk per rank (padded with zeros to a multiple of dp)::

    rank        0            1            2
    bucket     a0 a1 a2     b0 b1 b2     c0 c1 c2        float32 -> bf16
    1 alltoall  a0 b0 c0    a1 b1 c1     a2 b2 c2        rank d gets chunk d of all
    sum         S0 = f32(a0) + f32(b0) + f32(c0) ...      float32, in rank order
    2 allgather S0 S1 S2    S0 S1 S2     S0 S1 S2        bf16(S_d) to everyone
    bucket     float32(S)                                 the same bits on every rank

Each rank sends ``2 (dp - 1) / dp`` times the bucket's bf16 bytes, as a ring
all-reduce of it would (``dp_bytes`` counts them so): half of the float32 all-reduce.
An MPI all-reduce of bf16 with a user operation would round each partial sum to bf16
at every step of its tree; here the sum is rounded once, and only the values sent.

Phase 1 runs on ``dp_comm``, phase 2 on a duplicate of it, ordered by the same
``hierarchy.PhaseQueue`` as the hierarchical reduction: MPI wants the collectives of
one communicator posted in one order on every rank, and a bucket's phases finish at
different times on different ranks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpctrain.parallel.hierarchy import PhaseQueue
from hpctrain.precision import bfloat16

ALLTOALL, ALLGATHER = "alltoall", "allgather"


class Bf16Reduce:
    """``launch`` for ``GradBuckets`` (ZeRO 0, flat): the in-place sum of a float32
    bucket over ``dp_comm``, sent as bfloat16 (see the module docstring). Collective
    over ``dp_comm`` at construction (the duplicate)."""

    wire_fraction = 0.5  # bytes sent per byte of the float32 gradient (dp_bytes)

    def __init__(self, dp_comm: Any):
        self.low = bfloat16()
        self.comm = dp_comm
        self.size = dp_comm.Get_size()
        self.gather_comm = dp_comm.Dup() if self.size > 1 else None
        self.queue = PhaseQueue()

    def __call__(self, bucket: Any, view: np.ndarray) -> _Sum | None:
        """Start summing ``view`` (a float32 bucket) in place."""
        if self.size == 1:
            return None
        total = _Sum(self, view)
        total.pending = self.queue.add((ALLTOALL, ALLGATHER), total.post)
        return total

    def free(self) -> None:
        if self.gather_comm is not None:
            self.gather_comm.Free()
            self.gather_comm = None


class _Sum:
    """One bucket's two phases, and the float32 result written back when both are done;
    ``Test``/``Wait`` like an MPI request."""

    def __init__(self, reduce: Bf16Reduce, view: np.ndarray):
        p, n = reduce.size, view.size
        self.reduce, self.view = reduce, view
        self.chunk = -(-n // p)
        self.send = np.zeros(self.chunk * p, reduce.low)  # (p chunks), padded with zeros
        self.send[:n] = view
        self.recv = np.empty_like(self.send)  # chunk d of every rank, rank order
        self.pending = None
        self.finished = False

    def post(self, phase: str) -> Any:
        words = np.uint16  # bfloat16 travels as its 16 bits
        if phase == ALLTOALL:
            return self.reduce.comm.Ialltoall(self.send.view(words), self.recv.view(words))
        mine = self.recv.reshape(self.reduce.size, self.chunk).astype(np.float32).sum(axis=0)
        self.mine = mine.astype(self.reduce.low)  # rounded once, the sum in float32
        return self.reduce.gather_comm.Iallgather(self.mine.view(words),
                                                  self.send.view(words))

    def _finish(self) -> None:
        if not self.finished:
            self.view[...] = self.send[:self.view.size]  # bf16 -> float32, exact
            self.finished = True

    def Test(self) -> bool:  # noqa: N802 - the name MPI requests have
        if self.pending.Test():
            self._finish()
            return True
        return False

    def Wait(self) -> None:  # noqa: N802
        self.pending.Wait()
        self._finish()
