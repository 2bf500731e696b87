"""The calibration workers at any world size: a rate per rank, a sample per op and size,
the same figures on every rank (collective)."""

import pytest

from hpctrain.plan import cluster as cl
from hpctrain.plan.calibrate import collective_times, gemm_rates
from hpctrain.testing import assert_all


@pytest.mark.mpi
def test_every_rank_gets_every_ranks_gemm_rate(comm):
    for pool in (None, 0, 1 << 20):  # the default pool, the caches, a small pool
        rates = gemm_rates(comm, [32, 64], repeats=1, pool_bytes=pool)
        ok = sorted(rates) == [32, 64]
        ok &= all(len(r) == comm.Get_size() and min(r) > 0 for r in rates.values())
        assert_all(comm, ok, f"GEMM rates, pool {pool}")
        assert_all(comm, comm.allgather(rates) == [rates] * comm.Get_size(),
                   "same on every rank")


@pytest.mark.mpi
def test_every_op_and_size_has_one_positive_time_the_same_on_every_rank(comm):
    p = comm.Get_size()
    samples = collective_times(comm, [1024, 16384], repeats=2)
    ops = [op for op in cl.OPS if p > 1 or op != "p2p"]
    # float32 buffers of a multiple of p elements: the bytes rounded down to 4 p
    moved = [(op, n if op == "p2p" else n // (4 * p) * 4 * p) for op in ops for n in (1024, 16384)]
    ok = [(s.op, s.nbytes) for s in samples] == moved
    ok &= all(s.seconds > 0 and s.p == (2 if s.op == "p2p" else p) for s in samples)
    assert_all(comm, ok, "collective samples")
    assert_all(comm, comm.allgather(samples) == [samples] * p, "same on every rank")


@pytest.mark.mpi
def test_pairs_time_every_op_at_p_2_on_every_pair_at_once(comm):
    """``pair_times``: at an even world of 4 or more, a p = 2 sample per op and size, the
    same on both ranks of rank 0's pair, and every rank sent its pair's bytes (all pairs
    ran); elsewhere a clear error on every rank, before any collective."""
    from hpctrain.plan.calibrate import pair_times

    p = comm.Get_size()
    if p < 4 or p % 2:
        with pytest.raises(ValueError, match=rf"pairs need an even number of ranks, 4 or "
                                             rf"more \(got {p}\)"):
            pair_times(comm, [1024], repeats=1)
        return
    sent: list[float] = []
    samples = pair_times(comm, [1024, 16384], repeats=2, sent=sent)
    ok = [(s.op, s.p) for s in samples] == [(op, 2) for op in cl.OPS for _ in (1024, 16384)]
    ok &= all(s.seconds > 0 for s in samples)
    ok &= bool(sent) and min(sent) > 0
    assert_all(comm, ok, "pair samples")
    mine = comm.allgather(samples)
    assert_all(comm, mine[0] == mine[1], "the same on both ranks of rank 0's pair")


@pytest.mark.mpi
def test_the_overlap_probe_runs_in_groups_of_every_size_the_world_divides_into(comm):
    """``overlap.group_times``: one result per divisor of the world from 2, largest
    first, each measured by groups of that many ranks (its ``ranks``) all at once, the
    same on every rank; a world of one has no group. Without MPI_THREAD_MULTIPLE (no
    helper thread to move the sums) every rank raises, naming it."""
    from mpi4py import MPI

    from hpctrain.plan.overlap import group_sizes, group_times

    p = comm.Get_size()
    assert group_sizes(p) == [q for q in range(p, 1, -1) if p % q == 0]
    if p > 1 and MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        with pytest.raises(RuntimeError, match="needs MPI_THREAD_MULTIPLE"):
            group_times(comm, 1 << 20, 0.25, repeats=1)
        return
    times = group_times(comm, 1 << 20, 0.25, repeats=1)  # 4 buckets of 256 KiB
    ok = list(times) == group_sizes(p)
    ok &= all(t["ranks"] == q and t["buckets"] == 4 and t["comm_s"] > 0
              and t["compute_s"] > 0 for q, t in times.items())
    assert_all(comm, ok, f"group times {times}")
    assert_all(comm, comm.allgather(times) == [times] * p, "same on every rank")
