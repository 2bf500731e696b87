"""The parallel-scan backward under MPI against serial backprop, at any world size.

For every pipeline size pp in {2, 4} dividing the world size (the other ranks form
independent pipelines, as data-parallel replicas would), each rank runs its stage of
a deep narrow chain with the scan and with the ordinary chained backward; both give
the gradients serial backprop gives (float64, 1e-10 relative), which every rank
computes for itself.
"""

import numpy as np
import pytest

from hpctrain.config import ParallelConfig
from hpctrain.parallel.scan_backward import build_chain, serial_step, split_stages, step
from hpctrain.parallel.topology import Topology
from hpctrain.testing import assert_all, assert_close_all

B = 6


def pipeline_sizes(n):
    return [pp for pp in (2, 4) if n % pp == 0]


def cases(pp):
    """(depth, width, activation): several layers a stage, narrow and less narrow."""
    return [(2 * pp, 4, "gelu"), (3 * pp, 7, "relu"), (pp, 16, "gelu")]


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["scan", "chain"])
def test_gradients_equal_serial_backprop(comm, method):
    sizes = pipeline_sizes(comm.Get_size())
    assert_all(comm, bool(sizes) or comm.Get_size() == 1, "some pp in {2, 4} divides n")
    for pp in sizes:
        topo = Topology.build(comm, ParallelConfig(dp=comm.Get_size() // pp, pp=pp))
        s = topo.pp_rank
        for depth, width, act in cases(pp):
            seed = 10 * depth + width
            rng = np.random.default_rng(seed + topo.dp_rank)  # each pipeline its own batch
            x, t = rng.standard_normal((B, width)), rng.integers(0, width, B)
            serial = build_chain(depth, width, seed=seed, activation=act)
            ref_loss = serial_step(serial, x, t)
            stages = split_stages(build_chain(depth, width, seed=seed, activation=act),
                                  pp, width)
            loss = step(stages, x, t, topo.pp_comm, method=method)
            what = f"{method} pp={pp} depth={depth} width={width} {act}"
            ok = s != pp - 1 or abs(loss - ref_loss) <= 1e-12 * abs(ref_loss)
            assert_all(comm, ok, f"the last stage's loss equals serial, {what}")
            per = len(serial) // pp
            mine = [p.grad for layer in stages[s].layers for _, p in layer.named_parameters()]
            ref = [p.grad for layer in serial[s * per:(s + 1) * per]
                   for _, p in layer.named_parameters()]
            flat, want = np.concatenate([g.ravel() for g in mine]), \
                np.concatenate([g.ravel() for g in ref])
            assert_all(comm, np.abs(want).max() > 0, f"non-zero reference gradients, {what}")
            err = np.linalg.norm(flat - want) / np.linalg.norm(want)
            assert_close_all(comm, flat, want, rtol=1e-10, atol=1e-10 * np.abs(want).max(),
                             what=f"stage {s} gradients (relative error {err:.2g}), {what}")
        topo.free()


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_pp_1_is_refused_on_every_rank(comm):
    with pytest.raises(ValueError, match=r"pp \(1\) must be >= 2"):
        split_stages(build_chain(4, 4, seed=0), 1, 4)
    assert_all(comm, True, "every rank refused pp = 1 without a message")
