"""A schedule's order of operations, and its replay on ideal ranks, without MPI.

A schedule (``pipeline.gpipe``, ``pipeline.one_f_one_b``, ``pipeline.interleaved``)
is a function of a *stage*: it calls the stage's verbs ``recv_forward``,
``forward_step``, ``send_forward``, ``recv_backward``, ``backward_step`` and
``send_backward`` in some order. ``record`` runs it on a ``Recorder`` stage that only
writes the calls down, one rank at a time. ``replay`` then plays every rank's list
against the others, the way the ranks run under MPI, where only receives block:

* ``F(k, i)``, the forward of microbatch ``i`` through model chunk ``k``, starts when
  its rank is free and ``F(k - 1, i)`` has finished (its input has arrived);
* ``B(k, i)`` starts when its rank is free and ``B(k + 1, i)`` has finished, or, on the
  last chunk, ``F(k, i)``.

A replay that cannot go on is a deadlock of the real run; ``check`` asserts there is
none and that every (chunk, microbatch) runs forward and backward exactly once. With
the durations measured on each rank, the replay gives the timeline the schedule has
on dedicated cores with instant links; with the ideal durations (forward 1, backward
2) it gives the textbook bubble and the diagrams in the schedules' docstrings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Op(NamedTuple):
    verb: str  # one of the six stage verbs
    chunk: int  # model chunk k
    mb: int  # microbatch i


COMPUTE = {"forward_step": "F", "backward_step": "B"}


def bubble_theory(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of every rank with equal stages: ``(p - 1) / (v m + p - 1)``.

    The bubble lasts ``(p - 1)`` chunk forward+backward times of ``1 / v`` of a stage
    each, against ``m`` full forward+backward times of useful work; for ``v = 1`` this
    is ``(p - 1) / (m + p - 1)``.
    """
    p, m, v = pp, microbatches, virtual_stages
    return (p - 1) / (v * m + p - 1)


class Recorder:
    """A stage that writes the schedule's calls down instead of computing."""

    def __init__(self, pp_rank: int, pp_size: int, virtual_stages: int = 1):
        self.pp_rank, self.pp_size, self.virtual_stages = pp_rank, pp_size, virtual_stages
        self.ops: list[Op] = []

    def _note(self, verb: str, i: int, c: int) -> None:
        self.ops.append(Op(verb, c * self.pp_size + self.pp_rank, i))

    def recv_forward(self, i, c=0):
        self._note("recv_forward", i, c)

    def forward_step(self, i, x, c=0):
        self._note("forward_step", i, c)

    def send_forward(self, i, y, c=0):
        self._note("send_forward", i, c)

    def recv_backward(self, i, c=0):
        self._note("recv_backward", i, c)

    def backward_step(self, i, dy, c=0):
        self._note("backward_step", i, c)

    def send_backward(self, i, dx, c=0):
        self._note("send_backward", i, c)


class ComputeRecorder(Recorder):
    """A ``Recorder`` of the compute verbs only, each as a plain ``('F' or 'B', chunk,
    mb)`` tuple: what ``replay`` plays, a third of the calls (a planner records the
    schedules of thousands of microbatches)."""

    def recv_forward(self, i, c=0):
        pass

    def send_forward(self, i, y, c=0):
        pass

    def recv_backward(self, i, c=0):
        pass

    def send_backward(self, i, dx, c=0):
        pass

    def forward_step(self, i, x, c=0):
        self.ops.append(("F", c * self.pp_size + self.pp_rank, i))

    def backward_step(self, i, dy, c=0):
        self.ops.append(("B", c * self.pp_size + self.pp_rank, i))


def record(schedule, pp: int, microbatches: int,
           virtual_stages: int = 1) -> list[list[Op]]:
    """Every rank's calls, in order: ``ops[r]`` for pipeline rank ``r``."""
    return _record(Recorder, schedule, pp, microbatches, virtual_stages)


def record_compute(schedule, pp: int, microbatches: int,
                   virtual_stages: int = 1) -> list[list[tuple[str, int, int]]]:
    """Every rank's compute operations, in order, as ``('F' or 'B', chunk, mb)``."""
    return _record(ComputeRecorder, schedule, pp, microbatches, virtual_stages)


def _record(recorder, schedule, pp: int, microbatches: int, virtual_stages: int) -> list:
    orders = []
    for r in range(pp):
        stage = recorder(r, pp, virtual_stages)
        schedule(stage, microbatches)
        orders.append(stage.ops)
    return orders


@dataclass
class Timeline:
    """Per rank: the (start, end, 'F' or 'B', chunk, mb) of each compute operation."""

    spans: list[list[tuple[float, float, str, int, int]]]
    makespan: float

    def busy(self, r: int) -> float:
        return sum(end - start for start, end, *_ in self.spans[r])

    def bubble(self) -> float:
        """Mean over ranks of the idle fraction of the makespan."""
        p = len(self.spans)
        return sum(1.0 - self.busy(r) / self.makespan for r in range(p)) / p


def replay(compute: list[list[tuple[str, int, int, float]]], n_chunks: int) -> Timeline:
    """Play each rank's ('F' or 'B', chunk, mb, seconds) list against the others.

    Raises RuntimeError naming the blocked operations if no rank can proceed.
    """
    p = len(compute)
    pos, clock = [0] * p, [0.0] * p
    done: dict[tuple[str, int, int], float] = {}
    spans: list[list] = [[] for _ in range(p)]
    last = n_chunks - 1
    while any(pos[r] < len(compute[r]) for r in range(p)):
        moved = False
        for r in range(p):
            ops, at, now, out = compute[r], pos[r], clock[r], spans[r]
            while at < len(ops):
                kind, k, i, seconds = ops[at]
                # what it waits for (the module docstring's two rules)
                if kind == "F":
                    dep = ("F", k - 1, i) if k > 0 else None
                else:
                    dep = ("B", k + 1, i) if k < last else ("F", k, i)
                if dep is None:
                    start = now
                else:
                    ready = done.get(dep)
                    if ready is None:
                        break
                    start = now if now > ready else ready
                now = start + seconds
                done[(kind, k, i)] = now
                out.append((start, now, kind, k, i))
                at += 1
            if at != pos[r]:
                pos[r], clock[r] = at, now
                moved = True
        if not moved:
            blocked = [compute[r][pos[r]][:3] for r in range(p) if pos[r] < len(compute[r])]
            raise RuntimeError(f"deadlock: every rank waits; next operations {blocked}")
    return Timeline(spans, max(clock))


def compute_ops(orders: list[list[Op]], forward: float = 1.0,
                backward: float = 2.0) -> list[list[tuple[str, int, int, float]]]:
    """The compute operations of recorded orders, with ideal durations."""
    cost = {"F": forward, "B": backward}
    return [[(COMPUTE[op.verb], op.chunk, op.mb, cost[COMPUTE[op.verb]])
             for op in ops if op.verb in COMPUTE] for ops in orders]


def peak_live(ops: list[Op]) -> int:
    """Most microbatch caches held at once: forwards done minus backwards done."""
    live = peak = 0
    for op in ops:
        live += {"forward_step": 1, "backward_step": -1}.get(op.verb, 0)
        peak = max(peak, live)
    return peak


def check(orders: list[list[Op]], microbatches: int, virtual_stages: int = 1) -> Timeline:
    """Assert a recorded schedule is complete, well-formed and deadlock-free."""
    p = len(orders)
    n_chunks = p * virtual_stages
    for r, ops in enumerate(orders):
        mine = {(c * p + r, i) for c in range(virtual_stages) for i in range(microbatches)}
        for verb in ("forward_step", "backward_step"):
            got = [(op.chunk, op.mb) for op in ops if op.verb == verb]
            if sorted(got) != sorted(mine):
                raise AssertionError(f"rank {r}: {verb} covers {sorted(got)}, "
                                     f"expected each of {sorted(mine)} once")
        _check_triplets(r, ops)
    return replay(compute_ops(orders), n_chunks)


def _check_triplets(r: int, ops: list[Op]) -> None:
    """Every compute step is directly preceded by its receive and followed by its send."""
    for j, op in enumerate(ops):
        if op.verb not in COMPUTE:
            continue
        way = "forward" if op.verb == "forward_step" else "backward"
        around = ops[j - 1: j + 2] if j >= 1 else []
        expected = [Op(f"recv_{way}", *op[1:]), op, Op(f"send_{way}", *op[1:])]
        if around != expected:
            raise AssertionError(f"rank {r}: {op} is not between recv_{way} and "
                                 f"send_{way} of the same chunk and microbatch")


def render(timeline: Timeline, unit: float = 1.0) -> str:
    """ASCII timeline, two characters per ``unit`` of time (GPipe, pp = 2, m = 2)::

        rank 0 |F1F2......B1==B2==
        rank 1 |..F1F2B1==B2==....

    ``F3`` is the forward of microbatch 3 (counted from 1), ``B3==`` its backward (twice
    as long); lower case marks the second model chunk of a rank (interleaved); ``..``
    is idle.
    """
    width = round(timeline.makespan / unit)
    p = len(timeline.spans)
    rows = []
    for r in range(p):
        cells = [".."] * width
        for start, end, kind, k, i in timeline.spans[r]:
            a, b = round(start / unit), round(end / unit)
            label = kind if (k // p) % 2 == 0 else kind.lower()
            text = (f"{label}{_mb_char(i)}" + "==" * (b - a - 1)) if b > a else ""
            for j in range(a, b):
                cells[j] = text[2 * (j - a): 2 * (j - a) + 2]
        rows.append(f"rank {r} |" + "".join(cells))
    return "\n".join(rows)


def _mb_char(i: int) -> str:
    return "123456789abcdefghijklmnopqrstuvwxyz"[i] if i < 35 else "+"
