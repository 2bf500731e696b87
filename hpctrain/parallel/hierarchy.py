"""Hierarchical gradient reduction: reduce in the node, all-reduce among nodes, broadcast.

The flat reduction is one ``Iallreduce`` per bucket over the data group. The
hierarchical one sums each bucket in three non-blocking phases, so that only one rank
per node (the node's first data-parallel rank, its leader) sends over the network.
4 nodes x 2 ranks, dp = 8, one bucket ``g``::

    node        n0          n1          n2          n3
    ranks      0    1      2    3      4    5      6    7
    1 reduce   g0+g1 <-    g2+g3 <-    g4+g5 <-    g6+g7 <-     dp_node_comm
    2 all-red. [ s01  <----> s23  <----> s45  <----> s67 ]      dp_leader_comm
    3 bcast    S -> S      S -> S      S -> S      S -> S       dp_node_bcast_comm

Each node link carries one all-reduce among ``nodes`` ranks, whatever the placement of
the ranks and whatever algorithm the MPI library picks for the flat one. Measured on
4 emulated nodes of 2 ranks at 100 Mbit/s (``benchmarks/README.md``): with ranks placed
node by node, MPICH's flat all-reduce already pairs the ranks of a node first and sends
as few bytes over each link (about 1.55 times the buffer, both ways alike: 1.05x);
with ranks dealt out cyclically, the flat one sends twice as much and the
hierarchical one is 2.1x faster.

MPI requires the collectives on one communicator to be posted in the same order on
every rank, but a bucket's phases finish at different times on different ranks. So
the reduce and the broadcast each have their own communicator (the topology's node
part of the data group and its duplicate), and bucket k may post a phase only after
bucket k - 1 has posted it (``progress`` walks the buckets in order). A rank posts a
phase only when its previous phase is complete, so a pending send buffer is never a
pending receive buffer. Phases that would run on one rank are skipped: one rank per
node (the all-reduce alone), one node (reduce and broadcast only).
"""

from __future__ import annotations

from collections import deque
from typing import Any

REDUCE, ALLREDUCE, BCAST = "reduce", "allreduce", "bcast"


class _Bucket:
    """One bucket's phases; ``Test``/``Wait`` like an MPI request (what GradBuckets uses)."""

    def __init__(self, owner: HierarchicalReduce, view: Any, phases: tuple[str, ...]):
        self.owner, self.view, self.phases = owner, view, phases
        self.posted = 0  # phases posted so far (the last one may be in flight)
        self.request = None

    @property
    def done(self) -> bool:
        return self.posted == len(self.phases) and self.request is None

    def Test(self) -> bool:  # noqa: N802 - the name MPI requests have
        self.owner.progress()
        return self.done

    def Wait(self) -> None:  # noqa: N802
        while not self.done:
            self.owner.progress()
            first = self.owner.in_flight[0] if self.owner.in_flight else None
            if not self.done and first is not None and first.request is not None:
                first.request.Wait()  # the oldest bucket can always go on: block on it


class HierarchicalReduce:
    """``launch`` for ``GradBuckets``: the sum of a bucket over the data group in three
    phases, over the topology's ``dp_node_comm`` (reduce), ``dp_leader_comm``
    (all-reduce) and ``dp_node_bcast_comm`` (broadcast). No collective at construction."""

    def __init__(self, dp_node_comm: Any, dp_node_bcast_comm: Any, dp_leader_comm: Any):
        from mpi4py import MPI

        self.MPI = MPI
        local = dp_node_comm.Get_size() > 1
        self.reduce_comm, self.bcast_comm = dp_node_comm, dp_node_bcast_comm
        self.leader = dp_node_comm.Get_rank() == 0
        self.leader_comm = (dp_leader_comm if self.leader and dp_leader_comm.Get_size() > 1
                            else None)
        self.phases = tuple(p for p, on in ((REDUCE, local),
                                            (ALLREDUCE, self.leader_comm is not None),
                                            (BCAST, local)) if on)
        self.in_flight: deque[_Bucket] = deque()

    def __call__(self, bucket: Any, view: Any) -> _Bucket | None:
        """Start summing ``view`` (a bucket of the flat gradient) in place."""
        if not self.phases:
            return None  # one rank in the data group
        b = _Bucket(self, view, self.phases)
        self.in_flight.append(b)
        self.progress()
        return b

    def _post(self, phase: str, view: Any) -> Any:
        MPI = self.MPI
        if phase == REDUCE:
            send = MPI.IN_PLACE if self.leader else view
            return self.reduce_comm.Ireduce(send, view if self.leader else None, op=MPI.SUM,
                                            root=0)
        if phase == ALLREDUCE:
            return self.leader_comm.Iallreduce(MPI.IN_PLACE, view, op=MPI.SUM)
        return self.bcast_comm.Ibcast(view, root=0)

    def progress(self) -> None:
        """Test what is in flight and post every phase whose turn has come, in bucket
        order: a phase is posted only when it is the bucket's next one, its previous
        one is complete, and every earlier bucket has posted it."""
        blocked: set[str] = set()
        for b in self.in_flight:
            while True:
                if b.request is not None:
                    if not b.request.Test():
                        break
                    b.request = None
                if b.posted == len(b.phases) or b.phases[b.posted] in blocked:
                    break
                b.request = self._post(b.phases[b.posted], b.view)
                b.posted += 1
            blocked.update(b.phases[b.posted:])  # later buckets wait for these
        while self.in_flight and self.in_flight[0].done:
            self.in_flight.popleft()


def hierarchical_launcher(topo: Any) -> HierarchicalReduce:
    """The hierarchical reduction over ``topo``'s data group."""
    return HierarchicalReduce(topo.dp_node_comm, topo.dp_node_bcast_comm, topo.dp_leader_comm)
