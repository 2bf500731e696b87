"""The single-file form of a checkpoint, and back.

``consolidate(src, dst)`` writes one HDF5 file holding every tensor whole, as the
dataset ``/data/<tensor>``, with the index at its root (its pieces name the file
itself, ``"."``): easy to copy, to inspect, to read from another program. It loads
like any checkpoint.

``expand(src, dst, files=n)`` writes a checkpoint folder again (``dst/step-N/`` and
``dst/latest``): each tensor cut along its first axis into up to ``n`` pieces spread
over ``n`` data files, so that a large checkpoint is read in parallel. Both are
serial and go through the reader, so every piece is checked on the way.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hpctrain.checkpoint.format import SELF, Piece, TensorEntry, data_filename, write_index
from hpctrain.checkpoint.reader import Checkpoint
from hpctrain.checkpoint.reshard import full_box
from hpctrain.checkpoint.writer import commit, data_file, prepare, write_piece
from hpctrain.data.format import atomic_h5, fsync_path, sha256_array


def consolidate(src: str | Path, dst: str | Path, *, force: bool = False) -> Path:
    """Write the checkpoint ``src`` as the single file ``dst`` (atomically)."""
    dst = Path(dst)
    with Checkpoint(src) as ckpt, atomic_h5(dst, force=force) as f:
        entries = []
        for entry in ckpt.tensors.values():
            full = ckpt.read_full(entry.name)
            dataset = f"data/{entry.name}"
            f.create_dataset(dataset, data=full)
            piece = Piece(SELF, dataset, (0,) * full.ndim, full.shape, sha256_array(full))
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
        handles = [data_file(tmp / data_filename(i), ckpt.step, i) for i in range(files)]
        try:
            entries = []
            for k, entry in enumerate(ckpt.tensors.values()):
                full = ckpt.read_full(entry.name)
                pieces = []
                for j, box in enumerate(row_boxes(entry.global_shape, files)):
                    values = np.ascontiguousarray(full[tuple(slice(a, b) for a, b in box)])
                    pieces.append(write_piece(handles[(k + j) % files], entry.name, box,
                                              values, entry.global_shape))
                entries.append(TensorEntry(entry.name, entry.dtype, entry.global_shape,
                                           entry.tp_split, entry.tp_blocks, tuple(pieces)))
        finally:
            for h in handles:
                h.close()
        for i in range(files):
            fsync_path(tmp / data_filename(i))
        names = sorted({p.file for e in entries for p in e.pieces})
        for i in range(files):  # a file that received no piece (more files than rows)
            if data_filename(i) not in names:
                (tmp / data_filename(i)).unlink()
        return commit(root, tmp, ckpt.step, ckpt.meta, names, entries, keep=1 << 30)
