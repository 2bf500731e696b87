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

``products_over_rows`` does the same for kernels of many small matrix products
(attention's per-head ones), with BLAS held to one thread inside each block.

``set_threads(n)`` follows the rank's BLAS thread count (``runtime.set_blas_threads``
sets both); with one thread, ``over_rows`` is a plain call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np

MIN_ROWS_PER_THREAD = 8  # rows (of any width) below which the hand-off costs more than it saves

_threads = 1
_pool: ThreadPoolExecutor | None = None
_blas: list | None = None  # threadpoolctl's BLAS controllers, found on first use


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


def blas_threads() -> int:
    """The BLAS thread count now set in this process (1 without a BLAS found)."""
    return max([lib.num_threads for lib in _blas_libraries()], default=1)


@contextmanager
def _blas_on_one_thread() -> Iterator[None]:
    """Inside: every loaded BLAS on one thread; its counts restored after."""
    blas = _blas_libraries()
    before = [lib.num_threads for lib in blas]
    for lib in blas:
        lib.set_num_threads(1)
    try:
        yield
    finally:
        for lib, count in zip(blas, before, strict=True):
            lib.set_num_threads(count)


@contextmanager
def single() -> Iterator[None]:
    """Inside: BLAS and element-wise work on one thread, for a caller that runs its own
    threads (``hpctrain.parallel.batch_threads``); the counts are restored after. The
    pool is kept (``set_threads`` would shut it down)."""
    global _threads
    rows = _threads
    _threads = 1
    try:
        with _blas_on_one_thread():
            yield
    finally:
        _threads = rows


def over_rows(kernel: Callable[..., None], *arrays: np.ndarray) -> None:
    """``kernel(*blocks)`` for each block of rows of ``arrays`` (all with the same
    length along axis 0), the blocks in parallel."""
    n = min(_threads, len(arrays[0]) // MIN_ROWS_PER_THREAD)
    if n <= 1:
        kernel(*arrays)
        return
    _run_blocks(kernel, n, arrays)


def products_over_rows(kernel: Callable[..., None], *arrays: np.ndarray) -> None:
    """``over_rows`` for a kernel of many small matrix products, such as attention's
    per-head ones: each block runs its products on one BLAS thread, the blocks in
    parallel, one block (of one row or more) per thread. With fewer rows than threads
    it is a plain call, so that BLAS still spreads the products over every core.

    BLAS would split each small product over its own threads and hand it off for every
    product; here one thread does whole products. On the benchmark's 256 x 256 x 64
    head products that measured 95-101 GFLOP/s against 62-84 (2 cores). Each product
    runs whole on one BLAS thread whatever block it lands in, so results do not change
    with the number of blocks. In a plain call BLAS uses its own threads, which may
    round differently.
    """
    n = _threads
    if n <= 1 or len(arrays[0]) < n:
        kernel(*arrays)
        return
    with _blas_on_one_thread():
        _run_blocks(kernel, n, arrays)


def _run_blocks(kernel: Callable[..., None], n: int, arrays: tuple[np.ndarray, ...]) -> None:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(_threads, thread_name_prefix="hpctrain-rows")
    blocks = zip(*(np.array_split(a, n) for a in arrays), strict=True)
    for future in [_pool.submit(kernel, *block) for block in blocks]:
        future.result()  # re-raises a kernel's exception here


def _blas_libraries() -> list:
    """threadpoolctl's controllers of the BLAS libraries loaded (found once: a search
    of the loaded libraries takes about a millisecond)."""
    global _blas
    if _blas is None:
        from threadpoolctl import ThreadpoolController

        _blas = ThreadpoolController().select(user_api="blas").lib_controllers
    return _blas
