"""Checkpoints written from a background thread while training goes on.

``BackgroundWriter(ckpt_comm, overlap=...)`` saves in two halves. On the training
thread, ``save`` waits for the previous write (at most one is in flight), plans the
save (``writer.plan``, collective over the world communicator, kept from one save to
the next) and starts a thread. The thread copies into memory the arrays this rank
writes (the *snapshot*; with numba each copy's checksum and finite check are taken in
the same pass, ``copysum.py``), then runs ``writer.write_planned`` on the copies: the
rank files, the checks not yet taken, their fsync and rank 0's commit (index,
rename, ``latest``), its collectives over ``ckpt_comm``, a communicator of its own,
so they never meet the training's collectives (MPI must provide
``MPI_THREAD_MULTIPLE``, mpi4py's default request)::

    training thread                                 writer thread (ckpt_comm)
    save(N):  wait for write N-1, raise its error
              plan                 (world, small)
              start ------------------------------> copy this rank's arrays
    step N+1: forward, backward (read the state)     ...
              captured(): wait for the copy <------- (the snapshot is taken)
              clip, optimizer update                 prepare, write, check, fsync,
    step N+2, ...                                    commit: `latest` -> step N
    save(M) or wait(): join ------------------------<
              raise its error (every rank alike)

With ``overlap`` the snapshot is taken while the next step's forward and backward
run, which only read the parameters and the optimizer state: the caller must call
``captured()`` before anything changes them (``train.train_step``'s
``before_update``). Without it (the default, for callers that change the state
right away) ``save`` returns once the snapshot is taken.

The commit is the synchronous save's, so a job killed during a background write
leaves ``latest`` naming the previous complete checkpoint. An error in the thread is
a ``CheckpointError`` on every rank (``writer.write_planned`` over ``ckpt_comm``), a
non-finite snapshot a ``NonFiniteState`` on every rank (nothing committed, the
unfinished folder removed), raised by the next ``save`` or ``wait``. The run waits
for the write in flight at its end and before it stops on preemption
(``hpctrain.train``).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np

from hpctrain.checkpoint import copysum, direct, rankfile, writer
from hpctrain.checkpoint.format import step_dirname
from hpctrain.checkpoint.state import Held
from hpctrain.checkpoint.writer import POLL_S as POLL_S  # re-exported
from hpctrain.checkpoint.writer import arrive

# seconds: how long a thread waiting for the GIL waits before the holder must yield
# it, while a write is in flight (Python's default is 0.005). The writer's Python and
# h5py calls hold the GIL; the training thread needs it between its NumPy calls.
# Measured (bench_checkpoint.py, dp = 1, 4 alternating runs of 21 pairs): stall 11-13
# ms against 13-18 ms with the default; at dp = 2 no difference beyond the noise.
SWITCH_S = 0.0005


class BackgroundWriter:
    """At most one checkpoint write in flight, from a thread, over ``comm`` (a
    communicator used by nothing else: ``Topology.ckpt_comm``); ``overlap``: ``save``
    returns before the snapshot is taken (then call ``captured()`` before the state
    changes)."""

    def __init__(self, comm, *, overlap: bool = False):
        if comm.Get_size() > 1:
            from mpi4py import MPI

            if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
                raise RuntimeError("asynchronous checkpoints need MPI_THREAD_MULTIPLE (MPI "
                                   f"provides level {MPI.Query_thread()}); save synchronously "
                                   "(without --async-save)")
        self.comm = comm
        self.overlap = overlap
        copysum.load()  # numba's machine code now, not in the first snapshot
        self._thread: threading.Thread | None = None
        self._snapshot_taken: threading.Event | None = None
        self._outcome: tuple[Path | None, BaseException | None] = (None, None)
        self._copies: dict[str, np.ndarray] = {}  # per dtype, reused by the next save
        self.stall_s = 0.0  # the training thread's time in the last save
        self.capture_wait_s = 0.0  # the training thread's waits in captured() since
        self.copy_s = 0.0  # the thread's time for the last snapshot
        self.write_s = 0.0  # the thread's time for the last write, snapshot included
        self._switch = sys.getswitchinterval()

    @property
    def in_flight(self) -> bool:
        """A write was started and not yet waited for (it may have finished)."""
        return self._thread is not None

    @property
    def writing(self) -> bool:
        """The write started last is still running."""
        return self._thread is not None and self._thread.is_alive()

    def save(self, root: str | Path, step: int, held: list[Held], meta: dict, world_comm, *,
             stage: int = 0, keep: int = 3, on_event=None, say=print,
             finite: bool = False, io: str = "auto") -> Path:
        """Start writing the checkpoint of ``step`` (``writer.save``'s arguments) and
        return the folder it will have. Waits for the previous write first and raises
        its error. Collective over ``world_comm`` (the plan); the thread's collectives
        are over ``self.comm``."""
        if keep < 1:
            raise ValueError(f"keep ({keep}) must be at least 1")
        t0 = time.perf_counter()
        self.wait()
        planned = writer.plan(held, world_comm, stage)
        self._snapshot_taken = threading.Event()
        self.capture_wait_s = 0.0
        args = (Path(root), step, held, planned, meta, keep, on_event, say, finite,
                self._snapshot_taken, io)
        self._thread = threading.Thread(target=self._write, args=args, daemon=True,
                                        name=f"hpctrain-checkpoint-{step}")
        self._switch = sys.getswitchinterval()  # restored when the write ends
        sys.setswitchinterval(min(self._switch, SWITCH_S))
        self._thread.start()
        if not self.overlap:
            self.captured()
        self.stall_s = time.perf_counter() - t0
        return Path(root) / step_dirname(step)

    def captured(self) -> None:
        """Return once the save in flight holds its own copy of the state (at once if
        none is in flight): call it before changing what was saved."""
        taken = self._snapshot_taken
        if taken is not None and not taken.is_set():
            t0 = time.perf_counter()
            taken.wait()
            self.capture_wait_s += time.perf_counter() - t0

    def _snapshot(self, held: list[Held], planned: writer.Plan, taken: threading.Event,
                  finite: bool) -> tuple[list[Held], dict]:
        """Copies of the arrays holding a piece this rank writes, and the checks of each
        copy (``rankfile.known_key`` -> its blocksum64 and finite verdict: ``copysum``
        takes them in the copy's pass); ``taken`` is set when done, whatever happens.
        The copies of each dtype lie one after another in one page-aligned buffer, in
        the order the rank file stores them, so that, where each piece is a whole
        array, the write goes from there to the disk with ``O_DIRECT`` (``direct.py``)
        and no other copy. The buffers are kept for the next save (no page faults
        after the first)."""
        t0 = time.perf_counter()
        known: dict = {}
        fused = copysum.fused()  # else rankfile.checks sums the buffer in a few NumPy calls
        try:
            by_name = {h.name: h for h in held}
            order = list(dict.fromkeys(name for name, _ in planned.todo))
            layout: dict[str, list[Held]] = {}
            for name in order:
                layout.setdefault(by_name[name].array.dtype.str, []).append(by_name[name])
            out = []
            for dtype, group in layout.items():
                nbytes = sum(h.array.nbytes for h in group)
                buf = self._copies.get(dtype)
                if buf is None or buf.nbytes < nbytes:
                    buf = self._copies[dtype] = direct.aligned_empty(nbytes)
                at = 0
                for h in group:
                    copy = buf[at:at + h.array.nbytes].view(h.array.dtype).reshape(
                        h.array.shape)
                    if fused and h.array.flags.c_contiguous:  # copied, summed, tested
                        known[rankfile.known_key(copy)] = copysum.copy_checked(
                            h.array, copy, finite)
                    else:
                        np.copyto(copy, h.array)
                    out.append(Held(h.name, copy, h.sharding))
                    at += h.array.nbytes
            return out, known
        finally:
            self.copy_s = time.perf_counter() - t0
            taken.set()

    def _write(self, root: Path, step: int, held: list[Held], planned: writer.Plan,
               meta: dict, keep: int, on_event, say, finite: bool,
               taken: threading.Event, io: str) -> None:
        t0 = time.perf_counter()
        try:
            final = writer.write_planned(root, step, held, planned, meta, self.comm,
                                         keep=keep, on_event=on_event, say=say,
                                         catch=(Exception,), finite=finite,
                                         capture=lambda: self._snapshot(held, planned,
                                                                        taken, finite),
                                         arrive=lambda: arrive(self.comm), io=io)
            self._outcome = (final, None)
        except BaseException as err:  # a CheckpointError on every rank, raised by wait()
            self._outcome = (None, err)
        finally:
            taken.set()  # never leave the training thread waiting
            sys.setswitchinterval(self._switch)
        self.write_s = time.perf_counter() - t0

    def wait(self) -> Path | None:
        """Wait for the write in flight; return its folder (None: there was none), or
        raise its error (every rank alike). Not collective: each rank joins its thread,
        whose last step was collective."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        (final, error), self._outcome = self._outcome, (None, None)
        if error is not None:
            raise error
        return final
