"""``runtime.finalize_on_exit``: a job whose work is done ends even when MPI_Finalize
does not return, with the command's status and a line that says why.

Under ``mpiexec`` (serial suite: each test starts its own job). ``finalize_job.py``
makes one rank reach MPI_Finalize late; the others' finalize waits for it, as it waits
for a rank stuck in UCX's TCP teardown (DEVELOPERS.md). Without the bound the job lasts
as long as the late rank sleeps, past the test's timeout."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpctrain.runtime import FINALIZE_TIMEOUT_ENV, exit_status
from hpctrain.testing import run_mpi

JOB = Path(__file__).with_name("finalize_job.py")


def test_a_finalize_that_does_not_return_ends_the_job_with_its_status():
    start = time.monotonic()
    result = run_mpi(2, [sys.executable, str(JOB), "--timeout", "2", "--late", "1",
                         "--sleep", "120", "--status", "3"], timeout=60)
    took = time.monotonic() - start
    assert "rank 1 late by 120 s" in result.stderr, result.stderr
    assert ("[rank 0] MPI_Finalize has not returned after 2 s; exiting with status 3 "
            "without it") in result.stderr, result.stderr
    assert result.returncode == 3, result.stderr  # preempted: the job script requeues
    assert took < 30, took


def test_an_error_on_one_rank_outside_abort_on_error_ends_the_job():
    """The other rank waits in the last collectives (meet_before_finalize) for the one
    that raised: without an abort the job hung for good (cv writing its result)."""
    start = time.monotonic()
    result = run_mpi(2, [sys.executable, str(JOB), "--timeout", "30", "--crash", "1"],
                     timeout=60)
    assert result.returncode == 1, result.stderr
    assert "[rank 1] RuntimeError: an error outside abort_on_error" in result.stderr, \
        result.stderr
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("stuck, ranks, says", [
    (1, 2, "[rank 0] the command ended on this rank (status 0), but rank 1 has not come "
           "to the end after 2 s"),
    (2, 4, "[rank 0] the command ended on this rank (status 0), but rank 2 has not come "
           "to the end after 2 s"),
    (0, 2, "[rank 1] the command ended on this rank (status 0), but rank 0 has not come "
           "to the end after 4 s")])
def test_a_rank_that_never_comes_to_the_end_is_named_and_the_job_ends(stuck, ranks, says):
    """The others wait for it in their last collectives: without a bound the job hung
    for as long as it was stuck (a rank stuck after train's watchdog stopped)."""
    start = time.monotonic()
    result = run_mpi(ranks, [sys.executable, str(JOB), "--timeout", "2", "--stuck", str(stuck),
                             "--sleep", "120"], timeout=60)
    took = time.monotonic() - start
    assert f"rank {stuck} stuck for 120 s" in result.stderr, result.stderr
    assert says in result.stderr, result.stderr
    assert result.returncode == 5, result.stderr  # watchdog.EXIT_STALLED: not a success
    assert took < 30, took


def test_a_finalize_that_returns_keeps_the_status_and_says_nothing():
    for status in (0, 3):
        result = run_mpi(2, [sys.executable, str(JOB), "--timeout", "20",
                             "--status", str(status)], timeout=60)
        assert result.returncode == status, result.stderr
        assert "MPI_Finalize" not in result.stderr, result.stderr


@pytest.mark.parametrize("value", ["soon", "0", "-5"])
def test_a_bad_finalize_timeout_is_refused_by_name(tmp_path, value):
    result = subprocess.run(
        [str(Path(sys.executable).with_name("hpctrain")), "train", "--config",
         str(tmp_path / "none.toml")], capture_output=True, text=True, timeout=60,
        env={**os.environ, FINALIZE_TIMEOUT_ENV: value})
    assert result.returncode == 2, result.stderr
    assert (f"error: {FINALIZE_TIMEOUT_ENV} ({value!r}) must be a number of seconds > 0"
            in result.stderr), result.stderr


def test_exit_status_as_python_gives_it():
    assert [exit_status(c) for c in (None, 0, 3, 130, "a message")] == [0, 0, 3, 130, 1]


# MPICH's hydra before 4.1 turns a rank's status into 0 when it collects it only after
# the rank's output closed, once it had passed a signal on (runtime.keep_status_for_hydra;
# the preemption and Ctrl-C tests of test_preempt.py failed that way under Debian's MPICH)
HELD = ("import os, sys; from hpctrain.runtime import keep_status_for_hydra; "
        "keep_status_for_hydra(int(sys.argv[1])); os._exit(int(sys.argv[1]))")


def state_when_output_closes(status: int, env: dict) -> str:
    """The process state (/proc) of a child that exits with ``status`` at the moment its
    stdout reaches end of file, before anyone reaps it."""
    child = subprocess.Popen([sys.executable, "-c", HELD, str(status)],
                             stdout=subprocess.PIPE, env={**os.environ, **env})
    child.stdout.read()
    with open(f"/proc/{child.pid}/stat") as stat:
        state = stat.read().rsplit(")", 1)[1].split()[0]
    assert child.wait(timeout=30) == status
    return state


def test_under_hydra_a_failed_rank_holds_its_output_until_its_status_is_there():
    # without the holder the output often closes while the process is still exiting ("R"
    # one run in three to one in two here; 20 runs); the proxy then collects the status
    # too late
    states = [state_when_output_closes(3, {"MPI_LOCALNRANKS": "1"}) for _ in range(20)]
    assert states == ["Z"] * 20, states


def test_the_holder_is_only_for_a_failed_rank_under_hydra(monkeypatch):
    import subprocess as sp

    from hpctrain import runtime

    started = []
    monkeypatch.setattr(sp, "Popen", lambda *a, **k: started.append(a))
    monkeypatch.delenv("MPI_LOCALNRANKS", raising=False)
    runtime.keep_status_for_hydra(3)  # srun, mpirun: nothing to hold
    monkeypatch.setenv("MPI_LOCALNRANKS", "2")
    runtime.keep_status_for_hydra(0)  # a status 0 cannot be lost
    assert started == []
    runtime.keep_status_for_hydra(130)
    assert len(started) == 1
