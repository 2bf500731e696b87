"""One run at a time in a run folder (``hpctrain.runlock``): the lock's verdicts on its
own, then real ``hpctrain train`` and ``cv`` processes sharing a folder."""

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpctrain import preempt, runlock
from hpctrain.metrics import read_metrics
from hpctrain.runtime import UserError
from hpctrain.testing import run_train, tiny_corpus_config, tiny_dlrm_config, tiny_gpt_template

HOST = socket.gethostname()


def holder(**fields) -> dict:
    """A lock file's contents: this host, a pid that is no process, no SLURM."""
    return {"host": HOST, "pid": 2**22 + 1, "pid_start": None, "job_id": None,
            "attempt": 0, "cluster": None, "command": "train",
            "started": "2026-12-06T10:00:00+00:00", "token": "theirs", **fields}


def write_lock(folder: Path, **fields) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = runlock.lock_path(folder)
    path.write_text(json.dumps(holder(**fields)))
    return path


@pytest.fixture
def sleeper():
    """A live process of this host that is not this one."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def no_slurm(tmp_path, **env) -> dict:
    """An environment outside SLURM whose PATH finds no squeue but a fake one, if given."""
    return {"PATH": str(tmp_path / "bin"), **env}


def fake_squeue(tmp_path, out: str, err: str = "", status: int = 0) -> None:
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    script = bin_ / "squeue"
    script.write_text(f"#!/bin/sh\nprintf '{out}'\nprintf '{err}' >&2\nexit {status}\n")
    script.chmod(0o755)


# ---------------------------------------------------------------------------------
# the verdicts, in one process


def test_a_free_folder_is_taken_with_the_holder_recorded_and_released(tmp_path):
    lock = runlock.acquire(tmp_path / "new" / "run", "train", env=no_slurm(tmp_path))
    found = json.loads(lock.path.read_text())
    assert found["host"] == HOST and found["pid"] == os.getpid() and found["job_id"] is None
    assert found["pid_start"] == runlock.process_start(os.getpid()) is not None
    lock.release()
    assert not lock.path.exists()


def test_a_folder_the_lock_made_goes_with_it_when_nothing_was_written(tmp_path):
    # a run that failed at its start (no such dataset) left an empty run folder
    env = no_slurm(tmp_path)
    made = tmp_path / "new"
    runlock.acquire(made, env=env).release()
    assert not made.exists()
    lock = runlock.acquire(made, env=env)
    (made / "metrics.jsonl").write_text("{}\n")
    lock.release()
    assert (made / "metrics.jsonl").exists() and not lock.path.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    runlock.acquire(empty, env=env).release()
    assert empty.is_dir()  # the user's own folder stays


def test_a_live_holder_is_refused_with_the_folder_and_holder_named(tmp_path, sleeper):
    path = write_lock(tmp_path, pid=sleeper.pid, job_id="77", attempt=2)
    with pytest.raises(UserError) as err:
        runlock.acquire(tmp_path, env=no_slurm(tmp_path))
    message = str(err.value)
    assert message.startswith(f"{tmp_path} is in use by another run (pid {sleeper.pid} on "
                              f"{HOST}, SLURM job 77 attempt 2, hpctrain train since "
                              f"2026-12-06T10:00:00+00:00)"), message
    assert "Wait for it to end, or give another --run-dir" in message
    assert json.loads(path.read_text())["token"] == "theirs"  # untouched


def test_a_holder_on_this_host_whose_process_is_gone_is_taken_over(tmp_path):
    write_lock(tmp_path, pid=dead_pid())
    said = []
    lock = runlock.acquire(tmp_path, say=said.append, env=no_slurm(tmp_path))
    assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    assert len(said) == 1 and said[0].startswith(f"note: {lock.path} was held by pid ")
    assert said[0].endswith("; that process is gone: taken over")
    assert not list(tmp_path.glob("*.break"))


def test_a_pid_reused_by_another_process_is_no_holder(tmp_path, sleeper):
    write_lock(tmp_path, pid=sleeper.pid, pid_start="1")  # that pid, started at another time
    said = []
    runlock.acquire(tmp_path, say=said.append, env=no_slurm(tmp_path))
    assert "that process is gone" in said[0]


def test_a_requeued_slurm_job_takes_its_own_lock_over_from_any_host(tmp_path):
    write_lock(tmp_path, host="node-a", pid=123, job_id="4242", attempt=0)
    said = []
    lock = runlock.acquire(tmp_path, say=said.append,
                           env=no_slurm(tmp_path, SLURM_JOB_ID="4242", SLURM_RESTART_COUNT="1"))
    assert json.loads(lock.path.read_text())["attempt"] == 1
    assert said[0].endswith("this job was requeued since (attempt 1 now): taken over")


@pytest.mark.parametrize("env", [
    {"SLURM_JOB_ID": "4242"},  # the same attempt: another step of this job, maybe live
    {"SLURM_JOB_ID": "4243"},  # another job, and no squeue to ask
    {},  # outside SLURM
])
def test_a_lock_of_another_host_that_nothing_shows_gone_is_refused(tmp_path, env):
    path = write_lock(tmp_path, host="node-a", pid=123, job_id="4242")
    with pytest.raises(UserError) as err:
        runlock.acquire(tmp_path, env=no_slurm(tmp_path, **env))
    assert str(err.value).endswith(f"if that run is gone (`squeue --jobs 4242` lists "
                                   f"nothing), remove {path} and run again"), err.value


@pytest.mark.parametrize("out, err, status, taken", [
    ("", "slurm_load_jobs error: Invalid job id specified\\n", 1, True),
    ("", "", 0, True),  # no longer listed
    ("COMPLETED\\n", "", 0, True),
    ("RUNNING\\n", "", 0, False),
    ("COMPLETING\\n", "", 0, False),  # its processes may still write
    ("", "slurm_load_jobs error: Unable to contact slurm controller\\n", 1, False),
])
def test_squeue_tells_whether_another_jobs_lock_is_stale(tmp_path, out, err, status, taken):
    fake_squeue(tmp_path, out, err, status)
    write_lock(tmp_path / "run", host="node-a", pid=123, job_id="4242")
    said = []
    acquire = lambda: runlock.acquire(tmp_path / "run", say=said.append,  # noqa: E731
                                      env=no_slurm(tmp_path, SLURM_JOB_ID="5000"))
    if taken:
        acquire()
        assert "job 4242" in said[0] and said[0].endswith("taken over")
    else:
        with pytest.raises(UserError, match="is in use by another run"):
            acquire()


def test_a_lock_without_a_holder_is_refused_with_its_removal(tmp_path):
    (tmp_path / runlock.LOCK_NAME).write_text("")  # a job killed between create and write
    with pytest.raises(UserError, match=r"which holds no holder \(empty\): another run may "
                                        r"be starting there.*remove .*hpctrain.lock"):
        runlock.acquire(tmp_path, env=no_slurm(tmp_path))


def test_a_lock_that_cannot_be_written_whole_is_not_left_empty(tmp_path):
    """The lock file is made, then its holder written: a write that fails there (a full
    disk or quota; here the file size limit, EFBIG) left an empty lock, and every later
    run was refused until it was removed by hand."""
    script = (
        "import resource, signal, sys\n"
        "from hpctrain import runlock\n"
        "from hpctrain.runtime import UserError\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (16, 16))\n"
        "try:\n"
        "    runlock.acquire(sys.argv[1], env={'PATH': ''})\n"
        "except UserError as err:\n"
        "    print(err)\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "cannot be made or written to (File too large)" in done.stdout, done.stdout
    assert not runlock.lock_path(tmp_path).exists()
    runlock.acquire(tmp_path, env=no_slurm(tmp_path)).release()  # the next run takes it


def test_release_leaves_a_lock_another_run_has_taken(tmp_path):
    lock = runlock.acquire(tmp_path, env=no_slurm(tmp_path))
    lock.path.unlink()  # removed by hand while it ran, and taken by another run
    write_lock(tmp_path, host="node-b")
    lock.release()
    assert json.loads(lock.path.read_text())["host"] == "node-b"


def _race(folder: str, start, results, done) -> None:
    start.wait()
    try:
        runlock.acquire(folder, env={"PATH": ""})
        results.put("taken")
    except UserError:
        results.put("refused")
    done.wait(60)  # a winner stays alive: a lock whose process is gone is stale


def test_of_processes_racing_for_a_free_or_stale_folder_exactly_one_wins(tmp_path):
    # 40 rounds of 8 racers: taking a stale lock over by renaming it aside and putting
    # back a fresh one found there gave two winners in about 1 round of 9 here
    ctx = multiprocessing.get_context("fork")
    for round_ in range(40):
        stale = round_ > 0
        folder = tmp_path / f"round{round_}"
        if stale:
            write_lock(folder, pid=dead_pid())
        start, results, done = ctx.Event(), ctx.Queue(), ctx.Event()
        procs = [ctx.Process(target=_race, args=(str(folder), start, results, done))
                 for _ in range(8)]
        for p in procs:
            p.start()
        start.set()
        try:
            verdicts = sorted(results.get(timeout=60) for _ in procs)
        finally:
            done.set()
            for p in procs:
                p.join(timeout=60)
        assert verdicts == ["refused"] * 7 + ["taken"], (stale, verdicts)
        assert not list(folder.glob("*.break"))


def test_a_break_file_left_by_a_dead_takeover_is_named_after_the_wait(tmp_path, monkeypatch):
    write_lock(tmp_path, pid=dead_pid())
    write_lock(tmp_path, pid=dead_pid()).rename(tmp_path / "hpctrain.lock.break")
    write_lock(tmp_path, pid=dead_pid())
    monkeypatch.setattr(runlock, "BREAK_WAIT_S", 0.2)
    with pytest.raises(UserError, match=r"hpctrain.lock.break has been there for over 0.2 s: "
                                        r"pid \d+ on .* was taking over the stale lock .*"
                                        r"remove .*hpctrain.lock.break and run again"):
        runlock.acquire(tmp_path, env=no_slurm(tmp_path))
    assert json.loads((tmp_path / "hpctrain.lock").read_text())["token"] == "theirs"


# ---------------------------------------------------------------------------------
# real runs


CONFIG = tiny_gpt_template(train="steps = 20000\nbatch_size = 8\nsave_interval = 50")


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    return tiny_corpus_config(tmp_path_factory.mktemp("runlock"), CONFIG,
                              "a plague on both your houses.", 300)


def train_cmd(config, run_dir, *flags):
    return [sys.executable, "-m", "hpctrain.cli", "train", "--config", str(config),
            "--run-dir", str(run_dir), *flags]


def run_serial(config, run_dir, *flags, env=None):
    return subprocess.run(train_cmd(config, run_dir, *flags), capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.mark.slow
def test_a_second_train_in_a_live_runs_folder_is_refused_and_the_first_goes_on(
        config_file, tmp_path):
    run_dir = tmp_path / "run"
    first = subprocess.Popen(train_cmd(config_file, run_dir), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 60
        while not (metrics.exists() and len(read_metrics(metrics)) >= 60):  # one saved
            assert time.monotonic() < deadline and first.poll() is None, first.communicate()
            time.sleep(0.05)
        config_json = (run_dir / "config.json").read_bytes()
        # two ranks, resuming from the first's checkpoints as a requeue would: every rank
        # refused before any collective, with one line, and nothing written
        second = run_train(2, config_file, run_dir, "--resume", "auto", timeout=60)
        assert second.returncode == 2, (second.stdout, second.stderr)
        assert second.stderr.count("error") == 1 and \
            f"(rank 0): {run_dir} is in use by another run (pid {first.pid} on {HOST}" \
            in second.stderr, second.stderr
        assert first.poll() is None  # still training
        assert (run_dir / "config.json").read_bytes() == config_json
        first.send_signal(signal.SIGUSR1)  # preempted: saves, exits 3, frees the folder
        out, err = first.communicate(timeout=60)
    finally:
        first.kill()
    assert first.returncode == preempt.EXIT_PREEMPTED, err
    steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]
    assert steps == list(range(1, len(steps) + 1)), "the first run's records were disturbed"
    assert not runlock.lock_path(run_dir).exists()
    # and now the folder is free: the run continues
    again = run_serial(config_file, run_dir, "--resume", "auto", "--steps", str(steps[-1] + 2))
    assert again.returncode == 0, again.stderr
    assert not runlock.lock_path(run_dir).exists()


def test_a_stale_lock_is_taken_over_and_removed_at_the_end(config_file, tmp_path):
    run_dir = tmp_path / "run"
    write_lock(run_dir, pid=dead_pid())
    done = run_serial(config_file, run_dir, "--steps", "2")
    assert done.returncode == 0, done.stderr
    assert f"note: {runlock.lock_path(run_dir)} was held by pid " in done.stdout
    assert "that process is gone: taken over" in done.stdout, done.stdout
    assert not runlock.lock_path(run_dir).exists()


def test_a_requeued_job_takes_its_own_lock_over_and_another_job_is_refused(config_file,
                                                                          tmp_path):
    run_dir = tmp_path / "run"
    done = run_serial(config_file, run_dir, "--steps", "50")  # the first attempt's save
    assert done.returncode == 0, done.stderr
    write_lock(run_dir, host="node-a", pid=123, job_id="4242")  # killed on node-a
    other = run_serial(config_file, run_dir, "--steps", "52", "--resume", "auto",
                       env={"SLURM_JOB_ID": "4243"})
    assert other.returncode == 2 and f"{run_dir} is in use by another run (pid 123 on " \
        f"node-a, SLURM job 4242" in other.stderr, other.stderr
    requeued = run_serial(config_file, run_dir, "--steps", "52", "--resume", "auto",
                          env={"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "1"})
    assert requeued.returncode == 0, requeued.stderr
    assert "this job was requeued since (attempt 1 now): taken over" in requeued.stdout
    assert "resumed from" in requeued.stdout
    assert not runlock.lock_path(run_dir).exists()


def test_the_lock_is_removed_when_the_run_fails(config_file, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(config_file.read_text().replace("corpus.h5", "missing.h5"))
    write_lock(tmp_path / "run", pid=dead_pid())  # taken over, then removed
    failed = run_serial(bad, tmp_path / "run", "--steps", "2")
    assert failed.returncode == 2 and "missing.h5" in failed.stderr, failed.stderr
    assert "taken over" in failed.stdout, failed.stdout
    assert not runlock.lock_path(tmp_path / "run").exists()


def test_the_lock_is_removed_when_train_raises_in_process(config_file, tmp_path):
    from mpi4py import MPI

    from hpctrain import config as config_mod
    from hpctrain.train import train

    cfg = config_mod.load(str(config_file), {"train.run_dir": str(tmp_path / "run"),
                                             "train.steps": 2}).validate(1)
    held = []

    def fail():
        held.append(json.loads(runlock.lock_path(tmp_path / "run").read_text())["pid"])
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        train(cfg, MPI.COMM_SELF, quiet=True, after_step=fail)
    assert held == [os.getpid()]  # held while it ran
    assert not runlock.lock_path(tmp_path / "run").exists()
    summary = train(cfg, MPI.COMM_SELF, quiet=True, resume="auto")  # not held any more
    assert len(summary.losses) == 2


def test_cv_holds_its_folder(tmp_path, ratings_h5, sleeper):
    from click.testing import CliRunner

    from hpctrain.cli import main

    config = tiny_dlrm_config(tmp_path / "dlrm.toml", ratings_h5,
                              "steps = 2\nbatch_size = 8\neval_interval = 2")
    run_dir = tmp_path / "cv"
    write_lock(run_dir, pid=sleeper.pid, command="cv")
    args = ["cv", "--config", str(config), "--folds", "2", "--run-dir", str(run_dir)]
    refused = CliRunner().invoke(main, args)
    assert refused.exit_code == 2, refused.output
    assert f"{run_dir} is in use by another run (pid {sleeper.pid} on {HOST}, hpctrain cv " \
        in refused.output, refused.output
    assert not (run_dir / "fold0").exists()
    sleeper.kill()
    sleeper.wait()
    taken = CliRunner().invoke(main, args)
    assert taken.exit_code == 0, taken.output
    assert "that process is gone: taken over" in taken.output
    assert (run_dir / "cv.json").is_file()
    assert not list(run_dir.rglob(runlock.LOCK_NAME))  # its own and the folds'
