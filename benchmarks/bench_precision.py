"""Loss curves of the demo GPT in bf16 and fp16 against fp32: a correctness figure.

    .venv/bin/python benchmarks/bench_precision.py            # 400 steps, ~20 min here

Trains ``configs/gpt-shakespeare.toml`` (the demo) on one rank once per precision,
from the same seed and batches, and prints each low precision's gap to the fp32
curve: the largest and the mean absolute difference of the training loss over every
step, the same over a moving mean of ``--window`` steps (the batch noise averaged
out, what the tolerance of ``tests/test_precision.py`` is stated on), and the gap of
the validation loss at each evaluation. Also the bytes of one batch's forward cache
(the activations kept for backward) in each precision. No timing: the machine is
shared, and the figure is about the numbers.
"""

from __future__ import annotations

import click
import numpy as np
from mpi4py import MPI

import hpctrain  # noqa: F401  (before NumPy: OpenBLAS's thread timeout)
from hpctrain import precision
from hpctrain.config import load
from hpctrain.models.build import build_model
from hpctrain.runtime import set_blas_threads
from hpctrain.train import train


def moving_mean(values: list[float], window: int) -> np.ndarray:
    """The mean of each run of ``window`` consecutive values (len - window + 1 of them)."""
    v = np.asarray(values, np.float64)
    if window <= 1 or len(v) < window:
        return v
    c = np.cumsum(np.r_[0.0, v])
    return (c[window:] - c[:-window]) / window


def loss_gaps(reference: list[float], other: list[float], window: int = 20) -> dict:
    """Absolute differences of two loss curves: per step and over a moving mean."""
    ref, oth = np.asarray(reference), np.asarray(other)
    if ref.shape != oth.shape:
        raise ValueError(f"curves of {ref.shape} and {oth.shape} steps")
    step = np.abs(oth - ref)
    smooth = np.abs(moving_mean(other, window) - moving_mean(reference, window))
    return {"max": float(step.max()), "mean": float(step.mean()),
            "smooth_max": float(smooth.max()), "smooth_mean": float(smooth.mean()),
            "final": float(oth[-1] - ref[-1])}


def cache_bytes(cfg, name: str) -> int:
    """Bytes of the demo model's forward cache for one batch in precision ``name``."""
    m = cfg.model
    model = build_model(m, cfg.train.seed)
    precision.apply(model, name)
    idx = np.random.default_rng(0).integers(0, m.vocab_size, (cfg.train.batch_size,
                                                               m.seq_len))
    _, cache = model.forward(idx, idx)
    return precision.nbytes(cache)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", default="configs/gpt-shakespeare.toml",
              show_default=True, help="The run to train in each precision.")
@click.option("--steps", default=400, show_default=True, help="Training steps per run.")
@click.option("--precisions", default="bf16,fp16", show_default=True,
              help="Comma-separated precisions to compare with fp32.")
@click.option("--window", default=20, show_default=True,
              help="Steps in the moving mean of the smoothed gap.")
@click.option("--out", default="runs/bench-precision", show_default=True,
              help="Run folders go under here, one per precision.")
def main(config_path, steps, precisions, window, out):
    """Train the demo GPT per precision; print the loss gaps to fp32."""
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 1:
        raise click.UsageError("run on one rank: the curves are compared serially")
    set_blas_threads(1)
    names = ["fp32", *[p for p in precisions.split(",") if p and p != "fp32"]]
    runs = {}
    for name in names:
        cfg = load(config_path, {"train.steps": steps, "train.precision": name,
                                 "train.run_dir": f"{out}/{name}",
                                 "train.log_interval": max(steps // 4, 1)}).validate(1)
        click.echo(f"== {name}: {steps} steps of {config_path}")
        summary = train(cfg, comm, quiet=True)
        runs[name] = (cfg, summary)
        click.echo(f"   final loss {summary.losses[-1]:.4f}, val {summary.val_losses[-1]:.4f}")
    ref_cfg, ref = runs["fp32"]
    click.echo(f"\ngap to fp32 over {steps} steps (moving mean of {window} steps for "
               f"'smoothed'); cache bytes of one batch's forward")
    click.echo(f"{'precision':<10} {'max':>8} {'mean':>8} {'smooth max':>11} "
               f"{'smooth mean':>12} {'final':>8} {'val max':>8} {'cache MiB':>10}")
    for name in names:
        cfg, s = runs[name]
        g = loss_gaps(ref.losses, s.losses, window)
        val = max(abs(a - b) for a, b in zip(s.val_losses, ref.val_losses, strict=True))
        mib = cache_bytes(cfg, name) / 2**20
        click.echo(f"{name:<10} {g['max']:8.4f} {g['mean']:8.4f} {g['smooth_max']:11.4f} "
                   f"{g['smooth_mean']:12.4f} {g['final']:+8.4f} {val:8.4f} {mib:10.2f}")


if __name__ == "__main__":
    main()
