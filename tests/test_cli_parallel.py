"""``hpctrain train --tp 2`` under ``mpiexec -n 2`` gives the loss curve of ``--tp 1``,
with and without ``--sequence-parallel``, and so does ``--dp-reduce hierarchical`` with
ZeRO 1 (the two ranks on one node: reduce and scatter in the node), on a tiny
byte-level corpus prepared with ``hpctrain-prep text``."""

import json
import textwrap

import numpy as np
import pytest

from hpctrain.testing import run_train, tiny_corpus_config

CONFIG = textwrap.dedent("""
    [model]
    dtype = "float64"
    vocab_size = 256
    seq_len = 16
    n_layer = 2
    n_head = 4
    d_model = 32

    [train]
    steps = 4
    batch_size = 4
    warmup_steps = 1
    eval_interval = 2
    eval_batches = 2
    log_interval = 1

    [data]
    path = "{data}"
""")


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    return tiny_corpus_config(tmp_path_factory.mktemp("cli_tp"), CONFIG,
                              "to be, or not to be, that is the question.", 400)


def run_dir_of(config_file, ranks, *flags):
    return config_file.parent / "_".join(["run", str(ranks), *flags]).replace("-", "")


def run(config_file, ranks, *flags):
    run_dir = run_dir_of(config_file, ranks, *flags)
    result = run_train(ranks, config_file, run_dir, "--quiet", *flags)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return records


@pytest.fixture(scope="module")
def serial(config_file):
    return run(config_file, 1, "--tp", "1")


def assert_same_curves(parallel, serial, flags):
    for key in ("loss", "val_loss"):
        want = [r[key] for r in serial if key in r]
        got = [r[key] for r in parallel if key in r]
        assert len(got) == len(want) > 0
        np.testing.assert_allclose(got, want, rtol=1e-8, err_msg=f"{key} {flags}")


@pytest.mark.slow
def test_train_tp_2_matches_tp_1(config_file, serial):
    for flags in (["--tp", "2"], ["--tp", "2", "--sequence-parallel"]):
        parallel = run(config_file, 2, *flags)
        assert_same_curves(parallel, serial, flags)
        assert all(r["tp_comm_bytes"] > 0 for r in parallel if "loss" in r)
        assert ("sp_activation_bytes_saved" in parallel[-1]) == ("--sequence-parallel" in flags)


@pytest.mark.slow
def test_train_dp_2_hierarchical_matches_serial(config_file, serial):
    flags = ["--dp", "2", "--zero", "1", "--dp-reduce", "hierarchical"]
    assert_same_curves(run(config_file, 2, *flags), serial, flags)
    saved = json.loads((run_dir_of(config_file, 2, *flags) / "config.json").read_text())
    assert saved["parallel"]["dp_reduce"] == "hierarchical"


def test_sequence_parallelism_at_tp_1_is_named_as_changing_nothing(config_file):
    # it was taken silently: a user who asked for it saw no saving and no reason
    run_dir = run_dir_of(config_file, 1, "--sequence-parallel")
    result = run_train(1, config_file, run_dir, "--sequence-parallel", "--steps", "1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("warning: sequence parallelism shards the activations over "
                               "the tensor-parallel group; at tp 1 it changes nothing") == 1
    plain = run_train(1, config_file, run_dir_of(config_file, 1, "x"), "--steps", "1")
    assert plain.returncode == 0 and "sequence parallelism" not in plain.stdout
