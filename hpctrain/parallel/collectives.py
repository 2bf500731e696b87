"""Collectives on NumPy arrays along one axis, and a communicator that tallies them.

Three buffer collectives, each taking its communicator explicitly and returning its
input untouched when the communicator has one rank (serial is the degenerate case):

    all_reduce(x, comm)             sum (or max) over the ranks, in place in x
    all_gather(x, comm, axis)       (..., n, ...) per rank  -> (..., p n, ...), rank order
    reduce_scatter(x, comm, axis)   (..., p n, ...) per rank -> (..., n, ...): the sum over
                                    ranks of this rank's block ``r n : (r + 1) n``

``CountingComm`` wraps a communicator and counts what these move, as the bytes each
rank *sends* under the bandwidth-optimal ring algorithms, with ``p`` ranks and ``n``
the bytes of the whole (reduced or gathered) tensor:

    all-reduce       2 (p - 1) / p * n        (a reduce-scatter, then an all-gather)
    all-gather         (p - 1) / p * n
    reduce-scatter     (p - 1) / p * n

so an all-reduce costs exactly one all-gather plus one reduce-scatter, which is why
sequence parallelism moves the same volume as plain tensor parallelism.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpctrain import trace

_OPS = ("sum", "max")


def all_reduce(x: np.ndarray, comm: Any, op: str = "sum") -> np.ndarray:
    """Sum (or max) of ``x`` over ``comm``; returns it. Collective.

    Written into ``x`` when it is C-contiguous (it always is for a fresh product),
    else into a contiguous copy; use the returned array.
    """
    if op not in _OPS:
        raise ValueError(f"op ({op!r}) must be one of {', '.join(_OPS)}")
    if comm.Get_size() == 1:
        return x
    from mpi4py import MPI

    x = np.ascontiguousarray(x)
    comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM if op == "sum" else MPI.MAX)
    return x


def all_gather(x: np.ndarray, comm: Any, axis: int) -> np.ndarray:
    """Concatenation along ``axis`` of every rank's ``x``, in rank order. Collective.

    Every rank's ``x`` must have the same shape.
    """
    p = comm.Get_size()
    if p == 1:
        return x
    send = np.ascontiguousarray(x)
    recv = np.empty((p, *x.shape), dtype=x.dtype)  # (p, ...): MPI stacks along a new axis 0
    comm.Allgather(send, recv)
    return np.concatenate(recv, axis=axis % x.ndim)


def reduce_scatter(x: np.ndarray, comm: Any, axis: int) -> np.ndarray:
    """This rank's block along ``axis`` of the sum over ranks of ``x``. Collective.

    ``x.shape[axis]`` must be divisible by the number of ranks ``p``; rank ``r`` gets
    block ``r`` of ``p`` equal blocks (the inverse layout of ``all_gather``).
    """
    p = comm.Get_size()
    if p == 1:
        return x
    n = x.shape[axis]
    if n % p:
        raise ValueError(f"reduce-scatter along axis {axis}: its size ({n}) must be "
                         f"divisible by the number of ranks ({p})")
    from mpi4py import MPI

    send = np.ascontiguousarray(np.stack(np.split(x, p, axis=axis)))  # (p, ...block)
    recv = np.empty(send.shape[1:], dtype=x.dtype)
    comm.Reduce_scatter_block(send, recv, op=MPI.SUM)
    return recv


class CountingComm:
    """A communicator that counts the bytes its buffer collectives send per rank.

    Forwards the calls the functions above make (``Allreduce``, ``Allgather``,
    ``Reduce_scatter_block``) plus ``Get_size``, ``Get_rank`` and the pickle
    ``allgather``/``allreduce`` (not counted: small metadata). ``bytes_sent`` follows
    the ring model of the module docstring; ``calls`` counts buffer collectives.
    ``reset()`` starts a new tally (the engine does so at every step). Each buffer
    collective is a trace span of category ``cat``.
    """

    def __init__(self, comm: Any, cat: str = "tp_comm"):
        self.comm = comm
        self.cat = cat
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.bytes_sent = 0.0
        self.calls = 0

    def reset(self) -> None:
        self.bytes_sent = 0.0
        self.calls = 0

    def _count(self, nbytes: float) -> None:
        self.bytes_sent += nbytes
        self.calls += 1

    def Get_size(self) -> int:
        return self.size

    def Get_rank(self) -> int:
        return self.rank

    def Allreduce(self, sendbuf, recvbuf, op) -> None:
        p = self.size
        self._count(2.0 * (p - 1) / p * np.asarray(recvbuf).nbytes)
        with trace.span("all_reduce", self.cat, bytes=np.asarray(recvbuf).nbytes):
            self.comm.Allreduce(sendbuf, recvbuf, op=op)

    def Allgather(self, sendbuf, recvbuf) -> None:
        self._count((self.size - 1) * np.asarray(sendbuf).nbytes)
        with trace.span("all_gather", self.cat, bytes=np.asarray(recvbuf).nbytes):
            self.comm.Allgather(sendbuf, recvbuf)

    def Reduce_scatter_block(self, sendbuf, recvbuf, op) -> None:
        self._count((self.size - 1) * np.asarray(recvbuf).nbytes)
        with trace.span("reduce_scatter", self.cat, bytes=np.asarray(sendbuf).nbytes):
            self.comm.Reduce_scatter_block(sendbuf, recvbuf, op=op)

    def allgather(self, obj):
        return self.comm.allgather(obj)

    def allreduce(self, obj, op=None):
        return self.comm.allreduce(obj) if op is None else self.comm.allreduce(obj, op=op)
