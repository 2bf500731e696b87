"""``hpctrain ckpt verify``: every piece of a checkpoint read and checked, every problem
named (the file, the tensor), not only the first: files HDF5 cannot open (once each),
pieces that fail their checksum or cannot be read, tensors that hold nan or inf."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hpctrain.checkpoint.format import (
    CHECKPOINT,
    DATA,
    SELF,
    CheckpointError,
    check_format,
    open_checkpoint_file,
)
from hpctrain.checkpoint.rankfile import all_finite
from hpctrain.checkpoint.reader import Checkpoint


def verify(path: str | Path) -> tuple[Checkpoint, list[str]]:
    """Read every piece of every tensor; return the checkpoint and its problems (each
    naming the file and the tensor): files that cannot be opened (one problem each,
    their pieces skipped), unreadable or corrupt pieces, and tensors that hold nan or
    inf. Opening errors of the index are raised."""
    with Checkpoint(path) as ckpt:
        unopened = unopenable_files(ckpt)
        problems = list(unopened.values())
        for entry in ckpt.tensors.values():
            bad = {"nan": 0, "inf": 0}
            for piece in entry.pieces:
                if piece.file in unopened:
                    continue
                try:
                    data = ckpt.read_piece(entry, piece)
                except CheckpointError as err:
                    problems.append(str(err))
                    continue
                if not all_finite(data):
                    bad["nan"] += int(np.isnan(data).sum())
                    bad["inf"] += int(np.isinf(data).sum())
            if bad["nan"] or bad["inf"]:
                size = int(np.prod(entry.global_shape))
                problems.append(f"{ckpt.index.path}: tensor {entry.name} is not finite: "
                                f"{bad['nan']} nan and {bad['inf']} inf of {size} values")
    return ckpt, problems


def unopenable_files(ckpt: Checkpoint) -> dict[str, str]:
    """The files of ``ckpt`` that HDF5 cannot open as its data (truncated, overwritten,
    locked), each with one problem naming it and how many tensors it holds pieces of:
    ``verify`` reads none of their pieces, rather than naming the file once a piece."""
    holds: dict[str, list[str]] = {}  # file -> the tensor of each of its pieces
    for entry in ckpt.tensors.values():
        for piece in entry.pieces:
            holds.setdefault(piece.file, []).append(entry.name)
    problems = {}
    for name, tensors in holds.items():
        path = ckpt.index.file_path(name)
        held = (f", which holds {len(tensors)} piece(s) of {len(set(tensors))} tensor(s), "
                f"none of them verified")
        try:
            f = open_checkpoint_file(path, held)
        except CheckpointError as err:
            problems[name] = str(err)
            continue
        with f:
            try:
                check_format(f, path, CHECKPOINT if name == SELF else DATA)
            except CheckpointError as err:
                problems[name] = f"{err}{held}"
    return problems
