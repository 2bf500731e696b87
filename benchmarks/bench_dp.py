"""Data-parallel gradient synchronisation: bandwidth and overlap with backward.

    mpiexec -n 2 python benchmarks/bench_dp.py            # the benchmark GPT, dp = 2

Prints, in one run, for the gradient of the benchmark GPT (every rank is one data-
parallel replica):

1. raw MPI: ``Allreduce`` of one buffer of the gradient's size; bus bandwidth
   ``2 (p - 1) / p * bytes / t`` (the bytes each rank sends and receives in a ring);
2. ours, alone: ``GradBuckets`` with no compute (every bucket's ``Iallreduce``
   launched at once, then ``Waitall``), the same bandwidth formula, and its share of
   the raw figure;
3. ours, in training: the time a step spends in communication calls on the main
   thread (the hooks during backward, and the final ``wait``), against the time of
   the synchronisation alone: ``hidden = 1 - exposed / alone``. Taken on the rank
   that reaches ``wait`` last, since the first one also waits for its partner's
   backward (load imbalance, not communication; printed too). Overlapped steps
   alternate with steps synchronised only at the end (no hook) and steps without
   collectives, and all three step times (wall and CPU) are printed: the copies and
   reductions of MPI's shared-memory transport run on the cores that compute, so
   what the overlap hides is the waiting, and their CPU time shows in the step.

Timings are medians (every rank synchronised by a barrier first).
"""

from __future__ import annotations

import statistics
import time

import click
import numpy as np
from mpi4py import MPI

from hpctrain.bench import timed_on_all_ranks
from hpctrain.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.topology import Topology
from hpctrain.runtime import set_blas_threads
from hpctrain.train import make_data_parallel, train_step


def bus_gbps(nbytes: int, p: int, seconds: float) -> float:
    return 2 * (p - 1) / p * nbytes / seconds / 1e9


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--layers", default=6, show_default=True, help="Transformer blocks.")
@click.option("--d-model", default=384, show_default=True, help="Model width C.")
@click.option("--heads", default=6, show_default=True, help="Attention heads.")
@click.option("--seq-len", default=256, show_default=True, help="Sequence length T.")
@click.option("--vocab", default=256, show_default=True, help="Vocabulary size V.")
@click.option("--batch", default=8, show_default=True, help="Global batch, in sequences.")
@click.option("--dtype", default="float32", show_default=True,
              type=click.Choice(["float32", "float64"]), help="Parameter dtype.")
@click.option("--bucket-mb", default=4.0, show_default=True, help="Bucket size, MiB.")
@click.option("--steps", default=6, show_default=True,
              help="Training steps timed (after one warm-up step).")
@click.option("--repeats", default=10, show_default=True,
              help="Repetitions of each communication-only measurement.")
@click.option("--helper/--no-helper", default=True, show_default=True,
              help="Drive the buckets from the helper thread, or from the hooks only.")
def main(layers, d_model, heads, seq_len, vocab, batch, dtype, bucket_mb, steps, repeats,
         helper):
    """Raw Allreduce bandwidth, our bucketed bandwidth, and the hidden fraction."""
    comm = MPI.COMM_WORLD
    p, rank = comm.Get_size(), comm.Get_rank()
    set_blas_threads(1)
    cfg = Config(model=ModelConfig(n_layer=layers, d_model=d_model, n_head=heads,
                                   seq_len=seq_len, vocab_size=vocab, dtype=dtype),
                 parallel=ParallelConfig(bucket_mb=bucket_mb),
                 train=TrainConfig(batch_size=batch)).validate(p)
    topo = Topology.build(comm, cfg.parallel)
    engine = build_engine(cfg, topo)
    dp = make_data_parallel(cfg, engine, topo)
    if not helper:
        dp.grads.poll_interval = 0.0
    numel = sum(q.size for q in engine.params)
    nbytes = numel * np.dtype(dtype).itemsize

    # 1. raw MPI on one buffer of the gradient's size, and on buffers of a bucket's
    buf = np.ones(numel, dtype)
    comm.Allreduce(MPI.IN_PLACE, buf)
    raw = timed_on_all_ranks(comm, lambda: comm.Allreduce(MPI.IN_PLACE, buf), repeats)
    n = int(bucket_mb * 2**20) // buf.itemsize
    pieces = [buf[i:i + n] for i in range(0, numel, n)]
    raw_pieces = timed_on_all_ranks(comm, lambda: [comm.Allreduce(MPI.IN_PLACE, v) for v in pieces],
                       repeats)

    # 2. our buckets with nothing to hide behind: every one launched by wait
    dp.grads.zero()
    dp.grads.wait()
    alone = timed_on_all_ranks(comm, dp.grads.wait, repeats, setup=dp.grads.zero)

    # 3. training steps, in turn: overlapped, synchronised only at the end, no collectives
    r = np.random.default_rng(0)
    b = batch // p
    x = r.integers(0, vocab, (b, seq_len))
    y = r.integers(0, vocab, (b, seq_len))
    launch, hook = dp.grads.launch, engine.on_grads_ready
    modes = {"overlapped": (launch, hook), "at the end": (launch, None),
             "no collectives": (lambda bucket, view: None, None)}

    def step(mode: str):
        dp.grads.launch, engine.on_grads_ready = modes[mode]
        comm.Barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        train_step(engine, dp, x, y, lr=1e-4, grad_clip=1.0)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        m = dp.metrics()
        # per rank: (arrival at wait, seconds in communication calls, wall, CPU)
        return comm.allgather((dp.grads.wait_start - t0, m["dp_wait_s"] + m["dp_hook_s"],
                               wall, cpu))

    for mode in modes:  # warm-up
        step(mode)
    runs = {mode: [] for mode in modes}
    for _ in range(steps):
        for mode in modes:
            runs[mode].append(step(mode))
    dp.grads.launch, engine.on_grads_ready = launch, hook

    def exposed(mode: str) -> float:
        """Communication time on the rank reaching wait last: it waits for the
        collectives only, while the first one also waits for its partner's backward."""
        return statistics.median(max(ranks, key=lambda q: q[0])[1] for ranks in runs[mode])

    def wall(mode: str) -> float:
        return statistics.median(max(q[2] for q in ranks) for ranks in runs[mode])

    def cpu(mode: str) -> float:
        return statistics.median(float(np.mean([q[3] for q in ranks])) for ranks in runs[mode])

    imbalance = statistics.median(max(q[0] for q in ranks) - min(q[0] for q in ranks)
                                  for ranks in runs["overlapped"])
    hidden = 1.0 - exposed("overlapped") / alone

    if rank == 0:
        ours, theirs = bus_gbps(nbytes, p, alone), bus_gbps(nbytes, p, raw)
        in_pieces = bus_gbps(nbytes, p, raw_pieces)
        print(f"dp = {p}: GPT {layers} layers, d_model {d_model}, {heads} heads, T {seq_len}, "
              f"V {vocab}, global batch {batch}, {dtype}")
        print(f"gradient: {numel:,} elements, {nbytes / 2**20:.1f} MiB, "
              f"{len(dp.grads.buckets)} buckets of {bucket_mb} MiB, "
              f"{'helper thread' if dp.grads.poll_interval else 'hooks only'}")
        print(f"raw MPI Allreduce       {raw * 1e3:8.2f} ms  {theirs:6.2f} GB/s bus bandwidth "
              f"(one buffer of the gradient's size)")
        print(f"  the same, in pieces   {raw_pieces * 1e3:8.2f} ms  {in_pieces:6.2f} GB/s "
              f"({len(pieces)} blocking Allreduce of {bucket_mb} MiB in turn)")
        print(f"bucketed sync alone     {alone * 1e3:8.2f} ms  {ours:6.2f} GB/s "
              f"({100 * ours / theirs:.0f}% of raw, {100 * ours / in_pieces:.0f}% of raw in "
              f"pieces)")
        print("training step, medians  wall ms   CPU ms   exposed communication ms")
        for mode in modes:
            print(f"  {mode:20s} {wall(mode) * 1e3:8.1f} {cpu(mode) * 1e3:8.1f}   "
                  f"{exposed(mode) * 1e3:8.2f}")
        print(f"ranks' arrival at wait differs by {imbalance * 1e3:.1f} ms (median)")
        print(f"hidden behind backward  {100 * hidden:.0f}% of the sync alone")
    topo.free()


if __name__ == "__main__":
    main()
