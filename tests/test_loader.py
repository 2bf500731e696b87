"""The loader: batch contents and shapes, dp independence of unpartitioned files,
exact resume, prefetch, partitioned reads and shard assignment, and every refusal."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import h5py
import numpy as np
import pytest

from data_prep.partition import partition
from hpctrain import config
from hpctrain.data import DataError, assign_shards, eval_batches, open_loader
from hpctrain.data.format import lock_problem
from hpctrain.testing import hdf5_held_for_writing

ROOT = Path(__file__).resolve().parents[1]


def draw(path, steps, **kw):
    with open_loader(path, **kw) as loader:
        return [loader.next_batch() for _ in range(steps)]


def concat_ranks(path, steps, dp_size, **kw):
    """The global batches, rebuilt from every rank's part."""
    per_rank = [draw(path, steps, dp_rank=r, dp_size=dp_size, **kw) for r in range(dp_size)]
    return [tuple(np.concatenate([per_rank[r][s][i] for r in range(dp_size)])
                  for i in range(2)) for s in range(steps)]


def split_bytes(path, split) -> bytes:
    with h5py.File(path) as f:
        return f[split][...].tobytes()


# ---------------------------------------------------------------------------------
# what a batch holds


def test_token_batches(tokens_h5):
    text = split_bytes(tokens_h5, "train")
    with open_loader(tokens_h5, batch_size=8, dp_rank=1, dp_size=2, seed=3, seq_len=16) as ld:
        assert ld.num_samples == (len(text) - 16) // 2
        x, y = ld.next_batch()
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == np.int64
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
    for xr, yr in zip(x, y, strict=True):
        window = bytes(xr.astype(np.uint8).tolist() + [int(yr[-1])])
        assert window in text


def test_image_batches(images_h5, datasets):
    with h5py.File(images_h5) as f:
        images, labels = f["train/images"][...], f["train/labels"][...]
    with open_loader(images_h5, batch_size=12, dp_rank=0, dp_size=3, seed=0) as ld:
        x, y = ld.next_batch()
    assert x.shape == (4, 784) and x.dtype == np.float32 and y.dtype == np.int64
    assert 0.0 <= x.min() and x.max() <= 1.0
    ids = datasets.image_ids(x)
    np.testing.assert_allclose(x, images[ids].reshape(4, 784) / 255, rtol=1e-6)
    np.testing.assert_array_equal(y, labels[ids])


# ---------------------------------------------------------------------------------
# unpartitioned: the global batch does not depend on dp


@pytest.mark.parametrize("kind", ["tokens", "images"])
def test_global_batch_is_independent_of_dp(tmp_path, datasets, kind):
    path = getattr(datasets, f"make_{kind}")(tmp_path / f"{kind}.h5")
    kw = {"batch_size": 8, "seed": 11, "seq_len": 10 if kind == "tokens" else None}
    steps = 45  # images: 300 rows, 8 per step: crosses an epoch boundary
    serial = concat_ranks(path, steps, 1, **kw)
    for dp in (2, 4):
        for s, (a, b) in enumerate(zip(serial, concat_ranks(path, steps, dp, **kw),
                                       strict=True)):
            np.testing.assert_array_equal(a[0], b[0], err_msg=f"dp {dp} step {s}")
            np.testing.assert_array_equal(a[1], b[1], err_msg=f"dp {dp} step {s}")


def test_image_epoch_covers_every_row_once(images_h5, datasets):
    # 300 rows, global batch 10 on 2 ranks: 30 steps per epoch
    for dp_rank in range(2):
        with open_loader(images_h5, batch_size=10, dp_rank=dp_rank, dp_size=2, seed=4) as ld:
            assert ld.num_samples == 150
    batches = concat_ranks(images_h5, 60, 2, batch_size=10, seed=4)
    epochs = [np.concatenate([datasets.image_ids(x) for x, _ in batches[e * 30:(e + 1) * 30]])
              for e in range(2)]
    for ids in epochs:
        assert sorted(ids.tolist()) == list(range(300))
    assert epochs[0].tolist() != epochs[1].tolist()  # each epoch its own order


def test_seeds_give_different_streams(tokens_h5):
    a = draw(tokens_h5, 2, batch_size=4, seed=1, seq_len=8)
    b = draw(tokens_h5, 2, batch_size=4, seed=2, seq_len=8)
    assert not np.array_equal(a[0][0], b[0][0])


@pytest.mark.parametrize("kind", ["tokens", "images"])
@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_direct_reads_equal_h5py_reads(tmp_path, datasets, monkeypatch, kind, compression):
    from hpctrain.data import format as fmt
    from hpctrain.data.stores import DirectRows, H5Rows

    monkeypatch.setattr(fmt, "CHUNK_BYTES", 1000)  # many chunks: reads cross their edges
    path = getattr(datasets, f"make_{kind}")(tmp_path / f"{kind}.h5", compression=compression)
    kw = {"batch_size": 16, "seed": 3, "seq_len": 40 if kind == "tokens" else None}
    with open_loader(path, **kw) as direct, open_loader(path, direct=False, **kw) as h5:
        readers = direct.store.readers
        first = readers[0] if kind == "tokens" else readers[0][0]
        assert isinstance(first, DirectRows if compression == "none" else H5Rows)
        for _ in range(12):
            for a, b in zip(direct.next_batch(), h5.next_batch(), strict=True):
                np.testing.assert_array_equal(a, b)
    if kind == "tokens":  # and the windows are the source's text
        text = split_bytes(path, "train")
        for x, y in draw(path, 5, **kw):
            for xr, yr in zip(x, y, strict=True):
                assert bytes(xr.astype(np.uint8).tolist() + [int(yr[-1])]) in text
    else:
        ordered = eval_batches(path, split="test", batch_size=35, num_batches=2)
        with h5py.File(path) as f:
            want = f["test/images"][:70].reshape(70, -1) / 255
        np.testing.assert_allclose(np.concatenate([x for x, _ in ordered]), want, rtol=1e-6)


# ---------------------------------------------------------------------------------
# exact resume, prefetch


@pytest.mark.parametrize("kind", ["tokens", "images"])
@pytest.mark.parametrize("prefetch", [False, True])
def test_resume_sees_the_same_batches(tmp_path, datasets, kind, prefetch):
    path = getattr(datasets, f"make_{kind}")(tmp_path / f"{kind}.h5")
    kw = {"batch_size": 16, "dp_rank": 1, "dp_size": 2, "seed": 9,
          "seq_len": 12 if kind == "tokens" else None}
    reference = draw(path, 30, **kw)
    with open_loader(path, prefetch=prefetch, **kw) as ld:
        for _ in range(17):  # images: 300 rows, 16 per step: an epoch ends at step 18.75
            ld.next_batch()
        state = json.loads(json.dumps(ld.state_dict()))
    with open_loader(path, prefetch=prefetch, **kw) as ld:
        ld.next_batch()  # a prefetched batch is pending when the state is loaded
        ld.load_state_dict(state)
        assert ld.step == 17
        resumed = [ld.next_batch() for _ in range(13)]
    for a, b in zip(reference[17:], resumed, strict=True):
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])


def test_resume_at_another_dp_size_unpartitioned(images_h5):
    """The position is global for an unpartitioned file: dp may change on resume."""
    with open_loader(images_h5, batch_size=8, seed=2) as ld:
        for _ in range(5):
            ld.next_batch()
        state = ld.state_dict()
        serial_next = ld.next_batch()
    parts = []
    for r in range(2):
        with open_loader(images_h5, batch_size=8, dp_rank=r, dp_size=2, seed=2) as ld:
            ld.load_state_dict(state)
            parts.append(ld.next_batch())
    np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), serial_next[0])


def test_state_that_does_not_fit_is_refused(images_h5, tmp_path):
    with open_loader(images_h5, batch_size=8, seed=2) as ld:
        state = ld.state_dict()
    with open_loader(images_h5, batch_size=8, seed=3) as ld:
        with pytest.raises(DataError, match="seed 2, this loader has 3"):
            ld.load_state_dict(state)
        with pytest.raises(DataError, match="not hpctrain.loader"):
            ld.load_state_dict({"step": 3})
        with pytest.raises(DataError, match="step"):
            ld.load_state_dict({**ld.state_dict(), "step": -1})
    out = tmp_path / "parts"
    partition(images_h5, out, num_shards=4)
    with open_loader(out, batch_size=8, dp_rank=0, dp_size=2, seed=2) as ld:
        state = ld.state_dict()
    with open_loader(out, batch_size=8, dp_rank=0, dp_size=4, seed=2) as ld:
        with pytest.raises(DataError, match="dp_size 2, this loader has 4"):
            ld.load_state_dict(state)


def test_prefetch_changes_nothing(tokens_h5):
    kw = {"batch_size": 6, "seed": 5, "seq_len": 7}
    plain, fetched = draw(tokens_h5, 10, **kw), draw(tokens_h5, 10, prefetch=True, **kw)
    for a, b in zip(plain, fetched, strict=True):
        np.testing.assert_array_equal(a[0], b[0])


# ---------------------------------------------------------------------------------
# partitioned: a rank reads only its shards


def test_assign_shards():
    assert assign_shards(6, 4) == [[0], [1, 2], [3], [4, 5]]
    assert assign_shards(4, 4) == [[0], [1], [2], [3]]
    assert assign_shards(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(DataError, match="2 shard\\(s\\) cannot feed dp_size 4"):
        assign_shards(2, 4)


@pytest.mark.parametrize("strategy", ["contiguous", "strided", "shuffled"])
def test_partitioned_ranks_read_their_shards(tmp_path, images_h5, datasets, strategy):
    out = tmp_path / "parts"
    partition(images_h5, out, num_shards=4, strategy=strategy, seed=1)
    seen = []
    for r in range(2):
        with open_loader(out, batch_size=10, dp_rank=r, dp_size=2, seed=7) as ld:
            assert [p.name for p in ld.paths] == [f"shard-{k:05d}.h5" for k in (2 * r, 2 * r + 1)]
            own = np.concatenate([datasets.image_ids(h5py.File(p)["train/images"][...])
                                  for p in ld.paths])
            n = ld.num_samples
            assert n == len(own)
            ids = np.concatenate([datasets.image_ids(ld.next_batch()[0])
                                  for _ in range(-(-n // 5))])[:n]
            assert sorted(ids.tolist()) == sorted(own.tolist())  # one epoch: each row once
            seen.append(ids)
    assert sorted(np.concatenate(seen).tolist()) == list(range(300))


def test_partitioned_windows_stay_inside_runs(tmp_path, tokens_h5):
    out = tmp_path / "parts"
    partition(tokens_h5, out, num_shards=2, strategy="strided", row_size=50)
    text = split_bytes(tokens_h5, "train")
    for r in range(2):
        for x, y in draw(out, 20, batch_size=8, dp_rank=r, dp_size=2, seed=1, seq_len=20):
            for xr, yr in zip(x, y, strict=True):
                assert bytes(xr.astype(np.uint8).tolist() + [int(yr[-1])]) in text


def test_a_shard_file_reads_like_a_dataset_file(tmp_path, images_h5):
    out = tmp_path / "parts"
    partition(images_h5, out, num_shards=2, strategy="shuffled")
    batches = concat_ranks(out / "shard-00001.h5", 3, 2, batch_size=8, seed=1)
    assert batches[0][0].shape == (8, 784)


def test_impossible_assignment_names_the_manifest(tmp_path, images_h5):
    out = tmp_path / "parts"
    partition(images_h5, out, num_shards=2)
    with pytest.raises(DataError, match=r"manifest.h5: 2 shard\(s\) cannot feed dp_size 3"):
        open_loader(out, batch_size=6, dp_rank=0, dp_size=3, seed=0)


def test_truncated_shard_is_refused_by_its_rank_only(tmp_path, images_h5):
    out = tmp_path / "parts"
    partition(images_h5, out, num_shards=2)
    shard = out / "shard-00001.h5"
    os.truncate(shard, shard.stat().st_size - 1000)
    with pytest.raises(DataError, match=r"shard-00001.h5\): file is \d+ bytes.*truncated"):
        open_loader(out, batch_size=4, dp_rank=1, dp_size=2, seed=0)
    with pytest.raises(DataError, match=r"shard-00001.h5: cannot be read as HDF5 \(truncated"):
        open_loader(shard, batch_size=4, seed=0)
    with open_loader(out, batch_size=4, dp_rank=0, dp_size=2, seed=0) as ld:
        ld.next_batch()  # rank 0 never touches shard 1


# ---------------------------------------------------------------------------------
# validation batches


def test_eval_batches_are_fixed_and_global(tokens_h5, images_h5):
    kw = {"batch_size": 8, "seq_len": 9, "num_batches": 3}
    a = eval_batches(tokens_h5, **kw)
    b = eval_batches(tokens_h5, **kw)
    halves = [eval_batches(tokens_h5, dp_rank=r, dp_size=2, **kw) for r in range(2)]
    for s in range(3):
        np.testing.assert_array_equal(a[s][0], b[s][0])
        np.testing.assert_array_equal(a[s][0], np.concatenate([h[s][0] for h in halves]))
    with h5py.File(images_h5) as f:
        labels = f["test/labels"][...]
    test = eval_batches(images_h5, split="test", batch_size=10, num_batches=2)
    np.testing.assert_array_equal(np.concatenate([y for _, y in test]), labels[:20])


def test_more_validation_batches_than_the_split_holds_are_refused_with_the_most(images_h5):
    # every validation batch is kept in memory for the run: beyond the split they only
    # repeat it (eval_batches = 100,000 held the demo 15 minutes before its first step)
    with h5py.File(images_h5) as f:
        rows = len(f["test/labels"])
    most = rows // 10
    assert len(eval_batches(images_h5, split="test", batch_size=10, num_batches=most)) == most
    with pytest.raises(DataError, match=rf"eval_batches \({most + 1}\) x 10 samples a rank is "
                                        rf"more than the {rows:,} rows of split 'test' a rank "
                                        rf"draws from: use eval_batches {most} or fewer"):
        eval_batches(images_h5, split="test", batch_size=10, num_batches=most + 1)
    with pytest.raises(DataError, match=rf"x 5 samples a rank .* the {rows // 2:,} rows"):
        eval_batches(images_h5, split="test", batch_size=10, dp_rank=1, dp_size=2,
                     num_batches=most + 1)
    # not even one batch: "use eval_batches 0 or fewer" named what the config refuses
    with pytest.raises(DataError, match=rf"not one batch fits: use a batch_size of at most "
                                        rf"{rows:,} \({rows:,} a rank\)"):
        eval_batches(images_h5, split="test", batch_size=rows + 1, num_batches=1)


# ---------------------------------------------------------------------------------
# refusals


def test_a_dataset_another_process_writes_is_named_as_locked_not_corrupt(tokens_h5):
    """HDF5 locks what it opens: a file another process holds open for writing is
    refused with the lock named, not called corrupt with advice to re-create it."""
    kw = {"batch_size": 4, "seed": 0, "seq_len": 8}
    with hdf5_held_for_writing(tokens_h5), pytest.raises(DataError) as err:
        open_loader(tokens_h5, **kw)
    assert "HDF5 could not lock it: another process has it open for writing (errno 11)" \
        in str(err.value) and "re-create" not in str(err.value)
    open_loader(tokens_h5, **kw)  # released: it opens


@pytest.mark.parametrize("text, advice", [
    ("Unable to synchronously open file (unable to lock file, errno = 524, error message "
     "= 'Unknown error 524')", "supports no file locks (errno 524); set "
                               "HDF5_USE_FILE_LOCKING=FALSE"),
    ("Unable to open file (unable to lock file, errno = 38, error message = 'Function "
     "not implemented')", "supports no file locks (errno 38)"),
    ("Unable to open file (unable to lock file, errno = 11, error message = 'Resource "
     "temporarily unavailable')", "another process has it open for writing"),
    ("Unable to open file (file signature not found)", None),
])
def test_lock_failures_are_told_apart_by_the_text_hdf5_gives(text, advice):
    """The texts HDF5 gives (errno 524: Lustre mounted without flock; 38: no locks at
    all; 11: a writer holds the lock); any other failure is not a lock problem."""
    found = lock_problem(OSError(text))
    assert found is None if advice is None else advice in found


def test_bad_files_are_refused(tmp_path, tokens_h5, ratings_h5, monkeypatch):
    kw = {"batch_size": 4, "seed": 0, "seq_len": 8}
    with pytest.raises(DataError, match="none.h5: no such file; hpctrain-prep") as err:
        open_loader(tmp_path / "none.h5", **kw)
    assert "relative" not in str(err.value)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=re.escape(f"data/none.h5: no such file (relative "
                                                  f"to the current folder, {tmp_path})")):
        open_loader("data/none.h5", **kw)
    with h5py.File(tmp_path / "plain.h5", "w") as f:
        f["train"] = np.zeros(100, np.uint8)
    with pytest.raises(DataError, match="plain.h5: not an hpctrain dataset"):
        open_loader(tmp_path / "plain.h5", **kw)
    with h5py.File(tokens_h5, "r+") as f:
        f.attrs["version"] = 99
    with pytest.raises(DataError, match="version 99 is not supported.*hpctrain-prep text"):
        open_loader(tokens_h5, **kw)
    with h5py.File(ratings_h5, "r+") as f:
        f.attrs["version"] = 1
    with pytest.raises(DataError, match="ratings version 1 is not supported.*hpctrain-prep "
                                        "movielens"):
        open_loader(ratings_h5, **kw)
    (tmp_path / "junk.h5").write_bytes(b"junk" * 1000)
    with pytest.raises(DataError, match="junk.h5: cannot be read as HDF5"):
        open_loader(tmp_path / "junk.h5", **kw)


def test_bad_arguments_are_refused(tokens_h5, images_h5):
    with pytest.raises(DataError, match="seq_len >= 1"):
        open_loader(tokens_h5, batch_size=4, seed=0)
    with pytest.raises(DataError, match="no window of seq_len \\+ 1 \\(10001\\) tokens"):
        open_loader(tokens_h5, batch_size=4, seed=0, seq_len=10_000)
    with pytest.raises(DataError, match="batch_size \\(10\\) must be a positive multiple of "
                                        "dp_size \\(4\\)"):
        open_loader(images_h5, batch_size=10, dp_rank=0, dp_size=4, seed=0)
    with pytest.raises(DataError, match="dp_rank \\(2\\)"):
        open_loader(images_h5, batch_size=4, dp_rank=2, dp_size=2, seed=0)
    with pytest.raises(DataError, match="no split 'val' \\(it has train, test\\)"):
        open_loader(images_h5, split="val", batch_size=4, seed=0)
    with pytest.raises(DataError, match="seed \\(-1\\)"):
        open_loader(images_h5, batch_size=4, seed=-1)


# ---------------------------------------------------------------------------------
# the shipped configs, on the real data


def test_configs_point_at_the_prepared_datasets():
    gpt = config.load(ROOT / "configs/gpt-shakespeare.toml").validate(1)
    mlp = config.load(ROOT / "configs/mlp-fashion-mnist.toml").validate(1)
    assert (gpt.data.path, gpt.data.eval_split) == ("data/shakespeare.h5", "val")
    assert (mlp.data.path, mlp.data.eval_split) == ("data/fashion-mnist.h5", "test")
    assert gpt.model.vocab_size == 256 and mlp.model.input_dim == 784


def test_real_shakespeare(tmp_path):
    from data_prep import sources
    from data_prep.write import write_tokens

    out = tmp_path / "shakespeare.h5"
    write_tokens(out, sources.shakespeare_files(), val_fraction=0.1)
    with open_loader(out, batch_size=4, dp_rank=0, dp_size=2, seed=1, seq_len=128) as ld:
        x, y = ld.next_batch()
    assert x.shape == (2, 128) and x.max() < 128  # ASCII
    val = eval_batches(out, batch_size=4, seq_len=128, num_batches=2)
    assert val[0][0].shape == (4, 128)
