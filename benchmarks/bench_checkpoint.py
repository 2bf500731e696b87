"""Checkpoint save and load throughput next to a raw write and read of the same bytes.

    python benchmarks/bench_checkpoint.py                     # serial, the benchmark GPT
    mpiexec -n 4 python benchmarks/bench_checkpoint.py --tp 2 --zero 1

Saves the benchmark GPT with its AdamW state (3 arrays per parameter) at the layout
given, then loads it back into the same engine; each timed ``--repeats`` times, the
median reported, every rank synchronised by a barrier first and the slowest rank
counted. The raw baseline, in the same folder: each rank writes exactly the bytes
its rank file holds as one flat file (``ndarray.tofile``, then ``fsync``, as the
checkpoint does) and reads back, from those flat files, as many bytes as its load
reads. The checkpoint's extra work is the HDF5 structure (one dataset per piece),
the sha256 of every piece on both sides, the index, the renames and the slicing into
the live arrays.

Both reads come from the page cache once the files are written (nothing here drops
it): the read figures compare the software paths, not the disk.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import click
import numpy as np
from mpi4py import MPI

from hpctrain.bench import timed_on_all_ranks
from hpctrain.checkpoint import Checkpoint, load_training, save_training
from hpctrain.checkpoint.state import held_tensors
from hpctrain.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.data.format import sha256_array
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.topology import Topology
from hpctrain.runtime import set_blas_threads
from hpctrain.train import make_data_parallel


def raw_write(path: Path, nbytes: int) -> None:
    np.ones(nbytes, np.uint8).tofile(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(paths: list[Path], nbytes: int) -> int:
    """Read ``nbytes`` from the files in turn (wrapping round); returns the bytes read."""
    done, k = 0, 0
    while done < nbytes:
        chunk = np.fromfile(paths[k % len(paths)], np.uint8, count=nbytes - done)
        done += chunk.size
        k += 1
    return done


def raw_figures(comm, raw_dir: Path, written: int, to_read: int, repeats: int):
    """Seconds to write ``written`` bytes per rank as flat files, and to read back
    ``to_read`` bytes per rank from them (each rank starting at its own file)."""
    rank = comm.Get_rank()
    if rank == 0:
        raw_dir.mkdir(exist_ok=True)
    comm.Barrier()
    flat = raw_dir / f"rank-{rank:05d}.bin"
    t_write = timed_on_all_ranks(comm, lambda: raw_write(flat, written), repeats,
                                 setup=lambda: flat.unlink(missing_ok=True))
    files = sorted(raw_dir.glob("*.bin"))
    files = files[rank % len(files):] + files[:rank % len(files)]
    return t_write, timed_on_all_ranks(comm, lambda: raw_read(files, to_read), repeats)


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
@click.option("--repeats", default=3, show_default=True, help="Timed repetitions of each.")
def main(layers, d_model, heads, vocab, tp, pp, zero, folder, repeats):
    """Save and load MB/s of a checkpoint, and of raw files of the same bytes."""
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    set_blas_threads(1)
    cfg = Config(model=ModelConfig(n_layer=layers, d_model=d_model, n_head=heads, seq_len=256,
                                   vocab_size=vocab),
                 parallel=ParallelConfig(tp=tp, pp=pp, zero=zero, microbatches=pp),
                 train=TrainConfig(batch_size=8 * pp * comm.Get_size(),
                                   keep_checkpoints=1)).validate(comm.Get_size())
    base = comm.bcast(folder or tempfile.mkdtemp(prefix="bench-ckpt-") if rank == 0 else None)
    root = Path(base) / "checkpoints"
    topo = Topology.build(comm, cfg.parallel)
    engine = build_engine(cfg, topo)
    dp = make_data_parallel(cfg, engine, topo)
    held_bytes = sum(h.array.nbytes for h in held_tensors(engine, dp, topo.tp_rank,
                                                          topo.tp_size))
    steps = iter(range(1, 10**6))
    saved = {}

    def save():
        saved["path"] = save_training(cfg, topo, engine, dp, step=next(steps),
                                      loader_state=None, root=root)

    t_save = timed_on_all_ranks(comm, save, repeats)
    t_load = timed_on_all_ranks(
        comm, lambda: load_training(saved["path"], cfg, topo, engine, dp), repeats)
    mine = saved["path"] / f"rank-{rank:05d}.h5"
    with_file = mine.is_file()
    with Checkpoint(saved["path"]) as ck:
        total = sum(int(np.prod(t.global_shape)) * np.dtype(t.dtype).itemsize
                    for t in ck.tensors.values())
        written = sum(int(np.prod(np.subtract(p.stop, p.start))) * np.dtype(t.dtype).itemsize
                      for t in ck.tensors.values() for p in t.pieces
                      if p.file == mine.name) if with_file else 0
    t_raw_w, t_raw_r = raw_figures(comm, Path(base) / "raw", written, held_bytes, repeats)
    loaded = comm.allreduce(held_bytes)
    arrays = [h.array for h in held_tensors(engine, dp, topo.tp_rank, topo.tp_size)]
    t_sha = timed_on_all_ranks(comm, lambda: [sha256_array(a) for a in arrays], repeats)

    if rank == 0:
        mb = 1e6
        print(f"{comm.Get_size()} rank(s), dp={topo.dp_size} tp={tp} pp={pp} zero={zero}: GPT "
              f"{layers} layers, d_model {d_model}; checkpoint {total / mb:.1f} MB "
              f"(parameters and AdamW state) in {len(ck.index.files)} file(s)")
        print(f"save        {t_save:7.3f} s  {total / mb / t_save:8.1f} MB/s")
        print(f"raw write   {t_raw_w:7.3f} s  {total / mb / t_raw_w:8.1f} MB/s   "
              f"(save at {100 * t_raw_w / t_save:.0f}% of raw)")
        print(f"load        {t_load:7.3f} s  {loaded / mb / t_load:8.1f} MB/s   "
              f"({loaded / mb:.1f} MB into the ranks' arrays)")
        print(f"raw read    {t_raw_r:7.3f} s  {loaded / mb / t_raw_r:8.1f} MB/s   "
              f"(load at {100 * t_raw_r / t_load:.0f}% of raw)")
        print(f"sha256      {t_sha:7.3f} s  {loaded / mb / t_sha:8.1f} MB/s   (of what a load "
              f"reads, once: part of both save and load)")
        if folder is None:
            shutil.rmtree(base, ignore_errors=True)
    topo.free()


if __name__ == "__main__":
    main()
