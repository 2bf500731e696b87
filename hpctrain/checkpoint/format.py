"""The on-disk format of checkpoints: names, versions, the index, path resolution.

A run's checkpoints live in ``RUN_DIR/checkpoints``::

    checkpoints/
      step-000120/           a complete checkpoint
        index.h5             format hpctrain.checkpoint: metadata and the piece table
        rank-00000.h5        format hpctrain.checkpoint-data: the pieces one rank wrote
        rank-00003.h5        (a rank with nothing to write writes no file)
      step-000130.tmp/       a save in progress (or interrupted): never read
      latest                 the text "step-000120", replaced atomically

With parallel HDF5 (h5py built with MPI) the rank files are one ``data.h5`` that every
rank writes into, each tensor a dataset of its global shape; the index is the same.

Every tensor is stored as *pieces*, boxes of its global array (``reshard``). A data
file (version 3) holds one flat, contiguous, uncompressed dataset per dtype, named
after it (``/float32``), with the pieces it holds back to back, each in C order: the
piece ``[file, "float32", start, stop, checksum, at]`` is the elements ``[at, at +
volume)`` of ``/float32`` (plain h5py: ``f["float32"][at:at + n].reshape(shape)``).
HDF5 makes only that structure, one to three datasets whatever the model: the writer
allocates them, then writes the bytes straight to their offsets (``H5Dget_offset``),
and the reader reads them straight into the live arrays. Versions 1 and 2 made one
dataset per piece, ``/<tensor>/<box>`` (``/model/wpe.weight/0:8,0:16``): 231 on the
benchmark GPT, whose creation cost 8-12 ms a save; version 2 recorded each one's
file offset as the sixth field, version 1 had none (and gave each dataset ``start``,
``global_shape`` and ``sha256`` attributes). In a shared or consolidated file the
dataset ``/<tensor>`` has the global shape and a piece (``at`` null) is a box of it.
Tensor names: ``model/<parameter>`` and ``optim/<state>/<parameter>``
(``optim/m/blocks.0.attn.qkv.weight``), parameters named as in the full model.

The index (``index.h5``, or the root of a consolidated single file) holds, as root
attributes, ``format``, ``version``, ``step``, ``checksum`` (the algorithm of the
pieces' checksums, ``checksum_of``; absent in version 1: sha256) and JSON texts:
``config``, ``layout``, ``loader``, ``schedule``, ``rng``, ``optimizer``, ``files``; and
the dataset ``tensors``: a JSON text (uint8, with its ``sha256``), a list of ``{"name",
"dtype", "global_shape", "tp_split", "tp_blocks", "pieces": [[file, dataset, start,
stop, checksum, at], ...]}`` (``at``: version 3, the piece's first element in the flat
dataset, or null: the dataset holds the box, or the global array; version 2: the
piece's byte offset in the file; absent in version 1). Nothing is pickled: loading
never executes code.

Checksums. sha256 ran at 1.8 GB/s here, about a fifth of a save and more than a raw
read of the same bytes from the page cache; zlib's crc32 at 4 GB/s is still more than
the whole budget of a load at 80% of a raw read. ``blocksum64`` runs at memory speed
(about 30 GB/s, NumPy): the bytes as little-endian 64-bit words ``w`` (the last one
zero-padded), cut into 4 KiB blocks with sums ``S_b``; the checksum is the pair
``A = sum_i w_i`` and ``B = sum_b (b + 1) S_b``, both mod 2^64. Any change confined to
one 64-bit word changes ``A`` (a word changes by a nonzero amount below 2^64), so
every flipped bit, flipped byte or corrupt run of up to 8 aligned bytes is caught; a
zeroed, stale or misplaced 4 KiB block changes ``A`` or ``B`` unless its sum happens to
match. What it misses and a CRC would not: changes in two or more words that cancel
exactly (+x in one word, -x in another of the same block). The length is checked
apart (the shape in the index).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import h5py
import numpy as np

from hpctrain.data.format import DataError, lock_problem, sha256_array

CHECKPOINT = "hpctrain.checkpoint"  # an index: index.h5, or a consolidated file
DATA = "hpctrain.checkpoint-data"  # the pieces one rank (or all, with MPI-IO) wrote
VERSION = 3  # 3: flat datasets; 2: a dataset per piece, offsets; 1: sha256, no offsets
READABLE = (1, 2, 3)
CHECKSUM = "blocksum64"  # what this version writes
INDEX_NAME = "index.h5"
LATEST_NAME = "latest"
SHARED_NAME = "data.h5"
SELF = "."  # the file of a piece is the index file itself (consolidated)
META_KEYS = ("config", "layout", "loader", "schedule", "rng", "optimizer")
# written when present, absent from older checkpoints: an averaging strategy's position
# in its period (hpctrain.parallel.averaging), the batch shares (parallel.shares), the
# precision the run stored in (hpctrain.precision: name, storage, fp16's loss scale)
OPTIONAL_META_KEYS = ("averaging", "shares", "precision")
REMEDY = "load an earlier checkpoint (see `hpctrain ckpt inspect`), or re-run the training"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(DataError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model; the
    message names the file and the tensor."""


_BLOCK_WORDS = 512  # blocksum64's block: 4 KiB, a page
BLOCK_BYTES = 8 * _BLOCK_WORDS
_MASK = (1 << 64) - 1


def blocksum64(a: np.ndarray) -> str:
    """The ``blocksum64`` of an array's bytes in C order (see the module docstring):
    32 hex digits, ``A`` then ``B``."""
    raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    n_words = raw.size // 8
    n_blocks = n_words // _BLOCK_WORDS
    cut = n_blocks * _BLOCK_WORDS * 8
    sums = np.add.reduce(raw[:cut].view("<u8").reshape(n_blocks, _BLOCK_WORDS), axis=1)
    tail = raw[cut:].tobytes() + bytes(-(raw.size - cut) % 8)  # < 4 KiB, zero-padded
    if tail:  # the last, partial block
        sums = np.append(sums, np.frombuffer(tail, "<u8").sum(dtype=np.uint64))
    return blocksum64_of_sums(sums)


def blocksum64_of_sums(sums: np.ndarray) -> str:
    """The ``blocksum64`` of a piece from its block sums (uint64, one per block of
    ``BLOCK_BYTES``, the last one partial and its last word zero-padded: what
    ``blocksum64`` and ``copysum`` compute): ``A`` their sum, ``B`` their sum weighted
    by position (1, 2, ...), both mod 2^64."""
    total = int(sums.sum(dtype=np.uint64)) & _MASK
    weighted = int(np.dot(sums, _weights(sums.size))) & _MASK if sums.size else 0
    return f"{total:016x}{weighted:016x}"


def blocksum64_packed(data: np.ndarray, nbytes: list[int]) -> list[str] | None:
    """The ``blocksum64`` of each of several pieces lying back to back from the start
    of the C-contiguous ``data`` (``nbytes[k]``: the k-th piece's length), in a few
    NumPy calls whatever their number (``blocksum64`` per piece costs 15 us of Python
    each, 3.5 ms for the benchmark GPT's 231, held under the GIL beside training).
    A piece's last, partial block is an ordinary block whose missing words are zero,
    so every block of every piece is one ``reduceat`` segment of the 64-bit words.
    None when a piece does not start and end on a 64-bit word (the caller then takes
    ``blocksum64`` of each)."""
    sizes = np.asarray(nbytes, dtype=np.int64)
    raw = data.reshape(-1).view(np.uint8)
    if (data.ctypes.data % 8 or np.any(sizes % 8) or sizes.sum() > raw.size
            or not data.flags.c_contiguous):
        return None
    n_words = sizes // 8
    starts = np.concatenate(([0], np.cumsum(n_words)[:-1]))
    blocks = -(-n_words // _BLOCK_WORDS)  # per piece, the last one partial
    out = [f"{0:016x}{0:016x}"] * len(sizes)
    full = np.flatnonzero(blocks)  # empty pieces keep the sums of nothing
    if not full.size:
        return out
    blocks, starts = blocks[full], starts[full]
    first = np.concatenate(([0], np.cumsum(blocks)[:-1]))  # each piece's first block
    within = np.arange(int(blocks.sum())) - np.repeat(first, blocks)  # b per block
    bounds = np.repeat(starts, blocks) + within * _BLOCK_WORDS
    words = raw[:int(sizes.sum())].view("<u8")
    sums = np.add.reduceat(words, bounds)  # S_b (the pieces are back to back)
    total = np.add.reduceat(sums, first)
    weighted = np.add.reduceat(sums * (within + 1).astype(np.uint64), first)  # mod 2^64
    for k, a, b in zip(full.tolist(), total.tolist(), weighted.tolist(), strict=True):
        out[k] = f"{a:016x}{b:016x}"
    return out


_WEIGHTS = np.arange(1, 1 << 16, dtype=np.uint64)


def _weights(n: int) -> np.ndarray:
    """``1, 2, ..., n`` as uint64 (a view while n < 65536, blocks of up to 256 MiB)."""
    return _WEIGHTS[:n] if n < len(_WEIGHTS) else np.arange(1, n + 1, dtype=np.uint64)


def _sha256(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).data).hexdigest()


CHECKSUMS = {"blocksum64": blocksum64, "sha256": _sha256}


def checksum_of(algorithm: str, a: np.ndarray) -> str:
    """The checksum of ``a``'s bytes with a named algorithm (``CHECKSUMS``)."""
    if algorithm not in CHECKSUMS:
        raise CheckpointError(f"checksum algorithm {algorithm!r} is unknown (this hpctrain "
                              f"knows {', '.join(CHECKSUMS)})")
    return CHECKSUMS[algorithm](a)


def step_dirname(step: int) -> str:
    return f"step-{step:06d}"


def data_filename(rank: int) -> str:
    return f"rank-{rank:05d}.h5"


def step_of(path: Path) -> int | None:
    """The step of a complete checkpoint folder name, or None for anything else."""
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def flat_name(dtype) -> str:
    """The flat dataset of a data file holding the pieces of ``dtype``: ``float32``."""
    dtype = np.dtype(dtype)
    return dtype.name if dtype.isnative else dtype.str


class Piece(NamedTuple):
    """Box ``[start, stop)`` of a tensor, in dataset ``dataset`` of file ``file``.
    ``at`` (version 3): its first element in the flat dataset; ``offset`` (version 2):
    where its dataset's bytes start in the file. Neither: the dataset holds the box,
    or the global array, read through HDF5. (A named tuple: an index of a thousand
    ranks holds a quarter of a million of them, made in a third of a dataclass's time.)"""

    file: str
    dataset: str
    start: tuple[int, ...]
    stop: tuple[int, ...]
    checksum: str
    offset: int | None = None
    at: int | None = None

    @property
    def box(self) -> tuple[tuple[int, int], ...]:
        return tuple(zip(self.start, self.stop, strict=True))


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    global_shape: tuple[int, ...]
    tp_split: int | None
    tp_blocks: int
    pieces: tuple[Piece, ...]

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "global_shape": list(self.global_shape),
                "tp_split": self.tp_split, "tp_blocks": self.tp_blocks,
                "pieces": [[p.file, p.dataset, list(p.start), list(p.stop), p.checksum,
                            p.at] for p in self.pieces]}

    @classmethod
    def from_json(cls, d: dict, version: int = VERSION) -> TensorEntry:
        def piece(f, ds, a, b, h, where=None):  # version 1 has no sixth field
            where = None if where is None else int(where)
            return Piece(str(f), str(ds), tuple(map(int, a)), tuple(map(int, b)), str(h),
                         where if version == 2 else None, where if version >= 3 else None)

        pieces = tuple(piece(*p) for p in d["pieces"])
        return cls(str(d["name"]), str(d["dtype"]), tuple(map(int, d["global_shape"])),
                   None if d["tp_split"] is None else int(d["tp_split"]), int(d["tp_blocks"]),
                   pieces)


def json_attr(value) -> str:
    return json.dumps(value, sort_keys=True)


def write_index(f: h5py.File, *, step: int, meta: dict, files: list[str],
                tensors: list[TensorEntry]) -> None:
    """Write the index into an open, new HDF5 file (see the module docstring)."""
    f.attrs["format"] = CHECKPOINT
    f.attrs["version"] = VERSION
    f.attrs["step"] = int(step)
    f.attrs["checksum"] = CHECKSUM
    for key in META_KEYS:
        f.attrs[key] = json_attr(meta.get(key))
    for key in OPTIONAL_META_KEYS:
        if meta.get(key) is not None:
            f.attrs[key] = json_attr(meta[key])
    f.attrs["files"] = json_attr(files)
    text = np.frombuffer(json.dumps([t.to_json() for t in tensors]).encode(), np.uint8)
    dset = f.create_dataset("tensors", data=text)
    dset.attrs["sha256"] = sha256_array(text)


def check_format(f: h5py.File, path: Path, expected: str) -> None:
    """The ``format`` and ``version`` attributes, or an error saying what the file is."""
    name, version = f.attrs.get("format"), f.attrs.get("version")
    if name is None or version is None:
        raise CheckpointError(f"{path}: not an hpctrain checkpoint file (no 'format'/"
                              f"'version' attributes)")
    if str(name) != expected:
        raise CheckpointError(f"{path}: format {str(name)!r}, expected {expected!r}")
    if int(version) not in READABLE:
        raise CheckpointError(f"{path}: {expected} version {int(version)} is not supported "
                              f"(this hpctrain reads versions "
                              f"{', '.join(map(str, READABLE))})")


@dataclass
class Index:
    """What an index says: where it is, the step, the metadata and every tensor."""

    path: Path  # the index file
    root: Path  # the folder the piece file names are relative to
    step: int
    meta: dict
    files: list[str]
    tensors: dict[str, TensorEntry]
    checksum: str = "sha256"  # the algorithm of the pieces' checksums

    def file_path(self, name: str) -> Path:
        return self.path if name == SELF else self.root / name


def open_checkpoint_file(path: Path, needed: str = "", image: bytes | None = None
                         ) -> h5py.File:
    """``path`` opened read-only by HDF5 (or ``image``, its bytes as read before: opened
    in memory), or a CheckpointError: a file HDF5 cannot lock names the lock
    (``data.format.lock_problem``), any other failure the file as corrupt. ``needed``:
    what the file is needed for, appended to the message."""
    try:
        return h5py.File(path if image is None else io.BytesIO(image), "r")
    except OSError as err:
        if (locked := lock_problem(err)) is not None:
            raise CheckpointError(f"{path}: {locked}{needed}") from None
        raise CheckpointError(f"{path}: cannot be read as HDF5 ({err}){needed}; "
                              f"{REMEDY}") from None


def read_index(path: Path, image: bytes | None = None) -> Index:
    """Read and check an index file (``index.h5`` or a consolidated checkpoint);
    ``image``: its bytes, already read (``training.index_image``)."""
    f = open_checkpoint_file(path, image=image)
    with f:
        check_format(f, path, CHECKPOINT)
        try:
            meta = {key: json.loads(f.attrs[key]) for key in META_KEYS}
            meta |= {key: json.loads(f.attrs[key]) for key in OPTIONAL_META_KEYS
                     if key in f.attrs}
            files = list(json.loads(f.attrs["files"]))
            step = int(f.attrs["step"])
            algorithm = str(f.attrs.get("checksum", "sha256"))  # version 1: sha256
            text = f["tensors"][...]
            version = int(f.attrs["version"])
        except (KeyError, ValueError, OSError) as err:
            raise CheckpointError(f"{path}: the index is incomplete or corrupt ({err}); "
                                  f"{REMEDY}") from None
        if sha256_array(text) != f["tensors"].attrs.get("sha256"):
            raise CheckpointError(f"{path}: the tensor table fails its sha256 check; {REMEDY}")
    entries = [TensorEntry.from_json(d, version) for d in json.loads(text.tobytes())]
    if algorithm not in CHECKSUMS:
        raise CheckpointError(f"{path}: its pieces carry {algorithm!r} checksums, which this "
                              f"hpctrain cannot check (it knows {', '.join(CHECKSUMS)})")
    return Index(path, path.parent, step, meta, files, {t.name: t for t in entries},
                 algorithm)


def resolve(path: str | Path) -> Path:
    """The index file of a checkpoint given as a consolidated file, a step folder, a
    checkpoints folder (its ``latest``), the ``latest`` pointer itself, or a run folder
    (``checkpoints/latest``)."""
    path = Path(path)
    if path.is_file() and path.name == LATEST_NAME:
        path = path.parent  # the pointer: follow it below
    if path.is_file():
        return path
    if (path / INDEX_NAME).is_file():
        return path / INDEX_NAME
    if path.name.endswith(".tmp") and path.is_dir():
        raise CheckpointError(f"{path}: an unfinished save (it was never renamed); "
                              f"load the checkpoint 'latest' names instead")
    for folder in (path, path / "checkpoints"):
        pointer = latest_checkpoint(folder)
        if pointer is not None:
            return pointer / INDEX_NAME
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint")
    raise CheckpointError(f"{path}: holds no checkpoint ({INDEX_NAME}, or a '{LATEST_NAME}' "
                          f"pointer, here or in {path / 'checkpoints'})")


def latest_checkpoint(folder: Path) -> Path | None:
    """The step folder ``folder/latest`` names, or None if there is no pointer."""
    pointer = folder / LATEST_NAME
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    target = folder / name
    if step_of(Path(name)) is None or not (target / INDEX_NAME).is_file():
        raise CheckpointError(f"{pointer}: names {name!r}, which is not a complete checkpoint "
                              f"in {folder}")
    return target
