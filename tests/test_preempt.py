"""Preemption without SLURM: SIGUSR1 to one rank of an mpiexec job makes every rank
stop after the same step with a checkpoint, exit 3, and a resumed run ends with the
loss curve of an uninterrupted one, bitwise."""

import os
import signal
import subprocess
import sys
import time

from hpctrain.metrics import read_metrics
from hpctrain.testing import mpiexec, tiny_corpus_config

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


def prepare(tmp_path):
    return tiny_corpus_config(tmp_path, CONFIG, "to be, or not to be, that is the question.",
                              400)


def launch(cfg, run_dir, *extra):
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "hpctrain.cli", "train", "--config",
           str(cfg), "--run-dir", str(run_dir), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_sigusr1_checkpoints_exits_3_and_resume_equals_uninterrupted(tmp_path):
    cfg = prepare(tmp_path)
    job = launch(cfg, tmp_path / "run", "--resume", "auto")
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while not (metrics.exists() and len(read_metrics(metrics)) >= 5):
        assert time.monotonic() < deadline and job.poll() is None, job.communicate()
        time.sleep(0.05)
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
