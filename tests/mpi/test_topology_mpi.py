"""The communicators of Topology.build hold exactly the ranks the arithmetic says,
for every (dp, tp, pp) factorisation of the world size."""

import pytest

from hpctrain.config import ParallelConfig
from hpctrain.parallel.topology import GridShape, Topology
from hpctrain.testing import assert_all


def layouts(n):
    return [(dp, tp, n // (dp * tp)) for dp in range(1, n + 1) for tp in range(1, n + 1)
            if n % (dp * tp) == 0]


@pytest.mark.mpi
def test_every_group_has_the_members_the_arithmetic_gives(comm):
    for dp, tp, pp in layouts(comm.Get_size()):
        topo = Topology.build(comm, ParallelConfig(dp=dp, tp=tp, pp=pp))
        shape = GridShape(dp, tp, pp)
        rank = comm.Get_rank()
        ok = True
        for axis, sub in (("tp", topo.tp_comm), ("dp", topo.dp_comm), ("pp", topo.pp_comm),
                          ("model", topo.model_comm)):
            members = sub.allgather(rank)
            ok &= members == shape.group_ranks(rank, axis)
        ok &= topo.tp_rank == topo.tp_comm.Get_rank()
        ok &= topo.dp_rank == topo.dp_comm.Get_rank()
        ok &= topo.pp_rank == topo.pp_comm.Get_rank()
        # pipeline neighbours: the previous stage's next is me
        nxt = topo.pp_comm.allgather(topo.next_stage)
        ok &= topo.prev_stage is None or nxt[topo.prev_stage] == topo.pp_rank
        assert_all(comm, ok, f"group membership at dp={dp} tp={tp} pp={pp}")
        topo.free()


@pytest.mark.mpi
def test_a_mismatched_layout_is_refused_on_every_rank(comm):
    with pytest.raises(ValueError, match=r"must equal the communicator size"):
        Topology.build(comm, ParallelConfig(dp=comm.Get_size() + 1, tp=1, pp=1))


@pytest.mark.mpi
def test_the_spatial_group_is_the_inner_axis_and_the_batch_group_spans_dp_and_sp(comm):
    n, rank = comm.Get_size(), comm.Get_rank()
    for sp in [s for s in range(2, n + 1) if n % s == 0]:
        topo = Topology.build(comm, ParallelConfig(dp=n // sp, sp=sp))
        shape = GridShape(n // sp, sp, 1)  # sp rides on the innermost axis
        ok = topo.spatial and (topo.tp_size, topo.tp_rank) == (1, 0)
        ok &= topo.sp_comm.allgather(rank) == shape.group_ranks(rank, "tp")
        ok &= (topo.sp_size, topo.sp_rank) == (sp, rank % sp)
        ok &= topo.dp_comm.allgather(rank) == shape.group_ranks(rank, "dp")
        ok &= topo.batch_comm.allgather(rank) == list(range(n))  # pp = 1: every rank
        assert_all(comm, ok, f"spatial groups at dp={n // sp} sp={sp}")
        topo.free()
    from mpi4py import MPI

    topo = Topology.build(comm, ParallelConfig(dp=n))
    # the same ranks in a communicator of its own: BatchNorm's sums in the backward
    # never match the gradient buckets' sums the bucket thread posts on dp_comm
    ok = not topo.spatial and topo.sp_comm is None
    ok &= MPI.Comm.Compare(topo.batch_comm, topo.dp_comm) == MPI.CONGRUENT
    assert_all(comm, ok, "without sp the batch group is a copy of the data group")
    topo.free()
