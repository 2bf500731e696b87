"""How a data-parallel sum and the compute beside it slow each other on a node
(``comm_slowdown``, ``compute_slowdown``).

The cost model (``cost.beside``) runs a gradient bucket's sum beside the backward:
while both run, the sum takes ``comm_slowdown`` and the compute ``compute_slowdown``
times as long as each alone. How much depends on the node: MPICH moves a
non-blocking collective only inside MPI calls, made here by the data-parallel helper
thread every millisecond (``parallel.data.GradBuckets``), and over TCP every byte is
copied by a core; a node with half a core (four emulated nodes on two) has little
left for either while it computes. ``overlap_times`` measures it with the engine's
own machinery, every rank at once, one rank a node:

* ``comm``: the gradient buckets (``nbytes`` in buckets of ``bucket_mb``) summed by
  blocking ``Allreduce``s, one after the other (what the description's links price);
* ``compute``: a loop of float32 GEMMs (one BLAS thread) long enough that the sum
  beside it ends inside it (``COMPUTE_OVER_COMM`` times the sum alone, longer if the
  sum did not end inside it);
* ``both``: the same loop while ``GradBuckets`` sums the same buckets, every bucket
  reported final before the first product (its helper thread launches and tests
  them, as during a backward): ``done_s``, when the loop, between two products, first
  sees every bucket reduced, and ``both_s``, when the loop ends.

``group_times`` runs it at every data-group size the nodes divide into, all groups
of a size at once: the factors depend on it (four half-core nodes at 1 Gbit/s, 16
MiB: the sum 4.6 times as long beside the products in groups of two, 2.9 times in
one group of four, alone 0.14 and 0.24 s; done beside them after 0.65 and 0.72 s
alike, as if the node's core set the pace, not the link).

``slowdowns`` turns them into the two factors: ``comm_slowdown = done / comm`` and,
the compute having lost ``both - compute`` seconds while the sum ran beside it for
``done``, ``compute_slowdown = done / (done - (both - compute))``; each at least 1.
Pure, tested without MPI.

Measured on four half-core emulated nodes at 1 Gbit/s (16 and 44 MiB in 4 MiB
buckets): the sum ended 2.6-3.0 times later beside the products than alone, and
the products lost about 0.22 s a second of it (``compute_slowdown`` about 1.3),
alike for both sizes. An earlier form of this measurement saw only how far the
loop ran past its time alone, and so read a sum that ended inside the loop as one
that moved at its full rate.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

GEMM_N = 256  # the compute loop's products: a transformer block's size here
COMPUTE_OVER_COMM = 4.0  # the compute loop's length against the sum alone
TRIES = 3  # lengthen the loop at most this many times for the sum to end inside it


def overlap_times(comm, nbytes: int, bucket_mb: float, repeats: int,
                  lined_up=None) -> dict[str, float]:
    """Seconds of the sum alone, compute alone, and both together (module docstring):
    each the median over ``repeats`` of the slowest rank. Collective over ``comm``, and
    over ``lined_up`` when given (a communicator of which ``comm`` is one group: every
    group starts each run of both together at once and lengthens its loop when any
    group's sum outlasted its own)."""
    from mpi4py import MPI

    from hpctrain.bench import timed_on_all_ranks
    from hpctrain.nn.module import Parameter
    from hpctrain.parallel.data import POLL_INTERVAL, GradBuckets, allreduce_launcher

    per = max(1, int(bucket_mb * 2**20) // 4)
    counts = [per] * max(1, nbytes // 4 // per)
    params = [Parameter(np.zeros(n, np.float32)) for n in counts]
    buckets = GradBuckets(params, allreduce_launcher(comm), bucket_mb=bucket_mb,
                          poll_interval=POLL_INTERVAL)
    if buckets.poll_interval <= 0:
        raise RuntimeError("the overlap measurement needs MPI_THREAD_MULTIPLE (the "
                           "data-parallel helper thread moves the sums)")
    rng = np.random.default_rng(comm.Get_rank())
    a, b = (rng.standard_normal((GEMM_N, GEMM_N), dtype=np.float32) for _ in "ab")
    c = np.empty_like(a)

    def alone():
        for p in params:
            comm.Allreduce(MPI.IN_PLACE, p.grad, op=MPI.SUM)

    alone()  # warm-up: connections made, pages touched
    comm_s = timed_on_all_ranks(comm, alone, repeats)
    t0 = time.perf_counter()
    for _ in range(10):
        np.matmul(a, b, out=c)
    one = comm.allreduce((time.perf_counter() - t0) / 10, op=MPI.MAX)
    products = max(1, int(COMPUTE_OVER_COMM * comm_s / max(one, 1e-6)))

    def loop(watch: bool) -> tuple[float, float]:
        """(seconds to the end, seconds to every bucket seen reduced or inf)."""
        want = len(buckets.buckets)
        done = float("inf")
        t0 = time.perf_counter()
        for _ in range(products):
            np.matmul(a, b, out=c)
            if watch and done == float("inf") and buckets.reduced == want:
                done = time.perf_counter() - t0
        return time.perf_counter() - t0, done

    def both() -> tuple[float, float]:
        buckets.zero()
        buckets.mark_ready(params)  # every bucket final: the helper launches them
        took, done = loop(watch=True)
        buckets.wait()
        return took, done

    for _ in range(TRIES):
        compute_s = timed_on_all_ranks(comm, lambda: loop(watch=False), repeats)
        runs = []
        for _ in range(repeats):
            (lined_up or comm).Barrier()
            mine = np.array(both())
            slowest = np.empty_like(mine)
            comm.Allreduce(mine, slowest, op=MPI.MAX)  # each the slowest rank's
            runs.append(slowest.tolist())
        both_s = statistics.median(r[0] for r in runs)
        done_s = statistics.median(r[1] for r in runs)
        ended = done_s < float("inf")
        if lined_up.allreduce(ended, op=MPI.LAND) if lined_up is not None else ended:
            break
        products *= 2  # the sum outlasted the loop: a longer one
    buckets.release()
    return {"compute_s": compute_s, "comm_s": comm_s, "both_s": both_s, "done_s": done_s,
            "nbytes": float(sum(4 * n for n in counts)), "buckets": float(len(counts)),
            "ranks": float(comm.Get_size())}


def group_sizes(ranks: int) -> list[int]:
    """The data-group sizes ``group_times`` measures on ``ranks`` nodes: every divisor
    from 2, largest first."""
    return [p for p in range(ranks, 1, -1) if ranks % p == 0]


def group_times(comm, nbytes: int, bucket_mb: float, repeats: int) -> dict[int, dict]:
    """``overlap_times`` at every size of ``group_sizes``, ``comm`` cut into groups of
    consecutive ranks that all measure at once (as a layout's data groups sum beside
    each other; ``overlap_times``' ``lined_up``): per size, the times of the group
    whose sum ended last. Collective."""
    out = {}
    for p in group_sizes(comm.Get_size()):
        group = comm.Split(comm.Get_rank() // p, comm.Get_rank()) if p < comm.Get_size() \
            else comm
        times = overlap_times(group, nbytes, bucket_mb, repeats,
                              lined_up=comm if group is not comm else None)
        if group is not comm:
            group.Free()
        out[p] = max(comm.allgather(times), key=lambda t: t["done_s"])
    return out


def slowdowns(times: dict[str, float]) -> tuple[float, float]:
    """``(comm_slowdown, compute_slowdown)`` from ``overlap_times``' result (module
    docstring); a ValueError when the sum did not end inside the loop. Pure."""
    comm_s, done = times["comm_s"], times["done_s"]
    if not done < float("inf") or done <= 0 or comm_s <= 0:
        raise ValueError(f"the sum beside the compute did not end inside it (done_s "
                         f"{done!r}, the sum alone {comm_s!r} s): no slowdown to read")
    lost = max(0.0, times["both_s"] - times["compute_s"])
    if lost >= done:
        raise ValueError(f"the compute lost {lost:.3f} s beside a sum that ran {done:.3f} "
                         f"s: more than the sum's whole time, no slowdown to read")
    return max(1.0, done / comm_s), max(1.0, done / (done - lost))
