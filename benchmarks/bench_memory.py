"""Memory of the benchmark GPT (6 layers, d_model 384, 6 heads, T = 256, batch 8,
float32): activation recomputation, and the memory report against the planner.

    python benchmarks/bench_memory.py attention        attention's activations, in-process
    python benchmarks/bench_memory.py recompute        every recomputation mode: memory and time
    python benchmarks/bench_memory.py layouts --out runs/bench-memory   predicted vs measured

``attention``: the 6 attention layers' caches of one forward (the model's own layers,
fed the benchmark's (8, 256, 384) activation), measured two ways: ``tracemalloc``'s
growth while the caches are held, and each cache's arrays counted by base buffer;
then the peak of the forward-and-backward above the inputs, without recomputation,
with selective and with attention recomputation. ``recompute``: one training step's
traced peak above the persistent state and the step time of none / selective /
attention / full, interleaved (the times
move with the machine's load: the load average is printed). ``layouts``: every layout
(``LAYOUTS``) as its own MPI job of 4 steps with ``[train] memory_report``, each rank's
traced peak of the last step against ``plan.cost.predict_memory``, and the median step
time of steps 2-4 (traced; the load average is printed).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = str(ROOT / ".venv/bin/python")
MPIEXEC = str(ROOT / ".venv/bin/mpiexec")

# name -> (ranks, [parallel], recompute)
LAYOUTS = {
    "serial": (1, {}, "none"),
    "serial-selective": (1, {}, "selective"),
    "serial-attention": (1, {}, "attention"),
    "serial-full": (1, {}, "full"),
    "dp2": (2, {"dp": 2}, "none"),
    "dp2-full": (2, {"dp": 2}, "full"),
    "tp2": (2, {"tp": 2}, "none"),
    "tp2-selective": (2, {"tp": 2}, "selective"),
    "tp2-sp-attention": (2, {"tp": 2, "sequence_parallel": True}, "attention"),
    "pp2-mb2-1f1b": (2, {"pp": 2, "microbatches": 2, "schedule": "1f1b"}, "none"),
    "pp2-mb2-1f1b-full": (2, {"pp": 2, "microbatches": 2, "schedule": "1f1b"}, "full"),
    "pp2-mb4-gpipe": (2, {"pp": 2, "microbatches": 4, "schedule": "gpipe"}, "none"),
    "pp2-mb4-gpipe-selective": (2, {"pp": 2, "microbatches": 4, "schedule": "gpipe"},
                                "selective"),
    "pp2-mb4-gpipe-attention": (2, {"pp": 2, "microbatches": 4, "schedule": "gpipe"},
                                "attention"),
    "dp2-z1": (2, {"dp": 2, "zero": 1}, "none"),
    "dp2-z2": (2, {"dp": 2, "zero": 2}, "none"),
    "dp2-z2-full": (2, {"dp": 2, "zero": 2}, "full"),
}


def bench_config(parallel=None, recompute="none", ranks=1, **train):
    from hpctrain import config
    from hpctrain.bench import BENCH_CONFIG

    raw = copy.deepcopy(BENCH_CONFIG)
    raw["parallel"] = dict(parallel or {})
    raw["train"] |= {"recompute": recompute, **train}
    raw["data"]["path"] = str(ROOT / raw["data"]["path"])
    return config.from_dict(raw, source="bench_memory").validate(ranks)


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# ---------------------------------------------------------------------------------
# attention's activations with and without selective recomputation


def attention(args) -> None:
    import numpy as np

    import hpctrain  # noqa: F401  (before NumPy's BLAS is used: its thread timeout)
    from hpctrain.memreport import _Ledger
    from hpctrain.models.gpt import GPT

    cfg = bench_config()
    m = cfg.model
    b = cfg.train.batch_size
    x = np.random.default_rng(0).standard_normal((b, m.seq_len, m.d_model)).astype(np.float32)
    print(f"attention activations, {m.n_layer} layers, b {b}, T {m.seq_len}, C {m.d_model}, "
          f"H {m.n_head}, float32 (MiB)")
    print("recompute | traced, caches held | counted, caches held | of which P | "
          "forward+backward peak above inputs")
    rows = {}
    for mode in ("none", "selective", "attention"):
        layers = [blk.attn for blk in GPT(m, seed=0).blocks]
        for layer in layers:
            layer.recompute_scores = mode != "none"
            layer.recompute_qkv = mode == "attention"
        inputs = [x.copy() for _ in layers]  # each layer reads its own input (ln1's output)
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        caches = [layer.forward(a)[1] for layer, a in zip(layers, inputs, strict=True)]
        held = tracemalloc.get_traced_memory()[0] - base
        ledger = _Ledger()
        counted = ledger.count(a for c in caches for a in _cache_arrays(c))
        p_bytes = sum(c.p.nbytes for c in caches if c.p is not None)
        tracemalloc.reset_peak()
        for layer, c in zip(reversed(layers), reversed(caches), strict=True):
            layer.backward(np.ones((b, m.seq_len, m.d_model), np.float32), c)
        del caches
        peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
        rows[mode] = (held, counted, p_bytes, peak)
        mib = 2 ** 20
        print(f"{mode:9s} | {held / mib:.1f} | {counted / mib:.1f} | {p_bytes / mib:.1f} | "
              f"{peak / mib:.1f}")
    h0, c0, _, k0 = rows["none"]
    for mode in ("selective", "attention"):
        h1, c1, _, k1 = rows[mode]
        print(f"{mode} cuts the held caches from {h0 / 2**20:.1f} to {h1 / 2**20:.1f} MiB, "
              f"{c0 / c1:.2f}x counting each layer's "
              f"input, the forward+backward peak {k0 / k1:.2f}x")


def _cache_arrays(cache):
    for v in cache:
        if v is None:
            continue
        if isinstance(v, tuple):
            yield from _cache_arrays(v)
        else:
            yield v


# ---------------------------------------------------------------------------------
# a training step with recomputation: activation memory and time


def recompute(args) -> None:
    import numpy as np

    import hpctrain  # noqa: F401
    from hpctrain import runtime
    from hpctrain.models.gpt import GPT
    from hpctrain.parallel import recompute as rc

    runtime.keep_freed_memory()  # as training does: steps reuse the heap, not fresh pages
    cfg = bench_config()
    m, b = cfg.model, cfg.train.batch_size
    rng = np.random.default_rng(0)
    x = rng.integers(0, m.vocab_size, (b, m.seq_len))
    y = rng.integers(0, m.vocab_size, (b, m.seq_len))
    models = {}
    for mode in ("none", "selective", "attention", "full"):
        models[mode] = GPT(m, seed=0)
        rc.apply(models[mode], mode)
    print(f"load average before: {load()}")
    memory = {}
    for mode, model in models.items():
        loss, cache = model.forward(x, y)  # a warm-up step
        model.backward(cache)
        del cache
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        loss, cache = model.forward(x, y)
        kept = tracemalloc.get_traced_memory()[0] - base
        model.backward(cache)
        del cache
        memory[mode] = (kept, tracemalloc.get_traced_memory()[1] - base)
        tracemalloc.stop()
    times = {mode: [] for mode in models}
    for _ in range(args.repeats):  # interleaved: the machine's speed drifts
        for mode, model in models.items():
            t0 = time.perf_counter()
            loss, cache = model.forward(x, y)
            model.backward(cache)
            times[mode].append(time.perf_counter() - t0)
            del cache
    print(f"load average after: {load()}")
    base_t = statistics.median(times["none"])
    print("recompute | caches kept after forward (MiB) | step peak above the state (MiB) | "
          "forward+backward median (s) | vs none")
    for mode in models:
        kept, peak = memory[mode]
        t = statistics.median(times[mode])
        print(f"{mode:9s} | {kept / 2**20:.1f} | {peak / 2**20:.1f} | {t:.3f} | "
              f"{100 * (t / base_t - 1):+.1f}%")


# ---------------------------------------------------------------------------------
# every layout: the memory report against the planner


def worker(name: str, out: str) -> None:
    from mpi4py import MPI

    from hpctrain.train import train

    ranks, parallel, mode = LAYOUTS[name]
    cfg = bench_config(parallel, mode, ranks, steps=4, memory_report=True,
                       run_dir=str(Path(out) / name))
    train(cfg, MPI.COMM_WORLD, quiet=True)


def layouts(args) -> None:
    import json

    from hpctrain.memreport import predicted
    from hpctrain.metrics import read_metrics

    names = args.layouts.split(",") if args.layouts else list(LAYOUTS)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    rows = []
    print(f"load average before: {load()}")
    for name in names:
        ranks, parallel, mode = LAYOUTS[name]
        subprocess.run([MPIEXEC, "-n", str(ranks), PY, "-m", "mpi4py", __file__, "worker",
                        name, "--out", args.out], check=True, timeout=900, env=env)
        records = read_metrics(Path(args.out) / name / "metrics.jsonl")
        record = [r for r in records if "memory_per_rank" in r][-1]
        # the steps after the first (traced: tracemalloc's cost is within the noise)
        step_s = statistics.median(r["step_time_s"] for r in records
                                   if r.get("step", 0) >= 2 and "step_time_s" in r)
        pred = predicted(bench_config(parallel, mode, ranks))
        for r, m in enumerate(record["memory_per_rank"]):
            p = pred[m["pp_rank"]]
            rows.append({"layout": name, "rank": r, "measured": m, "predicted": p,
                         "step_s": step_s})
    print(f"load average after: {load()}")
    Path(args.out, "memory.json").write_text(json.dumps(rows, indent=1))
    mib = 2 ** 20
    print("layout | rank | params | grads | optimizer | buffers | other | activations | "
          "peak (MiB) | predicted | error | predicted act.+work | RSS peak | step (s)")
    worst = 0.0
    for row in rows:
        m, p = row["measured"], row["predicted"]
        err = p["total"] / m["peak"] - 1
        worst = max(worst, abs(err))
        cells = " | ".join(f"{m[k] / mib:.1f}" for k in ("params", "grads", "optimizer",
                                                        "buffers", "other", "activations"))
        print(f"{row['layout']} | {row['rank']} | {cells} | {m['peak'] / mib:.1f} | "
              f"{p['total'] / mib:.1f} | {100 * err:+.1f}% | "
              f"{(p['activations'] + p['workspace']) / mib:.1f} | {m['rss_peak'] / mib:.0f} | "
              f"{row['step_s']:.2f}")
    print(f"worst |error| {100 * worst:.1f}% over {len(rows)} rank rows")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["attention", "recompute", "layouts", "worker"])
    parser.add_argument("layout", nargs="?")
    parser.add_argument("--out", default="runs/bench-memory")
    parser.add_argument("--layouts", default="", help="names, by commas (default: all)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.what == "worker":
        worker(args.layout, args.out)
    elif args.what == "attention":
        attention(args)
    elif args.what == "recompute":
        recompute(args)
    else:
        layouts(args)


if __name__ == "__main__":
    sys.exit(main())
