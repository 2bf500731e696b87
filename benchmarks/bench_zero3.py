"""Memory per rank and step time of the benchmark GPT at ZeRO 0, 1, 2 and 3.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/bench_zero3.py

Every rank is one data-parallel rank (dp = the world size). For each stage: one
warm-up step, then ``--steps`` timed steps on random tokens (median); the bytes are
``dp.memory()`` between steps (parameters, gradients, optimizer state), the most a
rank held at once of each over the world's ranks. ZeRO 3 adds the most bytes of
gathered pieces held at once during a step. Prints the load average: figures taken
while other jobs run are slower.
"""

import os
import statistics
import time

import click
import numpy as np
from mpi4py import MPI

from hpctrain.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.topology import Topology
from hpctrain.runtime import set_blas_threads
from hpctrain.train import make_data_parallel, train_step

MiB = float(1 << 20)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--steps", default=3, show_default=True, help="Timed steps per stage.")
@click.option("--batch", default=8, show_default=True, help="Global batch, in sequences.")
def main(steps, batch):
    """ZeRO 0-3 on the benchmark GPT: bytes per rank and step time."""
    comm = MPI.COMM_WORLD
    p, rank = comm.Get_size(), comm.Get_rank()
    set_blas_threads(1)
    model = ModelConfig(n_layer=6, d_model=384, n_head=6, seq_len=256, vocab_size=256,
                        dtype="float32")
    r = np.random.default_rng(0)
    x = r.integers(0, 256, (batch, 256))
    y = r.integers(0, 256, (batch, 256))
    b = batch // p
    rows = slice(rank * b, (rank + 1) * b)
    if rank == 0:
        print(f"dp {p}, load average {os.getloadavg()[0]:.2f} at the start")
        print("zero | params MiB | grads MiB | optimizer MiB | gathered peak MiB | step s")
    for zero in (0, 1, 2, 3):
        cfg = Config(model=model, parallel=ParallelConfig(zero=zero),
                     train=TrainConfig(batch_size=batch)).validate(p)
        topo = Topology.build(comm, cfg.parallel)
        engine = build_engine(cfg, topo)
        dp = make_data_parallel(cfg, engine, topo)
        train_step(engine, dp, x[rows], y[rows], lr=1e-4, grad_clip=1.0)
        times = []
        for _ in range(steps):
            comm.Barrier()
            t0 = time.perf_counter()
            train_step(engine, dp, x[rows], y[rows], lr=1e-4, grad_clip=1.0)
            times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        memory = dp.memory()
        peak = dp.metrics().get("zero3_gathered_peak_bytes", 0)
        most = {k: comm.allreduce(v, op=MPI.MAX) for k, v in memory.items()}
        peak = comm.allreduce(peak, op=MPI.MAX)
        if rank == 0:
            print(f"{zero:>4} | {most['param_bytes'] / MiB:10.2f} | "
                  f"{most['grad_bytes'] / MiB:9.2f} | {most['optim_bytes'] / MiB:13.2f} | "
                  f"{peak / MiB:17.2f} | {statistics.median(times):6.3f}")
        topo.free()
    if rank == 0:
        print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
