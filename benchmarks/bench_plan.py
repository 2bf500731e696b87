"""The planner's predictions against measured steps of the benchmark GPT on this machine.

    python benchmarks/bench_plan.py stream --out runs/plan          element-wise rate
    python benchmarks/bench_plan.py measure --out runs/plan --rounds 3  every layout, timed
    python benchmarks/bench_plan.py compare --out runs/plan --cluster FILE.toml
    python benchmarks/bench_plan.py published                       Megatron on Selene
    python benchmarks/bench_plan.py scale                           the planner's own speed

    across emulated nodes (root): describe the cluster, run its layouts, compare
    sudo .venv/bin/hpctrain calibrate --emulated 2:1gbit \
        --out configs/clusters/emulated-2x1gbit.toml
    sudo .venv/bin/python benchmarks/bench_plan.py measure --nodes 2 --link 1gbit \
        --out runs/plan-emu2
    python benchmarks/bench_plan.py compare --nodes 2 --out runs/plan-emu2 \
        --cluster configs/clusters/emulated-2x1gbit.toml

``measure`` runs each layout (``LAYOUTS``) as its own MPI job, timed (``--steps``
steps, the median ``step_time_s`` after ``--warmup``) in each of ``--rounds`` rounds,
and once with
``tracemalloc`` (3 steps; the peak of the traced NumPy and Python allocations of each
rank over a steady step, the largest rank's; tracing slows the step, so it is not
timed). ``stream`` measures a rank's element-wise bytes/s (``a + b -> c`` on 64 MiB
float32 arrays, all ranks at once, the median of 8 samples of 40 passes) at 1 and 2
ranks, which ``hpctrain calibrate`` does not; ``compare`` adds it to the cluster
description it reads when the file has none. A round visits every layout, in turn,
the next round in the reverse order: this machine drifts by 3-10% from one minute to
the next, more than layouts lie apart, so one pass orders close layouts by when they
ran; over rounds each layout's time is the median of its rounds' medians, and the
rounds' range is printed beside it. ``compare`` prints predicted against
measured per layout, the median and worst step-time error, Spearman's rank
correlation, whether the predicted best is the measured best, and which layout
``hpctrain plan`` itself chooses among every valid one (the layouts of each run
include its choices) and where that layout measured.
``measure --nodes N`` brings up ``N`` one-core nodes (``hpctrain cluster``: links
shaped at ``--link``, UCX over TCP on them), runs ``ON_NODES[N]`` one rank a node (one
BLAS thread; serial on the first node alone) and removes the cluster; ``load.json``
keeps, per layout, the load average before and after, the bytes node 0 sent over its
link and the cores each node got. Before each timed run a probe (``probe_worker``, 10
s) measures the nodes' GEMM and stream rates as the calibration does, shorter, into
``probe.json``; ``compare`` then also predicts every layout at the probed rates (the
medians over the run), which tells the machine's drift since the calibration from the
model's error.
``compare --nodes N`` compares those layouts, serial against the description cut to
one node. ``published`` prints the predictions for published runs on A100 nodes
(Megatron-LM's and BLOOM's: three studies, two machines) against their teraFLOP/s per GPU
(``hpctrain/plan/published.py``;
``--cluster`` defaults to ``configs/clusters/a100-selene.toml`` there, and
``--gemm-efficiency`` replaces the description's to show how the table moves with it,
``--intra-bandwidth`` the NVLink bandwidth of every collective inside a node), then
the same rows with one GEMM efficiency calibrated on the least parallel run and every
other row predicted from it.
``scale`` times the planner itself (issue targets: every layout of 4,096 ranks on a
two-kind cluster in under 10 s on one core; the chosen plan's per-rank timeline at
1,024 ranks in under 5 s): the enumeration of a 48-layer d_model-4096 GPT on 32 + 32
nodes of two kinds (64 cores each), and, for the README's worked example at 1,024
ranks, the enumeration and then the chosen layout's estimate with its pipeline
schedule replayed, from a cold cache. Run it with one BLAS thread on an idle core.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
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
    "serial-split": (1, {"batch_threads": 0}),  # its batch over the rank's threads
    "dp2": (2, {"dp": 2}),
    "tp2": (2, {"tp": 2}),
    "tp2-sp": (2, {"tp": 2, "sequence_parallel": True}),
    "pp2-mb2-gpipe": (2, {"pp": 2, "microbatches": 2, "schedule": "gpipe"}),
    "pp2-mb2-1f1b": (2, {"pp": 2, "microbatches": 2, "schedule": "1f1b"}),
    "pp2-mb4-gpipe": (2, {"pp": 2, "microbatches": 4, "schedule": "gpipe"}),
    "pp2-mb4-1f1b": (2, {"pp": 2, "microbatches": 4, "schedule": "1f1b"}),
    "dp2-z1": (2, {"dp": 2, "zero": 1}),
    "dp2-z2": (2, {"dp": 2, "zero": 2}),
    # the planner's own leaders on 2 nodes (pipelines of 8 microbatches, interleaved),
    # and the stages it prices last
    "pp2-mb8-1f1b": (2, {"pp": 2, "microbatches": 8, "schedule": "1f1b"}),
    "pp2-mb8-int-v3": (2, {"pp": 2, "microbatches": 8, "schedule": "interleaved",
                           "virtual_stages": 3}),
    "pp2-mb4-int-v3": (2, {"pp": 2, "microbatches": 4, "schedule": "interleaved",
                           "virtual_stages": 3}),
    "dp2-mb2": (2, {"dp": 2, "microbatches": 2}),
    "dp2-z3": (2, {"dp": 2, "zero": 3}),
    # four ranks (the emulated cluster's 4 nodes)
    "dp4": (4, {"dp": 4}),
    "dp4-z1": (4, {"dp": 4, "zero": 1}),
    "dp4-z2": (4, {"dp": 4, "zero": 2}),
    "pp4-mb4-gpipe": (4, {"pp": 4, "microbatches": 4, "schedule": "gpipe"}),
    "pp4-mb4-1f1b": (4, {"pp": 4, "microbatches": 4, "schedule": "1f1b"}),
    "pp4-mb8-1f1b": (4, {"pp": 4, "microbatches": 8, "schedule": "1f1b"}),
    "dp2-pp2-mb2-1f1b": (4, {"dp": 2, "pp": 2, "microbatches": 2, "schedule": "1f1b"}),
    "tp2-dp2": (4, {"tp": 2, "dp": 2}),
    "tp2-dp2-sp": (4, {"tp": 2, "dp": 2, "sequence_parallel": True}),
    "tp2-pp2-mb4-1f1b": (4, {"tp": 2, "pp": 2, "microbatches": 4, "schedule": "1f1b"}),
    # the planner's leaders on 4 nodes (data-parallel interleaved pipelines), and
    # layouts across the rest of its order, to its slowest
    "dp2-pp2-mb4-int-v3": (4, {"dp": 2, "pp": 2, "microbatches": 4,
                               "schedule": "interleaved", "virtual_stages": 3}),
    "dp2-pp2-mb2-int-v3": (4, {"dp": 2, "pp": 2, "microbatches": 2,
                               "schedule": "interleaved", "virtual_stages": 3}),
    "dp2-pp2-mb4-int-v3-z1": (4, {"dp": 2, "pp": 2, "microbatches": 4, "zero": 1,
                                  "schedule": "interleaved", "virtual_stages": 3}),
    "dp2-pp2-mb4-1f1b": (4, {"dp": 2, "pp": 2, "microbatches": 4, "schedule": "1f1b"}),
    "dp4-mb2": (4, {"dp": 4, "microbatches": 2}),
    "tp2-dp2-mb2": (4, {"tp": 2, "dp": 2, "microbatches": 2}),
    "tp2-pp2-mb8-int-v3-sp": (4, {"tp": 2, "pp": 2, "microbatches": 8,
                                  "schedule": "interleaved", "virtual_stages": 3,
                                  "sequence_parallel": True}),
    "tp2-dp2-z3": (4, {"tp": 2, "dp": 2, "zero": 3}),
    "dp4-z3": (4, {"dp": 4, "zero": 3}),
    "pp4-mb2-1f1b": (4, {"pp": 4, "microbatches": 2, "schedule": "1f1b"}),
}
# the layouts of each run: on this machine, and on N emulated one-core nodes (one rank
# a node; serial runs on the first node alone)
ON_THIS_MACHINE = [n for n, (ranks, _) in LAYOUTS.items() if ranks <= 2]
ON_NODES = {2: [n for n in ON_THIS_MACHINE if n != "serial-split"],  # one core: no split
            4: [n for n, (ranks, _) in LAYOUTS.items() if ranks == 4]}
CLUSTER_NAME, SUBNET = "hpctplan", "10.224.0.0/24"  # the emulated runs' cluster and switch


def layout_config(name: str, steps: int, run_dir: str, threads: int = 0):
    """The benchmark GPT at layout ``name``; ``threads``: BLAS and element-wise threads
    a rank (0: the default, the node's cores over its ranks)."""
    from hpctrain import config
    from hpctrain.bench import BENCH_CONFIG

    ranks, parallel = LAYOUTS[name]
    raw = copy.deepcopy(BENCH_CONFIG)
    raw["parallel"] = dict(parallel)
    raw["train"] |= {"steps": steps, "run_dir": run_dir}
    if threads:
        raw["train"] |= {"blas_threads": threads, "row_threads": threads}
    raw["data"]["path"] = str(ROOT / raw["data"]["path"])
    return config.from_dict(raw, source=f"bench_plan {name}").validate(ranks)


# ---------------------------------------------------------------------------------
# MPI workers


def read_json(path: Path) -> dict:
    """A result file of the run folder (``load.json``, ``stream.json``, ``probe.json``),
    or {} before the first result."""
    return json.loads(path.read_text()) if path.exists() else {}


def run_dir_of(out: str, name: str, tag: str, round_: int = 1) -> Path:
    """Where a worker's run writes: ``{name}-memory``, ``{name}-time`` (round 1) and
    ``{name}-time-rK`` (round K > 1)."""
    return Path(out) / (f"{name}-{tag}" + (f"-r{round_}" if round_ > 1 else ""))


def worker(name: str, out: str, steps: int, memory: bool, threads: int = 0,
           round_: int = 1) -> None:
    import tracemalloc

    from mpi4py import MPI

    from hpctrain.nn import kernels
    from hpctrain.train import train

    comm = MPI.COMM_WORLD
    run_dir = str(run_dir_of(out, name, "memory" if memory else "time", round_))
    cfg = layout_config(name, 3 if memory else steps, run_dir, threads)
    hook = None
    if memory:
        kernels.load(cfg.model.dtype)  # numba's code loaded before tracing, as train does
        tracemalloc.start()

        def hook():
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.reset_peak()
            return {"peak_bytes_per_rank": comm.allgather(peak)}
    train(cfg, comm, quiet=True, after_step=hook)


def stream_worker(out: str) -> None:
    from mpi4py import MPI

    from hpctrain.plan.calibrate import stream_rates

    comm = MPI.COMM_WORLD
    # sustained: the median of 8 samples of 40 passes (``calibrate --emulated``'s); the
    # best single pass read 19 and 34 GB/s a rank at 2 ranks on two runs of one day
    rates = stream_rates(comm, sustained=True)
    if comm.Get_rank() == 0:
        path = Path(out) / "stream.json"
        got = read_json(path)
        got[str(comm.Get_size())] = statistics.median(rates)
        path.write_text(json.dumps(got, indent=2))


PROBE_SIZES = (256, 1024)  # the probe's GEMM sizes: attention's and the MLP's range


def probe_worker(out: str, tag: str) -> None:
    """The nodes' compute rates now: a short form of the calibration's GEMM (operands
    from memory, ``PROBE_SIZES``, the median of 3 sustained samples) and stream (3
    samples) on every rank at once, medians over ranks into ``probe.json`` under
    ``tag``. ``measure`` runs it just before each layout's timed run, so that
    ``compare`` can tell the machine's drift since the calibration from the model's
    error."""
    from mpi4py import MPI

    from hpctrain.plan.calibrate import gemm_rates, stream_rates

    comm = MPI.COMM_WORLD
    gemm = gemm_rates(comm, list(PROBE_SIZES), 3, sustained=True)
    stream = stream_rates(comm, repeats=3, sustained=True)
    if comm.Get_rank() == 0:
        path = Path(out) / "probe.json"
        got = read_json(path)
        got[tag] = {"gemm": {str(n): statistics.median(r) for n, r in gemm.items()},
                    "stream": statistics.median(stream)}
        path.write_text(json.dumps(got, indent=2))


def probe_tag(name: str, round_: int) -> str:
    return f"{name}-r{round_}"


def probe_layout(tag: str) -> str:
    """The layout a ``probe_tag`` names."""
    return tag.rsplit("-r", 1)[0]


def drop_probes(out: str, names: list[str]) -> None:
    """Remove from ``probe.json`` every probe of ``names``: ``measure`` runs them again
    (on a cluster with probes of its own, on this machine without)."""
    path = Path(out) / "probe.json"
    if path.exists():
        kept = {k: v for k, v in read_json(path).items() if probe_layout(k) not in names}
        path.write_text(json.dumps(kept, indent=2))


def drift(cluster, probes: dict, names: list[str]) -> tuple[float, float, int] | None:
    """How the one-rank-a-node GEMM and stream rates probed beside the timed runs of
    ``names`` compare with ``cluster``'s description: (GEMM factor, stream factor,
    probes), each factor the median over every probe of those layouts (the GEMM's per
    probe the geometric mean over ``PROBE_SIZES`` of probed over described); None
    without probes. Pooled over the run, not per layout: one probe of 3 samples reads
    +-10% from the next, more than the run drifted from its first probe to its last
    (2026-12-07: 57 probes over 37 minutes, no trend)."""
    if len(cluster.kinds) != 1:  # the emulated nodes are of one kind
        return None
    kind = next(iter(cluster.kinds.values()))
    table = dict(kind.gemm.get(1, ()))
    got = [v for k, v in sorted(probes.items()) if probe_layout(k) in names]
    if not got or any(n not in table for n in PROBE_SIZES) or 1 not in (kind.stream or {}):
        return None
    gemm = [statistics.geometric_mean([p["gemm"][str(n)] / table[n] for n in PROBE_SIZES])
            for p in got]
    stream = [p["stream"] / kind.stream[1] for p in got]
    return statistics.median(gemm), statistics.median(stream), len(got)


def scaled(cluster, gemm: float, stream: float):
    """``cluster`` with every node kind's GEMM tables times ``gemm`` and its stream rates
    times ``stream``: the description at the rates the machine ran at."""
    def times(tables, f):
        return None if tables is None else {r: tuple((n, f * v) for n, v in t)
                                            for r, t in tables.items()}

    kinds = {n: replace(k, gemm=times(k.gemm, gemm), gemm_cached=times(k.gemm_cached, gemm),
                        stream=None if k.stream is None else
                        {r: stream * v for r, v in k.stream.items()})
             for n, k in cluster.kinds.items()}
    return replace(cluster, kinds=kinds)


# ---------------------------------------------------------------------------------
# the driver


def launch(ranks: int, args: list[str], timeout: float = 900, cluster=None) -> None:
    """``ranks`` ranks of this script's ``args`` on this machine, or one a node on the
    first ``ranks`` nodes of an emulated ``cluster`` (``lifecycle.Cluster``)."""
    argv = [PY, "-m", "mpi4py", __file__, *args]
    if cluster is None:
        cmd = [MPIEXEC, "-n", str(ranks), *argv]
    else:
        cmd = cluster.mpiexec_command(argv + ["--threads", "1"], ranks_per_node=1,
                                      ranks=ranks, mpiexec=MPIEXEC)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"} \
        if cluster else None
    subprocess.run(cmd, check=True, timeout=timeout, cwd=ROOT, env=env)


def measure(out: str, steps: int, warmup: int, names: list[str], cluster=None,
            rounds: int = 1) -> None:
    """Each layout timed in each of ``rounds`` rounds (every layout in turn, the order
    reversed from one round to the next), and traced for memory in the first; on a
    cluster each timed run follows a probe of the nodes' rates (``probe_worker``);
    ``load.json`` records the 1-minute load average before and after each layout's
    runs (and on a cluster what node 0's switch port counted leaving it during the
    first timed run, and the cores each node got)."""
    if rounds < 1:
        raise ValueError(f"rounds ({rounds}) must be at least 1")
    Path(out).mkdir(parents=True, exist_ok=True)
    path = Path(out) / "load.json"
    loads = read_json(path)
    drop_probes(out, names)  # an earlier run's, of other nodes or more rounds
    for k in range(1, rounds + 1):
        for name in names if k % 2 else names[::-1]:
            ranks = LAYOUTS[name][0]
            before = os.getloadavg()[0]
            if cluster is not None:  # the nodes' rates now, for compare's drift
                launch(ranks, ["probe-worker", "--out", out, "--tag", probe_tag(name, k)],
                       cluster=cluster)
            t0 = time.perf_counter()
            port0, cpu0 = _port_bytes(cluster), _node_cpu_s(cluster)
            launch(ranks, ["worker", name, "--out", out, "--steps", str(steps),
                           "--round", str(k)], cluster=cluster)
            wall = time.perf_counter() - t0
            sent = _port_bytes(cluster) - port0
            cores = [(b - a) / wall for a, b in zip(cpu0, _node_cpu_s(cluster), strict=True)]
            if k == 1:
                launch(ranks, ["worker", name, "--out", out, "--memory"], cluster=cluster)
                loads[name] = {"load": [before, os.getloadavg()[0]], "port_bytes": sent,
                               "cores_got": cores[:ranks]}
            else:
                loads[name]["load"] += [before, os.getloadavg()[0]]
            path.write_text(json.dumps(loads, indent=2))
            print(f"round {k}/{rounds}, {name}: {time.perf_counter() - t0:.0f} s (load "
                  f"{before:.2f} before, {os.getloadavg()[0]:.2f} after"
                  + (f"; node 0 sent {sent / 1e6:.1f} MB over its link; the nodes got "
                     f"{'/'.join(f'{c:.2f}' for c in cores[:ranks])} cores)"
                     if cluster else ")"), flush=True)


def _port_bytes(cluster) -> int:
    """Bytes node 0 of an emulated cluster has sent through its link (0 without one)."""
    if cluster is None:
        return 0
    from hpctrain.cluster import net

    return net.link_bytes(cluster.spec, cluster.spec.nodes[0])[0]


def _node_cpu_s(cluster) -> list[float]:
    """CPU seconds each node of an emulated cluster has used (its cgroup; [] without one)."""
    if cluster is None:
        return []
    from hpctrain.cluster import cpu

    cg = cpu.detect()
    return [cpu.usage_s(cg, cluster.spec, n) or 0.0 for n in cluster.spec.nodes]


def measure_on_nodes(out: str, steps: int, warmup: int, names: list[str], nodes: int,
                     link: str, rounds: int = 1) -> None:
    """``measure`` on an emulated cluster of ``nodes`` one-core nodes at ``link``, brought
    up for the run and removed after it, pass or fail (root)."""
    from hpctrain.cluster import lifecycle
    from hpctrain.cluster import spec as spec_mod
    from hpctrain.plan import calibrate, emulated

    # capped at their share as the calibration's nodes (emulated.node_share)
    share = emulated.node_share(nodes, calibrate.core_count())
    spec = spec_mod.uniform(nodes, cores=1, cpu_share=share, link=link, name=CLUSTER_NAME,
                            subnet=SUBNET)
    with lifecycle.running(spec, log=lambda text: print(text, file=sys.stderr)) as cl:
        measure(out, steps, warmup, names, cl, rounds)


def measured(out: str, name: str, warmup: int) -> tuple[float, float, list[float]]:
    """A layout's step time (the median over its rounds of each round's median step
    after ``warmup``), its peak memory, and each round's step time."""
    from hpctrain.metrics import read_metrics

    per_round = []
    k = 1
    while (run := run_dir_of(out, name, "time", k) / "metrics.jsonl").exists():
        steps = [r["step_time_s"] for r in read_metrics(run)
                 if "loss" in r and r["step"] > warmup]
        per_round.append(statistics.median(steps))
        k += 1
    if not per_round:
        raise FileNotFoundError(f"{run_dir_of(out, name, 'time')}: no timed run of {name} "
                                f"(bench_plan.py measure --out {out})")
    mem = [r for r in read_metrics(run_dir_of(out, name, "memory") / "metrics.jsonl")
           if "loss" in r and r["step"] > 1]
    return (statistics.median(per_round), max(max(r["peak_bytes_per_rank"]) for r in mem),
            per_round)


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


def rounds_agreement(by_round: list[list[float]]) -> list[str]:
    """How well the measurement orders the layouts itself: the rank correlation of
    every pair of rounds (``by_round``: each layout's step time in each round), the
    ceiling for a prediction's against their medians. No line with one round."""
    k = min(len(r) for r in by_round)
    if k < 2:
        return []
    pairs = [spearman([r[i] for r in by_round], [r[j] for r in by_round])
             for i in range(k) for j in range(i + 1, k)]
    return ["the rounds' own order: rank correlation between rounds "
            + ("" if len(pairs) == 1 else f"{min(pairs):.3f} to ") + f"{max(pairs):.3f} "
            f"({len(pairs)} pair{'s' if len(pairs) > 1 else ''} of {k} rounds)"]


def first_nodes(cluster, ranks: int):
    """A cluster of one-rank nodes cut to its first ``ranks`` nodes (a layout of fewer
    ranks than nodes, as serial on the first node); a cluster of several cores a node
    as it is."""
    from hpctrain.plan.cluster import Cluster

    cores = min(k.cores for k in cluster.kinds.values())
    if cores > 1 or ranks >= cluster.num_nodes:
        return cluster
    kept, left = [], ranks
    for kind, count in cluster.nodes:
        if left:
            kept.append((kind, min(count, left)))
            left -= kept[-1][1]
    return Cluster(cluster.name, cluster.launcher, cluster.kinds, tuple(kept), cluster.links)


def compare(out: str, cluster_path: str, warmup: int, names: list[str]) -> str:
    from hpctrain.plan.cluster import load_cluster
    from hpctrain.plan.cost import estimate

    whole, added = with_stream(load_cluster(cluster_path), out)
    rows, pred, meas, by_round = [], [], [], []
    path = Path(out) / "load.json"
    loads = read_json(path)
    got = any(loads.get(n, {}).get("cores_got") for n in names)  # only on a cluster
    path = Path(out) / "probe.json"
    probes = read_json(path)
    factors = drift(whole, probes, names)
    probed = factors is not None
    at_rates = scaled(whole, *factors[:2]) if probed else None  # the run's probed rates
    head = ("| layout | ranks | predicted ms | measured ms | error | "
            + ("at probed rates: ms, error | " if probed else "")
            + "predicted MiB | measured MiB | error | largest predicted terms |"
            + (" cores got |" if got else ""))
    lines = [head, "|" + "---|" * (9 + got + probed)]
    at_probed = []
    for name in names:
        ranks = LAYOUTS[name][0]
        cfg = layout_config(name, 1, "/tmp/unused")
        cluster = first_nodes(whole, ranks)
        e = estimate(cfg, cluster)
        step, peak, rounds = measured(out, name, warmup)
        err, merr = e.step_s / step - 1, e.max_memory / peak - 1
        pred.append(e.step_s)
        meas.append(step)
        by_round.append(rounds)
        rows.append((name, err, merr))
        if probed:
            at_probed.append(estimate(cfg, first_nodes(at_rates, ranks)).step_s)
        top = sorted(e.shares.items(), key=lambda kv: -kv[1])[:3]
        terms = ", ".join(f"{k} {100 * v:.0f}%" for k, v in top if v > 0.005)
        spread = (f" ({1e3 * min(rounds):.0f}-{1e3 * max(rounds):.0f})"
                  if len(rounds) > 1 else "")
        again = (f"{1e3 * at_probed[-1]:.0f}, {100 * (at_probed[-1] / step - 1):+.1f}% | "
                 if probed else "")
        lines.append(f"| {name} | {ranks} | {1e3 * e.step_s:.0f} | {1e3 * step:.0f}{spread} | "
                     f"{100 * err:+.1f}% | {again}{e.max_memory / 2**20:.0f} | "
                     f"{peak / 2**20:.0f} | "
                     f"{100 * merr:+.1f}% | {terms} |"
                     + (" " + "/".join(f"{c:.2f}" for c in loads.get(name, {}).get(
                         "cores_got", [])) + " |" if got else ""))
    errs = [abs(r[1]) for r in rows]
    merrs = [abs(r[2]) for r in rows]
    best_p, best_m = names[pred.index(min(pred))], names[meas.index(min(meas))]
    gap = meas[names.index(best_p)] / min(meas) - 1
    lines += ["", f"step time: median |error| {100 * statistics.median(errs):.1f}%, worst "
              f"{100 * max(errs):.1f}% ({rows[errs.index(max(errs))][0]}); Spearman rank "
              f"correlation {spearman(pred, meas):.3f}; predicted best {best_p}, measured best "
              f"{best_m} (the predicted best measures {100 * gap:.1f}% slower than the best)",
              *rounds_agreement(by_round),
              *(probed_summary(names, at_probed, meas, factors) if probed else []),
              f"memory: median |error| {100 * statistics.median(merrs):.1f}%, worst "
              f"{100 * max(merrs):.1f}% ({rows[merrs.index(max(merrs))][0]})",
              f"cluster: {cluster_path}" + (f", stream rates from {out}/stream.json"
                                            if added else "")]
    lines.append(planner_choice(whole, names, meas))
    around = [x for n, v in loads.items() if n in names for x in v["load"]]
    if around:
        lines.append(f"1-minute load average around the runs: {min(around):.2f} to "
                     f"{max(around):.2f}" + ("; cores got: each node's CPU seconds over the "
                                              "timed run's wall time" if got else ""))
    return "\n".join(lines)


def probed_summary(names: list[str], pred: list[float], meas: list[float],
                   factors: tuple[float, float, int]) -> list[str]:
    """The step-time figures again with every layout predicted at the rates probed
    beside the runs (``drift``): the model's error with the machine's drift since the
    calibration taken out."""
    errs = [abs(p / m - 1) for p, m in zip(pred, meas, strict=True)]
    best_p = names[pred.index(min(pred))]
    gemm, stream, count = factors
    return [f"at the rates probed beside the runs (the medians of {count} probes: GEMM "
            f"{gemm:.3f}, stream {stream:.3f} of the calibration's): median |error| "
            f"{100 * statistics.median(errs):.1f}%, worst "
            f"{100 * max(errs):.1f}% ({names[errs.index(max(errs))]}); Spearman rank "
            f"correlation {spearman(pred, meas):.3f}; predicted best {best_p} (measures "
            f"{100 * (meas[names.index(best_p)] / min(meas) - 1):.1f}% slower than the "
            f"best)"]


def planner_choice(cluster, names: list[str], meas: list[float]) -> str:
    """What ``hpctrain plan`` itself would choose for the benchmark GPT on ``cluster``
    among every valid layout at the measured layouts' largest rank count (and, on one
    node, every smaller count it searches), and where that layout stands measured."""
    from hpctrain.plan.search import enumerate_over, layout_name, per_node_counts

    world = max(LAYOUTS[n][0] for n in names)
    worlds = [w for w in per_node_counts(cluster) if w <= world] \
        if cluster.num_nodes == 1 else [world]
    found = enumerate_over(layout_config("serial", 1, "/tmp/unused"), cluster, worlds)
    best = found.ranked[0]
    chosen = layout_name(best.cfg.parallel)
    by_name = {layout_name(layout_config(n, 1, "/tmp/unused").parallel): n for n in names}
    head = (f"the planner's choice among all {found.valid} valid layouts on "
            f"{'/'.join(map(str, worlds))} rank(s): {chosen} ({1e3 * best.step_s:.0f} ms)")
    if chosen not in by_name:
        return head + "; not measured"
    name = by_name[chosen]
    step = meas[names.index(name)]
    place = sorted(meas).index(step) + 1
    return (head + f" = {name}, measured {1e3 * step:.0f} ms, {place} of {len(names)} "
            f"measured, {100 * (step / min(meas) - 1):.1f}% slower than the measured best")


def published(cluster_path: str | None, efficiency: float | None,
              intra_bandwidth: float | None = None) -> str:
    """Every published row on the description of its machine (``--cluster`` replaces
    the Selene one), with ``--gemm-efficiency`` / ``--intra-bandwidth`` applied to each."""
    from hpctrain.plan import published as pub
    from hpctrain.plan.cluster import Link, load_cluster

    def adjusted(path: str):
        cluster = load_cluster(path)
        if efficiency is not None:
            kinds = {n: replace(k, gemm_efficiency=efficiency)
                     for n, k in cluster.kinds.items()}
            cluster = replace(cluster, kinds=kinds)
        if intra_bandwidth is not None:  # every collective inside a node, latency kept
            intra = {op: Link(line.latency_s, intra_bandwidth)
                     for op, line in cluster.links["intra"].items()}
            cluster = replace(cluster, links={**cluster.links, "intra": intra})
        return cluster

    paths = {p: str(ROOT / p) for p in {row.cluster for row in pub.ROWS}}
    if cluster_path:
        paths[pub.CLUSTER] = cluster_path
    clusters = {p: adjusted(path) for p, path in paths.items()}
    effs = sorted({k.gemm_efficiency for c in clusters.values() for k in c.kinds.values()})
    links = (f", intra-node collectives at {intra_bandwidth / 1e9:g} GB/s"
             if intra_bandwidth is not None else "")
    machines = ", ".join(f"{c.name} ({paths[p]})" for p, c in sorted(clusters.items()))
    practices = "; ".join(f"{name}: {pr}" for name, pr in pub.PRACTICES.items()) + \
        " (dp_overlap as each run's DDP: Row.ddp)"
    fitted = pub.calibrated(pub.CALIBRATION, clusters)
    return (f"published runs on {machines}, GEMM efficiency {effs}{links}; one practice "
            f"per software, recomputing what each run did: {practices}\n"
            + pub.report(clusters)
            + f"\n\nthe same, GEMM efficiency {fitted:.3f} on both machines: calibrated on "
            f"the least parallel run ({pub.CALIBRATION.table} {pub.CALIBRATION.name}), "
            f"every other row predicted\n"
            + pub.report(pub.with_efficiency(clusters, fitted), calibration=pub.CALIBRATION))


def two_kinds(fat: int, thin: int, cores: int = 64, memory_gib: float = 512.0):
    """A cluster description of ``fat`` and ``thin`` nodes of two GEMM speeds (the
    planner's scale case)."""
    from hpctrain.plan.cluster import from_dict

    link = {"latency_s": 1e-5, "bandwidth_Bps": 4e9}
    ops = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
    kinds = [{"name": name, "cores": cores, "memory_gib": memory_gib,
              "gemm": {str(cores): [[64, 1e10 * (1 + i)], [1024, 5e10 * (1 + i)]]},
              "stream": {str(cores): 5e9}} for i, name in enumerate(("fat", "thin"))]
    return from_dict({"name": "two-kinds", "kinds": kinds,
                      "nodes": [{"kind": "fat", "count": fat}, {"kind": "thin", "count": thin}],
                      "links": {lvl: dict.fromkeys(ops, link) for lvl in ("intra", "inter")}})


def scale() -> str:
    from hpctrain import config
    from hpctrain.plan import cost
    from hpctrain.plan.cluster import load_cluster
    from hpctrain.plan.search import enumerate_layouts, layout_name

    big = config.from_dict({"model": {"kind": "gpt", "n_layer": 48, "n_head": 32,
                                      "d_model": 4096, "seq_len": 2048, "vocab_size": 51200},
                            "train": {"batch_size": 1024}})
    def timed(fn):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        return out, time.perf_counter() - t0, time.process_time() - c0

    found, enum_s, enum_cpu = timed(lambda: enumerate_layouts(big, two_kinds(32, 32), 4096))
    example = config.load(str(ROOT / "configs/gpt-1b-plan-example.toml"))
    cluster = load_cluster(ROOT / "configs/clusters/example-cpu-128x8.toml")
    at1024, e1024_s, e1024_cpu = timed(lambda: enumerate_layouts(example, cluster, 1024))
    lines = [f"load average {os.getloadavg()[0]:.2f}; one process, "
             f"{os.environ.get('OMP_NUM_THREADS', '?')} BLAS thread(s); wall s (CPU s)",
             f"4096 ranks, two kinds (32 + 32 nodes of 64 cores), GPT 48 x 4096: "
             f"{found.valid} valid layouts of {found.tried}, {len(found.ranked)} fit, "
             f"enumerated and ranked in {enum_s:.2f} s ({enum_cpu:.2f}) (target < 10 s)",
             f"1024 ranks, {cluster.name}, {example.model.n_layer} layers d_model "
             f"{example.model.d_model}: {at1024.valid} valid layouts, enumerated and ranked "
             f"in {e1024_s:.2f} s ({e1024_cpu:.2f})"]
    chosen = [("chosen", at1024.ranked[0])] + [
        ("best pipelined", next(e for e in at1024.ranked if e.cfg.parallel.pp > 1))]
    for what, e in chosen:
        _, sim_s, sim_cpu = timed(lambda e=e: cost.estimate(e.cfg, cluster, replay=True,
                                                            memo={}))
        lines.append(f"  {what} {layout_name(e.cfg.parallel)}: per-rank timeline "
                     f"(each pipeline rank's schedule replayed; its dp and tp peers alike; cold "
                     f"cache) in {sim_s:.3f} s ({sim_cpu:.3f}) "
                     f"(target < 5 s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["measure", "compare", "stream", "worker",
                                         "stream-worker", "probe-worker", "published",
                                         "scale"])
    parser.add_argument("layout", nargs="?")
    parser.add_argument("--out", default="runs/plan")
    parser.add_argument("--cluster", default=None,
                        help="default: this-machine.toml (published: a100-selene.toml)")
    parser.add_argument("--gemm-efficiency", type=float, default=None,
                        help="published: replace the description's gemm_efficiency")
    parser.add_argument("--intra-bandwidth", type=float, default=None, metavar="BYTES/S",
                        help="published: every intra-node collective at this bandwidth "
                             "(e.g. 2e11, NCCL's measured all-reduce bus bandwidth on 8 "
                             "A100s, instead of NVLink's 3e11)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure: time every layout in this many rounds, the order "
                             "reversed each round (compare reads the rounds there are)")
    parser.add_argument("--round", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--tag", default="", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=0,
                        help="worker: BLAS and element-wise threads a rank (0: the default)")
    parser.add_argument("--nodes", type=int, choices=sorted(ON_NODES), default=None,
                        help="measure: on an emulated cluster of this many one-core nodes, "
                             "one rank each (root); compare: its layouts")
    parser.add_argument("--link", default="1gbit",
                        help="measure --nodes: the rate of every node's link")
    parser.add_argument("--layouts", default=None,
                        help="comma-separated (default: the run's, ON_THIS_MACHINE or "
                             "ON_NODES[--nodes])")
    args = parser.parse_args(argv)
    names = args.layouts.split(",") if args.layouts else \
        (ON_NODES[args.nodes] if args.nodes else ON_THIS_MACHINE)
    if args.rounds < 1:
        parser.error(f"--rounds ({args.rounds}) must be at least 1")
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout(s) {unknown}; known: {', '.join(LAYOUTS)}")
    if args.what == "worker":
        worker(args.layout, args.out, args.steps, args.memory, args.threads, args.round)
    elif args.what == "stream-worker":
        stream_worker(args.out)
    elif args.what == "probe-worker":
        probe_worker(args.out, args.tag)
    elif args.what == "stream":
        Path(args.out).mkdir(parents=True, exist_ok=True)
        for ranks in (1, 2):
            launch(ranks, ["stream-worker", "--out", args.out])
        print((Path(args.out) / "stream.json").read_text())
    elif args.what == "published":
        print(published(args.cluster, args.gemm_efficiency, args.intra_bandwidth))
    elif args.what == "scale":
        print(scale())
    elif args.what == "measure" and args.nodes:
        if os.geteuid() != 0:
            sys.exit("measure --nodes builds an emulated cluster: run it as root")
        too_many = [n for n in names if LAYOUTS[n][0] > args.nodes]
        if too_many:
            parser.error(f"layout(s) {too_many} need more than --nodes ({args.nodes}) ranks")
        measure_on_nodes(args.out, args.steps, args.warmup, names, args.nodes, args.link,
                         args.rounds)
    elif args.what == "measure":
        measure(args.out, args.steps, args.warmup, names, rounds=args.rounds)
    else:
        print(compare(args.out, args.cluster or "configs/clusters/this-machine.toml",
                      args.warmup, names))


if __name__ == "__main__":
    sys.exit(main())
