"""Opening the checkpoint index of a large job, which every rank of a load does.

    python benchmarks/bench_index.py                       # 1,024 ranks, both cuts
    python benchmarks/bench_index.py --ranks 4096 --cut columns

A job of R ranks writes every tensor in up to R pieces (ZeRO's shards of the
optimizer state over the data-parallel ranks, tensor-parallel columns), and the index
(``index.h5``) lists them all; a load opens it on every rank (rank 0 reads the file
and broadcasts its bytes, ``checkpoint.training.index_image``), parses it and checks,
per tensor, that its pieces tile the global shape exactly once
(``checkpoint.reshard.tiles``). This builds the index of the benchmark GPT's 231
tensors as R ranks would cut them, without writing any tensor data (the data files
are empty: only their names are checked), and times ``write_index`` (rank 0 of a
save), ``read_index`` (the parse) and ``Checkpoint()`` (parse, tiling check and the
data files' existence), each the median of ``--repeats``. ``--cut rows``: every piece
a band of rows (as flat ZeRO shards are); ``columns``: every piece spans all rows, as
a tensor-parallel split along the last axis does, the case where sorting the pieces by
their first axis leaves every pair to compare.
"""

from __future__ import annotations

import functools
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import click
import h5py

from hpctrain.checkpoint.format import META_KEYS, Piece, TensorEntry, read_index, write_index
from hpctrain.checkpoint.reader import Checkpoint

TENSORS = 231  # the benchmark GPT's parameters and AdamW's two moments each, and the step


def entries(ranks: int, tensors: int, cut: str, files: list[str]) -> list[TensorEntry]:
    """``tensors`` tensors of (64 * ranks, 4) or (4, 64 * ranks), one piece a rank."""
    out = []
    for t in range(tensors):
        if cut == "rows":
            shape = (64 * ranks, 4)
            boxes = [((64 * r, 64 * (r + 1)), (0, 4)) for r in range(ranks)]
        else:
            shape = (4, 64 * ranks)
            boxes = [((0, 4), (64 * r, 64 * (r + 1))) for r in range(ranks)]
        pieces = tuple(Piece(files[r], "float32", tuple(a for a, _ in box),
                             tuple(b for _, b in box), "0" * 32, None, 256 * t)
                       for r, box in enumerate(boxes))
        out.append(TensorEntry(f"model/t{t}", "float32", shape, None, 1, pieces))
    return out


def write(path: Path, files: list[str], table: list[TensorEntry]) -> None:
    with h5py.File(path, "w") as f:
        write_index(f, step=1, meta={key: {} for key in META_KEYS}, files=files,
                    tensors=table)


def open_close(path: Path) -> None:
    Checkpoint(path).close()


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@click.command()
@click.option("--ranks", type=click.IntRange(1), multiple=True, default=(64, 1024),
              show_default=True, help="Ranks of the job that wrote the index (repeatable).")
@click.option("--cut", type=click.Choice(["rows", "columns", "both"]), default="both",
              show_default=True, help="How each tensor is cut into the ranks' pieces.")
@click.option("--tensors", type=click.IntRange(1), default=TENSORS, show_default=True,
              help="Tensors in the index.")
@click.option("--repeats", type=click.IntRange(1), default=3, show_default=True,
              help="Timed repetitions of each figure (the median is printed).")
def main(ranks: tuple[int, ...], cut: str, tensors: int, repeats: int) -> None:
    """Time writing, parsing and opening the index of a checkpoint of many ranks."""
    cuts = ["rows", "columns"] if cut == "both" else [cut]
    print(f"{'ranks':>6} {'cut':>8} {'pieces':>9} {'index MB':>9} {'write_index':>12} "
          f"{'read_index':>11} {'Checkpoint()':>13}")
    for r in ranks:
        for c in cuts:
            folder = Path(tempfile.mkdtemp(prefix="hpctrain-index-"))
            try:
                files = [f"rank-{k:05d}.h5" for k in range(r)]
                for name in files:
                    (folder / name).touch()
                table = entries(r, tensors, c, files)
                path = folder / "index.h5"

                w = timed(functools.partial(write, path, files, table), repeats)
                parse = timed(functools.partial(read_index, path), repeats)
                opened = timed(functools.partial(open_close, path), repeats)
                print(f"{r:>6} {c:>8} {r * tensors:>9,} {path.stat().st_size / 1e6:>9.1f} "
                      f"{w:>10.3f} s {parse:>9.3f} s {opened:>11.3f} s", flush=True)
            finally:
                shutil.rmtree(folder)


if __name__ == "__main__":
    main()
