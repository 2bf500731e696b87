"""The pipeline bubble, measured, next to the theory ``(p - 1) / (v m + p - 1)``.

    mpiexec -n 4 python benchmarks/bench_bubble.py       # pp = 4, m in 4 8 16

Every rank is one pipeline stage (pp = the number of ranks, dp = tp = 1). For each
schedule and microbatch count it runs ``--repeats`` forward-backward steps of the
benchmark GPT, each microbatch ``--mb`` sequences (the work per microbatch stays the
same as m grows), and prints three measurements of the idle fraction, each the mean
over the ranks of idle time / step time.

The difficulty: this is meant to run with more ranks than cores (4 ranks, 2 cores).
Then the wall clock does not show the bubble: in the steady state all four ranks
compute and each gets half a core, in the warm-up only some do and get a whole one,
and MPICH polls while it waits, taking cycles from the ranks that compute. So the
work is measured in CPU time, and the timeline is rebuilt from it:

* every forward and backward records the CPU time it took (``time.thread_time``, in
  ``Stage.trace``); rank 0 gathers the traces and *replays* them along the
  schedule's real order and dependencies (``timeline.replay``: an operation starts
  when its rank is free and its input has arrived). That is the timeline of the same
  run with a core per rank and instant links.
* **stages** (the figure to read): each (forward or backward, model chunk) costs the
  median of its CPU times over all microbatches and steps. Sharing a core costs an
  operation up to ~20% at random here (another process evicts its caches, the host
  takes the virtual CPU away); replayed as measured, that noise lands in the bubble,
  as every wait waits for the slowest input. The median keeps what is systematic:
  unequal stages (embedding on the first, head and loss on the last; ``imbalance``
  is the busiest rank's work over the mean's), the forward/backward ratio.
* **ops**: each operation its least CPU time over the steps; less filtered, an upper
  bound on what a dedicated machine would show.
* **wall**: the engine's own metric (``bubble_fraction``: time waiting in receives,
  the final send-wait and the loss broadcast, over the step's wall time). On a core
  per rank this is the bubble; here it is shown for comparison only.

The theory assumes equal stages and free communication. 1F1B and GPipe share it
(1F1B holds p caches instead of m); interleaving divides the bubble by about v.
"""

from __future__ import annotations

import statistics

import click
from mpi4py import MPI

from hpctrain.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.timeline import bubble_theory, render, replay
from hpctrain.parallel.topology import Topology
from hpctrain.runtime import set_blas_threads


def bench_config(args, pp: int, m: int, schedule: str, v: int) -> Config:
    model = ModelConfig(dtype=args["dtype"], vocab_size=args["vocab"], seq_len=args["seq_len"],
                        n_layer=args["layers"], n_head=args["heads"], d_model=args["d_model"])
    par = ParallelConfig(dp=1, pp=pp, microbatches=m, schedule=schedule, virtual_stages=v)
    return Config(model=model, parallel=par,
                  train=TrainConfig(batch_size=m * args["mb"])).validate(pp)


def measure(comm, cfg: Config, repeats: int, rng_seed: int = 0) -> dict | None:
    """Bubble figures over ``repeats`` steps after one warm-up step (see the module
    docstring); collective over ``comm``, the figures returned on rank 0 only."""
    import numpy as np

    topo = Topology.build(comm, cfg.parallel)
    engine = build_engine(cfg, topo)
    rng = np.random.default_rng(rng_seed)
    shape = (cfg.train.batch_size, cfg.model.seq_len)
    x = rng.integers(0, cfg.model.vocab_size, shape)
    y = rng.integers(0, cfg.model.vocab_size, shape)
    steps, wall = [], []
    for step in range(repeats + 1):
        engine.zero_grad()
        comm.Barrier()
        engine.forward_backward(x, y)
        metrics = engine.metrics()  # collective over the pipeline
        traces = comm.gather(engine.stage.trace, root=0)
        if step > 0:  # step 0 warms up: first-touch allocations, the buffer pool
            steps.append(traces)
            wall.append(metrics["bubble_fraction"])
    topo.free()
    if comm.Get_rank() != 0:
        return None
    n_chunks = cfg.parallel.pp * cfg.parallel.virtual_stages
    # per operation: its least time over the steps
    per_op = [[(kind, k, i, min(s[r][j][3] for s in steps))
               for j, (kind, k, i, _) in enumerate(trace)] for r, trace in enumerate(steps[0])]
    # per stage: the median over every microbatch and step of (forward or backward, chunk)
    cost = {}
    for s in steps:
        for trace in s:
            for kind, k, _, seconds in trace:
                cost.setdefault((kind, k), []).append(seconds)
    cost = {key: statistics.median(times) for key, times in cost.items()}
    per_stage = [[(kind, k, i, cost[kind, k]) for kind, k, i, _ in ops] for ops in per_op]
    stage_tl = replay(per_stage, n_chunks)
    busy = [stage_tl.busy(r) for r in range(len(per_stage))]
    return {"stages": stage_tl.bubble(), "ops": replay(per_op, n_chunks).bubble(),
            "wall": statistics.median(wall), "imbalance": max(busy) / statistics.mean(busy) - 1,
            "peak": metrics["peak_live_caches"], "timeline": stage_tl}


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--layers", default=16, show_default=True, help="Transformer blocks.")
@click.option("--d-model", default=256, show_default=True, help="Model width C.")
@click.option("--heads", default=4, show_default=True, help="Attention heads.")
@click.option("--seq-len", default=128, show_default=True, help="Sequence length T.")
@click.option("--vocab", default=64, show_default=True, help="Vocabulary size V.")
@click.option("--mb", default=2, show_default=True, help="Sequences per microbatch.")
@click.option("--dtype", default="float32", show_default=True,
              type=click.Choice(["float32", "float64"]), help="Parameter dtype.")
@click.option("--microbatches", "ms", default="4,8,16", show_default=True,
              help="Comma-separated microbatch counts m.")
@click.option("--schedules", default="1f1b,gpipe,interleaved", show_default=True,
              help="Comma-separated schedules; interleaved runs with --virtual-stages.")
@click.option("--virtual-stages", default=2, show_default=True,
              help="Model chunks per rank for the interleaved schedule.")
@click.option("--repeats", default=5, show_default=True, help="Measured steps per case.")
@click.option("--show-timeline", is_flag=True, help="Print each case's replayed timeline.")
def main(ms: str, schedules: str, virtual_stages: int, repeats: int, show_timeline: bool,
         **args) -> None:
    """Measured pipeline bubble against (p - 1) / (v m + p - 1); pp = number of ranks."""
    comm = MPI.COMM_WORLD
    pp = comm.Get_size()
    set_blas_threads(1)
    if comm.Get_rank() == 0:
        print(f"pp = {pp}; GPT {args['layers']} layers, C = {args['d_model']}, "
              f"T = {args['seq_len']}, V = {args['vocab']}, {args['mb']} sequences per "
              f"microbatch, {args['dtype']}; {repeats} steps per case")
        print(f"{'schedule':>11} {'m':>3} {'v':>2} | {'theory':>6} {'stages':>6} {'vs theory':>9} "
              f"| {'ops':>6} {'wall':>6} | {'imbalance':>9} {'peak':>4}")
    for schedule in schedules.split(","):
        v = virtual_stages if schedule == "interleaved" else 1
        for m in (int(s) for s in ms.split(",")):
            if schedule == "interleaved" and m % pp:
                continue
            r = measure(comm, bench_config(args, pp, m, schedule, v), repeats)
            if r is None:
                continue
            theory = bubble_theory(pp, m, v)
            print(f"{schedule:>11} {m:3d} {v:2d} | {theory:6.3f} {r['stages']:6.3f} "
                  f"{(r['stages'] - theory) / theory:+9.1%} | {r['ops']:6.3f} {r['wall']:6.3f} "
                  f"| {r['imbalance']:+9.1%} {r['peak']:4d}", flush=True)
            if show_timeline:
                unit = min(end - start for spans in r["timeline"].spans
                           for start, end, *_ in spans)
                print(render(r["timeline"], unit=unit), flush=True)


if __name__ == "__main__":
    main()
