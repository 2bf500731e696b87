"""Writing a checkpoint: every piece once, into ``step-N.tmp/``, renamed when complete.

``save(root, step, held, meta, comm)`` is collective over ``comm`` (every rank of the
job): ``plan`` and then ``write_planned``, in four phases, each ending in an
``allgather`` of the ranks' verdicts so an I/O error on one rank fails every rank
alike (``background.BackgroundWriter`` runs the plan on the training thread and
``write_planned`` from a thread of its own, over a communicator of its own):

1. plan: every rank's pieces (``reshard.segments`` of what it holds) are gathered; a
   piece held by several ranks (data-parallel replicas, tensor-parallel replicated
   parameters, the tied table on two pipeline stages) is written by one of them,
   the one with the fewest bytes so far, largest pieces first, so replicas share
   the writing. Pieces of a tensor come from the ranks of its first pipeline stage
   only (ZeRO slices of the tied table differ between stages).
2. rank 0 removes interrupted saves (``step-*.tmp/``), saying so in one line, and
   creates ``step-N.tmp/``;
3. each rank writes its pieces to ``rank-RRRRR.h5`` (``rankfile.RankFileWrite``: HDF5
   makes the structure, the bytes go straight from the arrays to their offsets, around
   the page cache where the file system allows it) or, with parallel HDF5, its boxes
   of the shared ``data.h5``. While the bytes go to the disk from a thread, the rank
   takes its pieces' checksums and, with ``finite``, tests that every floating-point
   piece is finite; only the pieces a rank writes are checked, so each value of the
   checkpoint is checked once, by its writer (a replica is never written). The
   background writer's snapshot comes with its checks, taken during its copy
   (``copysum.py``, numba). Then, still while the bytes go, the piece table is
   gathered on rank 0, which checks that every tensor is tiled exactly once and
   writes ``index.h5`` (not yet fsynced: 3-4 ms here, off the critical path). The
   phase ends, the bytes fsynced, in one ``allgather`` of every rank's I/O error and
   non-finite tensors: any of the first is a ``CheckpointError`` on every rank, any of
   the second a ``NonFiniteState`` on every rank, after rank 0 removed
   ``step-N.tmp/``. A rank that waits for the others before a collective sleeps in a
   polled non-blocking barrier (``arrive``), so that it leaves its core to the ranks
   still writing and checking when ranks share cores (dp = 2 on this 2-core machine);
4. rank 0 fsyncs the index and the folder, renames it ``step-N/``, fsyncs ``root``,
   points ``latest`` at it (atomic replace) and keeps the newest ``keep``
   (``publish``).

A job killed at any point leaves ``latest`` naming the previous complete checkpoint.
``on_event(kind, path)``, if given, is called after each flat dataset ("dataset"),
rank file ("file"), the index ("index"), the rename ("renamed") and the pointer
("latest").
"""

from __future__ import annotations

import functools
import hashlib
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
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
    blocksum64,
    complete_steps,
    data_filename,
    latest_name,
    step_dirname,
    write_index,
)
from hpctrain.checkpoint.rankfile import RankFileWrite, all_finite, unique_names
from hpctrain.checkpoint.reshard import (
    Segment,
    box_volume,
    extract,
    segments,
    tiles,
)
from hpctrain.checkpoint.state import Held
from hpctrain.data.format import DataError, atomic_output, fsync_dir, fsync_path

CHECKPOINT_IO = ("auto", "mpio", "files")  # [train] checkpoint_io
MPIO_REMEDY = ("build h5py against the parallel HDF5 of the MPI that mpi4py uses: "
               "HDF5_MPI=ON CC=mpicc HDF5_DIR=<parallel HDF5 prefix> pip install "
               "--no-binary=h5py --no-build-isolation h5py (Debian's libhdf5-mpich-dev or "
               "libhdf5-openmpi-dev; `make install-system-mpi MPI=mpich|openmpi` does it "
               "here), or save per-rank files: checkpoint_io = \"files\"")


def parallel_hdf5() -> bool:
    """Whether h5py was built with MPI (the ``mpio`` driver: one shared file)."""
    return bool(h5py.get_config().mpi)


def mpio_missing() -> str | None:
    """Why ``checkpoint_io = "mpio"`` cannot run here, or None if it can."""
    if parallel_hdf5():
        return None
    return (f"h5py {h5py.__version__} (HDF5 {h5py.version.hdf5_version}) was built without "
            f"MPI (h5py.get_config().mpi is False)")


def shared_file(io: str, size: int) -> bool:
    """Whether a save over ``size`` ranks writes one shared file through MPI-IO:
    ``"mpio"`` always (an error when h5py has no MPI), ``"files"`` never, ``"auto"``
    when h5py has MPI and the job more than one rank."""
    if io not in CHECKPOINT_IO:
        raise ValueError(f"checkpoint_io ({io!r}) must be one of {', '.join(CHECKPOINT_IO)}")
    if io == "mpio":
        missing = mpio_missing()
        if missing is not None:
            raise CheckpointError(f"checkpoint_io ('mpio') needs h5py with MPI: {missing}; "
                                  f"{MPIO_REMEDY}")
        return True
    return io == "auto" and size > 1 and parallel_hdf5()


POLL_S = 0.0005  # how often a rank waiting in ``arrive`` looks whether the others came


def arrive(comm) -> None:
    """Return once every rank of ``comm`` has called it, sleeping meanwhile: a
    non-blocking barrier tested every ``POLL_S``. MPICH's blocking waits poll a core;
    a rank that waits there for a slower one (for rank 0's commit: its index, fsyncs
    and renames, about 10 ms; for the other ranks' writes and checksums) takes that
    core from the work it waits for when ranks share cores, or from the training
    step beside a background writer thread. After ``arrive`` the collective itself
    finds every rank there. Costs at most ``POLL_S`` of latency per wait."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(POLL_S)


def all_ranks(comm, fn, what: str, catch: tuple = (OSError, DataError), arrive=None):
    """Run ``fn`` on every rank; if it fails with an I/O or checkpoint error (any of
    ``catch``) on any rank, raise CheckpointError on every rank, naming the ranks
    (collective; ``arrive()``, if given, is called before the collective)."""
    error, result = None, None
    try:
        result = fn()
    except catch as err:
        error = str(err) or type(err).__name__
    if arrive is not None and comm.Get_size() > 1:
        arrive()
    errors = comm.allgather(error) if comm.Get_size() > 1 else [error]
    failed = [r for r, e in enumerate(errors) if e is not None]
    if failed:
        where = "" if comm.Get_size() == 1 else f" on rank(s) {failed}"
        raise CheckpointError(f"{what} failed{where}: {errors[failed[0]]}")
    return result


class NonFiniteState(CheckpointError):
    """The state to save holds nan or inf: no checkpoint is written (every rank)."""


def non_finite_error(step: int, everyone: list[list[str]]) -> NonFiniteState | None:
    """The refusal naming the first rank's first non-finite tensor (``everyone[rank]``:
    the names each rank found), or None if there are none."""
    found = [(rank, names) for rank, names in enumerate(everyone) if names]
    if not found:
        return None
    rank, names = found[0]
    where = "" if len(everyone) == 1 else f" on rank {rank}"
    more = f" and {len(names) - 1} more" if len(names) > 1 else ""
    return NonFiniteState(f"the state after step {step} is not finite: {names[0]}{more}"
                          f"{where} holds nan or inf; no checkpoint written")


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


Key = tuple  # (stage, ((tensor, dtype str, Sharding), ...)): what a rank holds


def held_key(held: list[Held], stage: int) -> Key:
    return stage, tuple((h.name, h.array.dtype.str, h.sharding) for h in held)


def _describe(key: Key) -> tuple[list, dict]:
    """``(stage, [(tensor, box, nbytes)])`` and ``{tensor: (dtype, global_shape,
    tp_split, tp_blocks)}`` of what one rank holds."""
    stage, held = key
    items, info = [], {}
    for name, dtype, sh in held:
        info[name] = (dtype, sh.global_shape, sh.tp_split, sh.tp_blocks)
        itemsize = np.dtype(dtype).itemsize
        for seg in segments(sh):
            items.append((name, seg.box, box_volume(seg.box) * itemsize))
    return (stage, items), info


def _write_shared(path: Path, arrays: dict[str, np.ndarray], planned: Plan, step: int,
                  comm, on_event, finite: bool = False) -> tuple[list, list[str]]:
    """Parallel HDF5: one file for every rank, each tensor a dataset of its global shape.

    Collective over ``comm``, every call in the same order on every rank: the file and
    every dataset are made together (HDF5's metadata is collective), then each tensor is
    written in ``planned.rounds[tensor]`` collective writes (MPI-IO two-phase I/O): in
    round k a rank writes its k-th piece of the tensor, or an empty selection when it
    has fewer (ranks holding no piece still take part). ``f.flush()`` makes every rank
    ``MPI_File_sync`` its own writes (on a parallel file system a client's cache is its
    own), rank 0 fsyncs what the close wrote. The pieces' checksums and finite check
    are taken on the same contiguous copies that are written, so they equal the rank
    files'. ``on_event("dataset")`` follows each tensor's writes; an error it raises on
    one rank, or one in taking a piece's copy or checks there, is raised there once the
    file is closed (that rank writes nothing more but takes part in every collective),
    so no rank is left waiting in one."""
    pieces, bad = [], []
    failed: Exception | None = None  # this rank's error: raised after the collectives
    mine: dict[str, list] = {}
    for name, seg in planned.todo:
        mine.setdefault(name, []).append(seg)
    dxpl = h5py.h5p.create(h5py.h5p.DATASET_XFER)
    dxpl.set_dxpl_mpio(h5py.h5fd.MPIO_COLLECTIVE)
    with h5py.File(path, "w-", driver="mpio", comm=comm) as f:
        f.attrs.update({"format": DATA, "version": VERSION, "step": step, "rank": -1})
        for name, (dtype, shape, _, _) in planned.shared.items():
            f.create_dataset(name, shape=shape, dtype=np.dtype(dtype))
        for name, rounds in planned.rounds.items():
            dset = f[name].id
            segs = mine.get(name, []) if failed is None else []
            for k in range(rounds):
                fspace = dset.get_space()
                data = None
                if failed is None and k < len(segs):
                    try:  # a rank-local failure (memory): empty parts from here on
                        data = extract(arrays[name], segs[k])
                    except Exception as err:  # noqa: BLE001 - raised below, once all are done
                        failed = err
                if data is not None:
                    box = segs[k].box
                    if box:
                        fspace.select_hyperslab(tuple(a for a, _ in box),
                                                tuple(b - a for a, b in box))
                    mspace = h5py.h5s.create_simple(data.shape or (1,))
                    dset.write(mspace, fspace, data.reshape(data.shape or (1,)), dxpl=dxpl)
                    try:
                        pieces.append((name, Piece(path.name, name, tuple(a for a, _ in box),
                                                   tuple(b for _, b in box),
                                                   blocksum64(data))))
                        if finite and not all_finite(data):
                            bad.append(name)
                    except Exception as err:  # noqa: BLE001 - as above
                        failed = err
                else:  # nothing of this round here: an empty part in the collective
                    fspace.select_none()
                    mspace = h5py.h5s.create_simple((1,))
                    mspace.select_none()
                    dset.write(mspace, fspace, np.empty(1, dset.dtype), dxpl=dxpl)
            if on_event and failed is None:
                try:  # an error here must not leave the other ranks in a collective
                    on_event("dataset", path)
                except Exception as err:  # noqa: BLE001 - raised below, once all are done
                    failed = err
        f.flush()  # every rank: MPI_File_sync of its writes
    if failed is not None:
        raise failed
    if comm.Get_rank() == 0:
        fsync_path(path)
    if on_event:
        on_event("file", path)
    return pieces, unique_names(bad)


def remove_stale(root: Path, say=print) -> list[str]:
    """Remove the folders interrupted saves left (``step-*.tmp``), saying so in one
    line through ``say`` (None: silently), and finish deletions that ``prune``
    started and the end of a process cut short (not those this process is deleting:
    an unlink of 131 MB took 0.02 s, on the critical path of every save before); the
    names of the first."""
    for p in root.glob(f"step-*{PRUNED}"):
        if p not in _doomed:
            shutil.rmtree(p, ignore_errors=True)
    # a save of a step that already had a checkpoint moves the old one to
    # step-N.old.tmp, then its own in: cut off between the two, step-N is gone, and
    # the old one, complete, goes back (latest may name it)
    for p in sorted(root.glob(f"step-*{OLD}")):
        final = p.with_name(p.name[:-len(OLD)])
        if p.is_dir() and (p / INDEX_NAME).is_file() and not final.exists():
            p.rename(final)
            if say is not None:
                say(f"restored {final} (a save of the same step was cut off while "
                    f"replacing it)")
    stale = sorted(p for p in root.glob("step-*.tmp") if p.is_dir())
    for p in stale:
        shutil.rmtree(p)
    names = [p.name for p in stale]
    if names and say is not None:
        say(f"removed {len(names)} unfinished checkpoint folder(s) an interrupted save left "
            f"in {root}: {', '.join(names)}")
    return names


def prepare(root: Path, step: int, say=print) -> Path:
    """Rank 0: drop interrupted saves (``remove_stale``), create and return
    ``step-N.tmp/``."""
    root.mkdir(parents=True, exist_ok=True)
    remove_stale(root, say)
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


def write_index_file(tmp: Path, step: int, meta: dict, entries: list[TensorEntry]) -> None:
    """Rank 0: ``index.h5`` in ``step-N.tmp/``, not yet fsynced (``publish`` does it)."""
    files = sorted({p.file for e in entries for p in e.pieces})
    with h5py.File(tmp / INDEX_NAME, "w-") as f:
        write_index(f, step=step, meta=meta, files=files, tensors=entries)


def publish(root: Path, tmp: Path, step: int, keep: int, on_event=None) -> Path:
    """Rank 0, once every data file and the index are written: fsync the index and
    the folder, rename it ``step-N/``, point ``latest`` at it, keep the newest
    ``keep``. The data files were fsynced by their writers."""
    fsync_path(tmp / INDEX_NAME)
    fsync_dir(tmp)
    if on_event:
        on_event("index", tmp / INDEX_NAME)
    final = root / step_dirname(step)
    old = None
    if final.exists():  # a checkpoint of the same step, from an earlier run
        old = root / f"{final.name}{OLD}"
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


def commit(root: Path, tmp: Path, step: int, meta: dict, entries: list[TensorEntry],
           keep: int, on_event=None) -> Path:
    """Rank 0: the index of ``entries``, then ``publish``."""
    write_index_file(tmp, step, meta, entries)
    return publish(root, tmp, step, keep, on_event)


PRUNED = ".pruned"  # the suffix of a checkpoint folder being deleted
OLD = ".old.tmp"  # the suffix of a checkpoint being replaced by a save of its step
_deleting: list[threading.Thread] = []  # this process's deletions still running
_doomed: set[Path] = set()  # the folders they have yet to delete


def prune(root: Path, keep: int, protect: Iterable[str] = ()) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (never ``latest``'s, nor
    the step folders named in ``protect``).

    Each is renamed ``step-N.pruned`` at once and deleted by a background thread:
    unlinking the 131 MB of the benchmark GPT's checkpoint took 0.024 s, a quarter of
    a save, that the next step need not wait for. A deletion cut short by the end of
    the process is finished by the next ``prune`` or ``remove_stale``."""
    done = complete_steps(root)
    spared = {latest_name(root), *protect}
    removed = [p for p in done[:max(0, len(done) - keep)] if p.name not in spared]
    doomed = [p for p in root.glob(f"step-*{PRUNED}")  # cut short before
              if p.is_dir() and p not in _doomed]
    for p in removed:
        doomed.append(p.rename(p.with_name(p.name + PRUNED)))
    _doomed.update(doomed)
    if doomed:
        thread = threading.Thread(target=_delete, args=(doomed,), name="hpctrain-prune",
                                  daemon=True)
        _deleting.append(thread)
        thread.start()
    return removed


def _delete(paths: list[Path]) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)  # another process may be at it too
        _doomed.discard(p)


def wait_for_pruning() -> None:
    """Wait until the deletions ``prune`` started have finished."""
    while _deleting:
        _deleting.pop().join()


@dataclass(frozen=True)
class Plan:
    """Who writes what: ``mine``, this rank's ``(tensor, box)`` pieces; ``infos``, every
    rank's ``{tensor: (dtype, global_shape, tp_split, tp_blocks)}``; ``todo``, this
    rank's pieces in writing order, ``(tensor, Segment)``."""

    mine: frozenset
    infos: list[dict]
    todo: tuple[tuple[str, Segment], ...] = ()
    # a shared file's: every tensor's (dtype, global_shape, ...) in one order, and the
    # most pieces of it any rank writes (its collective writes)
    shared: dict = field(default_factory=dict)
    rounds: dict = field(default_factory=dict)


def plan(held: list[Held], comm, stage: int = 0) -> Plan:
    """Phase 1 (see above): which pieces this rank writes. Collective over ``comm``:
    what each rank holds (names, dtypes, shardings) is gathered once and kept; later
    saves of the same holdings gather only a digest of each and a flag (two small
    collectives: 0.1 ms, against 1.4 ms for the benchmark GPT's 231 tensors, pickled at
    every save before); the plan of the same holdings is computed once and kept."""
    key = held_key(held, stage)
    if comm.Get_size() == 1:
        return _plan_of((key,), 0)
    digests = tuple(comm.allgather(_digest(key)))
    keys = _gathered.get(digests)
    # every rank must agree to skip the gather: a rank may have seen these holdings
    # in a gather the others were not part of
    from mpi4py import MPI

    if not comm.allreduce(keys is not None, op=MPI.LAND):
        keys = tuple(comm.allgather(key))
        if len(_gathered) >= _KEPT:
            _gathered.clear()
        _gathered[digests] = keys
    return _plan_of(keys, comm.Get_rank())


_KEPT = 8  # holdings kept by ``plan`` (a process saves one or two kinds)
_gathered: dict[tuple[bytes, ...], tuple[Key, ...]] = {}  # every rank's digest -> keys
_digests: dict[Key, bytes] = {}


def _digest(key: Key) -> bytes:
    """A digest of what a rank holds, the same in every process (Python's ``hash`` of
    strings differs between processes)."""
    digest = _digests.get(key)
    if digest is None:
        if len(_digests) >= _KEPT:
            _digests.clear()
        digest = _digests[key] = hashlib.sha256(repr(key).encode()).digest()
    return digest


@functools.lru_cache(maxsize=8)
def _plan_of(keys: tuple[Key, ...], rank: int) -> Plan:
    described = [_describe(k) for k in keys]
    writers = plan_writers([items for items, _ in described])
    mine = frozenset(writers[rank])
    todo = tuple((name, seg) for name, _, sh in keys[rank][1] for seg in segments(sh)
                 if (name, seg.box) in mine)
    infos = [info for _, info in described]
    shared = {k: v for info in infos for k, v in info.items()}
    counts: dict[tuple[str, int], int] = {}
    for r, boxes in enumerate(writers):
        for name, _ in boxes:
            counts[name, r] = counts.get((name, r), 0) + 1
    rounds = {name: max((c for (n, _), c in counts.items() if n == name), default=0)
              for name in shared}
    return Plan(mine, infos, todo, shared, rounds)


def save(root: str | Path, step: int, held: list[Held], meta: dict, comm, *, stage: int = 0,
         keep: int = 3, on_event=None, say=print, finite: bool = False,
         io: str = "auto") -> Path:
    """Write the checkpoint of ``step`` under ``root``; return its folder (see above).

    ``held``: this rank's arrays (``state.held_tensors``); ``meta``: the JSON metadata
    of ``format.META_KEYS``, the same on every rank; ``stage``: this rank's pipeline
    stage; ``say``: rank 0's one-line notices (stale folders removed); ``finite``:
    refuse (``NonFiniteState``, every rank) a state with nan or inf; ``io``: per-rank
    files or one shared file through MPI-IO (``shared_file``). Collective over ``comm``.
    """
    if keep < 1:
        raise ValueError(f"keep ({keep}) must be at least 1")
    return write_planned(root, step, held, plan(held, comm, stage), meta, comm, keep=keep,
                         on_event=on_event, say=say, finite=finite, io=io,
                         arrive=lambda: arrive(comm))  # waits free the core (dp = 2 here)


def write_planned(root: str | Path, step: int, held: list[Held], planned: Plan, meta: dict,
                  comm, *, keep: int = 3, on_event=None, say=print,
                  catch: tuple = (OSError, DataError), finite: bool = False,
                  capture: Callable[[], tuple[list[Held], dict]] | None = None,
                  arrive: Callable[[], None] | None = None, io: str = "auto") -> Path:
    """Phases 2 to 4 of a save planned by ``plan`` (over a communicator of the same
    ranks as ``comm``); ``catch``: the errors turned into a CheckpointError on every
    rank; ``finite``: refuse a non-finite state (``NonFiniteState`` on every rank,
    ``step-N.tmp`` removed); ``capture``: called first (its errors reported with
    phase 2's) to give the arrays to write instead of ``held``, and the checks
    already taken of them (``checks``' ``known``); ``arrive``: called
    before each collective (``arrive``: wait without spinning a core);
    ``io``: ``shared_file``'s choice. Collective over ``comm``."""
    root, rank, size = Path(root), comm.Get_rank(), comm.Get_size()
    shared = shared_file(io, size)  # the same on every rank: raises on every rank
    arrive = arrive if arrive is not None and size > 1 else (lambda: None)
    tmp = root / f"{step_dirname(step)}.tmp"
    arrays, known = {}, {}

    def start():
        taken, checked = capture() if capture else (held, {})
        arrays.update((h.name, h.array) for h in taken)
        known.update(checked)
        return prepare(root, step, say) if rank == 0 else None

    all_ranks(comm, start, f"preparing {tmp}", catch, arrive)
    error, pieces, bad, writing = None, [], [], None
    try:
        if shared:  # collective: every rank, whatever failed before
            pieces, bad = _write_shared(tmp / SHARED_NAME, arrays, planned, step, comm,
                                        on_event, finite)
        elif planned.todo:
            writing = RankFileWrite(tmp / data_filename(rank), arrays, planned.todo, step,
                                    rank, on_event, finite, known)
            pieces, bad = writing.checks()  # while the bytes go to the disk
    except catch as err:
        error = str(err) or type(err).__name__
    # rank 0 writes the index while the bytes go: it is fsynced, and the folder
    # renamed, only once every rank's data is on the disk
    arrive()
    mine = (pieces, error is None and not bad)
    gathered = comm.gather(mine, root=0) if size > 1 else [mine]
    if rank == 0 and all(ok for _, ok in gathered):
        try:
            entries = _index_entries([p for p, _ in gathered], planned.infos)
            write_index_file(tmp, step, meta, entries)
        except catch as err:
            error = str(err) or type(err).__name__
    if writing is not None:
        try:
            writing.finish()
        except catch as err:
            error = error or str(err) or type(err).__name__
    arrive()
    verdicts = comm.allgather((error, bad)) if size > 1 else [(error, bad)]
    failed = [r for r, (e, _) in enumerate(verdicts) if e is not None]
    if failed:
        where = "" if size == 1 else f" on rank(s) {failed}"
        raise CheckpointError(f"writing {tmp} failed{where}: {verdicts[failed[0]][0]}")
    refusal = non_finite_error(step, [names for _, names in verdicts])
    if refusal is not None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise refusal
    final = all_ranks(comm, lambda: publish(root, tmp, step, keep, on_event) if rank == 0
                      else None, f"committing {tmp}", catch, arrive)
    return comm.bcast(final, root=0) if size > 1 else final

