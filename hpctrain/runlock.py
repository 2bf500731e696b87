"""One run at a time in a run folder: the lock file ``<run_dir>/hpctrain.lock``.

Two jobs given the same run folder (``RUN_DIR``, ``--run-dir``) would both write its
checkpoints, ``latest`` and ``metrics.jsonl``, each over the other's. ``train`` (and
``cv``, for its folder; each fold's run locks its own) therefore takes the folder's lock
on rank 0 before anything is written there, inside a ``startup_check``, so that every
rank of a refused job exits with one message before any collective of training (in
``train``, within the watchdog's ``check_outputs`` phase: a file system that hangs there
ends the job like any stall); the lock is removed when the run ends, finished, failed,
preempted or interrupted.

The lock is a file created with ``O_CREAT | O_EXCL``: atomic on a local file system,
on NFS (v3 and later) and on Lustre, where ``flock`` is unreliable or switched off
(DEVELOPERS.md, "Facts about HDF5"). It holds one JSON object: the host, the pid and
that process's start time, the SLURM job id, attempt (``SLURM_RESTART_COUNT``) and
cluster if any, the command and the time it started. A lock already there is judged:

    held by a live process                       refused (the folder and the holder named)
    this host, its process gone (or pid reused)  stale: taken over, with a line saying so
    the same SLURM job, a later attempt          a requeue: taken over, with a line
    another SLURM job of this cluster that
      squeue no longer lists (killed on a node)  stale: taken over, with a line
    another host, nothing else known             refused: only the user can tell

A stale lock is taken over under a second, short-lived lock, ``hpctrain.lock.break``
(``_take_over``), so that of jobs starting at once exactly one takes it.

A lock left by a run that died where none of these tell (another host outside SLURM,
or squeue unavailable) is removed by hand once that run is known to be gone; the
refusal says which file and how to check. There is no option to override it: removing
the file is as explicit, and leaves no flag to be copied into job scripts.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from datetime import datetime
from pathlib import Path
from typing import Any

LOCK_NAME = "hpctrain.lock"
BREAK_WAIT_S = 10.0  # another job taking a stale lock over holds <lock>.break for ms
SQUEUE_TIMEOUT_S = 10.0  # a slow slurmctld leaves the lock held, never taken over
# squeue's states of a job that runs no more (anything else: it may still write)
ENDED_STATES = frozenset({"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED",
                          "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT"})


def lock_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / LOCK_NAME


@dataclass(frozen=True)
class Holder:
    """Who holds a run folder: what the lock file records."""

    host: str
    pid: int
    pid_start: str | None  # the process's start time since boot (/proc), for pid reuse
    job_id: str | None  # SLURM_JOB_ID
    attempt: int  # SLURM_RESTART_COUNT: 0, then 1, 2, ... after each requeue
    cluster: str | None  # SLURM_CLUSTER_NAME
    command: str
    started: str  # local time, ISO 8601
    token: str  # this lock's own id: a release removes only its own file

    def describe(self) -> str:
        """``pid 123 on node1, SLURM job 77 attempt 2, hpctrain train since <time>``"""
        job = ""
        if self.job_id:
            job = f", SLURM job {self.job_id}" + (f" attempt {self.attempt}"
                                                  if self.attempt else "")
        return f"pid {self.pid} on {self.host}{job}, hpctrain {self.command} since {self.started}"


def this_process(command: str, env: dict | None = None) -> Holder:
    """The holder this process would write."""
    env = os.environ if env is None else env
    return Holder(host=socket.gethostname(), pid=os.getpid(),
                  pid_start=process_start(os.getpid()), job_id=env.get("SLURM_JOB_ID") or None,
                  attempt=int(env.get("SLURM_RESTART_COUNT") or 0),
                  cluster=env.get("SLURM_CLUSTER_NAME") or None, command=command,
                  started=datetime.now().astimezone().isoformat(timespec="seconds"),
                  token=uuid.uuid4().hex)


def process_start(pid: int) -> str | None:
    """Field 22 of ``/proc/<pid>/stat``, the process's start in clock ticks since boot
    (None: no such process, or no /proc): a pid reused by another process differs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]  # fields 3.. follow the command's ")"


@dataclass
class RunLock:
    """A held run folder; ``release`` removes the lock file if it is still this one's,
    and the folder too if the lock made it and nothing else was put in it (a run that
    failed at its start leaves no empty folder behind)."""

    path: Path
    holder: Holder
    made: bool = False  # the folder was made with the lock

    def release(self) -> None:
        found = _read(self.path)
        if isinstance(found, Holder) and found.token == self.holder.token:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            if self.made:
                try:
                    self.path.parent.rmdir()  # only if empty
                except OSError:
                    pass


def acquire(run_dir: str | Path, command: str = "train",
            say: Callable[[str], None] | None = None, env: dict | None = None) -> RunLock:
    """Take ``run_dir``'s lock for this process (made with the folder if need be), or
    raise a user error naming the folder, the holder and what to do. A stale lock, or
    this SLURM job's own from an earlier attempt, is taken over and ``say`` told so
    (module docstring). Rank 0 alone calls this."""
    from hpctrain.runtime import UserError

    run_dir = Path(run_dir)
    path = lock_path(run_dir)
    me = this_process(command, env)
    made = not run_dir.exists()
    for _ in range(3):  # a racing job may take or free the lock between two looks
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            if _create(path, me):
                return RunLock(path, me, made)
        except OSError as err:  # train's own words for the folder (train._check_outputs)
            raise UserError(f"the run folder (--run-dir) {run_dir}: cannot be made or "
                            f"written to ({err.strerror or err}); choose another") from None
        found = _read(path)
        if found is None:
            continue  # removed in between: try again
        why = _stale(found, me, env)
        if why is None:
            raise UserError(_refusal(run_dir, path, found, me))
        try:
            taken = _take_over(path, found, me)
        except OSError as err:
            raise UserError(f"{path}: the stale lock cannot be replaced "
                            f"({err.strerror or err}); check the folder's space and "
                            f"permissions") from None
        if taken:
            if say is not None:
                say(f"note: {path} was held by {found.describe()}; {why}: taken over")
            return RunLock(path, me)
    raise UserError(f"{path}: other runs kept taking and freeing it; is another job "
                    f"starting in {run_dir}? Run again once it has")


def _create(path: Path, me: Holder) -> bool:
    """Create the lock file with ``me`` in it; False: it exists."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(me), f)
            f.flush()
            os.fsync(f.fileno())  # visible to a job on another node (NFS: at close)
    except BaseException:  # a full disk or quota: no empty lock left to refuse every run
        path.unlink(missing_ok=True)
        raise
    return True


def _read(path: Path) -> Holder | str | None:
    """The holder a lock file names; a string: why it cannot be read (a job writing it
    now, or one killed between creating and writing it); None: no file."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as err:
        return f"cannot be read: {err.strerror or err}"
    try:
        record = json.loads(text)
        return Holder(**{f.name: record[f.name] for f in fields(Holder)})
    except (ValueError, TypeError, KeyError) as err:
        return f"holds no holder ({'empty' if not text else err})"


def _stale(found: Holder | str, me: Holder, env: dict | None) -> str | None:
    """Why the lock ``found`` may be taken over (see the module docstring), or None."""
    if not isinstance(found, Holder):
        return None
    if me.job_id and found.job_id == me.job_id and found.cluster == me.cluster \
            and found.attempt < me.attempt:
        return f"this job was requeued since (attempt {me.attempt} now)"
    if found.host == me.host:
        if found.pid == me.pid and found.pid_start == me.pid_start:
            return None  # this very process holds it: another run in it, not a leftover
        start = process_start(found.pid)
        alive = _alive(found.pid) and (found.pid_start is None or start is None
                                       or start == found.pid_start)
        return None if alive else "that process is gone"
    if found.job_id and found.job_id != me.job_id and found.cluster == me.cluster:
        state = _job_state(found.job_id, env)
        if state == "gone":
            return f"squeue no longer lists job {found.job_id}"
        if state in ENDED_STATES:
            return f"job {found.job_id} has ended ({state})"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _job_state(job_id: str, env: dict | None) -> str | None:
    """squeue's state of a SLURM job: "gone" when it no longer lists the job, None
    when squeue is not there or does not answer (nothing is then concluded)."""
    path = (env if env is not None else os.environ).get("PATH")
    squeue = shutil.which("squeue", path=path)
    if squeue is None:
        return None
    try:
        done = subprocess.run([squeue, "--noheader", "--jobs", job_id, "--format", "%T"],
                              capture_output=True, text=True, timeout=SQUEUE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return "gone" if "Invalid job id" in done.stderr else None
    states = done.stdout.split()
    return states[0] if states else "gone"


def _take_over(path: Path, found: Holder, me: Holder) -> bool:
    """Replace the stale lock ``found`` by ``me``'s; False when another job changed it
    first (the caller looks again). Only the holder of the break file
    ``<lock>.break`` (made with ``O_EXCL``, held for a few milliseconds) removes a lock,
    and only after reading under it that the lock is still ``found``: of jobs taking
    over at once, one does; the others then find its live lock. (Renaming the stale
    file aside and putting back a fresh one found there instead leaves a moment with
    no lock, in which a third job can make its own: two jobs then both held it.)"""
    breaker = path.with_name(f"{path.name}.break")
    waited = time.monotonic() + BREAK_WAIT_S
    while not _create(breaker, me):
        if time.monotonic() > waited:
            from hpctrain.runtime import UserError
            holder = _read(breaker)
            who = holder.describe() if isinstance(holder, Holder) else "a run"
            raise UserError(
                f"{breaker} has been there for over {BREAK_WAIT_S:g} s: {who} was taking "
                f"over the stale lock {path} and ended before it had. If no run is "
                f"starting in {path.parent}, remove {breaker} and run again")
        time.sleep(0.02)
    try:
        now = _read(path)
        if not (isinstance(now, Holder) and now.token == found.token):
            return False  # taken over (or freed) by another job before this one got here
        path.unlink()
        return _create(path, me)  # False: a job starting afresh made it in between
    finally:
        breaker.unlink(missing_ok=True)


def _refusal(run_dir: Path, path: Path, found: Holder | str, me: Holder) -> str:
    if not isinstance(found, Holder):
        return (f"{run_dir} is locked by {path}, which {found}: another run may be starting "
                f"there. Give another --run-dir, or, if no run uses the folder, remove "
                f"{path} and run again")
    what = (f"{run_dir} is in use by another run ({found.describe()}): two runs in one "
            f"folder overwrite each other's checkpoints and metrics. Wait for it to end, or "
            f"give another --run-dir")
    if found.host == me.host:  # once its process is gone, the next run takes it over
        return what
    check = (f"`squeue --jobs {found.job_id}` lists nothing" if found.job_id
             else f"no process {found.pid} on {found.host}")
    return f"{what}; if that run is gone ({check}), remove {path} and run again"


@contextmanager
def held(comm: Any, run_dir: str | Path, command: str = "train",
         say: Callable[[str], None] | None = None) -> Iterator[RunLock | None]:
    """Hold ``run_dir`` for the body (collective over ``comm``): rank 0 takes the lock,
    every rank learns the verdict (``runtime.startup_check``: a refusal exits every
    rank with status 2), and rank 0 removes the lock when the body ends, however."""
    lock = take(comm, run_dir, command, say)
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()


def take(comm: Any, run_dir: str | Path, command: str = "train",
         say: Callable[[str], None] | None = None) -> RunLock | None:
    """Rank 0 takes ``run_dir``'s lock (its ``RunLock``; None on the other ranks), every
    rank learns the verdict (collective: ``runtime.startup_check``, a refusal exits every
    rank with status 2). The caller releases it (``held`` does)."""
    from hpctrain.runtime import startup_check

    return startup_check(comm, lambda: acquire(run_dir, command, say)
                         if comm.Get_rank() == 0 else None)
