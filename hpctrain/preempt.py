"""Preemption: a signal asks the job to checkpoint at the end of the step and stop.

SLURM sends SIGUSR1 before the time limit (``#SBATCH --signal=USR1@N``) or when told
(``scancel --signal=USR1``); schedulers and ``kill`` send SIGTERM. The handler only
sets a flag, so the signal may arrive anywhere, even inside BLAS or MPI. At the end of
every step the ranks agree with one tiny all-reduce: if any rank was signalled, all
of them save and stop after the *same* step, and ``hpctrain train`` exits with
``EXIT_PREEMPTED`` so the batch script knows to requeue.
"""

from __future__ import annotations

import signal
from typing import Any

EXIT_PREEMPTED = 3
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

_received: list[int] = []


def _handler(signum, _frame) -> None:
    _received.append(signum)


def install() -> None:
    """Catch SIGUSR1 and SIGTERM from now on (call first thing: a signal can come early)."""
    for sig in SIGNALS:
        signal.signal(sig, _handler)


def ignore() -> None:
    """Ignore SIGUSR1 and SIGTERM from now on: the run has ended, nothing is left to save.

    A signal that comes late (``--signal=USR1@N`` as the last step ends) must not kill
    a finished run in its shutdown: Python resets its own handlers to the default, which
    for SIGUSR1 kills the process, but keeps an ignored signal ignored.
    """
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def received() -> bool:
    """Whether this rank has been signalled (local, no communication)."""
    return bool(_received)


def agreed(comm: Any) -> bool:
    """Whether any rank of ``comm`` has been signalled (collective: one all-reduce)."""
    from mpi4py import MPI

    if comm.Get_size() == 1:
        return received()
    return bool(comm.allreduce(int(received()), op=MPI.MAX))


def signal_name() -> str:
    return signal.Signals(_received[0]).name if _received else ""
