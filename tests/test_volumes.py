"""3-D volumes: the NIfTI-1 reader, ``hpctrain-prep mni152``, the crop and tile loader,
and ``check_fits`` for a segmentation model.

The reader is checked against NIfTI files written here byte by byte (both byte orders,
gzip'ed and plain, scaled); the prep command and the loader run on the real MNI152
template at --downsample 2 (98 x 116 x 94 voxels), prepared once per module.
"""

from __future__ import annotations

import gzip
import struct
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from data_prep import sources
from data_prep.cli import main
from data_prep.nifti import read_nifti
from data_prep.partition import partition
from hpctrain.config import ModelConfig
from hpctrain.data import eval_batches, open_loader
from hpctrain.data.contents import check_fits, read_contents
from hpctrain.data.format import DataError, sha256_file
from hpctrain.data.volumes import IGNORE

MNI_SHAPE = (197, 233, 189)
SHAPE = (98, 116, 94)  # at --downsample 2
HELDOUT = (58, 94)  # the top quarter of the brain's slices (Z 1..76: 19 of 76) and above

# ---------------------------------------------------------------------------------
# NIfTI-1 files written by hand

_CODES = {"u1": (2, 8), "i2": (4, 16), "i4": (8, 32), "f4": (16, 32), "f8": (64, 64)}


def write_nifti(path: Path, data: np.ndarray, *, order: str = "<", slope: float = 0.0,
                inter: float = 0.0, pixdim=(1.5, 2.0, 2.5), gz: bool = False,
                datatype: int | None = None, bitpix: int | None = None,
                sizeof_hdr: int = 348, magic: bytes = b"n+1\0", cut: int = 0) -> Path:
    """A single-file NIfTI-1 image: header, 4 bytes of extension flag, voxels in F order."""
    code, bits = _CODES[data.dtype.str[1:]]
    header = bytearray(352)
    struct.pack_into(f"{order}i", header, 0, sizeof_hdr)
    struct.pack_into(f"{order}8h", header, 40, data.ndim, *data.shape, *[1] * (7 - data.ndim))
    struct.pack_into(f"{order}2h", header, 70, datatype or code, bitpix or bits)
    struct.pack_into(f"{order}8f", header, 76, 1.0, *pixdim, *[1.0] * (7 - len(pixdim)))
    struct.pack_into(f"{order}3f", header, 108, 352.0, slope, inter)
    header[344:348] = magic
    raw = bytes(header) + data.astype(data.dtype.newbyteorder(order)).tobytes(order="F")
    raw = raw[:len(raw) - cut]
    path.write_bytes(gzip.compress(raw) if gz else raw)
    return path


def distinct(shape, dtype) -> np.ndarray:
    """Every voxel a different value, so a wrong axis order cannot pass."""
    return np.arange(np.prod(shape)).reshape(shape).astype(dtype)


@pytest.mark.parametrize("order", ["<", ">"])
@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("dtype", ["u1", "i2", "i4", "f4", "f8"])
def test_nifti_reads_every_order_and_type(tmp_path, order, gz, dtype):
    data = distinct((3, 4, 5), dtype)
    path = write_nifti(tmp_path / ("v.nii.gz" if gz else "v.nii"), data, order=order, gz=gz)
    got, spacing = read_nifti(path)
    assert got.dtype == np.dtype(dtype) and got.dtype.isnative
    np.testing.assert_array_equal(got, data)  # a[i, j, k] with i fastest in the file
    assert spacing == (1.5, 2.0, 2.5)


def test_nifti_scaling(tmp_path):
    data = distinct((2, 3, 4), "i2") - 10
    got, _ = read_nifti(write_nifti(tmp_path / "s.nii", data, order=">", slope=0.5, inter=-3))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, data * np.float32(0.5) - 3)
    for slope, inter in ((0.0, 7.0), (1.0, 0.0)):  # no scaling: the stored values
        got, _ = read_nifti(write_nifti(tmp_path / "n.nii", data, slope=slope, inter=inter))
        assert got.dtype == np.int16
        np.testing.assert_array_equal(got, data)


@pytest.mark.parametrize("kwargs, words", [
    ({"sizeof_hdr": 100}, ["not a NIfTI-1 file", "sizeof_hdr 100"]),
    ({"sizeof_hdr": 540}, ["NIfTI-2"]),
    ({"magic": b"ni1\0"}, [".hdr/.img pair"]),
    ({"magic": b"abcd"}, ["not a NIfTI-1 file", "magic"]),
    ({"datatype": 32}, ["unsupported NIfTI datatype 32 (complex64)"]),
    ({"datatype": 128}, ["unsupported NIfTI datatype 128 (RGB24)"]),
    ({"bitpix": 16}, ["bitpix 16 does not match datatype 16 (float32"]),
    ({"cut": 1}, ["truncated", "needs 96"]),
    ({"cut": 100}, ["truncated: 0 bytes of voxels after vox_offset 352"]),
    ({"cut": 110}, ["338 bytes, shorter than a NIfTI-1 header"]),
])
def test_nifti_errors_name_the_file_and_the_problem(tmp_path, kwargs, words):
    path = write_nifti(tmp_path / "bad.nii", distinct((2, 3, 4), "f4"), **kwargs)
    with pytest.raises(DataError) as err:
        read_nifti(path)
    for w in [str(path), *words]:
        assert w in str(err.value), (w, str(err.value))


def test_nifti_bad_gzip_and_missing_file(tmp_path):
    path = write_nifti(tmp_path / "t.nii.gz", distinct((2, 3, 4), "f4"), gz=True)
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(DataError, match="not a readable gzip file"):
        read_nifti(path)
    with pytest.raises(DataError, match="no such file"):
        read_nifti(tmp_path / "none.nii")


def test_the_real_template_files():
    folder = sources.mni152_dir()
    for name in sources.MNI152_FILES.values():
        data, spacing = read_nifti(folder / name)
        assert data.shape == MNI_SHAPE and spacing == (1.0, 1.0, 1.0)
        assert data.max() > 0


def test_block_mean_and_tissue_labels():
    a = distinct((5, 4, 7), "f4")
    got = sources.block_mean(a, 2)  # trimmed to (4, 4, 6)
    want = a[:4, :4, :6].reshape(2, 2, 2, 2, 3, 2).mean(axis=(1, 3, 5))
    np.testing.assert_allclose(got, want)
    assert got.shape == (2, 2, 3) and got.dtype == np.float32
    gm = np.array([0.0, 0.6, 0.2, 0.3, 0.5])
    wm = np.array([0.0, 0.3, 0.7, 0.3, 0.5])
    np.testing.assert_array_equal(sources.tissue_labels(gm, wm), [0, 1, 2, 0, 1])


# ---------------------------------------------------------------------------------
# hpctrain-prep mni152


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def mni(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mni") / "mni152.h5"
    result = run("mni152", "-o", out, "-q")
    assert result.exit_code == 0, result.output
    assert "98 x 116 x 94 voxels of 2 x 2 x 2 mm" in result.output
    assert "grey matter" in result.output and "Z [58, 94) held out" in result.output
    return out


def test_prep_writes_the_volume_format(mni):
    with h5py.File(mni) as f:
        a = dict(f.attrs)
        image, labels = f["image"][...], f["labels"][...]
    assert (a["format"], a["version"], a["n_classes"]) == ("hpctrain.volumes", 1, 3)
    assert list(a["classes"]) == ["other", "grey matter", "white matter"]
    assert tuple(a["volume_shape"]) == SHAPE and list(a["spacing_mm"]) == [2.0, 2.0, 2.0]
    assert a["downsample"] == 2 and tuple(a["heldout"]) == HELDOUT
    folder = sources.mni152_dir()
    assert list(a["sources_sha256"]) == [sha256_file(folder / n)
                                         for n in sources.MNI152_FILES.values()]
    assert image.shape == labels.shape == SHAPE
    assert image.dtype == np.float32 and labels.dtype == np.uint8
    assert image.min() == 0 and image.max() <= 1
    assert set(np.unique(labels).tolist()) == {0, 1, 2}
    assert set(np.unique(labels[:, :, HELDOUT[0]:]).tolist()) == {0, 1, 2}
    c = read_contents(mni)
    assert (c.format, c.n_classes, c.volume_shape, c.heldout) == \
        ("hpctrain.volumes", 3, SHAPE, HELDOUT)
    assert "verified" in run("verify", mni).output


def test_prep_errors(tmp_path, mni):
    result = run("mni152", "-o", tmp_path / "x.h5", "--source-dir", tmp_path / "none")
    assert result.exit_code == 1
    assert "pip install --no-deps nilearn==0.14.1" in result.output
    result = run("mni152", "-o", mni)
    assert result.exit_code == 1 and "pass --force" in result.output
    result = run("mni152", "-o", tmp_path / "x.h5", "--downsample", 0)
    assert result.exit_code == 2 and "--downsample" in result.output
    with pytest.raises(DataError, match="has no rows to partition"):
        partition(mni, tmp_path / "parts", num_shards=2)
    assert not (tmp_path / "x.h5").exists() and not (tmp_path / "parts").exists()


def test_a_volume_file_is_checked_on_read(tmp_path, mni):
    bad = tmp_path / "bad.h5"
    with h5py.File(mni) as src, h5py.File(bad, "w") as f:
        f.attrs.update(src.attrs)
        f["image"] = src["image"][:, :, :50]
        f["labels"] = src["labels"][...]
    with pytest.raises(DataError, match=r"differ in shape.*re-run hpctrain-prep mni152"):
        loader(bad)
    with h5py.File(bad, "r+") as f:
        del f["image"]
        f["image"] = np.zeros(SHAPE, np.float32)
        f.attrs["heldout"] = [0, 94]
    with pytest.raises(DataError, match=r"heldout \(\[0, 94\]\) must be \[start, stop\)"):
        loader(bad)


# ---------------------------------------------------------------------------------
# the loader

CROP = (16, 24, 20)


def loader(path, **kw):
    args = {"batch_size": 4, "seed": 3, "crop": CROP} | kw
    return open_loader(path, **args)


def test_training_batches_are_deterministic_and_resume(mni):
    with loader(mni) as a, loader(mni) as b, loader(mni, seed=4) as c:
        first = [a.next_batch() for _ in range(3)]
        x, y = first[0]
        assert x.shape == (4, 1, *CROP) and x.dtype == np.float32
        assert y.shape == (4, *CROP) and y.dtype == np.int64
        for s, (x, y) in enumerate(first):
            np.testing.assert_array_equal(b.batch(s)[0], x)
            np.testing.assert_array_equal(b.batch(s)[1], y)
        assert not np.array_equal(c.batch(0)[0], first[0][0])
        state = a.state_dict()
        assert state["step"] == 3
        b.load_state_dict(state)
        np.testing.assert_array_equal(b.next_batch()[0], a.next_batch()[0])
    with loader(mni, batch_size=8) as other, pytest.raises(DataError, match="batch_size"):
        other.load_state_dict(state)


def test_the_global_batch_is_the_same_at_any_dp(mni):
    with loader(mni, batch_size=4) as whole, \
            loader(mni, batch_size=4, dp_size=2, dp_rank=0) as r0, \
            loader(mni, batch_size=4, dp_size=2, dp_rank=1, prefetch=True) as r1:
        for _ in range(4):
            x, y = whole.next_batch()
            parts = [r0.next_batch(), r1.next_batch()]
            assert parts[0][0].shape == (2, 1, *CROP)
            np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), x)
            np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), y)


def test_training_crops_stay_out_of_the_heldout_slices(mni):
    with h5py.File(mni) as f:
        image, labels = f["image"][...], f["labels"][...]
    D, H, W = CROP
    with loader(mni, batch_size=16) as ld:
        for s in range(50):
            corners = ld.indices(s)
            x, y = ld.batch(s)
            assert (corners[:, 2] + W <= HELDOUT[0]).all()
            for (i, j, k), xi, yi in zip(corners.tolist(), x, y, strict=True):
                assert labels[i + D // 2, j + H // 2, k + W // 2] != 0  # centred on brain
                np.testing.assert_array_equal(xi[0], image[i:i + D, j:j + H, k:k + W])
                np.testing.assert_array_equal(yi, labels[i:i + D, j:j + H, k:k + W])


def reassemble(batches_by_rank, region_shape, crop):
    """Tiles back into the padded region (C order of tile index), and IGNORE counts."""
    x = np.concatenate([np.concatenate([b[0] for b in batch]) for batch in batches_by_rank])
    y = np.concatenate([np.concatenate([b[1] for b in batch]) for batch in batches_by_rank])
    grid = [-(-s // k) for s, k in zip(region_shape, crop, strict=True)]
    n = int(np.prod(grid))
    assert (y[n:] == IGNORE).all() and (x[n:] == 0).all()  # the completing empty tiles

    def whole(t):
        t = t[:n].reshape(*grid, *crop).transpose(0, 3, 1, 4, 2, 5)
        return t.reshape([g * k for g, k in zip(grid, crop, strict=True)])
    return whole(x[:, 0]), whole(y)


@pytest.mark.parametrize("dp_size", [1, 2])
@pytest.mark.parametrize("split", ["whole", "heldout"])
def test_eval_tiles_cover_the_region_exactly_once(mni, dp_size, split):
    with h5py.File(mni) as f:
        z0, z1 = (0, SHAPE[2]) if split == "whole" else HELDOUT
        image, labels = f["image"][:, :, z0:z1], f["labels"][:, :, z0:z1]
    crop, B = (32, 32, 32), 6
    ranks = [eval_batches(mni, split=split, batch_size=B, dp_rank=r, dp_size=dp_size,
                          crop=crop, num_batches=0) for r in range(dp_size)]
    tiles = int(np.prod([-(-s // k) for s, k in zip(image.shape, crop, strict=True)]))
    assert all(len(r) == -(-tiles // B) for r in ranks)  # every rank the same count
    assert ranks[0][0][0].shape == (B // dp_size, 1, *crop)
    by_step = [[r[g] for r in ranks] for g in range(len(ranks[0]))]  # global batch order
    x, y = reassemble(by_step, image.shape, crop)
    X, Y, Z = image.shape
    assert (y != IGNORE).sum() == image.size
    np.testing.assert_array_equal(x[:X, :Y, :Z], image)
    np.testing.assert_array_equal(y[:X, :Y, :Z], labels)
    assert (x[X:] == 0).all() and (y[X:] == IGNORE).all() and (y[:, :, Z:] == IGNORE).all()
    assert len(eval_batches(mni, split=split, batch_size=B, crop=crop, num_batches=1)) == 1
    assert len(eval_batches(mni, split=split, batch_size=B, crop=crop, num_batches=999)) == \
        len(ranks[0])


@pytest.mark.parametrize("call, kw, words", [
    ("train", {"crop": (16, 16, 200)}, ["crop [16, 16, 200] must fit", "98 x 116 x 94"]),
    ("train", {"crop": (16, 16)}, ["crop [16, 16] must be 3 sizes"]),
    ("train", {"crop": None}, ["needs crop = (D, H, W)"]),
    ("train", {"crop": (16, 16, 80)}, ["crop W (80) exceeds the training slices Z [0, 58)"]),
    ("train", {"batch_size": 3, "dp_size": 2}, ["batch_size (3)", "dp_size (2)"]),
    ("train", {"split": "test"}, ["split 'train'", "'whole' or 'heldout'", "not 'test'"]),
    ("eval", {"split": "train"}, ["'whole' or 'heldout', not 'train'"]),
    ("eval", {"split": "whole", "crop": (0, 16, 16)}, ["each size at least 1"]),
])
def test_bad_loader_arguments(mni, call, kw, words):
    with pytest.raises(DataError) as err:
        if call == "train":
            loader(mni, **kw).close()
        else:
            eval_batches(mni, **({"batch_size": 4, "crop": CROP} | kw))
    for w in words:
        assert w in str(err.value), (w, str(err.value))


# ---------------------------------------------------------------------------------
# check_fits


@pytest.fixture
def seg3d(monkeypatch):
    """A model kind that trains on volumes (the real one may or may not be registered)."""
    from hpctrain.models.registry import MODELS

    monkeypatch.setitem(MODELS, "seg3d", SimpleNamespace(data_format="hpctrain.volumes"))
    return "seg3d"


def test_check_fits_a_segmentation_model(mni, seg3d):
    c = read_contents(mni)
    check_fits(c, ModelConfig(kind=seg3d, n_classes=3, crop=(32, 32, 32)))
    check_fits(c, ModelConfig(kind=seg3d, n_classes=3, crop=(98, 116, 58)))
    cases = [
        (ModelConfig(kind=seg3d, n_classes=10), r"holds 3 classes; the model's n_classes "
         r"\(10\) must equal 3: set \[model\] n_classes = 3"),
        (ModelConfig(kind=seg3d, n_classes=3, crop=(32, 128, 32)),
         r"volume of 98 x 116 x 94 voxels, of which Z \[0, 58\) is for training; every entry "
         r"of the model's crop \[32, 128, 32\] must be at least 1 and fit in 98 x 116 x 58: "
         r"set \[model\] crop = \[32, 116, 32\]"),
        (ModelConfig(kind=seg3d, n_classes=3, crop=(32, 32, 80)), r"crop = \[32, 32, 58\]"),
        (ModelConfig(kind=seg3d, n_classes=3, crop=(0, 32, 32)), r"crop = \[2, 32, 32\]"),
        # each side a multiple of 2^(levels - 1), as the model requires (39 was named)
        (ModelConfig(kind=seg3d, n_classes=3, channels=(4, 8, 16), crop=(16, 16, 80)),
         r"crop = \[16, 16, 56\]"),
        (ModelConfig(kind=seg3d, n_classes=3, crop=(32, 32)), r"crop \[32, 32\] must be 3"),
        (ModelConfig(kind="mlp"), r"holds a 3-D volume \(hpctrain.volumes\), which a seg3d "
         r"model trains on; the config's \[model\] kind is 'mlp'"),
    ]
    for model, message in cases:
        with pytest.raises(DataError, match=message):
            check_fits(c, model)
