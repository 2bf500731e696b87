"""Point-to-point transfers between pipeline stages, named by direction.

Over ``pp_comm``, between the ranks holding neighbouring model chunks ``k`` and
``k + 1`` (rank ``k % pp``; see ``stages``)::

    chunk k  --send_forward(y)-->   recv_forward    chunk k+1    activation (mb, T, C)
    chunk k  <--send_backward(dx)-- recv_backward   chunk k+1    its gradient (mb, T, C)

so ``send_forward`` pairs with ``recv_forward`` on the next stage and ``send_backward``
with ``recv_backward`` on the previous one. At the ends of the model the verbs do
nothing: the first chunk receives no activation and sends no gradient, the last chunk
sends no activation and receives no gradient (its gradient is the loss's).

Sends are ``Isend`` and are not waited for until ``wait_sends`` at the end of the
schedule; receives are ``Irecv`` followed by ``Wait``. So a rank only ever blocks in a
receive, and the schedules cannot deadlock as long as every receive waits for an
operation that does not itself wait on the receiver (``timeline.check`` proves this
for every schedule). Each message has its own tag, built from (microbatch, receiving
chunk, direction), so a receive can only match the message meant for it.

Shapes are known in advance, ``(mb, T, C)`` in the model dtype, so no shape travels
with the data. Receive buffers come from a pool and go back to it when the schedule
is done with them (``release``); after the first step no receive allocates.
The time spent waiting is the rank's idle time: the pipeline bubble.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from hpctrain import trace

FORWARD, BACKWARD = 0, 1


class P2P:
    """Direction-named transfers for one rank of ``pp_comm`` holding model chunks
    ``k = c * pp + pp_rank``; ``n_chunks`` model chunks, ``microbatches`` per step."""

    def __init__(self, pp_comm: Any, n_chunks: int, microbatches: int, dtype):
        from mpi4py import MPI

        self.comm = pp_comm
        self.pp_size = pp_comm.Get_size()
        self.pp_rank = pp_comm.Get_rank()
        self.n_chunks = n_chunks
        self.microbatches = microbatches
        self.dtype = np.dtype(dtype)
        # MPI caches MPI_TAG_UB on MPI_COMM_WORLD; Open MPI gives None on split groups
        tag_ub = pp_comm.Get_attr(MPI.TAG_UB) or MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        if 2 * n_chunks * microbatches > tag_ub:
            raise ValueError(f"2 * chunks * microbatches (2 * {n_chunks} * {microbatches}) "
                             f"exceeds the MPI tag bound ({tag_ub})")
        self._pool: dict[tuple[int, ...], list[np.ndarray]] = {}
        self._sends: list[tuple[Any, np.ndarray]] = []
        self.idle_s = 0.0  # seconds spent waiting in receives and at wait_sends
        self.bytes_sent = 0

    # ---- the four verbs -----------------------------------------------------------

    def send_forward(self, y: np.ndarray, k: int, mb: int) -> None:
        """Chunk ``k``'s output activation to chunk ``k + 1`` (nothing on the last chunk)."""
        if k == self.n_chunks - 1:
            return
        peer = self._rank_of(k + 1)
        with trace.span("send_forward", "pp_wait", mb=mb, chunk=k, peer=peer):
            self._send(y, peer, self._tag(mb, k + 1, FORWARD))

    def recv_forward(self, shape: tuple[int, ...], k: int, mb: int) -> np.ndarray | None:
        """Chunk ``k``'s input activation from chunk ``k - 1`` (None on the first chunk)."""
        if k == 0:
            return None
        peer = self._rank_of(k - 1)
        with trace.span("recv_forward", "pp_wait", mb=mb, chunk=k, peer=peer):
            return self._recv(shape, peer, self._tag(mb, k, FORWARD))

    def send_backward(self, dx: np.ndarray, k: int, mb: int) -> None:
        """The gradient of chunk ``k``'s input to chunk ``k - 1`` (nothing on the first)."""
        if k == 0:
            return
        peer = self._rank_of(k - 1)
        with trace.span("send_backward", "pp_wait", mb=mb, chunk=k, peer=peer):
            self._send(dx, peer, self._tag(mb, k - 1, BACKWARD))

    def recv_backward(self, shape: tuple[int, ...], k: int, mb: int) -> np.ndarray | None:
        """The gradient of chunk ``k``'s output from chunk ``k + 1`` (None on the last)."""
        if k == self.n_chunks - 1:
            return None
        peer = self._rank_of(k + 1)
        with trace.span("recv_backward", "pp_wait", mb=mb, chunk=k, peer=peer):
            return self._recv(shape, peer, self._tag(mb, k, BACKWARD))

    # ---- buffers and requests -----------------------------------------------------

    def release(self, buf: np.ndarray | None) -> None:
        """Hand a received buffer back to the pool once nothing reads it any more."""
        if buf is not None:
            self._pool.setdefault(buf.shape, []).append(buf)

    def wait_sends(self) -> None:
        """Complete every outstanding send (counted as idle time)."""
        from mpi4py import MPI

        t0 = time.perf_counter()
        with trace.span("wait_sends", "pp_wait"):
            MPI.Request.Waitall([req for req, _ in self._sends])
        self.idle_s += time.perf_counter() - t0
        self._sends.clear()

    def _send(self, buf: np.ndarray, dest: int, tag: int) -> None:
        buf = np.ascontiguousarray(buf, dtype=self.dtype)
        # keep the array alive until the send completes; drop the completed ones
        self._sends = [(req, b) for req, b in self._sends if not req.Test()]
        self._sends.append((self.comm.Isend(buf, dest=dest, tag=tag), buf))
        self.bytes_sent += buf.nbytes

    def _recv(self, shape: tuple[int, ...], source: int, tag: int) -> np.ndarray:
        free = self._pool.get(tuple(shape))
        buf = free.pop() if free else np.empty(shape, self.dtype)
        req = self.comm.Irecv(buf, source=source, tag=tag)
        t0 = time.perf_counter()
        req.Wait()
        self.idle_s += time.perf_counter() - t0
        return buf

    def _rank_of(self, k: int) -> int:
        return k % self.pp_size

    def _tag(self, mb: int, k: int, direction: int) -> int:
        # unique per message of a step: the receiving chunk, the microbatch, the direction
        return (mb * self.n_chunks + k) * 2 + direction
