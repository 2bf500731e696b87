"""The SLURM templates without a cluster: syntax, the guard, rendering and its checks."""

import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpctrain.cli import main
from hpctrain.config import ConfigError
from hpctrain.parallel.topology import NodeLayout
from hpctrain.slurm.placement import blas_threads_per_rank, tensor_group_warning
from hpctrain.slurm.render import TEMPLATES, JobRequest, check_fit, render, time_seconds

SCRIPTS = sorted(TEMPLATES.glob("*.sbatch")) + sorted(TEMPLATES.glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_template_parses_in_bash(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("script", sorted(TEMPLATES.glob("*.sbatch")), ids=lambda p: p.name)
def test_sbatch_lines_use_long_flags_with_a_comment_and_a_guard_outside_slurm(script):
    text = script.read_text()
    for line in text.splitlines():
        if line.startswith("#SBATCH"):
            assert line.startswith("#SBATCH --"), line
            assert "  # " in line, f"uncommented #SBATCH line: {line}"
    env = {"PATH": "/usr/bin:/bin"}  # no SLURM_JOB_ID
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env)
    assert result.returncode == 2 and "submit it with 'sbatch" in result.stderr


def test_render_fills_resources_and_layout_and_stays_valid_bash(tmp_path):
    out = tmp_path / "job.sbatch"
    result = CliRunner().invoke(main, [
        "slurm", "render", "--nodes", "2", "--ranks-per-node", "4", "--tp", "2", "--pp", "2",
        "--time", "01:00:00", "--partition", "compute", "--account", "proj",
        "--train-args", "--microbatches 4", "-o", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    for line in ["#SBATCH --nodes=2 ", "#SBATCH --ntasks-per-node=4 ", "#SBATCH --time=01:00:00 ",
                 "#SBATCH --partition=compute ", "#SBATCH --account=proj ",
                 ': "${TRAIN_ARGS:=--dp 2 --tp 2 --pp 2 --microbatches 4}"',
                 ': "${LAUNCHER:=auto}"']:
        assert line in text, line
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0


@pytest.mark.parametrize("req, message", [
    (JobRequest(nodes=2, ranks_per_node=2, tp=4), r"tp \(4\) must divide ranks per node \(2\)"),
    (JobRequest(nodes=1, ranks_per_node=4, dp=3),
     r"dp \* tp \* pp \(3 \* 1 \* 1 = 3\) must equal the tasks allocated"),
    (JobRequest(nodes=1, ranks_per_node=4, time="soon"), r"time \('soon'\) must look like"),
    (JobRequest(nodes=0, ranks_per_node=4), r"must be at least 1"),
    (JobRequest(nodes=1, ranks_per_node=4, launcher="ssh"),
     r"launcher \('ssh'\) must be one of auto, srun, mpiexec"),
    (JobRequest(nodes=1, ranks_per_node=4, tp=0), r"^tp \(0\) must be at least 1$"),
    (JobRequest(nodes=1, ranks_per_node=4, pp=0), r"^pp \(0\) must be at least 1$"),
    (JobRequest(nodes=1, ranks_per_node=4, dp=0), r"^dp \(0\) must be at least 1$"),
    (JobRequest(nodes=1, ranks_per_node=4, time="99:99:99"),
     r"time \('99:99:99'\) must look like MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"),
    (JobRequest(nodes=1, ranks_per_node=4, time="10:60"), r"time \('10:60'\)"),
    (JobRequest(nodes=1, ranks_per_node=4, time="1-24"), r"time \('1-24'\)"),
    (JobRequest(nodes=1, ranks_per_node=4, time="1-23:59:60"), r"time \('1-23:59:60'\)"),
])
def test_layouts_that_do_not_fit_are_refused(req, message):
    with pytest.raises(ConfigError, match=message):
        check_fit(req)


@pytest.mark.parametrize("time", ["30", "90", "90:00", "00:30:00", "99:59:59", "1-0",
                                  "2-23", "1-23:59", "10-23:59:59"])
def test_slurm_time_forms_are_accepted(time):
    assert check_fit(JobRequest(nodes=1, ranks_per_node=4, time=time)) == 4


@pytest.mark.parametrize("time, seconds", [
    ("3", 180), ("90", 5400), ("02:00", 120), ("1:02:03", 3723), ("1-0", 86400),
    ("1-2:03", 93780), ("2-23:59:59", 259199)])
def test_time_limits_in_seconds(time, seconds):
    assert time_seconds(time) == seconds


@pytest.mark.parametrize("args, message", [
    (["--tp", "0"], "tp (0) must be at least 1"),
    (["--pp", "0"], "pp (0) must be at least 1"),
    (["--hpctrain", "$HOME/venv/bin/hpctrain"],
     "HPCTRAIN ('$HOME/venv/bin/hpctrain') must not contain \" $ ` or \\"),
    (["--train-args", "--trace $SCRATCH/trace.json"], "must not contain \" $ ` or \\"),
    (["--ranks-per-node", "3", "--tp", "3"], "tp (3) must divide n_head (4)"),
    (["--ranks-per-node", "0"], "ranks per node (0)"),
    (["--time", "2h"], "time ('2h') must look like"),
    (["--time", "99:99:99"], "time ('99:99:99') must look like"),
    # no longer than the template's --signal=B:USR1@120: each attempt signalled at once
    (["--time", "2"], "time (2 = 120 s) must be longer than the template's warning "
                      "(--signal=B:USR1@120"),
    (["--time", "01:30"], "time (01:30 = 90 s) must be longer"),
    (["--config", "nonexist.toml"], "config file 'nonexist.toml' does not exist"),
    (["--train-args", "--bogus 1"], "No such option '--bogus'"),
    (["--job-name", "my job"], "--job-name ('my job') must be non-empty, without whitespace"),
    (["--job-name", "x\n#SBATCH --exclusive"], "--job-name ('x\\n#SBATCH --exclusive')"),
    (["--partition", "a b"], "--partition ('a b') must be non-empty, without whitespace"),
    (["--account", "a\tb"], "--account ('a\\tb') must be non-empty, without whitespace"),
])
def test_bad_input_is_a_usage_error_with_its_message(tmp_path, args, message):
    """Every bad value exits 2 (the project's status for bad input) with one message,
    no traceback, and nothing written."""
    cfg = tmp_path / "c.toml"
    cfg.write_text("[model]\nn_head = 4\nd_model = 64\n[train]\nbatch_size = 8\n")
    out = tmp_path / "job.sbatch"
    result = CliRunner().invoke(main, ["slurm", "render", "--ranks-per-node", "2",
                                       "--config", str(cfg), "-o", str(out), *args])
    assert result.exit_code == 2, (result.output, result.exception)
    assert message in result.output and "Traceback" not in result.output, result.output
    assert not out.exists()


def test_an_output_that_cannot_be_written_is_refused(tmp_path):
    out = tmp_path / "nodir" / "job.sbatch"
    result = CliRunner().invoke(main, ["slurm", "render", "--ranks-per-node", "4",
                                       "-o", str(out)])
    assert result.exit_code == 2, (result.output, result.exception)
    assert f"cannot write {out}: No such file or directory" in result.output, result.output
    assert not out.parent.exists()


def test_render_validates_the_model_for_the_layout(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[model]\nn_head = 8\nd_model = 64\n")
    result = CliRunner().invoke(main, ["slurm", "render", "--ranks-per-node", "3", "--tp", "3",
                                       "--config", str(cfg)])
    assert result.exit_code != 0 and "tp (3) must divide n_head (8)" in result.output


@pytest.mark.parametrize("train_args, message", [
    ("--microbatch 4", "No such option '--microbatch'. Did you mean '--microbatches'?"),
    ("--zero two", "Invalid value for '--zero': 'two' is not a valid integer"),
    ("--zero 9", "zero (9) must be 0, 1, 2 or 3"),
    ("--microbatches 3", "batch_size (8) must be a positive multiple of dp * microbatches "
                         "(2 * 3 = 6)"),
    ("--tp=2", "--tp is the job's own option: give it to render"),
    ("--config other.toml", "--config is the job's own option"),
    # the template's --run-dir "$RUN_DIR" came first, so this one won, silently
    ("--run-dir elsewhere", "--run-dir is the job's own option: the job's folder is "
                            "RUN_DIR, given to sbatch"),
    ("--resume=auto", "--resume is the job's own option: every attempt runs --resume auto"),
])
def test_render_reads_the_training_options_as_train_does(tmp_path, train_args, message):
    """--train-args go through `hpctrain train`'s own parser and the config's rules:
    a typo or a bad value fails at render, not when the job starts in the queue."""
    cfg = tmp_path / "c.toml"
    cfg.write_text("[model]\nn_head = 4\nd_model = 64\n[train]\nbatch_size = 8\n")
    result = CliRunner().invoke(main, ["slurm", "render", "--ranks-per-node", "2",
                                       "--config", str(cfg), "--train-args", train_args])
    assert result.exit_code != 0 and message in result.output, result.output
    result = CliRunner().invoke(main, ["slurm", "render", "--ranks-per-node", "2",
                                       "--config", str(cfg), "--train-args",
                                       "--microbatches 2 --zero 1 --steps 10"])
    assert result.exit_code == 0, result.output


def test_render_refuses_values_that_would_break_the_script():
    req = JobRequest(nodes=1, ranks_per_node=1, config='evil"; rm -rf /')
    with pytest.raises(ConfigError, match="must not contain"):
        render((TEMPLATES / "train.sbatch").read_text(), req, 1)
    # a newline in an #SBATCH value would add a directive of its own
    req = JobRequest(nodes=1, ranks_per_node=1, job_name="x\n#SBATCH --exclusive")
    with pytest.raises(ConfigError, match=r"--job-name \('x\\n#SBATCH --exclusive'\)"):
        render((TEMPLATES / "train.sbatch").read_text(), req, 1)


def test_a_template_without_the_lines_render_fills_is_refused(tmp_path):
    """A template lacking the lines render fills (here a README given as --template)
    was written out as the job, the layout and config silently dropped; and -o naming
    the template replaced it."""
    readme = Path(__file__).resolve().parents[1] / "README.md"
    result = CliRunner().invoke(main, ["slurm", "render", "--ranks-per-node", "2",
                                       "--template", str(readme), "-o",
                                       str(tmp_path / "job.sbatch")])
    assert result.exit_code == 2, result.output
    assert ("the template has no `#SBATCH --nodes` or `#SBATCH --ntasks-per-node` or "
            '`: "${CONFIG:=...}"` or `: "${TRAIN_ARGS:=...}"` line') in result.output
    assert not (tmp_path / "job.sbatch").exists()
    cut = tmp_path / "cut.sbatch"  # the shipped template without its CONFIG line
    cut.write_text("\n".join(line for line in (TEMPLATES / "train.sbatch").read_text()
                             .splitlines() if "${CONFIG:=" not in line))
    result = CliRunner().invoke(main, ["slurm", "render", "--ranks-per-node", "2",
                                       "--template", str(cut)])
    assert result.exit_code == 2 and 'no `: "${CONFIG:=...}"` line' in result.output
    mine = tmp_path / "mine.sbatch"
    mine.write_text((TEMPLATES / "train.sbatch").read_text())
    before = mine.read_text()
    result = CliRunner().invoke(main, ["slurm", "render", "--ranks-per-node", "2",
                                       "--template", str(mine), "-o", str(mine)])
    assert result.exit_code == 2 and "is the --template" in result.output
    assert mine.read_text() == before


def test_blas_threads_and_tensor_group_warning(monkeypatch):
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "3")
    assert blas_threads_per_rank(4) == 3
    monkeypatch.delenv("SLURM_CPUS_PER_TASK")
    assert blas_threads_per_rank(10_000) == 1
    assert tensor_group_warning(NodeLayout(0, 1, 4, False), 2) is None
    assert "spans nodes" in tensor_group_warning(NodeLayout(0, 2, 3, True), 2)


def test_templates_folder_is_the_repository_one():
    assert TEMPLATES == Path(__file__).resolve().parents[1] / "jobscripts"


def test_prep_job_exits_with_the_status_of_the_step_that_failed(tmp_path):
    """A partition that fails with status 5 ends the job with 5, not with the 1 of a
    test between the steps."""
    prep = tmp_path / "prep"
    prep.write_text('#!/bin/sh\necho "$1" >> "$(dirname "$0")/calls"\n'
                    '[ "$1" = partition ] && exit 5\nexit 0\n')
    prep.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n0",
           "PREP": str(prep), "SHARDS": "2", "OUTPUT": str(tmp_path / "d.h5")}
    result = subprocess.run(["bash", str(TEMPLATES / "prep.sbatch")], capture_output=True,
                            text=True, env=env, timeout=30)
    assert result.returncode == 5, (result.stdout, result.stderr)
    assert "preparation exited with status 5" in result.stdout
    assert (tmp_path / "calls").read_text().split() == ["text", "partition"]  # no verify
