"""Per-rank timelines: named spans of compute, communication, optimizer and data work.

    with trace.span("F", "compute", mb=i, chunk=k):
        out, cache = chunk.forward(x, y)

A span goes to the process's active ``Tracer``. Until ``recording(tracer)`` installs
one, the active tracer is a ``NullTracer`` whose spans record nothing, so the layers,
schedules and collectives carry their spans whether or not anybody listens. This is
the one piece of process-wide state in hpctrain, for the reason ``logging`` has one:
spans arise deep inside layers that know nothing of parallelism, and threading a
tracer through every signature would put observability into all of them. No
communicator lives here; ``write_chrome`` takes its communicator as an argument.

Categories (``CATEGORIES``), the columns of the step breakdown:

    compute     forward and backward arithmetic (spans "F", "B")
    tp_comm     tensor-parallel collectives inside forward and backward
    halo        spatial parallelism's transfers: halo exchanges and their scatter-adds,
                gathers, the sums of gradients and losses over the spatial group
    pp_wait     pipeline sends and receives: the bubble plus the transfers
    dp_comm     data-parallel gradient reduction that backward did not hide
    optimizer   zeroing gradients, gradient norm, clipping, the update
    data        the next batch from the loader
    other       the rest of the step: Python glue between the spans above

A category's time is *exclusive*: a span's duration minus that of the spans nested in
it, so a tensor-parallel all-reduce inside a forward counts as ``tp_comm`` and not
also as ``compute``, and the categories add up to the step. Only the main thread
counts; spans of helper threads (the data-parallel bucket thread) appear in the
trace on their own track but not in the breakdown, since they overlap the main
thread's work.

Chrome trace (``write_chrome``): one JSON object, ``pid`` = world rank, ``tid`` 0 the
main thread, ``ts``/``dur`` in microseconds from one origin shared by all ranks (the
end of a barrier), ``otherData.format = "hpctrain-trace"``. It opens in Perfetto
(ui.perfetto.dev) and ``chrome://tracing``.

Where the main thread is (``Tracer.position``): its open spans, outermost first, and
the last outermost span it closed. Another thread reads it at any time (the stall
watchdog, ``hpctrain.watchdog``); keeping it costs a list append and pop per span.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CATEGORIES = ("compute", "tp_comm", "halo", "pp_wait", "dp_comm", "optimizer", "data", "other")
TRACE_FORMAT, TRACE_VERSION = "hpctrain-trace", 1


class _Span:
    """The context manager ``Tracer.span`` returns (a class: cheaper than a generator)."""

    __slots__ = ("tracer", "name", "cat", "args", "start")

    def __init__(self, tracer: Tracer, name: str, cat: str, args: dict):
        self.tracer, self.name, self.cat, self.args = tracer, name, cat, args

    def __enter__(self) -> _Span:
        self.tracer._open(self)
        return self

    def __exit__(self, *exc) -> None:
        self.tracer._close(self.name, self.cat, self.args, self.start)


class _NullSpan:
    __slots__ = ()

    def __enter__(self) -> _NullSpan:
        return self

    def __exit__(self, *exc) -> None:
        return None


_NULL_SPAN = _NullSpan()


@dataclass(frozen=True)
class Position:
    """Where a tracer's main thread is (``Tracer.position``).

    ``spans``: its open spans, outermost first, each ``(name, cat, args, start)``
    (``start`` a ``perf_counter`` reading); ``step``: the tracer's step; ``closed``:
    ``(step, end)`` of the last outermost span it closed, or None.
    """

    spans: tuple[tuple[str, str, dict, float], ...]
    step: int | None
    closed: tuple[int | None, float] | None


class NullTracer:
    """Records nothing: the active tracer while nobody traces."""

    step: int | None = None

    def span(self, name: str, cat: str, **args) -> _NullSpan:
        return _NULL_SPAN

    def add(self, name: str, cat: str, start: float, end: float, *, track: str | None = None,
            **args) -> None:
        return None


class Tracer:
    """Spans of this process, and each category's exclusive seconds on the main thread.

    ``step``: the training step in progress, added to the args of every span (None
    outside steps). ``keep_events=False`` keeps only the category totals (for the
    per-step breakdown of a run that writes no trace).
    """

    def __init__(self, *, keep_events: bool = True):
        self.keep_events = keep_events
        self.step: int | None = None
        self.origin = time.perf_counter()
        self.events: list[tuple[str, str, int, float, float, dict]] = []
        self.totals = dict.fromkeys(CATEGORIES, 0.0)
        self._main = threading.get_ident()
        self._tids = {self._main: 0}
        self._thread_names = {0: "main"}
        self._rows_lock = threading.Lock()
        self._stack: list[float] = []  # main thread: child seconds of each open span
        self._open_spans: list[_Span] = []  # main thread: the open spans, outermost first
        self._closed: tuple[int | None, float] | None = None

    def set_origin(self, origin: float) -> None:
        """Timestamps count from ``origin`` (a ``perf_counter`` reading)."""
        self.origin = origin

    def span(self, name: str, cat: str, **args) -> _Span:
        """A context manager timing one span of category ``cat``."""
        return _Span(self, name, cat, args)

    def add(self, name: str, cat: str, start: float, end: float, *, track: str | None = None,
            **args) -> None:
        """A span measured elsewhere (``perf_counter`` readings), e.g. by a helper
        thread that saw an operation complete; it is not counted in the totals.
        ``track``: a row of its own by that name (an operation that ran beside the
        thread that saw it end would overlap that thread's spans, which a trace viewer
        draws only nested); default the calling thread's."""
        if self.keep_events:
            tid = self._tid() if track is None else self._track(track)
            self.events.append((name, cat, tid, start, end, self._args(args)))

    def position(self) -> Position:
        """Where the main thread is: a copy, safe to take from any thread."""
        spans = tuple((s.name, s.cat, s.args, s.start) for s in list(self._open_spans))
        return Position(spans, self.step, self._closed)

    def take_totals(self) -> dict[str, float]:
        """Exclusive seconds per category since the last call; resets them."""
        totals, self.totals = self.totals, dict.fromkeys(CATEGORIES, 0.0)
        return totals

    # ---- the span machinery ---------------------------------------------------------

    def _open(self, span: _Span) -> None:
        span.start = time.perf_counter()
        if threading.get_ident() == self._main:
            self._stack.append(0.0)
            self._open_spans.append(span)  # after .start is set: readers see it whole

    def _close(self, name: str, cat: str, args: dict, start: float) -> None:
        end = time.perf_counter()
        tid = self._tid()
        if tid == 0:
            children = self._stack.pop()
            self._open_spans.pop()
            elapsed = end - start
            self.totals[cat if cat in self.totals else "other"] += elapsed - children
            if self._stack:
                self._stack[-1] += elapsed
            else:
                self._closed = (self.step, end)
        if self.keep_events:
            self.events.append((name, cat, tid, start, end, self._args(args)))

    def _args(self, args: dict) -> dict:
        return args if self.step is None else {"step": self.step, **args}

    def _track(self, name: str) -> int:
        """The tid of a named row that is no thread (``add``'s ``track``)."""
        return self._row(("track", name), name)

    def _tid(self) -> int:
        ident = threading.get_ident()
        tid = self._tids.get(ident)
        return tid if tid is not None else self._row(ident, threading.current_thread().name)

    def _row(self, key, name: str) -> int:
        """A new row's tid, under a lock: two threads meeting rows at once get two."""
        with self._rows_lock:
            tid = self._tids.get(key)
            if tid is None:
                tid = self._tids[key] = len(self._tids)
                self._thread_names[tid] = name
            return tid

    # ---- Chrome trace -----------------------------------------------------------------

    def chrome_events(self, pid: int, process_name: str) -> list[dict]:
        """This process's spans as Chrome trace events (complete events, ph "X")."""
        out: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
             "args": {"name": process_name}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
             "args": {"sort_index": pid}}]
        out += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                 "args": {"name": name}} for tid, name in self._thread_names.items()]
        for name, cat, tid, start, end, args in self.events:
            out.append({"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid,
                        "ts": round((start - self.origin) * 1e6, 3),
                        "dur": round((end - start) * 1e6, 3), "args": args})
        return out


_active: Tracer | NullTracer = NullTracer()


def active() -> Tracer | NullTracer:
    """The tracer spans go to."""
    return _active


def span(name: str, cat: str, **args):
    """``active().span(...)``: a context manager timing one span."""
    return _active.span(name, cat, **args)


class recording:
    """``with recording(tracer):`` makes ``tracer`` the active one, then restores."""

    def __init__(self, tracer: Tracer):
        self.tracer = tracer

    def __enter__(self) -> Tracer:
        global _active
        self._previous, _active = _active, self.tracer
        return self.tracer

    def __exit__(self, *exc) -> None:
        global _active
        _active = self._previous


def align_origin(comm: Any, tracer: Tracer) -> None:
    """Give every rank of ``comm`` the same time origin: the end of a barrier.
    Collective. (Within one node ``perf_counter`` is one clock; across nodes the
    barrier aligns the ranks to within its latency.)"""
    comm.Barrier()
    tracer.set_origin(time.perf_counter())


def write_chrome(comm: Any, tracer: Tracer, path: str | Path, *, process_name: str,
                 other: dict | None = None) -> Path | None:
    """Gather every rank's spans to rank 0 of ``comm`` and write one Chrome trace
    JSON there (to a temporary name, then renamed). Collective; returns the path
    on rank 0, None elsewhere. ``other`` goes into ``otherData``."""
    events = tracer.chrome_events(comm.Get_rank(), process_name)
    gathered = comm.gather(events, root=0)
    if comm.Get_rank() != 0:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"traceEvents": [e for rank_events in gathered for e in rank_events],
           "displayTimeUnit": "ms",
           "otherData": {"format": TRACE_FORMAT, "version": TRACE_VERSION,
                         "world_size": comm.Get_size(), **(other or {})}}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc), encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_chrome(path: str | Path) -> dict:
    """A trace written by ``write_chrome``; ValueError if it is something else."""
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    fmt = doc.get("otherData", {}).get("format") if isinstance(doc, dict) else None
    if fmt != TRACE_FORMAT:
        raise ValueError(f"{path}: format {fmt!r} is not {TRACE_FORMAT!r} (write one with "
                         f"hpctrain train --trace FILE)")
    return doc
