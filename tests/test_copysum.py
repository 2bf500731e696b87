"""The snapshot's one-pass copy, checksum and finite test (``checkpoint/copysum.py``)
against the separate passes it replaces: ``format.blocksum64`` and
``rankfile.all_finite``, with numba's kernel and with NumPy's fallback."""

import threading

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.checkpoint import copysum, rankfile, writer
from hpctrain.checkpoint import format as fmt
from hpctrain.checkpoint.background import BackgroundWriter
from hpctrain.checkpoint.reshard import Sharding
from hpctrain.checkpoint.state import Held
from hpctrain.nn import kernels


@pytest.fixture(params=["numba", "numpy"])
def path(request):
    if request.param == "numba":
        try:
            from hpctrain.nn import fused
        except ImportError:
            pytest.skip("numba is not installed here (the `fused` extra)")
        kernels.set_kernels(fused.KERNELS)
    else:
        kernels.set_kernels(kernels.NUMPY_KERNELS)
    assert copysum.fused() == (request.param == "numba")
    yield request.param
    kernels.set_kernels(None)


SIZES = (0, 1, 2, 3, 511, 512, 513, 1024, 1025, 4099)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int64, np.int32,
                                   np.uint8, np.complex64])
def test_the_copy_its_blocksum64_and_finite_verdict_are_the_separate_passes(path, dtype):
    rng = np.random.default_rng(0)
    for n in SIZES:
        x = (rng.standard_normal(n) * 1000).astype(dtype)
        y = np.full_like(x, 7)
        digest, ok = copysum.copy_checked(x, y, True)
        assert np.array_equal(x, y), n
        assert digest == fmt.blocksum64(x), n
        assert ok, n


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_nan_and_inf_are_found_in_every_lane_of_a_word_and_finite_extremes_are_not(path,
                                                                                   dtype):
    """A 64-bit word holds 4, 2 or 1 elements: each position of a word, at the start,
    middle and end of an array (the last element past the whole words too)."""
    info = np.finfo(dtype)
    values = [np.nan, np.inf, -np.inf, info.max, -info.max, info.tiny,
              info.smallest_subnormal, 0.0, -0.0]
    for n in (1, 5, 9, 1027):
        base = np.linspace(-3, 3, n).astype(dtype)
        for v in values:
            for pos in sorted({0, 1 % n, 2 % n, 3 % n, n // 2, n - 1}):
                x = base.copy()
                x[pos] = v
                y = np.empty_like(x)
                digest, ok = copysum.copy_checked(x, y, True)
                assert ok == bool(np.isfinite(x).all()), (n, v, pos)
                assert digest == fmt.blocksum64(x)
                assert copysum.copy_checked(x, y, False)[1]  # not asked: always True


def test_a_shape_or_dtype_mismatch_is_refused():
    with pytest.raises(ValueError, match="float32"):
        copysum.copy_checked(np.ones(4, np.float32), np.ones(4, np.float64), True)


def test_the_snapshot_takes_the_checks_the_write_then_uses(path, monkeypatch):
    """With numba the background writer's copies come with their checks and
    ``rankfile.checks`` computes none again; with NumPy it computes them all. Either
    way they are blocksum64 and the finite verdict of what was saved."""
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in ((64, 48), (48,), (33,))]
    arrays[2][5] = np.inf
    held = [Held(f"t{k}", a, Sharding(a.shape)) for k, a in enumerate(arrays)]
    plan = writer._plan_of((writer.held_key(held, 0),), 0)
    background = BackgroundWriter(MPI.COMM_SELF, overlap=False)
    copies, known = background._snapshot(held, plan, threading.Event(), True)
    computed = []
    real = fmt.blocksum64
    monkeypatch.setattr(rankfile, "blocksum64", lambda a: computed.append(a) or real(a))
    monkeypatch.setattr(rankfile, "blocksum64_packed",
                        lambda d, n: computed.extend(n) or fmt.blocksum64_packed(d, n))
    datas = [c.array for c in copies]
    sums, bad = rankfile.checks(datas, True, known)
    assert sums == [fmt.blocksum64(a) for a in arrays]
    assert bad == [2]
    assert (computed == []) == (path == "numba")
