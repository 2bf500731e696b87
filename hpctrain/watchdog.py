"""The stall watchdog: when a step has not completed after ``stall_timeout`` seconds,
rank 0 says which ranks are missing from which operation, and the job ends.

A rank that stops arriving at collectives (a stuck read, a hang, a rank-dependent
branch) leaves the others waiting in MPI until the job's time limit, and nothing
names it. So every rank runs a daemon thread that reads where its main thread is:
the open trace spans (``trace.Tracer.position``: step, microbatch, the collective or
send/receive and its communicator) and the main thread's innermost Python frames.
Rank 2 of dp = 4 stuck reading its batch::

    rank 0, 1, 3   | step 3: data | F mb0 | B mb0 | dp_wait ..........................
    rank 2         | step 3: data (stuck) .............................................
    watchdogs      |  poll  poll  ...  step 3 older than the timeout: REPORT to rank 0
    rank 0's       |  ASK every rank, collect the answers (``grace`` s at most), print
    watchdog       |  who waits in what and who has not arrived, MPI_Abort(5)

Messages, over ``topo.watch_comm`` (a duplicate of the world: they never meet the
training's), pickled and small, sent with ``isend``, polled with ``Iprobe``::

    REPORT   rank r -> 0   where r is; sent when r's own step is late, and when asked
    ASK      0 -> r        "say where you are"
    EXITED   rank r -> 0   r's run ended by a SystemExit: its status, where it was raised

Rank 0 starts asking when its own step is late or the first report arrives. A rank
whose report rank 0 has not acted on after ``3 * grace`` seconds (rank 0 stuck in a
C call holding the GIL, stopped, or dead) prints its own report and ends the job
itself. Nothing is sent while steps complete: the cost is one ``Iprobe`` per rank
(two on rank 0) per ``poll`` seconds and the tracer's list append and pop per span.

A rank that leaves the run by a ``SystemExit`` (``exiting``; a ``sys.exit`` in code
that ran on it alone) would otherwise be one that "did not answer" once the others'
step is late: it sends EXITED, and rank 0, if it is still in the run ``grace``
seconds later, ends the job with that status, naming the rank. Exits every rank takes
together (the start-up's user errors, after ``startup_check``'s collective) reach
rank 0 as it leaves too, and nothing more happens.

What is timed, each against the timeout: each phase of the start-up (``STARTUP``:
rank 0's check of the run's output folders, loading the compiled kernels, opening the
data, building the model, loading the checkpoint; a rank stuck reading a slow file
system there leaves the others in ``startup_check``'s collective), each step (the
``step`` span: data, forward, backward, gradient reduction, optimizer), and
separately the work from the end of one of these to the start of the next (after the
start-up: building the data-parallel wrapper, evaluating the starting point; after a
step: the metrics all-reduce, evaluation, checkpoint saves, the preemption check;
after the last step: the last checkpoint write, the trace, the metrics file). Only
these phases and the step's parts open spans, so between them the report has the
main thread's Python frames but no operation names. The watchdog stops when
``stop()`` is called or when the function that started it (``train``) is no longer
on the main thread's stack (it raised): a watchdog never outlives its run.

Blame (``diagnose``, pure, tested without MPI): among the ranks at the latest point
of the run, those waiting in a communication span are grouped by operation and
communicator; the rest *have not arrived*: ranks at an earlier step, ranks at the
latest step but not in a communication (computing, reading, sleeping), and ranks
that did not answer; in the start-up, ranks in an earlier phase than others (the
headline names the earliest phase, where the job is held up). Ranks that exited are
named with their status. Most stalls are one rank not calling what the others wait in,
so a longer timeout rarely helps; the message says so (as PyTorch's flight-recorder
write-up found of NCCL timeouts: the stack that matters is the late rank's main
thread, not the watchdog's).

Needs ``MPI_THREAD_MULTIPLE`` (mpi4py's default request). With less, the thread makes
no MPI call: each late rank prints its own report and exits, which ends the job, and
an exit is not reported (the others stall; ``runtime.finalize_on_exit`` bounds the
exited rank's wait).
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain import trace

EXIT_STALLED = 5
REPORT, ASK, EXITED = 1, 2, 3  # message tags on watch_comm
STEP = "step"
# the start-up's phases in their order, outermost spans before the first step (step
# None): what each does
STARTUP = {"check_outputs": "checking the run's output folders",
           "load_kernels": "loading the compiled kernels",
           "open_data": "opening the data", "build_model": "building the model",
           "load_checkpoint": "loading the checkpoint"}
TIMED = (STEP, *STARTUP)  # the outermost spans timed while open

# communicator of a span that names none: its category's
_COMM_OF_CAT = {"tp_comm": "tp_comm", "pp_wait": "pp_comm", "dp_comm": "dp_comm"}
_GROUPS = {"tp_comm": "the tensor group", "dp_comm": "the data group",
           "pp_comm": "the pipeline group", "model_comm": "the model group",
           "world_comm": "every rank"}
_AXES = {"tp_comm": "tp", "dp_comm": "dp", "pp_comm": "pp", "model_comm": "model"}
_OPERATIONS = {
    "dp_wait": "gradient reduction", "zero_gather": "parameter all-gather",
    "all_reduce": "all-reduce", "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter", "send_forward": "send of an activation",
    "recv_forward": "receive of an activation", "send_backward": "send of a gradient",
    "recv_backward": "receive of a gradient", "wait_sends": "completion of its sends",
    "loss_bcast": "loss broadcast from the last stage",
    "tied_grads": "exchange of the tied embedding's gradient",
    "grad_norm": "gradient-norm all-reduce", "loss_mean": "loss all-reduce",
    "finite_check": "agreement on a finite step (hpctrain.guard)",
    "startup_check": "agreement on the start-up's errors",
    "end_of_run": "the ranks' meeting at the end of the run"}
_SHOWN_ARGS = ("mb", "chunk", "peer", "comm")
HINT = ("A stall is usually one rank not calling the operation the others wait in (stuck "
        "I/O, a hang, a rank-dependent branch): a longer --stall-timeout helps only if "
        "steps are really that slow.")
EXIT_HINT = ("A SystemExit (sys.exit, click's exit) ends only the rank that raises it; the "
             "others wait for it in their next communication: exit on every rank alike, or "
             "raise another exception, which ends the job at once with its traceback.")


@dataclass(frozen=True)
class Report:
    """Where one rank is. ``step``: the step in progress (``in_step``) or the last one
    completed; ``seconds`` in that phase; ``spans``: the open spans, outermost first,
    as ``(name, cat, args)``; ``frames``: the main thread's innermost Python frames,
    innermost first; ``coords`` ``(pp, dp, tp)`` and ``shape`` ``(dp, tp, pp)``.
    ``exited``: the status of the ``SystemExit`` that ended this rank's run (then
    ``frames`` are where it was raised, ``step`` the last step begun, no span open)."""

    rank: int
    step: int | None
    in_step: bool
    seconds: float
    spans: tuple[tuple[str, str, dict], ...] = ()
    frames: tuple[str, ...] = ()
    coords: tuple[int, int, int] | None = None
    shape: tuple[int, int, int] | None = None
    host: str = ""
    pid: int = 0
    exited: int | None = None


def phase_of(position: trace.Position, now: float,
             span: str | tuple[str, ...] = TIMED) -> tuple[int | None, bool, float] | None:
    """``(step, in_step, seconds in that phase)`` of a tracer position at ``now``
    (``perf_counter``): inside an outermost ``span`` (a name or several), or after the
    last outermost span closed; None before the first. A start-up phase is
    ``(None, True, s)``, the work after it ``(None, False, s)``."""
    names = (span,) if isinstance(span, str) else span
    if position.spans and position.spans[0][0] in names:
        return position.step, True, now - position.spans[0][3]
    if position.closed is not None:
        step, end = position.closed
        return step, False, now - end
    return None


def make_report(rank: int, position: trace.Position, now: float, *,
                frames: tuple[str, ...] = (), span: str | tuple[str, ...] = TIMED,
                **where) -> Report:
    """This rank's report from its tracer's position (``where``: coords, shape, host,
    pid)."""
    phase = phase_of(position, now, span)
    step, in_step, seconds = phase if phase is not None else (None, False, 0.0)
    spans = tuple((name, cat, dict(args)) for name, cat, args, _ in position.spans)
    return Report(rank, step, in_step, seconds, spans, frames, **where)


def main_frames(ident: int, depth: int = 4) -> tuple[str, ...]:
    """The innermost ``depth`` Python frames of thread ``ident``, innermost first, as
    ``path:line in function``."""
    frame = sys._current_frames().get(ident)
    out = []
    while frame is not None and len(out) < depth:
        code = frame.f_code
        out.append(f"{_short(code.co_filename)}:{frame.f_lineno} in {code.co_name}")
        frame = frame.f_back
    return tuple(out)


def raised_frames(err: BaseException, depth: int = 4) -> tuple[str, ...]:
    """The innermost ``depth`` frames of ``err``'s traceback, innermost first, as
    ``main_frames`` gives them: where it was raised."""
    import traceback

    summary = traceback.extract_tb(err.__traceback__)[::-1][:depth]
    return tuple(f"{_short(f.filename)}:{f.lineno} in {f.name}" for f in summary)


def _short(path: str) -> str:
    parts = Path(path).parts
    if "hpctrain" in parts[:-1]:
        first = len(parts) - 1 - parts[::-1].index("hpctrain")
        return "/".join(parts[first:])
    return parts[-1] if parts else path


# ---- blame: pure functions of the reports ---------------------------------------------

def wait_of(report: Report) -> tuple[str, str, dict] | None:
    """``(operation, communicator, args)`` if the rank's innermost span is a
    communication (a category of communication, or a span naming its ``comm``)."""
    if not report.spans:
        return None
    name, cat, args = report.spans[-1]
    comm = args.get("comm") or _COMM_OF_CAT.get(cat)
    return None if comm is None else (name, comm, args)


def members(report: Report, comm: str, args: dict) -> set[int] | None:
    """World ranks that take part in the rank's operation over ``comm`` (a send or
    receive: the rank and its ``peer``), or None if unknown."""
    if report.coords is None or report.shape is None:
        return None
    from hpctrain.parallel.topology import GridShape

    shape = GridShape(*report.shape)
    pp, dp, tp = report.coords
    if "peer" in args:
        return {report.rank, shape.rank_of(args["peer"], dp, tp)}
    if comm == "world_comm":
        return set(range(shape.world_size))
    axis = _AXES.get(comm)
    return None if axis is None else set(shape.group_ranks(report.rank, axis))


def describe_wait(op: str, comm: str) -> str:
    return f"{op} ({_OPERATIONS.get(op, 'a collective')} over {_GROUPS.get(comm, comm)})"


def phase_label(report: Report) -> str:
    if report.step is None:
        return "start-up" if report.in_step else "before the first step"
    return f"step {report.step}" if report.in_step else f"after step {report.step}"


def where(report: Report, note: str = "") -> str:
    """``in F (mb 0) > all_reduce (step 3), at FRAME``: the open spans inside the
    step, and the innermost Python frame; ``after step 2, at FRAME`` between steps.
    ``note`` goes before the frame."""
    inner = [_span_label(name, args) for name, _, args in report.spans if name != STEP]
    at = f", at {report.frames[0]}" if report.frames else ""
    if inner:
        return f"in {' > '.join(inner)} ({phase_label(report)}){note}{at}"
    return f"{'in ' if report.in_step else ''}{phase_label(report)}{note}{at}"


def _span_label(name: str, args: dict) -> str:
    shown = [f"{k} {args[k]}" for k in _SHOWN_ARGS if k in args]
    return f"{name} ({', '.join(shown)})" if shown else name


def _progress(report: Report) -> tuple[int, int, int]:
    """Order of the points of a run: the start-up's phases in ``STARTUP``'s order <
    the work before the first step < step 3 < after step 3 < step 4."""
    if report.step is None:  # start-up, then the work before the first step
        phase = report.spans[0][0] if report.in_step and report.spans else ""
        return (-1, 0 if report.in_step else 1, _STARTUP_ORDER.get(phase, 0))
    return (report.step, 0 if report.in_step else 1, 0)


_STARTUP_ORDER = {name: k for k, name in enumerate(STARTUP)}


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def diagnose(reports: dict[int, Report], size: int, timeout: float) -> str:
    """Rank 0's message: which ranks left the run (``Report.exited``), which wait in
    which operation (and for whom), which have not arrived and where they are, one
    line per rank, and a hint. ``reports``: by world rank, the ranks that answered or
    exited, at least one still in the run."""
    exited = sorted(r for r, report in reports.items() if report.exited is not None)
    running = {r: report for r, report in reports.items() if report.exited is None}
    front = max(_progress(r) for r in running.values())
    latest = max(running.values(), key=_progress)
    if front[:2] == (-1, 0):  # every rank in the start-up: held up where the last one is
        latest = min(running.values(), key=_progress)
    if exited:
        lines = [f"exit: {_ranks(exited)} left the run alone (a SystemExit) while the "
                 f"other ranks are still in it; ending the job"]
    else:
        seconds = max(r.seconds for r in running.values() if _progress(r) == _progress(latest))
        lines = [f"stall: {_what(latest)} after {seconds:.1f} s (stall timeout {timeout:g} "
                 f"s); ending the job"]
    waits: dict[tuple[str, str], list[int]] = {}
    idle, behind = [], []
    for rank in sorted(running):
        wait = wait_of(reports[rank])
        if _progress(reports[rank]) < front:
            behind.append(rank)
        elif wait is None:
            idle.append(rank)
        else:
            waits.setdefault(wait[:2], []).append(rank)
    for (op, comm), ranks in sorted(waits.items(), key=lambda kv: (-len(kv[1]), kv[1])):
        lines.append(f"  {_ranks(ranks)} wait{'s' if len(ranks) == 1 else ''} in "
                     f"{describe_wait(op, comm)}{_during(reports, ranks)}"
                     f"{_waiting_for(reports, ranks)}")
    lines += [f"  rank {r} has left the run: it exited with status {reports[r].exited} "
              f"(SystemExit) {_exit_where(reports[r])}" for r in exited]
    together = [] if waits else _waiting_untraced(reports, idle)
    lines += together
    late = behind + idle
    if waits or together or len(late) == 1:
        lines += [f"  rank {r} has not arrived: it is {_late(reports[r], r in behind)}"
                  for r in late]
    elif late:
        lines.append("  no rank waits in a traced communication and no place holds most "
                     "ranks; they are at:")
        lines += [f"    rank {r}: {where(reports[r])}" for r in late]
    silent = [r for r in range(size) if r not in reports]
    if silent:
        lines.append(f"  {_ranks(silent)} did not answer: blocked in a C call that holds "
                     f"the GIL, stopped, or dead")
    if not (late or silent or exited):
        lines.append("  every rank waits in a communication, but not all in the same one: "
                     "the ranks called different operations" if len(waits) > 1 else
                     "  every rank waits in the same operation and it does not complete: "
                     "the network or MPI")
    lines.append("where each rank is (innermost Python frames of its main thread first):")
    lines += [rank_line(reports[r]) if r in reports else f"  rank {r}: no answer"
              for r in range(size)]
    lines.append(EXIT_HINT if exited else HINT)
    return "\n".join(lines)


def abort_status(reports: dict[int, Report]) -> int:
    """The status rank 0 ends the job with: that of the first rank that exited with
    an error, else ``EXIT_STALLED``."""
    statuses = [reports[r].exited for r in sorted(reports) if reports[r].exited]
    return statuses[0] if statuses else EXIT_STALLED


def _exit_where(report: Report) -> str:
    """``in step 3, at FRAME``: where a rank's SystemExit was raised."""
    at = f", at {report.frames[0]}" if report.frames else ""
    return f"{'in ' if report.in_step else ''}{phase_label(report)}{at}"


def _what(latest: Report) -> str:
    """What has not completed, from the report of a rank at the latest point."""
    if latest.step is None and latest.in_step:
        phase = latest.spans[0][0] if latest.spans else ""
        return f"the start-up ({STARTUP.get(phase, phase)}) has not completed"
    if latest.step is None:
        return ("the work before the first step (data-parallel set-up, evaluation of the "
                "starting point) has not completed")
    if latest.in_step:
        return f"step {latest.step} has not completed"
    return (f"the work after step {latest.step} (metrics, evaluation, checkpoint, "
            f"preemption check, the end of the run) has not completed")


def _late(report: Report, behind: bool) -> str:
    if behind:
        return f"still {where(report)}"
    return where(report, ", not in a communication" if len(report.spans) > 1 else
                 ", not in a traced communication")


def _waiting_untraced(reports: dict[int, Report], idle: list[int]) -> list[str]:
    """Without communication spans (after a step; an untraced collective) the ranks
    waiting together are at one place: if one place holds more ranks than any other,
    say so and take them out of ``idle`` (in place); the rest have not arrived."""
    places: dict[str, list[int]] = {}
    for rank in idle:
        places.setdefault(where(reports[rank]), []).append(rank)
    sizes = sorted((len(ranks) for ranks in places.values()), reverse=True)
    if len(sizes) < 2 or sizes[0] < 2 or sizes[0] == sizes[1]:
        return []
    place, ranks = max(places.items(), key=lambda kv: len(kv[1]))
    idle[:] = [r for r in idle if r not in ranks]
    return [f"  {_ranks(ranks)} are {place}"]


def _during(reports: dict[int, Report], ranks: list[int]) -> str:
    """`` during F (mb 0)``: the spans around the ranks' wait, if the same for all."""
    around = {tuple(_span_label(name, args) for name, _, args in reports[r].spans[:-1]
                    if name != STEP) for r in ranks}
    if len(around) != 1:
        return ""
    inner = around.pop()
    return f" during {' > '.join(inner)}" if inner else ""


def _waiting_for(reports: dict[int, Report], ranks: list[int]) -> str:
    """`` for ranks 2, 3``: the members of the ranks' operations not in it."""
    missing: set[int] = set()
    for rank in ranks:
        op, comm, args = wait_of(reports[rank])
        group = members(reports[rank], comm, args)
        if group is not None:
            missing |= group - set(ranks)
    return f" for {_ranks(missing)}" if missing else ""


def rank_line(report: Report) -> str:
    """``rank 2 (pp 0 dp 1 tp 0, host pid 7): step 3, 5.1 s: step > data | frames``;
    ``rank 2 (...): exited with status 7 in step 3 | frames`` for a rank that left."""
    ident = [] if report.coords is None else [
        "pp {} dp {} tp {}".format(*report.coords)]
    if report.host:
        ident.append(f"{report.host} pid {report.pid}")
    frames = " < ".join(report.frames)
    if report.exited is not None:
        state = (f"exited with status {report.exited} {'in ' if report.in_step else ''}"
                 f"{phase_label(report)}")
    else:
        spans = " > ".join(_span_label(name, args) for name, _, args in report.spans)
        state = (f"{phase_label(report)}, {report.seconds:.1f} s: "
                 f"{spans or 'no open span'}")
    return (f"  rank {report.rank}" + (f" ({', '.join(ident)})" if ident else "") +
            f": {state}" + (f" | {frames}" if frames else ""))


def alone(report: Report, timeout: float, why: str) -> str:
    """The message of a rank that ends the job on its own."""
    return "\n".join([f"stall: {phase_label(report)} has not completed on rank "
                      f"{report.rank} after {report.seconds:.1f} s (stall timeout "
                      f"{timeout:g} s); {why}", rank_line(report), HINT])


# ---- the thread ------------------------------------------------------------------------

def _thread_level() -> tuple[int, bool]:
    """MPI's thread level and whether it is ``MPI_THREAD_MULTIPLE``."""
    from mpi4py import MPI

    level = MPI.Query_thread()
    return level, level >= MPI.THREAD_MULTIPLE


class Watchdog:
    """One rank's watchdog thread over ``comm`` (every rank of it runs one).

    ``tracer``: the run's; ``timeout`` in seconds. ``grace``: how long rank 0 collects
    answers (default timeout / 10, within [2, 10] s); ``poll``: seconds between looks
    (timeout / 20, within [0.05, 1]). ``abort(code)`` ends the job (default
    ``comm.Abort``, or ``os._exit`` without ``MPI_THREAD_MULTIPLE``); ``out`` takes
    the message (default ``sys.stderr``). ``coords``/``shape`` let rank 0 name the
    members of each operation.
    """

    def __init__(self, comm: Any, tracer: trace.Tracer, timeout: float, *,
                 coords: tuple[int, int, int] | None = None,
                 shape: tuple[int, int, int] | None = None, grace: float | None = None,
                 poll: float | None = None, abort: Callable[[int], Any] | None = None,
                 out: Any = None, span: str | tuple[str, ...] = TIMED):
        if timeout <= 0:
            raise ValueError(f"timeout ({timeout}) must be positive")
        self.comm, self.tracer, self.timeout, self.span = comm, tracer, float(timeout), span
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.grace = grace if grace is not None else min(10.0, max(2.0, self.timeout / 10))
        self.poll = poll if poll is not None else min(1.0, max(0.05, self.timeout / 20))
        self.level, self.threaded = _thread_level()
        self.abort = abort or (self._mpi_abort if self.threaded else os._exit)
        self.out = out
        self.where = dict(coords=coords, shape=shape, host=socket.gethostname(),
                          pid=os.getpid())
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._owner = None
        self._main = threading.get_ident()
        self._reports: dict[int, Report] = {}
        self._answered: set[int] = set()
        self._requests: list = []
        self._exit_seen: float | None = None  # rank 0: when a rank's exit was first heard of
        self._ending = False  # the thread is ending the job (a stall found)

    def start(self, owner=None) -> Watchdog:
        """Start the thread; it watches while ``owner`` (a frame, default the caller's)
        is on the calling thread's stack. Not collective."""
        self._owner = owner if owner is not None else sys._getframe(1)
        self._main = threading.get_ident()
        if not self.threaded and self.size > 1 and self.rank == 0:
            self._write(f"warning: MPI provides thread level {self.level}, not "
                        f"MPI_THREAD_MULTIPLE: a stalled job ends with each late rank's "
                        f"own report, no summary of every rank")
        self._thread = threading.Thread(target=self._run, name="stall watchdog", daemon=True)
        self._thread.start()
        atexit.register(self.stop)  # before MPI_Finalize, which mpi4py registered earlier
        return self

    def stop(self) -> None:
        """Stop the thread (not collective)."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.poll + 1)
        atexit.unregister(self.stop)
        self._owner = None
        if self.threaded and self.size > 1 and self.rank == 0:
            self._take_reports()  # a report sent as the run ended: received, ignored

    # ---- the loop ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._watch()
        except BaseException as err:  # noqa: BLE001 - the thread must not end unseen
            self._failed(err)

    def _failed(self, err: BaseException) -> None:
        """The thread's own error: said on stderr with the rank (Python's thread hook
        names no rank); the job ends if it came while ending it (a report that could
        not be written: the ranks would wait for good), else the run goes on without a
        watchdog."""
        ending = self._ending
        text = "".join(traceback.format_exception(err)).rstrip("\n")
        then = ("ending the job" if ending else
                "the run goes on without one (a stall is no longer reported)")
        lines = [f"[rank {self.rank}] the stall watchdog stopped on an error; {then}:"]
        lines += [f"[rank {self.rank}]   {line}" for line in text.splitlines()]
        try:
            os.write(2, ("\n".join(lines) + "\n").encode(errors="replace"))
        except OSError:
            pass
        if ending:
            self.abort(EXIT_STALLED)

    def _watch(self) -> None:
        reported_at = None
        try:
            while not self._stopping.wait(self.poll):
                if not self._owner_alive():
                    return
                now = time.perf_counter()
                phase = phase_of(self.tracer.position(), now, self.span)
                late = phase is not None and phase[2] > self.timeout
                if not self.threaded or self.size == 1:
                    if late:
                        return self._end_alone(self._why_alone())
                elif self.rank == 0:
                    if self._take_exits() and self._exit_seen is None:
                        self._exit_seen = now
                    # a rank that exited while this one is still in the run after grace
                    # seconds: it exited alone, and the others wait for it
                    left = self._exit_seen is not None and now - self._exit_seen > self.grace
                    if late or self._take_reports() or left:
                        return self._conclude()
                else:
                    if self._asked():
                        self._send(answering=True)
                    if late and reported_at is None:
                        self._send(answering=False)
                        reported_at = now
                    if reported_at is not None and now - reported_at > 3 * self.grace:
                        return self._end_alone(
                            f"rank 0's watchdog has not ended the job {3 * self.grace:g} s "
                            f"after this rank's report (rank 0 blocked holding the GIL, "
                            f"stopped, or dead): this rank ends it")
        finally:
            self._owner = None

    def _owner_alive(self) -> bool:
        frame = sys._current_frames().get(self._main)
        while frame is not None:
            if frame is self._owner:
                return True
            frame = frame.f_back
        return False

    def _report(self) -> Report:
        return make_report(self.rank, self.tracer.position(), time.perf_counter(),
                           frames=main_frames(self._main), span=self.span, **self.where)

    def _why_alone(self) -> str:
        if self.size == 1:
            return "ending the job"
        return (f"MPI provides thread level {self.level}, not MPI_THREAD_MULTIPLE, so the "
                f"watchdog cannot ask the other ranks: this rank ends the job")

    def _end_alone(self, why: str) -> None:
        self._ending = True
        self._write(alone(self._report(), self.timeout, why))
        self.abort(EXIT_STALLED)

    def _conclude(self) -> None:
        """Rank 0: ask every rank, collect for ``grace`` s at most, print, abort."""
        self._ending = True
        deadline = time.perf_counter() + self.grace
        self._ask([r for r in range(1, self.size) if r not in self._answered])
        while len(self._answered) < self.size - 1 and time.perf_counter() < deadline:
            if not (self._take_reports() | self._take_exits()):
                time.sleep(min(self.poll, 0.05))
        self._reports[0] = self._report()
        self._write(diagnose(self._reports, self.size, self.timeout))
        self.abort(abort_status(self._reports))

    def _ask(self, ranks: list[int]) -> None:
        for rank in ranks:
            self._requests.append(self.comm.isend(None, dest=rank, tag=ASK))

    def _take_reports(self) -> bool:
        """Rank 0: receive the reports that have arrived; whether there were any."""
        from mpi4py import MPI

        status, got = MPI.Status(), False
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=REPORT, status=status):
            answering, report = self.comm.recv(source=status.Get_source(), tag=REPORT)
            earlier = self._reports.get(report.rank)
            if earlier is None or earlier.exited is None:  # an exit is its last word
                self._reports[report.rank] = report
            if answering:
                self._answered.add(report.rank)
            got = True
        return got

    def _take_exits(self) -> bool:
        """Rank 0: receive the reports of ranks whose run ended by a ``SystemExit``
        (``exiting``); whether there were any. Such a rank answers nothing more."""
        from mpi4py import MPI

        status, got = MPI.Status(), False
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=EXITED, status=status):
            report = self.comm.recv(source=status.Get_source(), tag=EXITED)
            self._reports[report.rank] = report
            self._answered.add(report.rank)
            got = True
        return got

    # ---- a rank that exits ----------------------------------------------------------------

    def exiting(self, err: SystemExit) -> None:
        """This rank's run ends by ``err``; stops the thread (not collective).

        When every rank exits alike (the start-up's user errors: all raise them after
        one collective) nothing else happens. A rank that exits alone leaves the others
        waiting for it in their next communication, and its watchdog no longer answers:
        with ``MPI_THREAD_MULTIPLE`` it sends rank 0 its report (status, step, where it
        was raised), and rank 0, if still in the run ``grace`` seconds later, prints
        who left and where the others wait and ends the job with that status. Rank 0
        exiting itself waits for the others' reports at most ``grace`` seconds, asks
        those not heard from, and does the same if any answers from inside the run.
        Ranks that neither exit nor answer are left to ``runtime.finalize_on_exit``,
        which names them."""
        self.stop()
        if not self.threaded or self.size == 1:
            return
        from hpctrain.runtime import exit_status

        position = self.tracer.position()
        if position.step is not None:  # the loop's step is set only while a step runs
            step, in_step = position.step, True
        elif position.closed is not None and position.closed[0] is not None:
            step, in_step = position.closed[0], False
        else:
            step, in_step = None, True  # the start-up
        report = Report(self.rank, step, in_step, 0.0, (), raised_frames(err),
                        exited=exit_status(err.code), **self.where)
        if self.rank != 0:
            self._requests.append(self.comm.isend(report, dest=0, tag=EXITED))
            return
        self._reports[0] = report
        if self._others_still_in_run():
            self._write(diagnose(self._reports, self.size, self.timeout))
            self.abort(abort_status(self._reports))

    def _others_still_in_run(self) -> bool:
        """Rank 0, which exited: whether a rank reported from inside the run and did
        not exit within ``grace`` seconds. Ranks exiting alike report at once; the
        rest are asked after ``min(1, grace / 4)`` seconds (so that a common exit
        sends nothing more); any report of a rank not exited says it is in the run."""
        start = time.perf_counter()
        asked = False
        while time.perf_counter() - start < self.grace:
            self._take_exits()
            self._take_reports()
            out = {r for r, report in self._reports.items() if report.exited is not None}
            if len(out) == self.size:
                return False
            if not asked and time.perf_counter() - start > min(1.0, self.grace / 4):
                self._ask([r for r in range(1, self.size) if r not in out])
                asked = True
            time.sleep(0.01)
        return any(report.exited is None for r, report in self._reports.items() if r != 0)

    def _asked(self) -> bool:
        asked = False
        while self.comm.Iprobe(source=0, tag=ASK):
            self.comm.recv(source=0, tag=ASK)
            asked = True
        return asked

    def _send(self, *, answering: bool) -> None:
        self._requests = [r for r in self._requests if not r.Test()]
        self._requests.append(self.comm.isend((answering, self._report()), dest=0, tag=REPORT))

    def _write(self, text: str) -> None:
        out = self.out if self.out is not None else sys.stderr
        out.write(text + "\n")
        out.flush()

    def _mpi_abort(self, code: int) -> None:
        from hpctrain.runtime import abort

        abort(self.comm, code)


class NullWatchdog:
    """No watchdog (``stall_timeout = 0``)."""

    def stop(self) -> None:
        return None

    def exiting(self, err: SystemExit) -> None:
        return None


def start(topo: Any, tracer: trace.Tracer, timeout: float, **options) -> Watchdog | NullWatchdog:
    """Every rank's watchdog over ``topo.watch_comm`` for the steps ``tracer`` records,
    watching while the caller runs; a ``NullWatchdog`` when ``timeout`` is 0. Not
    collective (the communicator was built by ``Topology.build``)."""
    if timeout <= 0:
        return NullWatchdog()
    c = topo.coords
    watch = Watchdog(topo.watch_comm, tracer, timeout, coords=(c.pp, c.dp, c.tp),
                     shape=(topo.shape.dp, topo.shape.tp, topo.shape.pp), **options)
    return watch.start(owner=sys._getframe(1))
