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

Every tensor is stored as *pieces*, boxes of its global array (``reshard``). In a
data file a piece is the dataset ``/<tensor>/<box>`` (``/model/wpe.weight/0:8,0:16``)
with attributes ``start`` and ``global_shape`` and ``sha256``; in a shared or
consolidated file the dataset ``/<tensor>`` has the global shape and a piece is a box
of it. Tensor names: ``model/<parameter>`` and ``optim/<state>/<parameter>``
(``optim/m/blocks.0.attn.qkv.weight``), parameters named as in the full model.

The index (``index.h5``, or the root of a consolidated single file) holds, as root
attributes, ``format``, ``version``, ``step`` and JSON texts: ``config``, ``layout``,
``loader``, ``schedule``, ``rng``, ``optimizer``, ``files``; and the dataset
``tensors``: a JSON text (uint8, with its ``sha256``), a list of ``{"name", "dtype",
"global_shape", "tp_split", "tp_blocks", "pieces": [[file, dataset, start, stop,
sha256], ...]}``. Nothing is pickled: loading never executes code.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from hpctrain.data.format import DataError, sha256_array

CHECKPOINT = "hpctrain.checkpoint"  # an index: index.h5, or a consolidated file
DATA = "hpctrain.checkpoint-data"  # the pieces one rank (or all, with MPI-IO) wrote
VERSION = 1
INDEX_NAME = "index.h5"
LATEST_NAME = "latest"
SHARED_NAME = "data.h5"
SELF = "."  # the file of a piece is the index file itself (consolidated)
META_KEYS = ("config", "layout", "loader", "schedule", "rng", "optimizer")
REMEDY = "load an earlier checkpoint (see `hpctrain ckpt inspect`), or re-run the training"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(DataError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model; the
    message names the file and the tensor."""


def step_dirname(step: int) -> str:
    return f"step-{step:06d}"


def data_filename(rank: int) -> str:
    return f"rank-{rank:05d}.h5"


def step_of(path: Path) -> int | None:
    """The step of a complete checkpoint folder name, or None for anything else."""
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Piece:
    """Box ``[start, stop)`` of a tensor, in dataset ``dataset`` of file ``file``."""

    file: str
    dataset: str
    start: tuple[int, ...]
    stop: tuple[int, ...]
    sha256: str

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
                "pieces": [[p.file, p.dataset, list(p.start), list(p.stop), p.sha256]
                           for p in self.pieces]}

    @classmethod
    def from_json(cls, d: dict) -> TensorEntry:
        pieces = tuple(Piece(str(f), str(ds), tuple(map(int, a)), tuple(map(int, b)), str(h))
                       for f, ds, a, b, h in d["pieces"])
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
    for key in META_KEYS:
        f.attrs[key] = json_attr(meta.get(key))
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
    if int(version) != VERSION:
        raise CheckpointError(f"{path}: {expected} version {int(version)} is not supported "
                              f"(this hpctrain reads version {VERSION})")


@dataclass
class Index:
    """What an index says: where it is, the step, the metadata and every tensor."""

    path: Path  # the index file
    root: Path  # the folder the piece file names are relative to
    step: int
    meta: dict
    files: list[str]
    tensors: dict[str, TensorEntry]

    def file_path(self, name: str) -> Path:
        return self.path if name == SELF else self.root / name


def read_index(path: Path) -> Index:
    """Read and check an index file (``index.h5`` or a consolidated checkpoint)."""
    try:
        f = h5py.File(path, "r")
    except OSError as err:
        raise CheckpointError(f"{path}: cannot be read as HDF5 ({err}); {REMEDY}") from None
    with f:
        check_format(f, path, CHECKPOINT)
        try:
            meta = {key: json.loads(f.attrs[key]) for key in META_KEYS}
            files = list(json.loads(f.attrs["files"]))
            step = int(f.attrs["step"])
            text = f["tensors"][...]
        except (KeyError, ValueError, OSError) as err:
            raise CheckpointError(f"{path}: the index is incomplete or corrupt ({err}); "
                                  f"{REMEDY}") from None
        if sha256_array(text) != f["tensors"].attrs.get("sha256"):
            raise CheckpointError(f"{path}: the tensor table fails its sha256 check; {REMEDY}")
    entries = [TensorEntry.from_json(d) for d in json.loads(text.tobytes())]
    return Index(path, path.parent, step, meta, files, {t.name: t for t in entries})


def resolve(path: str | Path) -> Path:
    """The index file of a checkpoint given as a consolidated file, a step folder, a
    checkpoints folder (its ``latest``) or a run folder (``checkpoints/latest``)."""
    path = Path(path)
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
