"""Loader throughput next to raw h5py reads of the same bytes (target: at least 80%).

The raw baseline reads exactly the samples the loader draws (the loader's own
``indices(step)``, located before timing) with plain h5py slicing, one hyperslab per
token window or image row, into uint8 arrays, with the same HDF5 chunk cache. The
loader's extra work is the sampling, the int64/float32 conversion and the x/y split.
It is timed twice: as used (uncompressed chunks sliced from a memory map of the file,
``stores.DirectRows``) and with ``direct=False`` (every sample through h5py, as raw).

Timing is paired: each round times the loader on ``--round`` steps, then the raw reads
of the same steps, back to back, so load from other processes on a shared machine
falls on both alike; the figure is the median of the rounds' ratios (and the best
round of each side for the MB/s). One untimed pass warms the page and chunk caches.

    python benchmarks/bench_loader.py                # data/shakespeare.h5, data/fashion-mnist.h5
    python benchmarks/bench_loader.py --tokens data/shk-4 --dp-size 4 --dp-rank 1
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import click
import h5py
import numpy as np

from hpctrain.data import DataError, open_loader
from hpctrain.data.loader import CHUNK_CACHE


def _raw_reader(loader, steps: int, cache: dict):
    """``(read(lo, hi), files, bytes per sample)``: plain h5py reads of steps [lo, hi)."""
    store = loader.store
    located = [store.locate(np.unique(loader.indices(s)) if loader.kind == "images"
                            else loader.indices(s)) for s in range(steps)]
    picks = [list(zip(a.tolist(), b.tolist(), strict=True)) for a, b in located]
    if loader.kind == "tokens":
        width = store.seq_len + 1
        files = [h5py.File(d.file.filename, "r", **cache) for d, _, _ in store.segments]
        dsets = [f[d.name] for f, (d, _, _) in zip(files, store.segments, strict=True)]

        def read(lo: int, hi: int) -> None:
            for step in picks[lo:hi]:
                out = np.empty((len(step), width), dtype=np.uint8)
                for i, (s, a) in enumerate(step):
                    out[i] = dsets[s][a:a + width]
        return read, files, width
    files = [h5py.File(images.file.filename, "r", **cache) for images, _ in store.parts]
    pairs = [(f[i.name], f[lab.name]) for f, (i, lab) in zip(files, store.parts, strict=True)]

    def read(lo: int, hi: int) -> None:
        for step in picks[lo:hi]:
            images = np.empty((len(step), *store.image_shape), dtype=np.uint8)
            labels = np.empty(len(step), dtype=np.uint8)
            for i, (p, j) in enumerate(step):
                images[i] = pairs[p][0][j]
                labels[i] = pairs[p][1][j]
    return read, files, int(np.prod(store.image_shape)) + 1


def _timed(fn, lo: int, hi: int) -> float:
    t0 = time.perf_counter()
    fn(lo, hi)
    return time.perf_counter() - t0


def bench(path: Path, *, steps: int, batch_size: int, seq_len: int | None, dp_rank: int,
          dp_size: int, rounds: int, round_steps: int, prefetch: bool) -> float:
    kw = dict(batch_size=batch_size, dp_rank=dp_rank, dp_size=dp_size, seed=1,
              seq_len=seq_len, prefetch=prefetch)
    loaders = {"loader": open_loader(path, **kw),
               "loader, h5py reads": open_loader(path, direct=False, **kw)}

    def drawer(loader):
        def draw(lo: int, hi: int) -> None:
            loader.load_state_dict({**loader.state_dict(), "step": lo})
            for _ in range(hi - lo):
                loader.next_batch()
        return draw

    first = loaders["loader"]
    raw, files, sample_bytes = _raw_reader(first, steps, CHUNK_CACHE)
    runs = {name: drawer(ld) for name, ld in loaders.items()} | {"raw h5py": raw}
    for fn in runs.values():  # warm
        fn(0, steps)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        lo = (r * round_steps) % max(1, steps - round_steps)
        for name, fn in runs.items():
            times[name].append(_timed(fn, lo, lo + round_steps))
    kind = first.kind
    for ld in loaders.values():
        ld.close()
    for f in files:
        f.close()
    b = batch_size // dp_size
    mb = round_steps * b * sample_bytes / 1e6
    click.echo(f"{path} ({kind}, rank {dp_rank}/{dp_size}, {b} samples/step"
               f"{f', T={seq_len}' if kind == 'tokens' else ''}, {rounds} rounds of "
               f"{round_steps} steps{', prefetch' if prefetch else ''})")
    for name, t in times.items():
        click.echo(f"  {name:<19} {mb / min(t):8.2f} MB/s  {round_steps * b / min(t):10.0f} "
                   f"samples/s (best round)")
    result = 0.0
    for name in loaders:
        ratios = [100 * r / w for r, w in zip(times["raw h5py"], times[name], strict=True)]
        q = statistics.quantiles(ratios, n=4)
        ratio = statistics.median(ratios)
        result = result or ratio
        click.echo(f"  {name + ' / raw':<25} {ratio:6.1f} % median of rounds (quartiles "
                   f"{q[0]:.1f}-{q[2]:.1f} %)")
    return result


@click.command()
@click.option("--tokens", type=click.Path(path_type=Path), default=Path("data/shakespeare.h5"),
              show_default=True, help="Token stream (file, shard or partition folder).")
@click.option("--images", type=click.Path(path_type=Path),
              default=Path("data/fashion-mnist.h5"), show_default=True,
              help="Image file (file, shard or partition folder).")
@click.option("--steps", default=400, show_default=True, help="Distinct steps drawn from.")
@click.option("--rounds", default=40, show_default=True, help="Paired timing rounds.")
@click.option("--round", "round_steps", default=20, show_default=True,
              help="Steps per round.")
@click.option("--batch-size", default=64, show_default=True, help="Global batch B.")
@click.option("--seq-len", default=128, show_default=True, help="T for the token stream.")
@click.option("--dp-rank", default=0, show_default=True, help="Rank whose part is read.")
@click.option("--dp-size", default=1, show_default=True, help="Data-parallel size.")
@click.option("--prefetch", is_flag=True, help="Time the loader with background prefetch.")
def main(tokens, images, steps, rounds, round_steps, batch_size, seq_len, dp_rank, dp_size,
         prefetch):
    """Print loader throughput and raw h5py throughput on the same samples."""
    common = dict(steps=steps, batch_size=batch_size, dp_rank=dp_rank, dp_size=dp_size,
                  rounds=rounds, round_steps=round_steps, prefetch=prefetch)
    try:
        ratios = [bench(tokens, seq_len=seq_len, **common),
                  bench(images, seq_len=None, **common)]
    except DataError as err:
        sys.exit(f"error: {err}\nprepare the data first: hpctrain-prep text shakespeare -o "
                 f"data/shakespeare.h5; hpctrain-prep fashion-mnist -o data/fashion-mnist.h5")
    click.echo(f"loader / raw h5py: lowest {min(ratios):.1f} % (target >= 80 %)")


if __name__ == "__main__":
    main()
