"""Reading a checkpoint at any layout: every piece checked before it is used.

``Checkpoint(path)`` reads the index (``format.resolve`` finds it from a run folder,
a checkpoints folder, a step folder or a consolidated file) and checks, before any
tensor is read, that every file it names exists and that the pieces of every tensor
tile its global shape exactly once. ``read_into(name, array, sharding)`` fills the
part of a tensor a rank holds, whatever layout wrote it: for each of the rank's
segments (``reshard.segments``) it reads the stored pieces that overlap it, each
whole and once, checks the piece's shape, dtype and checksum (the algorithm the index
names: ``format.blocksum64``, or sha256 in version 1), and copies the overlap. A piece
whose place in the file is known (version 3: its flat dataset's offset, which HDF5
gives once per file and dtype, plus its position; version 2: the offset the index
records) is read with ``os.preadv`` straight into the live array when the layouts
match, else into a new array: HDF5 only checks the file's format and, in version 3,
the flat dataset's dtype and length; a piece read through HDF5 (version 1,
consolidated and shared files, a repacked version 3 file) has its dataset's shape
and dtype checked too.

``read_held(held)`` loads a rank's whole state (what ``training.load_training``
calls): the pieces that land whole in a contiguous part of a held array are sorted
by file and offset and cut into runs of pieces that follow one another in a file (up
to ``RUN_BYTES``, 2 MB; a larger piece is a run of its own); the rest go through
``read_into``. A few threads (``read_threads``: the cores the rank may use, shared
among the ranks of its node, at most 4, counted as its BLAS threads are) each take
the next run in file order, read it with one ``preadv`` and take its checksums at
once, while its bytes are still in the caches: the kernel's copies out of the page
cache and the checksums run on every core the rank has, and no pass reads a run back
from memory. A bad run stops the threads
taking new ones, and the load fails with the error of the first bad run in file
order (every run before it was taken, and is finished, first). On the benchmark GPT
(231 pieces) one ``preadv`` per run replaced 231 reads and checks in turn, about 10
ms of Python.
Replicas share the checking: the ranks of one node that hold the same arrays (data
parallel, ``training.check_share``) read the same runs from the same page cache, so
each checks about 1/n of them (``share_owners``) and a bad piece found by any fails
the load on every rank (``writer.all_ranks``); at dp = 2 that halves a load's checksum
work. Every byte a rank loads was checked by a rank of its node after the same read
of the same file; what no checksum sees, as before, is a rank's own copy out of the
page cache.

Every failure is a ``CheckpointError`` naming the file and the tensor: a missing
file or piece, a checksum mismatch, a shape or dtype that differs from the model's.
Nothing is ever zero-filled, and no HDF5 virtual dataset is involved.
"""

from __future__ import annotations

import functools
import os
import queue
from concurrent.futures import ThreadPoolExecutor
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
    checksum_of,
    open_checkpoint_file,
    read_index,
    resolve,
)
from hpctrain.checkpoint.rankfile import IOV_MAX, byte_views
from hpctrain.checkpoint.reshard import (
    Box,
    Sharding,
    box_name,
    box_shape,
    box_volume,
    full_box,
    intersect,
    region,
    segments,
    slices,
    tiles_bounds,
)
from hpctrain.checkpoint.state import Held
from hpctrain.slurm.placement import blas_threads_per_rank

RUN_BYTES = 2 << 20  # read_held's reads: each checked at once, while still in the caches
MAX_READ_THREADS = 4  # read_held's threads, at most
_segments = functools.lru_cache(maxsize=4096)(segments)  # pure, and asked at every load


class Checkpoint:
    """An open checkpoint: its index, and the files opened so far (read-only)."""

    def __init__(self, path: str | Path, image: bytes | None = None,
                 check_files: bool = True):
        """``image``: the index file's bytes, read once for many ranks
        (``training.index_image``); None: read here. ``check_files``: check that every
        file the index names exists (a stat each: with many ranks, one rank does it)."""
        self.index: Index = read_index(resolve(path), image)
        self._files: dict[str, h5py.File] = {}
        self._fds: dict[str, int] = {}
        self._flat: dict[tuple[str, str], tuple[int | None, int]] = {}
        self.bytes_read = 0  # tensor bytes read from the files so far
        if check_files:
            self._check_files()
        for entry in self.index.tensors.values():
            if entry.whole():
                continue
            problem = tiles_bounds(*entry.bounds(), entry.global_shape)
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
        for fd in self._fds.values():
            os.close(fd)
        self._files, self._fds, self._flat = {}, {}, {}

    def _check_files(self) -> None:
        """Every file a piece is in exists (in the order the pieces name them), else
        an error naming it, how many pieces it holds and a tensor they are of."""
        entries = list(self.index.tensors.values())
        names: dict[str, None] = {}
        for table in {id(e.table): e.table for e in entries if e.table is not None}.values():
            files, first = np.unique(table.rows[:, 0], return_index=True)  # NumPy: 1,024
            names.update(dict.fromkeys(table.files[k] for k in files[np.argsort(first)]))
        for e in entries:  # an index of version 1 to 3: its pieces, as read
            if e.table is None:
                names.update(dict.fromkeys(p.file for p in e.pieces))
        for name in names:
            path = self.index.file_path(name)
            if not path.is_file():
                holding = [e for e in entries if name in e.files()]
                pieces = sum(sum(p.file == name for p in e.pieces) for e in holding)
                raise CheckpointError(f"{path}: missing; it holds {pieces} piece(s), "
                                      f"of tensor {holding[0].name} among others; {REMEDY}")

    def _file(self, name: str, tensor: str) -> h5py.File:
        if name not in self._files:
            path = self.index.file_path(name)
            f = open_checkpoint_file(path, f", needed for tensor {tensor}")
            try:
                check_format(f, path, CHECKPOINT if name == SELF else DATA)
            except CheckpointError:
                f.close()
                raise
            self._files[name] = f
        return self._files[name]

    def _fd(self, name: str, tensor: str) -> int:
        """A raw descriptor of a data file, once HDF5 has checked its format."""
        if name not in self._fds:
            self._file(name, tensor)
            fd = self._fds[name] = os.open(self.index.file_path(name), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a longer readahead
        return self._fds[name]

    def _flat_offset(self, entry: TensorEntry, piece: Piece) -> int | None:
        """Version 3 and later: the byte offset of the piece in its file (``_flat_at``)."""
        return self._flat_at(entry, piece.file, piece.dataset, piece.at,
                             box_volume(piece.box), piece.box)

    def _flat_at(self, entry: TensorEntry, file: str, dataset: str, at: int, n: int,
                 box: Box) -> int | None:
        """The byte offset in ``file`` of the ``n`` elements from ``at`` on of its flat
        dataset ``dataset`` (a piece of ``entry``, ``box``), after checking the
        dataset's dtype and length (None: the dataset's storage is not one run of the
        file, e.g. a repacked file: read it through HDF5)."""
        key = (file, dataset)
        if key not in self._flat:
            f = self._file(file, entry.name)
            dset = f.get(dataset)
            if not isinstance(dset, h5py.Dataset) or dset.ndim != 1:
                raise CheckpointError(f"{self.index.file_path(file)}: has no flat "
                                      f"dataset {dataset}, needed for tensor "
                                      f"{entry.name}; {REMEDY}")
            self._flat[key] = (dset.id.get_offset(), dset.shape[0], dset.dtype)
        offset, length, dtype = self._flat[key]
        if dtype != entry.dtype or at + n > length:
            where = f"{self.index.file_path(file)}: tensor {entry.name}"
            if dtype != entry.dtype:
                raise CheckpointError(f"{where}: stored in {dataset} ({dtype}), the "
                                      f"index says {np.dtype(entry.dtype)}; {REMEDY}")
            raise CheckpointError(f"{where}: piece {box_name(box)} ends past the "
                                  f"{length} elements of {dataset}; {REMEDY}")
        return None if offset is None else offset + at * dtype.itemsize

    def _raw_offset(self, entry: TensorEntry, piece: Piece) -> int | None:
        """Where the piece's bytes start in its file, or None: read it through HDF5."""
        return piece.offset if piece.at is None else self._flat_offset(entry, piece)

    def _raw_offset_of(self, entry: TensorEntry, k: int, box: Box) -> tuple[str, int | None]:
        """Piece k of ``entry`` (``box``): its file, and where its bytes start there
        (None: read it through HDF5), without making the Piece of a version 4 table."""
        if entry.table is None:
            piece = entry.pieces[k]
            return piece.file, self._raw_offset(entry, piece)
        file, dataset, at = entry.where(k)
        if at is None:
            return file, None
        return file, self._flat_at(entry, file, dataset, at, box_volume(box), box)

    def _read_at(self, file: str, tensor: str, offset: int, outs: list[np.ndarray],
                 where: str) -> None:
        """Bytes from ``offset`` on, into the C-contiguous ``outs`` one after another."""
        fd = self._fd(file, tensor)
        self.bytes_read += sum(a.nbytes for a in outs)
        preadv_all(fd, outs, offset, where)

    def entry(self, name: str) -> TensorEntry:
        if name not in self.index.tensors:
            raise CheckpointError(f"{self.index.path}: has no tensor {name} "
                                  f"({len(self.index.tensors)} tensors)")
        return self.index.tensors[name]

    def read_piece(self, entry: TensorEntry, piece: Piece,
                   out: np.ndarray | None = None) -> np.ndarray:
        """One stored piece, whole, after checking its shape, dtype and checksum; read
        straight into ``out`` (C-contiguous, the piece's shape) if given."""
        path = self.index.file_path(piece.file)
        where = f"{path}: tensor {entry.name}, piece {box_name(piece.box)}"
        offset = self._raw_offset(entry, piece)
        if offset is not None:  # a raw read: HDF5 only checked the file's format
            data = np.empty(box_shape(piece.box), entry.dtype) if out is None else out
            try:
                self._read_at(piece.file, entry.name, offset, [data], where)
            except OSError as err:
                raise CheckpointError(f"{where}: cannot be read ({err}); {REMEDY}") from None
            return self._checked(piece, data, where)
        f = self._file(piece.file, entry.name)
        try:
            dset = f[piece.dataset]
            if piece.at is not None:  # version 3, its flat dataset not one run: HDF5
                n = box_volume(piece.box)
                data = dset[piece.at:piece.at + n].reshape(box_shape(piece.box))
                if out is not None:
                    out[...] = data
                    data = out
                self.bytes_read += data.nbytes
                return self._checked(piece, data, where)
            if dset.dtype != np.dtype(entry.dtype):
                raise CheckpointError(f"{where}: dtype {dset.dtype}, the index says "
                                      f"{np.dtype(entry.dtype)}")
            whole = dset.shape == box_shape(piece.box)
            if not whole and dset.shape != entry.global_shape:  # shared or consolidated
                raise CheckpointError(f"{where}: dataset {piece.dataset} has shape "
                                      f"{dset.shape}, the index says {box_shape(piece.box)}")
            if out is not None:  # the box, or its hyperslab of a shared file's dataset
                dset.read_direct(out, None if whole else slices(piece.box))
                data = out
            else:
                data = dset[...] if whole else dset[slices(piece.box)]
        except (KeyError, OSError, ValueError, TypeError) as err:
            raise CheckpointError(f"{where}: cannot be read ({err}); {REMEDY}") from None
        self.bytes_read += data.nbytes
        return self._checked(piece, data, where)

    def _checked(self, piece: Piece, data: np.ndarray, where) -> np.ndarray:
        """``data``, if its checksum is the piece's; ``where``: the text naming it in
        the error, or a function giving it."""
        return self._check(piece.checksum, data, where)

    def _check(self, stored: str, data: np.ndarray, where) -> np.ndarray:
        algorithm = self.index.checksum
        digest = checksum_of(algorithm, data)
        if digest != stored:
            where = where() if callable(where) else where
            raise CheckpointError(f"{where}: checksum mismatch ({algorithm}: stored "
                                  f"{stored[:12]}..., read {digest[:12]}...): the "
                                  f"file is corrupt; {REMEDY}")
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

    def read_held(self, held: list[Held], hint: str = "", share: tuple[int, int] = (0, 1),
                  read_all: bool = True, threads: int | None = None,
                  ) -> list[tuple[list[np.ndarray], int]]:
        """Fill every held array with its part of its tensor (see the module docstring):
        the pieces that land whole in a contiguous region are read in runs, one
        ``preadv`` per run of pieces that follow one another in a file, each checked
        as soon as it is read, by ``threads`` threads (None: ``read_threads(n)``);
        the others by ``read_into``.

        ``share = (k, n)``: this rank is the k-th of n ranks that hold the same arrays
        (data-parallel replicas) and so the same runs, in the same order; it checks
        only its share of the runs (about 1/n of the bytes, the same split on each),
        and the caller makes every rank fail if any of them found a bad piece
        (``writer.all_ranks``). With ``read_all`` (the replicas of one node, reading
        from one page cache) each run is still read by every rank: at dp = 2 this
        halves the checksum work of a load. Without it (``checkpoint_read =
        "shared"``) a rank reads only its share too (of the runs, and of the arrays
        read piece by piece, whole), and returns each as (its arrays, the share that
        read it), in the same order on each rank, for the caller to broadcast from
        their readers (``training.exchange_runs``); with it, an empty list."""
        if not 0 <= share[0] < share[1]:
            raise ValueError(f"share {share}: k must be in [0, n)")
        direct = []  # (file, offset, entry, piece, target)
        indirect = []  # arrays read piece by piece (read_into): shared whole
        for h in held:
            entry = self.check_fits(h.name, h.sharding, h.array.dtype, hint)
            reads = self._direct_reads(entry, h)
            if reads is None:
                indirect.append(h)
            else:
                direct += reads
        shares = []  # (arrays, the share that reads them), when not read_all
        for h, owner in zip(indirect, share_owners([h.array.nbytes for h in indirect],
                                                   share[1]), strict=True):
            if read_all or owner == share[0]:
                self.read_into(h.name, h.array, h.sharding, hint)
            if not read_all:
                shares.append(([h.array], owner))
        direct.sort(key=lambda r: (r[0], r[1]))
        runs: list[list] = []
        run_bytes = 0
        for r in direct:
            last = runs[-1][-1] if runs else None
            if (last is not None and last[0] == r[0] and last[1] + last[4].nbytes == r[1]
                    and run_bytes + r[4].nbytes <= RUN_BYTES):
                runs[-1].append(r)
                run_bytes += r[4].nbytes
            else:
                runs.append([r])
                run_bytes = r[4].nbytes
        owners = share_owners([sum(r[4].nbytes for r in run) for run in runs], share[1])
        if not read_all:
            shares += [([r[4] for r in run], owner)
                       for run, owner in zip(runs, owners, strict=True)]
        tasks = [(run, owner == share[0]) for run, owner in zip(runs, owners, strict=True)
                 if read_all or owner == share[0]]
        for run, _ in tasks:  # the files opened here: HDF5 checks them, once
            self._fd(run[0][0], run[0][2].name)
            self.bytes_read += sum(r[4].nbytes for r in run)
        self._read_runs(tasks, read_threads(share[1]) if threads is None else threads)
        return shares

    def _read_runs(self, tasks: list[tuple[list, bool]], threads: int) -> None:
        """Each ``(run, check)``: the run read by one ``preadv``, then, if ``check``,
        its checksums taken at once, while its bytes are still in the caches; by
        ``threads`` threads, each taking the next run in file order. The error of the
        first bad run in file order is raised here: after a failure the threads take no
        new run, and every run before it was taken first and finishes."""
        todo: queue.SimpleQueue = queue.SimpleQueue()
        for k, task in enumerate(tasks):
            todo.put((k, task))
        failed: dict[int, CheckpointError] = {}

        def work() -> None:
            while not failed:
                try:
                    k, (run, check) = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    self._read_run(run)
                    if check:
                        self._check_run(run)
                except CheckpointError as err:
                    failed[k] = err

        threads = max(1, min(threads, len(tasks)))
        if threads == 1:
            work()
        else:
            with ThreadPoolExecutor(threads - 1) as pool:
                helpers = [pool.submit(work) for _ in range(threads - 1)]
                work()
                for h in helpers:
                    h.result()  # anything but a CheckpointError: raised as it is
        if failed:
            raise failed[min(failed)]

    def _direct_reads(self, entry: TensorEntry, h: Held) -> list | None:
        """``(file, offset, entry, k, target)`` per segment of ``h``, if each is
        exactly one stored piece (the k-th of ``entry``) read raw into a contiguous
        region; else None. Pieces are matched to segments by their start (NumPy over
        the piece table: a job of many ranks cuts a tensor into as many pieces)."""
        array = h.array
        if array.shape != h.sharding.shape:
            return None  # read_into names the problem
        segs = _segments(h.sharding)
        if len(entry) == 1:
            rows = [0] if len(segs) == 1 else None
        else:
            start, _ = entry.bounds()
            rows = []
            for seg in segs:
                found = np.flatnonzero((start == [a for a, _ in seg.box]).all(axis=1))
                rows.append(int(found[0]) if len(found) else None)
        if rows is None or None in rows:
            return None
        reads = []
        for seg, k in zip(segs, rows, strict=True):
            if entry.box(k) != seg.box:
                return None
            whole = (len(segs) == 1 and seg.offset == 0 and seg.outer == array.shape
                     and seg.inner == full_box(array.shape))
            target = array if whole else region(array, seg)
            file, offset = self._raw_offset_of(entry, k, seg.box)
            if offset is None or not target.flags.c_contiguous:
                return None
            reads.append((file, offset, entry, k, target))
        return reads

    def _read_run(self, run: list) -> None:
        """A run's pieces, one after another in their file, into their targets (its
        file already open: ``read_held``)."""
        file, offset, entry, k, _ = run[0]
        try:
            preadv_all(self._fds[file], [r[4] for r in run], offset,
                       lambda: self._where(file, entry, k))
        except OSError as err:
            raise CheckpointError(f"{self._where(file, entry, k)}: cannot be read ({err}); "
                                  f"{REMEDY}") from None

    def _where(self, file: str, entry: TensorEntry, k: int) -> str:
        return f"{self.index.file_path(file)}: tensor {entry.name}, piece {box_name(entry.box(k))}"

    def _check_run(self, run: list) -> None:
        for file, _, entry, k, target in run:
            self._check(entry.checksum(k), target,
                        lambda f=file, e=entry, k=k: self._where(f, e, k))

    def read_full(self, name: str) -> np.ndarray:
        """The whole global tensor ``name``."""
        entry = self.entry(name)
        out = np.empty(entry.global_shape, np.dtype(entry.dtype))
        self.read_into(name, out, Sharding(entry.global_shape))
        return out


def preadv_all(fd: int, outs: list[np.ndarray], offset: int, where) -> None:
    """Bytes of ``fd`` from ``offset`` on, into the C-contiguous ``outs`` one after
    another, however the kernel splits the reads; a file that ends first is truncated
    (``where`` names the piece in the error: a text, or a function giving it)."""
    views = byte_views(outs)
    while views:
        n = os.preadv(fd, views[:IOV_MAX], offset)
        if n <= 0:
            where = where() if callable(where) else where
            raise CheckpointError(f"{where}: the file ends inside the piece (it is "
                                  f"truncated); {REMEDY}")
        offset += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if n:
            views[0] = views[0][n:]


def read_threads(ranks_on_node: int) -> int:
    """The threads ``read_held`` reads and checks on: the cores this rank may use,
    shared among ``ranks_on_node`` ranks (``slurm.placement.blas_threads_per_rank``, as
    for its BLAS: SLURM's cores per task, a launcher's binding, or an even share of the
    node), at most ``MAX_READ_THREADS``. A training load passes its node's ranks
    (``training.read_plan``); ``read_held`` alone, its share's n."""
    return min(MAX_READ_THREADS, blas_threads_per_rank(ranks_on_node))


def share_owners(sizes: list[int], n: int) -> list[int]:
    """Which of n ranks holding the same runs (or arrays), of ``sizes`` bytes, checks
    (and, reading shared, reads) each: the one with the fewest bytes so far (ties to the
    lowest), so the n shares cover every run once and weigh about the same."""
    load = [0] * n
    owners = []
    for size in sizes:
        who = min(range(n), key=lambda r: (load[r], r))
        load[who] += size
        owners.append(who)
    return owners
