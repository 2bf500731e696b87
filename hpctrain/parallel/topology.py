"""The 3-D process grid: which rank holds which piece of the model.

Ranks are laid out with the tensor-parallel index innermost, then data-parallel, then
pipeline-parallel (Megatron's order)::

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

Tensor-parallel neighbours therefore have consecutive ranks and, with a block
placement of ranks onto nodes, share a node: their all-reduces, the most frequent
collectives, stay on the node's memory bus. For 8 ranks with dp = tp = pp = 2::

    rank | pp dp tp | tensor group  data group  pipeline group
    -----+----------+---------------------------------------------
      0  |  0  0  0 |   [0, 1]        [0, 2]       [0, 4]
      1  |  0  0  1 |   [0, 1]        [1, 3]       [1, 5]
      2  |  0  1  0 |   [2, 3]        [0, 2]       [2, 6]
      3  |  0  1  1 |   [2, 3]        [1, 3]       [3, 7]
      4  |  1  0  0 |   [4, 5]        [4, 6]       [0, 4]
      5  |  1  0  1 |   [4, 5]        [5, 7]       [1, 5]
      6  |  1  1  0 |   [6, 7]        [4, 6]       [2, 6]
      7  |  1  1  1 |   [6, 7]        [5, 7]       [3, 7]

Nodes. ``Topology.build`` also finds which ranks share a node (MPI's shared-memory
split, or a ``node_key`` per rank, which tests use to emulate nodes on one machine)
and splits each data group by node, for the hierarchical gradient reduction
(``hierarchy.py``). 8 ranks on 4 nodes of 2, dp = 8: the data group [0..7] becomes
four node groups and one group of node leaders::

    node          |  n0   |  n1   |  n2   |  n3   |
    ranks         | 0   1 | 2   3 | 4   5 | 6   7 |
    dp_node_comm  | [0,1] | [2,3] | [4,5] | [6,7] |   1: reduce to the node's leader
    dp_leader_comm| 0     | 2     | 4     | 6     |   2: all-reduce among the nodes
    dp_node_bcast_comm: a duplicate of dp_node_comm     3: broadcast in the node
    dp_nodes      ((0, 1), (2, 3), (4, 5), (6, 7))      dp ranks by node, leaders' order

With dp = 4, tp = 2 on the same nodes the data groups are [0,2,4,6] and [1,3,5,7]:
one member per node, so every dp_node_comm has one rank and the leaders are the whole
group (``dp_nodes`` is ((0,), (1,), (2,), (3,))). Ranks dealt out cyclically onto 2
nodes (even ranks on one, odd on the other), dp = 8: ``dp_nodes`` is
((0, 2, 4, 6), (1, 3, 5, 7)), the leaders are ranks 0 and 1. ``NodeLayout`` tells
whether a tensor group spans nodes.

Spatial parallelism (``sp``) shares the innermost axis with tensor parallelism: a
model splits either its weights over it (tp) or each sample's activations (sp,
``spatial.py``), never both, so ``GridShape.tp`` is the size of that axis and the
inner group is ``tp_comm`` either way. Spatial neighbours exchange halos at every
convolution, the most frequent transfers of a convolutional net, so they too belong
on one node. ``Topology.sp_comm`` is the inner group when ``sp > 1`` (then
``tp_size`` is 1), and ``batch_comm`` joins every rank holding a part of one global
batch: the data group times the spatial group, over which BatchNorm sums its
statistics. 8 ranks with dp = 2, sp = 4 (``GridShape(dp=2, tp=4, pp=1)``)::

    rank | dp sp | spatial group  data group  batch group
    -----+-------+---------------------------------------
      0  |  0  0 |   [0..3]        [0, 4]      [0..7]
      1  |  0  1 |   [0..3]        [1, 5]      [0..7]
      2  |  0  2 |   [0..3]        [2, 6]      [0..7]
      3  |  0  3 |   [0..3]        [3, 7]      [0..7]
      4  |  1  0 |   [4..7]        [0, 4]      [0..7]
      5  |  1  1 |   [4..7]        [1, 5]      [0..7]
      6  |  1  2 |   [4..7]        [2, 6]      [0..7]
      7  |  1  3 |   [4..7]        [3, 7]      [0..7]

Embedding tables (``parallel/tables.py``) are sharded over a *table group* of
``table_group`` consecutive members of the data group and replicated across the groups
(two-dimensional sparse parallelism): ``table_comm`` joins one group (the all-to-alls
of lookups and gradients), ``table_replica_comm`` the members at the same place in
every group (the sum of a shard's gradient over the replicas). The dense layers stay
data parallel over the whole data group. 8 ranks, dp = 8, table_group = 4
(``table_groups``)::

    rank | group place | table group  replica group
    -----+-------------+---------------------------
      0  |   0     0   |   [0..3]        [0, 4]
      1  |   0     1   |   [0..3]        [1, 5]
      2  |   0     2   |   [0..3]        [2, 6]
      3  |   0     3   |   [0..3]        [3, 7]
      4  |   1     0   |   [4..7]        [0, 4]
      5  |   1     1   |   [4..7]        [1, 5]
      6  |   1     2   |   [4..7]        [2, 6]
      7  |   1     3   |   [4..7]        [3, 7]

The arithmetic (``coords``, ``rank_of``, ``group_ranks``, ``group_by_node``,
``table_groups``) is pure and tested without MPI. ``Topology.build`` is the one place
where communicators are created; everything else receives the communicator it uses as
an argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple


class Coords(NamedTuple):
    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class GridShape:
    """Sizes of the three axes; the world has ``dp * tp * pp`` ranks."""

    dp: int
    tp: int
    pp: int

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def coords(self, rank: int) -> Coords:
        """World rank -> (pp_rank, dp_rank, tp_rank)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank ({rank}) must be in [0, {self.world_size})")
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return Coords(pp_rank, dp_rank, tp_rank)

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        """(pp_rank, dp_rank, tp_rank) -> world rank."""
        for name, value, size in (("pp", pp, self.pp), ("dp", dp, self.dp), ("tp", tp, self.tp)):
            if not 0 <= value < size:
                raise ValueError(f"{name}_rank ({value}) must be in [0, {size})")
        return (pp * self.dp + dp) * self.tp + tp

    def group_ranks(self, rank: int, axis: str) -> list[int]:
        """World ranks of ``rank``'s group along ``axis`` ('tp', 'dp', 'pp' or 'model'),
        ordered by their index along that axis. The 'model' group is one model
        replica: every (pp, tp) position with this rank's dp index."""
        c = self.coords(rank)
        if axis == "tp":
            return [self.rank_of(c.pp, c.dp, t) for t in range(self.tp)]
        if axis == "dp":
            return [self.rank_of(c.pp, d, c.tp) for d in range(self.dp)]
        if axis == "pp":
            return [self.rank_of(p, c.dp, c.tp) for p in range(self.pp)]
        if axis == "model":
            return [self.rank_of(p, c.dp, t) for p in range(self.pp) for t in range(self.tp)]
        raise ValueError(f"axis ({axis!r}) must be one of 'tp', 'dp', 'pp', 'model'")

    def table(self) -> str:
        """The rank table of the module docstring, for any shape (printed at start-up)."""
        lines = ["rank | pp dp tp | tensor group | data group | pipeline group"]
        for r in range(self.world_size):
            c = self.coords(r)
            lines.append(f"{r:4d} | {c.pp:2d} {c.dp:2d} {c.tp:2d} | {self.group_ranks(r, 'tp')} | "
                         f"{self.group_ranks(r, 'dp')} | {self.group_ranks(r, 'pp')}")
        return "\n".join(lines)


@dataclass(frozen=True)
class NodeLayout:
    """Where this rank runs: nodes are numbered by their lowest world rank."""

    node_index: int  # this rank's node
    num_nodes: int
    ranks_on_node: int
    tp_spans_nodes: bool  # True if this rank's tensor group crosses a node boundary


def group_by_node(node_ids: list[int]) -> tuple[tuple[int, ...], ...]:
    """The members of a group (``node_ids[i]``: the node of member i) by node: each
    node's members in increasing order, the nodes by their first member. This is the
    order of the node leaders in ``dp_leader_comm``. ``[0, 0, 2, 2]`` -> ((0, 1), (2, 3));
    cyclic ``[0, 1, 0, 1]`` -> ((0, 2), (1, 3))."""
    members: dict[int, list[int]] = {}
    for i, node in enumerate(node_ids):
        members.setdefault(node, []).append(i)
    return tuple(sorted((tuple(m) for m in members.values()), key=lambda m: m[0]))


def table_groups(dp_size: int, group: int, dp_rank: int) -> tuple[list[int], list[int]]:
    """The data-group ranks of ``dp_rank``'s table group and of its replica group
    (the module docstring's table): groups of ``group`` consecutive dp ranks."""
    if not (1 <= group <= dp_size and dp_size % group == 0):
        raise ValueError(f"table_group ({group}) must divide dp ({dp_size})")
    first, place = dp_rank - dp_rank % group, dp_rank % group
    return (list(range(first, first + group)),
            list(range(place, dp_size, group)))


@dataclass
class Topology:
    """This rank's place in the grid and the communicators of its groups.

    ``tp_comm`` joins the ranks that split one layer; ``dp_comm`` the replicas of one
    model shard; ``pp_comm`` the stages of one pipeline, ordered by stage;
    ``model_comm`` all shards of one model replica (tp * pp ranks). ``node_comm``:
    the world ranks on this rank's node; ``dp_node_comm``: the members of ``dp_comm``
    on this node, by dp rank, and ``dp_node_bcast_comm`` a duplicate of it (the
    hierarchical reduction's last phase, a broadcast or a scatter, ordered apart from
    its reduces); ``dp_leader_comm``: the first of them on every node, by dp rank
    (``MPI.COMM_NULL`` on the other ranks). ``dp_nodes``: the dp ranks of this data
    group by node, in ``dp_leader_comm``'s order (``group_by_node``). ``ckpt_comm``: a
    duplicate of the world for the checkpoint writer's background thread, whose
    collectives must never meet the training's (``checkpoint.background``).
    ``watch_comm``: another duplicate, for the stall watchdog's thread (``watchdog``).
    ``table_comm`` and ``table_replica_comm``: the table group and the replica group of
    sharded embedding tables (``table_groups``; None when no table is sharded).
    """

    shape: GridShape
    rank: int
    world_comm: Any
    tp_comm: Any
    dp_comm: Any
    pp_comm: Any
    model_comm: Any
    node_comm: Any
    dp_node_comm: Any
    dp_node_bcast_comm: Any
    dp_leader_comm: Any
    nodes: NodeLayout
    dp_nodes: tuple[tuple[int, ...], ...]
    ckpt_comm: Any = None
    watch_comm: Any = None
    spatial: bool = False  # the inner axis splits samples in space (sp), not weights (tp)
    batch_comm: Any = None  # the data group times the spatial group (dp_comm's copy at sp 1)
    table_comm: Any = None  # sharded embedding tables: one table group (parallel/tables.py)
    table_replica_comm: Any = None  # the same place in every table group

    @classmethod
    def build(cls, comm: Any, parallel: Any, node_key: int | None = None) -> Topology:
        """Split ``comm`` into the grid given by a validated ``ParallelConfig``.

        ``node_key``: this rank's node, the same int on every rank of a node (tests
        emulate nodes with it); default: the ranks MPI puts in one shared-memory domain.
        Collective over ``comm``: every rank makes the same splits in the same order.
        """
        from mpi4py import MPI

        sp = getattr(parallel, "sp", 1)
        shape = GridShape(dp=parallel.dp, tp=parallel.tp * sp, pp=parallel.pp)
        if shape.world_size != comm.Get_size():
            raise ValueError(f"dp * tp * sp * pp ({parallel.dp} * {parallel.tp} * {sp} * "
                             f"{parallel.pp} = {shape.world_size}) must equal the "
                             f"communicator size ({comm.Get_size()})")
        rank = comm.Get_rank()
        c = shape.coords(rank)
        # color: which group; key: the rank's position inside it
        tp_comm = comm.Split(color=c.pp * shape.dp + c.dp, key=c.tp)
        dp_comm = comm.Split(color=c.pp * shape.tp + c.tp, key=c.dp)
        pp_comm = comm.Split(color=c.dp * shape.tp + c.tp, key=c.pp)
        model_comm = comm.Split(color=c.dp, key=c.pp * shape.tp + c.tp)
        node_comm, nodes, node_id = _split_nodes(comm, tp_comm, node_key)
        # node_id is the node's lowest world rank: the same on all its ranks
        dp_node_comm = dp_comm.Split(color=node_id, key=c.dp)
        leader = dp_node_comm.Get_rank() == 0
        dp_leader_comm = dp_comm.Split(color=0 if leader else MPI.UNDEFINED, key=c.dp)
        dp_nodes = group_by_node(dp_comm.allgather(node_id))
        spatial = sp > 1
        # a communicator of its own even when it is the data group: BatchNorm's blocking
        # sums run in the backward while the gradient buckets' non-blocking sums, posted
        # by the bucket thread on dp_comm, are in flight; on one communicator the two
        # threads' collectives could match the wrong partners
        batch_comm = (comm.Split(color=c.pp, key=c.dp * shape.tp + c.tp) if spatial
                      else dp_comm.Dup())
        table_comm = table_replica_comm = None
        group = _table_group(parallel, shape.dp)
        if group:  # some table is sharded: its group and replicas, within the data group
            table_comm = dp_comm.Split(color=c.dp // group, key=c.dp % group)
            table_replica_comm = dp_comm.Split(color=c.dp % group, key=c.dp // group)
        return cls(shape, rank, comm, tp_comm, dp_comm, pp_comm, model_comm, node_comm,
                   dp_node_comm, dp_node_comm.Dup(), dp_leader_comm, nodes, dp_nodes,
                   comm.Dup(), watch_comm=comm.Dup(), spatial=spatial,
                   batch_comm=batch_comm, table_comm=table_comm,
                   table_replica_comm=table_replica_comm)

    @property
    def coords(self) -> Coords:
        return self.shape.coords(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def tp_rank(self) -> int:
        return 0 if self.spatial else self.coords.tp

    @property
    def sp_rank(self) -> int:
        return self.coords.tp if self.spatial else 0

    @property
    def sp_size(self) -> int:
        return self.shape.tp if self.spatial else 1

    @property
    def sp_comm(self) -> Any:
        """The spatial group (the inner group when sp > 1), else None."""
        return self.tp_comm if self.spatial else None

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def dp_size(self) -> int:
        return self.shape.dp

    @property
    def tp_size(self) -> int:
        return 1 if self.spatial else self.shape.tp

    @property
    def pp_size(self) -> int:
        return self.shape.pp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def prev_stage(self) -> int | None:
        """Rank in ``pp_comm`` of the previous pipeline stage, or None on the first."""
        return None if self.is_first_stage else self.pp_rank - 1

    @property
    def next_stage(self) -> int | None:
        """Rank in ``pp_comm`` of the next pipeline stage, or None on the last."""
        return None if self.is_last_stage else self.pp_rank + 1

    def free(self) -> None:
        """Release the communicators this topology created (collective)."""
        from mpi4py import MPI

        for comm in (self.tp_comm, self.dp_comm, self.pp_comm, self.model_comm,
                     self.node_comm, self.dp_node_comm, self.dp_node_bcast_comm,
                     self.dp_leader_comm, self.ckpt_comm, self.watch_comm,
                     self.batch_comm, self.table_comm,
                     self.table_replica_comm):
            if comm is not None and comm != MPI.COMM_NULL:
                comm.Free()


def _table_group(parallel: Any, dp_size: int) -> int:
    """The table group's size when a table is sharded (``[parallel] table_sharding`` or
    ``table_default`` other than replicated), else 0."""
    sharded = getattr(parallel, "table_default", "replicated") != "replicated" or any(
        s.sharding != "replicated" for s in getattr(parallel, "table_sharding", ()))
    return (getattr(parallel, "table_group", 0) or dp_size) if sharded else 0


def split_node(comm: Any, node_key: int | None = None) -> Any:
    """The ranks of ``comm`` on this rank's node, by rank: MPI's shared-memory domain,
    or the ranks with this rank's ``node_key``. Collective over ``comm``; the caller
    frees the result (``Topology.build`` keeps it as ``node_comm``)."""
    from mpi4py import MPI

    rank = comm.Get_rank()
    if node_key is None:
        return comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    return comm.Split(color=node_key, key=rank)


def _split_nodes(comm: Any, tp_comm: Any, node_key: int | None) -> tuple[Any, NodeLayout, int]:
    """This rank's node communicator, its NodeLayout and its node's id (lowest world
    rank on the node). Collective over ``comm`` (one split, one bcast in the node, one
    allgather over comm and one over ``tp_comm``)."""
    node_comm = split_node(comm, node_key)
    node_id = node_comm.bcast(comm.Get_rank(), root=0)
    ids = sorted(set(comm.allgather(node_id)))
    tp_nodes = set(tp_comm.allgather(node_id))
    layout = NodeLayout(ids.index(node_id), len(ids), node_comm.Get_size(), len(tp_nodes) > 1)
    return node_comm, layout, node_id
