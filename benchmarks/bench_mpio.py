"""Checkpoints through parallel HDF5 (one shared file, collective MPI-IO writes) against
per-rank files against a raw write of the same bytes, at 1, 2 and 4 ranks, in one run.

    make bench-mpio MPI=mpich          # or MPI=openmpi: the system-MPI venv
    .venv-mpich/bin/python benchmarks/bench_mpio.py --ranks 1,2,4

It needs h5py built with MPI (``make install-system-mpi``). The driver starts one job per
rank count with this venv's ``mpiexec`` (``worker``) and prints a table. Each job trains
the benchmark GPT (6 layers, d_model 384, AdamW; 131 MB of parameters and optimizer
state) for three steps at dp = N, ZeRO 1 (every rank writes its share of the pieces),
then times, interleaved ``--repeats`` times, medians of the slowest rank after a barrier:

* save: ``checkpoint_io = "files"`` (each rank's ``rank-N.h5``: HDF5 makes the structure,
  the bytes go with ``pwritev``/``O_DIRECT``), ``"mpio"`` (one ``data.h5``: every
  tensor a dataset of its global shape, created collectively, written by collective
  ``H5Dwrite``s through MPI-IO), and a raw write (each rank writes the bytes of its
  share as one flat file from an existing array, fsync);
* load: each checkpoint read back into the live arrays (``load_training``: the rank
  files by ``preadv`` at the pieces' offsets; the shared file through HDF5 hyperslab
  reads), and a raw read of the flat files into existing arrays; warm (from the page
  cache the writes filled) and cold (every file dropped from the page cache first).

The helpers (raw write and read, eviction, interleaved timing) are
``bench_checkpoint.py``'s.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import click

HERE = Path(__file__).resolve().parent


@click.group(context_settings={"help_option_names": ["-h", "--help"]},
             invoke_without_command=True)
@click.option("--ranks", default="1,2,4", show_default=True, help="Rank counts, one job each.")
@click.option("--repeats", default=5, show_default=True, help="Timed repetitions of each.")
@click.option("--out", type=click.Path(file_okay=False), help="Folder for results.json.")
@click.option("--timeout", default=1200, show_default=True, help="Seconds per job.")
@click.pass_context
def main(ctx, ranks: str, repeats: int, out: str | None, timeout: int) -> None:
    """Save and load through mpio, per-rank files and raw files, at each rank count."""
    if ctx.invoked_subcommand is not None:
        return
    import hpctrain  # noqa: F401  (OPENBLAS_THREAD_TIMEOUT before NumPy)
    from hpctrain.checkpoint.writer import MPIO_REMEDY, mpio_missing
    from hpctrain.runtime import find_mpiexec

    if mpio_missing() is not None:
        raise click.ClickException(f"{mpio_missing()}: {MPIO_REMEDY}")
    rows = []
    for n in (int(r) for r in ranks.split(",")):
        with tempfile.NamedTemporaryFile("r", suffix=".json") as result:
            cmd = [find_mpiexec(), "-n", str(n), sys.executable, str(HERE / "bench_mpio.py"),
                   "worker", "--repeats", str(repeats), "--json", result.name]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
            done = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True,
                                  text=True)
            if done.returncode != 0:
                raise click.ClickException(f"{' '.join(cmd)} failed ({done.returncode}):\n"
                                           f"{done.stdout}{done.stderr}")
            rows.append(json.loads(Path(result.name).read_text()))
    print_table(rows)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "results.json").write_text(json.dumps(rows, indent=1))


def print_table(rows: list[dict]) -> None:
    first = rows[0]
    print(f"{first['mpi']}; HDF5 {first['hdf5']}; benchmark GPT checkpoint "
          f"{first['total_mb']:.1f} MB (parameters and AdamW state), dp = ranks, ZeRO 1; "
          f"seconds (MB/s), medians of {first['repeats']}, slowest rank")
    head = (f"{'ranks':>5} | {'save files':>16} {'save mpio':>16} {'raw write':>16} | "
            f"{'load files':>16} {'load mpio':>16} {'raw read':>16} | "
            f"{'cold files':>16} {'cold mpio':>16} {'cold raw':>16}")
    print(head)
    print("-" * len(head))
    def cell(r: dict, key: str, mb: float) -> str:
        return f"{r[key]:7.3f} ({mb / r[key]:6.0f})"

    for r in rows:
        t, lo = r["total_mb"], r["loaded_mb"]
        print(f"{r['ranks']:>5} | " + " ".join(cell(r, k, t) for k in (
            "save_files", "save_mpio", "raw_write")) + " | " + " ".join(cell(r, k, lo) for k in (
            "load_files", "load_mpio", "raw_read")) + " | " + " ".join(cell(r, k, lo) for k in (
            "cold_files", "cold_mpio", "cold_raw")))


@main.command()
@click.option("--repeats", default=5, show_default=True)
@click.option("--json", "json_path", required=True, type=click.Path(dir_okay=False))
def worker(repeats: int, json_path: str) -> None:
    """One job (under mpiexec): the figures at this world size."""
    import hpctrain  # noqa: F401  (before NumPy)

    sys.path.insert(0, str(HERE))
    import h5py
    import numpy as np
    from bench_checkpoint import evict, raw_read, raw_write, timed
    from mpi4py import MPI

    from hpctrain.checkpoint import Checkpoint, load_training, save_training, writer
    from hpctrain.checkpoint.state import held_tensors
    from hpctrain.config import Config, ModelConfig, ParallelConfig, TrainConfig
    from hpctrain.parallel.engine import build_engine
    from hpctrain.parallel.topology import Topology
    from hpctrain.runtime import keep_freed_memory, set_blas_threads
    from hpctrain.train import make_data_parallel, train_step

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    set_blas_threads(1)
    keep_freed_memory()
    cfg = Config(model=ModelConfig(n_layer=6, d_model=384, n_head=6, seq_len=256,
                                   vocab_size=256),
                 parallel=ParallelConfig(zero=1 if size > 1 else 0),
                 train=TrainConfig(batch_size=size, keep_checkpoints=1)).validate(size)
    base = Path(comm.bcast(tempfile.mkdtemp(prefix="bench-mpio-") if rank == 0 else None))
    topo = Topology.build(comm, cfg.parallel)
    engine = build_engine(cfg, topo)
    dp = make_data_parallel(cfg, engine, topo)
    held = held_tensors(engine, dp, topo.tp_rank, topo.tp_size)
    held_bytes = sum(h.array.nbytes for h in held)
    rng = np.random.default_rng(topo.dp_rank)
    for _ in range(3):  # real values, paged in
        x, y = (rng.integers(0, 256, (1, 256)) for _ in "xy")
        train_step(engine, dp, x, y, lr=1e-4, grad_clip=1.0)
    steps = iter(range(1, 10**6))
    saved: dict[str, Path] = {}

    def save(io: str):
        with_io = replace(cfg, train=replace(cfg.train, checkpoint_io=io))

        def run():
            saved[io] = save_training(with_io, topo, engine, dp, step=next(steps),
                                      loader_state=None, root=base / io)
        return run

    def load(io: str):
        return lambda: load_training(saved[io], cfg, topo, engine, dp, root=base / io)

    save("files")()
    save("mpio")()
    with Checkpoint(saved["files"]) as ck:
        total = sum(int(np.prod(t.global_shape)) * np.dtype(t.dtype).itemsize
                    for t in ck.tensors.values())
        mine = f"rank-{rank:05d}.h5"
        written = sum(int(np.prod(np.subtract(p.stop, p.start))) * np.dtype(t.dtype).itemsize
                      for t in ck.tensors.values() for p in t.pieces if p.file == mine)
    raw_dir = base / "raw"
    if rank == 0:
        raw_dir.mkdir()
    comm.Barrier()
    flat = raw_dir / f"rank-{rank:05d}.bin"
    data, out = np.ones(written, np.uint8), np.zeros(held_bytes, np.uint8)

    def before():
        writer.wait_for_pruning()
        if flat.exists():
            flat.unlink()

    def medians(fns: dict, setup=None) -> dict[str, float]:
        """Each of ``fns`` timed in turn, ``repeats`` rounds; the medians."""
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(repeats):
            for key, fn in fns.items():
                if setup is not None:
                    setup()
                times[key].append(timed(comm, fn))
        return {k: statistics.median(v) for k, v in times.items()}

    t = medians({"save_files": save("files"), "save_mpio": save("mpio"),
                 "raw_write": lambda: raw_write(flat, data)}, setup=before)  # the last
    files = sorted(raw_dir.glob("*.bin"))
    files = files[rank % len(files):] + files[:rank % len(files)]
    reads = {"files": load("files"), "mpio": load("mpio"), "raw": lambda: raw_read(files, out)}
    warm = medians(reads)
    folders = [saved["files"], saved["mpio"], raw_dir]
    cold = medians(reads, setup=lambda: evict(folders))
    t.update({"load_files": warm["files"], "load_mpio": warm["mpio"], "raw_read": warm["raw"],
              "cold_files": cold["files"], "cold_mpio": cold["mpio"], "cold_raw": cold["raw"]})
    loaded = comm.allreduce(held_bytes)
    writer.wait_for_pruning()
    comm.Barrier()
    if rank == 0:
        vendor, version = MPI.get_vendor()
        Path(json_path).write_text(json.dumps({
            "ranks": size, "repeats": repeats, "total_mb": total / 1e6,
            "loaded_mb": loaded / 1e6, "hdf5": h5py.version.hdf5_version,
            "mpi": f"{vendor} {'.'.join(map(str, version))}", **t}))
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    topo.free()


if __name__ == "__main__":
    main()
