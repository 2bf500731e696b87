"""The parallel-scan backward against the ordinary chained backward, by depth and width.

    mpiexec -n 2 python benchmarks/bench_scan_backward.py        # pp = 2
    mpiexec -n 4 python benchmarks/bench_scan_backward.py        # pp = 4

Every rank is one pipeline stage (pp = the number of ranks) of a deep narrow MLP
(``scan_backward.build_chain``: ``depth`` blocks of Linear(w, w) + GELU, float64),
``--batch`` samples as one microbatch. For each width and depth, ``--repeats`` times
and the methods interleaved: a forward, a barrier, then the timed backward, either
"chain" (the ordinary pipelined backward: stage s waits for s + 1's input gradient,
pp - 1 messages in a row) or "scan" (Jacobians, ceil(log2 pp) rounds, local
backward). After the barrier the scan's Jacobians are on the clock in full (in
``step`` they overlap the later stages' forward). Two figures per method, medians:

* wall: from the barrier to the last rank's end (the ranks share one machine's
  monotonic clock). With more ranks than cores and other jobs running, noisy.
* replay: the backward rebuilt from each rank's CPU seconds per phase (thread time
  around the compute only, not the waits: MPICH polls while it waits), as if every
  stage had its own core and messages were free: chain = sum of the stages'
  backwards; scan = max(last stage's backward, slowest Jacobian) + slowest
  combines + slowest local backward. This is the figure to compare across loads.

It prints the matrix-multiply FLOPs of each backward (critical path and total work,
``scan_backward.flop_counts``) and, per width, the depths where the scan wins, and
draws ``--out`` (default ``runs/bench-scan-backward/time-vs-depth.png``): replayed
and wall time against depth, one panel per width, chain and scan, the crossover
depth (where the replayed scan/chain ratio crosses 1, interpolated on log depth)
marked when it lies inside the measured range.

One microbatch, not a 1F1B pipeline of many: the scan shortens the latency of one
backward; with many microbatches a 1F1B schedule keeps every stage busy anyway and
the Jacobians would be pure extra work.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hpctrain.parallel.scan_backward import (
    backward,
    build_chain,
    flop_counts,
    forward,
    split_stages,
)


def timed_backward(comm, stages, x, t, method) -> tuple[float, float]:
    """(wall seconds of the backward, its replayed critical path in CPU seconds)."""
    fwd = forward(stages, x, t, comm)
    phases: dict[str, float] = {}
    comm.Barrier()
    t0 = time.perf_counter()
    backward(stages, fwd, comm, method, phases)
    t1 = time.perf_counter()
    wall = comm.allreduce(t1, op=MPI.MAX) - comm.allreduce(t0, op=MPI.MIN)
    every = comm.allgather(phases)
    if method == "chain":
        replay = sum(p["backward"] for p in every)
    else:
        *first, last = every
        replay = (max([last["backward"]] + [p.get("jacobian", 0.0) for p in first])
                  + max(p.get("combine", 0.0) for p in every)
                  + max(p["backward"] for p in first))
    return wall, replay


def measure(comm, depth, width, batch, repeats, seed=0):
    pp = comm.Get_size()
    stages = split_stages(build_chain(depth, width, seed=seed), pp, width)
    rng = np.random.default_rng(seed)
    x, t = rng.standard_normal((batch, width)), rng.integers(0, width, batch)
    times: dict[str, list[tuple[float, float]]] = {"chain": [], "scan": []}
    for r in range(repeats + 1):  # the first round warms up
        for method, out in times.items():
            got = timed_backward(comm, stages, x, t, method)
            if r:
                out.append(got)
    return {k: np.median(np.array(v), axis=0) for k, v in times.items()}


def crossover(depths: list[int], ratios: list[float]) -> float | None:
    """The depth where scan/chain crosses 1, interpolated on log2 depth; None if never."""
    for k in range(len(depths) - 1):
        (d0, r0), (d1, r1) = (depths[k], ratios[k]), (depths[k + 1], ratios[k + 1])
        if (r0 - 1) * (r1 - 1) <= 0 and r0 != r1:
            f = (1 - r0) / (r1 - r0)
            return 2 ** (math.log2(d0) + f * (math.log2(d1) - math.log2(d0)))
    return None


def plot(rows: list[dict], pp: int, batch: int, out: Path) -> Path:
    """Time against depth, one panel per width: chain and scan, replay and wall."""
    from hpctrain.plot import _pyplot, _save

    plt = _pyplot()
    widths = list(dict.fromkeys(r["width"] for r in rows))
    fig, axes = plt.subplots(1, len(widths), figsize=(5.2 * len(widths), 4.2), squeeze=False)
    for ax, width in zip(axes[0], widths, strict=True):
        mine = [r for r in rows if r["width"] == width]
        depths = [r["depth"] for r in mine]
        for method, colour in (("chain", "tab:blue"), ("scan", "tab:orange")):
            ax.plot(depths, [r[f"{method}_replay_ms"] for r in mine], "-o", color=colour,
                    label=f"{method}: replay (own core each)")
            ax.plot(depths, [r[f"{method}_wall_ms"] for r in mine], ":", color=colour,
                    label=f"{method}: wall")
        cross = crossover(depths, [r["scan_replay_ms"] / r["chain_replay_ms"] for r in mine])
        if cross is not None:
            ax.axvline(cross, color="grey", ls="--", lw=1)
            ax.text(cross, ax.get_ylim()[1] * 0.5, f" crossover ~{cross:.0f}", color="grey")
        wins = all(r["scan_replay_ms"] < r["chain_replay_ms"] for r in mine)
        ax.set_title(f"width {width}: " + ("no crossover, scan faster at every depth" if
                     wins and cross is None else "no crossover, chain faster at every depth"
                     if cross is None else "crossover marked"), fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("depth (Linear + GELU blocks)")
        ax.set_ylabel("backward time (ms)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(f"exact backward: parallel scan vs chained, pp = {pp}, batch {batch}, float64")
    fig.tight_layout()
    return _save(fig, plt, out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--widths", default="8,64", help="comma-separated layer widths")
    ap.add_argument("--depths", default="16,32,64,128,256",
                    help="comma-separated depths (Linear+GELU blocks; multiples of pp)")
    ap.add_argument("--batch", type=int, default=32, help="samples in the microbatch")
    ap.add_argument("--repeats", type=int, default=9, help="timed backwards per case")
    ap.add_argument("--out", default="runs/bench-scan-backward/time-vs-depth.png",
                    help="the PNG of time against depth (rank 0 writes it)")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    pp, root = comm.Get_size(), comm.Get_rank() == 0
    widths = [int(w) for w in args.widths.split(",")]
    depths = [int(d) for d in args.depths.split(",")]
    if root:
        print(f"pp = {pp}, batch {args.batch}, float64, median of {args.repeats}; "
              f"load average {os.getloadavg()[0]:.2f} at start")
        print("               wall ms               replay ms             MFLOP: path"
              "        scan work")
        print(f"{'width':>5} {'depth':>5}  {'chain':>6} {'scan':>6} {'ratio':>5}   {'chain':>6} "
              f"{'scan':>6} {'ratio':>5}   {'chain':>7} {'scan':>7}   {'':>7}")
    rows = []
    for width in widths:
        wins = []
        for depth in depths:
            m = measure(comm, depth, width, args.batch, args.repeats)
            (cw, cr), (sw, sr) = 1e3 * m["chain"], 1e3 * m["scan"]
            rows.append({"width": width, "depth": depth, "chain_wall_ms": cw,
                         "scan_wall_ms": sw, "chain_replay_ms": cr, "scan_replay_ms": sr})
            f = {k: v / 1e6 for k, v in flop_counts(depth, width, pp, args.batch).items()}
            if sr < 0.9 * cr:  # a margin: replays of equal work differ by a few %
                wins.append(depth)
            if root:
                print(f"{width:5d} {depth:5d}  {cw:6.2f} {sw:6.2f} {sw / cw:5.2f}   {cr:6.2f} "
                      f"{sr:6.2f} {sr / cr:5.2f}   {f['chain_path']:7.2f} {f['scan_path']:7.2f}"
                      f"   {f['scan_work']:7.2f}", flush=True)
        if root:
            print(f"width {width}: the scan's replayed backward is >10% faster at depths "
                  f"{wins or 'none'}")
    if root:
        print(f"load average {os.getloadavg()[0]:.2f} at the end")
        print(f"plot: {plot(rows, pp, args.batch, Path(args.out))}")


if __name__ == "__main__":
    main()
