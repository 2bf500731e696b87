"""Stalled and failing jobs under ``mpiexec``: one rank sleeps inside a step or a
phase of the start-up (``watchdog_job.py``, a real ``time.sleep`` inside
``hpctrain.train.train``, nothing of MPI replaced); the job must end within the stall
timeout plus 10 s with a non-zero status, and rank 0's message must name the sleeping
rank and the operation the others wait in. Without the watchdog these jobs sleep until
the subprocess timeout: a failure, not a hang. One rank that exits alone
(``SystemExit``) or whose ZeRO 3 helper thread raises ends the job too, named.

Serial suite: each test launches its own ``mpiexec`` (never from inside an MPI test)."""

import os
import re
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hpctrain.nn import kernels as nn_kernels
from hpctrain.runtime import EXIT_CRASH
from hpctrain.testing import run_mpi, tiny_corpus_config

CONFIG = textwrap.dedent("""
    [model]
    dtype = "float64"
    seq_len = 16
    n_layer = 2
    n_head = 2
    d_model = 32

    [train]
    steps = 5
    batch_size = 8
    eval_interval = {eval_interval}
    eval_batches = 1

    [data]
    path = "{{data}}"
""")
JOB = Path(__file__).with_name("watchdog_job.py")
# the status of MPI_Abort is the job's under the pip MPICH; Debian's MPICH 4.0 hydra may
# return 9 instead, the SIGKILL of the ranks it killed (DEVELOPERS.md): there, non-zero
EXACT_STATUS = os.environ.get("HPCTRAIN_EXPECT_MPI") != "mpich"


def ended_with(code: int, status: int) -> bool:
    """Whether the job's status ``code`` is the abort's ``status`` (as exactly as the
    launcher reports it)."""
    return code == status if EXACT_STATUS else code != 0
SLEEP = 90.0  # seconds the stalled rank sleeps: longer than any test waits


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """(no evaluation, evaluation after every step)."""
    # the jobs' kernel load is timed against stall timeouts of 2-3 s: a cold numba cache
    # compiles for about 6 s at 4 ranks on 2 cores, so it is compiled here, once
    nn_kernels.load("float64")
    folder = tmp_path_factory.mktemp("watchdog")
    line = "to be, or not to be, that is the question."
    plain = tiny_corpus_config(folder, CONFIG.format(eval_interval=0), line, 400)
    evaluated = plain.with_name("eval.toml")
    evaluated.write_text(plain.read_text().replace("eval_interval = 0", "eval_interval = 1"))
    return plain, evaluated


def stall(config, run_dir, ranks, *, timeout, rank, at, where, sleep=SLEEP, layout=(),
          exit=None):
    """Run the job (``exit``: that status instead of the sleep); returns (returncode,
    stderr, seconds from the sleep, exit or failure to the end)."""
    args = [sys.executable, str(JOB), str(config), str(run_dir), "--stall-timeout",
            str(timeout), "--rank", str(rank), "--at", str(at), "--sleep", str(sleep),
            "--where", where, *layout, *(() if exit is None else ("--exit", str(exit)))]
    result = run_mpi(ranks, args, timeout=60)
    ended = time.time()
    began = re.search(r"(?:sleeping|exiting|failing) at ([0-9.]+)", result.stderr)
    assert began, result.stderr
    return result.returncode, result.stderr, ended - float(began.group(1))


@pytest.mark.parametrize("layout, where, stalled, lines", [
    (("--dp", "4"), "data", 2, [
        "ranks 0, 1, 3 wait in dp_wait (gradient reduction over the data group) for rank 2",
        "rank 2 has not arrived: it is in data (step 3), not in a communication, at "
        "watchdog_job.py"]),
    (("--dp", "2", "--tp", "2"), "forward", 2, [
        "ranks 0, 1 wait in dp_wait (gradient reduction over the data group) for ranks 2, 3",
        "rank 3 waits in all_reduce (all-reduce over the tensor group) during F (mb 0, "
        "chunk 0) for rank 2",
        "rank 2 has not arrived: it is in F (mb 0, chunk 0) (step 3), not in a "
        "communication"]),
    (("--dp", "2", "--pp", "2"), "forward", 3, [
        "ranks 0, 2 wait in dp_wait (gradient reduction over the data group) for ranks 1, 3",
        "rank 1 waits in recv_backward (receive of a gradient over the pipeline group) "
        "for rank 3",
        "rank 3 has not arrived: it is in F (mb 0, chunk 1) (step 3), not in a "
        "communication"]),
], ids=["dp4-data", "dp2tp2-forward", "dp2pp2-forward"])
def test_a_rank_sleeping_in_a_step_of_4_is_named_and_the_job_ends(configs, tmp_path, layout,
                                                                    where, stalled, lines):
    timeout = 3.0
    code, err, seconds = stall(configs[0], tmp_path / "run", 4, timeout=timeout,
                               rank=stalled, at=3, where=where, layout=layout)
    assert code != 0, err
    assert seconds <= timeout + 10, (seconds, err)
    assert "stall: step 3 has not completed after" in err, err
    for line in lines:
        assert f"  {line}" in err, err
    assert re.search(rf"^  rank {stalled} \(.*\): step 3, ", err, re.M), err  # its own line


def test_rank_0_sleeping_after_a_step_is_found_by_its_own_watchdog(configs, tmp_path):
    # between steps no span is open: the ranks are told apart by their Python frames
    code, err, seconds = stall(configs[1], tmp_path / "run", 4, timeout=2.0, rank=0, at=2,
                               where="eval")
    assert code != 0 and seconds <= 2.0 + 10, (seconds, err)
    assert "stall: the work after step 2 (metrics, evaluation" in err, err
    assert "  ranks 1, 2, 3 are after step 2, at hpctrain/train.py" in err, err
    assert "in mean_over" in err and "  rank 0 has not arrived: it is after step 2, not in " \
        "a traced communication, at watchdog_job.py" in err, err


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_rank_stuck_opening_the_data_is_named_and_the_job_ends(configs, tmp_path, ranks):
    # before the first step: the others wait in startup_check's allgather for good
    code, err, seconds = stall(configs[0], tmp_path / "run", ranks, timeout=2.0, rank=1,
                               at=1, where="open")
    assert code != 0 and seconds <= 2.0 + 10, (seconds, err)
    assert "stall: the start-up (opening the data) has not completed after" in err, err
    assert re.search(r"^  rank 1 \(.*\): start-up, .*: open_data \| watchdog_job.py", err,
                     re.M), err
    waiting = "rank 0 waits" if ranks == 2 else "ranks 0, 2, 3 wait"
    assert (f"  {waiting} in startup_check (agreement on the start-up's errors over every "
            f"rank) during open_data for rank 1") in err, err
    assert "  rank 1 has not arrived: it is in open_data (start-up), not in a traced " \
        "communication, at watchdog_job.py" in err, err


@pytest.mark.parametrize("where, ranks, phase, waiting, late", [
    ("outputs", 2, "checking the run's output folders",
     "rank 1 waits in startup_check (agreement on the start-up's errors over every rank) "
     "during check_outputs for rank 0",
     "it is in check_outputs (start-up), not in a traced communication"),
    ("kernels", 4, "loading the compiled kernels",
     "ranks 1, 2, 3 wait in startup_check (agreement on the start-up's errors over every "
     "rank) during open_data for rank 0",
     "it is still in load_kernels (start-up)"),
], ids=["outputs-2", "kernels-4"])
def test_rank_0_stuck_before_the_data_is_opened_is_named_and_the_job_ends(
        configs, tmp_path, where, ranks, phase, waiting, late):
    # rank 0's check of the run folder and every rank's kernel load came before the
    # watchdog started: the others waited for rank 0 in the first collective for good
    code, err, seconds = stall(configs[0], tmp_path / "run", ranks, timeout=2.0, rank=0,
                               at=1, where=where)
    # non-zero, not the abort's 5: Debian's MPICH 4.0 hydra returned 9 here once, the
    # SIGKILL of the ranks it killed (DEVELOPERS.md, "comm.Abort(5) from a helper thread")
    assert code != 0 and seconds <= 2.0 + 10, (code, seconds, err)
    assert f"stall: the start-up ({phase}) has not completed after" in err, err
    assert f"  {waiting}" in err, err
    assert f"  rank 0 has not arrived: {late}, at watchdog_job.py" in err, err


@pytest.mark.parametrize("rank", [1, 0])
def test_a_rank_exiting_alone_mid_run_is_named_with_its_status_and_the_job_ends(
        configs, tmp_path, rank):
    # a SystemExit on one rank: the others wait for it in the gradient reduction. Its
    # watchdog told rank 0 as it left (not "did not answer" after the stall timeout),
    # so the job ends well within the 20 s stall timeout, with the exit's status
    code, err, seconds = stall(configs[0], tmp_path / "run", 4, timeout=20.0, rank=rank,
                               at=3, where="data", layout=("--dp", "4"), exit=7)
    assert ended_with(code, 7) and seconds < 20, (code, seconds, err)
    assert (f"exit: rank {rank} left the run alone (a SystemExit) while the other ranks are "
            f"still in it; ending the job") in err, err
    others = ", ".join(str(r) for r in range(4) if r != rank)
    assert (f"  ranks {others} wait in dp_wait (gradient reduction over the data group) "
            f"for rank {rank}") in err, err
    assert (f"  rank {rank} has left the run: it exited with status 7 (SystemExit) in "
            f"step 3, at watchdog_job.py") in err, err
    assert "did not answer" not in err and "stall:" not in err, err


def test_an_error_in_zero3s_helper_thread_ends_the_job_with_the_rank(configs, tmp_path):
    # it was printed by Python's thread hook, without a rank, and training went on
    # without the helper, the job's status 0
    code, err, seconds = stall(configs[0], tmp_path / "run", 2, timeout=3.0, rank=1, at=3,
                               where="helper", layout=("--dp", "2", "--zero", "3"))
    assert ended_with(code, EXIT_CRASH) and seconds <= 10, (code, seconds, err)
    assert ("[rank 1] hpctrain.parallel.data.HelperError: ZeRO 3's helper thread, which "
            "moves the parameter gathers and gradient reduce-scatters, failed: "
            "RuntimeError: the helper's test of a gather fails on purpose") in err, err
    assert "[rank 1] RuntimeError: the helper's test of a gather fails on purpose" in err
    assert "Exception in thread" not in err, err


def test_an_error_in_the_bucket_helper_thread_ends_the_job_with_the_rank(configs, tmp_path):
    # it was printed by Python's thread hook, without a rank, and the step went on: the
    # bucket being launched was never summed, the replicas' gradients apart
    code, err, seconds = stall(configs[0], tmp_path / "run", 2, timeout=3.0, rank=1, at=3,
                               where="buckets", layout=("--dp", "2"))
    assert ended_with(code, EXIT_CRASH) and seconds <= 10, (code, seconds, err)
    assert ("[rank 1] hpctrain.parallel.data.HelperError: the data-parallel reduction's "
            "helper thread, which launches and moves the gradient buckets' sums, failed: "
            "RuntimeError: the helper's launch of a bucket fails on purpose") in err, err
    assert "Exception in thread" not in err, err


def test_a_rank_stuck_after_the_last_step_is_named_and_the_job_ends(configs, tmp_path):
    # the last save, the trace and the loader's close come after the loop; the other
    # ranks wait for it in the meeting at the end of the run, still watched (before,
    # they had left their run and its watchdog, and waited in the finalize for good)
    code, err, seconds = stall(configs[0], tmp_path / "run", 4, timeout=2.0, rank=2, at=1,
                               where="close")
    assert code != 0 and seconds <= 2.0 + 10, (seconds, err)
    assert "stall: the work after step 5 (metrics, evaluation, checkpoint, preemption " \
        "check, the end of the run) has not completed after" in err, err
    assert "ranks 0, 1, 3 wait in end_of_run (the ranks' meeting at the end of the run " \
        "over every rank) for rank 2" in err, err
    assert re.search(r"^  rank 2 \(.*\): after step 5, .* \| watchdog_job.py:\d+ in slow",
                     err, re.M), err


def test_a_slow_step_under_the_timeout_completes(configs, tmp_path):
    code, err, _ = stall(configs[0], tmp_path / "run", 2, timeout=4.0, rank=1, at=2,
                         where="data", sleep=1.5)
    assert code == 0, err
    assert "stall" not in err.replace("--stall-timeout", ""), err


def test_timeout_0_disables_the_watchdog(configs, tmp_path):
    code, err, seconds = stall(configs[0], tmp_path / "run", 2, timeout=0, rank=1, at=2,
                               where="data", sleep=4.0)
    assert code == 0 and seconds >= 4.0, err  # a 1 s timeout, the least, would have fired
    assert "stall:" not in err, err
