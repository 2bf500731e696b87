"""Local-loss pipeline training against end-to-end 1F1B backprop: three models, pp = 2 and 4.

    python benchmarks/bench_local_loss.py all --plan quick      # minutes: a check
    python benchmarks/bench_local_loss.py all --plan full --repeats 2   # the figures

``all`` (no mpiexec: it starts one ``mpiexec -n PP`` job per run) trains, for every
model of ``--models`` and every pp of ``--pps``, both methods on the same seed, data
order and learning-rate schedule through ``hpctrain.train.train``; they differ only
in ``[parallel] pipeline_training``: "backprop" (1F1B) or "local"
(``hpctrain.parallel.local_loss``). Every rank is one pipeline stage (dp = 1),
``--microbatches`` per step, ``balance = "params"`` (the models' declared costs):

* ``mlp``: ``configs/mlp-fashion-mnist.toml`` with hidden 256 x 5 (equal widths);
* ``cnn``: ``configs/cnn-fashion-mnist.toml`` (channels 16, 32: four conv pieces);
* ``gpt``: ``configs/gpt-shakespeare.toml`` (4 blocks).

Plans: ``quick`` a few steps of each (a check that everything runs, figures
meaningless), ``full`` 3 epochs of the MLP, 2 of the CNN (468 steps of 128 images an
epoch) and the GPT config's 400 steps, evaluated on the whole test set (9,984 images)
or 8 validation batches. ``--repeats 2`` runs each pair twice, the second time in the
other order, so a drift of the machine's speed falls on both methods.

Printed per run: the mean training step (``step_time_s``, evaluation excluded, the
first step left out), as seconds an epoch for the image models, the final test
accuracy or validation loss, and the load average before and after (compare methods
within one run of this command). ``OUT/accuracy.png``: test accuracy (MLP, CNN) or
validation loss (GPT) against training wall-clock time, one line per method and pp;
``OUT/results.json`` every figure. ``run`` is one training run, under mpiexec (what
``all`` starts).

``--link RATE`` (root) runs every pp on an emulated cluster instead (``hpctrain
cluster``, its own name and switch): pp one-core nodes, one stage a node, joined by
links shaped to RATE, each node given ``cores / pp`` of this machine's cores (half a
core at pp = 4 on 2 cores), MPI traffic forced onto the links (``UCX_TLS=tcp``).
Each run also records the bytes its nodes sent through the switch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import click

import hpctrain  # noqa: F401  (before NumPy, which h5py loads: OPENBLAS_THREAD_TIMEOUT)
from hpctrain.config import load

METHODS = ("backprop", "local")
LABELS = {"backprop": "1F1B backprop", "local": "local losses"}


@dataclass(frozen=True)
class Case:
    config: str
    overrides: dict
    metric: str  # val_accuracy (higher is better) or val_loss
    images: bool  # epochs of the training split (else: steps of the config)


CASES = {
    "mlp": Case("configs/mlp-fashion-mnist.toml", {"model.hidden": [256] * 5},
                "val_accuracy", True),
    "cnn": Case("configs/cnn-fashion-mnist.toml", {}, "val_accuracy", True),
    "gpt": Case("configs/gpt-shakespeare.toml", {}, "val_loss", False),
}
# per model: (epochs or steps, evaluations per run, evaluation batches)
PLANS = {
    "quick": {"mlp": (40, 2, 4), "cnn": (6, 2, 2), "gpt": (8, 2, 2)},
    "full": {"mlp": ("3e", 3, 78), "cnn": ("2e", 2, 78), "gpt": (400, 8, 8)},
}


def steps_per_epoch(case: Case) -> int:
    import h5py

    base = load(case.config)
    with h5py.File(base.data.path, "r") as f:
        return len(f["train/labels"]) // base.train.batch_size


def schedule(model: str, plan: str) -> tuple[int, int, int]:
    """(steps, steps between evaluations, evaluation batches) of ``model`` in ``plan``."""
    length, evals, batches = PLANS[plan][model]
    steps = (int(length[:-1]) * steps_per_epoch(CASES[model]) if isinstance(length, str)
             else length)
    return steps, max(1, steps // evals), batches


CLUSTER, SUBNET = "hpcll", "10.225.0.0/24"  # the --link runs' own cluster and switch


@contextmanager
def launcher(pp: int, link: str | None):
    """A function from a run's argv to the job's command and a function giving the bytes
    the nodes sent so far: plain ``mpiexec -n pp`` without ``link``; with it, over an
    emulated cluster of pp one-core nodes (each ``cores / pp`` of the machine) for the
    length of the ``with`` block."""
    from hpctrain.runtime import find_mpiexec

    mpiexec = find_mpiexec()
    if link is None:
        yield (lambda argv: [mpiexec, "-n", str(pp), *argv]), (lambda: 0)
        return
    from hpctrain.cluster import lifecycle, net
    from hpctrain.cluster import spec as spec_mod

    spec = spec_mod.uniform(pp, cores=1, cpu_share=min(1.0, (os.cpu_count() or 1) / pp),
                            link=link, name=CLUSTER, subnet=SUBNET)
    with lifecycle.running(spec, log=lambda _: None) as cl:
        yield ((lambda argv: cl.mpiexec_command(argv, ranks_per_node=1, mpiexec=mpiexec)),
               (lambda: sum(net.link_bytes(cl.spec, n)[0] for n in cl.spec.nodes)))


# ---------------------------------------------------------------------------------
# one run, under mpiexec


def read_run(run_dir: Path, metric: str) -> dict:
    """Step times, and the metric against the training clock at every evaluation."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times, clock, curve = [], 0.0, []
    for r in records:
        if "step_time_s" in r:
            times.append(r["step_time_s"])
            clock += r["step_time_s"]
        if metric in r:
            curve.append({"step": r["step"], "clock": clock, "value": r[metric],
                          "val_loss": r.get("val_loss")})
    return {"step_times": times, "curve": curve}


@click.group()
def main() -> None:
    """Local-loss pipeline training against 1F1B (module docstring)."""


@main.command("run")
@click.option("--model", type=click.Choice(sorted(CASES)), required=True, help="Which model.")
@click.option("--method", type=click.Choice(METHODS), required=True,
              help="pipeline_training: backprop (1F1B) or local.")
@click.option("--steps", type=int, required=True, help="Training steps.")
@click.option("--eval-every", type=int, required=True, help="Steps between evaluations.")
@click.option("--eval-batches", type=int, required=True, help="Batches per evaluation.")
@click.option("--microbatches", default=4, show_default=True, help="Microbatches per step.")
@click.option("--run-dir", type=click.Path(file_okay=False), required=True,
              help="The run's folder (replaced); its summary goes to RUN_DIR/run.json.")
def run(model: str, method: str, steps: int, eval_every: int, eval_batches: int,
        microbatches: int, run_dir: str) -> None:
    """One training run, one pipeline stage a rank (under mpiexec -n PP)."""
    from mpi4py import MPI

    from hpctrain.train import train

    comm = MPI.COMM_WORLD
    pp, rank = comm.Get_size(), comm.Get_rank()
    if pp < 2:
        raise click.UsageError("run it with mpiexec -n 2 (or 4): one pipeline stage a rank")
    case, out = CASES[model], Path(run_dir)
    if rank == 0 and out.exists():
        shutil.rmtree(out)
    comm.Barrier()
    overrides = case.overrides | {
        "parallel.pp": pp, "parallel.dp": 1, "parallel.microbatches": microbatches,
        "parallel.schedule": "1f1b", "parallel.pipeline_training": method,
        "parallel.balance": "params", "train.steps": steps, "train.eval_interval": eval_every,
        "train.eval_batches": eval_batches, "train.log_interval": eval_every,
        "train.save_interval": 0, "train.run_dir": str(out)}
    cfg = load(case.config, overrides).validate(pp)
    load_before = os.getloadavg()[0]
    summary = train(cfg, comm, quiet=True)
    if rank == 0:
        figures = read_run(out, case.metric) | {
            "model": model, "method": method, "pp": pp, "microbatches": microbatches,
            "steps": steps, "total_s": summary.seconds, "load_before": load_before,
            "load_after": os.getloadavg()[0]}
        (out / "run.json").write_text(json.dumps(figures))


# ---------------------------------------------------------------------------------
# every run, one job each


def mean_step(r: dict) -> float:
    times = r["step_times"][1:] or r["step_times"]  # the first step warms up
    return sum(times) / len(times)


def plot(results: list[dict], out: Path) -> Path:
    from hpctrain.plot import _pyplot, _save

    plt = _pyplot()
    models = list(dict.fromkeys(r["model"] for r in results))
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        accuracy = CASES[model].metric == "val_accuracy"
        for r in (r for r in results if r["model"] == model):
            xs = [p["clock"] for p in r["curve"]]
            ys = [100 * p["value"] if accuracy else p["value"] for p in r["curve"]]
            style = ("-" if r["method"] == "local" else "--") + ("o" if r["pp"] == 2 else "s")
            ax.plot(xs, ys, style, label=f"{LABELS[r['method']]}, pp {r['pp']} (run {r['run']})")
        ax.set_title(f"{model.upper()}: {'test accuracy' if accuracy else 'validation loss'}")
        ax.set_xlabel("training wall-clock time (s)")
        ax.set_ylabel("test accuracy (%)" if accuracy else "validation loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("local losses vs 1F1B backprop, one pipeline stage a rank")
    fig.tight_layout()
    return _save(fig, plt, out / "accuracy.png")


def report(results: list[dict], per_epoch: int) -> None:
    print(f"\n{'model':>5} {'pp':>2} {'method':>14} {'run':>3}  {'time':>16}  "
          f"{'final':>18}  load")
    for r in results:
        step = mean_step(r)
        time_s = (f"{step * per_epoch:7.2f} s/epoch" if CASES[r["model"]].images
                  else f"{1e3 * step:7.1f} ms/step")
        last = r["curve"][-1]["value"] if r["curve"] else float("nan")
        final = (f"test acc {100 * last:6.2f}%" if CASES[r["model"]].metric == "val_accuracy"
                 else f"val loss {last:.4f}")
        print(f"{r['model']:>5} {r['pp']:>2} {LABELS[r['method']]:>14} {r['run']:>3}  {time_s}  "
              f"{final:>18}  {r['load_before']:.1f} -> {r['load_after']:.1f}")
    print("\nlocal / 1F1B, mean step time over the runs (< 1: local is faster):")
    for model, pp in dict.fromkeys((r["model"], r["pp"]) for r in results):
        mean = {m: [mean_step(r) for r in results if (r["model"], r["pp"], r["method"]) ==
                    (model, pp, m)] for m in METHODS}
        if all(mean.values()):
            ratio = (sum(mean["local"]) / len(mean["local"])) / (
                sum(mean["backprop"]) / len(mean["backprop"]))
            print(f"  {model} pp {pp}: {ratio:.3f}")


@main.command("all")
@click.option("--plan", type=click.Choice(sorted(PLANS)), default="quick", show_default=True,
              help="quick: a few steps each (a check); full: the figures (see the docstring).")
@click.option("--models", default="mlp,cnn,gpt", show_default=True,
              help="Comma-separated models, of mlp, cnn, gpt.")
@click.option("--pps", default="2,4", show_default=True, help="Comma-separated pipeline sizes.")
@click.option("--microbatches", default=4, show_default=True, help="Microbatches per step.")
@click.option("--repeats", default=1, show_default=True,
              help="Pairs of runs per case; odd pairs run backprop first, even ones local.")
@click.option("--timeout", "limit", default=3600, show_default=True,
              help="Seconds one run may take before it is killed (a failure).")
@click.option("--out", default="runs/bench-local-loss", show_default=True,
              type=click.Path(file_okay=False), help="Folder for the runs, PNG and JSON.")
@click.option("--link", default=None, metavar="RATE",
              help="Run on an emulated cluster of pp one-core nodes joined at RATE "
                   "(e.g. 1gbit, 100mbit; root); default: plain mpiexec on this machine.")
def run_all(plan: str, models: str, pps: str, microbatches: int, repeats: int, limit: int,
            out: str, link: str | None) -> None:
    """Every model, pp and method, one mpiexec job a run; the table and the PNG."""
    names = [m for m in models.split(",") if m]
    for name in names:
        if name not in CASES:
            raise click.BadParameter(f"{name!r} is not one of {sorted(CASES)}",
                                     param_hint="--models")
    if link is not None:
        from hpctrain.cluster import spec as spec_mod

        spec_mod.parse_rate(link)  # a bad rate fails here, before any run
        if os.geteuid() != 0:
            raise click.UsageError("--link builds an emulated cluster: run it as root")
    out_dir = Path(out)
    env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"} | dict(os.environ)
    results = []
    per_epoch = steps_per_epoch(CASES["mlp"])
    for model in names:
        steps, every, batches = schedule(model, plan)
        for pp in (int(p) for p in pps.split(",")):
            with launcher(pp, link) as (command, sent):
                for run_no in range(1, repeats + 1):
                    for method in METHODS if run_no % 2 else METHODS[::-1]:
                        run_dir = out_dir / f"{model}-pp{pp}-{method}-{run_no}"
                        cmd = command([sys.executable, "-m", "mpi4py", str(Path(__file__)
                                                                           .resolve()),
                                       "run", "--model", model, "--method", method,
                                       "--steps", str(steps), "--eval-every", str(every),
                                       "--eval-batches", str(batches),
                                       "--microbatches", str(microbatches),
                                       "--run-dir", str(run_dir.resolve())])
                        t0, bytes0 = time.perf_counter(), sent()
                        subprocess.run(cmd, check=True, timeout=limit, env=env)
                        r = json.loads((run_dir / "run.json").read_text()) | {
                            "run": run_no, "link": link,
                            "link_bytes_per_step": (sent() - bytes0) / steps}
                        results.append(r)
                        wire = (f"{r['link_bytes_per_step'] / 1e3:.0f} kB/step on the links, "
                                if link else "")
                        print(f"{model} pp {pp} {LABELS[method]} run {run_no}: {steps} "
                              f"steps, mean step {1e3 * mean_step(r):.1f} ms, {wire}"
                              f"job {time.perf_counter() - t0:.0f} s", flush=True)
    report(results, per_epoch)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    print(f"plot: {plot(results, out_dir)}")


if __name__ == "__main__":
    main()
