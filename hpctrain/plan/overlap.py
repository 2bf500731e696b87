"""How much of a data-parallel sum a node hides under compute (``comm_overlap``).

The cost model (``cost.dp_time``) lets a gradient bucket's sum run beside the
backward and counts as exposed only what runs past the end of the compute, plus the
CPU the bytes cost (``comm_cpu_s_per_byte``). Whether the sum really hides depends
on the node: MPICH moves a non-blocking collective only inside MPI calls, made here
by the data-parallel helper thread every millisecond (``parallel.data.GradBuckets``),
and over TCP every byte is copied by a core; a node with half a core (four emulated
nodes on two) has little left to move it while it computes. ``overlap_times``
measures it with the engine's own machinery, every rank at once, one rank a node:

* ``compute``: a loop of float32 GEMMs (one BLAS thread) of about ``compute_s``;
* ``comm``: the gradient buckets (``nbytes`` in buckets of ``bucket_mb``) summed by
  blocking ``Allreduce``s, one after the other;
* ``both``: the loop again while ``GradBuckets`` sums the same buckets, every bucket
  reported final before the first product (its helper thread launches and tests
  them, as during a backward), then ``wait``.

``hidden_share`` turns the three into the description's ``comm_overlap``: the model
says a sum launched at once beside a longer compute is exposed by ``h * cpu + (1 -
h) * comm`` (nothing runs past the compute), so ``h = (comm - exposed) / (comm -
cpu)`` with ``exposed = both - compute``, clipped to [0, 1]. Pure, tested without MPI.
"""

from __future__ import annotations

import time

import numpy as np

from hpctrain.plan import cluster as cl

GEMM_N = 256  # the compute loop's products: a transformer block's size here
COMPUTE_OVER_COMM = 2.5  # the compute loop's length against the sum alone


def overlap_times(comm, nbytes: int, bucket_mb: float, repeats: int) -> dict[str, float]:
    """Seconds of compute alone, the sum alone and both together (module docstring):
    each the median over ``repeats`` of the slowest rank. Collective over ``comm``."""
    from mpi4py import MPI

    from hpctrain.bench import timed_on_all_ranks
    from hpctrain.nn.module import Parameter
    from hpctrain.parallel.data import POLL_INTERVAL, GradBuckets, allreduce_launcher

    per = max(1, int(bucket_mb * 2**20) // 4)
    counts = [per] * max(1, nbytes // 4 // per)
    params = [Parameter(np.zeros(n, np.float32)) for n in counts]
    buckets = GradBuckets(params, allreduce_launcher(comm), bucket_mb=bucket_mb,
                          poll_interval=POLL_INTERVAL)
    rng = np.random.default_rng(comm.Get_rank())
    a, b = (rng.standard_normal((GEMM_N, GEMM_N), dtype=np.float32) for _ in "ab")
    c = np.empty_like(a)

    def alone():
        for p in params:
            comm.Allreduce(MPI.IN_PLACE, p.grad, op=MPI.SUM)

    alone()  # warm-up: connections made, pages touched
    comm_s = timed_on_all_ranks(comm, alone, repeats)
    t0 = time.perf_counter()
    np.matmul(a, b, out=c)
    one = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    products = max(1, int(COMPUTE_OVER_COMM * comm_s / max(one, 1e-6)))

    def compute():
        for _ in range(products):
            np.matmul(a, b, out=c)

    compute_s = timed_on_all_ranks(comm, compute, repeats)
    while compute_s < COMPUTE_OVER_COMM * comm_s * 0.8:  # the first product was fast
        products = int(products * COMPUTE_OVER_COMM * comm_s / compute_s) + 1
        compute_s = timed_on_all_ranks(comm, compute, repeats)

    def both():
        buckets.zero()
        buckets.mark_ready(params)  # every bucket final: the helper launches them
        compute()
        buckets.wait()

    both_s = timed_on_all_ranks(comm, both, repeats)
    buckets.release()
    return {"compute_s": compute_s, "comm_s": comm_s, "both_s": both_s,
            "nbytes": float(sum(4 * n for n in counts)), "buckets": float(len(counts)),
            "ranks": float(comm.Get_size())}


def hidden_share(times: dict[str, float], cpu_per_byte: float) -> float:
    """``comm_overlap`` from ``overlap_times``' result and the node's CPU a byte sent
    costs (module docstring). Pure."""
    comm_s, exposed = times["comm_s"], max(0.0, times["both_s"] - times["compute_s"])
    p, buckets = int(times["ranks"]), max(1, int(times["buckets"]))
    cpu = cpu_per_byte * buckets * cl.volume("all_reduce", p, times["nbytes"] / buckets)
    if comm_s <= cpu or comm_s <= 0:
        return 1.0 if exposed <= cpu else 0.0
    return min(1.0, max(0.0, (comm_s - exposed) / (comm_s - cpu)))
