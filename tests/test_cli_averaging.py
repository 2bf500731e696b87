"""``hpctrain train`` with averaging strategies and batch shares under ``mpiexec -n 2``,
through the real loader, training loop and checkpoints:

* unequal fixed shares give the loss curve of one rank, and so does a run resumed
  with other shares than it saved with (the global batches are the same: nothing lost
  or repeated), each step recording the shares and every rank's compute time;
* measured shares run and record what they chose;
* an averaging run records the bytes it sent: a fraction of synchronous training's;
* a local strategy's checkpoint refuses to resume at another dp, by name.
"""

import json

import numpy as np
import pytest

from hpctrain.testing import run_train, tiny_corpus_config, tiny_gpt_template

CONFIG = tiny_gpt_template(train="steps = 6\nbatch_size = 12")


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    return tiny_corpus_config(tmp_path_factory.mktemp("cli_averaging"), CONFIG,
                              "the quality of mercy is not strained.", 300)


def run(config_file, ranks, name, *flags):
    run_dir = config_file.parent / name
    result = run_train(ranks, config_file, run_dir, *flags)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


@pytest.fixture(scope="module")
def serial(config_file):
    return [r["loss"] for r in run(config_file, 1, "serial")]


@pytest.mark.slow
def test_fixed_shares_and_a_resume_with_other_shares_give_the_serial_curve(config_file,
                                                                            serial):
    records = run(config_file, 2, "fixed", "--shares", "fixed", "--batch-shares", "8,4")
    np.testing.assert_allclose([r["loss"] for r in records], serial, rtol=1e-10)
    assert all(r["batch_shares"] == [8, 4] and len(r["rank_compute_s"]) == 2
               for r in records)
    # saved after step 3 with (8, 4); resumed from there with the shares the other way
    run(config_file, 2, "saved", "--shares", "fixed", "--batch-shares", "8,4",
        "--save-interval", "3", "--keep", "2")
    step3 = config_file.parent / "saved" / "checkpoints" / "step-000003"
    resumed = run(config_file, 2, "changed", "--shares", "fixed", "--batch-shares", "2,10",
                  "--resume", str(step3))
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert all(r["batch_shares"] == [2, 10] for r in resumed)
    np.testing.assert_allclose([r["loss"] for r in resumed], serial[3:], rtol=1e-10)


@pytest.mark.slow
def test_measured_shares_record_their_choice(config_file):
    want = [r["loss"] for r in run(config_file, 1, "serial14", "--steps", "14")]
    records = run(config_file, 2, "measured", "--shares", "measured", "--steps", "14")
    shares = [r["batch_shares"] for r in records]
    assert all(sum(s) == 12 and min(s) >= 1 for s in shares)
    assert shares[:10] == [[6, 6]] * 10  # equal until measured, after step 10
    # whatever the shares, the update is the global mean: the serial curve
    np.testing.assert_allclose([r["loss"] for r in records], want, rtol=1e-10)


@pytest.mark.slow
def test_periodic_averaging_sends_a_fraction_of_the_bytes(config_file):
    sync = run(config_file, 2, "sync")
    local = run(config_file, 2, "periodic", "--averaging", "periodic", "--average-every", "3")
    sync_bytes = sum(r["dp_bytes"] for r in sync)
    local_bytes = sum(r["dp_bytes"] for r in local)
    assert [r["averaged"] for r in local] == [False, False, True] * 2
    assert local_bytes == pytest.approx(sync_bytes / 3, rel=1e-9)  # params = grads in size


def test_a_local_checkpoint_resumes_only_at_its_dp(config_file):
    run(config_file, 2, "local", "--averaging", "diloco", "--average-every", "2",
        "--steps", "3", "--save-interval", "3")
    result = run_train(1, config_file, config_file.parent / "local", "--averaging", "diloco",
                       "--average-every", "2", "--resume", "auto")
    assert result.returncode != 0
    assert "saved with averaging 'diloco' at dp 2; this run has 'diloco' at dp 1" in \
        result.stderr


def test_hierarchical_averaging_on_one_node_is_one_error_line(config_file):
    """Every rank sees the same node table and raised alike, but after start-up: each
    printed the error and called MPI_Abort (two lines and an abort's status)."""
    result = run_train(2, config_file, config_file.parent / "hier1", "--averaging",
                       "hierarchical", "--average-every", "2", "--steps", "2")
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.splitlines() if "needs the data group on two" in line]
    assert len(lines) == 1 and lines[0].startswith("error: averaging 'hierarchical'"), \
        result.stderr
