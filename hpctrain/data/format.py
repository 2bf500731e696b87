"""The on-disk formats of hpctrain datasets, in one place.

Every file is HDF5 with two root attributes, ``format`` and ``version``, checked on
every read. A *table* is a set of datasets that share axis 0 (its rows); partitioning
splits tables by rows and copies *replicated* groups whole into every shard::

    format             tables (datasets sharing axis 0)                       replicated
    hpctrain.tokens    train: train (n,) u1          val: val (m,) u1            -
    hpctrain.images    train: train/images (N, 28, 28) u1, train/labels (N,) u1 -
                       test:  test/images, test/labels
    hpctrain.ratings   ratings: ratings/{user,item} i4, rating f4,            users, items
                       timestamp i8, fold u1, ids (R, K) i4, dense (R, D) f8
                       (the model's inputs: ``hpctrain.data.ratings``)
    hpctrain.volumes   volume: image (X, Y, Z) f4, labels (X, Y, Z) u1 (one 3-D volume,
                       read whole: never split by rows, never partitioned)
    hpctrain.shard     the datasets of its source format, holding only its rows in
                       ascending source order, plus partition/<table> (r, 2) i8: the
                       [start, stop) row ranges it holds, in source rows
    hpctrain.manifest  shards/<k>: attrs path, file_size, sha256;
                       shards/<k>/<table> (r, 2) i8 row ranges, attrs rows, elements

A token stream has no natural rows, so partitioning views it as rows of ``row_size``
tokens (the last row may be short); every other table has ``row_size`` 1. Each
dataset carries a ``sha256`` attribute of its bytes (C order); the manifest carries the
sha256 and size of every shard file, and paths relative to the manifest's folder.

Writes are atomic: data go to a hidden temporary name in the destination folder, are
flushed and fsync'ed, then renamed over the final name (``atomic_output``).
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

TOKENS = "hpctrain.tokens"
IMAGES = "hpctrain.images"
RATINGS = "hpctrain.ratings"
VOLUMES = "hpctrain.volumes"
SHARD = "hpctrain.shard"
MANIFEST = "hpctrain.manifest"
VERSIONS = {TOKENS: 1, IMAGES: 1, RATINGS: 2, VOLUMES: 1, SHARD: 1, MANIFEST: 1}
MANIFEST_NAME = "manifest.h5"

# What to run to (re)make a file of each format; error messages end with it.
REMEDY = {
    TOKENS: "hpctrain-prep text",
    IMAGES: "hpctrain-prep fashion-mnist",
    RATINGS: "hpctrain-prep movielens",
    VOLUMES: "hpctrain-prep mni152",
    SHARD: "hpctrain-prep partition",
    MANIFEST: "hpctrain-prep partition",
}

CHUNK_BYTES = 128 * 1024  # target chunk size along axis 0: small enough for random reads
COMPRESSIONS = ("none", "gzip", "lzf")


class DataError(Exception):
    """A dataset file breaks a rule; the one-line message names the file and the rule."""


@dataclass(frozen=True)
class Column:
    path: str  # dataset path inside the file
    ndim: int
    dtype: str  # numpy dtype string, e.g. "u1"


@dataclass(frozen=True)
class Layout:
    tables: dict[str, tuple[Column, ...]]
    replicated: tuple[str, ...] = ()
    unit: str = "row"  # what one element along axis 0 is, for messages
    whole: bool = False  # one array per column, all of one shape: read whole, not by rows

    def columns(self) -> Iterator[Column]:
        for cols in self.tables.values():
            yield from cols


def _images_table(split: str) -> tuple[Column, ...]:
    return (Column(f"{split}/images", 3, "u1"), Column(f"{split}/labels", 1, "u1"))


LAYOUTS = {
    TOKENS: Layout(tables={"train": (Column("train", 1, "u1"),),
                           "val": (Column("val", 1, "u1"),)}, unit="token"),
    IMAGES: Layout(tables={"train": _images_table("train"), "test": _images_table("test")}),
    RATINGS: Layout(tables={"ratings": (Column("ratings/user", 1, "i4"),
                                        Column("ratings/item", 1, "i4"),
                                        Column("ratings/rating", 1, "f4"),
                                        Column("ratings/timestamp", 1, "i8"),
                                        Column("ratings/fold", 1, "u1"),
                                        Column("ratings/ids", 2, "i4"),
                                        Column("ratings/dense", 2, "f8"))},
                    replicated=("users", "items")),
    VOLUMES: Layout(tables={"volume": (Column("image", 3, "f4"), Column("labels", 3, "u1"))},
                    whole=True),
}


@dataclass(frozen=True)
class FileInfo:
    """What ``check_file`` learnt about a file: its format and its data layout."""

    path: Path
    format: str
    version: int
    data_format: str  # the format of the data inside: a shard's source format
    layout: Layout | None  # None for a manifest
    attrs: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------
# reading and checking


def lock_problem(err: OSError) -> str | None:
    """Why HDF5 could not lock a file it opens, and what to do, if ``err`` says so (its
    text holds "unable to lock file"); else None. HDF5 locks every file it opens
    (shared to read, exclusive to write): another process writing the file holds the
    lock (errno 11), and some parallel file systems (Lustre without ``flock``, NFS)
    support no locks at all (errno 38, or 524 on Lustre)."""
    text = str(err)
    if "unable to lock file" not in text:
        return None
    code = re.search(r"errno = (\d+)", text)
    number = int(code.group(1)) if code else None
    if number in (errno.EAGAIN, errno.EACCES):
        return (f"HDF5 could not lock it: another process has it open for writing "
                f"(errno {number}); wait for that process or stop it")
    return (f"HDF5 could not lock it: this file system supports no file locks "
            f"(errno {number}); set HDF5_USE_FILE_LOCKING=FALSE in the job's environment")


def open_h5(path: str | Path, **kwargs) -> h5py.File:
    """Open an HDF5 file read-only; a missing, truncated or corrupt file is a DataError,
    as is one HDF5 cannot lock (``lock_problem``)."""
    path = Path(path)
    if not path.exists():
        where = "" if path.is_absolute() else f" (relative to the current folder, {Path.cwd()})"
        raise DataError(f"{path}: no such file{where}; hpctrain-prep writes datasets")
    if path.is_dir():
        raise DataError(f"{path}: is a folder, not a dataset file (and has no {MANIFEST_NAME})")
    try:
        return h5py.File(path, "r", **kwargs)
    except OSError as err:
        if (locked := lock_problem(err)) is not None:
            raise DataError(f"{path}: {locked}") from None
        reason = "truncated" if "truncated" in str(err) else "corrupt or not HDF5"
        raise DataError(f"{path}: cannot be read as HDF5 ({reason}: {err}); "
                        f"re-create it with hpctrain-prep") from None


def read_format(f: h5py.File, path: str | Path) -> tuple[str, int]:
    """Return ``(format, version)`` after checking both against the known formats."""
    name, version = f.attrs.get("format"), f.attrs.get("version")
    if name is None or version is None:
        raise DataError(f"{path}: not an hpctrain dataset (no 'format'/'version' attributes); "
                        f"write it with hpctrain-prep")
    name = str(name)
    if name not in VERSIONS:
        raise DataError(f"{path}: unknown format {name!r} (known: {', '.join(VERSIONS)})")
    if int(version) != VERSIONS[name]:
        raise DataError(f"{path}: {name} version {int(version)} is not supported (this hpctrain "
                        f"reads version {VERSIONS[name]}); re-run {REMEDY[name]}")
    return name, int(version)


def check_file(f: h5py.File, path: str | Path) -> FileInfo:
    """Check format, version and the layout of every table; return what was found."""
    name, version = read_format(f, path)
    attrs = {k: f.attrs[k] for k in f.attrs}
    if name == MANIFEST:
        return FileInfo(Path(path), name, version, str(attrs.get("source_format", "")), None,
                        attrs)
    data_format = name
    if name == SHARD:
        data_format = str(attrs.get("source_format"))
        if data_format not in LAYOUTS:
            raise DataError(f"{path}: shard of unknown source format {data_format!r}")
    layout = LAYOUTS[data_format]
    for table, cols in layout.tables.items():
        lengths = {}
        for col in cols:
            if col.path not in f or not isinstance(f[col.path], h5py.Dataset):
                raise DataError(f"{path}: missing dataset {col.path!r} required by "
                                f"{data_format}; re-run {REMEDY[name]}")
            dset = f[col.path]
            if dset.ndim != col.ndim or dset.dtype != np.dtype(col.dtype):
                raise DataError(f"{path}: dataset {col.path!r} is {dset.dtype}{dset.shape}, "
                                f"{data_format} needs {np.dtype(col.dtype)} with "
                                f"{col.ndim} dimension(s)")
            lengths[col.path] = dset.shape[0]
        if len(set(lengths.values())) > 1:
            raise DataError(f"{path}: datasets of table {table!r} differ in length: {lengths}")
        shapes = {col.path: f[col.path].shape for col in cols}
        if layout.whole and len(set(shapes.values())) > 1:
            raise DataError(f"{path}: datasets of table {table!r} differ in shape: {shapes}; "
                            f"re-run {REMEDY[name]}")
    return FileInfo(Path(path), name, version, data_format, layout, attrs)


def table_rows(f: h5py.File, layout: Layout, table: str) -> int:
    """Length along axis 0 of a table (its elements: tokens or rows)."""
    return int(f[layout.tables[table][0].path].shape[0])


# ---------------------------------------------------------------------------------
# checksums


def sha256_file(path: str | Path, block: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            h.update(chunk)
    return h.hexdigest()


def sha256_array(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).data).hexdigest()


def sha256_dataset(dset: h5py.Dataset, block_bytes: int = 1 << 24) -> str:
    """sha256 of a dataset's bytes in C order, read ``block_bytes`` at a time."""
    h = hashlib.sha256()
    n = dset.shape[0]
    row_bytes = max(1, dset.dtype.itemsize * int(np.prod(dset.shape[1:], dtype=np.int64)))
    step = max(1, block_bytes // row_bytes)
    for a in range(0, n, step):
        h.update(np.ascontiguousarray(dset[a:min(a + step, n)]).data)
    return h.hexdigest()


# ---------------------------------------------------------------------------------
# writing


def chunk_shape(shape: tuple[int, ...], dtype) -> tuple[int, ...] | None:
    """Chunks of about CHUNK_BYTES along axis 0, whole along the other axes."""
    if shape[0] == 0:
        return None
    row_bytes = np.dtype(dtype).itemsize * int(np.prod(shape[1:], dtype=np.int64))
    rows = max(1, min(shape[0], CHUNK_BYTES // max(1, row_bytes)))
    return (rows, *shape[1:])


def create_dataset(group: h5py.Group, name: str, shape: tuple[int, ...], dtype,
                   compression: str = "none") -> h5py.Dataset:
    """A chunked dataset (contiguous when empty), optionally compressed."""
    if compression not in COMPRESSIONS:
        raise DataError(f"compression {compression!r} must be one of {', '.join(COMPRESSIONS)}")
    chunks = chunk_shape(shape, dtype)
    kwargs = {}
    if chunks is not None and compression != "none":
        kwargs = {"compression": compression}
        if compression == "gzip":
            kwargs["compression_opts"] = 4
    return group.create_dataset(name, shape=shape, dtype=dtype, chunks=chunks, **kwargs)


def write_array(group: h5py.Group, name: str, data: np.ndarray,
                compression: str = "none") -> h5py.Dataset:
    """Write a whole array as a chunked dataset with its ``sha256`` attribute."""
    data = np.ascontiguousarray(data)
    dset = create_dataset(group, name, data.shape, data.dtype, compression)
    if data.size:
        dset[...] = data
    dset.attrs["sha256"] = sha256_array(data)
    return dset


def check_output(path: str | Path, force: bool, folder: bool = False) -> None:
    """Refuse to replace an existing output unless ``force``; refuse odd targets always:
    a folder holding files where a file is written (``folder`` False; an empty one is
    replaced), a folder that is no partition where a partition is."""
    path = Path(path)
    if not (path.exists() or path.is_symlink()):
        return
    if path.is_dir() and not folder and any(path.iterdir()):
        raise DataError(f"{path}: is a folder holding files, and this writes one file: "
                        f"give the file's name (e.g. {path / 'data.h5'}); such a folder is "
                        f"never replaced by a file, not even with --force")
    if path.is_dir() and not any(path.iterdir()):
        return
    if not force:
        raise DataError(f"{path}: already exists; pass --force to replace it")
    if path.is_dir() and not (path / MANIFEST_NAME).is_file():
        raise DataError(f"{path}: is a folder that holds no {MANIFEST_NAME}; "
                        f"refusing to replace it even with --force")


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether ``a`` and ``b`` are one file (links and spellings alike); False when
    either does not exist."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def fsync_path(path: Path) -> None:
    """fsync a file, or every file in a folder and the folder itself."""
    paths = sorted(path.rglob("*")) + [path] if path.is_dir() else [path]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextmanager
def atomic_output(path: str | Path, *, force: bool = False, folder: bool = False
                  ) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (a file, or a folder if ``folder``).

    When the block ends normally the temporary is fsync'ed and renamed to ``path``;
    on any exception (KeyboardInterrupt included) it is removed, so an interrupted run
    never leaves anything under the final name. ``force`` allows replacing an output.
    """
    path = Path(path)
    check_output(path, force, folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    if folder:
        tmp.mkdir()
    try:
        yield tmp
        fsync_path(tmp)
        check_output(path, force, folder)  # another writer may have finished meanwhile
        old = None
        if path.is_dir() and any(path.iterdir()):
            old = path.with_name(f".{path.name}.{os.getpid()}.old.tmp")
            os.replace(path, old)
        elif path.is_dir() and not folder:
            path.rmdir()
        os.replace(tmp, path)
        fsync_dir(path.parent)
        if old is not None:
            _remove(old)
    except BaseException:
        _remove(tmp)
        raise


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (a rename into it) to disk, as ``fsync_path`` a file's data."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_h5(path: str | Path, *, force: bool = False, attrs: dict | None = None
              ) -> Iterator[h5py.File]:
    """Yield a new HDF5 file that appears under ``path`` only once complete."""
    with atomic_output(path, force=force) as tmp:
        with h5py.File(tmp, "w-") as f:
            for k, v in (attrs or {}).items():
                f.attrs[k] = v
            yield f
