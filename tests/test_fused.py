"""numba's fused kernels (hpctrain.nn.fused) against the NumPy kernels they replace
(hpctrain.nn.kernels), forward and backward, float32 and float64, and AdamW's update
(bitwise); and the choice between the two sets (``kernels.kernels``), which must fall
back to NumPy without numba.

The comparisons need numba and say so when it is missing (``pytest.importorskip``);
the tests of the choice run either way.
"""

import subprocess
import sys

import numpy as np
import pytest

from hpctrain.nn import GELU, CausalSelfAttention, LayerNorm, kernels
from hpctrain.nn import threads as nn_threads
from hpctrain.nn.kernels import NUMPY_KERNELS, Kernels
from hpctrain.optim import AdamW

# numba against NumPy, in units in the last place of the NumPy result (sums in another
# order, float32 exp within 1 ulp where NumPy's is within 2.4)
ULPS = {np.float32: 8, np.float64: 4}
DTYPES = [np.float32, np.float64]


@pytest.fixture
def fused():
    pytest.importorskip("numba", reason="numba is not installed: the fused kernels "
                                        "cannot be compared (pip install numba)")
    from hpctrain.nn import fused

    return fused


@pytest.fixture(autouse=True)
def kernels_from_environment():
    """Every test starts and ends with the choice left to the environment."""
    kernels.set_kernels(None)
    yield
    kernels.set_kernels(None)


def assert_ulps(got, want, dtype, atol=0.0):
    """|got - want| within ULPS[dtype] units in the last place of want, or within
    ``atol``; NaNs and infinities where want has them."""
    want64 = want.astype(np.float64)
    spacing = np.spacing(np.maximum(np.abs(want), np.finfo(dtype).tiny).astype(dtype))
    with np.errstate(invalid="ignore"):  # inf - inf
        diff = np.abs(got.astype(np.float64) - want64)
    err = np.where(diff <= atol, 0.0, diff / spacing.astype(np.float64))
    assert np.array_equal(np.isnan(got), np.isnan(want))
    finite = np.isfinite(want)
    assert np.array_equal(got[~finite], want[~finite], equal_nan=True)
    worst = err[finite].max(initial=0.0)
    assert worst <= ULPS[dtype], f"{worst:.1f} ulps (allowed {ULPS[dtype]})"


def rows(shape, dtype, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


# ---------------------------------------------------------------------------------
# choosing the kernels


def test_fused_0_runs_numpy(monkeypatch):
    monkeypatch.setenv("HPCTRAIN_FUSED", "0")
    assert kernels.kernels(np.dtype(np.float32)) is NUMPY_KERNELS


def test_without_numba_numpy_runs_and_fused_1_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "numba", None)  # import numba raises ImportError
    monkeypatch.delenv("HPCTRAIN_FUSED", raising=False)
    assert kernels.kernels(np.dtype(np.float64)) is NUMPY_KERNELS
    kernels.set_kernels(None)
    monkeypatch.setenv("HPCTRAIN_FUSED", "1")
    with pytest.raises(ImportError, match="pip install numba"):
        kernels.kernels(np.dtype(np.float32))


def test_a_bad_fused_value_is_named(monkeypatch):
    monkeypatch.setenv("HPCTRAIN_FUSED", "yes")
    with pytest.raises(ValueError, match=r"HPCTRAIN_FUSED \('yes'\) must be 0"):
        kernels.kernels(np.dtype(np.float32))


def test_other_dtypes_run_numpy():
    marker = Kernels(*(lambda *a: None for _ in Kernels._fields))
    kernels.set_kernels(marker)
    assert kernels.kernels(np.dtype(np.float32)) is marker
    assert kernels.kernels(np.dtype(np.float16)) is NUMPY_KERNELS


def test_the_layers_run_the_chosen_kernels():
    calls = []

    def spy(name):
        def kernel(*args):
            calls.append(name)
            getattr(NUMPY_KERNELS, name)(*args)
        return kernel

    kernels.set_kernels(Kernels(*(spy(name) for name in Kernels._fields)))
    x = rows((2, 4, 6), np.float64)
    attention = CausalSelfAttention(6, 2, rng=np.random.default_rng(0), dtype=np.float64)
    for layer in (GELU(), LayerNorm(6, dtype=np.float64), attention):
        y, cache = layer.forward(x)
        layer.backward(x, cache)
    AdamW(attention.named_parameters(), lr=0.1).step()
    assert list(dict.fromkeys(calls)) == list(Kernels._fields)  # each, in this order


def test_importing_hpctrain_nn_does_not_import_numba():
    code = "import sys, hpctrain.nn, hpctrain.models.build; assert 'numba' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------
# GELU


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (37, 53), (64, 1536)])
def test_gelu_forward_matches_numpy(fused, dtype, shape):
    x = rows(shape, dtype, scale=4.0)  # reaches the tails, where exp over/underflows
    s, y, s_np, y_np = (np.empty_like(x) for _ in range(4))
    fused.gelu_forward(x, s, y)
    kernels.gelu_forward(x, s_np, y_np)
    # in float32 NumPy's 1 / (1 + exp(-2u)) is 0 once exp overflows (x < -9.5), where
    # the fused s = exp(2u) / (1 + exp(2u)) keeps the denormals: both below 1e-37
    atol = 1e-37 if dtype == np.float32 else 0.0
    assert_ulps(s, s_np, dtype, atol)
    assert_ulps(y, y_np, dtype, atol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_forward_edges(fused, dtype):
    x = np.array([[-np.inf, -200.0, -10.0, -1.0, -0.0, 0.0, 1e-30, 1.0, 10.0, 200.0,
                   np.inf, np.nan]], dtype)
    s, y, s_np, y_np = (np.empty_like(x) for _ in range(4))
    fused.gelu_forward(x, s, y)
    with np.errstate(all="ignore"):
        kernels.gelu_forward(x, s_np, y_np)
    assert_ulps(s, s_np, dtype, atol=1e-37)
    assert_ulps(y, y_np, dtype, atol=1e-37)
    assert np.isnan(s[0, -1]) and np.isnan(y[0, -1])  # a NaN stays a NaN


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (37, 53), (64, 1536)])
def test_gelu_backward_is_numpy_bit_for_bit(fused, dtype, shape):
    # the same operations in the same order, and no exp
    x, dy = rows(shape, dtype, 0, 3.0), rows(shape, dtype, 1)
    s, y = np.empty_like(x), np.empty_like(x)
    kernels.gelu_forward(x, s, y)
    dx, dx_np = np.empty_like(x), np.empty_like(x)
    fused.gelu_backward(x, s, dy, dx)
    kernels.gelu_backward(x, s, dy, dx_np)
    assert np.array_equal(dx, dx_np)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_on_strided_rows(fused, dtype):
    # a view whose rows are not contiguous: numba compiles it apart, same results
    x = rows((9, 22), dtype, scale=3.0)[:, ::2]
    s, y, s_np, y_np = (np.empty(x.shape, dtype) for _ in range(4))
    fused.gelu_forward(x, s, y)
    kernels.gelu_forward(x, s_np, y_np)
    assert_ulps(y, y_np, dtype, atol=1e-37)
    dx, dx_np = np.empty(x.shape, dtype), np.empty(x.shape, dtype)
    fused.gelu_backward(x, s_np, x, dx)
    kernels.gelu_backward(x, s_np, x, dx_np)
    assert np.array_equal(dx, dx_np)


def test_fused_expf_is_within_one_ulp(fused):
    import numba

    @numba.njit
    def exp_all(a, out):
        for i in range(a.size):
            out[i] = fused._expf_nonpositive(a[i])

    a = np.concatenate([-np.linspace(0.0, 110.0, 200_001), [-np.inf, np.nan, -0.0]])
    a = a.astype(np.float32)
    out = np.empty_like(a)
    exp_all(a, out)
    want = np.exp(a.astype(np.float64))  # exact to float32's eyes
    finite = np.isfinite(a)
    spacing = np.spacing(want[finite].astype(np.float32)).astype(np.float64)
    assert (np.abs(out[finite] - want[finite]) / spacing).max() <= 1.0
    assert out[-3] == 0.0 and np.isnan(out[-2]) and out[-1] == 1.0


# ---------------------------------------------------------------------------------
# LayerNorm


def layernorm_inputs(shape, dtype):
    x = rows(shape, dtype, 0, 3.0) + dtype(1.5)
    w, b = rows(shape[-1:], dtype, 1), rows(shape[-1:], dtype, 2)
    return x, w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (37, 53), (64, 384), (3, 1000)])
def test_layernorm_forward_matches_numpy(fused, dtype, shape):
    x, w, b = layernorm_inputs(shape, dtype)
    xhat, y, xhat_np, y_np = (np.empty_like(x) for _ in range(4))
    rstd, rstd_np = np.empty((shape[0], 1), dtype), np.empty((shape[0], 1), dtype)
    fused.layernorm_forward(x, xhat, rstd, y, w, b, 1e-5)
    kernels.layernorm_forward(x, xhat_np, rstd_np, y_np, w, b, 1e-5)
    assert_ulps(rstd, rstd_np, dtype)
    # xhat = (x - mean) rstd: where x is near its mean, both carry the rounding of mean
    scale = np.abs(x).max(axis=-1, keepdims=True) * rstd_np
    eps = np.finfo(dtype).eps
    assert np.all(np.abs(xhat - xhat_np) <= 8 * eps * scale)
    assert np.all(np.abs(y - y_np) <= 8 * eps * (scale * np.abs(w) + np.abs(b)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (37, 53), (64, 384)])
def test_layernorm_backward_matches_numpy(fused, dtype, shape):
    x, w, b = layernorm_inputs(shape, dtype)
    xhat, y = np.empty_like(x), np.empty_like(x)
    rstd = np.empty((shape[0], 1), dtype)
    kernels.layernorm_forward(x, xhat, rstd, y, w, b, 1e-5)
    dy = rows(shape, dtype, 3)
    dx, dx_np = np.empty_like(x), np.empty_like(x)
    fused.layernorm_backward(dy, xhat, rstd, dx, w)
    kernels.layernorm_backward(dy, xhat, rstd, dx_np, w)
    # dx = rstd (g - mean(g) - xhat mean(g xhat)): the sums' rounding, scaled
    g = np.abs(dy * w)
    bound = 8 * np.finfo(dtype).eps * rstd * (g + g.max(axis=-1, keepdims=True)
                                               * (1 + np.abs(xhat)))
    assert np.all(np.abs(dx - dx_np) <= bound)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layers_fused_against_numpy_and_gradcheck(fused, dtype):
    """The layers with either kernel set: outputs, input and parameter gradients."""
    x = rows((3, 5, 24), dtype, 0, 2.0)
    dy = rows((3, 5, 24), dtype, 1)
    results = []
    for chosen in (NUMPY_KERNELS, fused.KERNELS):
        kernels.set_kernels(chosen)
        ln = LayerNorm(24, dtype=dtype)
        ln.weight.data[:] = rows((24,), dtype, 2)
        h, ln_cache = ln.forward(x)
        y, gelu_cache = GELU().forward(h)
        dh = GELU().backward(dy, gelu_cache)
        dx = ln.backward(dh, ln_cache)
        results.append((y, dx, ln.weight.grad, ln.bias.grad))
    rtol = 1e-4 if dtype == np.float32 else 1e-12
    for got, want in zip(results[1], results[0], strict=True):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())


def test_fused_kernels_are_bitwise_the_same_at_any_thread_count(fused):
    kernels.set_kernels(fused.KERNELS)
    x = rows((4, 64, 48), np.float32)
    results = []
    try:
        for n in (1, 2, 3):
            nn_threads.set_threads(n)
            ln = LayerNorm(48)
            y, gelu_cache = GELU().forward(x)
            h, ln_cache = ln.forward(x)
            results.append((y, GELU().backward(x, gelu_cache), h, ln.backward(x, ln_cache)))
    finally:
        nn_threads.set_threads(1)
    for other in results[1:]:
        for got, want in zip(other, results[0], strict=True):
            assert np.array_equal(got, want)


# ---------------------------------------------------------------------------------
# softmax (attention's)


def scores(shape, dtype, seed=0):
    """Scores with NaN above the diagonal: neither softmax may read there."""
    s = rows(shape, dtype, seed, 3.0)
    T = shape[-1]
    s[..., np.triu(np.ones((T, T), bool), k=1)] = np.nan
    return s


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (70, 70), (2, 3, 33, 33), (2, 6, 256, 256)])
def test_causal_softmax_matches_numpy(fused, dtype, shape):
    s = scores(shape, dtype)
    p, p_np = s.copy(), s.copy()
    fused.causal_softmax(p)
    kernels.causal_softmax(p_np)
    assert np.array_equal(p == 0, p_np == 0)  # the zeros above the diagonal, exactly
    assert_softmax_close(p, p_np, s, dtype)


def assert_softmax_close(p, p_np, s, dtype):
    """P = exp(S - max) / sum: the rounding of S - max is eps |S| absolute, so relative
    eps |S| in exp; both implementations carry it (each ~20 ulps off the exact value
    at |S| ~ 15, float64), on top of the sum's few ulps."""
    s_max = np.nanmax(np.abs(s))
    bound = 4 * np.finfo(dtype).eps * p_np * (4 + s_max) + np.finfo(dtype).tiny
    assert np.all(np.abs(p.astype(np.float64) - p_np) <= bound)


def test_causal_softmax_on_a_batch_block_and_a_transposed_batch(fused):
    s = scores((4, 3, 40, 40), np.float64)
    p_np = s.copy()
    kernels.causal_softmax(p_np)
    p = s.copy()
    fused.causal_softmax(p[1:3])  # a block of the batch, as products_over_rows hands it
    np.testing.assert_array_equal(p[[0, 3]], s[[0, 3]])
    assert_softmax_close(p[1:3], p_np[1:3], s, np.float64)
    q = s.copy()
    fused.causal_softmax(q.transpose(1, 0, 2, 3))  # leading axes that do not merge
    assert_softmax_close(q, p_np, s, np.float64)


def test_causal_softmax_keeps_a_nan_and_refuses_non_square(fused):
    s = scores((1, 5, 5), np.float32)
    s[0, 3, 1] = np.nan
    fused.causal_softmax(s)
    assert np.isnan(s[0, 3, :4]).all() and not np.isnan(s[0, [0, 1, 2, 4]]).any()
    with pytest.raises(ValueError, match=r"square \(\.\.\., T, T\) scores, not \(4, 5\)"):
        fused.causal_softmax(np.zeros((4, 5)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_backward_on_attention_blocks_matches_numpy(fused, dtype):
    # as attention._attend_backward calls it: rows i0:i1 of each (T, T), columns :i1
    T = 100
    p = scores((2, 3, T, T), dtype)
    kernels.causal_softmax(p)
    dp = rows(p.shape, dtype, 1)
    ds, ds_np = dp.copy(), dp.copy()
    for i0 in range(0, T, 64):
        i1 = min(i0 + 64, T)
        fused.softmax_backward(ds[..., i0:i1, :i1], p[..., i0:i1, :i1])
        kernels.softmax_backward(ds_np[..., i0:i1, :i1], p[..., i0:i1, :i1])
    seen = np.zeros((T, T), bool)  # the blocks: rows i0:i1, columns :i1
    for i0 in range(0, T, 64):
        seen[i0:i0 + 64, :i0 + 64] = True
    np.testing.assert_array_equal(ds[..., ~seen], dp[..., ~seen])  # not written
    assert_softmax_backward_close(ds, ds_np, dp, p, dtype)


def assert_softmax_backward_close(ds, ds_np, dp, p, dtype):
    """dS = P (dP - sum_j dP P): the sum's rounding (a few eps max|dP|), times P."""
    bound = 8 * np.finfo(dtype).eps * p * (np.abs(dp).max() + np.abs(dp))
    assert np.all(np.abs(ds - ds_np) <= bound + np.finfo(dtype).tiny)


def test_softmax_backward_on_columns_of_a_transposed_array(fused):
    # rows that are not contiguous: worked on in a copy, written back
    p = np.random.default_rng(0).random((7, 5))
    dp = rows((7, 5), np.float64, 1)
    ds, ds_np = dp.T.copy().T, dp.copy()  # ds: Fortran order, same values
    fused.softmax_backward(ds, p)
    kernels.softmax_backward(ds_np, p)
    assert_softmax_backward_close(ds, ds_np, dp, p, np.float64)
    with pytest.raises(ValueError, match=r"ds \(7, 5\) and p \(7, 4\) must match"):
        fused.softmax_backward(ds, p[:, :4])


def test_the_doctor_names_the_kernels_that_run(monkeypatch):
    from hpctrain.doctor import Report, check_kernels

    monkeypatch.setenv("HPCTRAIN_FUSED", "0")
    report = Report()
    check_kernels(report)
    assert report.facts["kernels"] == "NumPy's (HPCTRAIN_FUSED=0)" and not report.problems
    kernels.set_kernels(None)
    monkeypatch.setenv("HPCTRAIN_FUSED", "maybe")
    report = Report()
    check_kernels(report)
    assert "kernels" not in report.facts
    assert len(report.problems) == 1 and "HPCTRAIN_FUSED ('maybe')" in report.problems[0]


# ---------------------------------------------------------------------------------
# AdamW's update


@pytest.mark.parametrize("dtype", DTYPES)
def test_adamw_fused_is_bitwise_numpys(fused, dtype):
    """Three steps of AdamW with each kernel set: parameters and state bitwise equal, for
    a matrix (decayed, above PARALLEL_MIN_SIZE: split over threads) and a bias."""
    from hpctrain.nn.module import Parameter

    results = []
    for chosen in (NUMPY_KERNELS, fused.KERNELS):
        kernels.set_kernels(chosen)
        params = [("w", Parameter(rows((300, 300), dtype, 0))),
                  ("b", Parameter(rows((300,), dtype, 1)))]
        opt = AdamW(params, lr=1e-2, weight_decay=0.1)
        for step in range(3):
            for i, (_, p) in enumerate(params):
                p.grad[...] = rows(p.shape, dtype, 10 * step + i + 2, scale=10.0 ** -step)
            opt.step()
        results.append([p.data for _, p in params] + opt.m + opt.v)
    for got, want in zip(results[1], results[0], strict=True):
        assert got.dtype == want.dtype and np.array_equal(got, want)
    assert not np.array_equal(results[0][0], rows((300, 300), dtype, 0))  # it did update


def test_adamw_runs_numpys_kernel_where_the_dtypes_differ(fused):
    from hpctrain.nn.module import Parameter

    calls = []
    kernels.set_kernels(fused.KERNELS._replace(adamw_update=lambda *a: calls.append(a)))
    p = Parameter(rows((8,), np.float32))
    p.grad = np.ones(8)  # a float64 gradient of a float32 parameter: NumPy's rules
    AdamW([("p", p)], lr=0.1).step()
    assert calls == [] and not np.array_equal(p.data, rows((8,), np.float32))
