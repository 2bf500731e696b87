"""``hpctrain train --zero 0|1|2`` under ``mpiexec -n 2`` gives the loss curve of one
rank, through the real loader and training loop, and logs the overlap figures; a bad
stage is refused with the rule."""

import json

import numpy as np
import pytest

from hpctrain.testing import run_train, tiny_corpus_config, tiny_gpt_template

CONFIG = tiny_gpt_template(train="steps = 4\nbatch_size = 4", parallel="bucket_mb = 0.01")


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    return tiny_corpus_config(tmp_path_factory.mktemp("cli_zero"), CONFIG,
                              "the quality of mercy is not strained.", 300)


def run(config_file, ranks, *flags):
    run_dir = config_file.parent / "_".join(["run", str(ranks), *flags]).replace("-", "")
    result = run_train(ranks, config_file, run_dir, *flags)
    return result, run_dir


@pytest.mark.slow
def test_every_zero_stage_at_dp_2_matches_one_rank(config_file):
    result, run_dir = run(config_file, 1)
    assert result.returncode == 0, result.stderr
    want = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").open()]
    for zero in ("0", "1", "2", "3"):
        result, run_dir = run(config_file, 2, "--zero", zero)
        assert result.returncode == 0, result.stderr
        assert f"(zero {zero}): parameters" in result.stdout  # the memory line
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
        np.testing.assert_allclose([r["loss"] for r in records], want, rtol=1e-8,
                                   err_msg=f"--zero {zero}")
        if zero != "3":  # ZeRO-3 has no gradient buckets: a unit is reduced when final
            assert all(r["dp_buckets_early"] >= 0 and r["dp_wait_s"] >= 0 for r in records)


def test_a_bad_zero_stage_names_the_rule(config_file):
    result, _ = run(config_file, 1, "--zero", "4")
    assert result.returncode == 2
    assert "zero (4) must be 0, 1, 2 or 3" in result.stderr
