"""Where ranks sit: BLAS threads per rank, and the warning for a tensor group across nodes.

With tensor parallelism innermost (``topology``) and SLURM's default block placement
of consecutive ranks onto a node, a tensor group stays on one node exactly when the
node's rank count is a multiple of tp. The topology's ``NodeLayout`` records this for
the ranks as they were really placed (MPI's shared-memory split), so a cyclic
placement or a node with an odd rank count is caught too.
"""

from __future__ import annotations

import os

from hpctrain.parallel.topology import NodeLayout


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
