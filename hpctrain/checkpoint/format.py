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
file (versions 3 and 4) holds one flat, contiguous, uncompressed dataset per dtype, named
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
``config``, ``layout``, ``loader``, ``schedule``, ``rng``, ``optimizer``, ``files``
(the data files, relative to the index's folder; ``"."``: the index file itself).
Version 4 (the data files as in version 3) keeps the piece table as arrays, parsed
by NumPy in a few calls whatever the number of pieces (a job of 1,024 ranks writes
a quarter of a million)::

    tensors     uint8, a JSON text: [{"name", "dtype", "global_shape", "tp_split",
                "tp_blocks", "pieces": n}, ...], n pieces each, in this order
    pieces      int64 (N, 3): per piece its file (an index into ``files``), its
                dataset (an index into the root attribute ``datasets``, a JSON list
                of names) and ``at`` (-1: none)
    boxes       int64 (sum of 2 ndim over the pieces,): per tensor, its pieces'
                ``start`` then ``stop``, an (n, 2, ndim) block
    checksums   S<w> (N,): each piece's checksum, ASCII hex

and the root attributes ``datasets`` and ``table_sha256`` (a JSON object: each of the
four datasets' sha256, checked before the table is used). Versions 1 to 3
kept one JSON text in ``tensors``: ``{..., "pieces": [[file, dataset, start, stop,
checksum, at], ...]}``, which took 0.5 s to parse and 0.4 s to turn into pieces at
1,024 ranks (``benchmarks/bench_index.py``). ``at``: from version 3, the piece's
first element in the flat dataset, or none: the dataset holds the box, or the global
array; version 2: the piece's byte offset in the file; absent in version 1. Nothing
is pickled: loading never executes code.

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
# 4: the index's piece table as arrays; 3: flat datasets; 2: a dataset per piece,
# offsets; 1: sha256, no offsets
VERSION = 4
READABLE = (1, 2, 3, 4)
TABLE_VERSION = 4  # the first version whose index keeps its piece table as arrays
CHECKSUM = "blocksum64"  # what this version writes
INDEX_NAME = "index.h5"
LATEST_NAME = "latest"
SHARED_NAME = "data.h5"
SELF = "."  # the file of a piece is the index file itself (consolidated)
META_KEYS = ("config", "layout", "loader", "schedule", "rng", "optimizer")
# written when present, absent from older checkpoints: an averaging strategy's position
# in its period (hpctrain.parallel.averaging), the batch shares (parallel.shares), the
# precision the run stored in (hpctrain.precision: name, storage, fp16's loss scale),
# the non-finite guard's counts (hpctrain.guard)
OPTIONAL_META_KEYS = ("averaging", "shares", "precision", "guard")
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
    32 hex digits, ``A`` then ``B``. The block sums are one ``reduceat`` over the
    64-bit words (the last block partial), the trailing bytes a zero-padded word: 5 us
    of calls for a small array against 10 for a reshape, a tail copy and an append
    (a load checks every piece: the benchmark GPT's 231)."""
    raw = (a if a.flags.c_contiguous else np.ascontiguousarray(a)).reshape(-1).view(np.uint8)
    n_words, rest = divmod(raw.size, 8)
    n_blocks = -(-n_words // _BLOCK_WORDS)
    starts = (_STARTS[:n_blocks] if n_blocks <= len(_STARTS)
              else np.arange(0, n_words, _BLOCK_WORDS, dtype=np.intp))
    sums = (np.add.reduceat(raw[:8 * n_words].view("<u8"), starts) if n_words
            else np.zeros(0, np.uint64))
    if rest:  # the last word, zero-padded: in the last block, or a block of its own
        last = np.uint64(int.from_bytes(raw[8 * n_words:].tobytes(), "little"))
        if n_words % _BLOCK_WORDS:
            sums[-1] += last
        else:
            sums = np.append(sums, last)
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
_STARTS = np.arange(0, 1 << 16, dtype=np.intp) * _BLOCK_WORDS  # each block's first word


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


def complete_steps(folder: Path) -> list[Path]:
    """The step folders of ``folder`` whose index is written, by step."""
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir()
                   if step_of(p) is not None and (p / INDEX_NAME).is_file()), key=step_of)


def flat_name(dtype) -> str:
    """The flat dataset of a data file holding the pieces of ``dtype``: ``float32``."""
    dtype = np.dtype(dtype)
    return dtype.name if dtype.isnative else dtype.str


class Piece(NamedTuple):
    """Box ``[start, stop)`` of a tensor, in dataset ``dataset`` of file ``file``.
    ``at`` (from version 3): its first element in the flat dataset; ``offset`` (version
    2): where its dataset's bytes start in the file. Neither: the dataset holds the box,
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


class PieceTable(NamedTuple):
    """The piece table of a version 4 index, as read (one for all its tensors): row
    ``r`` of ``rows`` is a piece's file (an index into ``files``), dataset (into
    ``datasets``) and ``at`` (-1: none); ``boxes`` its start and stop, each tensor's
    pieces an (n, 2, ndim) block; ``checksums`` (bytes, ASCII hex) its checksum."""

    files: list[str]
    datasets: list[str]
    rows: np.ndarray  # (N, 3) int64
    boxes: np.ndarray  # (sum of 2 ndim,) int64
    checksums: np.ndarray  # (N,) bytes


class TensorEntry:
    """One tensor of a checkpoint: its name, dtype, global shape, tensor-parallel split
    and its pieces: ``pieces`` (Piece tuples), or, as read from a version 4 index,
    rows ``[first, first + count)`` of the index's ``table`` (its boxes from
    ``boxes_at`` on). Then no Piece is made until ``pieces`` is asked for, and
    ``len``, ``box(k)``, ``checksum(k)``, ``where(k)`` and ``bounds()`` read the
    arrays: opening the index of a large job makes none of its pieces."""

    __slots__ = ("name", "dtype", "global_shape", "tp_split", "tp_blocks", "_pieces",
                 "table", "first", "count", "boxes_at")

    def __init__(self, name: str, dtype: str, global_shape: tuple[int, ...],
                 tp_split: int | None, tp_blocks: int, pieces: tuple[Piece, ...] = (),
                 table: PieceTable | None = None, first: int = 0, count: int = 0,
                 boxes_at: int = 0):
        self.name, self.dtype, self.global_shape = name, dtype, global_shape
        self.tp_split, self.tp_blocks = tp_split, tp_blocks
        self._pieces = None if table is not None else tuple(pieces)
        self.table, self.first, self.count, self.boxes_at = table, first, count, boxes_at

    @property
    def pieces(self) -> tuple[Piece, ...]:
        if self._pieces is None:
            self._pieces = tuple(self.piece(k) for k in range(self.count))
        return self._pieces

    def __len__(self) -> int:
        """The number of pieces."""
        return self.count if self._pieces is None else len(self._pieces)

    def piece(self, k: int) -> Piece:
        if self._pieces is not None:
            return self._pieces[k]
        file, dataset, at = self.where(k)
        start, stop = zip(*self.box(k), strict=True) if self.global_shape else ((), ())
        return Piece(file, dataset, start, stop, self.checksum(k), None, at)

    def box(self, k: int) -> tuple[tuple[int, int], ...]:
        """Piece k's box, without making the Piece."""
        if self._pieces is not None:
            return self._pieces[k].box
        d = len(self.global_shape)
        at = self.boxes_at + 2 * d * k
        ends = self.table.boxes[at:at + 2 * d].tolist()
        return tuple(zip(ends[:d], ends[d:], strict=True))

    def checksum(self, k: int) -> str:
        if self._pieces is not None:
            return self._pieces[k].checksum
        return self.table.checksums[self.first + k].decode()

    def where(self, k: int) -> tuple[str, str, int | None]:
        """Piece k's file, dataset and ``at`` (None: none)."""
        if self._pieces is not None:
            p = self._pieces[k]
            return p.file, p.dataset, p.at
        file, dataset, at = self.table.rows[self.first + k].tolist()
        return self.table.files[file], self.table.datasets[dataset], None if at < 0 else at

    def files(self) -> list[str]:
        """The files its pieces are in, each once, in the pieces' order."""
        if self._pieces is not None:
            return list(dict.fromkeys(p.file for p in self._pieces))
        mine = self.table.rows[self.first:self.first + self.count, 0]
        return [self.table.files[k] for k in dict.fromkeys(mine.tolist())]

    def whole(self) -> bool:
        """Whether it is one piece, the whole tensor (most tensors: no tiling to check)."""
        return len(self) == 1 and self.box(0) == tuple((0, n) for n in self.global_shape)

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """Every piece's ``start`` and ``stop``, as (n, ndim) int64 arrays."""
        d, n = len(self.global_shape), len(self)
        if self._pieces is None:
            block = self.table.boxes[self.boxes_at:self.boxes_at + 2 * d * n]
            block = block.reshape(n, 2, d)
            return block[:, 0], block[:, 1]
        start = np.array([p.start for p in self._pieces], np.int64).reshape(n, d)
        stop = np.array([p.stop for p in self._pieces], np.int64).reshape(n, d)
        return start, stop

    def __repr__(self) -> str:
        return (f"TensorEntry({self.name!r}, {self.dtype!r}, {self.global_shape}, "
                f"{len(self)} piece(s))")

    def to_json(self) -> dict:
        """The entry as versions 1 to 3 wrote it, pieces included."""
        return {**self._head(), "pieces": [[p.file, p.dataset, list(p.start), list(p.stop),
                                            p.checksum, p.at] for p in self.pieces]}

    def _head(self) -> dict:
        return {"name": self.name, "dtype": self.dtype,
                "global_shape": list(self.global_shape), "tp_split": self.tp_split,
                "tp_blocks": self.tp_blocks}

    @classmethod
    def from_json(cls, d: dict, version: int = 3) -> TensorEntry:
        """An entry of a version 1 to 3 index (its pieces in the JSON text)."""
        def piece(f, ds, a, b, h, where=None):  # version 1 has no sixth field
            where = None if where is None else int(where)
            return Piece(str(f), str(ds), tuple(map(int, a)), tuple(map(int, b)), str(h),
                         where if version == 2 else None, where if version >= 3 else None)

        pieces = tuple(piece(*p) for p in d["pieces"])
        return cls(*_head_of(d), pieces)


def _head_of(d: dict) -> tuple:
    return (str(d["name"]), str(d["dtype"]), tuple(map(int, d["global_shape"])),
            None if d["tp_split"] is None else int(d["tp_split"]), int(d["tp_blocks"]))


def json_attr(value) -> str:
    return json.dumps(value, sort_keys=True)


def write_index(f: h5py.File, *, step: int, meta: dict, files: list[str],
                tensors: list[TensorEntry], version: int = VERSION) -> None:
    """Write the index into an open, new HDF5 file (see the module docstring).
    ``version`` 3: the piece table as one JSON text, as versions 1 to 3 kept it (what
    the tests of the older readers start from)."""
    f.attrs["format"] = CHECKPOINT
    f.attrs["version"] = version
    f.attrs["step"] = int(step)
    f.attrs["checksum"] = CHECKSUM
    for key in META_KEYS:
        f.attrs[key] = json_attr(meta.get(key))
    for key in OPTIONAL_META_KEYS:
        if meta.get(key) is not None:
            f.attrs[key] = json_attr(meta[key])
    f.attrs["files"] = json_attr(files)
    if version < TABLE_VERSION:
        text = np.frombuffer(json.dumps([t.to_json() for t in tensors]).encode(), np.uint8)
        f.create_dataset("tensors", data=text).attrs["sha256"] = sha256_array(text)
        return
    file_of = {name: k for k, name in enumerate(files)}
    dataset_of: dict[str, int] = {}
    rows, boxes, sums = [], [], []
    for t in tensors:
        for p in t.pieces:
            if p.file not in file_of:
                raise ValueError(f"tensor {t.name}: piece in {p.file}, which is not among "
                                 f"the index's files {files}")
            rows.append((file_of[p.file], dataset_of.setdefault(p.dataset, len(dataset_of)),
                         -1 if p.at is None else p.at))
            boxes += [*p.start, *p.stop]
            sums.append(p.checksum.encode())
    head = [{**t._head(), "pieces": len(t)} for t in tensors]
    parts = {"tensors": np.frombuffer(json.dumps(head).encode(), np.uint8),
             "pieces": np.array(rows, np.int64).reshape(len(rows), 3),
             "boxes": np.array(boxes, np.int64),
             "checksums": np.array(sums, dtype=f"S{max(map(len, sums), default=1)}")}
    for name, data in parts.items():
        f.create_dataset(name, data=data)
    f.attrs["datasets"] = json_attr(list(dataset_of))
    # one attribute for the four: h5py reads an attribute in 0.05-0.09 ms
    f.attrs["table_sha256"] = json_attr({name: sha256_array(data)
                                         for name, data in parts.items()})


def _table_entries(f: h5py.File, files: list[str]) -> list[TensorEntry]:
    """The entries of a version 4 index, each its rows of the one piece table; a table
    whose parts disagree (counts, lengths, indexes out of range) is refused."""
    parts, sums = {}, json.loads(f.attrs["table_sha256"])
    for name in ("tensors", "pieces", "boxes", "checksums"):
        dset = h5py.h5d.open(f.id, name.encode())  # h5py's f[name][...]: 3x the time
        parts[name] = data = np.empty(dset.shape, dset.dtype)
        if data.size:
            dset.read(h5py.h5s.ALL, h5py.h5s.ALL, data)
        if sha256_array(data) != sums.get(name):
            raise ValueError(f"dataset {name} fails its sha256 check")
    heads = json.loads(parts["tensors"].tobytes())
    datasets = [str(d) for d in json.loads(f.attrs["datasets"])]
    rows, boxes, sums = parts["pieces"], parts["boxes"], parts["checksums"]
    counts = [int(d["pieces"]) for d in heads]
    widths = [2 * len(d["global_shape"]) * n for d, n in zip(heads, counts, strict=True)]
    n = sum(counts)
    if (rows.shape != (n, 3) or sums.shape != (n,) or min(counts, default=0) < 0
            or boxes.shape != (sum(widths),)):
        raise ValueError(f"the piece table's parts disagree: {n} pieces by the tensors, "
                         f"pieces {rows.shape}, boxes {boxes.shape}, checksums {sums.shape}")
    if n and (rows[:, 0].min() < 0 or rows[:, 0].max() >= len(files)
              or rows[:, 1].min() < 0 or rows[:, 1].max() >= len(datasets)
              or rows[:, 2].min() < -1):
        raise ValueError(f"a piece names a file, a dataset or a position out of range "
                         f"({len(files)} files, {len(datasets)} datasets)")
    table = PieceTable(files, datasets, rows, boxes, sums)
    entries, first, at = [], 0, 0
    for d, count, width in zip(heads, counts, widths, strict=True):
        entries.append(TensorEntry(*_head_of(d), table=table, first=first, count=count,
                                   boxes_at=at))
        first, at = first + count, at + width
    return entries


def check_format(f: h5py.File, path: Path, expected: str) -> None:
    """The ``format`` and ``version`` attributes, or an error saying what the file is."""
    name, version = f.attrs.get("format"), f.attrs.get("version")
    if name is None or version is None:
        raise CheckpointError(f"{path}: not an hpctrain checkpoint file (no 'format'/"
                              f"'version' attributes)")
    if str(name) != expected:
        raise CheckpointError(f"{path}: format {str(name)!r}, expected {expected!r}")
    if int(version) not in READABLE:
        newer = ("; a newer hpctrain wrote it: load it with that one"
                 if int(version) > max(READABLE) else "")
        raise CheckpointError(f"{path}: {expected} version {int(version)} is not supported "
                              f"(this hpctrain reads versions "
                              f"{', '.join(map(str, READABLE))}){newer}")


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
            files = [str(name) for name in json.loads(f.attrs["files"])]
            step = int(f.attrs["step"])
            algorithm = str(f.attrs.get("checksum", "sha256"))  # version 1: sha256
            version = int(f.attrs["version"])
            text = None if version >= TABLE_VERSION else f["tensors"][...]
        except (KeyError, ValueError, OSError) as err:
            raise CheckpointError(f"{path}: the index is incomplete or corrupt ({err}); "
                                  f"{REMEDY}") from None
        if text is not None and sha256_array(text) != f["tensors"].attrs.get("sha256"):
            raise CheckpointError(f"{path}: the tensor table fails its sha256 check; {REMEDY}")
        if text is None:
            try:
                entries = _table_entries(f, files)
            except (KeyError, ValueError, TypeError, OSError) as err:
                raise CheckpointError(f"{path}: the piece table is incomplete or corrupt "
                                      f"({err}); {REMEDY}") from None
    if text is not None:
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
    steps = sorted(complete_steps(path) + complete_steps(path / "checkpoints"), key=step_of)
    found = ""
    if steps:  # a 'latest' lost (removed by hand, an old copy): name what is there
        found = (f"; it has {len(steps)} complete step folder(s), the newest "
                 f"{steps[-1]}: give one of them")
    raise CheckpointError(f"{path}: holds no checkpoint ({INDEX_NAME}, or a '{LATEST_NAME}' "
                          f"pointer, here or in {path / 'checkpoints'}){found}")


def latest_name(folder: Path) -> str | None:
    """The name ``folder/latest`` holds, unchecked (bytes that are no text replaced:
    a pointer overwritten by another file reads as no step), or None if there is no
    pointer."""
    pointer = folder / LATEST_NAME
    return pointer.read_text(errors="replace").strip() if pointer.is_file() else None


def latest_checkpoint(folder: Path) -> Path | None:
    """The step folder ``folder/latest`` names, or None if there is no pointer."""
    pointer = folder / LATEST_NAME
    name = latest_name(folder)
    if name is None:
        return None
    target = folder / name
    if step_of(Path(name)) is None or not (target / INDEX_NAME).is_file():
        shown = (repr(name) if name.isprintable() and len(name) <= 64
                 else f"no step ({pointer.stat().st_size} bytes that are not a step name: "
                      f"another file written over the pointer?)")
        raise CheckpointError(f"{pointer}: names {shown}, which is not a complete checkpoint "
                              f"in {folder}")
    return target
