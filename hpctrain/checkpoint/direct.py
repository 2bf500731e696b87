"""Writing a checkpoint's bytes around the page cache (``O_DIRECT``).

A buffered ``write`` copies every byte into the page cache (the kernel's CPU time,
about 0.04 s for the benchmark GPT's 131 MB here, a third of a core's share of a
training step) and the ``fsync`` after it then waits for the writeback. With
``O_DIRECT`` the disk reads the bytes from the process's memory: on this machine the
same 131 MB took 0.05-0.06 s and 0.005 s of CPU, against 0.08-0.09 s and 0.044 s
buffered (DEVELOPERS.md). That CPU is what an asynchronous save takes from the
training steps it runs beside, and a checkpoint is not read back soon, so caching
it only evicts pages that training uses.

``O_DIRECT`` needs the memory address, the file offset and the length to be
multiples of the device's block size. The arrays are not aligned, so their bytes
stream through two page-aligned buffers of ``CHUNK`` bytes: while the kernel writes
one (``pwrite`` releases the GIL; a second thread issues it), the caller fills the
other::

    arrays   |--a--|----b----|-c-|------d------|--e--|
    stream   [ chunk 0  ][ chunk 1  ][ chunk 2  ][ch3]+tail
    caller   fill 0      fill 1      fill 2      fill 3
    thread               write 0     write 1     write 2     write 3, then the tail

A snapshot that already lies in one aligned buffer, in file order (the background
writer takes its copies so), is written from there, without the two buffers.

The offset must be aligned (``writer.allocate_flat`` asks HDF5 to align datasets of
``DIRECT_MIN`` bytes or more to ``ALIGN``); the last ``length % ALIGN`` bytes go
through an ordinary file descriptor. Where ``O_DIRECT`` is refused (tmpfs, some
network file systems: ``EINVAL`` at open or at the first write), ``direct_write``
returns False and writes nothing, and the caller writes buffered.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

ALIGN = 4096  # bytes: a multiple of every block device's logical block size
# bytes per O_DIRECT write through the two buffers: with 8 MB, the first fill and the
# last write, which nothing overlaps, cost 65 MB 44-45 ms against 35 ms for 2 MB (and
# for one write from aligned memory); 1 MB 35.6 ms, 0.5 MB 39.8 (DEVELOPERS.md)
CHUNK = 2 << 20
DIRECT_MIN = 1 << 20  # flat datasets this large or larger are written with O_DIRECT
REFUSED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)  # O_DIRECT not supported here


class _Buffers:
    """Pairs of page-aligned ``CHUNK``-byte buffers, kept for the next save (a fresh
    one faults in CHUNK / 4096 pages); one pair per write in flight."""

    def __init__(self):
        self._free: list[tuple[np.ndarray, np.ndarray]] = []
        self._lock = threading.Lock()

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            if self._free:
                return self._free.pop()
        # mmap memory starts on a page boundary
        return tuple(np.frombuffer(mmap.mmap(-1, CHUNK), np.uint8) for _ in range(2))

    def give(self, pair: tuple[np.ndarray, np.ndarray]) -> None:
        with self._lock:
            self._free.append(pair)


_buffers = _Buffers()


def supported() -> bool:
    return hasattr(os, "O_DIRECT")


def aligned_empty(nbytes: int) -> np.ndarray:
    """``nbytes`` uint8 starting on a page boundary (mmap), rounded up to ``ALIGN``."""
    return np.frombuffer(mmap.mmap(-1, max(ALIGN, -(-nbytes // ALIGN) * ALIGN)), np.uint8)


def _span(arrays: list[np.ndarray]) -> np.ndarray | None:
    """The arrays' bytes as one uint8 view if they lie one after another in memory,
    from an ``ALIGN``-aligned address, inside the first one's buffer (as
    ``aligned_empty``'s views do); else None."""
    arrays = [a for a in arrays if a.nbytes]
    if not arrays or not all(a.flags.c_contiguous for a in arrays):
        return None
    base = arrays[0]
    while isinstance(base.base, np.ndarray):  # the array that holds the memory
        base = base.base
    if not base.flags.c_contiguous:
        return None
    base = base.reshape(-1).view(np.uint8)
    start = arrays[0].ctypes.data
    if start % ALIGN:
        return None
    at = start
    for a in arrays:
        if a.ctypes.data != at:
            return None
        at += a.nbytes
    first = start - base.ctypes.data
    if first < 0 or at - base.ctypes.data > base.nbytes:
        return None
    return base[first:first + (at - start)]


def _bytes_of(arrays: list[np.ndarray]):
    """Each non-empty array's bytes, as a flat uint8 view, in turn."""
    for a in arrays:
        if a.nbytes:
            yield a.reshape(-1).view(np.uint8)


def direct_write(path, plain_fd: int, arrays: list[np.ndarray], offset: int) -> bool:
    """Write the C-contiguous ``arrays``' bytes one after another from ``offset`` (a
    multiple of ``ALIGN``) of the file ``path``, the aligned bulk with ``O_DIRECT``
    and the tail through ``plain_fd``. False (nothing written) if the file system
    refuses ``O_DIRECT``; other ``OSError``s propagate. The caller fsyncs."""
    if offset % ALIGN:
        raise ValueError(f"offset ({offset}) must be a multiple of {ALIGN} for O_DIRECT")
    total = sum(a.nbytes for a in arrays)
    bulk = total - total % ALIGN
    try:
        fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    except OSError as err:
        if err.errno in REFUSED:
            return False
        raise
    span = _span(arrays)
    if span is not None:  # already aligned and in file order (background.py's snapshot)
        try:
            if bulk and not _pwrite_direct(fd, span[:bulk], offset, True):
                return False
            _pwrite_plain(plain_fd, span[bulk:], offset + bulk)
            return True
        finally:
            os.close(fd)
    pair = _buffers.take()
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="hpctrain-direct") as pool:
            written = _stream(fd, plain_fd, _bytes_of(arrays), pair, offset, bulk, total,
                              pool)
    finally:
        os.close(fd)
        _buffers.give(pair)
    return written


def _stream(fd: int, plain_fd: int, sources, pair, offset: int, bulk: int, total: int,
            pool) -> bool:
    """Fill the buffers of ``pair`` in turn from ``sources`` and write each full one
    from the pool's thread while the next is filled; then the tail, buffered."""
    pending, k, pos = None, 0, 0  # pos: bytes of the stream filled so far
    src, at = next(sources, None), 0
    tail = np.empty(total - bulk, np.uint8)
    while pos < total:
        buf = pair[k % 2]
        n = min(CHUNK, bulk - pos) if pos < bulk else total - pos
        dest = buf[:n] if pos < bulk else tail
        filled = 0
        while filled < n:  # copy from the arrays into dest
            take = min(n - filled, src.size - at)
            dest[filled:filled + take] = src[at:at + take]
            filled += take
            at += take
            if at == src.size:
                src, at = next(sources, None), 0
        if pending is not None and not pending.result():
            return False
        if pos < bulk:
            pending = pool.submit(_pwrite_direct, fd, dest, offset + pos, k == 0)
        else:
            _pwrite_plain(plain_fd, dest, offset + pos)
        pos += n
        k += 1
    return pending is None or pending.result()


def _pwrite_direct(fd: int, data: np.ndarray, offset: int, first: bool) -> bool:
    """``data`` (aligned, a multiple of ALIGN bytes) at ``offset``; False if the very
    first write is refused (the file system takes O_DIRECT opens but not writes)."""
    view, done = memoryview(data), 0
    while done < len(view):
        try:
            n = os.pwrite(fd, view[done:], offset + done)
        except OSError as err:
            if first and done == 0 and err.errno in REFUSED:
                return False
            raise
        if n <= 0:
            raise OSError(f"O_DIRECT pwrite wrote nothing at offset {offset + done}")
        done += n
    return True


def _pwrite_plain(fd: int, data: np.ndarray, offset: int) -> None:
    view, done = memoryview(data), 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(f"pwrite wrote nothing at offset {offset + done}")
        done += n
