"""Hierarchical gradient reduction: reduce in the node, combine among nodes, spread back.

The flat reduction is one collective per bucket over the data group. The hierarchical
one sums each bucket in three non-blocking phases, so that only one rank per node (the
node's first data-parallel rank, its leader) sends over the network. 4 nodes x 2
ranks, dp = 8, one bucket ``g`` (``g_r``: rank r's gradient, ``S`` the sum)::

    node          n0          n1          n2          n3
    ranks        0    1      2    3      4    5      6    7
    1 reduce     g0+g1 <-    g2+g3 <-    g4+g5 <-    g6+g7 <-      dp_node_comm
    2 all-red.   [ s01  <----> s23  <----> s45  <----> s67 ]       dp_leader_comm
    3 bcast      S -> S      S -> S      S -> S      S -> S        dp_node_bcast_comm

ZeRO 1 and 2 (``HierarchicalReduceScatter``) want only shard ``d`` of the sum on dp
rank ``d``. Phase 2 is then a reduce-scatter among the leaders, node ``j`` receiving
the shards of its members (``counts``: members x shard), and phase 3 a scatter of
those shards inside the node::

    2 red.-sc.   [ S0 S1 | S2 S3 | S4 S5 | S6 S7 ]  node j gets   dp_leader_comm
                                                    its shards
    3 scatter    S0 -> S1    S2 -> S3    S4 -> S5    S6 -> S7       dp_node_bcast_comm

When a node's dp ranks are not consecutive (ranks dealt out cyclically), each leader
first reorders the shards of its node sum node by node (``Topology.dp_nodes``: the
leaders' order), one copy of the bucket, so any placement works.

Each node link carries one all-reduce among ``nodes`` ranks, whatever the placement of
the ranks and whatever algorithm the MPI library picks for the flat one. Measured on
4 emulated nodes of 2 ranks at 100 Mbit/s (``benchmarks/README.md``): with ranks placed
node by node, MPICH's flat all-reduce already pairs the ranks of a node first and sends
as few bytes over each link (about 1.55 times the buffer, both ways alike: 1.01-1.10x);
with ranks dealt out cyclically, the flat one sends twice as much and the
hierarchical one is 2.1-2.2x faster.

Ordering (``PhaseQueue``, pure, tested without MPI). MPI requires the collectives on
one communicator to be posted in the same order on every rank, but a bucket's phases
finish at different times on different ranks. So phases 1 and 3 each have their own
communicator (the topology's node part of the data group and its duplicate), and
bucket k may post a phase only after bucket k - 1 has posted it. A rank posts a
phase only when its previous phase is complete, so a pending send buffer is never a
pending receive buffer. Phases that would run on one rank are skipped: one rank per
node (phase 2 alone), one node (phases 1 and 3 only), dp = 1 (nothing: None).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

REDUCE, ALLREDUCE, BCAST = "reduce", "allreduce", "bcast"
REDUCE_SCATTER, SCATTER = "reduce_scatter", "scatter"


class Pending:
    """One bucket's phases, posted by its ``PhaseQueue``; ``Test``/``Wait`` like an MPI
    request (what ``GradBuckets`` drives)."""

    def __init__(self, queue: PhaseQueue, phases: tuple[str, ...],
                 post: Callable[[str], Any]):
        self.queue, self.phases, self.post = queue, phases, post
        self.posted = 0  # phases posted so far (the last one may be in flight)
        self.request = None  # the posted phase's request, until seen complete

    @property
    def done(self) -> bool:
        return self.posted == len(self.phases) and self.request is None

    def Test(self) -> bool:  # noqa: N802 - the name MPI requests have
        """Move every bucket of the queue on; whether this one is complete."""
        self.queue.progress()
        return self.done

    def Wait(self) -> None:  # noqa: N802
        """Until this bucket is complete, move the queue on and block on the oldest
        bucket's posted phase: nothing earlier is left for this rank to post, so it
        completes once the other ranks post their part."""
        while True:
            self.queue.progress()
            if self.done:
                return
            self.queue.in_flight[0].request.Wait()


class PhaseQueue:
    """The buckets in flight on one rank, each a sequence of phases; no MPI in here.

    ``add(phases, post)`` enters a bucket: ``post(phase)`` starts one of its phases and
    returns a request (``Test() -> bool``, ``Wait()``). A phase names the communicator
    it runs on. ``progress`` tests the requests and posts, walking the buckets oldest
    first, each phase
      - only when it is the bucket's next one and the previous one is complete,
      - only when every earlier bucket in flight has posted it,
    so every communicator sees its collectives in bucket order on every rank, however
    the phases complete and in whatever order the buckets are tested or waited for.
    """

    def __init__(self):
        self.in_flight: deque[Pending] = deque()

    def add(self, phases: tuple[str, ...], post: Callable[[str], Any]) -> Pending:
        bucket = Pending(self, phases, post)
        self.in_flight.append(bucket)
        self.progress()
        return bucket

    def progress(self) -> None:
        blocked: set[str] = set()  # phases an earlier bucket has not posted yet
        for b in self.in_flight:
            while True:
                if b.request is not None:
                    if not b.request.Test():
                        break
                    b.request = None
                if b.posted == len(b.phases) or b.phases[b.posted] in blocked:
                    break
                b.request = b.post(b.phases[b.posted])
                b.posted += 1
            blocked.update(b.phases[b.posted:])
        while self.in_flight and self.in_flight[0].done:
            self.in_flight.popleft()


def _phases(node_comm: Any, leader_comm: Any, middle: str, last: str):
    """This rank's phases, and its leaders' communicator (None: not a leader, or one
    node): phase 1 and ``last`` inside a node of several ranks, ``middle`` on leaders
    of several nodes."""
    local = node_comm.Get_size() > 1
    leader = node_comm.Get_rank() == 0
    leaders = leader_comm if leader and leader_comm.Get_size() > 1 else None
    phases = tuple(p for p, on in ((REDUCE, local), (middle, leaders is not None),
                                   (last, local)) if on)
    return phases, leader, leaders


class HierarchicalReduce:
    """``launch`` for ``GradBuckets`` (ZeRO 0): the in-place sum of a bucket over the data
    group, in phases over ``dp_node_comm`` (reduce), ``dp_leader_comm`` (all-reduce) and
    ``dp_node_bcast_comm`` (broadcast). No collective at construction."""

    def __init__(self, dp_node_comm: Any, dp_node_bcast_comm: Any, dp_leader_comm: Any):
        from mpi4py import MPI

        self.MPI = MPI
        self.reduce_comm, self.bcast_comm = dp_node_comm, dp_node_bcast_comm
        self.phases, self.leader, self.leader_comm = _phases(dp_node_comm, dp_leader_comm,
                                                             ALLREDUCE, BCAST)
        self.queue = PhaseQueue()

    def __call__(self, bucket: Any, view: np.ndarray) -> Pending | None:
        """Start summing ``view`` (a bucket of the flat gradient) in place."""
        if not self.phases:
            return None  # one rank in the data group
        return self.queue.add(self.phases, lambda phase: self._post(phase, view))

    def _post(self, phase: str, view: np.ndarray) -> Any:
        MPI = self.MPI
        if phase == REDUCE:
            return _reduce_to_leader(self.reduce_comm, self.leader, view)
        if phase == ALLREDUCE:
            return self.leader_comm.Iallreduce(MPI.IN_PLACE, view, op=MPI.SUM)
        return self.bcast_comm.Ibcast(view, root=0)


class HierarchicalReduceScatter:
    """ZeRO 1 and 2: dp rank ``d`` gets shard ``d`` of a bucket's sum over the data group
    (a bucket is ``dp`` equal shards), in phases over ``dp_node_comm`` (reduce),
    ``dp_leader_comm`` (reduce-scatter, node j receiving its members' shards) and
    ``dp_node_bcast_comm`` (scatter). ``dp_nodes``: the dp ranks by node, in the leaders'
    order (``Topology.dp_nodes``). No collective at construction."""

    def __init__(self, dp_node_comm: Any, dp_node_bcast_comm: Any, dp_leader_comm: Any,
                 dp_nodes: tuple[tuple[int, ...], ...]):
        from mpi4py import MPI

        self.MPI = MPI
        self.reduce_comm, self.scatter_comm = dp_node_comm, dp_node_bcast_comm
        self.phases, self.leader, self.leader_comm = _phases(
            dp_node_comm, dp_leader_comm, REDUCE_SCATTER, SCATTER)
        self.members = [len(node) for node in dp_nodes]  # per node, leaders' order
        self.dp = sum(self.members)
        order = [d for node in dp_nodes for d in node]  # dp ranks node by node
        self.order = None if order == list(range(self.dp)) else np.array(order)
        self.on_node = dp_node_comm.Get_size()
        self.queue = PhaseQueue()

    def __call__(self, view: np.ndarray, out: np.ndarray | None = None) -> Pending | None:
        """Start reducing ``view`` (``dp`` shards); this rank's shard of the sum lands in
        ``out`` (``view.size / dp`` elements), or with ``out`` None at the start of
        ``view``, as MPI's in-place reduce-scatter puts it. ``view`` is clobbered."""
        if view.size % self.dp:
            raise ValueError(f"the bucket's size ({view.size}) must be a multiple of "
                             f"dp ({self.dp}): one equal shard per rank")
        if not self.phases:
            if out is not None:
                out[...] = view
            return None  # one rank in the data group
        shard = view.size // self.dp
        return self.queue.add(self.phases, lambda phase: self._post(phase, view, out, shard))

    def _post(self, phase: str, view: np.ndarray, out: np.ndarray | None, shard: int) -> Any:
        MPI = self.MPI
        if phase == REDUCE:
            return _reduce_to_leader(self.reduce_comm, self.leader, view)
        if phase == REDUCE_SCATTER:
            if self.order is not None:  # the shards node by node, as the leaders split them
                view[...] = view.reshape(self.dp, shard)[self.order].reshape(-1)
            counts = [n * shard for n in self.members]
            if out is None or REDUCE in self.phases:  # node's shards to the start of view
                return self.leader_comm.Ireduce_scatter(MPI.IN_PLACE, view, counts, op=MPI.SUM)
            return self.leader_comm.Ireduce_scatter(view, out, counts, op=MPI.SUM)
        mine = view[:shard] if out is None else out
        if not self.leader:
            return self.scatter_comm.Iscatter(None, mine, root=0)
        node = view[:self.on_node * shard]  # the node's shards, its leader's first
        return self.scatter_comm.Iscatter(node, MPI.IN_PLACE if out is None else out, root=0)


def _reduce_to_leader(comm: Any, leader: bool, view: np.ndarray) -> Any:
    """Phase 1: the node's sum of ``view`` into the leader's ``view`` (non-blocking)."""
    from mpi4py import MPI

    if leader:
        return comm.Ireduce(MPI.IN_PLACE, view, op=MPI.SUM, root=0)
    return comm.Ireduce(view, None, op=MPI.SUM, root=0)


def hierarchical_launcher(topo: Any) -> HierarchicalReduce:
    """The hierarchical sum over ``topo``'s data group (``launch`` for ``GradBuckets``)."""
    return HierarchicalReduce(topo.dp_node_comm, topo.dp_node_bcast_comm, topo.dp_leader_comm)


def hierarchical_reduce_scatter(topo: Any) -> HierarchicalReduceScatter:
    """The hierarchical reduce-scatter over ``topo``'s data group (ZeRO 1 and 2)."""
    return HierarchicalReduceScatter(topo.dp_node_comm, topo.dp_node_bcast_comm,
                                     topo.dp_leader_comm, topo.dp_nodes)
