"""``hpctrain-prep`` through click's CliRunner: every command, its outputs and its errors.

User errors must give one message, a non-zero exit, no traceback and nothing under
the output's name. Partition round trips are checked by content: every source row
is found in exactly one shard, byte for byte.
"""

from __future__ import annotations

import gzip
import os
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from data_prep import write
from data_prep.cli import main
from hpctrain.data.format import LAYOUTS, MANIFEST_NAME, VERSIONS
from hpctrain.data.manifest import element_ranges, read_manifest

COMMANDS = ["text", "fashion-mnist", "movielens", "mni152", "partition", "inspect", "verify"]


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_ok(result):
    assert result.exit_code == 0, result.output


def assert_user_error(result, *words):
    """Exit status non-zero, a one-line 'Error:' message naming ``words``, no traceback."""
    assert result.exit_code != 0, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    assert "Error" in result.output
    for w in words:
        assert str(w) in result.output, (w, result.output)


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def write_idx(path: Path, array: np.ndarray, *, magic: bytes | None = None, cut: int = 0):
    header = magic or bytes([0, 0, 0x08, array.ndim])
    header += np.asarray(array.shape, dtype=">u4").tobytes()
    raw = header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    path.write_bytes(gzip.compress(raw[:len(raw) - cut]))


def write_fashion(folder: Path, n_train=50, n_test=20, **bad) -> dict:
    rng = np.random.default_rng(1)
    folder.mkdir(exist_ok=True)
    arrays = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        write_idx(folder / f"{prefix}-images-idx3-ubyte.gz", images, **bad)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte.gz", labels)
        arrays[prefix] = (images, labels)
    return arrays


def read_all(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        out = {}
        f.visititems(lambda n, o: out.__setitem__(n, o[...]) if isinstance(o, h5py.Dataset)
                     else None)
        return out


# ---------------------------------------------------------------------------------
# help


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_has_examples(command):
    result = run(*([command] if command else []), "--help")
    assert_ok(result)
    assert "Examples:" in result.output and "hpctrain-prep" in result.output


def test_unknown_dataset_command():
    result = run("cifar-10", "-o", "x.h5")
    assert result.exit_code == 2 and "No such command 'cifar-10'" in result.output


# ---------------------------------------------------------------------------------
# text


def test_text_files_and_globs(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"0123456789" * 10)
    (tmp_path / "a.txt").write_bytes(bytes(range(256)) * 2)
    out = tmp_path / "out" / "t.h5"
    assert_ok(run("text", tmp_path / "*.txt", "-o", out, "--val-fraction", "0.2", "-q"))
    with h5py.File(out) as f:
        assert f.attrs["format"] == "hpctrain.tokens" and f.attrs["version"] == 1
        assert list(f.attrs["sources"]) == ["a.txt", "b.txt"]
        a, b = bytes(range(256)) * 2, b"0123456789" * 10
        assert f["train"][...].tobytes() == a[:410] + b[:80]  # each file's head ...
        assert f["val"][...].tobytes() == a[410:] + b[80:]  # ... and its tail
        assert f["train"].chunks is not None
    assert_ok(run("verify", out))


def test_a_file_output_spelled_as_a_folder_is_refused(tmp_path):
    # "-o runs/new/" wrote a file named runs/new
    (tmp_path / "a.txt").write_bytes(b"0123456789" * 10)
    result = run("text", tmp_path / "a.txt", "-o", f"{tmp_path / 'new'}/", "-q")
    assert_user_error(result, "ends with '/', a folder", "new/data.h5")
    assert not (tmp_path / "new").exists()


def test_text_shakespeare_real(tmp_path):
    out = tmp_path / "shakespeare.h5"
    result = run("text", "shakespeare", "-o", out, "-q")
    assert_ok(result)
    with h5py.File(out) as f:
        assert len(f.attrs["sources"]) == 42
        assert not any(s.endswith("_gut_f.txt") for s in f.attrs["sources"])
        assert f["train"].shape[0] + f["val"].shape[0] == 5_057_198
        assert b"HAMLET" in f["train"][...].tobytes()


@pytest.mark.parametrize("inputs, words", [
    (["missing.txt"], ["missing.txt", "no such file"]),
    (["no-such-corpus"], ["no-such-corpus", "shakespeare"]),
    (["*.nothing"], ["matches no files"]),
    (["."], ["is a folder"]),
])
def test_text_bad_input(tmp_path, monkeypatch, inputs, words):
    monkeypatch.chdir(tmp_path)
    assert_user_error(run("text", *inputs, "-o", "out.h5"), *words)
    assert not (tmp_path / "out.h5").exists() and not leftovers(tmp_path)


def test_existing_output_needs_force(tmp_path):
    src = tmp_path / "a.txt"
    src.write_bytes(b"x" * 100)
    out = tmp_path / "t.h5"
    out.write_bytes(b"precious")
    assert_user_error(run("text", src, "-o", out), "already exists", "--force")
    assert out.read_bytes() == b"precious"
    assert_ok(run("text", src, "-o", out, "--force", "-q"))
    assert h5py.is_hdf5(out)


def test_an_input_is_never_the_output_even_with_force(tmp_path, monkeypatch):
    """The text file became the HDF5 file written from it: refused by the file, however
    it is spelled (another path, a glob, a symbolic link)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_bytes(b"precious " * 20)
    (tmp_path / "link.txt").symlink_to("notes.txt")
    for inputs, out, force in ((["notes.txt"], "notes.txt", []),
                               (["notes.txt"], "notes.txt", ["--force"]),
                               (["*.txt"], "./notes.txt", ["--force"]),
                               (["a.txt", "notes.txt"], "link.txt", ["--force"])):
        (tmp_path / "a.txt").write_bytes(b"other " * 20)
        assert_user_error(run("text", *inputs, "-o", out, *force),
                          f"{Path(out)}: is the input", "--force never replaces an input")
        assert (tmp_path / "notes.txt").read_bytes() == b"precious " * 20
        assert (tmp_path / "link.txt").is_symlink() and not leftovers(tmp_path)


def test_text_bad_val_fraction(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"abc")
    assert_user_error(run("text", tmp_path / "a.txt", "-o", tmp_path / "o.h5",
                          "--val-fraction", "1.5"), "--val-fraction")
    # 3 bytes at 10%: no validation token at all
    assert_user_error(run("text", tmp_path / "a.txt", "-o", tmp_path / "o.h5"), "validation")
    assert not (tmp_path / "o.h5").exists()


def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_bytes(b"y" * 1000)
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the val dataset: the file is half written
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    real = write.write_array
    monkeypatch.setattr(write, "write_array", interrupted)
    result = run("text", tmp_path / "a.txt", "-o", tmp_path / "t.h5")
    assert result.exit_code != 0
    assert not (tmp_path / "t.h5").exists() and leftovers(tmp_path) == []


# ---------------------------------------------------------------------------------
# fashion-mnist


def test_fashion_mnist_synthetic(tmp_path):
    arrays = write_fashion(tmp_path / "idx")
    out = tmp_path / "fm.h5"
    assert_ok(run("fashion-mnist", "--source-dir", tmp_path / "idx", "-o", out, "-q",
                  "--compression", "gzip"))
    data = read_all(out)
    for split, prefix in (("train", "train"), ("test", "t10k")):
        np.testing.assert_array_equal(data[f"{split}/images"], arrays[prefix][0])
        np.testing.assert_array_equal(data[f"{split}/labels"], arrays[prefix][1])
    with h5py.File(out) as f:
        assert f.attrs["format"] == "hpctrain.images" and f.attrs["n_classes"] == 10
        assert f["train/images"].compression == "gzip"


def test_fashion_mnist_real(tmp_path):
    out = tmp_path / "fm.h5"
    assert_ok(run("fashion-mnist", "-o", out, "-q"))
    with h5py.File(out) as f:
        assert f["train/images"].shape == (60000, 28, 28)
        assert f["test/images"].shape == (10000, 28, 28)
        assert np.bincount(f["train/labels"][...]).tolist() == [6000] * 10


@pytest.mark.parametrize("bad, words", [
    ({"magic": b"\x00\x00\x08\x07"}, ["train-images-idx3-ubyte.gz", "needs"]),
    ({"magic": b"\x12\x34\x08\x03"}, ["bad magic"]),
    ({"cut": 100}, ["truncated"]),
])
def test_fashion_mnist_bad_idx(tmp_path, bad, words):
    write_fashion(tmp_path / "idx", **bad)
    assert_user_error(run("fashion-mnist", "--source-dir", tmp_path / "idx", "-o",
                          tmp_path / "fm.h5"), *words)
    assert not (tmp_path / "fm.h5").exists()


def test_fashion_mnist_output_is_never_a_source_file(tmp_path):
    write_fashion(tmp_path / "idx")
    source = tmp_path / "idx" / "t10k-labels-idx1-ubyte.gz"
    before = source.read_bytes()
    assert_user_error(run("fashion-mnist", "--source-dir", tmp_path / "idx", "-o", source,
                          "--force"), f"{source}: is the input")
    assert source.read_bytes() == before


@pytest.mark.parametrize("command, name", [("movielens", "ml-100k.inter"),
                                           ("mni152", "mni_icbm152_gm_tal_nlin_sym_09a_"
                                                      "converted.nii.gz")])
def test_dataset_output_is_never_a_source_file(tmp_path, command, name):
    """Refused before anything is read: the files need not be valid."""
    (tmp_path / "src").mkdir()
    source = tmp_path / "src" / name
    source.write_bytes(b"source bytes")
    assert_user_error(run(command, "--source-dir", tmp_path / "src", "-o", source, "--force"),
                      f"{source}: is the input")
    assert source.read_bytes() == b"source bytes"


def test_fashion_mnist_missing_and_mismatched(tmp_path):
    assert_user_error(run("fashion-mnist", "--source-dir", tmp_path / "none", "-o",
                          tmp_path / "fm.h5"), "no such folder")
    write_fashion(tmp_path / "idx")
    write_idx(tmp_path / "idx" / "t10k-labels-idx1-ubyte.gz", np.zeros(19, np.uint8))
    assert_user_error(run("fashion-mnist", "--source-dir", tmp_path / "idx", "-o",
                          tmp_path / "fm.h5"), "19 labels for 20 images")
    (tmp_path / "idx" / "train-labels-idx1-ubyte.gz").write_bytes(b"not gzip")
    assert_user_error(run("fashion-mnist", "--source-dir", tmp_path / "idx", "-o",
                          tmp_path / "fm.h5"), "gzip")
    assert not (tmp_path / "fm.h5").exists()


# ---------------------------------------------------------------------------------
# movielens


def test_movielens_real(tmp_path):
    out = tmp_path / "ml.h5"
    assert_ok(run("movielens", "-o", out, "-q"))
    data = read_all(out)
    assert data["ratings/user"].shape == (100_000,)
    first = [data[f"ratings/{c}"][0] for c in ("user", "item", "rating", "timestamp")]
    assert first == [196, 242, 3.0, 881250949]
    assert data["users/id"].shape == (943,) and data["items/id"].shape == (1682,)
    assert data["items/genres"].shape[0] == 1682 and data["items/title"][0] == b"Toy Story"
    with h5py.File(out) as f:
        assert list(f["users/gender"].attrs["categories"]) == ["F", "M"]


def test_movielens_with_more_than_256_values_of_a_category(tmp_path):
    # the codes were uint8: "OverflowError: Python integer 334 out of bounds for uint8"
    from data_prep.sources import movielens_dir

    src = tmp_path / "src"
    shutil.copytree(movielens_dir(), src)
    user = src / "ml-100k.user"
    head, *rows = user.read_text().splitlines()
    rows = [r.split("\t") for r in rows]
    for i, r in enumerate(rows):
        r[3] = f"job{i}"  # every user an occupation of their own
    user.write_text("\n".join([head] + ["\t".join(r) for r in rows]) + "\n")
    out = tmp_path / "ml.h5"
    assert_ok(run("movielens", "--source-dir", src, "-o", out, "-q"))
    with h5py.File(out) as f:
        assert len(f["users/occupation"].attrs["categories"]) == 943
        assert sorted(set(f["users/occupation"][...].tolist())) == list(range(943))


def test_a_corpus_of_thousands_of_files_is_written(tmp_path):
    # every name went into one attribute: past about 4,095 names HDF5 refused it
    # ("object header message is too large") and nothing was written
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4100):
        (corpus / f"document-{i:05d}.txt").write_bytes(b"some text %d\n" % i)
    out = tmp_path / "t.h5"
    assert_ok(run("text", corpus / "*.txt", "-o", out, "-q"))
    with h5py.File(out) as f:
        assert f.attrs["sources_count"] == 4100
        names = list(f.attrs["sources"])
        assert 0 < len(names) < 4100 and names[0] == "document-00000.txt"


def test_a_file_named_twice_is_read_once(tmp_path, monkeypatch):
    # another spelling and a link were read again: the document in train and val twice
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_bytes(b"0123456789" * 10)
    (tmp_path / "link.txt").symlink_to("a.txt")
    assert_ok(run("text", "a.txt", tmp_path / "a.txt", "link.txt", "-o", "t.h5",
                  "--val-fraction", "0.1", "-q"))
    with h5py.File(tmp_path / "t.h5") as f:
        assert f["train"].size + f["val"].size == 100


def test_a_file_output_never_replaces_a_folder_holding_files(tmp_path):
    # text -o PARTITION --force replaced the partition folder (shards and manifest)
    (tmp_path / "a.txt").write_bytes(b"0123456789" * 10)
    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "manifest.h5").write_bytes(b"kept")
    assert_user_error(run("text", tmp_path / "a.txt", "-o", parts, "--force"),
                      "is a folder holding files", "not even with --force")
    assert (parts / "manifest.h5").read_bytes() == b"kept"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_ok(run("text", tmp_path / "a.txt", "-o", empty, "-q"))  # an empty one is replaced
    assert h5py.is_hdf5(empty)


def test_movielens_bad_input(tmp_path):
    assert_user_error(run("movielens", "--source-dir", tmp_path / "none", "-o",
                          tmp_path / "ml.h5"), "no such folder")
    d = tmp_path / "ml"
    d.mkdir()
    (d / "ml-100k.inter").write_text("user_id:token\titem_id:token\trating:float\n1\t2\t3\n")
    assert_user_error(run("movielens", "--source-dir", d, "-o", tmp_path / "ml.h5"),
                      "ml-100k.inter", "timestamp")
    assert not (tmp_path / "ml.h5").exists()


# ---------------------------------------------------------------------------------
# partition: the union of the shards is the source, by content


def _reassemble(source: Path, out: Path) -> None:
    """Place every shard's rows at their source ranges; each row exactly once."""
    m = read_manifest(out)
    src = read_all(source)
    layout = LAYOUTS[m.source_format]
    for table, cols in layout.tables.items():
        t = m.tables[table]
        for col in cols:
            rebuilt = np.zeros_like(src[col.path])
            times = np.zeros(len(rebuilt), dtype=np.int64)
            for e in m.shards:
                data = read_all(e.path)[col.path]
                at = 0
                for a, b in element_ranges(e.ranges[table], t.row_size, t.elements):
                    rebuilt[a:b] = data[at:at + b - a]
                    times[a:b] += 1
                    at += b - a
                assert at == len(data), "shard holds rows outside its ranges"
            assert (times == 1).all(), f"{col.path}: rows lost or duplicated"
            np.testing.assert_array_equal(rebuilt, src[col.path])


def _row_records(columns: list[np.ndarray]) -> np.ndarray:
    """One opaque byte string per row, all of a table's columns side by side; sorted.

    Equal multisets of rows give equal arrays, whatever the order of the rows.
    """
    parts = [np.ascontiguousarray(c).reshape(len(c), -1).view(np.uint8) for c in columns]
    rows = np.ascontiguousarray(np.concatenate(parts, axis=1))
    return np.sort(rows.view(f"V{rows.shape[1]}").ravel())


@pytest.mark.parametrize("strategy", ["contiguous", "strided", "shuffled"])
@pytest.mark.parametrize("weights", [None, "3,1,2"])
@pytest.mark.parametrize("kind", ["tokens", "images", "ratings"])
def test_partition_union_is_source(tmp_path, datasets, strategy, weights, kind):
    source = getattr(datasets, f"make_{kind}")(tmp_path / f"{kind}.h5")
    out = tmp_path / "parts"
    shape = ["--weights", weights] if weights else ["-n", 3]
    result = run("partition", source, "-o", out, "--strategy", strategy, "--seed", 5,
                 "--row-size", 64, "-q", *shape)
    assert_ok(result)
    _reassemble(source, out)
    m = read_manifest(out)
    if kind != "tokens":  # whole rows by content alone, without the ranges
        src = read_all(source)
        for table, cols in LAYOUTS[m.source_format].tables.items():
            shards = [read_all(e.path) for e in m.shards]
            got = _row_records([np.concatenate([s[c.path] for s in shards]) for c in cols])
            want = _row_records([src[c.path] for c in cols])
            assert len(np.unique(want)) == len(want)  # distinct rows: duplicates would show
            np.testing.assert_array_equal(got, want)
            sizes = [m.shard_rows(e, table) for e in m.shards]
            if weights:
                assert sizes[0] > sizes[2] > sizes[1], sizes
            else:
                assert max(sizes) - min(sizes) <= 1, sizes
    assert_ok(run("verify", out, "-q"))


def test_partition_replicates_features(tmp_path, datasets):
    source = datasets.make_ratings(tmp_path / "r.h5")
    assert_ok(run("partition", source, "-o", tmp_path / "p", "-n", 2, "-q"))
    src = read_all(source)
    for e in read_manifest(tmp_path / "p").shards:
        shard = read_all(e.path)
        for name in ("users/id", "users/age", "items/genres"):
            np.testing.assert_array_equal(shard[name], src[name])


def test_partition_strided_is_round_robin(tmp_path, datasets):
    source = datasets.make_images(tmp_path / "i.h5", n_train=10, n_test=7)
    assert_ok(run("partition", source, "-o", tmp_path / "p", "-n", 3, "--strategy", "strided",
                  "-q"))
    shards = [read_all(e.path) for e in read_manifest(tmp_path / "p").shards]
    ids = [datasets.image_ids(s["train/images"]).tolist() for s in shards]
    assert ids == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]


@pytest.mark.parametrize("args, words", [
    (["-n", 1000], ["fewer than the 1000 partitions"]),
    (["--weights", "2,x,1"], ["--weights", "positive numbers"]),
    (["--weights", "2,0,1"], ["--weights", "positive numbers"]),
    (["--weights", "1,-1"], ["--weights"]),
    (["--weights", "1,1", "-n", 3], ["2 weights for 3 shards"]),
    (["--weights", "1000,1"], ["shard 1 would get no rows"]),
    ([], ["-n/--num-shards or --weights"]),
    (["-n", 2, "--strategy", "random"], ["--strategy"]),
    (["-n", 0], ["--num-shards"]),
])
def test_partition_bad_arguments(tmp_path, images_h5, args, words):
    out = tmp_path / "parts"
    assert_user_error(run("partition", images_h5, "-o", out, *args), *words)
    assert not out.exists() and not leftovers(tmp_path)


def test_partition_bad_sources(tmp_path, images_h5, tokens_h5):
    out = tmp_path / "parts"
    assert_user_error(run("partition", tmp_path / "none.h5", "-o", out, "-n", 2), "no such file")
    assert_ok(run("partition", images_h5, "-o", out, "-n", 2, "-q"))
    assert_user_error(run("partition", out / MANIFEST_NAME, "-o", tmp_path / "p2", "-n", 2),
                      "hpctrain.manifest")
    assert_user_error(run("partition", out / "shard-00000.h5", "-o", tmp_path / "p2", "-n", 2),
                      "hpctrain.shard")
    # the folder itself: it said "is a folder, not a dataset file (and has no manifest.h5)"
    assert_user_error(run("partition", out, "-o", tmp_path / "p2", "-n", 2),
                      f"{out}: is already a partition (its {MANIFEST_NAME} names the dataset "
                      f"file {images_h5}); partition that file")
    assert_user_error(run("partition", images_h5, "-o", out, "-n", 2), "already exists")
    assert_ok(run("partition", images_h5, "-o", out, "-n", 3, "--force", "-q"))
    assert len(read_manifest(out).shards) == 3 and not leftovers(tmp_path)
    # 5.8 kB of training tokens in rows of 4096 tokens: two rows
    assert_user_error(run("partition", tokens_h5, "-o", tmp_path / "p3", "-n", 3),
                      "'train' has 2 rows of 4096 tokens", "--row-size")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "keep.txt").write_text("mine")
    assert_user_error(run("partition", images_h5, "-o", tmp_path / "folder", "-n", 2,
                          "--force"), "no manifest.h5")
    assert (tmp_path / "folder" / "keep.txt").exists()


def test_partition_never_replaces_the_folder_holding_its_source(tmp_path, images_h5):
    out = tmp_path / "parts"
    assert_ok(run("partition", images_h5, "-o", out, "-n", 2, "-q"))
    inside = out / "images.h5"
    inside.write_bytes(images_h5.read_bytes())
    assert_user_error(run("partition", inside, "-o", out, "-n", 3, "--force"),
                      f"{out}: holds the input {inside}")
    assert inside.read_bytes() == images_h5.read_bytes()
    assert len(read_manifest(out).shards) == 2 and not leftovers(tmp_path)


def test_interrupted_partition_leaves_nothing(tmp_path, images_h5, monkeypatch):
    from data_prep import partition as part

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(part, "_write_manifest", interrupted)  # shards are written by now
    result = run("partition", images_h5, "-o", tmp_path / "parts", "-n", 2)
    assert result.exit_code != 0
    assert not (tmp_path / "parts").exists() and leftovers(tmp_path) == []


# ---------------------------------------------------------------------------------
# inspect and verify


def test_inspect(tmp_path, images_h5):
    result = run("inspect", images_h5)
    assert_ok(result)
    assert "hpctrain.images version 1" in result.output
    assert "train/images" in result.output and "(300, 28, 28)" in result.output
    assert_ok(run("partition", images_h5, "-o", tmp_path / "p", "--weights", "2,1", "-q",
                  "--strategy", "strided"))
    result = run("inspect", tmp_path / "p")
    assert_ok(result)
    for words in ("partition manifest of 2 shard(s)", "shard-00000.h5", "shard-00001.h5",
                  "train: 200 rows", "train: 100 rows", "strided", "weights [2.0, 1.0]"):
        assert words in result.output, (words, result.output)
    result = run("inspect", tmp_path / "p" / "shard-00001.h5")
    assert_ok(result)
    assert "shard 1 of 2 (strided)" in result.output and "partition/train" in result.output


def _plain_h5(path: Path, **attrs) -> Path:
    with h5py.File(path, "w") as f:
        f.attrs.update(attrs)
        f["x"] = np.arange(3)
    return path


@pytest.mark.parametrize("command", ["inspect", "verify", "partition"])
def test_wrong_format_and_version(tmp_path, command, images_h5):
    extra = ["-o", tmp_path / "p", "-n", 2] if command == "partition" else []
    assert_user_error(run(command, tmp_path / "none.h5", *extra), "no such file")
    assert_user_error(run(command, _plain_h5(tmp_path / "plain.h5"), *extra),
                      "plain.h5", "not an hpctrain dataset")
    assert_user_error(run(command, _plain_h5(tmp_path / "odd.h5", format="x.y", version=1),
                          *extra), "unknown format 'x.y'")
    with h5py.File(images_h5, "r+") as f:
        f.attrs["version"] = VERSIONS["hpctrain.images"] + 1
    assert_user_error(run(command, images_h5, *extra), "version 2 is not supported",
                      "hpctrain-prep fashion-mnist")
    (tmp_path / "junk.h5").write_bytes(b"\x89HDF\r\n" + b"junk" * 100)
    assert_user_error(run(command, tmp_path / "junk.h5", *extra), "junk.h5", "HDF5")
    assert not (tmp_path / "p").exists()


def _partitioned(tmp_path, datasets, n=3, strategy="shuffled") -> Path:
    source = datasets.make_images(tmp_path / "i.h5")
    assert_ok(run("partition", source, "-o", tmp_path / "p", "-n", n, "--strategy", strategy,
                  "-q"))
    return tmp_path / "p"


def test_verify_good(tmp_path, datasets):
    out = _partitioned(tmp_path, datasets)
    result = run("verify", out)
    assert_ok(result)
    assert "cover its 300 rows exactly once" in result.output
    assert "shard contents equal their rows" in result.output


def test_verify_truncated_shard(tmp_path, datasets):
    out = _partitioned(tmp_path, datasets)
    shard = out / "shard-00001.h5"
    os.truncate(shard, shard.stat().st_size // 2)
    assert_user_error(run("verify", out), "shard 1", "shard-00001.h5", "truncated")
    assert_user_error(run("verify", shard), "shard-00001.h5", "truncated")


def test_verify_corrupt_shard_content(tmp_path, datasets):
    out = _partitioned(tmp_path, datasets)
    shard = out / "shard-00002.h5"
    with h5py.File(shard, "r") as f:  # flip one pixel byte in place: same size, same HDF5
        offset = f["train/images"].id.get_offset() or f["train/images"].id.get_chunk_info(
            0).byte_offset
    with open(shard, "r+b") as fh:
        fh.seek(offset + 100)
        byte = fh.read(1)
        fh.seek(offset + 100)
        fh.write(bytes([byte[0] ^ 0xFF]))
    result = run("verify", out)
    assert_user_error(result, "shard 2", "shard-00002.h5")
    assert "sha256" in result.output and "'/train/images'" in result.output
    assert_user_error(run("verify", shard), "'/train/images' does not match its sha256")


def test_verify_missing_shard_and_changed_source(tmp_path, datasets):
    out = _partitioned(tmp_path, datasets)
    (out / "shard-00000.h5").unlink()
    assert_user_error(run("verify", out), "shard 0", "no such file")
    out2 = tmp_path / "q"
    assert_ok(run("partition", tmp_path / "i.h5", "-o", out2, "-n", 2, "-q"))
    with h5py.File(tmp_path / "i.h5", "r+") as f:
        f["train/labels"][0] = 9 - f["train/labels"][0]
    assert_user_error(run("verify", out2), "differs from the file that was partitioned")


def test_verify_overlapping_ranges(tmp_path, datasets):
    out = _partitioned(tmp_path, datasets, n=2, strategy="contiguous")
    with h5py.File(out / MANIFEST_NAME, "r+") as f:
        del f["shards/00001/train"]
        f["shards/00001/train"] = np.array([[140, 300]])  # shard 0 holds 0..149
    result = run("verify", out)
    assert_user_error(result, "more than one shard", "row 140", "the manifest records 160")


def test_verify_moved_source(tmp_path, datasets):
    out = _partitioned(tmp_path, datasets, n=2)
    moved = tmp_path / "elsewhere.h5"
    (tmp_path / "i.h5").rename(moved)
    result = run("verify", out)
    assert_ok(result)
    assert "not found" in result.output and "--source" in result.output
    result = run("verify", out, "--source", moved)
    assert_ok(result)
    assert "shard contents equal their rows" in result.output
