"""``hpctrain train --precision``, ``--loss-scale`` and ``--grad-comm-dtype``: the flags
reach the run (fp16's metrics record the fixed scale given), and a bad value is refused
by name before anything runs."""

import json

import pytest

from hpctrain.testing import run_train, tiny_corpus_config, tiny_gpt_template

CONFIG = tiny_gpt_template(train="steps = 3\nbatch_size = 4\nsave_interval = 3").replace(
    'dtype = "float64"', 'dtype = "float32"')  # 16-bit storage computes in float32


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    return tiny_corpus_config(tmp_path_factory.mktemp("cli_precision"), CONFIG,
                              "the quality of mercy is not strained.", 300)


def test_fp16_with_a_fixed_scale_reaches_the_run(config_file):
    run_dir = config_file.parent / "run_fp16"
    result = run_train(1, config_file, run_dir, "--precision", "fp16", "--loss-scale", "1024")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert [r["loss_scale"] for r in records if "loss" in r] == [1024.0] * 3
    assert (run_dir / "checkpoints" / "latest").exists()


def test_bad_values_are_refused_by_name(config_file):
    result = run_train(1, config_file, config_file.parent / "bad1", "--precision", "fp8")
    assert result.returncode == 2 and "'fp8' is not one of 'fp32', 'bf16', 'fp16'" \
        in result.stderr
    result = run_train(1, config_file, config_file.parent / "bad2", "--grad-comm-dtype",
                       "int8")
    assert result.returncode == 2 and "'int8' is not one of 'fp32', 'bf16'" in result.stderr


def test_the_gradient_sum_dtype_reaches_the_config_checks(config_file):
    """--grad-comm-dtype bf16 with --zero 1 is refused by the rule on [parallel]: the flag
    got there (without it, --zero 1 alone is a valid run)."""
    result = run_train(1, config_file, config_file.parent / "bad3", "--grad-comm-dtype",
                       "bf16", "--zero", "1")
    assert result.returncode == 2
    assert "grad_comm_dtype (\"bf16\") replaces the flat all-reduce of zero 0" in result.stderr
