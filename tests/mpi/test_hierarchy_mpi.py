"""Node-aware reduction: the topology's node groups, and the hierarchical sum and
reduce-scatter equal to the flat ones, for nodes emulated with ``node_key`` on one
machine (and for the real node split, which ``tests/cluster`` runs across emulated nodes).

Node placements, for any world size: blocks of 2 ranks, one rank per node, all on one
node, uneven nodes (rank 0 alone), cyclic (even and odd ranks); each with many small
buckets in flight at once, tested and waited for out of order. Training at ZeRO 0, 1
and 2 reproduces the serial loss curve, with data groups of consecutive and of strided
ranks (tp = 2).
"""

from dataclasses import replace

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.config import Config, ParallelConfig
from hpctrain.nn.module import Parameter
from hpctrain.parallel.data import GradBuckets
from hpctrain.parallel.hierarchy import hierarchical_launcher, hierarchical_reduce_scatter
from hpctrain.parallel.topology import Topology
from hpctrain.testing import assert_all, assert_close_all, train_losses

SIZE = MPI.COMM_WORLD.Get_size()
PLACEMENTS = {
    "block2": lambda r: r // 2,
    "one-per-node": lambda r: r,
    "one-node": lambda r: 0,
    "uneven": lambda r: min(r, 1),
    "cyclic": lambda r: r % 2,
    "mpi": None,  # MPI's shared-memory split: one node here, real nodes on a cluster
}


def key(placement, rank):
    f = PLACEMENTS[placement]
    return None if f is None else f(rank)


def values(rank, i, n):
    """Parameter i's gradient on ``rank``: distinct on every rank and element."""
    return np.sin(np.arange(n) * (i + 1) + 0.37 * rank) * (rank + 1)


@pytest.mark.mpi
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_node_groups_follow_the_placement(comm, placement):
    rank = comm.Get_rank()
    topo = Topology.build(comm, ParallelConfig(dp=SIZE), node_key=key(placement, rank))
    keys = comm.allgather(topo.node_comm.bcast(rank))  # each rank's node id
    mine = [r for r in range(SIZE) if keys[r] == keys[rank]]
    leaders = sorted({min(r for r in range(SIZE) if keys[r] == k) for k in keys})
    ok = topo.dp_node_comm.allgather(rank) == mine
    ok &= topo.dp_nodes == tuple(tuple(r for r in range(SIZE) if keys[r] == keys[leader])
                                 for leader in leaders)
    ok &= topo.nodes.ranks_on_node == len(mine) and topo.nodes.num_nodes == len(leaders)
    ok &= topo.nodes.node_index == leaders.index(mine[0])
    if rank in leaders:
        ok &= topo.dp_leader_comm.allgather(rank) == leaders
    else:
        ok &= topo.dp_leader_comm == MPI.COMM_NULL
    assert_all(comm, ok, f"node groups of placement {placement}")
    topo.free()


@pytest.mark.mpi
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_hierarchical_bucket_sums_equal_the_flat_sums(comm, placement):
    rank = comm.Get_rank()
    topo = Topology.build(comm, ParallelConfig(dp=SIZE), node_key=key(placement, rank))
    sizes = [7, 300, 1, 4096, 33, 1000, 5, 2048]
    params = [Parameter(np.zeros(n)) for n in sizes]
    # buckets of 128 bytes: all but the smallest parameters are a bucket of their own
    grads = GradBuckets(params, hierarchical_launcher(topo), bucket_mb=1 / 8192)
    for step in range(2):  # twice: the state of one step does not leak into the next
        grads.zero()
        for i, p in enumerate(params):
            p.grad[...] = values(rank, i, p.size) + step
        grads.mark_ready(params[::-1])  # backward order: every bucket launched now
        grads.wait()
        for i, p in enumerate(params):
            want = sum(values(r, i, p.size) for r in range(SIZE)) + SIZE * step
            assert_close_all(comm, p.grad, want, rtol=1e-12, atol=1e-12,
                             what=f"parameter {i} at step {step}, placement {placement}")
    assert_all(comm, len(grads.buckets) >= 6, f"{len(grads.buckets)} buckets")
    topo.free()


@pytest.mark.mpi
@pytest.mark.parametrize("placement", ["block2", "uneven", "cyclic"])
def test_buckets_tested_and_waited_for_out_of_order(comm, placement):
    """Phases finish at different times on different ranks; whatever order the buckets
    are polled and waited in, every communicator sees its collectives in bucket order."""
    rank = comm.Get_rank()
    topo = Topology.build(comm, ParallelConfig(dp=SIZE), node_key=key(placement, rank))
    launch = hierarchical_launcher(topo)
    views = [values(rank, k, 500 + 97 * k) for k in range(12)]
    requests = [launch(None, v) for v in views]
    rng = np.random.default_rng(rank)  # each rank its own order
    for k in rng.permutation(len(requests))[:6]:
        if requests[k] is not None:
            requests[k].Test()
    for k in rng.permutation(len(requests)):
        if requests[k] is not None:
            requests[k].Wait()
    for k, v in enumerate(views):
        want = sum(values(r, k, v.size) for r in range(SIZE))
        assert_close_all(comm, v, want, rtol=1e-12, atol=1e-12, what=f"bucket {k}")
    topo.free()


@pytest.mark.mpi
@pytest.mark.parametrize("in_place", [True, False], ids=["zero1-in-place", "zero2-to-shard"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_hierarchical_reduce_scatter_gives_each_rank_its_shard(comm, placement, in_place):
    """Shard d of the sum on dp rank d, at the start of the bucket (ZeRO 1) or in a
    separate array (ZeRO 2); buckets in flight together, waited for in a random order."""
    rank = comm.Get_rank()
    topo = Topology.build(comm, ParallelConfig(dp=SIZE), node_key=key(placement, rank))
    reduce_scatter = hierarchical_reduce_scatter(topo)
    shards = [1, 3, 64, 2, 500, 7]  # elements per rank
    views = [values(rank, k, SIZE * n) for k, n in enumerate(shards)]
    outs = [None if in_place else np.full(n, np.nan) for n in shards]
    requests = [reduce_scatter(v, out) for v, out in zip(views, outs, strict=True)]
    for k in np.random.default_rng(rank).permutation(len(requests)):
        if requests[k] is not None:
            requests[k].Wait()
    for k, n in enumerate(shards):
        got = views[k][:n] if in_place else outs[k]
        want = sum(values(r, k, SIZE * n) for r in range(SIZE))[rank * n:(rank + 1) * n]
        assert_close_all(comm, got, want, rtol=1e-12, atol=1e-12,
                         what=f"shard of bucket {k}, placement {placement}")
    topo.free()


def dp_layouts(n):
    out = [(n, 1)]
    if n % 2 == 0 and n > 2:
        out.append((n // 2, 2))  # data groups strided over the tensor pairs
    return out


@pytest.fixture(scope="module")
def curve():
    """Global batches and the serial loss curve of the equivalence suite's tiny GPT."""
    from test_equivalence import MODEL, TRAIN

    r = np.random.default_rng(0)
    shape = (TRAIN.batch_size, MODEL.seq_len)
    batches = [(r.integers(0, MODEL.vocab_size, shape), r.integers(0, MODEL.vocab_size, shape))
               for _ in range(6)]
    serial = train_losses(Config(model=MODEL, train=TRAIN).validate(1), MPI.COMM_SELF, batches)
    return batches, serial


TRAINING = ([("block2", zero) for zero in (0, 1, 2, 3)] + [("cyclic", zero) for zero in (0, 2, 3)]
            + [("uneven", 1), ("mpi", 0)])


@pytest.mark.mpi
@pytest.mark.parametrize("placement, zero", TRAINING, ids=lambda v: str(v))
@pytest.mark.parametrize("dp, tp", dp_layouts(SIZE), ids=lambda v: str(v))
def test_hierarchical_training_reproduces_the_serial_loss_curve(comm, curve, placement, zero,
                                                                dp, tp):
    from test_equivalence import MODEL, RTOL, TRAIN

    batches, serial = curve
    par = ParallelConfig(dp=dp, tp=tp, microbatches=2, bucket_mb=0.002, zero=zero,
                         dp_reduce="hierarchical")
    cfg = Config(model=MODEL, parallel=par, train=TRAIN).validate(SIZE)
    got = train_losses(cfg, comm, batches, node_key=key(placement, comm.Get_rank()))
    what = f"dp{dp}-tp{tp}, zero {zero}, placement {placement}"
    assert_close_all(comm, got, serial, rtol=RTOL, what=f"hierarchical losses at {what}")
    if placement == "block2":
        flat = train_losses(replace(cfg, parallel=replace(par, dp_reduce="flat")), comm,
                            batches)
        assert_close_all(comm, got, flat, rtol=RTOL, what=f"hierarchical against flat at {what}")
