"""A benchmark model at several layouts: throughput, model FLOP/s and MFU against the
GEMM peak each rank measures in the same run, and where the step time goes.

    hpctrain bench [--model M]            the driver: one MPI job per layout, the table
    python -m mpi4py -m hpctrain.bench    one layout, on the ranks of an MPI job

The benchmark models (``BENCH_MODELS``), each float32, AdamW, evaluation off:

    gpt     6 layers, d_model 384, 6 heads, sequence 256, vocabulary 256, global batch
            8 sequences (2,048 tokens a step); layouts serial, serial-split, dp2, tp2,
            pp2 (serial-split: one rank, its batch split over its threads)
    gpt-large  12 layers, d_model 768, 12 heads (85M parameters), the rest as gpt;
            layouts serial, serial-split, dp2 (the larger model of
            benchmarks/bench_peer.py)
    cnn     the Fashion-MNIST classifier, channels [16, 32], images padded to 32 x 32,
            global batch 128 images; layouts serial, dp2, sp2
    seg3d   the 3-D U-Net, channels [8, 16, 32], 3 classes, 32^3 crops of MNI152,
            global batch 4 crops; layouts serial, dp2, sp2

Throughput is in tokens/s for a sequence model (``Model.sample_len``), in samples/s
(images, crops) for the others. A layout a model cannot run (tp2 for the CNN) is the
config's own error (``Config.validate``), raised before anything runs.

Model FLOPs of a step (``model_flops``) are what the model declares
(``Model.model_flops``, ``hpctrain.models.protocol``): the matrix products it defines,
forward ``2 m n k`` per product, backward twice the forward. For the GPT:

    per token and layer, forward:  2 (3 C^2 + C^2 + 2 C F)    qkv, proj, fc, fc-proj
                                   + 2 (2 T C)                 S = q k^T and P v
    per token, head:               2 C V

with ``C`` = d_model, ``F`` = the MLP width, ``T`` = sequence length, ``V`` =
vocabulary. Attention counts the whole ``T x T`` products, the masked half included,
because the batched products compute them. The same count holds at every layout: MFU
says how much of the machine's matrix-multiply rate the *model* gets, so recomputation,
communication and bubbles all lower it.

MFU compares each step with the machine's matrix-multiply rate *at that moment*: every
rank measures its float32 GEMM rate (with its own BLAS threads, all ranks at once)
before the first step and again after every step, outside the step's timing. A step's
peak is the mean of the probes just before and just after it, summed over ranks, and

    MFU = median over the timed steps of (model FLOPs of a step / step time) / its peak

A shared machine's rate drifts by 20% over seconds; one probe before the run would
make the figure depend on the moment it was taken.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from hpctrain import config as config_mod
from hpctrain.config import ModelConfig

BENCH_CONFIG: dict[str, dict[str, Any]] = {
    "model": {"kind": "gpt", "vocab_size": 256, "seq_len": 256, "n_layer": 6,
              "n_head": 6, "d_model": 384, "dtype": "float32"},
    "train": {"batch_size": 8, "optimizer": "adamw", "lr": 3e-4, "warmup_steps": 2,
              "eval_interval": 0, "log_interval": 1, "seed": 1234},
    "data": {"path": "data/shakespeare.h5"},
}

# name -> (ranks, parallel overrides)
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "serial": (1, {}),
    # one rank, its batch split over its threads (hpctrain.parallel.batch_threads)
    "serial-split": (1, {"batch_threads": 0}),
    "dp2": (2, {"dp": 2}),
    "tp2": (2, {"tp": 2}),
    "pp2": (2, {"pp": 2, "microbatches": 4, "schedule": "1f1b"}),
    "sp2": (2, {"sp": 2}),
}


@dataclass(frozen=True)
class BenchModel:
    """A benchmark model: its config (the sections of ``config.from_dict``, without
    ``[parallel]``: the layout gives it) and the layouts ``hpctrain bench`` runs."""

    config: dict[str, dict[str, Any]]
    layouts: tuple[str, ...]


def _convolutional(model: dict[str, Any], batch_size: int, data: str) -> dict[str, dict]:
    """A convolutional benchmark config: the GPT's optimizer settings, another model,
    batch and dataset."""
    return {"model": {"dtype": "float32", **model},
            "train": BENCH_CONFIG["train"] | {"batch_size": batch_size},
            "data": {"path": data}}


BENCH_MODELS: dict[str, BenchModel] = {
    "gpt": BenchModel(BENCH_CONFIG, ("serial", "serial-split", "dp2", "tp2", "pp2")),
    "gpt-large": BenchModel(BENCH_CONFIG | {"model": BENCH_CONFIG["model"]
                                            | {"n_layer": 12, "n_head": 12, "d_model": 768}},
                            ("serial", "serial-split", "dp2")),
    # image_pad 2: 28 x 28 -> 32 x 32, so sp2 halves every stage's rows (at all layouts,
    # so that the rows compare the same model)
    "cnn": BenchModel(_convolutional({"kind": "cnn", "input_dim": 784, "image_pad": 2,
                                      "channels": [16, 32], "n_classes": 10},
                                     128, "data/fashion-mnist.h5"),
                      ("serial", "dp2", "sp2")),
    "seg3d": BenchModel(_convolutional({"kind": "seg3d", "channels": [8, 16, 32],
                                        "n_classes": 3, "crop": [32, 32, 32]},
                                       4, "data/mni152.h5"),
                        ("serial", "dp2", "sp2")),
}

GEMM_N = 2048  # the peak's square matrices: large enough for BLAS to reach its rate


def model_flops(m: ModelConfig, sequences: int) -> float:
    """FLOPs of one training step (forward + backward) over ``sequences`` samples (of
    m.seq_len tokens for the GPT), as the registered model of ``m.kind`` declares."""
    from hpctrain.models.registry import model_class

    return model_class(m.kind).model_flops(m, sequences)


class GemmProbe:
    """This process's float32 ``(n, n) @ (n, n)`` rate; the matrices are made once."""

    def __init__(self, n: int = GEMM_N):
        rng = np.random.default_rng(0)
        self.n = n
        self.a = rng.standard_normal((n, n), dtype=np.float32)
        self.b = rng.standard_normal((n, n), dtype=np.float32)
        self.out = np.empty((n, n), np.float32)

    def rate(self, repeats: int = 3) -> float:
        """The best FLOP/s over ``repeats`` products, after one warm-up product."""
        np.matmul(self.a, self.b, out=self.out)  # warm-up: threads started, caches filled
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            np.matmul(self.a, self.b, out=self.out)
            best = min(best, time.perf_counter() - t0)
        return 2.0 * self.n**3 / best


def peaks_around_steps(probes: list[list[float]]) -> list[float]:
    """Each step's peak, from GEMM probes taken before the first step and after every
    step (each a list over ranks): the mean of the summed probes just before and just
    after it."""
    return [0.5 * (sum(before) + sum(after)) for before, after in pairwise(probes)]


def timed_on_all_ranks(comm: Any, fn, repeats: int, setup=None) -> float:
    """Median seconds of ``fn()`` over ``repeats``, each the slowest rank's time; every
    rank starts together (``setup()`` runs first, untimed). Collective over ``comm``."""
    from mpi4py import MPI

    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return statistics.median(times)


def layout_config(layout: str, *, data: str, steps: int, run_dir: str, row_threads: int = 0,
                  model: str = "gpt"):
    """The config of benchmark model ``model`` (``BENCH_MODELS``) at one of ``LAYOUTS``,
    validated for its rank count: a layout the model cannot run raises ConfigError."""
    if model not in BENCH_MODELS:
        raise ValueError(f"model ({model!r}) must be one of {', '.join(BENCH_MODELS)}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout ({layout!r}) must be one of {', '.join(LAYOUTS)}")
    ranks, parallel = LAYOUTS[layout]
    raw = {section: dict(values) for section, values in BENCH_MODELS[model].config.items()}
    raw["parallel"] = dict(parallel)
    raw["train"] |= {"steps": steps, "run_dir": run_dir, "row_threads": row_threads}
    raw["data"] |= {"path": data}
    return config_mod.from_dict(raw, source=f"benchmark {model} at layout {layout}"
                                ).validate(ranks)


def throughput_unit(m: ModelConfig) -> tuple[str, str, int]:
    """The throughput's key in the figures, its column, and what one sample counts:
    tokens for a sequence model (``Model.sample_len``), samples (images, crops) else."""
    from hpctrain.models.registry import model_class

    per_sample = model_class(m.kind).sample_len(m)
    if per_sample is None:
        return "samples_per_s", "samp/s", 1
    return "tokens_per_s", "tok/s", per_sample


def summarise(records: list[dict], warmup: int, flops: float, first_peaks: list[float],
              tokens: int, per_s: str = "tokens_per_s") -> dict[str, Any]:
    """The figures of one layout from its per-step records (steps after ``warmup``).

    ``first_peaks``: each rank's GEMM rate measured before step 1; every step's record
    carries ``gemm_flops_per_rank``, measured after it (see the module's MFU).
    ``tokens``: the tokens (or samples) of a step, a rate under the key ``per_s``.
    """
    steps = [r for r in records if "loss" in r]
    probes = [first_peaks] + [r["gemm_flops_per_rank"] for r in steps]  # before, after each
    timed = [(r, peak) for r, peak in zip(steps, peaks_around_steps(probes), strict=True)
             if r["step"] > warmup]
    if not timed:
        raise ValueError(f"no step after the {warmup} warm-up steps was recorded")
    step_s = statistics.median(r["step_time_s"] for r, _ in timed)
    mfu_per_step = [flops / r["step_time_s"] / peak for r, peak in timed]
    breakdown = {c: statistics.fmean(r["time_s"][c] for r, _ in timed)
                 for c in timed[0][0]["time_s"]}
    per_rank = [statistics.median(p[rank] for p in probes) for rank in range(len(first_peaks))]
    return {"steps_timed": len(timed), "step_time_s": step_s, per_s: tokens / step_s,
            "model_flops_per_step": flops, "model_flops_per_s": flops / step_s,
            "peak_flops_per_s": statistics.median(peak for _, peak in timed),
            "peak_flops_per_rank": per_rank, "mfu": statistics.median(mfu_per_step),
            "mfu_per_step": mfu_per_step,
            "time_s": breakdown, "final_loss": timed[-1][0]["loss"]}


def run_layout(comm: Any, layout: str, *, data: str, steps: int, warmup: int, out_dir: str,
               trace: bool = False, row_threads: int = 0, model: str = "gpt"
               ) -> dict[str, Any] | None:
    """Measure the GEMM peak on every rank at once, then train ``steps`` steps of the
    benchmark model ``model``; rank 0 writes and returns the layout's figures. Collective."""
    from hpctrain.runtime import blas_thread_timeout, set_blas_threads, startup_check
    from hpctrain.slurm.placement import blas_threads_per_rank
    from hpctrain.train import train

    run_dir = str(Path(out_dir) / layout)
    cfg = startup_check(comm, lambda: layout_config(layout, data=data, steps=steps,
                                                    run_dir=run_dir, row_threads=row_threads,
                                                    model=model))
    if comm.Get_size() != LAYOUTS[layout][0]:
        raise ValueError(f"layout {layout} needs {LAYOUTS[layout][0]} rank(s), "
                         f"not {comm.Get_size()}")
    # the same thread count train() will choose, for the peak as for the run
    threads = set_blas_threads(blas_threads_per_rank(_ranks_on_node(comm)))
    probe = GemmProbe()

    def probe_all_ranks() -> list[float]:  # every rank at once, as when training
        comm.Barrier()
        return comm.allgather(probe.rate())

    first_peaks = probe_all_ranks()
    if comm.Get_rank() == 0:  # the layout's run folder is this benchmark's scratch
        for name in ("metrics.jsonl", "config.json"):
            (Path(run_dir) / name).unlink(missing_ok=True)
    trace_path = str(Path(run_dir) / "trace.json") if trace else None
    train(cfg, comm, quiet=True, trace_path=trace_path,
          after_step=lambda: {"gemm_flops_per_rank": probe_all_ranks()})
    if comm.Get_rank() != 0:
        return None
    from hpctrain.metrics import read_metrics

    records = read_metrics(Path(run_dir) / "metrics.jsonl")
    per_s, _, per_sample = throughput_unit(cfg.model)
    result = {"model": model, "layout": layout, "ranks": comm.Get_size(),
              "blas_threads": threads, "row_threads": row_threads or threads,
              "blas_thread_timeout": blas_thread_timeout(),
              "parallel": LAYOUTS[layout][1], "warmup_steps": warmup,
              **summarise(records, warmup, model_flops(cfg.model, cfg.train.batch_size),
                          first_peaks, cfg.train.batch_size * per_sample, per_s)}
    if trace_path:
        result["trace"] = trace_path
    Path(out_dir, f"{layout}.json").write_text(json.dumps(result, indent=2))
    return result


def _ranks_on_node(comm: Any) -> int:
    """How many ranks of ``comm`` share this rank's node (collective), as ``train``
    counts them (``Topology.nodes.ranks_on_node``)."""
    from hpctrain.parallel.topology import split_node

    node = split_node(comm)
    n = node.Get_size()
    node.Free()
    return n


# ---------------------------------------------------------------------------------
# the table

COLUMNS = ("compute", "tp_comm", "halo", "pp_wait", "dp_comm", "optimizer", "data", "other")


def table(results: list[dict[str, Any]]) -> str:
    """The printed table: one row per layout (of one model); throughput in tokens/s for
    a sequence model, samples/s for the others (the key its figures carry); the
    breakdown in % of the mean step (the sum of its categories, averaged over ranks and
    timed steps)."""
    per_s, unit = (("tokens_per_s", "tok/s") if "tokens_per_s" in results[0]
                   else ("samples_per_s", "samp/s"))
    head = (f"{'layout':<12} {'ranks':>5} {'ms/step':>8} {unit:>7} {'GFLOP/s':>8} "
            f"{'peak':>6} {'MFU':>6} | " + " ".join(f"{c:>9}" for c in COLUMNS))
    lines = [head, "-" * len(head)]
    for r in results:
        step = r["step_time_s"]
        whole = sum(r["time_s"].values()) or 1.0  # the mean step the breakdown adds up to
        shares = " ".join(f"{100 * r['time_s'].get(c, 0.0) / whole:>8.1f}%" for c in COLUMNS)
        lines.append(f"{r['layout']:<12} {r['ranks']:>5} {1e3 * step:>8.0f} "
                     f"{r[per_s]:>7.0f} {r['model_flops_per_s'] / 1e9:>8.1f} "
                     f"{r['peak_flops_per_s'] / 1e9:>6.0f} {100 * r['mfu']:>5.1f}% | {shares}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """One layout on the ranks of this MPI job (what ``hpctrain bench`` launches)."""
    parser = argparse.ArgumentParser(prog="python -m mpi4py -m hpctrain.bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("layout", choices=list(LAYOUTS))
    parser.add_argument("--model", choices=list(BENCH_MODELS), default="gpt")
    parser.add_argument("--data", help="default: the model's dataset")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="runs/bench")
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--row-threads", type=int, default=0)
    args = parser.parse_args(argv)
    from mpi4py import MPI

    from hpctrain.runtime import abort_on_error

    comm = MPI.COMM_WORLD
    data = args.data or BENCH_MODELS[args.model].config["data"]["path"]
    with abort_on_error(comm):
        run_layout(comm, args.layout, data=data, steps=args.steps, warmup=args.warmup,
                   out_dir=args.out, trace=args.trace, row_threads=args.row_threads,
                   model=args.model)


if __name__ == "__main__":
    sys.exit(main())
