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

The arithmetic (``coords``, ``rank_of``, ``group_ranks``) is pure and tested without
MPI. ``Topology.build`` is the one place where communicators are created; everything
else receives the communicator it uses as an argument.
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


@dataclass
class Topology:
    """This rank's place in the grid and the communicators of its groups.

    ``tp_comm`` joins the ranks that split one layer; ``dp_comm`` the replicas of one
    model shard; ``pp_comm`` the stages of one pipeline, ordered by stage;
    ``model_comm`` all shards of one model replica (tp * pp ranks).
    """

    shape: GridShape
    rank: int
    world_comm: Any
    tp_comm: Any
    dp_comm: Any
    pp_comm: Any
    model_comm: Any

    @classmethod
    def build(cls, comm: Any, parallel: Any) -> Topology:
        """Split ``comm`` into the grid given by a validated ``ParallelConfig``.

        Collective over ``comm``: every rank calls ``Split`` four times, in the same order.
        """
        shape = GridShape(dp=parallel.dp, tp=parallel.tp, pp=parallel.pp)
        if shape.world_size != comm.Get_size():
            raise ValueError(f"dp * tp * pp ({parallel.dp} * {parallel.tp} * {parallel.pp} = "
                             f"{shape.world_size}) must equal the communicator size "
                             f"({comm.Get_size()})")
        rank = comm.Get_rank()
        c = shape.coords(rank)
        # color: which group; key: the rank's position inside it
        tp_comm = comm.Split(color=c.pp * shape.dp + c.dp, key=c.tp)
        dp_comm = comm.Split(color=c.pp * shape.tp + c.tp, key=c.dp)
        pp_comm = comm.Split(color=c.dp * shape.tp + c.tp, key=c.pp)
        model_comm = comm.Split(color=c.dp, key=c.pp * shape.tp + c.tp)
        return cls(shape, rank, comm, tp_comm, dp_comm, pp_comm, model_comm)

    @property
    def coords(self) -> Coords:
        return self.shape.coords(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def dp_size(self) -> int:
        return self.shape.dp

    @property
    def tp_size(self) -> int:
        return self.shape.tp

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
        for comm in (self.tp_comm, self.dp_comm, self.pp_comm, self.model_comm):
            comm.Free()
