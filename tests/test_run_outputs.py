"""What a run writes, checked before it trains: the run folder, the checkpoints folder
in it, the trace's folder and a resumed run's metrics file; and what the last lines of
a resumed run say. Each failure is one line naming the path, exit status 2, before the
first step (nothing written), at 2 ranks as at one."""

import io
import json

import pytest
from click.testing import CliRunner

from hpctrain.metrics import MetricsError, MetricsWriter, read_metrics
from hpctrain.plot_cli import plot
from hpctrain.testing import run_train, tiny_corpus_config

CONFIG = """
[model]
seq_len = 16
n_layer = 1
n_head = 2
d_model = 16
[train]
steps = 4
batch_size = 4
lr = 3e-3
min_lr = 3e-4
warmup_steps = 1
eval_interval = 0
save_interval = 2
seed = 5
[data]
path = "{data}"
"""

RECORDS = [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.25}]


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    return tiny_corpus_config(tmp_path_factory.mktemp("outputs"), CONFIG,
                              "all the world's a stage.", 200)


def lines(records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def test_a_last_line_cut_off_mid_record_is_left_out_and_said(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(lines(RECORDS) + '{"step": 3, "lo')  # the write of step 3 cut short
    assert read_metrics(path) == RECORDS
    stream = io.StringIO()
    MetricsWriter(tmp_path, resume_after=2, stream=stream).close()
    assert path.read_text() == lines(RECORDS)
    assert "its last line was cut off mid-record" in stream.getvalue()


@pytest.mark.parametrize("bad, rule", [('{"step": 2, "lo\n', "not a JSON record"),
                                       ("[1, 2]\n", "a JSON list, not a record")])
def test_a_bad_line_before_the_last_names_the_file_and_line(tmp_path, bad, rule):
    path = tmp_path / "metrics.jsonl"
    path.write_text(lines(RECORDS[:1]) + bad + lines(RECORDS[1:]))
    with pytest.raises(MetricsError, match=rf"metrics.jsonl, line 2: {rule}"):
        read_metrics(path)
    result = CliRunner().invoke(plot, [str(tmp_path)])
    assert result.exit_code == 1 and "line 2:" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("bad, rule", [('{"step": "a", "loss": "x"}', "step ('a')"),
                                       ('{"step": 2, "loss": null}', "loss (None)"),
                                       ('{"step": 2, "val_loss": true}', "val_loss (True)")])
def test_a_value_that_is_not_a_number_names_its_record_and_field(tmp_path, bad, rule):
    (tmp_path / "metrics.jsonl").write_text(lines(RECORDS[:1]) + bad + "\n"
                                            + lines(RECORDS[1:]))
    result = CliRunner().invoke(plot, [str(tmp_path)])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert f"metrics.jsonl: record 2: {rule} must be a number" in result.output
    assert not (tmp_path / "loss.png").exists()


def refused(result, *words: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "MPI_Abort" not in result.stderr, result.stderr
    for word in words:
        assert word in result.stderr, result.stderr


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_run_folder_that_cannot_be_made_is_refused_before_training(config_file, tmp_path,
                                                                     ranks):
    (tmp_path / "afile").write_text("x")
    result = run_train(ranks, config_file, tmp_path / "afile" / "run")
    # rank 0 writes the run's files and checks the folder; every rank stops
    where = "" if ranks == 1 else " (rank 0)"
    refused(result, f"error{where}: the run folder (--run-dir)",
            "afile/run: cannot be made or written to (Not a directory); choose another")


def test_a_checkpoints_file_in_the_run_folder_is_refused_before_training(config_file,
                                                                         tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("x")
    result = run_train(2, config_file, run)
    refused(result, "checkpoints is a file, where the run keeps its checkpoints")
    assert not (run / "metrics.jsonl").exists()


def test_a_trace_that_cannot_be_written_is_refused_before_training(config_file, tmp_path):
    (tmp_path / "afile").write_text("x")
    run = tmp_path / "run"
    result = run_train(2, config_file, run, "--trace", str(tmp_path / "afile" / "t.json"))
    refused(result, "--trace's folder", "cannot be made or written to")
    assert not (run / "metrics.jsonl").exists()


def test_a_resume_keeps_the_records_before_a_cut_line_and_says_what_it_trained(config_file,
                                                                              tmp_path):
    run = tmp_path / "run"
    result = run_train(2, config_file, run, "--steps", "4")
    assert result.returncode == 0, result.stderr
    assert "done: 4 steps in" in result.stdout
    metrics = run / "metrics.jsonl"
    text = metrics.read_text()
    metrics.write_text(text[:-40])  # the last record (step 4) cut off
    # the latest checkpoint is step 4: move it back to step 2, as if the job had
    # ended while step 4 was being written
    (run / "checkpoints" / "latest").write_text("step-000002\n")
    result = run_train(2, config_file, run, "--steps", "6", "--resume", "auto")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "its last line was cut off mid-record" in out
    assert "done: steps 3-6 (4 trained)" in out, out
    # the saved schedule ended at step 4: steps 5-6 run at min_lr, and the run says so
    assert "warning: the schedule ends at step 4 and the run goes on to step 6: steps 5-6 " \
           "train at min_lr 3.00e-04" in out, out
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2, 3, 4, 5, 6]
    result = run_train(1, config_file, run, "--steps", "3", "--resume", "auto")
    assert result.returncode == 0, result.stderr
    assert "done: no step left to train (the checkpoint is at step 6, --steps 3)" in \
        result.stdout
    # nothing left to train past the schedule's end: no warning about steps 7-6
    result = run_train(1, config_file, run, "--steps", "6", "--resume", "auto")
    assert result.returncode == 0, result.stderr
    assert "no step left to train" in result.stdout and "warning" not in result.stdout, \
        result.stdout


def test_an_empty_resume_is_refused_not_taken_for_a_fresh_run(config_file, tmp_path):
    result = run_train(2, config_file, tmp_path / "run", "--resume", "")
    assert result.returncode == 2 and "--resume: empty: give 'auto'" in result.stderr
    assert not (tmp_path / "run").exists()


def test_a_recomputation_the_built_model_cannot_take_is_one_line_on_every_rank(config_file,
                                                                              tmp_path):
    # only the built pieces show it (no attention in the first piece): refused in the
    # start-up check, not by a traceback and MPI_Abort from inside the engine's build
    result = run_train(2, config_file, tmp_path / "run", "--recompute", "attention",
                       "--recompute-pieces", "first")
    refused(result, "error: recompute ('attention') recomputes attention, but pieces "
                    "['first'] of the GPT hold no attention layer")
    assert result.stderr.count("error") == 1


def test_a_resume_with_no_step_left_keeps_one_record_of_its_evaluation(config_file,
                                                                       tmp_path):
    # each rerun of a finished run evaluated its checkpoint and appended the record again
    cfg = tmp_path / "eval.toml"
    cfg.write_text(config_file.read_text().replace("eval_interval = 0", "eval_interval = 2"))
    run = tmp_path / "run"
    for flags in ((), ("--resume", "auto"), ("--resume", "auto")):
        result = run_train(1, cfg, run, "--steps", "2", *flags)
        assert result.returncode == 0, result.stderr
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 2], records
    assert "val_loss" in records[-1] and "loss" not in records[-1]


def test_a_resume_inside_the_warm_up_says_nothing_of_min_lr(config_file, tmp_path):
    # a schedule of 3 steps with a warm-up of 30 still warms up at steps 4-5 (lr_at):
    # the warning said they train at min_lr
    cfg = tmp_path / "warm.toml"
    cfg.write_text(config_file.read_text().replace("warmup_steps = 1", "warmup_steps = 30"))
    run = tmp_path / "run"
    assert run_train(1, cfg, run, "--steps", "3", "--save-interval", "3").returncode == 0
    result = run_train(1, cfg, run, "--steps", "5", "--resume", "auto")
    assert result.returncode == 0, result.stderr
    assert "train at min_lr" not in result.stdout, result.stdout
    lrs = [r["lr"] for r in read_metrics(run / "metrics.jsonl")]
    assert lrs == sorted(lrs) and lrs[-1] < 3e-3  # still rising to lr


def test_the_trace_never_replaces_the_runs_own_records(config_file, tmp_path):
    run = tmp_path / "run"
    result = run_train(1, config_file, run, "--steps", "1", "--trace",
                       str(run / "metrics.jsonl"))
    assert result.returncode == 2 and "is the run's own metrics.jsonl" in result.stderr, \
        result.stderr


def test_a_run_that_diverges_still_writes_its_trace(config_file, tmp_path):
    # the trace was written only at a normal end: the steps that diverged were lost
    import json

    run = tmp_path / "run"
    result = run_train(1, config_file, run, "--lr", "1e6", "--steps", "12",
                       "--trace", str(tmp_path / "t.json"))
    assert result.returncode == 4, result.stderr
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert any(e.get("name") == "step" for e in events)


def test_a_fresh_run_of_no_steps_evaluates_and_says_so(config_file, tmp_path):
    cfg = tmp_path / "eval.toml"
    cfg.write_text(config_file.read_text().replace("eval_interval = 0", "eval_interval = 2"))
    result = run_train(1, cfg, tmp_path / "run", "--steps", "0")
    assert result.returncode == 0, result.stderr
    assert "step 0/0 | val " in result.stdout and "done: 0 steps in" in result.stdout, \
        result.stdout
