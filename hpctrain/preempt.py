"""Preemption and interruption: a signal asks the job to checkpoint at the end of the
step and stop.

SLURM sends SIGUSR1 before the time limit (``#SBATCH --signal=B:USR1@N``: to the job
script, which passes it to its launcher and that to the ranks) or when told (``scancel
--batch --signal=USR1``); schedulers and ``kill`` send SIGTERM. The handler only
sets a flag, so the signal may arrive anywhere, even inside BLAS or MPI. At the end of
every step the ranks agree with one tiny all-reduce: if any rank was signalled, all
of them save and stop after the *same* step, and ``hpctrain train`` exits with
``EXIT_PREEMPTED`` so the batch script knows to requeue. A signal during start-up
(agreed once before the first step) stops the run before it, with nothing to save.

Ctrl-C (SIGINT; ``mpiexec`` passes it to every rank) stops the same way, after the
step, with a checkpoint, but exits with ``runtime.EXIT_INTERRUPTED`` (130, the shell's
status for SIGINT), which no batch script requeues. Its first arrival says so on the
terminal; a second one raises ``KeyboardInterrupt`` where the rank is, which ends the
job at once without saving (``runtime.abort_on_error``). A SIGINT the process was
started ignoring (a background job of a shell without job control) stays ignored.

Open MPI's ``mpirun`` (ORTE, the launcher of Open MPI 4 and earlier) passes neither
SIGINT nor SIGTERM on: it stops the job by a kill sequence of its own, SIGCONT to every
rank at once, SIGTERM ``odls_base_sigkill_timeout`` seconds later (default 1) and
SIGKILL as long again after that (measured: DEVELOPERS.md). The ranks take the SIGTERM
as a preemption and stop after the step with a checkpoint, if the step and the save fit
in that time; ``stop_time_note`` tells rank 0 when they do not (``train`` asks after its
first checkpoint). Open MPI 5's ``mpirun`` (PRRTE) runs the same sequence with fixed
steps of 0.25 s that no parameter changes, so there a run is stopped with its checkpoint
by SIGUSR1 to ``mpirun``, which passes that signal on, and the note says so.
"""

from __future__ import annotations

import math
import os
import signal
from typing import Any

EXIT_PREEMPTED = 3
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

# what ``agreed`` returns: bits of the signals any rank has seen
PREEMPTED, INTERRUPTED = 1, 2

# the ranks' environment under Open MPI's mpirun (ORTE): its own address, and the MCA
# parameter of its kill sequence when the user set it (--mca or the environment)
ORTE_URI = "OMPI_MCA_orte_hnp_uri"
ORTE_KILL_DELAY = "OMPI_MCA_odls_base_sigkill_timeout"
EXIT_S = 0.5  # what a rank takes to leave after its checkpoint (finalize, exit)
# under Open MPI 5's mpirun (PRRTE, which sets PRTE_LAUNCHED in the ranks): SIGTERM 0.25 s
# after its own Ctrl-C or SIGTERM, SIGKILL 0.25 s after that, fixed in PRRTE's code
PRRTE_MARK = "PRTE_LAUNCHED"
PRRTE_KILL_DELAY = 0.25

_received: list[int] = []
_speaker = [True]  # whether this rank says that a Ctrl-C was seen (rank 0 of the job)


def _handler(signum, _frame) -> None:
    _received.append(signum)


def _interrupt(signum, _frame) -> None:
    _received.append(signum)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the next one: at once
    if _speaker[0]:  # os.write: a print may be under way where the signal came
        os.write(2, b"\ninterrupt: stopping after this step with a checkpoint "
                    b"(Ctrl-C again stops at once, without one)\n")


def install() -> None:
    """Catch SIGUSR1, SIGTERM and SIGINT from now on (call first thing: a signal can
    come early)."""
    for sig in SIGNALS:
        signal.signal(sig, _handler)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _interrupt)


def speak(on: bool) -> None:
    """Whether this rank announces a Ctrl-C (only one rank of a job should)."""
    _speaker[0] = on


def ignore() -> None:
    """Ignore SIGUSR1 and SIGTERM from now on, and let Ctrl-C raise as usual: the run
    has ended, nothing is left to save.

    A signal that comes late (``--signal=USR1@N`` as the last step ends) must not kill
    a finished run in its shutdown: Python resets its own handlers to the default, which
    for SIGUSR1 kills the process, but keeps an ignored signal ignored.
    """
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def received() -> bool:
    """Whether this rank has been signalled (local, no communication)."""
    return bool(_received)


def _bits() -> int:
    return (INTERRUPTED if signal.SIGINT in _received else 0) | \
        (PREEMPTED if any(s in SIGNALS for s in _received) else 0)


def agreed(comm: Any) -> int:
    """What any rank of ``comm`` has been signalled to do (collective: one all-reduce):
    0, or the bits ``PREEMPTED`` and ``INTERRUPTED``; true when the run must stop."""
    from mpi4py import MPI

    if comm.Get_size() == 1:
        return _bits()
    return int(comm.allreduce(_bits(), op=MPI.BOR))


def signal_name() -> str:
    return signal.Signals(_received[0]).name if _received else ""


def orte_kill_delay(env: dict | None = None) -> int | None:
    """Seconds from Open MPI's ``mpirun`` receiving Ctrl-C or SIGTERM to its SIGTERM of
    the ranks, and from that to its SIGKILL (``odls_base_sigkill_timeout``, 1 unless set);
    None when the ranks were not started by that ``mpirun`` (``env``: the environment)."""
    env = os.environ if env is None else env
    if ORTE_URI not in env:
        return None
    try:
        return max(0, int(env.get(ORTE_KILL_DELAY, "1")))
    except ValueError:  # mpirun itself refuses such a value
        return None


def stop_time_note(step_s: float, save_s: float, env: dict | None = None) -> str | None:
    """The line rank 0 prints when a stop would be killed before its checkpoint is
    written: under Open MPI's ``mpirun`` run by hand (a terminal's Ctrl-C, ``kill``), a
    rank signalled just as a step begins needs the step (``step_s``), the save
    (``save_s``) and ``EXIT_S`` to leave, and gets ``orte_kill_delay`` seconds; under
    Open MPI 5's (PRRTE) it gets ``PRRTE_KILL_DELAY`` for the step and the save, which no
    setting lengthens, so the note names SIGUSR1 instead. None when that is enough,
    under another launcher, or in a SLURM job (``jobscripts/train.sbatch`` passes
    SIGUSR1 on to its launcher)."""
    env = os.environ if env is None else env
    if "SLURM_JOB_ID" in env:
        return None
    if env.get(PRRTE_MARK) == "1":
        need = step_s + save_s
        if need <= PRRTE_KILL_DELAY:
            return None
        return (f"note: Open MPI 5's mpirun stops a job on Ctrl-C or SIGTERM by sending the "
                f"ranks SIGTERM after {PRRTE_KILL_DELAY} s and SIGKILL {PRRTE_KILL_DELAY} s "
                f"later, times no setting changes; this run needs up to {need:.1f} s to "
                f"finish a step ({step_s:.1f} s) and save ({save_s:.1f} s), so such a stop "
                f"loses the steps since the last checkpoint: stop it with SIGUSR1 to "
                f"mpirun instead (kill -USR1 PID-of-mpirun), which mpirun passes to every "
                f"rank: they save and exit with status {EXIT_PREEMPTED}")
    delay = orte_kill_delay(env)
    need = step_s + save_s + EXIT_S
    if delay is None or need <= delay:
        return None
    advice = max(5, math.ceil(1.5 * need))
    return (f"note: Open MPI's mpirun stops a job on Ctrl-C or SIGTERM by sending the ranks "
            f"SIGTERM after {delay} s and SIGKILL {delay} s later "
            f"(odls_base_sigkill_timeout); this run needs up to {need:.1f} s to finish a "
            f"step ({step_s:.1f} s), save ({save_s:.1f} s) and leave, so such a stop can "
            f"be killed before its checkpoint is written: start mpirun with --mca "
            f"odls_base_sigkill_timeout {advice} (or export "
            f"{ORTE_KILL_DELAY}={advice}; mpirun then takes up to {2 * advice} s to stop)")
