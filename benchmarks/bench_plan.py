"""The planner's predictions against measured steps of the benchmark GPT on this machine.

    python benchmarks/bench_plan.py stream --out runs/plan          element-wise rate
    python benchmarks/bench_plan.py measure --out runs/plan         every layout, timed
    python benchmarks/bench_plan.py compare --out runs/plan --cluster FILE.toml
    python benchmarks/bench_plan.py published                       Megatron on Selene

``measure`` runs each layout (``LAYOUTS``) twice as its own MPI job: once timed
(``--steps`` steps, the median ``step_time_s`` after ``--warmup``), once with
``tracemalloc`` (3 steps; the peak of the traced NumPy and Python allocations of each
rank over a steady step, the largest rank's; tracing slows the step, so it is not
timed). ``stream`` measures a rank's element-wise bytes/s (``a + b -> c`` on 64 MiB
float32 arrays, all ranks at once) at 1 and 2 ranks, which ``hpctrain calibrate``
does not; ``compare`` adds it to the cluster description it reads when the file has
none. ``compare`` prints predicted against measured per layout, the median and worst
step-time error, Spearman's rank correlation, and whether the predicted best is the
measured best. ``published`` prints the predictions for Megatron-LM's published runs
on A100 nodes against their published teraFLOP/s per GPU (``hpctrain/plan/published.py``;
``--cluster`` defaults to ``configs/clusters/a100-selene.toml`` there, and
``--gemm-efficiency`` replaces the description's to show how the table moves with it).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = str(ROOT / ".venv/bin/python")
MPIEXEC = str(ROOT / ".venv/bin/mpiexec")

# name -> (ranks, [parallel])
LAYOUTS = {
    "serial": (1, {}),
    "dp2": (2, {"dp": 2}),
    "tp2": (2, {"tp": 2}),
    "tp2-sp": (2, {"tp": 2, "sequence_parallel": True}),
    "pp2-mb2-gpipe": (2, {"pp": 2, "microbatches": 2, "schedule": "gpipe"}),
    "pp2-mb2-1f1b": (2, {"pp": 2, "microbatches": 2, "schedule": "1f1b"}),
    "pp2-mb4-gpipe": (2, {"pp": 2, "microbatches": 4, "schedule": "gpipe"}),
    "pp2-mb4-1f1b": (2, {"pp": 2, "microbatches": 4, "schedule": "1f1b"}),
    "dp2-z1": (2, {"dp": 2, "zero": 1}),
    "dp2-z2": (2, {"dp": 2, "zero": 2}),
}


def layout_config(name: str, steps: int, run_dir: str):
    from hpctrain import config
    from hpctrain.bench import BENCH_CONFIG

    ranks, parallel = LAYOUTS[name]
    raw = copy.deepcopy(BENCH_CONFIG)
    raw["parallel"] = dict(parallel)
    raw["train"] |= {"steps": steps, "run_dir": run_dir}
    raw["data"]["path"] = str(ROOT / raw["data"]["path"])
    return config.from_dict(raw, source=f"bench_plan {name}").validate(ranks)


# ---------------------------------------------------------------------------------
# MPI workers


def worker(name: str, out: str, steps: int, memory: bool) -> None:
    import tracemalloc

    from mpi4py import MPI

    from hpctrain.train import train

    comm = MPI.COMM_WORLD
    tag = "memory" if memory else "time"
    run_dir = str(Path(out) / f"{name}-{tag}")
    cfg = layout_config(name, 3 if memory else steps, run_dir)
    hook = None
    if memory:
        tracemalloc.start()

        def hook():
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.reset_peak()
            return {"peak_bytes_per_rank": comm.allgather(peak)}
    train(cfg, comm, quiet=True, after_step=hook)


def stream_worker(out: str) -> None:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    n = 16 << 20  # 64 MiB of float32 per array
    a, b, c = (np.ones(n, np.float32) for _ in range(3))
    best = float("inf")
    for _ in range(8):
        comm.Barrier()
        t0 = time.perf_counter()
        np.add(a, b, out=c)
        best = min(best, time.perf_counter() - t0)
    rates = comm.gather(3 * 4 * n / best)
    if comm.Get_rank() == 0:
        path = Path(out) / "stream.json"
        got = json.loads(path.read_text()) if path.exists() else {}
        got[str(comm.Get_size())] = statistics.median(rates)
        path.write_text(json.dumps(got, indent=2))


# ---------------------------------------------------------------------------------
# the driver


def launch(ranks: int, args: list[str], timeout: float = 900) -> None:
    cmd = [MPIEXEC, "-n", str(ranks), PY, "-m", "mpi4py", __file__, *args]
    subprocess.run(cmd, check=True, timeout=timeout, cwd=ROOT)


def measure(out: str, steps: int, warmup: int, names: list[str]) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    for name in names:
        ranks = LAYOUTS[name][0]
        load = Path("/proc/loadavg").read_text().split()[0]
        t0 = time.perf_counter()
        launch(ranks, ["worker", name, "--out", out, "--steps", str(steps)])
        launch(ranks, ["worker", name, "--out", out, "--memory"])
        print(f"{name}: {time.perf_counter() - t0:.0f} s (load {load} before)", flush=True)


def measured(out: str, name: str, warmup: int) -> tuple[float, float]:
    from hpctrain.metrics import read_metrics

    steps = [r for r in read_metrics(Path(out) / f"{name}-time" / "metrics.jsonl")
             if "loss" in r and r["step"] > warmup]
    mem = [r for r in read_metrics(Path(out) / f"{name}-memory" / "metrics.jsonl")
           if "loss" in r and r["step"] > 1]
    return (statistics.median(r["step_time_s"] for r in steps),
            max(max(r["peak_bytes_per_rank"]) for r in mem))


def with_stream(cluster, out: str):
    """The cluster, with the measured stream rates if it has none."""
    path = Path(out) / "stream.json"
    if not path.exists():
        return cluster, False
    rates = {int(k): v for k, v in json.loads(path.read_text()).items()}
    kinds = {n: (k if k.stream else replace(k, stream=rates)) for n, k in cluster.kinds.items()}
    return replace(cluster, kinds=kinds), any(not k.stream for k in cluster.kinds.values())


def spearman(x: list[float], y: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for pos, i in enumerate(order):
            r[i] = float(pos)
        return r

    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den


def compare(out: str, cluster_path: str, warmup: int, names: list[str]) -> str:
    from hpctrain.plan.cluster import load_cluster
    from hpctrain.plan.cost import estimate

    cluster, added = with_stream(load_cluster(cluster_path), out)
    rows, pred, meas = [], [], []
    head = ("| layout | ranks | predicted ms | measured ms | error | predicted MiB | "
            "measured MiB | error | largest predicted terms |")
    lines = [head, "|" + "---|" * 9]
    for name in names:
        ranks = LAYOUTS[name][0]
        cfg = layout_config(name, 1, "/tmp/unused")
        e = estimate(cfg, cluster)
        step, peak = measured(out, name, warmup)
        err, merr = e.step_s / step - 1, e.max_memory / peak - 1
        pred.append(e.step_s)
        meas.append(step)
        rows.append((name, err, merr))
        top = sorted(e.shares.items(), key=lambda kv: -kv[1])[:3]
        terms = ", ".join(f"{k} {100 * v:.0f}%" for k, v in top if v > 0.005)
        lines.append(f"| {name} | {ranks} | {1e3 * e.step_s:.0f} | {1e3 * step:.0f} | "
                     f"{100 * err:+.1f}% | {e.max_memory / 2**20:.0f} | {peak / 2**20:.0f} | "
                     f"{100 * merr:+.1f}% | {terms} |")
    errs = [abs(r[1]) for r in rows]
    merrs = [abs(r[2]) for r in rows]
    best_p, best_m = names[pred.index(min(pred))], names[meas.index(min(meas))]
    gap = meas[names.index(best_p)] / min(meas) - 1
    lines += ["", f"step time: median |error| {100 * statistics.median(errs):.1f}%, worst "
              f"{100 * max(errs):.1f}% ({rows[errs.index(max(errs))][0]}); Spearman rank "
              f"correlation {spearman(pred, meas):.3f}; predicted best {best_p}, measured best "
              f"{best_m} (the predicted best measures {100 * gap:.1f}% slower than the best)",
              f"memory: median |error| {100 * statistics.median(merrs):.1f}%, worst "
              f"{100 * max(merrs):.1f}% ({rows[merrs.index(max(merrs))][0]})",
              f"cluster: {cluster_path}" + (f", stream rates from {out}/stream.json"
                                            if added else "")]
    return "\n".join(lines)


def published(cluster_path: str | None, efficiency: float | None) -> str:
    from hpctrain.plan import published as pub
    from hpctrain.plan.cluster import load_cluster

    path = cluster_path or str(ROOT / pub.CLUSTER)
    cluster = load_cluster(path)
    effs = sorted({k.gemm_efficiency for k in cluster.kinds.values()})
    if efficiency is not None:
        kinds = {n: replace(k, gemm_efficiency=efficiency) for n, k in cluster.kinds.items()}
        cluster = replace(cluster, kinds=kinds)
        effs = [efficiency]
    return (f"Megatron-LM on {cluster.name} ({path}), GEMM efficiency {effs}, one practice "
            f"for all rows: {pub.MEGATRON}\n" + pub.report(cluster))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["measure", "compare", "stream", "worker",
                                         "stream-worker", "published"])
    parser.add_argument("layout", nargs="?")
    parser.add_argument("--out", default="runs/plan")
    parser.add_argument("--cluster", default=None,
                        help="default: this-machine.toml (published: a100-selene.toml)")
    parser.add_argument("--gemm-efficiency", type=float, default=None,
                        help="published: replace the description's gemm_efficiency")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    args = parser.parse_args(argv)
    names = args.layouts.split(",")
    if args.what == "worker":
        worker(args.layout, args.out, args.steps, args.memory)
    elif args.what == "stream-worker":
        stream_worker(args.out)
    elif args.what == "stream":
        Path(args.out).mkdir(parents=True, exist_ok=True)
        for ranks in (1, 2):
            launch(ranks, ["stream-worker", "--out", args.out])
        print((Path(args.out) / "stream.json").read_text())
    elif args.what == "published":
        print(published(args.cluster, args.gemm_efficiency))
    elif args.what == "measure":
        measure(args.out, args.steps, args.warmup, names)
    else:
        print(compare(args.out, args.cluster or "configs/clusters/this-machine.toml",
                      args.warmup, names))


if __name__ == "__main__":
    sys.exit(main())
