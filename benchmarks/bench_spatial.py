"""Spatial parallelism: the memory of one training step on each rank, at sp = 1, 2, 4.

    python benchmarks/bench_spatial.py --sizes 1,2,4              # the driver: one table
    python benchmarks/bench_spatial.py --sizes 1,2,4 --crop 64
    mpiexec -n 2 python benchmarks/bench_spatial.py               # one size: sp = ranks

Every rank of the job is one rank of the spatial group (sp = the number of ranks,
dp = 1): each holds a slab of depth (seg3d) or of rows (cnn) of every activation of
the same ``--batch`` samples, at the shapes of the benchmark config
(``hpctrain.bench.BENCH_MODELS``, with ``--crop``, ``--channels``, ``--batch``). For
one training step it measures, on each rank:

1. **activations**: the bytes the model's forward keeps for backward,
   ``hpctrain.parallel.tensor.activation_nbytes`` of the cache ``forward`` returns
   (every floating-point array, each memory block once). At sp > 1 the slabs carry
   their halos, so a rank keeps more than 1 / sp of the serial figure;
2. **peak**: the peak of Python and NumPy allocations during forward and backward
   (``tracemalloc``: NumPy reports its allocations to it), counted from the start of
   the step, after a warm-up step: activations, their gradients and every temporary,
   not the parameters, gradients or batch, which exist before the step. MPI's own
   buffers are not Python allocations and are not counted;
3. **time**: the median step (forward and backward of ``engine.model``, without the
   spatial sum of the gradients that ``SpatialEngine.backward`` adds), of the slowest
   rank, measured without tracemalloc, with freed memory kept in the process as
   ``train`` keeps it. Ranks share this machine's cores: sp = 4 on 2 cores runs two
   ranks a core, so the time is indicative only.

Memory is reported as the maximum over ranks, in MiB, and as a fraction of sp = 1.

The input is random: uniform floats for the images and uniform labels of the right
shape (memory and time do not depend on the values, and no dataset is read).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import click
import numpy as np

MIB = 2**20


def step_config(model: str, sp: int, *, batch: int, crop: int, channels: tuple[int, ...]):
    """The benchmark config of ``model`` at sp = ``sp`` ranks (dp = 1), validated."""
    from hpctrain import config as config_mod
    from hpctrain.bench import BENCH_MODELS

    raw = {section: dict(values) for section, values in BENCH_MODELS[model].config.items()}
    raw["model"] |= {"channels": list(channels)}
    if model == "seg3d":
        raw["model"] |= {"crop": [crop] * 3}
    raw["train"] |= {"batch_size": batch}
    raw["parallel"] = {"dp": 1, "sp": sp}
    return config_mod.from_dict(raw, source=f"bench_spatial {model}").validate(sp)


def random_batch(cfg, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Images and labels of the model's shapes: seg3d x (B, 1, D, H, W), y (B, D, H, W);
    cnn x (B, input_dim), y (B,)."""
    m, b = cfg.model, cfg.train.batch_size
    if m.kind == "seg3d":
        x = rng.random((b, 1, *m.crop), dtype=np.float32)
        y = rng.integers(0, m.n_classes, (b, *m.crop))
    else:
        x = rng.random((b, m.input_dim), dtype=np.float32)
        y = rng.integers(0, m.n_classes, b)
    return x, y


def measure(model: str, *, batch: int, crop: int, channels: tuple[int, ...],
            steps: int) -> dict | None:
    """One step's memory and time on every rank of COMM_WORLD (the spatial group);
    rank 0 returns the figures. Collective."""
    from mpi4py import MPI

    from hpctrain.bench import timed_on_all_ranks
    from hpctrain.parallel.engine import build_engine
    from hpctrain.parallel.tensor import activation_nbytes
    from hpctrain.parallel.topology import Topology
    from hpctrain.runtime import keep_freed_memory, set_blas_threads, startup_check
    from hpctrain.slurm.placement import blas_threads_per_rank

    comm = MPI.COMM_WORLD
    sp = comm.Get_size()
    cfg = startup_check(comm, lambda: step_config(model, sp, batch=batch, crop=crop,
                                                  channels=channels))
    set_blas_threads(blas_threads_per_rank(sp))
    keep_freed_memory()  # as train() does: a step reuses the last one's pages
    topo = Topology.build(comm, cfg.parallel)
    engine = build_engine(cfg, topo)
    x, y = random_batch(cfg, np.random.default_rng(0))  # the same batch on every rank

    def step() -> int:
        _, cache = engine.model.forward(x, y)
        kept = activation_nbytes(cache)
        engine.model.backward(cache)
        return kept

    kept = step()  # warm-up: first-touch, the layers' own buffers
    seconds = timed_on_all_ranks(comm, step, steps)
    tracemalloc.start()
    comm.Barrier()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    step()
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    ranks = comm.gather((kept, peak), root=0)
    topo.free()
    if comm.Get_rank() != 0:
        return None
    return {"model": model, "sp": sp, "ranks": sp, "batch": batch, "channels": list(channels),
            "shape": list(cfg.model.crop) if model == "seg3d" else cfg.model.input_dim,
            "activation_bytes": max(k for k, _ in ranks),
            "activation_bytes_per_rank": [k for k, _ in ranks],
            "peak_bytes": max(p for _, p in ranks), "peak_bytes_per_rank": [p for _, p in ranks],
            "step_time_s": seconds}


def table(rows: list[dict]) -> str:
    """One line per size; memory as MiB per rank (max over ranks) and fraction of sp=1."""
    base = next((r for r in rows if r["sp"] == 1), None)

    def of_serial(r: dict, key: str) -> str:
        return f"{r[key] / base[key]:>7.4f}" if base else f"{'-':>7}"

    head = (f"{'sp':>3} {'ranks':>5} {'act MiB':>8} {'of sp=1':>7} {'peak MiB':>9} "
            f"{'of sp=1':>7} {'1/sp':>5} {'ms/step':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['sp']:>3} {r['ranks']:>5} {r['activation_bytes'] / MIB:>8.1f} "
                     f"{of_serial(r, 'activation_bytes')} {r['peak_bytes'] / MIB:>9.1f} "
                     f"{of_serial(r, 'peak_bytes')} {1 / r['sp']:>5.2f} "
                     f"{1e3 * r['step_time_s']:>8.0f}")
    return "\n".join(lines)


def describe(r: dict) -> str:
    shape = (f"crop {'x'.join(map(str, r['shape']))}" if r["model"] == "seg3d"
             else f"input_dim {r['shape']}, image_pad 2")
    return (f"{r['model']}: channels {r['channels']}, {shape}, batch {r['batch']} "
            f"(every rank the same samples), float32, one step forward + backward")


def drive(sizes: list[int], args: list[str], timeout: int) -> list[dict]:
    """Run this script under ``mpiexec -n s`` for each size ``s``; their figures."""
    from hpctrain.runtime import UserError, find_mpiexec

    try:
        launcher = find_mpiexec()
    except UserError as err:
        raise click.UsageError(str(err)) from None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for s in sizes:
            out = Path(tmp) / f"sp{s}.json"
            cmd = [launcher, "-n", str(s), sys.executable, str(Path(__file__).resolve()),
                   *args, "--json", str(out)]
            click.echo(f"== sp = {s} ...", err=True)
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, timeout=timeout)
            except subprocess.TimeoutExpired:
                raise click.ClickException(f"sp = {s} took more than {timeout} s") from None
            if proc.returncode != 0:
                raise click.ClickException(f"sp = {s} failed (exit status {proc.returncode}): "
                                           f"{' '.join(cmd)}")
            click.echo(f"   {time.perf_counter() - t0:.0f} s", err=True)
            rows.append(json.loads(out.read_text()))
    return rows


def _sizes(ctx, param, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        sizes = [int(v) for v in value.split(",")]
    except ValueError:
        raise click.BadParameter(f"{value!r} must be sizes separated by commas") from None
    if not sizes or min(sizes) < 1:
        raise click.BadParameter(f"sizes ({value}) must be at least 1")
    return sizes


def _channels(ctx, param, value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        return tuple(int(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r} must be widths separated by commas") from None


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", default="seg3d", show_default=True,
              type=click.Choice(["seg3d", "cnn"]),
              help="The 3-D U-Net, or the Fashion-MNIST CNN (images padded to 32 x 32).")
@click.option("--crop", default=32, show_default=True, type=click.IntRange(min=1),
              help="seg3d: side of the cubic crop (32, 64, ...).")
@click.option("--batch", type=click.IntRange(min=1),
              help="Samples a step, on every rank alike (default: the benchmark config's, "
                   "4 crops or 128 images).")
@click.option("--channels", callback=_channels, default=None,
              help="Widths, comma-separated (default: the benchmark config's, 8,16,32 "
                   "or 16,32).")
@click.option("--steps", default=3, show_default=True, type=click.IntRange(min=1),
              help="Timed steps (after one warm-up step); the median is printed.")
@click.option("--sizes", callback=_sizes,
              help="Driver: run under mpiexec -n S for each S of this list (e.g. 1,2,4) "
                   "and print one table. Without it: one size, the ranks of this job.")
@click.option("--timeout", default=900, show_default=True, type=click.IntRange(min=1),
              help="Driver: seconds one size may take before it is killed.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False),
              help="Also write rank 0's figures there (what the driver reads).")
def main(model, crop, batch, channels, steps, sizes, timeout, json_path):
    """Activation and peak memory per rank of one training step, at sp = the ranks."""
    from hpctrain.bench import BENCH_MODELS

    config = BENCH_MODELS[model].config
    batch = batch or config["train"]["batch_size"]
    channels = channels or tuple(config["model"]["channels"])
    if sizes is not None:
        args = ["--model", model, "--crop", str(crop), "--batch", str(batch),
                "--channels", ",".join(map(str, channels)), "--steps", str(steps)]
        rows = drive(sizes, args, timeout)
        click.echo(describe(rows[0]))
        click.echo(table(rows))
        return
    from mpi4py import MPI

    from hpctrain.runtime import abort_on_error

    with abort_on_error(MPI.COMM_WORLD):  # one rank's error ends the job, not a hang
        row = measure(model, batch=batch, crop=crop, channels=channels, steps=steps)
    if row is not None:
        if json_path:
            Path(json_path).write_text(json.dumps(row, indent=2))
        else:
            click.echo(describe(row))
            click.echo(table([row]))


if __name__ == "__main__":
    main()
