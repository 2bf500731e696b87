"""A snapshot's copy, checksum and finite test in one pass over the bytes.

The background writer (``background.py``) copies the arrays it saves, then
``rankfile.checks`` passes over the copies twice more: ``blocksum64`` of every piece
and, with ``finite``, the test for nan and inf. Those passes run beside the training
steps and take memory bandwidth and CPU from them. ``copy_checked`` does all three
in the copy: a numba kernel (``_kernel``) loads each 64-bit word once,
stores it, adds it to its 4 KiB block's sum and folds its exponent bits into a flag
(integer operations only, so LLVM vectorises the loop). On the benchmark GPT's 131
MB (one thread): copy then checks 21.4 ms, copy alone 10.7, one pass 11-13.

The finite test works on whole words: ``t = (w & E) ^ E`` is zero in an element's
lane exactly when that element's exponent is all ones (nan or inf), and ``(t - L) &
H`` (``L`` the lowest bit of each lane, ``H`` the highest) has a lane's top bit set
exactly when that lane of ``t`` is zero: a lane of ``t`` is below ``H`` and, when not
zero, at least two, so a borrow from the lane below never sets its top bit.

``blocksum64`` comes out of the block sums (``format.blocksum64_of_sums``) equal to
``format.blocksum64`` of the copy (tested). numba runs this where it runs the layer
kernels (``nn.kernels``, ``HPCTRAIN_FUSED``); elsewhere ``copy_checked`` is the copy
followed by NumPy's checks. Tried and dropped: the same kernel for loading (each run
read 4 MB at a time into a cached buffer, then copied and summed into the live
arrays): 31-34 ms a load against 27-32 for ``preadv`` into the arrays with the
checksums on a second thread, at dp 1 and 2.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from hpctrain.checkpoint.format import BLOCK_BYTES, blocksum64, blocksum64_of_sums
from hpctrain.nn import kernels

# per floating dtype: the exponent bits of every element a 64-bit word holds (E), the
# lowest bit of each element's lane (L), the highest (H)
_LANES = {np.dtype(np.float64): (0x7FF0000000000000, 0x0000000000000001,
                                 0x8000000000000000),
          np.dtype(np.float32): (0x7F8000007F800000, 0x0000000100000001,
                                 0x8000000080000000),
          np.dtype(np.float16): (0x7C007C007C007C00, 0x0001000100010001,
                                 0x8000800080008000)}


def fused() -> bool:
    """Whether the numba kernel runs here (``nn.kernels.fused_running``)."""
    return kernels.fused_running(np.float32)


@functools.cache
def _kernel() -> Callable:
    """The numba kernel, compiled (or loaded from numba's cache) on first use."""
    import numba

    words = BLOCK_BYTES // 8

    @numba.njit(nogil=True, boundscheck=False, cache=True)
    def copy_checked_words(src, dst, sums, e, low):  # pragma: no cover - compiled
        n = src.size
        flags = np.uint64(0)
        b = 0
        lo = 0
        while lo < n:
            hi = min(lo + words, n)
            s0 = np.uint64(0)
            s1 = np.uint64(0)
            i = lo
            while i + 2 <= hi:  # two sums: the adds do not wait on each other
                a0 = src[i]
                a1 = src[i + 1]
                dst[i] = a0
                dst[i + 1] = a1
                s0 += a0
                s1 += a1
                flags |= (((a0 & e) ^ e) - low) | (((a1 & e) ^ e) - low)
                i += 2
            while i < hi:
                a0 = src[i]
                dst[i] = a0
                s0 += a0
                flags |= ((a0 & e) ^ e) - low
                i += 1
            sums[b] = s0 + s1
            b += 1
            lo = hi
        return flags

    return copy_checked_words


def load() -> None:
    """Load the kernel's machine code now (a few words copied), not in a snapshot."""
    if fused():
        copy_checked(np.ones(3, np.float32), np.empty(3, np.float32), True)


def copy_checked(src: np.ndarray, dst: np.ndarray, finite: bool) -> tuple[str, bool]:
    """Copy the C-contiguous ``src`` into the C-contiguous ``dst`` (same shape and
    dtype); return its ``blocksum64`` and, with ``finite``, whether it holds no nan or
    inf (always True without ``finite`` and for dtypes other than floating point)."""
    from hpctrain.checkpoint.rankfile import all_finite

    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(f"copy_checked: {src.dtype}{src.shape} into {dst.dtype}{dst.shape}")
    if not fused():
        np.copyto(dst, src)
        return blocksum64(dst), not finite or all_finite(dst)
    s, d = src.reshape(-1).view(np.uint8), dst.reshape(-1).view(np.uint8)
    n = s.size
    whole = n - n % 8
    sums = np.zeros(-(-n // BLOCK_BYTES), np.uint64)
    lanes = _LANES.get(src.dtype, (0, 0, 0))
    flags = 0
    if whole:
        flags = int(_kernel()(s[:whole].view("<u8"), d[:whole].view("<u8"), sums,
                              np.uint64(lanes[0]), np.uint64(lanes[1])))
    if whole < n:  # the last bytes, zero-padded to a word (blocksum64's definition)
        d[whole:] = s[whole:]
        b = whole // BLOCK_BYTES
        word = int.from_bytes(bytes(s[whole:]) + bytes(8 - (n - whole)), "little")
        sums[b] = (int(sums[b]) + word) & (2**64 - 1)
    ok = True
    if finite and src.dtype.kind in "fc" and n:
        if src.dtype in _LANES:
            ok = not flags & lanes[2]
            if whole < n:  # the elements of the last bytes
                ok = ok and all_finite(dst.reshape(-1)[whole // src.itemsize:])
        else:
            ok = all_finite(dst)
    return blocksum64_of_sums(sums), ok
