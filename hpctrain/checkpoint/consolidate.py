"""The single-file form of a checkpoint, and back.

``consolidate(src, dst)`` writes one HDF5 file holding every tensor whole, as the
dataset ``/data/<tensor>``, with the index at its root (its pieces name the file
itself, ``"."``): easy to copy, to inspect, to read from another program. It loads
like any checkpoint.

``expand(src, dst, files=n)`` writes a checkpoint folder again (``dst/step-N/`` and
``dst/latest``): each tensor cut along its first axis into up to ``n`` pieces spread
over ``n`` data files (the flat layout of ``format``: the layout of every file is made
first, from the index, then each tensor is read once and its pieces written straight
to their offsets), so that a large checkpoint is read in parallel. Both are serial
and go through the reader, so every piece is checked on the way.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from hpctrain.checkpoint.format import (
    SELF,
    Piece,
    TensorEntry,
    blocksum64,
    data_filename,
    flat_name,
    write_index,
)
from hpctrain.checkpoint.rankfile import allocate_flat, flat_layout, pwrite_all
from hpctrain.checkpoint.reader import Checkpoint
from hpctrain.checkpoint.reshard import box_volume, full_box, slices
from hpctrain.checkpoint.writer import commit, prepare
from hpctrain.data.format import atomic_h5


def consolidate(src: str | Path, dst: str | Path, *, force: bool = False) -> Path:
    """Write the checkpoint ``src`` as the single file ``dst`` (atomically)."""
    dst = Path(dst)
    with Checkpoint(src) as ckpt, atomic_h5(dst, force=force) as f:
        entries = []
        for entry in ckpt.tensors.values():
            full = ckpt.read_full(entry.name)
            dataset = f"data/{entry.name}"
            f.create_dataset(dataset, data=full)
            # no offset: a copied or repacked single file must still load (through HDF5)
            piece = Piece(SELF, dataset, (0,) * full.ndim, full.shape, blocksum64(full))
            entries.append(TensorEntry(entry.name, entry.dtype, entry.global_shape,
                                       entry.tp_split, entry.tp_blocks, (piece,)))
        write_index(f, step=ckpt.step, meta=ckpt.meta, files=[SELF], tensors=entries)
    return dst


def row_boxes(shape: tuple[int, ...], n: int) -> list:
    """``shape`` cut along axis 0 into up to ``n`` near-equal boxes (one if 0-d)."""
    if not shape or shape[0] == 0:
        return [full_box(shape)]
    cuts = np.linspace(0, shape[0], min(n, shape[0]) + 1).round().astype(int)
    return [((int(a), int(b)), *full_box(shape[1:])) for a, b in zip(cuts[:-1], cuts[1:],
                                                                      strict=True)]


def expand(src: str | Path, dst: str | Path, *, files: int = 1) -> Path:
    """Write the checkpoint ``src`` as a checkpoint folder under ``dst`` with ``files``
    data files; ``dst/latest`` names it. Returns the step folder."""
    if files < 1:
        raise ValueError(f"files ({files}) must be at least 1")
    root = Path(dst)
    with Checkpoint(src) as ckpt:
        tmp = prepare(root, ckpt.step)
        tensors = list(ckpt.tensors.values())
        where: list[list[tuple[int, tuple]]] = []  # per tensor: (file, box) of its pieces
        placed: list[list[tuple[str, int]]] = [[] for _ in range(files)]
        for k, entry in enumerate(tensors):
            boxes = row_boxes(entry.global_shape, files)
            where.append([((k + j) % files, box) for j, box in enumerate(boxes)])
            for i, box in where[-1]:
                placed[i].append((np.dtype(entry.dtype).str, box_volume(box)))
        layouts = [flat_layout(p) for p in placed]
        offsets = {i: allocate_flat(tmp / data_filename(i), ckpt.step, i, layouts[i][0])
                   for i in range(files) if placed[i]}
        fds = {i: os.open(tmp / data_filename(i), os.O_WRONLY) for i in offsets}
        try:
            entries, next_at = [], [iter(ats) for _, ats in layouts]
            for entry, spots in zip(tensors, where, strict=True):
                full = ckpt.read_full(entry.name)
                pieces = []
                for i, box in spots:
                    values = np.ascontiguousarray(full[slices(box)])
                    at = next(next_at[i])
                    pwrite_all(fds[i], [values], offsets[i][values.dtype.str]
                               + at * values.itemsize)
                    pieces.append(Piece(data_filename(i), flat_name(values.dtype),
                                        tuple(a for a, _ in box), tuple(b for _, b in box),
                                        blocksum64(values), at=at))
                entries.append(TensorEntry(entry.name, entry.dtype, entry.global_shape,
                                           entry.tp_split, entry.tp_blocks, tuple(pieces)))
            for fd in fds.values():
                os.fsync(fd)
        finally:
            for fd in fds.values():
                os.close(fd)
        return commit(root, tmp, ckpt.step, ckpt.meta, entries, keep=1 << 30)
