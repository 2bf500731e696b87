"""Averaging strategies on slow links, and batch shares on unequal nodes, measured.

    sudo make bench-averaging        (or: .venv/bin/python benchmarks/bench_averaging.py)
    sudo .venv/bin/python benchmarks/bench_averaging.py --quick      (a check, ~4 minutes)

Root: each part brings up its own emulated cluster (``hpctrain cluster``: one network
namespace and cgroup a node, each link shaped by ``tbf``), runs ``hpctrain train`` on
it through ``mpiexec`` (one rank a node, UCX over TCP on the shaped link: see
``hpctrain/cluster/launch.py``), and removes it. In one run it prints:

1. **strategies**: 2 nodes x 1 rank (1 core each) at 100 Mbit/s and 1 Gbit/s, a GPT on
   Shakespeare with ``--averaging`` sync, periodic H=4, periodic H=16, post_local
   (S synchronous steps, then H=16), diloco H=16 (outer lr 0.7, momentum 0.9). The
   learning rate is constant after its warm-up (``min_lr = lr``), so a run of 2N steps
   is, step for step, the run of N steps continued: sync trains N steps, the others
   ``--local-factor`` x N, and they compare
   - at equal tokens: the validation loss at step N;
   - at equal wall-clock: the training time (the sum of ``step_time_s``, evaluation
     left out) at which each first reaches sync's validation loss at step N
     (linear between evaluations), and its ratio to sync's time;
   - by bytes: ``dp_bytes`` (what a rank sent for its data-group collectives, ring
     model) per step, and what the switch port counted leaving node 0 per step;
2. **shares**: 2 nodes, CPU shares 1.0 and 0.5 (one core each, the second capped at
   half of it by the CFS quota), 1 Gbit/s, sync averaging, ``--shares equal`` against
   ``--shares measured`` (and ``fixed`` at equal shares, which records each rank's
   compute time as equal cannot), interleaved in ``--rounds`` rounds: the mean step
   time after ``SETTLE`` steps, the shares chosen, the per-rank compute times, and the
   speed-up of measured over equal against the ideal 1.5x (a 1 + 0.5 core pair doing
   in parallel what 0.5 + 0.5 did); once with the cluster's 100 ms CFS period and once
   with the same shares of a 10 ms period (``--cfs-periods``): the half node is then
   stopped for 5 ms at a time instead of 50, as a slow real node never is.

Others' jobs may share the machine: every run records the cores each node got (its
cgroup's CPU time over the run's wall time) and the load average, and the tables show
them.

Every figure goes into ``OUT/bench-averaging.json``, the curves into
``OUT/loss-vs-time-<link>.png`` and ``OUT/loss-vs-bytes-<link>.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME, SUBNET = "hpcavg", "10.219.0.0/24"  # this benchmark's own cluster and switch
SETTLE = 10  # steps left out of the share benchmark's means (warm-up, first measurement)

# the models: the demo GPT (configs/gpt-shakespeare.toml) and hpctrain bench's GPT
MODELS = {
    "small": {"model": {"kind": "gpt", "vocab_size": 256, "seq_len": 64, "n_layer": 4,
                        "n_head": 4, "d_model": 128},
              "train": {"batch_size": 32, "lr": 3e-3, "warmup_steps": 30}},
    "bench": {"model": {"kind": "gpt", "vocab_size": 256, "seq_len": 256, "n_layer": 6,
                        "n_head": 6, "d_model": 384},
              "train": {"batch_size": 8, "lr": 1e-3, "warmup_steps": 10}},
}


@dataclass(frozen=True)
class Strategy:
    label: str
    flags: tuple[str, ...] = ()
    local: bool = True  # trains --local-factor x the steps of sync

    def cli(self) -> list[str]:
        return list(self.flags)


def strategies(sync_steps: int, every: int = 16) -> list[Strategy]:
    return [Strategy("sync", ("--averaging", "sync"), local=False),
            Strategy("periodic H=4", ("--averaging", "periodic", "--average-every", "4")),
            Strategy(f"periodic H={every}", ("--averaging", "periodic",
                                              "--average-every", str(every))),
            Strategy(f"post_local S={sync_steps} H={every}",
                     ("--averaging", "post_local", "--sync-steps", str(sync_steps),
                      "--average-every", str(every))),
            Strategy(f"diloco H={every}", ("--averaging", "diloco", "--average-every",
                                            str(every), "--outer-lr", "0.7",
                                            "--outer-momentum", "0.9"))]


def unequal_strategies(every: int = 16, steps_a_round: int = 4) -> list[Strategy]:
    """On nodes of unequal speed: equal batches against speed-proportional ones, for
    synchronous training and for local SGD. Local SGD takes ``steps_a_round`` local
    steps a round (``--microbatches``: a step is one unit of B / (dp x microbatches)
    samples, so that shares can move by a unit), meeting every ``every`` rounds: with
    equal fixed shares it is plain local SGD, with measured shares throughput-weighted
    local SGD (``parallel/weighted.py``: the faster rank takes more of the steps)."""
    local = ("--averaging", "periodic", "--average-every", str(every),
             "--microbatches", str(steps_a_round))
    return [Strategy("sync, equal", ("--averaging", "sync", "--shares", "equal"), local=False),
            Strategy("sync, measured", ("--averaging", "sync", "--shares", "measured"),
                     local=False),
            Strategy(f"local SGD H={every}, equal", (*local, "--shares", "fixed",
                                                      "--batch-shares", "EQUAL")),
            Strategy(f"weighted H={every}", (*local, "--shares", "measured"))]


# ---------------------------------------------------------------------------------
# one training run on a cluster


def _spec(link: str, shares: tuple[float, ...] = (1.0, 1.0)):
    from hpctrain.cluster import spec as spec_mod

    return spec_mod.build({"name": NAME, "subnet": SUBNET, "link": link,
                           "nodes": [{"count": 1, "cores": 1, "cpu_share": s}
                                     for s in shares]})


def _toml(cfg: dict) -> str:
    def value(v):
        return json.dumps(v) if isinstance(v, str) else repr(v).lower() \
            if isinstance(v, bool) else repr(v)

    return "\n".join(f"[{section}]\n" + "\n".join(f"{k} = {value(v)}" for k, v in table.items())
                     + "\n" for section, table in cfg.items())


def write_config(folder: Path, model: str, steps: int, eval_interval: int,
                 data: str) -> Path:
    """The run's TOML: the model, a constant learning rate after warm-up, one BLAS thread."""
    m = MODELS[model]
    train = {**m["train"], "min_lr": m["train"]["lr"], "steps": steps, "optimizer": "adamw",
             "seed": 1234, "eval_interval": eval_interval, "eval_batches": 8,
             "log_interval": 50, "blas_threads": 1, "row_threads": 1,
             "run_dir": str(folder)}
    cfg = {"model": {**m["model"], "dtype": "float32"}, "train": train,
           "data": {"path": data, "eval_split": "val"}}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.toml"
    path.write_text(_toml(cfg))
    return path


def node_cpu(cl) -> list[dict]:
    """Each node's CPU seconds used so far, and the CFS periods in which its quota
    stopped it (``cpu.stat``, cgroup v1 or v2)."""
    from hpctrain.cluster import cpu

    cg = cpu.detect()
    out = []
    for n in cl.spec.nodes:
        stat = dict(line.split() for line in
                    (cg.cpu / f"hpctrain-{cl.spec.name}" / n.hostname / "cpu.stat")
                    .read_text().splitlines())
        out.append({"used_s": cpu.usage_s(cg, cl.spec, n) or 0.0,
                    "periods": int(stat.get("nr_periods", 0)),
                    "throttled": int(stat.get("nr_throttled", 0))})
    return out


def cpu_during(before: list[dict], after: list[dict], wall: float) -> list[dict]:
    """Per node: the cores it got on average, and the share of CFS periods throttled."""
    return [{"cores": (a["used_s"] - b["used_s"]) / wall,
             "throttled_periods": (a["throttled"] - b["throttled"])
             / max(1, a["periods"] - b["periods"])}
            for b, a in zip(before, after, strict=True)]


def train_on(cl, config: Path, flags: list[str], timeout: float = 3600) -> dict:
    """``hpctrain train`` on every node (one rank each); its metrics records, the bytes
    the switch counted leaving each node, the CPU each node got, and the job's wall
    time (with the machine's load average before and after: others' jobs share it)."""
    from hpctrain.cluster import net
    from hpctrain.testing import mpiexec

    folder = config.parent
    metrics = folder / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "mpi4py", "-m", "hpctrain.cli", "train", "--config",
            str(config), "--run-dir", str(folder), "--quiet", *flags]
    cmd = cl.mpiexec_command(argv, ranks_per_node=1, mpiexec=mpiexec())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    before, cpu0 = [net.link_bytes(cl.spec, n)[0] for n in cl.spec.nodes], node_cpu(cl)
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(flags)} failed ({proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    sent = [net.link_bytes(cl.spec, n)[0] - b
            for n, b in zip(cl.spec.nodes, before, strict=True)]
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    return {"records": records, "port_bytes": sent, "wall_s": wall,
            "load": [load0, os.getloadavg()[0]], "cpu": cpu_during(cpu0, node_cpu(cl), wall)}


# ---------------------------------------------------------------------------------
# part 1: strategies


def curve(records: list[dict]) -> list[dict]:
    """Validation points with the training time and the bytes sent up to them."""
    out, t, sent = [], 0.0, 0.0
    for r in records:
        if "step_time_s" in r:
            t += r["step_time_s"]
            sent += r.get("dp_bytes", 0.0)
        if "val_loss" in r:
            out.append({"step": r["step"], "time_s": t, "bytes": sent,
                        "val_loss": r["val_loss"]})
    return out


REACH_TOL = 1e-4  # a loss within this of the target reaches it: the same update summed
# in another order (unequal shares) differs from the target run's in the 6th digit


def first_reach(points: list[dict], target: float, key: str) -> float | None:
    """The ``key`` (time_s, bytes) at which the validation loss first reaches ``target``
    (within ``REACH_TOL``), linear between evaluations; None if it never does."""
    target += REACH_TOL
    for a, b in zip(points, points[1:], strict=False):
        if b["val_loss"] <= target:
            if a["val_loss"] <= target:
                return a[key]
            f = (a["val_loss"] - target) / (a["val_loss"] - b["val_loss"])
            return a[key] + f * (b[key] - a[key])
    return None


def summarise(label: str, run: dict, steps: int, target: float | None) -> dict:
    steps_recs = [r for r in run["records"] if "step_time_s" in r]
    timed = steps_recs[2:]  # the first steps allocate and connect
    pts = curve(run["records"])
    at = {p["step"]: p["val_loss"] for p in pts}
    row = {"strategy": label, "steps_run": len(steps_recs),
           "dp_bytes_per_step": statistics.fmean(r.get("dp_bytes", 0.0) for r in steps_recs),
           "port_bytes_per_step": run["port_bytes"][0] / len(steps_recs),
           "step_time_s": statistics.fmean(r["step_time_s"] for r in timed),
           "val_loss_at_n": at.get(steps), "final_val_loss": pts[-1]["val_loss"],
           "time_at_n_s": next(p["time_s"] for p in pts if p["step"] == steps),
           "wall_s": run["wall_s"], "load": run["load"], "cpu": run["cpu"], "curve": pts}
    if target is not None:
        row["time_to_target_s"] = first_reach(pts, target, "time_s")
        row["bytes_to_target"] = first_reach(pts, target, "bytes")
        row["step_to_target"] = first_reach(pts, target, "step")
    return row


def bench_strategies(link: str, model: str, steps: int, factor: float, eval_every: int,
                     sync_steps: int, data: str, out: Path, log, nodes: int = 2,
                     cpu_shares: tuple[float, ...] | None = None,
                     chosen: list[Strategy] | None = None) -> dict:
    """Each strategy (``chosen``, default ``strategies(sync_steps)``; the first is the
    reference, synchronous) trained on one cluster of ``nodes`` one-core nodes (CPU
    shares ``cpu_shares``, default all 1.0) at ``link``."""
    from hpctrain.cluster import lifecycle

    cpu_shares = cpu_shares or (1.0,) * nodes
    chosen = chosen or strategies(sync_steps)
    long_steps = int(round(steps * factor / eval_every)) * eval_every
    rows, target = [], None
    tag = "" if set(cpu_shares) == {1.0} else "-" + "-".join(map(str, cpu_shares))
    with lifecycle.running(_spec(link, cpu_shares), log=lambda _: None) as cl:
        for s in chosen:
            n = long_steps if s.local else steps
            name = s.label.replace(' ', '-').replace('=', '').replace(',', '')
            folder = out / f"{link}{tag}-{name}"
            config = write_config(folder, model, n, eval_every, data)
            batch = MODELS[model]["train"]["batch_size"]
            flags = [",".join([str(batch // nodes)] * nodes) if f == "EQUAL" else f
                     for f in s.cli()]
            row = summarise(s.label, train_on(cl, config, flags), steps, target)
            if target is None:
                target = row["val_loss_at_n"]  # the reference's loss at step N: the goal
                row.update(time_to_target_s=row["time_at_n_s"],
                           bytes_to_target=row["dp_bytes_per_step"] * steps,
                           step_to_target=steps)
            rows.append(row)
            log(f"   {link} {s.label}: {1e3 * row['step_time_s']:.0f} ms/step, "
                f"{row['dp_bytes_per_step'] / 1e6:.2f} MB/step, val at {steps} "
                f"{row['val_loss_at_n']:.4f}, reaches sync's at "
                f"{row['time_to_target_s'] or float('nan'):.1f} s")
    sync_time = rows[0]["time_to_target_s"]
    for r in rows:
        t = r["time_to_target_s"]
        r["speedup_to_target"] = sync_time / t if t else None
    return {"link": link, "model": model, "steps": steps, "local_steps": long_steps,
            "eval_every": eval_every, "target_val_loss": target, "rows": rows,
            "nodes": nodes, "cpu_shares": list(cpu_shares)}


def plot_strategies(result: dict, out: Path) -> list[Path]:
    from hpctrain.plot import _pyplot

    plt = _pyplot()
    paths = []
    for key, xlabel, scale in (("time_s", "training time (s; evaluation left out)", 1.0),
                               ("bytes", "bytes sent by a rank (MB, ring model)", 1e-6)):
        fig, ax = plt.subplots(figsize=(8, 4.6))
        for r in result["rows"]:
            pts = [p for p in r["curve"] if key == "time_s" or p[key] > 0]  # log axis
            ax.plot([p[key] * scale for p in pts], [p["val_loss"] for p in pts],
                    "o-", ms=2.5, lw=1.2, label=r["strategy"])
        ax.axhline(result["target_val_loss"], color="grey", lw=0.8, ls="--",
                   label=f"sync's loss at step {result['steps']}")
        if key == "bytes":
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss (nats per token)")
        lo = min(p["val_loss"] for r in result["rows"] for p in r["curve"])
        ax.set_ylim(lo - 0.05, lo + 1.2)
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title(f"{result['model']} GPT, {result.get('nodes', 2)} nodes x 1 core at "
                     f"{result['link']}")
        shares = result.get("cpu_shares") or [1.0]
        tag = "" if set(shares) == {1.0} else "-cpu" + "-".join(map(str, shares))
        path = out / (f"loss-vs-{'time' if key == 'time_s' else 'bytes'}-{result['link']}"
                      f"{tag}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------------
# part 2: batch shares on unequal nodes


def share_row(label: str, run: dict) -> dict:
    recs = [r for r in run["records"] if "step_time_s" in r][SETTLE:]
    row = {"variant": label, "step_time_s": statistics.fmean(r["step_time_s"] for r in recs),
           "steps": len(recs), "load": run["load"], "cpu": run["cpu"],
           "compute_s": statistics.fmean(r["time_s"]["compute"] for r in recs)}
    if recs and "batch_shares" in recs[-1]:
        row["shares_seen"] = sorted({tuple(r["batch_shares"]) for r in recs})
        row["shares_final"] = recs[-1]["batch_shares"]
        per = list(zip(*(r["rank_compute_s"] for r in recs), strict=True))
        row["rank_compute_s"] = [statistics.fmean(x) for x in per]
    return row


def set_cfs_period(cl, period_us: int) -> None:
    """Give every node its CPU share of a ``period_us`` CFS period instead of the cluster's
    100 ms (``spec.PERIOD_US``): the quota then stops a half node for half of each period,
    and a shorter period makes that stop shorter (see the README)."""
    from hpctrain.cluster import cpu

    cg = cpu.detect()
    for n in cl.spec.nodes:
        d = cg.cpu / f"hpctrain-{cl.spec.name}" / n.hostname
        quota = max(1000, round(n.cpu_cores * period_us))
        if cg.version == 2:
            (d / "cpu.max").write_text(f"{quota} {period_us}")
        else:
            (d / "cpu.cfs_quota_us").write_text("-1")  # a quota may not exceed a new period
            (d / "cpu.cfs_period_us").write_text(str(period_us))
            (d / "cpu.cfs_quota_us").write_text(str(quota))


def bench_shares(model: str, steps: int, rounds: int, period_us: int, data: str, out: Path,
                 log, extra: tuple[str, ...] = ()) -> dict:
    from hpctrain.cluster import lifecycle

    batch = MODELS[model]["train"]["batch_size"]
    variants = {"equal": ["--shares", "equal"],
                "measured": ["--shares", "measured"],
                "fixed equal (per-rank times)": ["--shares", "fixed", "--batch-shares",
                                                 f"{batch // 2},{batch // 2}"]}
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    with lifecycle.running(_spec("1gbit", (1.0, 0.5)), log=lambda _: None) as cl:
        set_cfs_period(cl, period_us)
        for k in range(rounds):
            for label, flags in variants.items():
                folder = out / f"shares-p{period_us}-{label.split()[0]}-r{k}"
                config = write_config(folder, model, steps, 0, data)
                row = share_row(label, train_on(cl, config, ["--averaging", "sync", *flags,
                                                             *extra]))
                runs[label].append(row)
                log(f"   shares, {period_us // 1000} ms period, {label} round {k}: "
                    f"{1e3 * row['step_time_s']:.0f} ms/step"
                    + (f", shares {row['shares_final']}, per-rank compute "
                       f"{[round(x, 3) for x in row['rank_compute_s']]} s"
                       if "shares_final" in row else ""))
    rows = []
    for label, rs in runs.items():
        rows.append({"variant": label, "rounds": rs,
                     "step_time_s": statistics.fmean(r["step_time_s"] for r in rs)})
    equal = rows[0]["step_time_s"]
    for r in rows:
        r["speedup"] = equal / r["step_time_s"]
    return {"model": model, "batch": batch, "steps": steps, "settle": SETTLE,
            "period_us": period_us, "ideal_speedup": 1.5, "rows": rows}


# ---------------------------------------------------------------------------------
# the report


def report(results: dict) -> str:
    lines = []
    for res in results.get("strategies", []):
        shares = res.get("cpu_shares") or [1.0]
        lines += [f"strategies: {res['model']} GPT, {res.get('nodes', 2)} nodes x 1 rank "
                  + (f"(CPU shares {'/'.join(map(str, shares))}) "
                     if set(shares) != {1.0} else "")
                  + f"at {res['link']}; synchronous runs "
                  f"{res['steps']} steps, local ones {res['local_steps']}; target = the first "
                  f"row's val loss at step {res['steps']}: {res['target_val_loss']:.4f}",
                  f"  {'strategy':<22} {'MB/step':>8} {'port MB/step':>12} {'ms/step':>8} "
                  f"{'val@' + str(res['steps']):>8} {'best val':>8} {'to target s':>11} "
                  f"{'step':>5} {'vs sync':>8} {'cores got':>10} {'load':>10}"]
        for r in res["rows"]:
            t = r["time_to_target_s"]
            lines.append(
                f"  {r['strategy']:<22} {r['dp_bytes_per_step'] / 1e6:>8.3f} "
                f"{r['port_bytes_per_step'] / 1e6:>12.3f} {1e3 * r['step_time_s']:>8.0f} "
                f"{r['val_loss_at_n']:>8.4f} "
                f"{min(p['val_loss'] for p in r['curve']):>8.4f} "
                + (f"{t:>11.1f} {r['step_to_target']:>5.0f} {r['speedup_to_target']:>7.2f}x"
                   if t else f"{'never':>11} {'-':>5} {'-':>8}")
                + f" {'/'.join(format(c['cores'], '.2f') for c in r['cpu']):>10}"
                + ("!" if any(c["cores"] < 0.85 * share for c, share in
                              zip(r["cpu"], shares * len(r["cpu"]), strict=False)) else " ")
                + f" {'/'.join(f'{x:.1f}' for x in r['load']):>10}")
        lines.append("  (!: a node got less than 0.85 of its CPU share: others' jobs "
                     "shared the machine)\n")
    for sh in results.get("shares", []):
        lines += [f"shares: {sh['model']} GPT, batch {sh['batch']}, 2 nodes at CPU shares "
                  f"1.0 and 0.5 of a {sh['period_us'] // 1000} ms CFS period, 1 Gbit/s, "
                  f"sync; means over steps {sh['settle'] + 1}-"
                  f"{sh['steps']} of each run, {len(sh['rows'][0]['rounds'])} interleaved "
                  f"round(s)",
                  f"  {'variant':<28} {'ms/step':>8} {'runs ms/step':>16} {'speed-up':>9} "
                  f"{'of ideal':>9} {'cores got':>11} {'throttled':>9}  "
                  f"shares, per-rank compute s"]
        for r in sh["rows"]:
            last = r["rounds"][-1]
            extra = (f"{last['shares_final']}, {[round(x, 3) for x in last['rank_compute_s']]}"
                     if "shares_final" in last else "")
            runs = "/".join(f"{1e3 * x['step_time_s']:.0f}" for x in r["rounds"])
            cores = "/".join(f"{statistics.fmean(x['cpu'][k]['cores'] for x in r['rounds']):.2f}"
                             for k in range(2))
            throttled = statistics.fmean(x["cpu"][1]["throttled_periods"] for x in r["rounds"])
            lines.append(f"  {r['variant']:<28} {1e3 * r['step_time_s']:>8.0f} {runs:>16} "
                         f"{r['speedup']:>8.2f}x {100 * r['speedup'] / 1.5:>8.0f}% "
                         f"{cores:>11} {100 * throttled:>8.0f}%  {extra}")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/bench-averaging", help="folder for JSON, PNGs")
    parser.add_argument("--parts", default="strategies,shares",
                        help="comma-separated parts to run (strategies, shares, unequal: "
                             "equal and measured batch shares, sync and periodic "
                             "averaging, on nodes of CPU shares 1.0 and 0.5 at the first "
                             "link)")
    parser.add_argument("--model", choices=sorted(MODELS), default="small",
                        help="small: configs/gpt-shakespeare.toml's GPT; bench: hpctrain "
                             "bench's (6 layers, d_model 384, T 256)")
    parser.add_argument("--links", default="100mbit,1gbit", help="link rates, comma-separated")
    parser.add_argument("--nodes", type=int, default=2,
                        help="strategies part: one-core nodes, one rank each")
    parser.add_argument("--steps", type=int, default=128, help="sync's steps (N)")
    parser.add_argument("--local-factor", type=float, default=1.5,
                        help="the local strategies train this many times N steps")
    parser.add_argument("--eval-every", type=int, default=16,
                        help="steps between evaluations (a multiple of H keeps them at meetings)")
    parser.add_argument("--sync-steps", type=int, default=16,
                        help="post_local's synchronous warm-up S")
    parser.add_argument("--share-steps", type=int, default=60, help="steps of a shares run")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of shares")
    parser.add_argument("--cfs-periods", default="100000,10000",
                        help="CFS periods (us) to cap the nodes over in the shares part: the "
                             "cluster's own 100 ms, and a shorter one")
    parser.add_argument("--data", default="data/shakespeare.h5", help="tokens (Shakespeare)")
    parser.add_argument("--bucket-mb", type=float, default=None,
                        help="shares part: gradient bucket size passed to every run (several "
                             "buckets overlap the all-reduce with backward)")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny version to check the script: 32 steps, 100mbit only")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.local_factor, args.links = 32, 1.5, "100mbit"
        args.share_steps, args.rounds = 24, 1
    if os.geteuid() != 0:
        sys.exit("bench_averaging.py builds emulated clusters: run it as root (sudo)")
    if not Path(args.data).exists():
        sys.exit(f"{args.data} is missing: run `make data/shakespeare.h5`")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args)}
    parts, t0 = args.parts.split(","), time.perf_counter()
    if "strategies" in parts:
        results["strategies"] = []
        for link in args.links.split(","):
            res = bench_strategies(link, args.model, args.steps, args.local_factor,
                                   args.eval_every, args.sync_steps, args.data, out, log,
                                   args.nodes)
            results["strategies"].append(res)
            res["plots"] = [str(p) for p in plot_strategies(res, out)]
            (out / "bench-averaging.json").write_text(json.dumps(results, indent=2))
    if "unequal" in parts:
        link = args.links.split(",")[0]
        res = bench_strategies(link, args.model, args.steps, args.local_factor,
                               args.eval_every, args.sync_steps, args.data, out, log, 2,
                               cpu_shares=(1.0, 0.5), chosen=unequal_strategies())
        results.setdefault("strategies", []).append(res)
        res["plots"] = [str(p) for p in plot_strategies(res, out)]
    if "shares" in parts:
        extra = () if args.bucket_mb is None else ("--bucket-mb", str(args.bucket_mb))
        results["shares"] = [bench_shares(args.model, args.share_steps, args.rounds, int(p),
                                          args.data, out, log, extra)
                             for p in args.cfs_periods.split(",")]
    results["seconds"] = time.perf_counter() - t0
    (out / "bench-averaging.json").write_text(json.dumps(results, indent=2))
    print(report(results))
    print(f"\n{results['seconds']:.0f} s; figures in {out / 'bench-averaging.json'}")


if __name__ == "__main__":
    main()
