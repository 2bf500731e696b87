"""hpctrain against PyTorch on the same CPU, the same GPT, in one invocation.

    make bench-peer                          three repetitions (the figures)
    .venv/bin/python benchmarks/bench_peer.py --quick      a few steps: does it run?
    .venv/bin/python benchmarks/bench_peer.py --check-only the float64 check alone

First a float64 check that the two programs compute the same function: hpctrain's
benchmark GPT, built from its seed in float64, gives its weights and one batch to the
PyTorch model (``peer_torch.py``, in the peer venv ``.venv-peer``); both compute the
loss, every gradient, and the loss after one clipped AdamW step, which must agree to
~1e-10 (the loss) and ~1e-8 (relative, the gradients).

Then, per repetition, model and layout, interleaved (which runs first alternates):
``hpctrain bench --model M --layout L`` (its tokens/s and MFU as it reports them);
the same model in PyTorch (serial, or DDP over gloo under torchrun for dp2), with
``torch.set_num_threads`` at the BLAS threads hpctrain's ranks chose; and the per-step
GEMM probe (``gemm_shapes.py``): every product of a rank's step at its own shape, each
timed alone, all ranks at once, with NumPy's BLAS (the one hpctrain uses) and with
torch's. Layouts: ``serial`` (one process, BLAS on its 2 threads), ``serial-split``
(one process, its batch split over its 2 threads, ``[parallel] batch_threads``; compared
with the same repetition's PyTorch serial run, its probe is two 1-thread workers of half
the batch each, as the threads run), ``dp2``. Models: ``gpt`` (6 layers, d_model 384,
6 heads, T 256, V 256, global batch 8) and ``gpt-large`` (12 layers, d_model 768, 12
heads, the rest the same).

Printed per model and layout (medians over the repetitions, the ratio's range):
tokens/s of each, hpctrain / PyTorch, hpctrain's MFU as ``hpctrain bench`` gives it
(against a 2048^3 GEMM probed around every step) and against the per-step GEMM probe
(model FLOP/s over the ranks' summed probe rates: 100% would be a step that is only
its products, each as fast as alone). Figures go to ``OUT/peer.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gemm_shapes import gpt_gemms, step_rate  # noqa: E402  (beside this script)

MODELS = ("gpt", "gpt-large")
LAYOUTS = ("serial", "serial-split", "dp2")
RANKS = {"serial": 1, "serial-split": 1, "dp2": 2}
# the PyTorch layout each is compared with: one process, its 2 threads, for both serials
TORCH_LAYOUT = {"serial": "serial", "serial-split": "serial", "dp2": "dp2"}
# processes x threads of the per-step GEMM probe: a rank's products as they run, so
# serial-split's are half the rows each, on one thread, two at once
PROBE_WORKERS = {"serial": 1, "serial-split": 2, "dp2": 2}


def _env() -> dict[str, str]:
    """The environment of every run: no inherited thread counts (each run sets its own)."""
    return {k: v for k, v in os.environ.items()
            if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


def _run(cmd: list[str], timeout: int, what: str, *, log: Path | None = None,
         env: dict[str, str] | None = None) -> None:
    """Run ``cmd`` to its end; its output to ``log`` if given (errors still shown)."""
    try:
        if log is None:
            proc = subprocess.run(cmd, env=_env() | (env or {}), timeout=timeout)
        else:
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "w") as f:
                proc = subprocess.run(cmd, env=_env() | (env or {}), timeout=timeout,
                                      stdout=f, stderr=subprocess.STDOUT)
            if proc.returncode != 0:
                sys.stderr.write(log.read_text())
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{what} took more than {timeout} s: {' '.join(cmd)}") from None
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed (exit status {proc.returncode}): {' '.join(cmd)}")


def model_shape(model: str) -> dict[str, int]:
    """The benchmark model's [model] keys and global batch (``hpctrain.bench``'s config)."""
    from hpctrain.bench import BENCH_MODELS

    spec = BENCH_MODELS[model].config
    m = spec["model"]
    return {"vocab_size": m["vocab_size"], "seq_len": m["seq_len"], "n_layer": m["n_layer"],
            "n_head": m["n_head"], "d_model": m["d_model"],
            "batch_size": spec["train"]["batch_size"]}


def export_tokens(data: str, out: Path) -> Path:
    """The training token stream of a ``hpctrain.tokens`` file as .npy, for PyTorch."""
    import h5py

    from hpctrain.data.format import TOKENS

    path = out / "tokens.npy"
    with h5py.File(data, "r") as f:
        if f.attrs.get("format") != TOKENS:
            raise SystemExit(f"{data} is not a {TOKENS} file (prepare it with: make data)")
        np.save(path, f["train"][:])
    return path


# ---------------------------------------------------------------------------------
# the float64 check


def export_check(model: str, data_tokens: Path, out: Path, batch: int = 2) -> Path:
    """hpctrain's side of the float64 check: the benchmark model in float64 from its
    seed, one batch, its loss and gradients, and the loss after one clipped AdamW step
    (at the schedule's first learning rate), written with the weights to an npz."""
    from hpctrain.bench import BENCH_MODELS
    from hpctrain.config import ModelConfig, TrainConfig
    from hpctrain.models.gpt import GPT
    from hpctrain.optim.clip import clip_grads, grad_norm
    from hpctrain.optim.optimizers import AdamW
    from hpctrain.optim.schedule import lr_at

    spec = BENCH_MODELS[model].config
    cfg = dataclasses.replace(ModelConfig(**spec["model"]), dtype="float64")
    train = spec["train"]
    gpt = GPT(cfg, seed=train["seed"])
    tokens = np.load(data_tokens, mmap_mode="r")
    starts = np.random.default_rng(0).integers(0, len(tokens) - cfg.seq_len - 1, size=batch)
    window = np.stack([tokens[s:s + cfg.seq_len + 1] for s in starts]).astype(np.int64)
    idx, targets = window[:, :-1], window[:, 1:]
    named = gpt.named_parameters()
    saved = {f"w:{name}": p.data.copy() for name, p in named}
    loss, cache = gpt.forward(idx, targets)
    gpt.backward(cache)
    saved |= {f"g:{name}": p.grad.copy() for name, p in named}
    defaults = TrainConfig()  # min_lr, weight_decay, grad_clip: the benchmark keeps them
    lr = lr_at(0, lr=train["lr"], min_lr=defaults.min_lr, warmup_steps=train["warmup_steps"],
               total_steps=10)
    weight_decay = defaults.weight_decay
    clip_grads(gpt.parameters(), defaults.grad_clip, grad_norm(gpt.parameters()))
    AdamW(named, lr=lr, weight_decay=weight_decay).step()
    loss_after, _ = gpt.forward(idx, targets)
    path = out / f"check-{model}.npz"
    np.savez(path, config=json.dumps(dataclasses.asdict(cfg)), idx=idx, targets=targets,
             loss=loss, loss_after_step=loss_after, lr=lr, weight_decay=weight_decay, **saved)
    return path


# ---------------------------------------------------------------------------------
# one repetition of one model at one layout


def run_hpctrain(model: str, layout: str, *, steps: int, warmup: int, data: str, out: Path,
                 timeout: int) -> dict:
    """``hpctrain bench`` at one layout (its own MPI job); its figures."""
    hpctrain = shutil.which("hpctrain", path=str(Path(sys.executable).parent)) or "hpctrain"
    run_out = out / "hpctrain"
    _run([hpctrain, "bench", "--model", model, "--layout", layout, "--steps", str(steps),
          "--warmup", str(warmup), "--data", data, "--out", str(run_out),
          "--timeout", str(timeout)], timeout + 60, f"hpctrain bench {model} {layout}",
         log=run_out / "log.txt")
    return json.loads((run_out / f"{layout}.json").read_text())


def run_torch(peer: Path, model: str, layout: str, *, threads: int, steps: int, warmup: int,
              tokens: Path, out: Path, timeout: int) -> dict:
    """The PyTorch GPT at one layout: plain Python serial, torchrun (gloo) for dp2."""
    shape = model_shape(model)
    ranks = RANKS[layout]
    result = out / "pytorch" / f"{layout}.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    script = [str(HERE / "peer_torch.py"), "train", "--threads", str(threads),
              "--tokens", str(tokens), "--out", str(result), "--steps", str(steps),
              "--warmup", str(warmup)]
    script += [arg for key, value in shape.items()
               for arg in (f"--{key.replace('_', '-')}", str(value))]
    if ranks == 1:
        cmd = [str(peer), *script]
    else:
        cmd = [str(peer), "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={ranks}", *script]
    # torchrun would set OMP_NUM_THREADS=1 (and say so); the run sets its threads itself
    _run(cmd, timeout, f"PyTorch {model} {layout}", log=result.with_suffix(".log"),
         env={"OMP_NUM_THREADS": str(threads)})
    return json.loads(result.read_text())


def run_probes(peer: Path, model: str, ranks: int, *, threads: int, out: Path,
               timeout: int) -> dict:
    """The per-step GEMM probe of one worker's share of the batch (a rank's, or a batch
    thread's), on ``ranks`` workers at once (one process each, ``threads`` threads),
    with NumPy's BLAS and with torch's."""
    shape = model_shape(model)
    local = shape["batch_size"] // ranks
    gemms = gpt_gemms(batch=local, **{k: v for k, v in shape.items() if k != "batch_size"})
    shapes = out / "probe-shapes.json"
    shapes.write_text(json.dumps([[g.batch, g.m, g.k, g.n] for g in gemms]))
    args = [f"--{k.replace('_', '-')}={v}" for k, v in shape.items() if k != "batch_size"]
    rates = {}
    for lib in ("numpy", "torch"):
        procs, files = [], [out / f"probe-{lib}-{r}.json" for r in range(ranks)]
        for f in files:
            if lib == "numpy":
                cmd = [sys.executable, str(HERE / "gemm_shapes.py"), f"--batch={local}",
                       f"--threads={threads}", f"--out={f}", *args]
            else:
                cmd = [str(peer), str(HERE / "peer_torch.py"), "probe", f"--shapes={shapes}",
                       f"--threads={threads}", f"--out={f}"]
            procs.append(subprocess.Popen(cmd, env=_env()))
        for p in procs:
            if p.wait(timeout=timeout) != 0:
                raise SystemExit(f"the {lib} GEMM probe of {model} on {ranks} process(es) "
                                 f"failed")
        per_rank = []
        for f in files:
            figures = json.loads(f.read_text())
            seconds = figures if lib == "torch" else [g["best_s"] for g in figures["gemms"]]
            per_rank.append(step_rate(gemms, seconds)[1])
        rates[lib] = sum(per_rank)  # the layout's ceiling: every rank's rate
    return rates


def one_run(peer: Path, model: str, layout: str, rep: int, args, tokens: Path,
            out: Path, torch_done: dict | None = None) -> dict:
    """hpctrain and PyTorch (the first alternating with ``rep``), then the probes.
    ``torch_done``: PyTorch's figures of this layout's counterpart, already measured in
    this repetition (serial-split is compared with the serial run's)."""
    out.mkdir(parents=True, exist_ok=True)
    threads = None
    order = ("hpctrain", "pytorch") if rep % 2 == 0 else ("pytorch", "hpctrain")
    figures = {} if torch_done is None else {"pytorch": torch_done}
    for who in order:
        if who in figures:
            continue
        print(f"== rep {rep + 1}, {model} {layout}: {who} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        if who == "hpctrain":
            figures[who] = run_hpctrain(model, layout, steps=args.steps, warmup=args.warmup,
                                        data=args.data, out=out, timeout=args.timeout)
        else:
            # the threads hpctrain's ranks choose (cores // ranks on this node); the same
            # rule before hpctrain has run once
            threads = (figures["hpctrain"]["blas_threads"] if "hpctrain" in figures
                       else max(1, (os.cpu_count() or 1) // RANKS[layout]))
            figures[who] = run_torch(peer, model, TORCH_LAYOUT[layout], threads=threads,
                                     steps=args.steps,
                                     warmup=args.warmup, tokens=tokens, out=out,
                                     timeout=args.timeout)
        print(f"   {who}: {figures[who]['tokens_per_s']:.0f} tok/s, "
              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    hp, pt = figures["hpctrain"], figures["pytorch"]
    if hp["blas_threads"] != pt["threads"]:
        raise SystemExit(f"threads differ: hpctrain {hp['blas_threads']}, PyTorch "
                         f"{pt['threads']} ({model} {layout})")
    workers = PROBE_WORKERS[layout]
    probes = run_probes(peer, model, workers, out=out, timeout=args.timeout,
                        threads=hp["blas_threads"] * hp["ranks"] // workers)
    return {"model": model, "layout": layout, "rep": rep + 1, "ranks": hp["ranks"],
            "threads": hp["blas_threads"], "hpctrain": hp, "pytorch": pt,
            "ratio": hp["tokens_per_s"] / pt["tokens_per_s"],
            "mfu": hp["mfu"], "gemm_probe_flops_per_s": probes,
            "mfu_vs_step_probe": hp["model_flops_per_s"] / probes["numpy"],
            "pytorch_mfu_vs_step_probe": (hp["model_flops_per_step"] / pt["step_time_s"]
                                          / probes["torch"])}


# ---------------------------------------------------------------------------------
# the table


def table(runs: list[dict]) -> str:
    """One row per model and layout: medians over the repetitions, the ratio's range."""
    head = (f"{'model':<10} {'layout':<12} {'ranks':>5} {'thr':>3} | {'hpctrain':>9} "
            f"{'pytorch':>9} {'ratio':>6} {'(range)':>13} | {'MFU':>6} {'MFU/step':>8} "
            f"{'probe np':>8} {'probe pt':>8} {'pt/step':>7}")
    lines = [head, f"{'':<33} | {'tok/s':>9} {'tok/s':>9} {'':>20} | {'2048^3':>6} "
                   f"{'probe':>8} {'GFLOP/s':>8} {'GFLOP/s':>8} {'probe':>7}",
             "-" * len(head)]
    keys = list(dict.fromkeys((r["model"], r["layout"]) for r in runs))
    for model, layout in keys:
        rs = [r for r in runs if (r["model"], r["layout"]) == (model, layout)]

        def med(fn, rs=rs):
            return statistics.median(fn(r) for r in rs)

        ratios = [r["ratio"] for r in rs]
        lines.append(
            f"{model:<10} {layout:<12} {rs[0]['ranks']:>5} {rs[0]['threads']:>3} | "
            f"{med(lambda r: r['hpctrain']['tokens_per_s']):>9.0f} "
            f"{med(lambda r: r['pytorch']['tokens_per_s']):>9.0f} "
            f"{med(lambda r: r['ratio']):>5.2f}x "
            f"{f'{min(ratios):.2f}-{max(ratios):.2f}x':>13} | "
            f"{100 * med(lambda r: r['mfu']):>5.1f}% "
            f"{100 * med(lambda r: r['mfu_vs_step_probe']):>7.1f}% "
            f"{med(lambda r: r['gemm_probe_flops_per_s']['numpy']) / 1e9:>8.1f} "
            f"{med(lambda r: r['gemm_probe_flops_per_s']['torch']) / 1e9:>8.1f} "
            f"{100 * med(lambda r: r['pytorch_mfu_vs_step_probe']):>6.1f}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="one repetition of 3 steps (1 warm-up): a check that it runs")
    parser.add_argument("--reps", type=int, default=3, help="repetitions, interleaved")
    parser.add_argument("--steps", type=int, default=12, help="steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out")
    parser.add_argument("--model", dest="models", action="append", choices=MODELS,
                        help=f"model to run (repeatable; default: {', '.join(MODELS)})")
    parser.add_argument("--layout", dest="layouts", action="append", choices=LAYOUTS,
                        help=f"layout to run (repeatable; default: {', '.join(LAYOUTS)})")
    parser.add_argument("--peer-python", default=".venv-peer/bin/python",
                        help="the peer venv's Python, with torch (make bench-peer makes it)")
    parser.add_argument("--data", default="data/shakespeare.h5", help="the token dataset")
    parser.add_argument("--out", default="runs/bench-peer", help="folder for every figure")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds one run may take")
    parser.add_argument("--check-only", action="store_true", help="only the float64 check")
    parser.add_argument("--skip-check", action="store_true", help="no float64 check")
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.steps, args.warmup = 1, 3, 1
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    peer = Path(args.peer_python)
    if not peer.is_file():
        parser.error(f"{peer} does not exist: make the peer venv with `make bench-peer` "
                     f"(or pass --peer-python)")
    if not Path(args.data).is_file():
        parser.error(f"{args.data} does not exist (prepare it with: make data)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokens = export_tokens(args.data, out)
    if not args.skip_check:
        npz = export_check("gpt", tokens, out)
        _run([str(peer), str(HERE / "peer_torch.py"), "check", "--npz", str(npz)],
             args.timeout, "the float64 check")
    if args.check_only:
        return 0
    runs = []
    for rep in range(args.reps):
        for model in args.models or MODELS:
            done: dict[str, dict] = {}  # PyTorch's figures of this repetition, by layout
            for layout in args.layouts or LAYOUTS:
                runs.append(one_run(peer, model, layout, rep, args, tokens,
                                    out / f"rep{rep + 1}" / model / layout,
                                    torch_done=done.get(TORCH_LAYOUT[layout])))
                done.setdefault(TORCH_LAYOUT[layout], runs[-1]["pytorch"])
    pt = runs[0]["pytorch"]
    print(f"\nPyTorch {pt['torch']} (eager, CPU; DDP over gloo), hpctrain's BLAS threads per "
          f"process ({pt['interop_threads']} inter-op threads); {args.reps} repetition(s) of "
          f"{args.steps} steps, {args.warmup} warm-up; medians:")
    print(table(runs))
    (out / "peer.json").write_text(json.dumps({"runs": runs, "args": vars(args)}, indent=2))
    print(f"\nfigures in {out / 'peer.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
