"""The calibration workers at any world size: a rate per rank, a sample per op and size,
the same figures on every rank (collective)."""

import pytest

from hpctrain.plan import cluster as cl
from hpctrain.plan.calibrate import collective_times, gemm_rates
from hpctrain.testing import assert_all


@pytest.mark.mpi
def test_every_rank_gets_every_ranks_gemm_rate(comm):
    rates = gemm_rates(comm, [32, 64], repeats=1)
    ok = sorted(rates) == [32, 64]
    ok &= all(len(r) == comm.Get_size() and min(r) > 0 for r in rates.values())
    assert_all(comm, ok, "GEMM rates")
    assert_all(comm, comm.allgather(rates) == [rates] * comm.Get_size(), "same on every rank")


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
