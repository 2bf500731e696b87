"""``hpctrain bench``: a benchmark model at each layout, one MPI job per layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import click

from hpctrain import bench, clitypes
from hpctrain.config import ConfigError
from hpctrain.runtime import EXIT_INTERRUPTED, EXIT_USER_ERROR


class LayoutRefused(click.ClickException):
    """A layout's job ended with the status of a user error (its ranks said why)."""

    exit_code = 2


def _default_layouts() -> str:
    return "; ".join(f"{name}: {', '.join(m.layouts)}" for name, m in bench.BENCH_MODELS.items())


def _default_data() -> str:
    return ", ".join(f"{name}: {m.config['data']['path']}"
                     for name, m in bench.BENCH_MODELS.items())


def _default_out(model: str) -> str:
    return "runs/bench" if model == "gpt" else f"runs/bench-{model}"


@click.command(name="bench")
@click.option("--model", default="gpt", show_default=True,
              type=click.Choice(list(bench.BENCH_MODELS)),
              help="Benchmark model: the GPT (6 layers, or gpt-large: 12), the "
                   "Fashion-MNIST CNN or the 3-D U-Net.")
@click.option("--layout", "layouts", multiple=True, type=click.Choice(list(bench.LAYOUTS)),
              help=f"Layout to run (repeatable; default: the model's, {_default_layouts()}).")
@click.option("--data", type=click.Path(dir_okay=False),
              help=f"Dataset to train on (default: the model's, {_default_data()}; "
                   f"make data prepares them).")
@click.option("--steps", default=12, show_default=True, type=click.IntRange(min=2),
              help="Training steps per layout, warm-up included.")
@click.option("--warmup", default=2, show_default=True, type=click.IntRange(min=0),
              help="First steps left out of the figures (allocation, caches).")
@click.option("--out", type=click.Path(file_okay=False),
              help="Folder for each layout's run, LAYOUT.json and bench.json (default: "
                   "runs/bench for the GPT, runs/bench-MODEL for the others).")
@click.option("--trace", is_flag=True,
              help="Also write each layout's Chrome trace (OUT/LAYOUT/trace.json).")
@click.option("--row-threads", default=0, show_default=True, type=click.IntRange(min=0),
              help="Element-wise threads per rank (0: as many as BLAS threads; 1 turns "
                   "the threaded GELU, softmax and AdamW off, for comparison).")
@click.option("--mpiexec", help="MPI launcher (default: the one beside this Python).")
@click.option("--timeout", default=900, show_default=True, type=click.IntRange(min=1),
              help="Seconds one layout may take before it is killed.")
def bench_command(model: str, layouts: tuple[str, ...], data: str | None, steps: int,
                  warmup: int, out: str | None, trace: bool, row_threads: int,
                  mpiexec: str | None, timeout: int) -> None:
    """Throughput, model FLOP/s and MFU of a benchmark model at each layout.

    The benchmark GPT (default): 6 layers, d_model 384, 6 heads, sequence 256,
    vocabulary 256, global batch 8; layouts serial, serial-split (one rank, its batch
    split over its threads: [parallel] batch_threads), dp2, tp2, pp2. gpt-large: 12
    layers, d_model 768, 12 heads, the rest the same; serial, serial-split, dp2. The CNN: the
    Fashion-MNIST classifier (channels 16, 32; images padded to 32 x 32), global batch
    128; the 3-D U-Net (seg3d): channels 8, 16, 32 on 32^3 crops of MNI152, global
    batch 4; both at serial, dp2 and sp2 (spatial parallelism, 2 slabs). Throughput
    is tokens/s for the GPT, samples/s (images, crops) for the others. Each layout
    runs as its own MPI job on this machine; every rank measures its float32 GEMM rate
    before the first step and after each step. A step's MFU is its model FLOP/s over
    the sum of the rates measured around it, and MFU is the median over the timed
    steps. The time breakdown (mean over ranks, % of the step) splits each step into
    compute, tensor-parallel communication, spatial halo transfers, pipeline waits,
    exposed data-parallel communication, optimizer, data and the rest.

    \b
    Examples:
      hpctrain bench
      hpctrain bench --layout serial --layout dp2 --steps 20
      hpctrain bench --model seg3d --layout sp2 --trace
      hpctrain bench --layout pp2 --trace && hpctrain plot runs/bench/pp2 \\
          --trace runs/bench/pp2/trace.json
    """
    if steps <= warmup:
        raise click.BadParameter(f"steps ({steps}) must exceed warmup ({warmup})",
                                 param_hint="--steps")
    spec = bench.BENCH_MODELS[model]
    data = data or spec.config["data"]["path"]
    out = out or _default_out(model)
    layouts = layouts or spec.layouts
    for layout in layouts:  # every layout's config, before anything runs
        try:
            bench.layout_config(layout, data=data, steps=steps, run_dir=out, model=model)
        except ConfigError as err:
            raise click.BadParameter(f"the {model} benchmark cannot run layout {layout}: "
                                     f"{err}", param_hint="--layout") from None
    if not Path(data).is_file():
        raise click.BadParameter(f"{data} does not exist (prepare it with: make data)",
                                 param_hint="--data")
    launcher = clitypes.launcher(mpiexec)
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise click.BadParameter(f"{out}: cannot be made ({err.strerror or err})",
                                 param_hint="--out") from None
    results = []
    for layout in layouts:
        ranks = bench.LAYOUTS[layout][0]
        click.echo(f"== {model} {layout}: {ranks} rank(s), {steps} steps ...", err=True)
        cmd = [launcher, "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m",
               "hpctrain.bench", layout, "--model", model, "--data", data,
               "--steps", str(steps), "--warmup", str(warmup), "--out", out,
               "--row-threads", str(row_threads)]
        cmd += ["--trace"] if trace else []
        env = {k: v for k, v in os.environ.items()
               if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}  # ranks choose
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise click.ClickException(f"layout {layout} took more than {timeout} s") from None
        except KeyboardInterrupt:  # Ctrl-C reached the layout's job as well
            click.echo(f"interrupted during layout {layout}", err=True)
            sys.exit(EXIT_INTERRUPTED)
        if proc.returncode == EXIT_USER_ERROR:
            raise LayoutRefused(f"layout {layout} refused its input (status 2; its ranks' "
                                f"message is above)")
        if proc.returncode == EXIT_INTERRUPTED:
            click.echo(f"interrupted during layout {layout}", err=True)
            sys.exit(EXIT_INTERRUPTED)
        if proc.returncode != 0:
            raise click.ClickException(f"layout {layout} failed (exit status "
                                       f"{proc.returncode}): {' '.join(cmd)}")
        result = json.loads(Path(out, f"{layout}.json").read_text())
        click.echo(f"   {layout}: {result['mfu']:.1%} MFU, {time.perf_counter() - t0:.0f} s",
                   err=True)
        results.append(result)
    summary = Path(out) / "bench.json"
    summary.write_text(json.dumps({"model": spec.config["model"],
                                   "global_batch": spec.config["train"]["batch_size"],
                                   "results": results}, indent=2))
    click.echo(bench.table(results))
    click.echo(f"\nfigures in {summary}")
