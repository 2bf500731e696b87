"""Checkpoint bytes written around the page cache (``checkpoint/direct.py``): the same
bytes as a buffered write, at the same offsets, whatever the sizes and chunking, from
unaligned arrays (through the aligned buffers) and from the background writer's
aligned snapshot (straight), and checkpoints that use it load bitwise."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.checkpoint import Checkpoint, direct, writer
from hpctrain.checkpoint.background import BackgroundWriter
from hpctrain.checkpoint.reshard import Sharding
from hpctrain.checkpoint.state import Held

pytestmark = pytest.mark.skipif(not direct.supported(), reason="no O_DIRECT on this OS")


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 3 pages, so that a few arrays cross several chunk boundaries."""
    monkeypatch.setattr(direct, "CHUNK", 3 * direct.ALIGN)
    monkeypatch.setattr(direct, "_buffers", direct._Buffers())


def arrays_of(sizes: list[int], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]


def written(path, offset: int, nbytes: int) -> bytes:
    with open(path, "rb") as fh:
        fh.seek(offset)
        return fh.read(nbytes)


@pytest.mark.parametrize("sizes", [[20000], [1, 4095, 4096, 4097, 12287, 7], [3 * 4096],
                                   [5000, 0, 30000]])
def test_streamed_write_puts_every_byte_at_its_offset(tmp_path, small_chunks, sizes):
    arrays = arrays_of(sizes)
    path = tmp_path / "f.bin"
    path.write_bytes(b"\xee" * 8192)  # bytes before the offset stay as they are
    fd = os.open(path, os.O_WRONLY)
    try:
        assert direct.direct_write(path, fd, arrays, 8192)
    finally:
        os.close(fd)
    total = sum(sizes)
    assert path.stat().st_size == 8192 + total
    assert written(path, 0, 8192) == b"\xee" * 8192
    assert written(path, 8192, total) == b"".join(a.tobytes() for a in arrays)


def test_an_aligned_snapshot_is_one_span_and_written_straight(tmp_path, monkeypatch):
    buf = direct.aligned_empty(3 * 4096 + 100)
    a = buf[:8000].view(np.float64).reshape(10, 100)
    b = buf[8000:12388]
    a[...] = np.arange(1000).reshape(10, 100)
    b[...] = 7
    span = direct._span([a, b])
    assert span is not None and span.nbytes == 12388 and span.ctypes.data == a.ctypes.data
    assert direct._span([b, a]) is None  # not in memory order
    assert direct._span([a[:, :50]]) is None  # not contiguous
    assert direct._span([np.ones(4096, np.uint8)[1:]]) is None  # not aligned
    monkeypatch.setattr(direct, "_buffers", None)  # the streaming path would fail
    path = tmp_path / "g.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        assert direct.direct_write(path, fd, [a, b], 0)
    finally:
        os.close(fd)
    assert path.read_bytes() == a.tobytes() + b.tobytes()


def test_an_unaligned_offset_is_refused(tmp_path):
    path = tmp_path / "h.bin"
    path.touch()
    fd = os.open(path, os.O_WRONLY)
    try:
        with pytest.raises(ValueError, match=r"offset \(100\) must be a multiple of 4096"):
            direct.direct_write(path, fd, arrays_of([5000]), 100)
    finally:
        os.close(fd)


def big_held(seed: int) -> list[Held]:
    """Two float64 tensors of several MiB (O_DIRECT) and a small float32 one (not)."""
    rng = np.random.default_rng(seed)
    out = []
    for name, shape, dtype in (("w", (700, 1000), np.float64), ("v", (300, 1001), np.float64),
                               ("s", (33,), np.float32)):
        a = rng.standard_normal(shape).astype(dtype)
        out.append(Held(name, a, Sharding(shape)))
    return out


@pytest.mark.parametrize("background", [False, True])
def test_a_checkpoint_written_around_the_page_cache_loads_bitwise(tmp_path, background):
    held = big_held(1)
    root = tmp_path / "checkpoints"
    if background:
        w = BackgroundWriter(MPI.COMM_SELF)
        w.save(root, 1, held, {}, MPI.COMM_SELF, keep=2)
        w.wait()
        w.save(root, 2, held, {}, MPI.COMM_SELF, keep=2)  # into the kept buffers
        path = w.wait()
    else:
        path = writer.save(root, 2, held, {}, MPI.COMM_SELF)
    with h5py.File(path / "rank-00000.h5") as f:
        offset = f["float64"].id.get_offset()
    assert offset % direct.ALIGN == 0  # HDF5 aligned the large dataset for O_DIRECT
    with Checkpoint(path) as ck:
        for h in held:
            np.testing.assert_array_equal(ck.read_full(h.name), h.array)
            assert ck.read_full(h.name).dtype == h.array.dtype
