"""Element-wise work split over the rank's cores, as BLAS splits its products.

NumPy runs a ufunc on one core, so on a rank with two BLAS threads every GELU, softmax
and LayerNorm pass leaves a core idle. ``over_rows(kernel, *arrays)`` cuts the arrays
into ``threads()`` blocks of rows (axis 0) and runs ``kernel`` on the blocks at once
in a small thread pool: ufuncs release the GIL, so the blocks really run in parallel.
Kernels write their results into output arrays passed in among ``arrays`` (``out=``),
so the blocks fill one whole result and nothing is concatenated.

Each row is computed by the same operations whatever the block it lands in, so the
results are bitwise those of one thread. Reductions *across* rows (parameter
gradients) are left to the caller, outside the blocks, for the same reason.

``set_threads(n)`` follows the rank's BLAS thread count (``runtime.set_blas_threads``
sets both); with one thread, ``over_rows`` is a plain call.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

MIN_ROWS_PER_THREAD = 8  # rows (of any width) below which the hand-off costs more than it saves

_threads = 1
_pool: ThreadPoolExecutor | None = None


def set_threads(n: int) -> None:
    """Use ``n`` threads (at least one) for element-wise work in this process."""
    global _threads, _pool
    n = max(1, int(n))
    if n != _threads and _pool is not None:
        _pool.shutdown()
        _pool = None
    _threads = n


def threads() -> int:
    return _threads


def over_rows(kernel: Callable[..., None], *arrays: np.ndarray) -> None:
    """``kernel(*blocks)`` for each block of rows of ``arrays`` (all with the same
    length along axis 0), the blocks in parallel."""
    global _pool
    n = min(_threads, len(arrays[0]) // MIN_ROWS_PER_THREAD)
    if n <= 1:
        kernel(*arrays)
        return
    if _pool is None:
        _pool = ThreadPoolExecutor(_threads, thread_name_prefix="hpctrain-rows")
    blocks = zip(*(np.array_split(a, n) for a in arrays), strict=True)
    for future in [_pool.submit(kernel, *block) for block in blocks]:
        future.result()  # re-raises a kernel's exception here
