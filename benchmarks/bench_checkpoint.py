"""Checkpoint save and load throughput next to a raw write and read of the same bytes,
and the training-visible stall of an asynchronous save, all in one run.

    python benchmarks/bench_checkpoint.py                     # serial, the benchmark GPT
    mpiexec -n 2 python benchmarks/bench_checkpoint.py        # dp=2
    mpiexec -n 4 python benchmarks/bench_checkpoint.py --tp 2 --zero 1

The benchmark GPT is trained for a few steps first, so that its parameters and AdamW
state (3 arrays per parameter) are real, paged-in values (an untrained engine's
optimizer state is untouched zero pages: the first write of them faulted for 0.3 s).

Save and raw write alternate, ``--repeats`` times each, and so do load and raw read;
each figure is the median, every rank synchronised by a barrier first and the
slowest rank counted. The raw baseline, in the same folder: each rank writes exactly
the bytes its rank file holds as one flat file, from an array that already exists
(one ``write``, then ``fsync``, as the checkpoint does), and reads back, from those
flat files, as many bytes as its load reads, into an array that already exists
(``readinto``: the load, too, reads into the live arrays). Both arrays are
page-aligned, the raw I/O's best case: the kernel's copy to or from the page cache
runs up to 4 times slower when the buffer and the file offset are not aligned alike
to 64 bytes, and a heap array is aligned to 16 only. The checkpoint's extra
work is the HDF5 structure (one flat dataset per dtype), the checksum (and, on save,
the finite check) of every piece, the index, the renames, the pruning of the previous
checkpoint (``keep_checkpoints`` 1; its deletion, a background thread's, is waited
for before the next timed save, as a training step would separate two saves) and the
walk over the pieces.

The asynchronous save is measured as training sees it: training steps
(``--step-batch`` sequences of ``seq_len`` tokens per rank), plain ones against those
after an asynchronous save whose snapshot overlaps the step's forward and
backward (``train_step``'s ``before_update`` waits for it). The *stall* is the
median over ``--pairs`` of (save call + the steps that run until the write is done
on every rank) - (as many plain steps): the plan, the wait for the snapshot, and
whatever the background copy, write, checksums and fsync took from those steps (CPU
and memory bandwidth) while they ran beside them. Also printed: the save
call alone, the wait in ``before_update`` and the background thread's times.

Reads are measured twice. Warm, from the page cache the writes filled: the software
paths side by side, where a raw read is a memory copy. Cold, after every file of the
checkpoint and of the raw baseline is dropped from the page cache
(``posix_fadvise(DONTNEED)``, no privileges needed): a load as a restarted job does
it, from the disk.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import click
import numpy as np
from mpi4py import MPI

from hpctrain.bench import timed_on_all_ranks
from hpctrain.checkpoint import Checkpoint, direct, load_training, save_training, writer
from hpctrain.checkpoint.background import BackgroundWriter
from hpctrain.checkpoint.format import blocksum64
from hpctrain.checkpoint.state import held_tensors
from hpctrain.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.data.format import sha256_array
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.topology import Topology
from hpctrain.runtime import keep_freed_memory, set_blas_threads
from hpctrain.train import make_data_parallel, train_step

MAX_AFTER = 8  # steps after an asynchronous save that wait for its write to finish


def raw_write(path: Path, data: np.ndarray) -> None:
    """``data``'s bytes as a new file, fsync'ed."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view, done = memoryview(data).cast("B"), 0
        while done < len(view):
            done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(paths: list[Path], out: np.ndarray) -> int:
    """Fill ``out`` from the files in turn (wrapping round); returns the bytes read."""
    view, done, k = memoryview(out).cast("B"), 0, 0
    while done < len(view):
        with open(paths[k % len(paths)], "rb", buffering=0) as fh:
            while done < len(view) and (n := fh.readinto(view[done:])):
                done += n
        k += 1
    return done


def evict(folders: list[Path]) -> None:
    """Drop the files under ``folders`` from the page cache (``POSIX_FADV_DONTNEED``:
    their pages are clean, fsync'ed), so that the next read comes from the disk."""
    for folder in folders:
        for path in folder.rglob("*"):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def timed(comm, fn) -> float:
    """Seconds of ``fn()`` on the slowest rank, every rank starting together."""
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def interleaved(comm, first, second, repeats: int, setup=None) -> tuple[float, float]:
    """Medians of ``first()`` and ``second()`` timed alternately (``setup()`` untimed
    before each)."""
    a, b = [], []
    for _ in range(repeats):
        for fn, times in ((first, a), (second, b)):
            if setup is not None:
                setup()
            times.append(timed(comm, fn))
    return statistics.median(a), statistics.median(b)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--layers", default=6, show_default=True, help="Transformer blocks.")
@click.option("--d-model", default=384, show_default=True, help="Model width C.")
@click.option("--heads", default=6, show_default=True, help="Attention heads.")
@click.option("--vocab", default=256, show_default=True, help="Vocabulary size V.")
@click.option("--tp", default=1, show_default=True, help="Tensor-parallel size.")
@click.option("--pp", default=1, show_default=True, help="Pipeline stages.")
@click.option("--zero", default=0, show_default=True, help="ZeRO stage (0, 1 or 2).")
@click.option("--folder", type=click.Path(file_okay=False),
              help="Where to write (default: a temporary folder, removed afterwards).")
@click.option("--repeats", default=5, show_default=True,
              help="Timed repetitions of each save, load and raw figure.")
@click.option("--pairs", default=11, show_default=True,
              help="Asynchronous saves, each with the steps until its write is done, "
                   "and as many plain steps, for the stall.")
@click.option("--step-batch", default=1, show_default=True,
              help="Sequences of seq_len tokens per rank in a training step.")
def main(layers, d_model, heads, vocab, tp, pp, zero, folder, repeats, pairs, step_batch):
    """Save and load MB/s of a checkpoint, and of raw files of the same bytes; the
    stall of an asynchronous save against the synchronous save."""
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    set_blas_threads(1)
    keep_freed_memory()
    cfg = Config(model=ModelConfig(n_layer=layers, d_model=d_model, n_head=heads, seq_len=256,
                                   vocab_size=vocab),
                 parallel=ParallelConfig(tp=tp, pp=pp, zero=zero, microbatches=pp),
                 train=TrainConfig(batch_size=step_batch * comm.Get_size() // tp,
                                   keep_checkpoints=1)).validate(comm.Get_size())
    base = comm.bcast(folder or tempfile.mkdtemp(prefix="bench-ckpt-") if rank == 0 else None)
    root = Path(base) / "checkpoints"
    topo = Topology.build(comm, cfg.parallel)
    engine = build_engine(cfg, topo)
    dp = make_data_parallel(cfg, engine, topo)
    held_bytes = sum(h.array.nbytes for h in held_tensors(engine, dp, topo.tp_rank,
                                                          topo.tp_size))
    rng = np.random.default_rng(topo.dp_rank)

    def step(hook=None):
        x, y = (rng.integers(0, vocab, (step_batch * pp, cfg.model.seq_len)) for _ in "xy")
        train_step(engine, dp, x, y, lr=1e-4, grad_clip=1.0, before_update=hook)

    for _ in range(3):  # real values in the parameters and the optimizer state
        step()
    steps = iter(range(1, 10**6))
    saved = {}

    def save():
        saved["path"] = save_training(cfg, topo, engine, dp, step=next(steps),
                                      loader_state=None, root=root)

    def load():
        load_training(saved["path"], cfg, topo, engine, dp, root=root)

    save()  # the flat files' sizes, and the first write of the snapshot buffers
    mine = saved["path"] / f"rank-{rank:05d}.h5"
    with Checkpoint(saved["path"]) as ck:
        total = sum(int(np.prod(t.global_shape)) * np.dtype(t.dtype).itemsize
                    for t in ck.tensors.values())
        written = sum(int(np.prod(np.subtract(p.stop, p.start))) * np.dtype(t.dtype).itemsize
                      for t in ck.tensors.values() for p in t.pieces if p.file == mine.name)
        n_files = len(ck.index.files)
    raw_dir = Path(base) / "raw"
    if rank == 0:
        raw_dir.mkdir(exist_ok=True)
    comm.Barrier()
    flat = raw_dir / f"rank-{rank:05d}.bin"
    # page-aligned, so that the kernel's copies between them and the page cache run at
    # their best: copying 128 MB from the page cache took 10.5 ms where the buffer's
    # address and the file offset agree mod 64 bytes, 16-23 ms at 16 or 48 bytes apart,
    # 41 ms at 8 (DEVELOPERS.md); a heap array's address is only 16-byte aligned
    data = direct.aligned_empty(written)[:written]
    out = direct.aligned_empty(held_bytes)[:held_bytes]
    data[:] = 1
    out[:] = 0

    def before_write():
        writer.wait_for_pruning()
        flat.unlink(missing_ok=True)

    t_save, t_raw_w = interleaved(comm, save, lambda: raw_write(flat, data), repeats,
                                  setup=before_write)  # the raw files stay, to read
    files = sorted(raw_dir.glob("*.bin"))
    files = files[rank % len(files):] + files[:rank % len(files)]
    t_load, t_raw_r = interleaved(comm, load, lambda: raw_read(files, out), repeats)
    t_load_cold, t_raw_r_cold = interleaved(  # both from the disk, not the page cache
        comm, load, lambda: raw_read(files, out), repeats,
        setup=lambda: evict([saved["path"], raw_dir]))

    def stall_of(background: BackgroundWriter) -> dict:
        """The stall of ``background``'s saves: ``pairs`` times, an asynchronous save
        and the steps that run until its write is done on every rank (at most
        ``MAX_AFTER``), then as many plain steps; (save call + those steps) - (the plain
        steps) per pair."""
        def save_async():
            saved["path"] = save_training(cfg, topo, engine, dp, step=next(steps),
                                          loader_state=None, root=root,
                                          background=background)

        save_async()  # the snapshot buffers page in: not the steady state
        background.wait()
        out = {k: [] for k in ("diff", "plain", "after", "call", "wait", "copy", "write",
                               "steps", "unfinished", "cpu")}
        for _ in range(pairs):
            writer.wait_for_pruning()
            cpu0 = time.process_time()
            call = timed(comm, save_async)
            after, n = 0.0, 0
            while n < MAX_AFTER:
                after += timed(comm, lambda: step(background.captured))
                n += 1
                if not comm.allreduce(background.writing, op=MPI.LOR):
                    break
            out["unfinished"].append(bool(comm.allreduce(background.writing, op=MPI.LOR)))
            out["wait"].append(comm.allreduce(background.capture_wait_s, op=MPI.MAX))
            background.wait()
            cpu1 = time.process_time()
            out["copy"].append(comm.allreduce(background.copy_s, op=MPI.MAX))
            out["write"].append(comm.allreduce(background.write_s, op=MPI.MAX))
            plain = sum(timed(comm, step) for _ in range(n))
            out["cpu"].append(comm.allreduce((cpu1 - cpu0) - (time.process_time() - cpu1),
                                             op=MPI.MAX))
            out["diff"].append(call + after - plain)
            out["plain"].append(plain / n)
            out["after"].append(after / n)
            out["call"].append(call)
            out["steps"].append(n)
        return out

    shared = {}
    if topo.dp_size > 1:  # checkpoint_read "shared": the replicas read 1/dp each
        cfg_shared = replace(cfg, train=replace(cfg.train, checkpoint_read="shared"))

        def load_shared():
            shared["resumed"] = load_training(saved["path"], cfg_shared, topo, engine, dp,
                                              root=root)

        shared["warm"] = interleaved(comm, load_shared, load, repeats)
        shared["cold"] = interleaved(comm, load_shared, load, repeats,
                                     setup=lambda: evict([saved["path"]]))
        shared["read"] = comm.allreduce(shared["resumed"].bytes_read, op=MPI.MAX)
    r = stall_of(BackgroundWriter(topo.ckpt_comm, overlap=True))
    med = statistics.median
    loaded = comm.allreduce(held_bytes)
    arrays = [h.array for h in held_tensors(engine, dp, topo.tp_rank, topo.tp_size)]
    t_sha = timed_on_all_ranks(comm, lambda: [sha256_array(a) for a in arrays], repeats)
    t_sum = timed_on_all_ranks(comm, lambda: [blocksum64(a) for a in arrays], repeats)

    if rank == 0:
        mb = 1e6
        print(f"{comm.Get_size()} rank(s), dp={topo.dp_size} tp={tp} pp={pp} zero={zero}: GPT "
              f"{layers} layers, d_model {d_model}; checkpoint {total / mb:.1f} MB "
              f"(parameters and AdamW state) in {n_files} file(s)")
        print(f"save        {t_save:7.3f} s  {total / mb / t_save:8.1f} MB/s")
        print(f"raw write   {t_raw_w:7.3f} s  {total / mb / t_raw_w:8.1f} MB/s   "
              f"(save at {100 * t_raw_w / t_save:.0f}% of raw)")
        print(f"load        {t_load:7.3f} s  {loaded / mb / t_load:8.1f} MB/s   "
              f"({loaded / mb:.1f} MB into the ranks' arrays)")
        print(f"raw read    {t_raw_r:7.3f} s  {loaded / mb / t_raw_r:8.1f} MB/s   "
              f"(load at {100 * t_raw_r / t_load:.0f}% of raw)")
        print(f"load, cold  {t_load_cold:7.3f} s  {loaded / mb / t_load_cold:8.1f} MB/s   "
              f"(the files dropped from the page cache first: read from the disk)")
        print(f"raw, cold   {t_raw_r_cold:7.3f} s  {loaded / mb / t_raw_r_cold:8.1f} MB/s   "
              f"(load at {100 * t_raw_r_cold / t_load_cold:.0f}% of raw)")
        d = r["diff"]
        q1, _, q3 = statistics.quantiles(d, n=4) if len(d) > 1 else (d[0],) * 3
        print(f"async stall {med(d):7.3f} s                  ({100 * med(d) / t_save:.1f}% "
              f"of the synchronous save {t_save:.3f} s): (save call + the steps until "
              f"the write is done) - as many plain steps, median of {len(d)} pairs, "
              f"quartiles {q1:.3f} to {q3:.3f} s")
        print(f"  plain step {med(r['plain']):.3f} s, a step while writing "
              f"{med(r['after']):.3f} s, steps until written {min(r['steps'])}-"
              f"{max(r['steps'])} (unfinished after {MAX_AFTER}: "
              f"{sum(r['unfinished'])}), save call {med(r['call']):.4f} s, wait in "
              f"before_update {med(r['wait']):.4f} s; in the background: snapshot "
              f"{med(r['copy']):.3f} s, whole write {med(r['write']):.3f} s; extra CPU of "
              f"the process {med(r['cpu']):.3f} s (the slowest rank)")
        if shared:
            (sw, ew), (sc, ec) = shared["warm"], shared["cold"]
            print(f"load, shared reads (checkpoint_read \"shared\"): the slowest rank read "
                  f"{shared['read'] / mb:.1f} MB of its {held_bytes / mb:.1f} MB from the "
                  f"files, the rest from its replicas; warm {sw:.3f} s against {ew:.3f} s "
                  f"each reading all, cold {sc:.3f} s against {ec:.3f} s")
        print(f"blocksum64  {t_sum:7.3f} s  {loaded / mb / t_sum:8.1f} MB/s   (the checksum, of "
              f"what a load reads, once: part of both save and load)")
        print(f"sha256      {t_sha:7.3f} s  {loaded / mb / t_sha:8.1f} MB/s   (the checksum "
              f"of format version 1, for comparison)")
    writer.wait_for_pruning()
    comm.Barrier()
    if rank == 0 and folder is None:
        shutil.rmtree(base, ignore_errors=True)
    topo.free()


if __name__ == "__main__":
    main()
