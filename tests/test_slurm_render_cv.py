"""``hpctrain slurm render --command cv``: a cross-validation job script, checked by cv's
own rules before it is written, whose command cv accepts (parsed by its parser, and run
through the rendered script with SLURM's environment and a stand-in ``srun``)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpctrain.cli import main
from hpctrain.crossval import cv_command
from hpctrain.testing import tiny_dlrm_config

HPCTRAIN = Path(sys.executable).parent / "hpctrain"


@pytest.fixture
def dlrm(tmp_path, ratings_h5):
    return tiny_dlrm_config(tmp_path / "dlrm.toml", ratings_h5,
                            "steps = 3\nbatch_size = 8\neval_interval = 3")


def render(*args):
    return CliRunner().invoke(main, ["slurm", "render", "--command", "cv", *args])


def default(script: str, name: str) -> str:
    return re.search(rf'^: "\$\{{{name}:=(.*?)\}}"', script, re.MULTILINE).group(1)


def cv_line(template: str) -> list[str]:
    """The words of the template's cv command, its variables named."""
    line = re.search(r"^\s*cv\) run=\((cv [^)]*)\)", template, re.MULTILINE).group(1)
    return [w.strip('"') for w in line.split()]


def test_render_writes_a_cv_job_whose_command_cv_accepts(tmp_path, dlrm):
    out = tmp_path / "cv.sbatch"
    result = render("--ranks-per-node", "2", "--config", str(dlrm),
                    "--train-args", "--folds 2 --steps 3", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert f"hpctrain cv at {dlrm}'s layout; submit with: sbatch {out}" in result.output
    script = out.read_text()
    assert default(script, "COMMAND") == "cv"
    assert default(script, "TRAIN_ARGS") == "--folds 2 --steps 3"  # no --dp/--tp/--pp
    assert "#SBATCH --job-name=hpctrain-cv " in script
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0
    # the job's command line as the script builds it, through cv's own parser
    values = {"$CONFIG": default(script, "CONFIG"), "$RUN_DIR": str(tmp_path / "run")}
    words = [values.get(w, w) for w in cv_line(script)]
    assert words[0] == "cv"
    params = cv_command.make_context("cv", [*words[1:],
                                            *default(script, "TRAIN_ARGS").split()]).params
    assert params["folds"] == 2 and params["steps"] == 3 and params["resume"]
    assert params["config_path"] == str(dlrm)


def test_the_rendered_cv_job_runs(tmp_path, dlrm):
    """The rendered script itself, with the environment SLURM gives a job and an srun
    that runs its command once: cv starts, trains both folds, writes cv.json."""
    out = tmp_path / "cv.sbatch"
    result = render("--ranks-per-node", "1", "--config", str(dlrm), "--launcher", "srun",
                    "--hpctrain", str(HPCTRAIN), "--train-args", "--folds 2", "-o", str(out))
    assert result.exit_code == 0, result.output
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    srun = bin_ / "srun"
    srun.write_text('#!/bin/sh\nwhile [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n')
    srun.chmod(0o755)
    env = {"PATH": f"{bin_}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1",
           "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_NODELIST": "n0", "OMP_NUM_THREADS": "1",
           "RUN_DIR": str(tmp_path / "run")}
    job = subprocess.run(["bash", str(out)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert job.returncode == 0, (job.stdout, job.stderr)
    assert "2-fold cross-validation" in job.stdout and "RMSE per fold:" in job.stdout
    assert "job 7: hpctrain cv exited with status 0" in job.stdout
    assert json.loads((tmp_path / "run" / "cv.json").read_text())["folds"] == [0, 1]


@pytest.mark.parametrize("args, message", [
    (["--tp", "2"], "hpctrain cv takes no --dp, --tp or --pp (--tp 2): it runs the layout "
                    "of its config's [parallel] table"),
    (["--dp", "2"], "hpctrain cv takes no --dp, --tp or --pp (--dp 2)"),
    (["--train-args", "--fold 2"], "--train-args ('--fold 2'): No such option '--fold'. "
                                   "Did you mean '--folds'? (hpctrain cv --help"),
    (["--train-args", "--microbatches 2"], "No such option '--microbatches'"),
    (["--train-args", "--run-dir x"], "--run-dir is the job's own option"),
    (["--train-args", "--config=x.toml"], "--config is the job's own option"),
    (["--train-args", "--folds 9"], "--folds (9) must be between 1 and the 5 folds"),
    (["--train-args", "--folds 0"], "--folds (0) must be between 1 and the 5 folds"),
    (["--train-args", "--steps many"], "Invalid value for '--steps': 'many' is not a valid "
                                       "integer"),
])
def test_render_refuses_what_cv_would_refuse_and_writes_nothing(tmp_path, dlrm, args, message):
    out = tmp_path / "cv.sbatch"
    result = render("--ranks-per-node", "2", "--config", str(dlrm), "-o", str(out), *args)
    assert result.exit_code == 2, (result.output, result.exception)
    assert message in result.output and "Traceback" not in result.output, result.output
    assert not out.exists()


def test_render_refuses_a_config_cv_cannot_run(tmp_path, dlrm):
    text = dlrm.read_text()
    cases = [(text.replace("eval_interval = 3", "eval_interval = 0"),
              "eval_interval (0) must be > 0: cv reads each fold's RMSE"),
             (text.replace('[train]', '[parallel]\ndp = 3\n[train]'), "dp"),
             ('[model]\nn_head = 4\nd_model = 64\n', "its model (gpt) reads hpctrain.tokens "
                                                     "data; hpctrain cv validates models of "
                                                     "hpctrain.ratings data")]
    for i, (config, message) in enumerate(cases):
        path = tmp_path / f"c{i}.toml"
        path.write_text(config)
        result = render("--ranks-per-node", "2", "--config", str(path))
        assert result.exit_code == 2 and message in result.output, (message, result.output)


def test_train_stays_the_default_with_its_layout(tmp_path):
    result = CliRunner().invoke(main, ["slurm", "render", "--ranks-per-node", "2"])
    assert result.exit_code == 0, result.output
    assert default(result.output, "COMMAND") == "train"
    assert default(result.output, "TRAIN_ARGS") == "--dp 2 --tp 1 --pp 1"
    assert "#SBATCH --job-name=hpctrain-train " in result.output


def test_render_never_writes_over_its_config_or_template_and_asks_before_replacing(
        tmp_path, dlrm):
    """-o the --config (or the --template): refused even with --force, both intact; an
    existing script is replaced only with --force."""
    config = dlrm.read_text()
    template = tmp_path / "job.tmpl"
    template.write_text((Path(__file__).parents[1] / "jobscripts" / "train.sbatch").read_text())
    for force in ([], ["--force"]):
        result = render("--ranks-per-node", "2", "--config", str(dlrm), "-o", str(dlrm),
                        *force)
        assert result.exit_code == 2 and f"{dlrm}: is the --config file, which -o never " \
            "replaces (not even with --force)" in result.output, result.output
        result = render("--ranks-per-node", "2", "--config", str(dlrm), "--template",
                        str(template), "-o", str(template), *force)
        assert result.exit_code == 2 and "is the --template file" in result.output, \
            result.output
    assert dlrm.read_text() == config
    out = tmp_path / "cv.sbatch"
    out.write_text("an older script\n")
    result = render("--ranks-per-node", "2", "--config", str(dlrm), "-o", str(out))
    assert result.exit_code == 2 and "already exists; pass --force" in result.output
    assert out.read_text() == "an older script\n"
    result = render("--ranks-per-node", "2", "--config", str(dlrm), "-o", str(out), "--force")
    assert result.exit_code == 0, result.output
    assert out.read_text().startswith("#!") and out.stat().st_mode & 0o111


def test_render_names_a_template_or_dataset_that_is_no_text_or_not_ratings(tmp_path, dlrm,
                                                                          tokens_h5):
    result = render("--ranks-per-node", "2", "--config", str(dlrm), "--template",
                    str(tokens_h5))
    assert result.exit_code == 2 and "is not a text file" in result.output, result.output
    assert "Traceback" not in result.output
    wrong = tmp_path / "wrong.toml"
    wrong.write_text(re.sub(r'path = ".*?"', f'path = "{tokens_h5}"', dlrm.read_text()))
    result = render("--ranks-per-node", "2", "--config", str(wrong), "--train-args",
                    "--folds 3")
    assert result.exit_code == 2 and "not hpctrain.ratings" in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
