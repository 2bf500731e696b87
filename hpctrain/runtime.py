"""How a job starts and how it fails: one rank's error ends every rank.

Three kinds of failure, three mechanisms:

* **User errors** (a bad config value, a missing or corrupt dataset) are found during
  start-up, before any training collective. ``startup_check`` runs the start-up work
  on every rank, then gathers the verdicts in one ``allgather``: if any rank failed,
  rank 0 prints each distinct message once (naming the ranks it came from) and every
  rank exits with status 2. No traceback: the message says what to fix.
* **Anything else**, at any time, on any rank: ``abort_on_error`` prints the traceback
  prefixed with the rank (a ``KeyboardInterrupt``, the one line "interrupted", status
  130) and calls ``MPI_Abort``, which ends the whole job with a
  non-zero status. Waiting ranks are never left hanging in a collective (the same
  behaviour as ``python -m mpi4py``).
* **Errors the ranks agreed on** in a collective (``CollectiveError``: the run diverged,
  ``hpctrain.guard``): every rank raises it in the same step, rank 0 prints it once and
  all exit with its status, without an abort.

And one way to end: ``finalize_on_exit`` ends MPI when every rank is done, but exits
with the command's status if ``MPI_Finalize`` does not return (UCX's TCP transport can
hang there, DEVELOPERS.md), so that a finished or preempted job does not sit in its
allocation until the time limit; and ends the job, naming the ranks, when some rank
does not come to the end at all within that time (stuck after the stall watchdog
stopped, or the others left behind by a rank that exited alone).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

EXIT_USER_ERROR = 2
EXIT_CRASH = 1
EXIT_INTERRUPTED = 130  # a Ctrl-C, as a shell reports it
# seconds MPI_Finalize may take once every rank has arrived (a site can set its own)
FINALIZE_TIMEOUT_ENV = "HPCTRAIN_FINALIZE_TIMEOUT_S"
FINALIZE_TIMEOUT_S = 30.0
FINALIZE_SETTLE_S = 0.1  # seconds between the ranks' last barrier and MPI_Finalize
FINALIZE_WIRE_MAX_RANKS = 512  # jobs up to this size connect every pair before it
# seconds between a rank's last words and its MPI_Abort: the launcher forwards a rank's
# output as it reads it, and an abort tears the job down before it read the rest (MPICH
# 4.0's hydra lost the whole traceback of the failing rank in 3 of 13 jobs here)
ABORT_DRAIN_S = 0.3
ARRIVED_TAG = 32001  # point-to-point tag on the world of a rank's arrival at the end
ARRIVAL_POLL_S = 0.01  # seconds between looks whether the other ranks have arrived


class UserError(Exception):
    """An error the user fixes by changing input; printed without a traceback."""


class CollectiveError(UserError):
    """A user error every rank raises together, at the same point of the run (the ranks
    agreed on it in a collective): rank 0 prints it once and every rank exits with
    ``exit_code``; nobody is waiting, so no ``MPI_Abort``."""

    exit_code = EXIT_USER_ERROR


def user_error_types() -> tuple[type[BaseException], ...]:
    """Exception types that are reported as one clean message."""
    from hpctrain.config import ConfigError
    from hpctrain.data import DataError

    return (UserError, ConfigError, DataError)


def startup_check(comm: Any, fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank; if it raises a user error on any rank, all exit(2).

    Collective over ``comm`` (one ``allgather`` of a short string).
    """
    error = None
    result = None
    try:
        result = fn()
    except user_error_types() as err:
        error = str(err)
    from hpctrain import trace

    # a span: a stall report names the ranks waiting here and the one that has not come
    with trace.span("startup_check", "other", comm="world_comm"):
        errors = comm.allgather(error)
    if any(e is not None for e in errors):
        if comm.Get_rank() == 0:
            by_message: dict[str, list[int]] = {}
            for rank, message in enumerate(errors):
                if message is not None:
                    by_message.setdefault(message, []).append(rank)
            for message, ranks in by_message.items():
                where = "" if len(ranks) == comm.Get_size() else f" (rank {_ranges(ranks)})"
                print(f"error{where}: {message}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
    return result


def _ranges(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


@contextmanager
def abort_on_error(comm: Any):
    """End the whole job if the body raises on this rank.

    A user error still prints one line without a traceback; anything else prints the
    traceback. Either way ``comm.Abort`` follows when other ranks exist, since they may
    already be waiting in a collective this rank will never join.
    """
    try:
        yield
    except SystemExit:
        raise
    except CollectiveError as err:
        if comm.Get_rank() == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(status_of(err))
    except BaseException as err:  # noqa: BLE001 - every failure must end the job
        rank, size = comm.Get_rank(), comm.Get_size()
        prefix = f"[rank {rank}] " if size > 1 else ""
        code = status_of(err)
        if isinstance(err, user_error_types()):
            print(f"{prefix}error: {err}", file=sys.stderr, flush=True)
        elif isinstance(err, KeyboardInterrupt):  # Ctrl-C: where it came is no news
            print(f"{prefix}interrupted", file=sys.stderr, flush=True)
        elif isinstance(err, MemoryError):  # a config too large: the size, not NumPy's frames
            ours = [f for f in traceback.extract_tb(err.__traceback__)  # hpctrain's last
                    if "hpctrain" in Path(f.filename).parts]
            at = ""
            if ours:
                parts = Path(ours[-1].filename).parts
                where = "/".join(parts[len(parts) - parts[::-1].index("hpctrain") - 1:])
                at = f" in {where}:{ours[-1].lineno}"
            print(f"{prefix}error: out of memory ({err or 'MemoryError'}{at}): the model, "
                  f"the batch or the layout does not fit this rank's memory; `hpctrain plan "
                  f"--config ... --cluster ... --explain LAYOUT` predicts each rank's "
                  f"memory", file=sys.stderr, flush=True)
        else:
            text = "".join(traceback.format_exception(err))
            sys.stderr.write("".join(prefix + line + "\n" for line in text.splitlines()))
            sys.stderr.flush()
        if size > 1:
            abort(comm, code)
        sys.exit(code)


def status_of(err: BaseException) -> int:
    """The exit status a process ends with when ``err`` ends it (``abort_on_error``'s):
    a SystemExit its own, an error every rank raised together its ``exit_code``, a user
    error 2, a Ctrl-C 130, anything else 1."""
    if isinstance(err, SystemExit):
        return exit_status(err.code)
    if isinstance(err, CollectiveError):
        return err.exit_code
    if isinstance(err, user_error_types()):
        return EXIT_USER_ERROR
    return EXIT_INTERRUPTED if isinstance(err, KeyboardInterrupt) else EXIT_CRASH


def abort(comm: Any, code: int) -> None:
    """``comm.Abort(code)`` once this rank's output has had ``ABORT_DRAIN_S`` to reach
    the launcher (what a rank printed last says why the job ended)."""
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(ABORT_DRAIN_S)
    comm.Abort(code)


def set_blas_threads(threads: int) -> int:
    """Limit the BLAS pool of the NumPy already loaded in this process, and the threads
    of element-wise work (``hpctrain.nn.threads``) to the same count; return it."""
    from threadpoolctl import threadpool_limits

    from hpctrain.nn import threads as nn_threads

    threads = max(1, threads)
    threadpool_limits(limits=threads, user_api="blas")
    nn_threads.set_threads(threads)  # element-wise work follows the BLAS pool
    return threads


def blas_thread_timeout() -> int | None:
    """The ``OPENBLAS_THREAD_TIMEOUT`` the loaded OpenBLAS read when it started (0 when
    unset: its default spin), or None when NumPy's BLAS is not OpenBLAS.

    The package sets it on import (see ``hpctrain/__init__.py``); this says whether that
    came in time, i.e. before NumPy was imported.
    """
    import ctypes

    import numpy  # noqa: F401  (loads the BLAS, so that threadpoolctl finds it)
    from threadpoolctl import threadpool_info

    for lib in threadpool_info():
        if lib.get("internal_api") == "openblas":
            getter = getattr(ctypes.CDLL(lib["filepath"]), "openblas_thread_timeout", None)
            return None if getter is None else int(getter())
    return None


def blas_spin_warning(threads: int) -> str | None:
    """A warning when this rank's OpenBLAS workers spin after each product (NumPy was
    loaded before hpctrain could set ``OPENBLAS_THREAD_TIMEOUT``); None otherwise. Only
    a rank with more than one BLAS thread has workers."""
    if threads <= 1 or blas_thread_timeout() != 0:
        return None
    return ("warning: OpenBLAS's idle workers spin after each product and slow the "
            "element-wise work (NumPy was imported before hpctrain): set "
            "OPENBLAS_THREAD_TIMEOUT=4 in the environment, or import hpctrain first")


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Make freed arrays stay in this process for the next step to reuse; True if set.

    A training step allocates hundreds of MB of activations and frees them all at the
    end of backward. By default glibc hands that memory back to the kernel (trimming
    the heap, unmapping large blocks), so the next step page-faults every page in
    again: on the benchmark GPT that is 60,000 faults and about a third of the step.
    Here the heap is never trimmed and no block gets its own mapping (glibc maps a
    block itself only if the heap cannot grow), so after the first step the arrays
    reuse memory already mapped, as a caching allocator does. The process keeps its
    peak memory until it exits. A no-op without glibc.
    """
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to tune
        return False
    ok = mallopt(_M_MMAP_MAX, 0)  # large blocks from the heap too, whatever their size
    ok &= mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    return bool(ok)


def find_mpiexec(given: str | None = None) -> str:
    """``given`` (a command's ``--mpiexec``) if it names a program, else the ``mpiexec``
    beside this Python (the venv's MPICH wheel), else the one on PATH."""
    import os
    import shutil

    if given is not None:
        if shutil.which(given) is None:
            raise UserError(f"{given}: no such program (give a path or a name on PATH)")
        return given
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = beside if os.access(beside, os.X_OK) else shutil.which("mpiexec")
    if found is None:
        raise UserError("no mpiexec beside this Python or on PATH: run `make install` (it "
                        "brings MPICH into .venv) or install the 'mpich' extra")
    return found


def exit_status(code: Any) -> int:
    """The process status ``sys.exit(code)`` gives: None 0, an int itself, else 1."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def finalize_timeout() -> float:
    """``HPCTRAIN_FINALIZE_TIMEOUT_S`` (seconds, > 0), else ``FINALIZE_TIMEOUT_S``."""
    text = os.environ.get(FINALIZE_TIMEOUT_ENV)
    if text is None:
        return FINALIZE_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UserError(f"{FINALIZE_TIMEOUT_ENV} ({text!r}) must be a number of seconds > 0")
    return value


@contextmanager
def finalize_on_exit(timeout: float | None = None):
    """End MPI on the way out of a program, within ``timeout`` seconds, if the program
    started it (``hpctrain``'s entry point, ``cli.run``; mpi4py imported and initialized).

    On a normal return or a ``SystemExit`` (every way an hpctrain command ends other
    than ``MPI_Abort``, and one all ranks take together), the ranks wait for each other
    at most ``timeout`` seconds (``meet_before_finalize``): a rank that does not come
    is named and the job ended (``MPI_Abort``, the command's status if an error, else
    ``watchdog.EXIT_STALLED``), since the others would wait for it for good. Then
    every pair of ranks exchanges a byte (jobs up to ``FINALIZE_WIRE_MAX_RANKS``: an
    endpoint never used can hang the finalize), the ranks meet in a barrier, pause
    ``FINALIZE_SETTLE_S`` and call ``MPI_Finalize`` with the GIL released (through
    ctypes; mpi4py's own ``Finalize`` holds it), while a thread waits: if it has not
    returned after ``timeout`` seconds, the rank says so and leaves with the command's
    status (``os._exit``). The ranks still inside the finalize leave the same way when
    their own time is up. Without this a job whose work is done and saved can stay in
    its allocation until the time limit (UCX 1.13's TCP transport sometimes never
    finishes closing its endpoints; DEVELOPERS.md). Any other exception (one the
    command's own ``abort_on_error`` did not see) passes through as it is on a single
    rank; with more ranks it ends the job as ``abort_on_error`` does, since the others
    may be waiting for this rank."""
    if timeout is None:
        try:
            timeout = finalize_timeout()
        except UserError as err:  # before any command ran: nothing collective yet
            print(f"error: {err}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)
    status = 0
    try:
        yield
    except SystemExit as exc:
        status = exit_status(exc.code)
        _finalize_within(status, timeout)
        keep_status_for_hydra(status)
        raise
    except BaseException:
        world = _running_world()
        if world is not None and world.Get_size() > 1:
            # an error outside the command's own abort_on_error: the other ranks may
            # wait for this one in their last collectives, so it ends the job
            with abort_on_error(world):
                raise
        raise
    _finalize_within(status, timeout)


def _running_world() -> Any:
    """COMM_WORLD if this process started MPI and has not finalized it, else None."""
    if "mpi4py.MPI" not in sys.modules:
        return None
    from mpi4py import MPI

    if not MPI.Is_initialized() or MPI.Is_finalized():
        return None
    return MPI.COMM_WORLD


def meet_before_finalize(comm, within: float | None = None) -> list[int]:
    """What every rank does right before ``MPI_Finalize`` in ``finalize_on_exit``.

    First each rank tells rank 0 it has arrived and waits for rank 0's word that all
    have (point-to-point on ``comm``: never matched with a collective a late rank may
    still be in). ``within``: rank 0 waits that many seconds for the others, the
    others twice that for rank 0; then the ranks that have not arrived are returned
    (rank 0: the missing ranks; another rank: [0]) and nothing else is done. Else the
    ranks meet in their last collectives and [] is returned."""
    missing = _arrive(comm, within)
    if missing:
        return missing
    size = comm.Get_size()
    # a message between every pair of ranks first: MPI opens a pair's connection at its
    # first message, and MPICH 4.0 over UCX's TCP transport closes every endpoint in
    # MPI_Finalize, one a rank never used among them; closing one whose connection was
    # still being made waits for a peer that has left for the finalize's PMI barrier,
    # for good. Two emulated nodes, 4 ranks: 11 of 40 jobs waited for the bound below
    # without it, 0 of 50 with it (DEVELOPERS.md). Each rank opens size - 1
    # connections, so only up to FINALIZE_WIRE_MAX_RANKS.
    if 1 < size <= FINALIZE_WIRE_MAX_RANKS:
        comm.Alltoall(bytearray(size), bytearray(size))
    # every rank done, then a pause before the teardown: ranks that reach MPI_Finalize
    # at different times, or straight from a barrier, made UCX 1.13's TCP transport
    # hang there in 9 of 10 4-rank jobs; with 20 ms between, none (DEVELOPERS.md)
    comm.Barrier()
    time.sleep(FINALIZE_SETTLE_S)
    return []


def _arrive(comm, within: float | None) -> list[int]:
    """``meet_before_finalize``'s arrival: the ranks not there in time (see there)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        return []
    byte = bytearray(1)
    if rank == 0:
        pending = {r: comm.Irecv(bytearray(1), source=r, tag=ARRIVED_TAG)
                   for r in range(1, size)}
        missing = _wait_for(pending, within)
        if missing:
            return missing
        from mpi4py import MPI

        MPI.Request.Waitall([comm.Isend(byte, dest=r, tag=ARRIVED_TAG)
                             for r in range(1, size)])
        return []
    comm.Send(byte, dest=0, tag=ARRIVED_TAG)
    # longer than rank 0 waits for the others: a late rank is named by rank 0
    return _wait_for({0: comm.Irecv(byte, source=0, tag=ARRIVED_TAG)},
                     None if within is None else 2 * within)


def _wait_for(requests: dict, within: float | None) -> list[int]:
    """Test ``requests`` (by rank) until all completed, or ``within`` seconds passed:
    the ranks whose request has not completed."""
    deadline = None if within is None else time.monotonic() + within
    while requests:
        requests = {r: req for r, req in requests.items() if not req.Test()}
        if requests and deadline is not None and time.monotonic() > deadline:
            for req in requests.values():
                req.Cancel()
            return sorted(requests)
        if requests:
            time.sleep(ARRIVAL_POLL_S)
    return []


def _finalize_within(status: int, timeout: float) -> None:
    comm = _running_world()
    if comm is None:  # the command never started MPI, or ended it
        return
    from mpi4py import MPI

    sys.stdout.flush()
    sys.stderr.flush()
    rank, size = comm.Get_rank(), comm.Get_size()
    missing = meet_before_finalize(comm, within=timeout)
    if missing:
        _end_without(comm, missing, status, 2 * timeout if rank else timeout)
    returned = threading.Event()

    def watch() -> None:
        if returned.wait(timeout):
            return
        prefix = f"[rank {rank}] " if size > 1 else ""
        os.write(2, f"{prefix}MPI_Finalize has not returned after {timeout:g} s; exiting "
                    f"with status {status} without it (the command's work is done; "
                    f"{FINALIZE_TIMEOUT_ENV} sets the wait)\n".encode())
        keep_status_for_hydra(status)
        os._exit(status)

    threading.Thread(target=watch, name="hpctrain-finalize", daemon=True).start()
    import ctypes

    # MPI.so's handle finds MPI_Finalize in the MPI library it links against; a ctypes
    # call releases the GIL, so the thread above can act while this one waits
    ctypes.CDLL(MPI.__file__).MPI_Finalize()
    returned.set()


def _end_without(comm, missing: list[int], status: int, waited: float) -> None:
    """This rank's command ended with ``status``; ``missing`` did not come to the end
    within ``waited`` seconds: say so and end the job (``MPI_Abort``), with ``status``
    if it is an error, else ``watchdog.EXIT_STALLED``."""
    from hpctrain.watchdog import EXIT_STALLED

    rank = comm.Get_rank()
    who = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {_ranges(missing)}"
    has = "has" if len(missing) == 1 else "have"
    code = status or EXIT_STALLED
    os.write(2, f"[rank {rank}] the command ended on this rank (status {status}), but {who} "
                f"{has} not come to the end after {waited:g} s (stuck after the stall "
                f"watchdog stopped, or waiting in an operation a rank left): ending the "
                f"job with status {code} ({FINALIZE_TIMEOUT_ENV} sets the wait)\n".encode())
    abort(comm, code)


def keep_status_for_hydra(status: int) -> None:
    """Make MPICH's ``mpiexec`` (hydra) report this rank's non-zero exit status.

    Hydra before MPICH 4.1 (Debian 12's and Ubuntu 22.04's 4.0) reports 0 for a rank
    that exits after ``mpiexec`` passed it a signal (Ctrl-C's SIGINT, a preemption's
    SIGUSR1) unless its proxy collected the status while some rank's output was still
    open: a signal passed on marks the job "forced cleanup", and the statuses collected
    after the last output closed are then taken as 0 (pmodels/mpich#5930 removed that).
    The rank's output closes as it exits, a moment before the kernel has the status, so
    a job signalled through ``mpiexec`` often ended with 0 instead of 3 (preempted: not
    requeued) or 130. A shell child
    holds this rank's stdout and stderr until the rank is a zombie (``/proc``), then
    exits: their closing wakes the proxy, which collects the real status. Only under
    hydra (``MPI_LOCALNRANKS`` set) and for a non-zero status; costs one ``sh``."""
    proc_stat = f"/proc/{os.getpid()}/stat"
    if status == 0 or "MPI_LOCALNRANKS" not in os.environ or not os.path.exists(proc_stat):
        return
    import subprocess

    # the state is the field after the command name's closing parenthesis; at most 10 s
    script = ('i=0; while [ "$i" -lt 500 ]; do '
              f's=$(sed "s/.*) //" {proc_stat} 2>/dev/null | cut -c1); '
              'case "$s" in Z|"") exit 0;; esac; sleep 0.02; i=$((i + 1)); done')
    try:
        subprocess.Popen(["/bin/sh", "-c", script], stdin=subprocess.DEVNULL)
    except OSError:  # no shell: the status may be lost, as without this
        pass
