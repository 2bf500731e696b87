"""Check a dataset file, a shard file or a whole partition against its own records.

For a manifest: every shard exists, has the recorded size and sha256, is a shard of
the right format, index and row counts, and its datasets match their checksums; the
shards' row ranges cover every source row exactly once; and, when the source file
is found, the content of every shard equals its rows of the source (recomputed from
one pass over the source, compared by sha256).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from data_prep.partition import stream_rows
from data_prep.write import no_progress
from hpctrain.data.format import (
    MANIFEST,
    SHARD,
    DataError,
    check_file,
    open_h5,
    read_format,
    sha256_dataset,
    sha256_file,
)
from hpctrain.data.manifest import (
    Manifest,
    element_ranges,
    open_shard,
    read_manifest,
    resolve,
)


@dataclass
class Report:
    path: Path
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(path: str | Path, *, source: str | Path | None = None,
           progress=no_progress) -> Report:
    """Check ``path``; problems are collected, not raised, so all of them are reported."""
    path = resolve(path)
    report = Report(path)
    try:
        with open_h5(path) as f:
            name, version = read_format(f, path)
        if name == MANIFEST:
            _verify_manifest(read_manifest(path), source, report, progress)
        else:
            with open_h5(path) as f:
                info = check_file(f, path)
                of = f" of {info.data_format}" if info.format == SHARD else ""
                report.notes.append(f"{info.format} version {version}{of}")
                _verify_checksums(f, str(path), report, progress)
                if info.format == SHARD:
                    _verify_shard_ranges(f, info, str(path), report)
    except DataError as err:
        report.problems.append(str(err))
    return report


def _verify_checksums(f: h5py.File, where: str, report: Report, progress) -> None:
    dsets = []
    f.visititems(lambda name, obj: dsets.append(obj) if isinstance(obj, h5py.Dataset)
                 and not name.startswith("partition/") else None)
    with progress(len(dsets), "checksums") as bar:
        for d in dsets:
            want = d.attrs.get("sha256")
            if want is None:
                report.problems.append(f"{where}: dataset {d.name!r} has no sha256 attribute")
            elif sha256_dataset(d) != str(want):
                report.problems.append(f"{where}: dataset {d.name!r} does not match its "
                                       f"sha256 (corrupt); re-create the file")
            bar.update(1)
    report.notes.append(f"{where}: {len(dsets)} dataset checksum(s) checked")


def _verify_shard_ranges(f: h5py.File, info, where: str, report: Report) -> None:
    for table, cols in info.layout.tables.items():
        d = f.get(f"partition/{table}")
        if d is None:
            report.problems.append(f"{where}: no partition/{table} row ranges")
            continue
        spans = element_ranges(d[...].reshape(-1, 2), int(d.attrs["row_size"]),
                               int(d.attrs["source_elements"]))
        have = int(f[cols[0].path].shape[0])
        if sum(b - a for a, b in spans) != have:
            report.problems.append(f"{where}: table {table!r} has {have} elements, its "
                                   f"partition ranges cover {sum(b - a for a, b in spans)}")


def _verify_manifest(m: Manifest, source, report: Report, progress) -> None:
    report.notes.append(f"manifest of {len(m.shards)} {m.strategy} shard(s) of {m.source_format}")
    content = {}  # (shard, dataset path) -> sha256 recorded in the shard
    with progress(len(m.shards), "shards") as bar:
        for entry in m.shards:
            where = f"shard {entry.index} ({entry.path})"
            try:
                f, info = open_shard(m, entry)
            except DataError as err:
                report.problems.append(str(err))
                bar.update(1)
                continue
            with f:
                if sha256_file(entry.path) != entry.sha256:
                    report.problems.append(f"{where}: file sha256 differs from the manifest's "
                                           f"(corrupt or replaced); re-run hpctrain-prep "
                                           f"partition")
                _verify_checksums(f, where, report, no_progress)
                for table in m.tables:
                    ranges = np.asarray(f[f"partition/{table}"][...]).reshape(-1, 2)
                    if not np.array_equal(ranges, entry.ranges[table]):
                        report.problems.append(f"{where}: row ranges of {table!r} differ "
                                               f"from the manifest's")
                    for col in info.layout.tables[table]:
                        content[entry.index, col.path] = str(f[col.path].attrs.get("sha256"))
            bar.update(1)
    owners = {t: _coverage(m, t, report) for t in m.tables}
    src = Path(source) if source is not None else m.source
    if src is None:
        report.notes.append(f"source {m.source_relpath!r} not found beside the manifest: "
                            f"shard contents not compared with it (pass --source)")
        return
    if sha256_file(src) != m.source_sha256:
        report.problems.append(f"{src}: differs from the file that was partitioned "
                               f"(sha256 changed); re-run hpctrain-prep partition")
        return
    _verify_content(m, src, owners, content, report, progress)


def _coverage(m: Manifest, table: str, report: Report) -> np.ndarray | None:
    """Check every source row is in exactly one shard; return the owner of each row."""
    rows = m.tables[table].rows
    count = np.zeros(rows + 1, dtype=np.int64)
    owner = np.full(rows, -1, dtype=np.int64)
    for entry in m.shards:
        r = entry.ranges[table]
        if r.size and (r[:, 0].min() < 0 or r[:, 1].max() > rows or (r[:, 1] <= r[:, 0]).any()):
            report.problems.append(f"shard {entry.index} ({entry.path}): row ranges of "
                                   f"{table!r} fall outside 0..{rows} or are empty")
            return None
        np.add.at(count, r[:, 0], 1)
        np.add.at(count, r[:, 1], -1)
        for a, b in r:
            owner[a:b] = entry.index
    times = np.cumsum(count)[:rows]
    for bad, what in ((times == 0, "in no shard"), (times > 1, "in more than one shard")):
        if bad.any():
            first = int(np.argmax(bad))
            report.problems.append(f"table {table!r}: {int(bad.sum())} source row(s) are "
                                   f"{what}, the first is row {first}")
    if (times != 1).any():
        return None
    report.notes.append(f"table {table!r}: the shards cover its {rows} rows exactly once")
    return owner


def _verify_content(m: Manifest, src: Path, owners, content, report: Report, progress) -> None:
    before = len(report.problems)
    with open_h5(src) as f:
        info = check_file(f, src)
        for table, t in m.tables.items():
            if owners[table] is None:
                continue
            cols = {c.path for c in info.layout.tables[table]}
            hashes = {key: hashlib.sha256() for key in content if key[1] in cols}
            with progress(t.rows, f"comparing {table}") as bar:
                for k, path, data in stream_rows(f, info.layout, table,
                                                 (t.rows, t.row_size, t.elements),
                                                 owners[table], bar.update):
                    if (k, path) in hashes:
                        hashes[k, path].update(np.ascontiguousarray(data).data)
            for (k, path), h in hashes.items():
                if h.hexdigest() != content[k, path]:
                    report.problems.append(f"shard {k} ({m.shards[k].path}): dataset "
                                           f"{path!r} differs from its rows of {src}")
    if len(report.problems) == before:
        report.notes.append(f"shard contents equal their rows of {src}")
