"""Preemption without SLURM: SIGUSR1 to one rank of an mpiexec job makes every rank
stop after the same step with a checkpoint, exit 3, and a resumed run ends with the
loss curve of an uninterrupted one, bitwise. Ctrl-C stops the same way with status
130; a second one at once."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hpctrain import preempt
from hpctrain.metrics import read_metrics
from hpctrain.testing import mpiexec, tiny_corpus_config, tiny_dlrm_config

CONFIG = """
[model]
seq_len = 16
n_layer = 2
n_head = 2
d_model = 32
dtype = "float64"
[train]
steps = 300
batch_size = 8
lr = 3e-3
eval_interval = 0
seed = 3
[data]
path = "{data}"
"""


def prepare(tmp_path, config=CONFIG):
    return tiny_corpus_config(tmp_path, config, "to be, or not to be, that is the question.",
                              400)


def as_from_a_terminal() -> None:
    """A child's SIGINT as a terminal's foreground job has it: the default. A suite
    started in the background by a shell without job control (``make test &``)
    passes SIGINT on ignored, and an ignored SIGINT stays ignored (tested below)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def launch(cfg, run_dir, *extra, env=None):
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "hpctrain.cli", "train", "--config",
           str(cfg), "--run-dir", str(run_dir), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                            preexec_fn=as_from_a_terminal)


def wait_for_records(job, metrics: Path, n: int, *, within: float) -> None:
    """Return once ``metrics`` holds ``n`` records; fail if ``job`` ends first or
    ``within`` seconds pass."""
    deadline = time.monotonic() + within
    while not (metrics.exists() and len(read_metrics(metrics)) >= n):
        assert time.monotonic() < deadline and job.poll() is None, job.communicate()
        time.sleep(0.05)


def test_sigusr1_checkpoints_exits_3_and_resume_equals_uninterrupted(tmp_path):
    cfg = prepare(tmp_path)
    job = launch(cfg, tmp_path / "run", "--resume", "auto")
    metrics = tmp_path / "run" / "metrics.jsonl"
    wait_for_records(job, metrics, 5, within=60)
    job.send_signal(signal.SIGUSR1)  # to mpiexec, which forwards it to every rank
    out, err = job.communicate(timeout=60)
    assert job.returncode == 3, err
    assert "preempted (SIGUSR1)" in out and "checkpoint saved" in out
    stopped = read_metrics(metrics)[-1]["step"]
    assert 5 <= stopped < 300

    resumed = launch(cfg, tmp_path / "run", "--resume", "auto")
    out, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err
    assert "resumed from" in out and f"after step {stopped}" in out

    reference = launch(cfg, tmp_path / "ref")
    _, err = reference.communicate(timeout=120)
    assert reference.returncode == 0, err
    got = [(r["step"], r["loss"]) for r in read_metrics(metrics)]
    want = [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "ref" / "metrics.jsonl")]
    assert got == want


def test_a_signal_after_the_run_is_ignored_not_fatal():
    # SLURM's warning signal can come as the last step ends; Python resets a handled
    # SIGUSR1 to the default (terminate) while it shuts down, an ignored one stays ignored
    code = ("import os, signal; from hpctrain import preempt; preempt.install(); "
            "preempt.ignore(); assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN; "
            "os.kill(os.getpid(), signal.SIGUSR1); os.kill(os.getpid(), signal.SIGTERM); "
            "print('alive', preempt.received())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and result.stdout.split() == ["alive", "False"], result


def test_ctrl_c_checkpoints_exits_130_and_the_run_resumes(tmp_path):
    # what a terminal's Ctrl-C does under mpiexec: mpiexec passes SIGINT to every rank.
    # Open MPI's mpirun (the system-MPI legs) passes nothing on: its kill sequence sends
    # the ranks SIGTERM odls_base_sigkill_timeout seconds later and SIGKILL as long after
    # that (preempt.py), so the ranks stop as if preempted, given 5 s here to do it; Open
    # MPI 5's gives them 0.25 s, which no setting changes, and this model's step and save
    # take a few milliseconds
    mpirun = os.environ.get("HPCTRAIN_EXPECT_MPI") in ("openmpi", "openmpi5")
    # mpirun reads nothing the ranks print while it waits to kill them: this model's
    # progress lines (400 a second) would fill rank 0's terminal and block it there
    cfg = prepare(tmp_path, CONFIG.replace("eval_interval = 0", "eval_interval = 0\n"
                                           "log_interval = 100000") if mpirun else CONFIG)
    steps = 100_000 if mpirun else 300  # steps of a few ms: some must be left after 5 s
    job = launch(cfg, tmp_path / "run", "--steps", str(steps),
                 env={preempt.ORTE_KILL_DELAY: "5"} if mpirun else None)
    metrics = tmp_path / "run" / "metrics.jsonl"
    wait_for_records(job, metrics, 5, within=60)
    job.send_signal(signal.SIGINT)
    out, err = job.communicate(timeout=60)
    assert "Traceback" not in err
    stopped = read_metrics(metrics)[-1]["step"]
    assert 5 <= stopped < steps
    if mpirun:  # mpirun reports a job it stopped as failed, whatever the ranks' status, and
        # may drop what they print once it stops it (DEVELOPERS.md): the files tell
        assert job.returncode not in (0, 130), (job.returncode, err)
    else:
        assert job.returncode == 130, err
        assert err.count("interrupt: stopping after this step with a checkpoint") == 1, err
        assert f"interrupted (Ctrl-C) after step {stopped}: checkpoint saved" in out
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() \
        == f"step-{stopped:06d}"

    resumed = launch(cfg, tmp_path / "run", "--resume", "auto", "--steps", str(stopped + 2))
    out, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err
    assert f"after step {stopped}" in out
    assert [r["step"] for r in read_metrics(metrics)][-2:] == [stopped + 1, stopped + 2]


def test_a_second_ctrl_c_stops_at_once_with_one_line(tmp_path):
    # the first SIGINT sets the flag; the second raises where the rank is, and
    # abort_on_error reports it as one line with status 130, no traceback
    script = tmp_path / "twice.py"
    script.write_text(
        "import os, signal, time\n"
        "from mpi4py import MPI\n"
        "from hpctrain import preempt\n"
        "from hpctrain.runtime import abort_on_error\n"
        "preempt.install()\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "print('agreed', preempt.agreed(MPI.COMM_WORLD), flush=True)\n"
        "with abort_on_error(MPI.COMM_WORLD):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(30)\n"
        "print('not stopped')\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=60, preexec_fn=as_from_a_terminal)
    assert result.returncode == 130, result
    assert result.stdout.split() == ["agreed", "2"], result  # preempt.INTERRUPTED
    assert result.stderr.strip().splitlines()[-1] == "interrupted", result
    assert "Traceback" not in result.stderr
    assert result.stderr.count("interrupt: stopping after this step") == 1


def test_a_ctrl_c_ignored_from_the_start_stays_ignored():
    # a background job of a shell without job control starts with SIGINT ignored
    code = ("import os, signal; from hpctrain import preempt; preempt.install(); "
            "assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN; "
            "os.kill(os.getpid(), signal.SIGINT); print('alive', preempt.received())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert result.returncode == 0 and result.stdout.split() == ["alive", "False"], result


def test_ctrl_c_during_start_up_stops_before_any_step_and_saves_nothing(tmp_path):
    # signalled before the loop (a long start-up: data, a checkpoint, compiling): no step
    # is trained only to be saved, which would leave checkpoints a fresh rerun refuses
    cfg = prepare(tmp_path)
    script = tmp_path / "early.py"
    script.write_text(
        "import os, signal, sys\n"
        "from hpctrain import preempt\n"
        "from hpctrain.cli import main\n"
        "preempt.install()\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "main(sys.argv[1:])\n")
    run = tmp_path / "run"
    result = subprocess.run([sys.executable, str(script), "train", "--config", str(cfg),
                             "--run-dir", str(run), "--save-interval", "5"],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=as_from_a_terminal)
    assert result.returncode == 130, result.stderr
    assert "interrupted (Ctrl-C) during start-up: no step trained, nothing saved" \
        in result.stdout, result.stdout
    assert not (run / "checkpoints").exists()
    assert [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r] == []


def caught(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (its SigCgt mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def test_sigusr1_while_the_program_still_loads_stops_it_before_any_step(tmp_path):
    # a rank signalled in its first second, while the command line and NumPy load: the
    # console script catches it within milliseconds, and the run stops before its first
    # step with the status a batch script requeues, instead of dying of the signal
    cfg = prepare(tmp_path)
    run = tmp_path / "run"
    job = subprocess.Popen([str(Path(sys.executable).parent / "hpctrain"), "train", "--config",
                            str(cfg), "--run-dir", str(run)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 30
    while not caught(job.pid, signal.SIGUSR1):
        assert time.monotonic() < deadline and job.poll() is None, job.communicate()
        time.sleep(0.001)
    maps = Path(f"/proc/{job.pid}/maps").read_text()
    job.send_signal(signal.SIGUSR1)
    out, err = job.communicate(timeout=120)
    assert "_multiarray_umath" not in maps, "SIGUSR1 was caught only after NumPy had loaded"
    assert job.returncode == preempt.EXIT_PREEMPTED, err
    assert "preempted (SIGUSR1) during start-up: no step trained, nothing saved" in out, out
    assert not (run / "checkpoints").exists()


ORTE = {preempt.ORTE_URI: "1110441984.0;tcp://10.0.0.1:57769"}  # what mpirun sets


def test_the_kill_delay_is_read_only_under_open_mpis_mpirun():
    assert preempt.orte_kill_delay({}) is None  # hydra, srun, a single process
    assert preempt.orte_kill_delay({preempt.ORTE_KILL_DELAY: "30"}) is None
    assert preempt.orte_kill_delay(ORTE) == 1  # Open MPI's default
    assert preempt.orte_kill_delay({**ORTE, preempt.ORTE_KILL_DELAY: "30"}) == 30
    assert preempt.orte_kill_delay({**ORTE, preempt.ORTE_KILL_DELAY: "x"}) is None


def test_a_stop_that_outlasts_the_kill_delay_is_named_with_the_fix():
    assert preempt.stop_time_note(2.0, 1.0, {}) is None  # another launcher
    assert preempt.stop_time_note(0.1, 0.2, ORTE) is None  # 0.8 s of the 1 s
    slow = {**ORTE, preempt.ORTE_KILL_DELAY: "3"}
    note = preempt.stop_time_note(1.9, 0.7, slow)  # 3.1 s needed
    assert note is not None and "SIGTERM after 3 s and SIGKILL 3 s later" in note, note
    assert "up to 3.1 s to finish a step (1.9 s), save (0.7 s)" in note, note
    assert note.endswith("--mca odls_base_sigkill_timeout 5 (or export "
                         "OMPI_MCA_odls_base_sigkill_timeout=5; mpirun then takes up to "
                         "10 s to stop)"), note
    assert preempt.stop_time_note(1.9, 0.7, {**slow, "SLURM_JOB_ID": "7"}) is None
    note = preempt.stop_time_note(10.0, 2.0, ORTE)  # 12.5 s: advise 19
    assert "odls_base_sigkill_timeout 19 " in note, note
    assert preempt.stop_time_note(2.0, 0.5, {**ORTE, preempt.ORTE_KILL_DELAY: "3"}) is None


PRRTE = {preempt.PRRTE_MARK: "1"}  # what Open MPI 5's mpirun sets in the ranks


def test_under_open_mpi_5_a_stop_longer_than_its_fixed_quarter_second_names_sigusr1():
    assert preempt.stop_time_note(0.05, 0.1, PRRTE) is None  # the checkpoint fits
    note = preempt.stop_time_note(0.4, 0.3, PRRTE)
    assert note is not None and "SIGTERM after 0.25 s and SIGKILL 0.25 s later" in note, note
    assert "up to 0.7 s to finish a step (0.4 s) and save (0.3 s)" in note, note
    assert "kill -USR1 PID-of-mpirun" in note and "exit with status 3" in note, note
    assert "odls_base_sigkill_timeout" not in note  # no such setting there
    assert preempt.stop_time_note(0.4, 0.3, {**PRRTE, "SLURM_JOB_ID": "7"}) is None
    assert preempt.stop_time_note(0.4, 0.3, {**ORTE, "SLURM_JOB_ID": "7"}) is None


# ---------------------------------------------------------------------------------
# hpctrain cv: a signal stops the fold in training with a checkpoint; --resume goes on


def cv_config(tmp_path, ratings_h5) -> Path:
    return tiny_dlrm_config(tmp_path / "dlrm.toml", ratings_h5,
                            "steps = 300\nbatch_size = 8\neval_interval = 300")


def launch_cv(config, run_dir, *extra):
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "hpctrain.cli", "cv", "--config",
           str(config), "--folds", "2", "--run-dir", str(run_dir), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=as_from_a_terminal)


def test_cv_stopped_in_a_fold_resumes_there_and_ends_with_the_uninterrupted_rmse(
        tmp_path, ratings_h5):
    import json

    config = cv_config(tmp_path, ratings_h5)
    job = launch_cv(config, tmp_path / "cv")
    fold1 = tmp_path / "cv" / "fold1" / "metrics.jsonl"
    wait_for_records(job, fold1, 5, within=120)
    job.send_signal(signal.SIGUSR1)  # to mpiexec, which forwards it to every rank
    out, err = job.communicate(timeout=60)
    assert job.returncode == preempt.EXIT_PREEMPTED, err  # before: it trained on, unsaved
    assert "fold 0: RMSE" in out and "preempted (SIGUSR1) after step" in out, out
    assert "resume with --resume\n" in out and "stopped in fold 1" in out, out
    stopped = read_metrics(fold1)[-1]["step"]
    assert 5 <= stopped < 300 and not (tmp_path / "cv" / "cv.json").exists()

    again = launch_cv(config, tmp_path / "cv", "--resume")
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    assert "--resume: 1 fold(s) finished earlier" in out and "(finished earlier)" in out, out

    reference = launch_cv(config, tmp_path / "ref")
    _, err = reference.communicate(timeout=120)
    assert reference.returncode == 0, err
    got = json.loads((tmp_path / "cv" / "cv.json").read_text())
    want = json.loads((tmp_path / "ref" / "cv.json").read_text())
    assert got["rmse"] == want["rmse"] and got["earlier"] == [0]
    assert [r["loss"] for r in read_metrics(fold1) if "loss" in r] == \
        [r["loss"] for r in read_metrics(tmp_path / "ref" / "fold1" / "metrics.jsonl")
         if "loss" in r]


def test_cv_refuses_before_any_fold_a_resume_of_another_config_or_an_overwrite(
        tmp_path, ratings_h5):
    from click.testing import CliRunner

    from hpctrain.cli import main

    config = cv_config(tmp_path, ratings_h5)
    run_dir = tmp_path / "cv"
    args = ["cv", "--config", str(config), "--folds", "2", "--run-dir", str(run_dir),
            "--steps", "3"]
    config.write_text(config.read_text().replace("eval_interval = 300",
                                                 "eval_interval = 3\nsave_interval = 3"))
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    fold0 = (run_dir / "fold0" / "metrics.jsonl").read_bytes()
    # a fresh cv would overwrite fold 0's checkpoints: refused at once, not at fold 0's turn
    bad = CliRunner().invoke(main, args)
    assert bad.exit_code == 2 and f"{run_dir / 'fold0'} holds fold 0's checkpoints from an " \
        "earlier cross-validation (latest: step-000003): continue it with --resume" \
        in bad.output, bad.output
    # --resume of a run made with other steps
    bad = CliRunner().invoke(main, [*args[:-1], "4", "--resume"])
    assert bad.exit_code == 2 and "fold 0's earlier run had another config " \
        "(train.steps (3, not 4))" in bad.output, bad.output
    assert (run_dir / "fold0" / "metrics.jsonl").read_bytes() == fold0
    # the same config: both folds read, nothing trained
    same = CliRunner().invoke(main, [*args, "--resume"])
    assert same.exit_code == 0, same.output
    assert same.output.count("(finished earlier)") == 2, same.output
    assert (run_dir / "fold0" / "metrics.jsonl").read_bytes() == fold0
