"""Writing a checkpoint: every piece once, into ``step-N.tmp/``, renamed when complete.

``save(root, step, held, meta, comm)`` is collective over ``comm`` (every rank of the
job), in four phases, each ending in an ``allgather`` of the ranks' verdicts so an
I/O error on one rank fails every rank alike:

1. plan: every rank's pieces (``reshard.segments`` of what it holds) are gathered; a
   piece held by several ranks (data-parallel replicas, tensor-parallel replicated
   parameters, the tied table on two pipeline stages) is written by one of them,
   the one with the fewest bytes so far, largest pieces first, so replicas share
   the writing. Pieces of a tensor come from the ranks of its first pipeline stage
   only (ZeRO slices of the tied table differ between stages).
2. rank 0 removes interrupted saves (``step-*.tmp/``) and creates ``step-N.tmp/``;
3. each rank writes its pieces to ``rank-RRRRR.h5`` (or, with parallel HDF5, its
   boxes of the shared ``data.h5``) and fsyncs it;
4. rank 0 gathers the piece table, checks that every tensor is tiled exactly once,
   writes ``index.h5``, fsyncs the folder, renames it ``step-N/``, fsyncs
   ``root``, points ``latest`` at it (atomic replace) and keeps the newest ``keep``.

A job killed at any point leaves ``latest`` naming the previous complete checkpoint.
``on_event(kind, path)``, if given, is called after each dataset ("dataset"), rank
file ("file"), the index ("index"), the rename ("renamed") and the pointer ("latest").
"""

from __future__ import annotations

import shutil
from pathlib import Path

import h5py
import numpy as np

from hpctrain.checkpoint.format import (
    DATA,
    INDEX_NAME,
    LATEST_NAME,
    SHARED_NAME,
    VERSION,
    CheckpointError,
    Piece,
    TensorEntry,
    data_filename,
    step_dirname,
    step_of,
    write_index,
)
from hpctrain.checkpoint.reshard import box_name, box_volume, extract, segments, slices, tiles
from hpctrain.checkpoint.state import Held
from hpctrain.data.format import (
    DataError,
    atomic_output,
    fsync_dir,
    fsync_path,
    sha256_array,
)


def parallel_hdf5() -> bool:
    """Whether h5py was built with MPI (then every rank writes one shared file)."""
    return bool(h5py.get_config().mpi)


def all_ranks(comm, fn, what: str):
    """Run ``fn`` on every rank; if it fails with an I/O or checkpoint error on any
    rank, raise CheckpointError on every rank, naming the ranks (collective)."""
    error, result = None, None
    try:
        result = fn()
    except (OSError, DataError) as err:
        error = str(err)
    errors = comm.allgather(error) if comm.Get_size() > 1 else [error]
    failed = [r for r, e in enumerate(errors) if e is not None]
    if failed:
        where = "" if comm.Get_size() == 1 else f" on rank(s) {failed}"
        raise CheckpointError(f"{what} failed{where}: {errors[failed[0]]}")
    return result


def plan_writers(everyone: list[tuple[int, list[tuple[str, tuple, int]]]]) -> list[set]:
    """Which rank writes each piece: ``everyone[rank] = (stage, [(tensor, box, nbytes)])``
    -> per rank the set of ``(tensor, box)`` it writes (see phase 1 above)."""
    first_stage: dict[str, int] = {}
    for stage, items in everyone:
        for name, _, _ in items:
            first_stage[name] = min(first_stage.get(name, stage), stage)
    holders: dict[tuple, tuple[int, list[int]]] = {}
    for rank, (stage, items) in enumerate(everyone):
        for name, box, nbytes in items:
            if stage == first_stage[name]:
                holders.setdefault((name, box), (nbytes, []))[1].append(rank)
    load = [0] * len(everyone)
    mine: list[set] = [set() for _ in everyone]
    order = sorted(holders, key=lambda k: -holders[k][0])  # stable: ties keep rank order
    for key in order:
        nbytes, ranks = holders[key]
        writer = min(ranks, key=lambda r: (load[r], r))
        load[writer] += nbytes
        mine[writer].add(key)
    return mine


def _describe(held: list[Held]) -> tuple[list, dict]:
    items, info = [], {}
    for h in held:
        sh = h.sharding
        info[h.name] = (h.array.dtype.str, sh.global_shape, sh.tp_split, sh.tp_blocks)
        for seg in segments(sh):
            items.append((h.name, seg.box, box_volume(seg.box) * h.array.itemsize))
    return items, info


def write_piece(f: h5py.File, tensor: str, box, data: np.ndarray,
                global_shape: tuple[int, ...]) -> Piece:
    """Store the values ``data`` of ``box`` of a tensor as dataset ``/<tensor>/<box>``
    with its ``start``, ``global_shape`` and ``sha256`` attributes."""
    digest = sha256_array(data)
    dataset = f"{tensor}/{box_name(box)}"
    dset = f.create_dataset(dataset, data=data)
    dset.attrs.update({"start": [a for a, _ in box], "global_shape": list(global_shape),
                       "sha256": digest})
    return Piece(Path(f.filename).name, dataset, tuple(a for a, _ in box),
                 tuple(b for _, b in box), digest)


def data_file(path: Path, step: int, rank: int) -> h5py.File:
    """A new data file (refusing to overwrite) with its format attributes."""
    f = h5py.File(path, "w-")
    f.attrs.update({"format": DATA, "version": VERSION, "step": step, "rank": rank})
    return f


def _write_rank_file(path: Path, held: list[Held], mine: set, step: int, rank: int,
                     on_event) -> list[tuple[str, Piece]]:
    """This rank's pieces as datasets ``/<tensor>/<box>``; fsync'ed; the piece table."""
    pieces = []
    with data_file(path, step, rank) as f:
        for h in held:
            for seg in segments(h.sharding):
                if (h.name, seg.box) in mine:
                    data = extract(h.array, seg)
                    pieces.append((h.name, write_piece(f, h.name, seg.box, data,
                                                       h.sharding.global_shape)))
                    if on_event:
                        on_event("dataset", path)
    fsync_path(path)  # h5py never fsyncs: reopen and fsync
    if on_event:
        on_event("file", path)
    return pieces


def _write_shared(path: Path, held: list[Held], mine: set, info: dict, step: int, comm,
                  on_event) -> list[tuple[str, Piece]]:
    """Parallel HDF5: one file, each tensor a dataset of its global shape, created by
    every rank in the same order (collective); each rank writes its boxes."""
    pieces = []
    with h5py.File(path, "w-", driver="mpio", comm=comm) as f:
        f.attrs.update({"format": DATA, "version": VERSION, "step": step, "rank": -1})
        for name, (dtype, shape, _, _) in info.items():
            f.create_dataset(name, shape=shape, dtype=np.dtype(dtype))
        for h in held:
            for seg in segments(h.sharding):
                if (h.name, seg.box) in mine:
                    data = extract(h.array, seg)
                    f[h.name][slices(seg.box)] = data
                    pieces.append((h.name, Piece(path.name, h.name,
                                                 tuple(a for a, _ in seg.box),
                                                 tuple(b for _, b in seg.box),
                                                 sha256_array(data))))
    if comm.Get_rank() == 0:
        fsync_path(path)
    if on_event:
        on_event("file", path)
    return pieces


def prepare(root: Path, step: int) -> Path:
    """Rank 0: drop interrupted saves, create and return ``step-N.tmp/``."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("step-*.tmp"):
        shutil.rmtree(stale)
    tmp = root / f"{step_dirname(step)}.tmp"
    tmp.mkdir()
    return tmp


def _index_entries(gathered: list[list[tuple[str, Piece]]], infos: list[dict]
                   ) -> list[TensorEntry]:
    pieces: dict[str, list[Piece]] = {}
    for rank_pieces in gathered:
        for name, piece in rank_pieces:
            pieces.setdefault(name, []).append(piece)
    spec: dict[str, tuple] = {}
    for info in infos:
        for name, s in info.items():
            spec.setdefault(name, s)
    entries = []
    for name, (dtype, shape, split, blocks) in spec.items():
        mine = sorted(pieces.get(name, []), key=lambda p: p.start)
        problem = tiles([p.box for p in mine], tuple(shape))
        if problem is not None:  # a bug in the plan, never a user error
            raise RuntimeError(f"checkpoint tensor {name}: {problem}")
        entries.append(TensorEntry(name, dtype, tuple(shape), split, blocks, tuple(mine)))
    return entries


def commit(root: Path, tmp: Path, step: int, meta: dict, files: list[str],
           entries: list[TensorEntry], keep: int, on_event=None) -> Path:
    """Rank 0: the index, fsync, rename to ``step-N/``, the ``latest`` pointer, pruning."""
    with h5py.File(tmp / INDEX_NAME, "w-") as f:
        write_index(f, step=step, meta=meta, files=files, tensors=entries)
    fsync_path(tmp)  # every file in the folder, and the folder
    if on_event:
        on_event("index", tmp / INDEX_NAME)
    final = root / step_dirname(step)
    old = None
    if final.exists():  # a checkpoint of the same step, from an earlier run
        old = root / f"{final.name}.old.tmp"
        final.rename(old)
    tmp.rename(final)
    fsync_dir(root)
    if on_event:
        on_event("renamed", final)
    with atomic_output(root / LATEST_NAME, force=True) as pointer:
        pointer.write_text(final.name + "\n")
    if on_event:
        on_event("latest", root / LATEST_NAME)
    if old is not None:
        shutil.rmtree(old)
    prune(root, keep)
    return final


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (never ``latest``'s)."""
    latest = (root / LATEST_NAME).read_text().strip() if (root / LATEST_NAME).is_file() else ""
    done = sorted((p for p in root.iterdir() if step_of(p) is not None and
                   (p / INDEX_NAME).is_file()), key=step_of)
    removed = [p for p in done[:max(0, len(done) - keep)] if p.name != latest]
    for p in removed:
        shutil.rmtree(p)
    return removed


def save(root: str | Path, step: int, held: list[Held], meta: dict, comm, *, stage: int = 0,
         keep: int = 3, on_event=None) -> Path:
    """Write the checkpoint of ``step`` under ``root``; return its folder (see above).

    ``held``: this rank's arrays (``state.held_tensors``); ``meta``: the JSON metadata
    of ``format.META_KEYS``, the same on every rank; ``stage``: this rank's pipeline
    stage. Collective over ``comm``.
    """
    if keep < 1:
        raise ValueError(f"keep ({keep}) must be at least 1")
    root, rank, size = Path(root), comm.Get_rank(), comm.Get_size()
    tmp = root / f"{step_dirname(step)}.tmp"
    items, info = _describe(held)
    everyone = comm.allgather((stage, items)) if size > 1 else [(stage, items)]
    infos = comm.allgather(info) if size > 1 else [info]
    mine = plan_writers(everyone)[rank]
    all_ranks(comm, lambda: prepare(root, step) if rank == 0 else None, f"preparing {tmp}")
    pieces = all_ranks(comm, lambda: _write(tmp, held, mine, infos, step, comm, on_event),
                       f"writing {tmp}")
    gathered = comm.gather(pieces, root=0) if size > 1 else [pieces]

    def finish():
        if rank != 0:
            return None
        entries = _index_entries(gathered, infos)
        files = sorted({p.file for e in entries for p in e.pieces})
        return commit(root, tmp, step, meta, files, entries, keep, on_event)

    final = all_ranks(comm, finish, f"committing {tmp}")
    return comm.bcast(final, root=0) if size > 1 else final


def _write(tmp: Path, held: list[Held], mine: set, infos: list[dict], step: int, comm,
           on_event) -> list[tuple[str, Piece]]:
    """This rank's pieces: into the shared file with parallel HDF5, else its own file
    (none if it writes nothing)."""
    if parallel_hdf5() and comm.Get_size() > 1:
        merged = {k: v for info in infos for k, v in info.items()}
        return _write_shared(tmp / SHARED_NAME, held, mine, merged, step, comm, on_event)
    if not mine:
        return []
    return _write_rank_file(tmp / data_filename(comm.Get_rank()), held, mine, step,
                            comm.Get_rank(), on_event)
