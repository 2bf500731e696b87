"""Where ranks sit: ranks per node, tensor groups inside a node, BLAS threads per rank.

With tensor parallelism innermost (``topology``) and SLURM's default block placement
of consecutive ranks onto a node, a tensor group stays on one node exactly when the
node's rank count is a multiple of tp. ``node_layout`` checks this for the ranks as
they were really placed, from MPI's shared-memory split, so a cyclic placement or a
node with an odd rank count is caught too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class NodeLayout:
    node_index: int  # which node this rank is on, numbered by each node's lowest rank
    num_nodes: int
    ranks_on_node: int
    tp_spans_nodes: bool  # True if this rank's tensor group crosses a node boundary


def node_layout(world_comm: Any, tp_comm: Any) -> NodeLayout:
    """This rank's node and whether its tensor group spans nodes (collective)."""
    from mpi4py import MPI

    node_comm = world_comm.Split_type(MPI.COMM_TYPE_SHARED, key=world_comm.Get_rank())
    try:
        leader = node_comm.bcast(world_comm.Get_rank(), root=0)
        ranks_on_node = node_comm.Get_size()
    finally:
        node_comm.Free()
    leaders = sorted(set(world_comm.allgather(leader)))
    tp_nodes = set(tp_comm.allgather(leader))
    return NodeLayout(leaders.index(leader), len(leaders), ranks_on_node, len(tp_nodes) > 1)


def blas_threads_per_rank(ranks_on_node: int) -> int:
    """BLAS threads for one rank, never fewer than one.

    SLURM's cores per task if set; else, if the launcher bound this rank to a subset
    of the cores, that subset; else the node's cores shared evenly among its ranks.
    """
    per_task = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if per_task.isdigit():
        return max(1, int(per_task))
    total = os.cpu_count() or 1
    try:
        mine = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        mine = total
    if mine < total:
        return mine
    return max(1, total // max(1, ranks_on_node))


def tensor_group_warning(layout: NodeLayout, tp: int) -> str | None:
    if not layout.tp_spans_nodes:
        return None
    return (f"warning: a tensor-parallel group (tp = {tp}) spans nodes, so its all-reduces "
            f"cross the network; use ranks per node ({layout.ranks_on_node}) divisible by tp")
