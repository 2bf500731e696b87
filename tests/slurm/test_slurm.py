"""The job templates on a real two-node SLURM cluster (part of ``make test-cluster``).

The fixture brings up an emulated cluster of two nodes (``hpctrain cluster``: network
namespaces, shaped links, cgroups) with ``slurmctld`` on this machine and a ``slurmd``
in each node; Debian's slurm and munge are installed when missing. At the end
everything is removed, pass or fail. The tests submit the real ``jobscripts/`` with
``sbatch``: data preparation, the prep -> train chain with ``--dependency=afterok``,
one job across both nodes (the template's automatic launcher: ``mpiexec`` inside the
allocation for the pip MPICH, see DEVELOPERS.md) and on one node with ``srun
--mpi=pmi2``, and training jobs on one and on two nodes preempted with ``scancel --batch
--signal=USR1`` (the signal ``#SBATCH --signal=B:USR1@120`` sends before the time limit,
which the script passes on to its launcher) that must requeue themselves, resume from
their checkpoint and, on two nodes, end with the loss curve of an uninterrupted run.
What goes wrong for users is checked too: a job SLURM will not requeue must end FAILED,
a chain whose preparation fails must not leave its training pending for good, and
another MPI's ``mpiexec`` first on PATH must not be taken for the venv's. ``COMMAND=cv``
runs a cross-validation through the same template.

The jobs run the hpctrain, hpctrain-prep and mpiexec of the venv that runs pytest: the
pip MPICH's in ``make test-cluster``; Debian's MPICH or Open MPI in ``make
test-system-mpi``, Open MPI 5 from PyPI in ``make test-system-mpi MPI=openmpi5``, which
names it in ``HPCTRAIN_EXPECT_MPI`` (``LAUNCHERS`` below: what the template's automatic
launcher takes for each).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpctrain.cluster import lifecycle, net
from hpctrain.cluster import spec as spec_mod
from hpctrain.metrics import read_metrics
from hpctrain.testing import tiny_dlrm_config

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the SLURM cluster runs on emulated nodes, which need root: "
                              "run `sudo make test-cluster`")

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

TINY_GPT = """
[model]
seq_len = 16
n_layer = 2
n_head = 2
d_model = 32
dtype = "float64"
[train]
steps = {steps}
batch_size = 8
lr = 3e-3
warmup_steps = 5
eval_interval = 0
log_interval = 5
seed = 7
[data]
path = "{data}"
"""


# the MPI of this venv -> the launcher train.sbatch's LAUNCHER=auto takes on (one node,
# two nodes): srun --mpi=pmi2 where the MPI starts under it, but the pip MPICH across
# nodes and Open MPI (Debian's 4.1.4 starts under neither pmi2 nor pmix) take mpiexec
LAUNCHERS = {"pip-mpich": ("srun", "mpiexec"), "mpich": ("srun", "srun"),
             "openmpi": ("mpiexec", "mpiexec"), "openmpi5": ("mpiexec", "mpiexec")}
MPI_NAME = os.environ.get("HPCTRAIN_EXPECT_MPI", "pip-mpich")
ONE_NODE, TWO_NODES = LAUNCHERS[MPI_NAME]
# the preempted run's steps: the tiny model takes about 5 ms a step at 2 ranks on each
# one-core node with the pip MPICH, 30-70 ms with Debian's MPICH or Open MPI (their
# waits poll the network, and two ranks share a core capped by its cgroup), 25-50 ms
# with Open MPI 5
PREEMPT_STEPS = {"pip-mpich": 2000, "mpich": 300, "openmpi": 300, "openmpi5": 500}

SPEC = spec_mod.build({"name": "hpctslm", "subnet": "10.216.0.0/24", "link": "1gbit",
                       "slurm": True, "slurm_cpus": 4, "nodes": [{"count": 2, "cores": 1}]})


@pytest.fixture(scope="module")
def emulated():
    with lifecycle.running(SPEC) as cl:
        yield cl


@pytest.fixture(scope="module")
def cluster(emulated):
    """The environment every SLURM command of the tests runs with (the jobs inherit it:
    the venv's mpiexec on PATH, as with the venv activated)."""
    return {**os.environ, **emulated.env(), "PATH": f"{BIN}:{os.environ['PATH']}",
            "HPCTRAIN": str(BIN / "hpctrain"),
            "PREP": str(BIN / "hpctrain-prep"), "OMP_NUM_THREADS": "1"}


def sbatch(env, script, *options, **variables) -> str:
    result = subprocess.run(
        ["sbatch", "--parsable", *options, str(ROOT / "jobscripts" / script)],
        env={**env, **{k: str(v) for k, v in variables.items()}}, capture_output=True,
        text=True, timeout=60, check=True)
    return result.stdout.strip().split(";")[0]


def job_fields(env, job_id) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True,
                         text=True, timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_for(env, job_id, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"),
             timeout=300) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fields = job_fields(env, job_id)
        if fields.get("JobState") in states:
            return fields
        time.sleep(1)
    raise AssertionError(f"job {job_id} not in {states} after {timeout} s:\n"
                         + job_report(env, job_id))


def wait_for_requeued(env, job_id, timeout=300) -> None:
    """Wait until a signalled job has requeued itself (Restarts=1), run again and
    completed; fail at once if it failed, was cancelled, or completed unrequeued."""
    deadline = time.monotonic() + timeout
    while True:
        fields = job_fields(env, job_id)
        if fields.get("Restarts") == "1" and fields.get("JobState") == "COMPLETED":
            return
        assert not (fields.get("Restarts") == "0" and fields.get("JobState") == "COMPLETED"), \
            "the run finished before the signal landed: " + job_report(env, job_id)
        assert time.monotonic() < deadline, job_report(env, job_id)
        assert fields.get("JobState") not in ("FAILED", "CANCELLED"), job_report(env, job_id)
        time.sleep(1)


def job_report(env, job_id, workdir: Path | None = None) -> str:
    """What a failed assertion shows: the job's state and reason, and the tail of its
    output and error files (the whole dict of scontrol fields is cut by pytest)."""
    fields = job_fields(env, job_id)
    keys = ("JobState", "Reason", "Restarts", "NodeList", "RunTime", "ExitCode")
    lines = [" ".join(f"{k}={fields.get(k)}" for k in keys)]
    workdir = Path(fields.get("WorkDir", ".")) if workdir is None else workdir
    for suffix in ("out", "err"):
        path = workdir / f"{fields.get('JobName', 'hpctrain-train')}-{job_id}.{suffix}"
        if path.exists():
            lines += [f"--- {path.name} (last 40 lines)",
                      *path.read_text(errors="replace").splitlines()[-40:]]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def text_data(cluster, tmp_path_factory):
    """Shakespeare prepared by prep.sbatch, as a user would on a cluster."""
    work = tmp_path_factory.mktemp("prep")
    job = sbatch(cluster, "prep.sbatch", f"--chdir={work}",
                 OUTPUT=work / "shakespeare.h5", SOURCES="shakespeare")
    fields = wait_for(cluster, job)
    log = (work / f"hpctrain-prep-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED", log
    assert f"job {job} on" in log and "exited with status 0" in log
    return work / "shakespeare.h5"


def test_prep_job_writes_a_verified_dataset(cluster, text_data):
    result = subprocess.run([str(BIN / "hpctrain-prep"), "verify", str(text_data)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_chain_runs_train_after_prep_and_exit_codes_propagate(cluster, tmp_path):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY_GPT.format(steps=6, data=tmp_path / "shk.h5"))
    env = {**cluster, "OUTPUT": str(tmp_path / "shk.h5"), "CONFIG": str(cfg),
           "RUN_DIR": str(tmp_path / "run"), "PREP_ARGS": "--force"}
    out = subprocess.run(["bash", str(ROOT / "jobscripts" / "chain.sh")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    prep_id, train_id = re.findall(r"job (\d+)", out)[:2]
    assert wait_for(cluster, prep_id)["JobState"] == "COMPLETED"
    fields = wait_for(cluster, train_id)
    log = (tmp_path / f"hpctrain-train-{train_id}.out").read_text()
    assert fields["JobState"] == "COMPLETED", log
    assert "layout: 4 ranks = 1 node(s) x 4" in log
    assert f"launcher: {ONE_NODE} (auto)" in log, log
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == \
        list(range(1, 7))
    # a failing run must show FAILED, not COMPLETED: a config the model refuses
    job = sbatch(cluster, "train.sbatch", f"--chdir={tmp_path}", CONFIG=cfg,
                 RUN_DIR=tmp_path / "bad", TRAIN_ARGS="--tp 3")
    fields = wait_for(cluster, job)
    assert fields["JobState"] == "FAILED" and fields["ExitCode"].startswith("2:")


@pytest.mark.parametrize("nodes", [2, 1])
def test_preempted_job_requeues_resumes_and_equals_an_uninterrupted_run(cluster, text_data,
                                                                        tmp_path, nodes):
    # about 10 s of training or more, so that the signal, sent after step 8, lands
    # mid-run (600 steps, 3 s, once lost that race under load)
    steps = PREEMPT_STEPS[MPI_NAME]
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY_GPT.format(steps=steps, data=text_data))
    # two ranks a node, each node one core, as in the other tests (and as PREEMPT_STEPS
    # is timed for)
    common = [f"--chdir={tmp_path}", f"--nodes={nodes}", "--ntasks-per-node=2"]
    job = sbatch(cluster, "train.sbatch", *common, CONFIG=cfg, RUN_DIR=tmp_path / "preempted",
                 TRAIN_ARGS="--save-interval 1000")
    metrics = tmp_path / "preempted" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and len(read_metrics(metrics)) >= 8):
        assert time.monotonic() < deadline, job_report(cluster, job)
        time.sleep(0.2)
    # to the batch script alone, as the template's --signal=B:USR1@120 does: it passes
    # the signal to its launcher (on one node under mpiexec no job step holds a rank, so
    # a signal to the steps would reach none of them)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=cluster, check=True,
                   timeout=30)
    wait_for_requeued(cluster, job)
    log = (tmp_path / f"hpctrain-train-{job}.out").read_text()
    assert "SIGUSR1, passed on to the ranks" in log, log
    # each attempt heads the error file too, which it appends to (--open-mode=append)
    err = (tmp_path / f"hpctrain-train-{job}.err").read_text()
    assert f"job {job} (restart 0)" in err and f"job {job} (restart 1)" in err, err
    assert "checkpoint saved; resume with" in log and "; requeueing" in log, log
    assert "(restart 1)" in log, log
    got = {r["step"]: r["loss"] for r in read_metrics(metrics)}
    assert sorted(got) == list(range(1, steps + 1))
    if nodes == 1:
        return  # the resume's exactness: the two-node case, against a run not stopped
    reference = sbatch(cluster, "train.sbatch", *common, CONFIG=cfg,
                       RUN_DIR=tmp_path / "uninterrupted", TRAIN_ARGS="--save-interval 1000")
    assert wait_for(cluster, reference)["JobState"] == "COMPLETED"
    want = {r["step"]: r["loss"]
            for r in read_metrics(tmp_path / "uninterrupted" / "metrics.jsonl")}
    assert got == want  # bitwise: same layout, resumed from an exact checkpoint


def signalled_in_site_setup(env, tmp_path, text_data, *options) -> str:
    """A 6-step job of the template given a slow site setup, as a module system's can
    be, sent SIGUSR1 during that setup (before its launcher runs); its id."""
    template = (ROOT / "jobscripts" / "train.sbatch").read_text()
    site = '# source "$HOME/hpctrain/.venv/bin/activate"\n'
    assert template.count(site) == 1
    script = tmp_path / "slow-site.sbatch"
    script.write_text(template.replace(site, site + 'echo "site setup"; sleep 5\n'))
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY_GPT.format(steps=6, data=text_data))
    job = subprocess.run(["sbatch", "--parsable", f"--chdir={tmp_path}", "--nodes=1",
                          "--ntasks-per-node=2", *options, str(script)],
                         env={**env, "CONFIG": str(cfg), "RUN_DIR": str(tmp_path / "run")},
                         capture_output=True, text=True, timeout=60, check=True
                         ).stdout.strip().split(";")[0]
    out = tmp_path / f"hpctrain-train-{job}.out"
    deadline = time.monotonic() + 120
    while not (out.exists() and "site setup" in out.read_text()):
        assert time.monotonic() < deadline, job_report(env, job)
        time.sleep(0.2)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=env, check=True,
                   timeout=30)
    return job


def test_a_signal_before_the_launch_requeues_the_job_without_starting_it(cluster, text_data,
                                                                       tmp_path):
    # a SIGUSR1 during the site setup (a short time limit, an early scancel) finds no
    # launcher to pass it to; the job must go back to the queue and run later, not die
    # of the signal
    job = signalled_in_site_setup(cluster, tmp_path, text_data)
    out = tmp_path / f"hpctrain-train-{job}.out"
    wait_for_requeued(cluster, job)
    log = out.read_text()
    assert f"job {job}: SIGUSR1 before the launch; requeueing without starting" in log, log
    assert "(restart 1)" in log and log.count("step 1/6") == 1, log  # trained once
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == \
        list(range(1, 7))


def test_a_job_slurm_will_not_requeue_ends_failed_with_the_run_dir_to_resume(
        cluster, text_data, tmp_path):
    # submitted with --no-requeue, `scontrol requeue` is refused: the job must not show
    # COMPLETED with its run unfinished, but FAILED with the preempted status
    job = signalled_in_site_setup(cluster, tmp_path, text_data, "--no-requeue")
    fields = wait_for(cluster, job, timeout=60)
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "3:0", \
        job_report(cluster, job)
    note = (f"job {job}: SLURM did not requeue it; to continue, submit it again with "
            f"RUN_DIR={tmp_path / 'run'}")
    for suffix in ("out", "err"):
        assert note in (tmp_path / f"hpctrain-train-{job}.{suffix}").read_text()


def test_a_chain_whose_preparation_fails_cancels_its_training(cluster, tmp_path):
    # not left pending for good ("DependencyNeverSatisfied")
    env = {**cluster, "DATASET": "no-such-dataset", "OUTPUT": str(tmp_path / "x.h5")}
    out = subprocess.run(["bash", str(ROOT / "jobscripts" / "chain.sh")], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         check=True).stdout
    prep_id, train_id = re.findall(r"job (\d+)", out)[:2]
    assert wait_for(cluster, prep_id, timeout=60)["JobState"] == "FAILED"
    fields = wait_for(cluster, train_id, timeout=30)
    assert fields["JobState"] == "CANCELLED", job_report(cluster, train_id)
    assert fields["Reason"] == "DependencyNeverSatisfied", fields["Reason"]


def test_cross_validation_runs_through_the_template(cluster, ratings_h5, tmp_path):
    # COMMAND=cv: `hpctrain cv ... --resume`, which starts fresh folds and, after a
    # requeue, continues the stopped one (a ratings file of the suite's own: a clean
    # clone's `make test` prepares no MovieLens)
    cfg = tiny_dlrm_config(tmp_path / "dlrm.toml", ratings_h5,
                           "steps = 3\nbatch_size = 8\neval_interval = 3")
    job = sbatch(cluster, "train.sbatch", f"--chdir={tmp_path}", "--nodes=1",
                 "--ntasks-per-node=2", COMMAND="cv", CONFIG=cfg, RUN_DIR=tmp_path / "cv",
                 TRAIN_ARGS="--folds 2")
    fields = wait_for(cluster, job, timeout=120)
    log = (tmp_path / f"hpctrain-train-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED", job_report(cluster, job)
    assert "2-fold cross-validation" in log and "RMSE per fold:" in log, log
    assert f"job {job}: hpctrain cv exited with status 0" in log, log
    assert (tmp_path / "cv" / "cv.json").is_file()


@pytest.mark.skipif(not (BIN / "mpiexec").exists(), reason="this venv holds no mpiexec")
def test_the_mpi_beside_hpctrain_comes_before_another_on_path(cluster, text_data, tmp_path):
    # HPCTRAIN=.../venv/bin/hpctrain with the venv not activated, as the README shows,
    # and another MPI's mpiexec (a system Open MPI) first on PATH: the job must launch
    # with the venv's MPI, not pick the other one and fail in MPI_Init
    other = tmp_path / "other-mpi"
    other.mkdir()
    (other / "mpiexec").write_text(
        '#!/bin/sh\necho "mpiexec (OpenRTE) 4.1.4"\n[ "$1" = --version ] && exit 0\n'
        'echo "another MPI\'s mpiexec" >&2\nexit 1\n')
    (other / "mpiexec").chmod(0o755)
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY_GPT.format(steps=6, data=text_data))
    env = {**cluster, "PATH": f"{other}:/usr/bin:/bin"}
    job = sbatch(env, "train.sbatch", f"--chdir={tmp_path}", "--nodes=1",
                 "--ntasks-per-node=2", CONFIG=cfg, RUN_DIR=tmp_path / "run")
    fields = wait_for(cluster, job, timeout=120)
    log = (tmp_path / f"hpctrain-train-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED", job_report(cluster, job)
    assert f"PATH: {BIN} first, for the MPI beside HPCTRAIN" in log, log
    assert f"launcher: {ONE_NODE} (auto)" in log, log


def test_one_job_across_two_nodes_and_srun_on_one(cluster, emulated, text_data, tmp_path):
    """The same training across both nodes (the template's automatic launcher, which is
    mpiexec for the pip MPICH across nodes) and on one node with srun --mpi=pmi2 (with
    mpiexec for an MPI that does not start under srun)."""
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY_GPT.format(steps=6, data=text_data))
    sent_before = [net.link_bytes(emulated.spec, n)[0] for n in emulated.spec.nodes]
    curves = {}
    for name, nodes, per_node, launcher in (("two", 2, 2, "auto"), ("one", 1, 4, ONE_NODE)):
        job = sbatch(cluster, "train.sbatch", f"--chdir={tmp_path}", f"--nodes={nodes}",
                     f"--ntasks-per-node={per_node}", CONFIG=cfg, RUN_DIR=tmp_path / name,
                     LAUNCHER=launcher, TRAIN_ARGS="--tp 2")
        fields = wait_for(cluster, job)
        log = (tmp_path / f"hpctrain-train-{job}.out").read_text()
        assert fields["JobState"] == "COMPLETED", job_report(cluster, job, tmp_path)
        assert f"layout: 4 ranks = {nodes} node(s) x {per_node}" in log, log
        assert "spans nodes" not in log, log
        curves[name] = [r["loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl")]
        if nodes == 2:
            assert fields["NodeList"] == "hpctslm[0-1]", fields
            assert f"launcher: {TWO_NODES} (auto)" in log, log
    # the same layout (dp 2, tp 2) computes the same losses on one node and on two; the
    # sums may differ in the last bits, as the collectives' algorithms depend on placement
    assert len(curves["two"]) == 6
    assert curves["two"] == pytest.approx(curves["one"], rel=1e-12)
    # the gradients crossed the links: the data groups join the nodes, so in each of 6
    # steps every node sent at least the gradient of one tensor shard, half of the
    # model's 42k float64 parameters
    sent = [net.link_bytes(emulated.spec, n)[0] - b
            for n, b in zip(emulated.spec.nodes, sent_before, strict=True)]
    assert all(s > 6 * 21_000 * 8 for s in sent), sent


def test_the_epilog_removes_segments_no_process_maps(cluster, emulated, tmp_path):
    """A killed step's MPICH segment in a node's /dev/shm goes at the end of the next
    job on that node (the node's /dev/shm is seen through its slurmd's root)."""
    from hpctrain.cluster import slurmd

    shm = {}
    for pid in slurmd.pids(emulated.folder / "slurm"):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"slurmd" in cmdline[0]:
            node = cmdline[cmdline.index(b"-N") + 1].decode()
            shm[node] = Path(f"/proc/{pid}/root/dev/shm")
    assert sorted(shm) == ["hpctslm0", "hpctslm1"], shm
    stale = shm["hpctslm1"] / "mpich_shm_stale_0"
    stale.write_bytes(b"left by a killed step")
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\nhostname\n")
    job = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--nodelist=hpctslm1",
                          f"--chdir={tmp_path}", str(script)], env=cluster, capture_output=True,
                         text=True, timeout=60, check=True).stdout.strip()
    assert wait_for(cluster, job)["JobState"] == "COMPLETED"
    deadline = time.monotonic() + 30  # the epilog runs as the job ends
    while stale.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not stale.exists()


def test_render_refuses_layouts_that_do_not_fit(tmp_path):
    cases = [(["--ranks-per-node", "2", "--nodes", "2", "--tp", "4"],
              "tp (4) must divide ranks per node (2)"),
             (["--ranks-per-node", "4", "--dp", "3"],
              "dp * tp * pp (3 * 1 * 1 = 3) must equal the tasks allocated")]
    for args, message in cases:
        result = subprocess.run([str(BIN / "hpctrain"), "slurm", "render", *args],
                                capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert result.returncode != 0 and message in result.stderr, result.stderr
