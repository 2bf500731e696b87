"""Reading a checkpoint at any layout: every piece checked before it is used.

``Checkpoint(path)`` reads the index (``format.resolve`` finds it from a run folder,
a checkpoints folder, a step folder or a consolidated file) and checks, before any
tensor is read, that every file it names exists and that the pieces of every tensor
tile its global shape exactly once. ``read_into(name, array, sharding)`` fills the
part of a tensor a rank holds, whatever layout wrote it: for each of the rank's
segments (``reshard.segments``) it reads the stored pieces that overlap it, each
whole and once, checks the piece's shape, dtype and sha256, and copies the overlap.

Every failure is a ``CheckpointError`` naming the file and the tensor: a missing
file or piece, a checksum mismatch, a shape or dtype that differs from the model's.
Nothing is ever zero-filled, and no HDF5 virtual dataset is involved.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from hpctrain.checkpoint.format import (
    CHECKPOINT,
    DATA,
    REMEDY,
    SELF,
    CheckpointError,
    Index,
    Piece,
    TensorEntry,
    check_format,
    read_index,
    resolve,
)
from hpctrain.checkpoint.reshard import (
    Box,
    Sharding,
    box_name,
    box_shape,
    box_volume,
    intersect,
    region,
    segments,
    slices,
    tiles,
)
from hpctrain.data.format import sha256_array


class Checkpoint:
    """An open checkpoint: its index, and the files opened so far (read-only)."""

    def __init__(self, path: str | Path):
        self.index: Index = read_index(resolve(path))
        self._files: dict[str, h5py.File] = {}
        self._check_files()
        for entry in self.index.tensors.values():
            problem = tiles([p.box for p in entry.pieces], entry.global_shape)
            if problem is not None:
                raise CheckpointError(f"{self.index.path}: tensor {entry.name}: {problem}; "
                                      f"{REMEDY}")

    @property
    def step(self) -> int:
        return self.index.step

    @property
    def meta(self) -> dict:
        return self.index.meta

    @property
    def tensors(self) -> dict[str, TensorEntry]:
        return self.index.tensors

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for f in self._files.values():
            if f.id.valid:
                f.close()
        self._files = {}

    def _check_files(self) -> None:
        holds: dict[str, list[str]] = {}
        for entry in self.index.tensors.values():
            for p in entry.pieces:
                holds.setdefault(p.file, []).append(entry.name)
        for name, tensors in holds.items():
            path = self.index.file_path(name)
            if not path.is_file():
                raise CheckpointError(f"{path}: missing; it holds {len(tensors)} piece(s), "
                                      f"of tensor {tensors[0]} among others; {REMEDY}")

    def _file(self, name: str, tensor: str) -> h5py.File:
        if name not in self._files:
            path = self.index.file_path(name)
            try:
                f = h5py.File(path, "r")
            except OSError as err:
                raise CheckpointError(f"{path}: cannot be read as HDF5 ({err}), needed for "
                                      f"tensor {tensor}; {REMEDY}") from None
            try:
                check_format(f, path, CHECKPOINT if name == SELF else DATA)
            except CheckpointError:
                f.close()
                raise
            self._files[name] = f
        return self._files[name]

    def entry(self, name: str) -> TensorEntry:
        if name not in self.index.tensors:
            raise CheckpointError(f"{self.index.path}: has no tensor {name} "
                                  f"({len(self.index.tensors)} tensors)")
        return self.index.tensors[name]

    def read_piece(self, entry: TensorEntry, piece: Piece,
                   out: np.ndarray | None = None) -> np.ndarray:
        """One stored piece, whole, after checking its shape, dtype and sha256; read
        straight into ``out`` (C-contiguous, the piece's shape) if given."""
        path = self.index.file_path(piece.file)
        where = f"{path}: tensor {entry.name}, piece {box_name(piece.box)}"
        f = self._file(piece.file, entry.name)
        try:
            dset = f[piece.dataset]
            if dset.dtype != np.dtype(entry.dtype):
                raise CheckpointError(f"{where}: dtype {dset.dtype}, the index says "
                                      f"{np.dtype(entry.dtype)}")
            whole = dset.shape == box_shape(piece.box)
            if not whole and dset.shape != entry.global_shape:  # shared or consolidated
                raise CheckpointError(f"{where}: dataset {piece.dataset} has shape "
                                      f"{dset.shape}, the index says {box_shape(piece.box)}")
            if out is not None and whole:
                dset.read_direct(out)
                data = out
            else:
                data = dset[...] if whole else dset[slices(piece.box)]
        except (KeyError, OSError, ValueError, TypeError) as err:
            raise CheckpointError(f"{where}: cannot be read ({err}); {REMEDY}") from None
        digest = sha256_array(data)
        if digest != piece.sha256:
            raise CheckpointError(f"{where}: sha256 mismatch (stored {piece.sha256[:12]}..., "
                                  f"read {digest[:12]}...): the file is corrupt; {REMEDY}")
        return data

    def check_fits(self, name: str, sharding: Sharding, dtype, hint: str = "") -> TensorEntry:
        """The entry of ``name``, after checking it has the model's shape and dtype."""
        entry = self.entry(name)
        if entry.global_shape != tuple(sharding.global_shape):
            raise CheckpointError(f"{self.index.path}: tensor {name} has global shape "
                                  f"{entry.global_shape}, the model built from the config "
                                  f"has {tuple(sharding.global_shape)}{hint}")
        if np.dtype(entry.dtype) != np.dtype(dtype):
            raise CheckpointError(f"{self.index.path}: tensor {name} is "
                                  f"{np.dtype(entry.dtype)}, the model is {np.dtype(dtype)}"
                                  f"{hint}")
        return entry

    def read_into(self, name: str, array: np.ndarray, sharding: Sharding,
                  hint: str = "") -> None:
        """Fill ``array`` (held as ``sharding`` says) with its part of tensor ``name``."""
        entry = self.check_fits(name, sharding, array.dtype, hint)
        if array.shape != sharding.shape:
            raise ValueError(f"{name}: the array {array.shape} is not the held shape "
                             f"{sharding.shape}")
        overlaps: dict[int, list[tuple[int, Box]]] = {}  # piece -> (segment, overlap)
        segs = segments(sharding)
        for s, seg in enumerate(segs):
            covered = 0
            for k, piece in enumerate(entry.pieces):
                common = intersect(seg.box, piece.box)
                if common is not None:
                    overlaps.setdefault(k, []).append((s, common))
                    covered += box_volume(common)
            if covered != box_volume(seg.box):
                raise CheckpointError(f"{self.index.path}: tensor {name}: the pieces cover "
                                      f"{covered} of the {box_volume(seg.box)} elements of "
                                      f"{box_name(seg.box)}; {REMEDY}")
        for k, parts in overlaps.items():
            piece = entry.pieces[k]
            (s, common), *more = parts
            target = region(array, segs[s])
            if not more and common == piece.box == segs[s].box and target.flags.c_contiguous:
                self.read_piece(entry, piece, out=target)  # the same layout: no copy
                continue
            data = self.read_piece(entry, piece)
            for s, common in parts:
                held = region(array, segs[s])  # a view of the segment's box
                held[slices(common, segs[s].box)] = data[slices(common, piece.box)]

    def read_full(self, name: str) -> np.ndarray:
        """The whole global tensor ``name``."""
        entry = self.entry(name)
        out = np.empty(entry.global_shape, np.dtype(entry.dtype))
        self.read_into(name, out, Sharding(entry.global_shape))
        return out


def verify(path: str | Path) -> tuple[Checkpoint, list[str]]:
    """Read every piece of every tensor; return the checkpoint and its problems (each
    naming the file and the tensor). Opening errors are raised."""
    problems = []
    with Checkpoint(path) as ckpt:
        for entry in ckpt.tensors.values():
            for piece in entry.pieces:
                try:
                    ckpt.read_piece(entry, piece)
                except CheckpointError as err:
                    problems.append(str(err))
    return ckpt, problems
