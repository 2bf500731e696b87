"""Partition manifests: reading them, assigning shards to ranks, opening one shard.

A manifest (``hpctrain.manifest``) sits in the partition's folder beside its shards and
lists, for every shard, its file (path relative to the manifest's folder), size and
sha256, and for every table the ``[start, stop)`` ranges of source rows it holds. Row
``i`` of a table covers source elements ``[i * row_size, min((i + 1) * row_size, n))``.

Shards are assigned to data-parallel ranks in contiguous blocks (``assign_shards``);
a rank opens only the shards assigned to it, after checking each file's size against
the manifest, so a truncated shard is refused before any data are read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from hpctrain.data.format import (
    LAYOUTS,
    MANIFEST,
    MANIFEST_NAME,
    SHARD,
    DataError,
    FileInfo,
    check_file,
    open_h5,
    read_format,
)


@dataclass(frozen=True)
class TableInfo:
    rows: int  # source rows (of row_size elements)
    row_size: int
    elements: int  # source length along axis 0


@dataclass(frozen=True)
class ShardEntry:
    index: int
    path: Path  # resolved against the manifest's folder
    relpath: str
    file_size: int
    sha256: str
    ranges: dict[str, np.ndarray]  # table -> (r, 2) int64 [start, stop) source rows


@dataclass(frozen=True)
class Manifest:
    path: Path
    source_format: str
    source_version: int
    source: Path | None  # the partitioned file, if its recorded path still resolves
    source_relpath: str
    source_sha256: str
    strategy: str
    seed: int
    weights: tuple[float, ...]
    tables: dict[str, TableInfo]
    shards: tuple[ShardEntry, ...]

    def shard_rows(self, entry: ShardEntry, table: str) -> int:
        r = entry.ranges[table]
        return int((r[:, 1] - r[:, 0]).sum())

    def shard_elements(self, entry: ShardEntry, table: str) -> int:
        t = self.tables[table]
        return int(sum(b - a for a, b in element_ranges(entry.ranges[table], t.row_size,
                                                        t.elements)))


def element_ranges(ranges: np.ndarray, row_size: int, elements: int) -> list[tuple[int, int]]:
    """Source element ranges ``[(a, b), ...]`` covered by row ranges ``(r, 2)``."""
    return [(int(a) * row_size, min(int(b) * row_size, elements)) for a, b in ranges]


def runs(rows: np.ndarray) -> np.ndarray:
    """Maximal ``[start, stop)`` runs of an ascending array of distinct row indices."""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = rows[np.r_[0, breaks]]
    stops = rows[np.r_[breaks - 1, rows.size - 1]] + 1
    return np.stack([starts, stops], axis=1)


def resolve(path: str | Path) -> Path:
    """A partition folder stands for the manifest inside it."""
    path = Path(path)
    if path.is_dir() and (path / MANIFEST_NAME).is_file():
        return path / MANIFEST_NAME
    return path


def read_manifest(path: str | Path) -> Manifest:
    path = resolve(path)
    with open_h5(path) as f:
        name, _ = read_format(f, path)
        if name != MANIFEST:
            raise DataError(f"{path}: is a {name} file, not a partition manifest")
        return _parse(f, path)


def _parse(f: h5py.File, path: Path) -> Manifest:
    try:
        a = f.attrs
        source_format = str(a["source_format"])
        if source_format not in LAYOUTS:
            raise DataError(f"{path}: manifest of unknown source format {source_format!r}")
        tables = {t: TableInfo(int(g.attrs["rows"]), int(g.attrs["row_size"]),
                               int(g.attrs["elements"])) for t, g in f["tables"].items()}
        shards = []
        for key in sorted(f["shards"]):
            g = f["shards"][key]
            shards.append(ShardEntry(
                index=int(g.attrs["index"]), path=(path.parent / str(g.attrs["path"])),
                relpath=str(g.attrs["path"]), file_size=int(g.attrs["file_size"]),
                sha256=str(g.attrs["sha256"]),
                ranges={t: np.asarray(g[t][...], dtype=np.int64).reshape(-1, 2)
                        for t in tables}))
        src_rel = str(a["source"])
        src = Path(os.path.normpath(path.parent / src_rel)) if src_rel else None
        m = Manifest(path=path, source_format=source_format,
                     source_version=int(a["source_version"]),
                     source=src if src is not None and src.is_file() else None,
                     source_relpath=src_rel, source_sha256=str(a["source_sha256"]),
                     strategy=str(a["strategy"]), seed=int(a["seed"]),
                     weights=tuple(float(w) for w in a["weights"]), tables=tables,
                     shards=tuple(shards))
    except KeyError as err:
        raise DataError(f"{path}: manifest is incomplete (missing {err}); "
                        f"re-run hpctrain-prep partition") from None
    if [s.index for s in m.shards] != list(range(int(a["num_shards"]))):
        raise DataError(f"{path}: manifest lists shards {[s.index for s in m.shards]}, "
                        f"expected 0..{int(a['num_shards']) - 1}")
    return m


def assign_shards(num_shards: int, dp_size: int) -> list[list[int]]:
    """Shards of each data-parallel rank: rank r gets [r*S // dp, (r+1)*S // dp).

    Every rank needs at least one shard, so ``num_shards >= dp_size``. For 6 shards on
    4 ranks::

        rank   0     1       2     3
        shards [0]   [1, 2]  [3]   [4, 5]
    """
    if dp_size < 1:
        raise DataError(f"dp_size ({dp_size}) must be at least 1")
    if num_shards < dp_size:
        raise DataError(f"{num_shards} shard(s) cannot feed dp_size {dp_size}: every "
                        f"data-parallel rank reads whole shards; re-run hpctrain-prep "
                        f"partition with -n {dp_size} (or a multiple of it)")
    return [list(range(r * num_shards // dp_size, (r + 1) * num_shards // dp_size))
            for r in range(dp_size)]


def open_shard(m: Manifest, entry: ShardEntry, **h5_kwargs) -> tuple[h5py.File, FileInfo]:
    """Open one shard after checking its size, format and row counts against ``m``."""
    p = entry.path
    where = f"shard {entry.index} ({p})"
    if not p.is_file():
        raise DataError(f"{where}: no such file; the manifest {m.path} lists it")
    size = p.stat().st_size
    if size != entry.file_size:
        raise DataError(f"{where}: file is {size} bytes, the manifest records "
                        f"{entry.file_size} (truncated or replaced); re-run "
                        f"hpctrain-prep partition")
    f = open_h5(p, **h5_kwargs)
    try:
        info = check_file(f, p)
        if info.format != SHARD or info.data_format != m.source_format:
            raise DataError(f"{where}: is {info.format} of {info.data_format}, the manifest "
                            f"expects a {SHARD} of {m.source_format}")
        if int(f.attrs.get("shard", -1)) != entry.index:
            raise DataError(f"{where}: holds shard {int(f.attrs.get('shard', -1))}, "
                            f"the manifest expects shard {entry.index}")
        for table in m.tables:
            want = m.shard_elements(entry, table)
            have = int(f[info.layout.tables[table][0].path].shape[0])
            if have != want:
                raise DataError(f"{where}: table {table!r} has {have} elements, "
                                f"the manifest records {want}")
    except BaseException:
        f.close()
        raise
    return f, info


def shard_segments(f: h5py.File, path: Path, table: str) -> list[tuple[int, int]]:
    """Runs of consecutive source elements in a shard's table: ``[(offset, length)]``.

    Offsets are positions inside the shard's datasets; a token window must not cross
    from one run into the next, whose text does not follow it in the source.
    """
    key = f"partition/{table}"
    if key not in f:
        raise DataError(f"{path}: shard has no {key!r} dataset; re-run hpctrain-prep partition")
    d = f[key]
    ranges = np.asarray(d[...], dtype=np.int64).reshape(-1, 2)
    spans = element_ranges(ranges, int(d.attrs["row_size"]), int(d.attrs["source_elements"]))
    out, offset = [], 0
    for a, b in spans:
        out.append((offset, b - a))
        offset += b - a
    return out
