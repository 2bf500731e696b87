"""Partition one dataset file into N shard files and a manifest, in one new folder.

Every table is split by rows (a token stream by rows of ``row_size`` tokens), each
table independently; replicated groups are copied whole into every shard::

    strategy     shard of row i (n rows, N shards, sizes s_k)
    contiguous   k such that s_0 + ... + s_(k-1) <= i < s_0 + ... + s_k
    strided      i mod N; with unequal sizes, shard k's rows are spread evenly over
                 the table (row positions (j + 1/2) / s_k, j < s_k, merged in order)
    shuffled     the k-th block of s_k rows of a permutation seeded by (seed, table)

Sizes are balanced (``n // N``, the first ``n % N`` shards one more) or, with
weights, proportional to them by largest remainders. Each shard holds its rows in
ascending source order, so shard content and its checksum are reproducible from the
source and the row ranges alone; ``verify`` relies on that.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np

from data_prep.write import no_progress
from hpctrain.data.contents import CONTENT_ATTRS
from hpctrain.data.format import (
    MANIFEST,
    MANIFEST_NAME,
    SHARD,
    VERSIONS,
    DataError,
    Layout,
    atomic_output,
    check_file,
    check_output,
    create_dataset,
    open_h5,
    sha256_file,
    table_rows,
)
from hpctrain.data.manifest import read_manifest, runs

STRATEGIES = ("contiguous", "strided", "shuffled")
DEFAULT_ROW_SIZE = 4096  # tokens per row when partitioning a token stream
BLOCK_BYTES = 16 << 20  # source bytes read at a time


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.h5"


def split_sizes(n: int, weights: tuple[float, ...]) -> np.ndarray:
    """Rows per shard: proportional to ``weights``, by largest remainders (ties: first)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = n * w / w.sum()
    sizes = np.floor(exact).astype(np.int64)
    short = n - int(sizes.sum())
    order = np.argsort(-(exact - sizes), kind="stable")
    sizes[order[:short]] += 1
    return sizes


def assign_rows(n: int, sizes: np.ndarray, strategy: str, seed: int, table_index: int
                ) -> np.ndarray:
    """Shard of every row, (n,) int32; see the module docstring."""
    num = len(sizes)
    owners = np.repeat(np.arange(num, dtype=np.int32), sizes)  # contiguous
    if strategy == "contiguous":
        return owners
    if strategy == "strided":
        if np.all(sizes == split_sizes(n, (1.0,) * num)):
            return (np.arange(n) % num).astype(np.int32)
        position = np.concatenate([(np.arange(s) + 0.5) / s for s in sizes])
        return owners[np.lexsort((owners, position))]
    if strategy == "shuffled":
        out = np.empty(n, dtype=np.int32)
        out[np.random.default_rng([seed, table_index]).permutation(n)] = owners
        return out
    raise DataError(f"strategy {strategy!r} must be one of {', '.join(STRATEGIES)}")


def table_plan(f: h5py.File, layout: Layout, row_size: int) -> dict[str, tuple[int, int, int]]:
    """``{table: (rows, row_size, elements)}``; row_size is 1 except for token streams."""
    plan = {}
    for table in layout.tables:
        elements = table_rows(f, layout, table)
        rs = row_size if layout.unit == "token" else 1
        plan[table] = (-(-elements // rs), rs, elements)
    return plan


def stream_rows(f: h5py.File, layout: Layout, table: str, plan: tuple[int, int, int],
                owner: np.ndarray, done=lambda rows: None
                ) -> Iterator[tuple[int, str, np.ndarray]]:
    """Read a table once, in order, yielding ``(shard, dataset path, data)``.

    ``data`` is the next piece of that shard's content: its rows of the block just read,
    in ascending source order. Used to write shards and, in ``verify``, to recompute
    their checksums from the source. ``done(rows)`` is called after every block.
    """
    rows, rs, elements = plan
    row_bytes = sum(f[c.path].dtype.itemsize * int(np.prod(f[c.path].shape[1:]))
                    for c in layout.tables[table]) * rs
    block = max(1, BLOCK_BYTES // max(1, row_bytes))
    for r0 in range(0, rows, block):
        r1 = min(rows, r0 + block)
        mine = owner[r0:r1]
        lengths = np.full(r1 - r0, rs, dtype=np.int64)
        lengths[-1] = min(r1 * rs, elements) - (r1 - 1) * rs
        for col in layout.tables[table]:
            data = f[col.path][r0 * rs:min(r1 * rs, elements)]
            for k in np.unique(mine).tolist():
                sel = mine == k
                yield k, col.path, data[np.repeat(sel, lengths) if rs > 1 else sel]
        done(r1 - r0)


def partition(source: Path, out: Path, *, num_shards: int, strategy: str = "contiguous",
              seed: int = 0, weights: tuple[float, ...] | None = None,
              row_size: int = DEFAULT_ROW_SIZE, compression: str | None = None,
              force: bool = False, progress=no_progress) -> Path:
    """Write ``out/shard-0000k.h5`` for k < num_shards and ``out/manifest.h5``.

    ``compression`` None keeps each dataset's compression from the source.
    """
    weights = weights or (1.0,) * num_shards
    if len(weights) != num_shards:
        raise DataError(f"{len(weights)} weights for {num_shards} shards: give one per shard")
    if row_size < 1:
        raise DataError(f"row size ({row_size}) must be at least 1")
    check_output(out, force, folder=True)
    if source.is_dir() and (source / MANIFEST_NAME).is_file():
        m = read_manifest(source)
        was = str(m.source) if m.source is not None else f"{m.source_relpath} (not found now)"
        raise DataError(f"{source}: is already a partition (its {MANIFEST_NAME} names the "
                        f"dataset file {was}); partition that file: hpctrain-prep partition "
                        f"DATASET.h5 -o {out} -n {num_shards}")
    with open_h5(source) as src:
        info = check_file(src, source)
        if info.layout is None or info.format == SHARD:
            raise DataError(f"{source}: is a {info.format} file; partition a dataset file "
                            f"(hpctrain.tokens, hpctrain.images or hpctrain.ratings)")
        if info.layout.whole:
            raise DataError(f"{source}: is one {info.format} volume, which every rank reads "
                            f"whole; it has no rows to partition")
        plans = table_plan(src, info.layout, row_size)
        owners = {}
        for i, (table, (rows, rs, _)) in enumerate(plans.items()):
            unit = f" of {rs} tokens" if rs > 1 else ""
            if rows < num_shards:
                hint = "; use a smaller --row-size" if info.layout.unit == "token" else ""
                raise DataError(f"{source}: table {table!r} has {rows} rows{unit}, fewer than "
                                f"the {num_shards} partitions asked for{hint}")
            sizes = split_sizes(rows, weights)
            if sizes.min() == 0:
                k = int(np.argmin(sizes))
                raise DataError(f"{source}: with weights {list(weights)}, shard {k} would get "
                                f"no rows of table {table!r} ({rows} rows{unit})")
            owners[table] = assign_rows(rows, sizes, strategy, seed, i)
        with atomic_output(out, force=force, folder=True) as tmp:
            _write_shards(src, info, tmp, plans, owners, num_shards, strategy, seed,
                          compression, progress)
            _write_manifest(source, out, tmp, info, plans, owners, num_shards, strategy, seed,
                            weights)
    return out / MANIFEST_NAME


def _write_shards(src, info, tmp: Path, plans, owners, num_shards, strategy, seed, compression,
                  progress):
    layout = info.layout
    extra = {k: v for k, v in info.attrs.items() if k not in ("format", "version")}
    files = [h5py.File(tmp / shard_name(k), "w-") for k in range(num_shards)]
    try:
        hashes, cursors = {}, {}
        for k, f in enumerate(files):
            f.attrs.update(extra | {"format": SHARD, "version": VERSIONS[SHARD],
                                    "source_format": info.format,
                                    "source_version": info.version, "shard": k,
                                    "num_shards": num_shards, "strategy": strategy,
                                    "seed": seed})
            for group in layout.replicated:
                src.copy(src[group], f, name=group)
            for table, (rows, rs, elements) in plans.items():
                mine = np.flatnonzero(owners[table] == k)
                ranges = runs(mine)
                d = f.create_dataset(f"partition/{table}", data=ranges)
                d.attrs.update({"row_size": rs, "source_rows": rows,
                                "source_elements": elements})
                n_el = int(sum(min(b * rs, elements) - a * rs for a, b in ranges))
                for col in layout.tables[table]:
                    sd = src[col.path]
                    dd = create_dataset(f, col.path, (n_el, *sd.shape[1:]), sd.dtype,
                                        compression or sd.compression or "none")
                    dd.attrs.update({k2: v for k2, v in sd.attrs.items() if k2 != "sha256"})
                    hashes[k, col.path] = hashlib.sha256()
                    cursors[k, col.path] = 0
        total = sum(p[0] for p in plans.values())
        with progress(total, "partitioning") as bar:
            for table, plan in plans.items():
                for k, path, data in stream_rows(src, layout, table, plan, owners[table],
                                                 bar.update):
                    a = cursors[k, path]
                    files[k][path][a:a + len(data)] = data
                    cursors[k, path] = a + len(data)
                    hashes[k, path].update(np.ascontiguousarray(data).data)
        for (k, path), h in hashes.items():
            files[k][path].attrs["sha256"] = h.hexdigest()
    finally:
        for f in files:
            f.close()


def _write_manifest(source, out, tmp, info, plans, owners, num_shards, strategy, seed,
                    weights):
    path = tmp / MANIFEST_NAME
    with h5py.File(path, "w-") as m:
        m.attrs.update({"format": MANIFEST, "version": VERSIONS[MANIFEST],
                        "source_format": info.format, "source_version": info.version,
                        "source": os.path.relpath(Path(source).resolve(),
                                                  Path(out).resolve()),
                        "source_sha256": sha256_file(source), "strategy": strategy,
                        "seed": seed, "weights": np.asarray(weights, dtype=np.float64),
                        "num_shards": num_shards})
        # what the data hold (vocabulary, classes), for the check against the model
        m.attrs.update({k: info.attrs[k] for k in CONTENT_ATTRS if k in info.attrs})
        for table, (rows, rs, elements) in plans.items():
            g = m.create_group(f"tables/{table}")
            g.attrs.update({"rows": rows, "row_size": rs, "elements": elements})
        for k in range(num_shards):
            shard = tmp / shard_name(k)
            g = m.create_group(f"shards/{k:05d}")
            g.attrs.update({"index": k, "path": shard_name(k),
                            "file_size": shard.stat().st_size, "sha256": sha256_file(shard)})
            for table in plans:
                ranges = runs(np.flatnonzero(owners[table] == k))
                d = g.create_dataset(table, data=ranges)
                d.attrs.update({"rows": int((ranges[:, 1] - ranges[:, 0]).sum())})
