"""Forward and backward of the benchmark GPT in one process, for comparing kernels.

Each step (forward and backward on fixed random tokens: no optimizer, no data) is
rated against the mean of two GEMM probes, one just before it and one just after, as
`hpctrain bench` does. The script prints the median MFU and step time over the timed steps.
This machine's speed drifts from minute to minute, so compare two versions of a
kernel by running them in turn, several times each:

    for i in 1 2 3; do
        python benchmarks/bench_step.py                             # as the code runs
        OPENBLAS_THREAD_TIMEOUT=0 python benchmarks/bench_step.py   # OpenBLAS's default spin
    done

NumPy is imported only after hpctrain, so OpenBLAS starts with the package's
``OPENBLAS_THREAD_TIMEOUT`` unless the environment sets another.
"""

from __future__ import annotations

import statistics
import time

import click

from hpctrain.bench import (
    BENCH_CONFIG,
    GemmProbe,
    layout_config,
    model_flops,
    peaks_around_steps,
)
from hpctrain.models.build import build_model
from hpctrain.runtime import blas_thread_timeout, keep_freed_memory, set_blas_threads


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--steps", default=6, show_default=True, type=click.IntRange(min=1),
              help="Timed steps, after two untimed ones.")
@click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1),
              help="BLAS and element-wise threads.")
def main(steps: int, threads: int) -> None:
    """Print the median MFU and step time of the benchmark GPT's forward and backward."""
    import numpy as np

    keep_freed_memory()
    set_blas_threads(threads)
    cfg = layout_config("serial", data=BENCH_CONFIG["data"]["path"], steps=steps,
                        run_dir="unused")
    model = build_model(cfg.model, cfg.train.seed)
    rng = np.random.default_rng(0)
    shape = (cfg.train.batch_size, cfg.model.seq_len)
    x, y = (rng.integers(0, cfg.model.vocab_size, shape) for _ in range(2))
    flops = model_flops(cfg.model, cfg.train.batch_size)
    probe = GemmProbe()

    def step() -> float:
        model.zero_grad()
        t0 = time.perf_counter()
        _, cache = model.forward(x, y)
        model.backward(cache)
        return time.perf_counter() - t0

    for _ in range(2):  # allocation, caches
        step()
    probes, times = [[probe.rate()]], []  # before the first step, then after each
    for _ in range(steps):
        times.append(step())
        probes.append([probe.rate()])
    ratios = [flops / seconds / peak
              for seconds, peak in zip(times, peaks_around_steps(probes), strict=True)]
    click.echo(f"MFU {100 * statistics.median(ratios):.1f}% (steps "
               f"{min(ratios) * 100:.1f}-{max(ratios) * 100:.1f}%), "
               f"{1e3 * statistics.median(times):.0f} ms/step, {threads} thread(s), "
               f"OPENBLAS_THREAD_TIMEOUT {blas_thread_timeout()}")


if __name__ == "__main__":
    main()
