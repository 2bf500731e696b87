"""Local-loss pipeline training against end-to-end 1F1B backprop, same layout, one job.

    mpiexec -n 2 python benchmarks/bench_local_loss.py --epochs 3     # pp = 2

Every rank is one pipeline stage (pp = the number of ranks, dp = 1). Both methods
train the MLP of ``configs/mlp-fashion-mnist.toml`` with ``--hidden`` equal widths
(pipelining needs one activation shape) on Fashion-MNIST for ``--epochs`` epochs
through ``hpctrain.train.train``, the same seed, data order and learning-rate
schedule; they differ only in ``[parallel] pipeline_training``: "backprop" (1F1B) or
"local" (``hpctrain.parallel.local_loss``). The test set is evaluated after every
epoch. With ``--repeats 2`` the pair runs twice, the second time in the other order
(backprop, local, local, backprop), so a drift of the machine's speed falls on both.

Printed per method and run: the training seconds of each epoch (the sum of the
steps' ``step_time_s``: evaluation excluded), the test accuracy after each epoch,
and the load average before and after (the machine may be shared: compare methods
within one run of this command). ``OUT/accuracy.png``: test accuracy against the
training wall-clock time, one line per method and run; ``OUT/results.json`` the
figures.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import click
from mpi4py import MPI

import hpctrain  # noqa: F401  (before NumPy, which h5py loads: OPENBLAS_THREAD_TIMEOUT)
from hpctrain.config import load
from hpctrain.train import train

METHODS = ("backprop", "local")


def run_config(path: str, *, pp: int, hidden: tuple[int, ...], method: str, m: int,
               steps: int, per_epoch: int, run_dir: Path, seed: int):
    overrides = {"model.hidden": list(hidden), "parallel.pp": pp, "parallel.dp": 1,
                 "parallel.microbatches": m, "parallel.schedule": "1f1b",
                 "parallel.pipeline_training": method, "parallel.balance": "params",
                 "train.steps": steps, "train.eval_interval": per_epoch,
                 "train.log_interval": per_epoch, "train.save_interval": 0,
                 "train.run_dir": str(run_dir), "train.seed": seed}
    return load(path, overrides)


def epochs_of(run_dir: Path, per_epoch: int) -> list[dict]:
    """Per epoch: training seconds, cumulative seconds, test accuracy and loss."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if "step_time_s" in r}
    out, clock = [], 0.0
    for e in range(1, max(steps) // per_epoch + 1):
        seconds = sum(steps[s]["step_time_s"] for s in range((e - 1) * per_epoch + 1,
                                                            e * per_epoch + 1))
        clock += seconds
        end = steps[e * per_epoch]
        out.append({"epoch": e, "seconds": seconds, "clock": clock,
                    "accuracy": end.get("val_accuracy"), "val_loss": end.get("val_loss")})
    return out


def plot(results: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for r in results:
        xs = [0.0] + [e["clock"] for e in r["epochs"]]
        ys = [r["initial_accuracy"]] + [100 * e["accuracy"] for e in r["epochs"]]
        style = "-o" if r["method"] == "local" else "--s"
        ax.plot(xs, ys, style, label=f"{r['label']} (run {r['run']})")
    ax.set_xlabel("training wall-clock time (s)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(bottom=max(0.0, min(min(100 * e["accuracy"] for e in r["epochs"])
                                    for r in results) - 5))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"Fashion-MNIST MLP, pp = {results[0]['pp']}: local losses vs 1F1B backprop")
    path = out / "accuracy.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@click.command()
@click.option("--config", "config_path", default="configs/mlp-fashion-mnist.toml",
              show_default=True, help="The MLP config (model, train, data sections).")
@click.option("--epochs", default=3, show_default=True, help="Epochs per run.")
@click.option("--hidden", default="256,256,256,256,256", show_default=True,
              help="Hidden widths, equal (the activation between stages has one shape).")
@click.option("--microbatches", default=4, show_default=True, help="Microbatches per step.")
@click.option("--repeats", default=1, show_default=True,
              help="Pairs of runs; odd pairs run backprop first, even ones local first.")
@click.option("--out", default="runs/bench-local-loss", show_default=True,
              type=click.Path(file_okay=False), help="Folder for the runs, PNG and JSON.")
def main(config_path: str, epochs: int, hidden: str, microbatches: int, repeats: int,
         out: str) -> None:
    comm = MPI.COMM_WORLD
    rank, pp = comm.Get_rank(), comm.Get_size()
    if pp < 2:
        raise click.UsageError("run it with mpiexec -n 2 (or 4): one pipeline stage a rank")
    widths = tuple(int(h) for h in hidden.split(","))
    base = load(config_path)
    import h5py

    with h5py.File(base.data.path, "r") as f:
        n_train = len(f["train/labels"])
    per_epoch = n_train // base.train.batch_size
    out_dir = Path(out)
    results = []
    for run in range(1, repeats + 1):
        order = METHODS if run % 2 else METHODS[::-1]
        for method in order:
            run_dir = out_dir / f"{method}-{run}"
            if rank == 0 and run_dir.exists():
                shutil.rmtree(run_dir)
            comm.Barrier()
            cfg = run_config(config_path, pp=pp, hidden=widths, method=method,
                             m=microbatches, steps=epochs * per_epoch, per_epoch=per_epoch,
                             run_dir=run_dir, seed=base.train.seed).validate(pp)
            load_before = os.getloadavg()[0]
            summary = train(cfg, comm, quiet=True)
            if rank == 0:
                first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
                r = {"method": method, "run": run, "pp": pp, "microbatches": microbatches,
                     "hidden": list(widths), "label": "local losses" if method == "local"
                     else "1F1B backprop",
                     "initial_accuracy": 100 * first.get("val_accuracy", 0.0),
                     "epochs": epochs_of(run_dir, per_epoch), "total_s": summary.seconds,
                     "load_before": load_before, "load_after": os.getloadavg()[0]}
                results.append(r)
                per = " ".join(f"{e['seconds']:.1f}" for e in r["epochs"])
                acc = " ".join(f"{100 * e['accuracy']:.2f}" for e in r["epochs"])
                print(f"{r['label']:>14} run {run}: s/epoch {per} | test acc % {acc} | "
                      f"load {load_before:.2f} -> {r['load_after']:.2f}", flush=True)
    if rank == 0:
        print(f"\npp = {pp}, m = {microbatches}, hidden {list(widths)}, {per_epoch} steps an "
              f"epoch of {base.train.batch_size} images")
        for method in METHODS:
            mine = [r for r in results if r["method"] == method]
            mean_s = sum(e["seconds"] for r in mine for e in r["epochs"]) / sum(
                len(r["epochs"]) for r in mine)
            final = [100 * r["epochs"][-1]["accuracy"] for r in mine]
            print(f"{mine[0]['label']:>14}: {mean_s:.2f} s/epoch (mean), final test "
                  f"accuracy {', '.join(f'{a:.2f}%' for a in final)}")
        (out_dir / "results.json").write_text(json.dumps(results, indent=2))
        print(f"plot: {plot(results, out_dir)}")


if __name__ == "__main__":
    main()
