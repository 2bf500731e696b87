"""Data against model: every dataset records what it holds, and training checks it
against the model on every rank before the first step."""

from __future__ import annotations

import sys

import h5py
import pytest

from data_prep.partition import partition
from hpctrain.config import ModelConfig
from hpctrain.data.contents import check_fits, read_contents
from hpctrain.data.format import DataError
from hpctrain.testing import run_mpi


def test_prepared_files_record_what_they_hold(tmp_path, datasets):
    tokens = read_contents(datasets.make_tokens(tmp_path / "t.h5"))
    with h5py.File(tmp_path / "t.h5") as f:
        biggest = max(int(f["train"][...].max()), int(f["val"][...].max()))
    assert (tokens.format, tokens.vocab_size, tokens.max_token) == \
        ("hpctrain.tokens", 256, biggest)
    images = read_contents(datasets.make_images(tmp_path / "i.h5"))
    assert (images.format, images.n_classes, images.image_shape) == \
        ("hpctrain.images", 10, (28, 28))


@pytest.mark.parametrize("kind", ["tokens", "images"])
def test_a_partition_carries_the_contents_in_its_manifest_and_shards(tmp_path, datasets,
                                                                     kind):
    make = datasets.make_tokens if kind == "tokens" else datasets.make_images
    source = make(tmp_path / f"{kind}.h5")
    out = partition(source, tmp_path / "parts", num_shards=3, row_size=64)
    whole = read_contents(source)
    for path in (out, out.parent, out.parent / "shard-00001.h5"):
        got = read_contents(path)
        assert (got.format, got.vocab_size, got.max_token, got.n_classes,
                got.image_shape) == (whole.format, whole.vocab_size, whole.max_token,
                                     whole.n_classes, whole.image_shape)


def test_each_mismatch_names_both_values_and_the_fix(tmp_path, datasets):
    tokens = read_contents(datasets.make_tokens(tmp_path / "t.h5"))
    images = read_contents(datasets.make_images(tmp_path / "i.h5"))
    check_fits(tokens, ModelConfig(kind="gpt", vocab_size=256))
    check_fits(images, ModelConfig(kind="mlp", input_dim=784, n_classes=10))
    cases = [
        (tokens, ModelConfig(kind="gpt", vocab_size=64),
         r"vocabulary of 256, largest token id \d+; the model's vocab_size \(64\) must be at "
         r"least 256: set \[model\] vocab_size = 256"),
        (images, ModelConfig(kind="mlp", input_dim=100),
         r"images of 28 x 28 = 784 values; the model's input_dim \(100\) must equal 784"),
        (images, ModelConfig(kind="mlp", n_classes=5),
         r"holds 10 classes; the model's n_classes \(5\) must be at least 10"),
        (images, ModelConfig(kind="gpt"),
         r"holds images \(hpctrain.images\), which a mlp or cnn model trains on; the config's "
         r"\[model\] kind is 'gpt'"),
        (tokens, ModelConfig(kind="mlp"),
         r"holds a token stream \(hpctrain.tokens\), which a gpt model trains on; the "
         r"config's \[model\] kind is 'mlp'"),
    ]
    for contents, model, message in cases:
        with pytest.raises(DataError, match=message):
            check_fits(contents, model)


def test_ratings_are_for_the_dlrm(tmp_path, datasets):
    ratings = read_contents(datasets.make_ratings(tmp_path / "r.h5"))
    with pytest.raises(DataError, match=r"which a dlrm model trains on; the config's \[model\] "
                                        r"kind is 'gpt': set kind = \"dlrm\""):
        check_fits(ratings, ModelConfig())


def test_training_a_small_vocabulary_on_bytes_is_one_line_on_every_rank(tmp_path, datasets):
    data = datasets.make_tokens(tmp_path / "t.h5")
    config = tmp_path / "v64.toml"
    config.write_text(f"[model]\nvocab_size = 64\nseq_len = 16\nn_layer = 1\nn_head = 2\n"
                      f"d_model = 16\n[train]\nsteps = 2\nbatch_size = 4\n"
                      f"[data]\npath = \"{data}\"\n")
    result = run_mpi(2, [sys.executable, "-m", "hpctrain.cli", "train", "--config",
                         str(config), "--run-dir", str(tmp_path / "run")], timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("the model's vocab_size (64) must be at least 256") == 1
    assert "IndexError" not in result.stderr and "Traceback" not in result.stderr
