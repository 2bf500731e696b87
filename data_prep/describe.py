"""Human-readable description of a dataset file, a shard file or a partition manifest."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from hpctrain.data.format import MANIFEST, SHARD, check_file, open_h5, read_format
from hpctrain.data.manifest import Manifest, read_manifest, resolve


def size_text(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def ranges_text(r: np.ndarray, limit: int = 3) -> str:
    """``0-99, 200-299`` for a few ranges (inclusive ends), else a count and the first."""
    if r.shape[0] == 0:
        return "none"
    spans = [f"{a}-{b - 1}" if b - a > 1 else f"{a}" for a, b in r[:limit].tolist()]
    more = f", ... ({r.shape[0]} ranges)" if r.shape[0] > limit else ""
    return ", ".join(spans) + more


def _attr_text(value) -> str:
    if isinstance(value, np.ndarray):
        items = value.tolist()
        text = ", ".join(str(v) for v in items[:6]) + (", ..." if len(items) > 6 else "")
        return f"[{text}] ({len(items)})"
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _dataset_line(name: str, d: h5py.Dataset) -> str:
    chunks = f"chunks {d.chunks}" if d.chunks else "contiguous"
    comp = f", {d.compression}" if d.compression else ""
    return (f"  {name:<24} {str(d.shape):<18} {str(d.dtype):<8} {chunks}{comp}, "
            f"{size_text(d.id.get_storage_size())}")


def describe(path: str | Path) -> list[str]:
    path = resolve(path)
    with open_h5(path) as f:
        name, version = read_format(f, path)
        if name == MANIFEST:
            return _describe_manifest(read_manifest(path))
        info = check_file(f, path)
        lines = [f"{path}: {name} version {version}, {size_text(path.stat().st_size)}"]
        if name == SHARD:
            lines.append(f"shard {int(f.attrs['shard'])} of {int(f.attrs['num_shards'])} "
                         f"({f.attrs['strategy']}) of {info.data_format}")
        lines.append("attributes:")
        lines += [f"  {k} = {_attr_text(v)}" for k, v in sorted(f.attrs.items())
                  if k not in ("format", "version")]
        lines.append("datasets:")
        f.visititems(lambda n, obj: lines.append(_dataset_line(n, obj))
                     if isinstance(obj, h5py.Dataset) else None)
        if name == SHARD:
            lines.append("source rows held:")
            lines += [f"  {table}: {ranges_text(f[f'partition/{table}'][...].reshape(-1, 2))}"
                      for table in info.layout.tables]
    return lines


def _describe_manifest(m: Manifest) -> list[str]:
    lines = [f"{m.path}: partition manifest of {len(m.shards)} shard(s)",
             f"source: {m.source_relpath} ({m.source_format} version {m.source_version}"
             f"{'' if m.source is not None else ', not found'}), sha256 {m.source_sha256[:16]}",
             f"strategy: {m.strategy}, seed {m.seed}, weights {list(m.weights)}",
             "tables:"]
    for table, t in m.tables.items():
        unit = f" of {t.row_size} elements" if t.row_size > 1 else ""
        lines.append(f"  {table}: {t.rows} rows{unit}, {t.elements} elements")
    lines.append("shard map:")
    for e in m.shards:
        found = "" if e.path.is_file() else "  MISSING"
        lines.append(f"  {e.index:>4}  {e.relpath}  {size_text(e.file_size)}  "
                     f"sha256 {e.sha256[:16]}{found}")
        for table in m.tables:
            lines.append(f"        {table}: {m.shard_rows(e, table)} rows: "
                         f"{ranges_text(e.ranges[table])}")
    return lines
