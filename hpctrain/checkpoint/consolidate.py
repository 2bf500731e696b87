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

Both check their output before they write anything: neither ever writes over a file
of the checkpoint it reads, nor replaces an existing output without ``force``. For
``expand`` the output is two things in a folder, ``step-N/`` and ``latest``
(``check_folder_output``): an existing ``step-N/``, or a ``latest`` naming a later
step (which the write would move back: a resume from the folder would then start
from step N), need ``force``; a newer step added beside older ones does not, as a
save in training.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from hpctrain.checkpoint.format import (
    LATEST_NAME,
    SELF,
    CheckpointError,
    Piece,
    TensorEntry,
    blocksum64,
    data_filename,
    flat_name,
    step_dirname,
    step_of,
    write_index,
)
from hpctrain.checkpoint.rankfile import allocate_flat, flat_layout, pwrite_all
from hpctrain.checkpoint.reader import Checkpoint
from hpctrain.checkpoint.reshard import box_volume, full_box, slices
from hpctrain.checkpoint.writer import PRUNED, commit
from hpctrain.data.format import atomic_h5


def consolidate(src: str | Path, dst: str | Path, *, force: bool = False) -> Path:
    """Write the checkpoint ``src`` as the single file ``dst`` (atomically)."""
    dst = Path(dst)
    with Checkpoint(src) as ckpt:
        check_file_output(ckpt, dst, force)
        with atomic_h5(dst, force=force) as f:
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


def check_file_output(ckpt: Checkpoint, dst: Path, force: bool) -> None:
    """Refuse, before anything is written, a ``dst`` that is a file of ``ckpt`` itself
    (even with ``force``), an existing folder, even an empty one, without ``force``,
    and a folder that is not empty, even with it (``atomic_h5`` refuses the other
    existing outputs)."""
    own = [ckpt.index.path] + [ckpt.index.file_path(name) for name in ckpt.index.files]
    if dst.is_file() and any(p.is_file() and dst.samefile(p) for p in own):
        raise CheckpointError(f"{dst}: is a file of the checkpoint being converted "
                              f"({ckpt.index.path}); refusing to write over it even with "
                              f"--force: name another output")
    if dst.name == LATEST_NAME and (dst.is_file() or any(dst.parent.glob("step-*"))):
        raise CheckpointError(f"{dst}: is (or would be) the '{LATEST_NAME}' pointer of a "
                              f"checkpoints folder, which names its newest step; refusing "
                              f"to write a checkpoint there even with --force: name "
                              f"another file")
    if dst.is_dir() and not force:
        raise CheckpointError(f"{dst}: already exists (a folder); pass --force to replace "
                              f"it")
    if dst.is_dir() and any(dst.iterdir()):  # a dataset's partitions, a run: never
        raise CheckpointError(f"{dst}: is a folder that holds files; the converted "
                              f"checkpoint is one file, which replaces an empty folder "
                              f"at most, even with --force: name a file")


def check_folder_output(root: Path, step: int, source: Path, force: bool) -> None:
    """Refuse, before anything is written, what writing ``root/step-N/`` and
    ``root/latest`` (``expand``) would destroy: always a ``root`` that is not a folder
    (``source``, the file being converted, or any other); without ``force``, a
    non-empty ``root`` that is no checkpoints folder (it has no ``latest``), an
    existing ``step-N/``, and a ``latest`` that names a later step (or no step), which
    the write would move back to step N."""
    if (root.exists() or root.is_symlink()) and not root.is_dir():
        if root.is_file() and root.samefile(source):
            raise CheckpointError(f"{root}: is the file being converted; refusing to write "
                                  f"over it even with --force: name a folder for its "
                                  f"{step_dirname(step)}/ and {LATEST_NAME}")
        raise CheckpointError(f"{root}: exists and is not a folder; a consolidated file "
                              f"converts to a checkpoints folder ({step_dirname(step)}/ and "
                              f"{LATEST_NAME}): name a new folder, or one of checkpoints")
    final, pointer = root / step_dirname(step), root / LATEST_NAME
    if root.is_dir():  # what the write removes: step-N/ (with --force), pruned steps
        inside = source.resolve()
        for doomed in (final, *(p for p in root.glob(f"step-*{PRUNED}") if p.is_dir())):
            if inside.is_relative_to(doomed.resolve()):
                raise CheckpointError(
                    f"{source}: the file being converted is inside {doomed}, which "
                    f"writing {final.name}/ into {root} would "
                    + ("replace" if doomed == final else "delete (a pruned checkpoint)")
                    + "; refusing even with --force: copy the file elsewhere first, "
                    "or name another folder")
    if force or not root.is_dir() or not any(root.iterdir()):
        return
    if not pointer.is_file():
        raise CheckpointError(f"{root}: already exists and is not a checkpoints folder (it "
                              f"has no '{LATEST_NAME}' pointer); pass --force to write "
                              f"{final.name}/ and {LATEST_NAME} into it")
    problems, remedies = [], []
    if final.exists() or final.is_symlink():
        problems.append(f"{final}: already exists")
        remedies.append(f"replace {final.name}/")
    name = pointer.read_text(errors="replace").strip()
    latest = step_of(Path(name))
    if latest is None:
        problems.append(f"{pointer}: names {name!r}, which is no step folder")
        remedies.append(f"point {LATEST_NAME} at {final.name}")
    elif latest > step:
        problems.append(f"{pointer}: names {name}, a later step than {step} (a resume "
                        f"from {root} would start from step {step})")
        remedies.append(f"move {LATEST_NAME} back to {final.name}")
    if problems:
        raise CheckpointError(f"{'; '.join(problems)}; pass --force to "
                              f"{' and '.join(remedies)}")


def row_boxes(shape: tuple[int, ...], n: int) -> list:
    """``shape`` cut along axis 0 into up to ``n`` near-equal boxes (one if 0-d)."""
    if not shape or shape[0] == 0:
        return [full_box(shape)]
    cuts = np.linspace(0, shape[0], min(n, shape[0]) + 1).round().astype(int)
    return [((int(a), int(b)), *full_box(shape[1:])) for a, b in zip(cuts[:-1], cuts[1:],
                                                                      strict=True)]


def expand(src: str | Path, dst: str | Path, *, files: int = 1, force: bool = False) -> Path:
    """Write the checkpoint ``src`` as a checkpoint folder under ``dst`` with ``files``
    data files; ``dst/latest`` names it. Returns the step folder. ``force``: replace
    an existing step folder of the same step, move ``latest`` back
    (``check_folder_output``)."""
    if files < 1:
        raise ValueError(f"files ({files}) must be at least 1")
    root = Path(os.path.abspath(dst))
    with Checkpoint(src) as ckpt:
        check_folder_output(root, ckpt.step, ckpt.index.path, force)
        made = [p for p in (*reversed(root.parents), root) if not p.exists()]
        # a folder of this conversion alone: another save's unfinished step-N.tmp/ (a
        # run training into this folder) is its own to finish or remove
        tmp = root / f"{step_dirname(ckpt.step)}.convert-{os.getpid()}.tmp"
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            return _expand_into(ckpt, root, tmp, files)
        except BaseException:  # a bad piece, a full disk, ^C: nothing of it left behind
            shutil.rmtree(tmp, ignore_errors=True)
            for folder in reversed(made):  # the folders it made, if nothing else is there
                try:
                    folder.rmdir()
                except OSError:
                    break
            raise


def _expand_into(ckpt: Checkpoint, root: Path, tmp: Path, files: int) -> Path:
    """``expand``'s write: the pieces into ``tmp``, then the commit."""
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
