"""The emulated cluster, measured: links, gradient sync, the benchmark GPT, each node's CPU.

    sudo make bench-cluster          (or: .venv/bin/python benchmarks/bench_cluster.py)

Root: every part brings up its own emulated cluster (``hpctrain cluster``), measures,
and removes it. In one run it prints:

1. **links**: a 16 MiB all-reduce between two nodes (one rank each) at 100 Mbit/s and
   1 Gbit/s: bus bandwidth against the configured link rate, and the bytes that the
   switch ports counted, to show the data crossed the shaped link;
2. **sync**: a data-parallel gradient sync of 16 MiB (4 MiB buckets, hpctrain's
   ``GradBuckets``) flat (one all-reduce over all ranks) against hierarchical (reduce
   in the node, all-reduce among node leaders, broadcast in the node), at 2 and 4
   nodes x 2 ranks on 1 Gbit/s and 100 Mbit/s with ranks placed node by node
   (block), and at 4 nodes with ranks dealt out one per node in turn (cyclic), with
   the bytes each node sent;
3. **gpt**: the benchmark GPT (``hpctrain bench``'s) at dp = 2 on two nodes of one core
   against dp = 2 on one node of two cores, 1 Gbit/s: step time and MFU;
4. **gemm**: each node's float32 GEMM rate on two nodes of one core, the second given
   half of its core.

Bus bandwidth of an all-reduce of ``n`` bytes over ``p`` ranks in ``t`` seconds is
``2 (p - 1) / p * n / t``: the bytes each rank must send, over the time (the figure
NCCL's tests report); for two ranks it is what crossed the link each way.

Every MPI rank waits for its collectives by polling with short sleeps (``POLL_S``)
rather than inside MPI, which busy-polls: eight ranks on two cores otherwise spend the
cores spinning, and the link sits idle while the senders wait for a core.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
POLL_S = 5e-4
RATES = ("100mbit", "1gbit")


# ---------------------------------------------------------------------------------
# workers: run under mpiexec on the cluster's ranks; rank 0 prints one JSON line


def _wait_politely(requests) -> None:
    from mpi4py import MPI

    while not MPI.Request.Testall(requests):
        time.sleep(POLL_S)


def _rx_tx() -> tuple[int, int]:
    """Bytes received and sent on this namespace's eth0 (/proc/net/dev is per namespace)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        if line.strip().startswith("eth0:"):
            fields = line.split(":", 1)[1].split()
            return int(fields[0]), int(fields[8])
    return 0, 0


def worker_allreduce(nbytes: int, repeats: int) -> dict:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    x = np.ones(nbytes // 4, np.float32)
    _wait_politely([comm.Iallreduce(MPI.IN_PLACE, x)])  # connections made, pages touched
    times = []
    sent0 = _rx_tx()[1]
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        _wait_politely([comm.Iallreduce(MPI.IN_PLACE, x)])
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    sent = comm.gather((_rx_tx()[1] - sent0) / repeats)
    p = comm.Get_size()
    t = statistics.median(times)
    return {"seconds": t, "busbw_bps": 8 * 2 * (p - 1) / p * nbytes / t,
            "sent_bytes_per_rank": sent}


def worker_sync(mib: float, reduce: str, repeats: int) -> dict:
    """One gradient sync of ``mib`` MiB in 4 MiB buckets through hpctrain's GradBuckets,
    every bucket reported ready at once (as at the end of a backward)."""
    import numpy as np
    from mpi4py import MPI

    from hpctrain.config import ParallelConfig
    from hpctrain.nn.module import Parameter
    from hpctrain.parallel import data
    from hpctrain.parallel.hierarchy import hierarchical_launcher
    from hpctrain.parallel.topology import Topology

    comm = MPI.COMM_WORLD
    topo = Topology.build(comm, ParallelConfig(dp=comm.Get_size()))
    launch = (data.allreduce_launcher(topo.dp_comm) if reduce == "flat"
              else hierarchical_launcher(topo))
    rng = np.random.default_rng(comm.Get_rank())
    params = [Parameter(rng.standard_normal(int(mib * MiB) // 4 // 8).astype(np.float32))
              for _ in range(8)]
    grads = data.GradBuckets(params, launch, bucket_mb=4.0)
    expected = comm.allreduce(params[0].data[:16].copy())

    def sync():
        grads.zero()
        for p in params:
            p.grad[...] = p.data
        grads.mark_ready(params)  # launches every bucket
        while not grads.test():  # wait with sleeps: see the module docstring
            time.sleep(POLL_S)
        grads.wait()

    sync()
    ok = bool(np.allclose(params[0].grad[:16], expected, rtol=1e-5))
    times, sent0 = [], _rx_tx()[1]
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        sync()
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    sent = comm.gather((_rx_tx()[1] - sent0) / repeats)
    return {"seconds": statistics.median(times), "correct": comm.allreduce(ok, op=MPI.LAND),
            "sent_bytes_per_rank": sent}


def worker_gemm(seconds: float) -> dict:
    """This process's sustained float32 GEMM rate: products done over ``seconds`` of wall
    time. (One product's rate would not show a CPU cap: the CFS quota lets a node run
    at full speed for its share of every 100 ms period, then stops it.)"""
    import numpy as np

    from hpctrain.bench import GemmProbe

    probe = GemmProbe(1024)
    probe.rate(repeats=1)  # warm-up
    products, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        np.matmul(probe.a, probe.b, out=probe.out)
        products += 1
    elapsed = time.perf_counter() - t0
    return {"gflops": products * 2.0 * probe.n**3 / elapsed / 1e9,
            "best_product_gflops": probe.rate(repeats=3) / 1e9, "products": products}


def worker_main(kind: str, args: list[str]) -> None:
    from mpi4py import MPI

    if kind == "allreduce":
        result = worker_allreduce(int(args[0]), int(args[1]))
    elif kind == "sync":
        result = worker_sync(float(args[0]), args[1], int(args[2]))
    else:
        result = worker_gemm(float(args[0]))
    if MPI.COMM_WORLD.Get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------
# the driver (root): one cluster per scenario


def _spec(nodes: int, link: str, name: str = "hpctb", **node):
    from hpctrain.cluster import spec as spec_mod

    return spec_mod.build({"name": name, "subnet": "10.217.0.0/24", "link": link,
                           "nodes": [{"count": nodes, "cores": 1, **node}]})


def _run(cmd: list[str], timeout: float = 1200) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def _mpi(cl, kind: str, *args, ranks_per_node: int, placement: str = "block") -> dict:
    from hpctrain.testing import mpiexec

    argv = [sys.executable, __file__, "--worker", kind, *map(str, args)]
    return _run(cl.mpiexec_command(argv, ranks_per_node=ranks_per_node, mpiexec=mpiexec(),
                                   placement=placement))


def bench_links(repeats: int, log) -> list[dict]:
    from hpctrain.cluster import lifecycle, net
    from hpctrain.cluster.spec import parse_rate

    rows = []
    for link in RATES:
        with lifecycle.running(_spec(2, link), log=lambda _: None) as cl:
            before = [net.link_bytes(cl.spec, n)[0] for n in cl.spec.nodes]
            r = _mpi(cl, "allreduce", 16 * MiB, repeats, ranks_per_node=1)
            crossed = [net.link_bytes(cl.spec, n)[0] - b
                       for n, b in zip(cl.spec.nodes, before, strict=True)]
        rate = parse_rate(link)
        rows.append({"link": link, "link_bps": rate, "seconds": r["seconds"],
                     "busbw_bps": r["busbw_bps"], "of_link": r["busbw_bps"] / rate,
                     "port_bytes_per_node": crossed, "repeats": repeats,
                     "sent_bytes_per_rank": r["sent_bytes_per_rank"]})
        log(f"   links {link}: {r['busbw_bps'] / 1e6:.0f} Mbit/s bus bandwidth, "
            f"{100 * r['busbw_bps'] / rate:.1f}% of the link")
    return rows


def bench_sync(repeats: int, log) -> list[dict]:
    """Flat against hierarchical, interleaved twice each, the faster run of each kept;
    block placement at 2 and 4 nodes, and cyclic placement at 4 nodes."""
    from hpctrain.cluster import lifecycle

    rows = []
    for link in reversed(RATES):
        for nodes, placement in ((2, "block"), (4, "block"), (4, "cyclic")):
            with lifecycle.running(_spec(nodes, link), log=lambda _: None) as cl:
                times = {}
                for reduce in ("flat", "hierarchical", "flat", "hierarchical"):
                    r = _mpi(cl, "sync", 16, reduce, repeats, ranks_per_node=2,
                             placement=placement)
                    if not r["correct"]:
                        raise RuntimeError(f"{reduce} sync gave a wrong sum")
                    times.setdefault(reduce, []).append(r)
            row = {"link": link, "nodes": nodes, "placement": placement, "ranks_per_node": 2,
                   "mib": 16}
            for reduce, runs in times.items():
                row[f"{reduce}_s"] = min(x["seconds"] for x in runs)
                row[f"{reduce}_runs_s"] = [x["seconds"] for x in runs]
                row[f"{reduce}_sent_bytes_per_rank"] = runs[-1]["sent_bytes_per_rank"]
            row["speedup"] = row["flat_s"] / row["hierarchical_s"]
            rows.append(row)
            log(f"   sync {nodes} nodes x 2 ({placement}) at {link}: flat {row['flat_s']:.2f} s"
                f", hierarchical {row['hierarchical_s']:.2f} s ({row['speedup']:.2f}x)")
    return rows


def bench_gpt(steps: int, data: str, out: Path, log) -> list[dict]:
    from hpctrain.cluster import lifecycle
    from hpctrain.testing import mpiexec

    rows = []
    shapes = [("2 nodes x 1 core", _spec(2, "1gbit")),
              ("1 node x 2 cores", _spec(1, "1gbit", cores=2))]
    for label, spec in shapes:
        with lifecycle.running(spec, log=lambda _: None) as cl:
            folder = out / ("gpt-two-nodes" if len(spec.nodes) == 2 else "gpt-one-node")
            argv = [sys.executable, "-m", "mpi4py", "-m", "hpctrain.bench", "dp2", "--data",
                    data, "--steps", str(steps), "--out", str(folder)]
            cmd = cl.mpiexec_command(argv, ranks_per_node=2 // len(spec.nodes),
                                     mpiexec=mpiexec())
            env = {k: v for k, v in os.environ.items()
                   if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}  # ranks choose
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env,
                                  cwd=ROOT)
            if proc.returncode != 0:
                raise RuntimeError(f"the GPT on {label} failed:\n{proc.stderr[-3000:]}")
        r = json.loads((folder / "dp2.json").read_text())
        rows.append({"shape": label, "step_time_s": r["step_time_s"], "mfu": r["mfu"],
                     "tokens_per_s": r["tokens_per_s"], "dp_comm_s": r["time_s"]["dp_comm"],
                     "peak_gflops": r["peak_flops_per_s"] / 1e9})
        log(f"   gpt dp2 on {label}: {1e3 * r['step_time_s']:.0f} ms/step, "
            f"MFU {100 * r['mfu']:.1f}%")
    return rows


def bench_gemm(seconds: float, log) -> list[dict]:
    from hpctrain.cluster import lifecycle
    from hpctrain.cluster import spec as spec_mod

    spec = spec_mod.build({"name": "hpctb", "subnet": "10.217.0.0/24",
                           "nodes": [{"count": 1, "cpu_share": 1.0},
                                     {"count": 1, "cpu_share": 0.5}]})
    rows = []
    with lifecycle.running(spec, log=lambda _: None) as cl:
        for n in spec.nodes:
            r = _run(cl.node_command(n.hostname, [sys.executable, __file__, "--worker", "gemm",
                                                  str(seconds)]))
            rows.append({"node": n.hostname, "cpu_share": n.cpu_share, **r})
            log(f"   gemm {n.hostname} (share {n.cpu_share}): {r['gflops']:.1f} GFLOP/s "
                f"sustained, {r['best_product_gflops']:.1f} in its best product")
    return rows


def report(results: dict) -> str:
    lines = []
    if results.get("links"):
        lines += ["links: 16 MiB all-reduce, 2 nodes x 1 rank",
                  f"  {'link':>8} {'busbw Mbit/s':>13} {'of link':>8} {'port MB/node':>13}"]
    for r in results.get("links", []):
        lines.append(f"  {r['link']:>8} {r['busbw_bps'] / 1e6:>13.0f} {100 * r['of_link']:>7.1f}% "
                     f"{statistics.fmean(r['port_bytes_per_node']) / 1e6:>13.1f}")
    if results.get("sync"):
        lines += ["", "sync: 16 MiB of gradients in 4 MiB buckets, 2 ranks per node",
                  f"  {'link':>8} {'nodes':>5} {'ranks':>7} {'flat s':>8} {'hier. s':>8} "
                  f"{'speed-up':>9} {'flat MB/node':>13} {'hier. MB/node':>14}"]
        for r in results["sync"]:
            flat = sum(r["flat_sent_bytes_per_rank"]) / r["nodes"] / 1e6
            hier = sum(r["hierarchical_sent_bytes_per_rank"]) / r["nodes"] / 1e6
            lines.append(f"  {r['link']:>8} {r['nodes']:>5} {r['placement']:>7} "
                         f"{r['flat_s']:>8.2f} {r['hierarchical_s']:>8.2f} "
                         f"{r['speedup']:>8.2f}x {flat:>13.1f} {hier:>14.1f}")
    if results.get("gpt"):
        lines += ["", "gpt: the benchmark GPT at dp = 2, 1 Gbit/s",
                  f"  {'shape':<18} {'ms/step':>8} {'MFU':>6} {'dp_comm s':>10}"]
        for r in results["gpt"]:
            lines.append(f"  {r['shape']:<18} {1e3 * r['step_time_s']:>8.0f} "
                         f"{100 * r['mfu']:>5.1f}% {r['dp_comm_s']:>10.3f}")
    if results.get("gemm"):
        lines += ["", "gemm: float32 1024^3 products on each node, sustained over 4 s "
                      "(and the best single product)"]
        for r in results["gemm"]:
            lines.append(f"  {r['node']:<10} cpu_share {r['cpu_share']:.2f}: "
                         f"{r['gflops']:6.1f} GFLOP/s ({r['best_product_gflops']:.1f})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/bench-cluster", help="folder for the JSON")
    parser.add_argument("--parts", default="links,sync,gpt,gemm",
                        help="comma-separated parts to run (links, sync, gpt, gemm)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per figure")
    parser.add_argument("--gpt-steps", type=int, default=8, help="GPT steps (2 warm-up)")
    parser.add_argument("--data", default="data/shakespeare.h5", help="tokens for the GPT")
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args.worker[0], args.worker[1:])
        return
    if os.geteuid() != 0:
        sys.exit("bench_cluster.py builds emulated clusters: run it as root (sudo)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    results: dict = {"repeats": args.repeats}
    parts = args.parts.split(",")
    t0 = time.perf_counter()
    if "links" in parts:
        results["links"] = bench_links(args.repeats, log)
    if "sync" in parts:
        results["sync"] = bench_sync(args.repeats, log)
    if "gpt" in parts:
        results["gpt"] = bench_gpt(args.gpt_steps, args.data, out, log)
    if "gemm" in parts:
        results["gemm"] = bench_gemm(4.0, log)
    results["seconds"] = time.perf_counter() - t0
    (out / "bench-cluster.json").write_text(json.dumps(results, indent=2))
    print(report(results))
    print(f"\n{results['seconds']:.0f} s; figures in {out / 'bench-cluster.json'}")


if __name__ == "__main__":
    main()
