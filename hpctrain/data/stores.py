"""Readers of one rank's samples: token windows and image rows, gathered by sample id.

A store knows nothing of steps, epochs or ranks: it maps sample ids ``0..n-1`` to
bytes in one or more open datasets and reads only those bytes. The samplers in
``loader.py`` decide which ids a rank reads at a step.

Rows are read through ``DirectRows`` where a dataset allows it: HDF5 keeps every
unfiltered chunk as its C-order bytes at one offset in the file, so rows ``[a, b)``
are a slice of a read-only memory map of the file, with no HDF5 call per sample (a
token window is 129 bytes; an h5py call costs more than copying them). Compressed
datasets, chunks that split rows, and unallocated chunks are read through h5py. The
chunk index is checked against the file's size when a reader is made; a dataset file
must not be rewritten in place while a loader has it open (prep never does: it
writes a new file and renames it).
"""

from __future__ import annotations

import h5py
import numpy as np

from hpctrain.data.format import DataError


class H5Rows:
    """Rows ``[a, b)`` of a dataset, read through h5py."""

    def __init__(self, dset: h5py.Dataset):
        self.dset = dset

    def read(self, a: int, b: int) -> np.ndarray:
        return self.dset[a:b]

    def read_many(self, starts: np.ndarray, width: int) -> np.ndarray:
        """Rows ``[a, a + width)`` for every a in ``starts`` (k,): (k, width, ...)."""
        out = np.empty((len(starts), width, *self.dset.shape[1:]), dtype=self.dset.dtype)
        for i, a in enumerate(starts.tolist()):
            out[i] = self.dset[a:a + width]
        return out


def _chunk_offsets(dsid) -> list[tuple[int, int]]:
    """``(first row, byte offset)`` of every stored chunk: one ``H5Dchunk_iter`` pass
    (HDF5 1.12.3 and newer), else ``H5Dget_chunk_info`` per chunk (HDF5 1.10.5 and
    newer: Debian's parallel HDF5 1.10.8, common on clusters)."""
    infos: list[tuple[int, int]] = []
    if hasattr(dsid, "chunk_iter"):
        dsid.chunk_iter(lambda info: infos.append((info.chunk_offset[0], info.byte_offset)))
        return infos
    for k in range(dsid.get_num_chunks()):
        info = dsid.get_chunk_info(k)
        infos.append((info.chunk_offset[0], info.byte_offset))
    return infos


class DirectRows:
    """Rows ``[a, b)`` of an unfiltered dataset, sliced from a memory map of its file.

    ``offsets[c]`` is the file offset of chunk c, which holds rows
    ``[c * chunk_rows, (c + 1) * chunk_rows)`` (a contiguous dataset is one chunk).
    """

    def __init__(self, data: np.memmap, offsets: np.ndarray, chunk_rows: int,
                 row_shape: tuple[int, ...], dtype: np.dtype):
        self.data = data.view(np.ndarray)  # plain slices: a memmap's own are slower
        self.offsets, self.chunk_rows = np.asarray(offsets, dtype=np.int64), chunk_rows
        self.row_shape, self.dtype = row_shape, dtype
        self.row_bytes = dtype.itemsize * int(np.prod(row_shape, dtype=np.int64))

    @classmethod
    def of(cls, dset: h5py.Dataset, maps: dict[str, np.memmap]) -> DirectRows | None:
        """The direct reader of ``dset``, or None if its bytes are not plain rows."""
        n = dset.shape[0] if dset.ndim else 0
        if n == 0 or dset.id.get_create_plist().get_nfilters() or dset.dtype.kind in "OV":
            return None
        path = dset.file.filename
        row_bytes = dset.dtype.itemsize * int(np.prod(dset.shape[1:], dtype=np.int64))
        if dset.chunks is None:
            offset = dset.id.get_offset()
            if offset is None:
                return None
            chunk_rows, offsets, extent = n, np.array([offset]), offset + n * row_bytes
        else:
            if tuple(dset.chunks[1:]) != tuple(dset.shape[1:]):
                return None
            chunk_rows = dset.chunks[0]
            offsets = np.full(-(-n // chunk_rows), -1, dtype=np.int64)
            for first_row, byte_offset in _chunk_offsets(dset.id):
                offsets[first_row // chunk_rows] = byte_offset
            if (offsets < 0).any():
                return None
            extent = int(offsets.max()) + chunk_rows * row_bytes
        if path not in maps:
            maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        if extent > maps[path].size:
            raise DataError(f"{path}: dataset {dset.name!r} extends past the end of the file "
                            f"(truncated); re-create the file")
        return cls(maps[path], offsets, chunk_rows, tuple(dset.shape[1:]), dset.dtype)

    def read(self, a: int, b: int) -> np.ndarray:
        """A view of rows [a, b) (copy it before the map is closed)."""
        cr, rb = self.chunk_rows, self.row_bytes
        c0, c1 = a // cr, (b - 1) // cr
        if c0 == c1:
            start = int(self.offsets[c0]) + (a - c0 * cr) * rb
            raw = self.data[start:start + (b - a) * rb]
        else:  # the rows cross chunk boundaries: one piece per chunk
            pieces = []
            for c in range(c0, c1 + 1):
                lo, hi = max(a, c * cr), min(b, (c + 1) * cr)
                start = int(self.offsets[c]) + (lo - c * cr) * rb
                pieces.append(self.data[start:start + (hi - lo) * rb])
            raw = np.concatenate(pieces)
        return raw.view(self.dtype).reshape(b - a, *self.row_shape)

    def read_many(self, starts: np.ndarray, width: int) -> np.ndarray:
        """Rows ``[a, a + width)`` for every a in ``starts`` (k,), in one gather.

        Byte positions (k, width * row_bytes) index the map at once; the few runs that
        cross a chunk boundary are read one by one.
        """
        cr, rb = self.chunk_rows, self.row_bytes
        starts = np.asarray(starts, dtype=np.int64)
        chunk = starts // cr
        crossing = (starts + width - 1) // cr != chunk
        where = self.offsets[chunk] + (starts - chunk * cr) * rb  # (k,) first byte
        where[crossing] = 0  # placeholders, read below: their bytes may pass the file's end
        raw = self.data[where[:, None] + np.arange(width * rb)]  # (k, width * rb)
        for i in np.flatnonzero(crossing).tolist():
            a = int(starts[i])
            raw[i] = self.read(a, a + width).reshape(-1).view(np.uint8)
        return raw.view(self.dtype).reshape(len(starts), width, *self.row_shape)


def row_reader(dset: h5py.Dataset, maps: dict[str, np.memmap] | None):
    """A direct reader where possible (``maps`` not None), else an h5py one."""
    direct = DirectRows.of(dset, maps) if maps is not None else None
    return direct or H5Rows(dset)


class TokenWindows:
    """Windows of ``T + 1`` consecutive tokens inside runs of a token stream.

    ``segments`` are ``(dataset, offset, length)`` runs of consecutive source text; a
    run of length L holds ``L - T`` windows (starts ``0..L-T-1``), and no window
    crosses from one run into the next. Window id ``i`` counts windows run by run.
    """

    def __init__(self, segments: list[tuple[h5py.Dataset, int, int]], seq_len: int,
                 direct: bool = True):
        self.segments = segments
        self.seq_len = seq_len
        self.maps: dict[str, np.memmap] = {}
        readers: dict[tuple[str, str], int] = {}  # one reader per dataset
        self.readers = []
        for dset, _, _ in segments:
            key = (dset.file.filename, dset.name)
            if key not in readers:
                readers[key] = len(self.readers)
                self.readers.append(row_reader(dset, self.maps if direct else None))
        self._reader_of = np.array([readers[d.file.filename, d.name] for d, _, _ in segments],
                                   dtype=np.int64)
        counts = np.array([max(0, length - seq_len) for _, _, length in segments],
                          dtype=np.int64)
        self._ends = np.cumsum(counts)  # (S,) windows up to the end of each run
        self._counts = counts
        self._offsets = np.array([offset for _, offset, _ in segments], dtype=np.int64)
        self.num_samples = int(self._ends[-1]) if len(segments) else 0

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Run of each window id (k,) and its first token's position in that run's dataset."""
        ids = np.asarray(ids, dtype=np.int64)
        seg = np.searchsorted(self._ends, ids, side="right")
        first = self._ends[seg] - self._counts[seg]  # id of each run's first window
        return seg, self._offsets[seg] + ids - first

    def gather(self, ids: np.ndarray) -> np.ndarray:
        """Read windows ``ids`` (k,) into a (k, T + 1) uint8 array."""
        seg, start = self.locate(ids)
        width = self.seq_len + 1
        which = self._reader_of[seg]
        if len(self.readers) == 1:
            return self.readers[0].read_many(start, width)
        out = np.empty((seg.size, width), dtype=np.uint8)
        for r in np.unique(which).tolist():
            sel = np.flatnonzero(which == r)
            out[sel] = self.readers[r].read_many(start[sel], width)
        return out

    def close(self) -> None:
        """Drop the readers and memory maps (the h5py files are the loader's to close)."""
        self.readers, self.maps = [], {}


class ImageRows:
    """Rows of one or more ``(images, labels)`` dataset pairs, numbered part by part."""

    def __init__(self, parts: list[tuple[h5py.Dataset, h5py.Dataset]], direct: bool = True):
        self.parts = parts
        self.maps: dict[str, np.memmap] = {}
        maps = self.maps if direct else None
        self.readers = [(row_reader(i, maps), row_reader(lab, maps)) for i, lab in parts]
        lengths = np.array([images.shape[0] for images, _ in parts], dtype=np.int64)
        self._ends = np.cumsum(lengths)
        self._starts = self._ends - lengths
        self.num_samples = int(self._ends[-1]) if parts else 0
        self.image_shape = tuple(parts[0][0].shape[1:]) if parts else (0,)

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Part of each row id (k,) and the row's index inside that part."""
        ids = np.asarray(ids, dtype=np.int64)
        part = np.searchsorted(self._ends, ids, side="right")
        return part, ids - self._starts[part]

    def gather(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Read rows ``ids`` (k,): images (k, H, W) uint8 and labels (k,) uint8.

        Distinct ids are read once, in file order, as maximal runs of consecutive rows
        (one slice per run); duplicates (a batch longer than an epoch) are copied.
        """
        uniq, inverse = np.unique(np.asarray(ids, dtype=np.int64), return_inverse=True)
        images = np.empty((uniq.size, *self.image_shape), dtype=np.uint8)
        labels = np.empty(uniq.size, dtype=np.uint8)
        part, local = self.locate(uniq)
        breaks = np.flatnonzero((np.diff(part) != 0) | (np.diff(local) != 1)) + 1
        bounds = np.r_[0, breaks, uniq.size].tolist()
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            read_images, read_labels = self.readers[int(part[a])]
            lo = int(local[a])
            images[a:b] = read_images.read(lo, lo + b - a)
            labels[a:b] = read_labels.read(lo, lo + b - a)
        return images[inverse], labels[inverse]

    def close(self) -> None:
        """Drop the readers and memory maps (the h5py files are the loader's to close)."""
        self.readers, self.maps = [], {}

