"""Every layer against central finite differences (float64), plus the layer contract:
accumulating gradients, caches that live outside the layer, float32 kept float32."""

import numpy as np
import pytest

from hpctrain.nn import (
    GELU,
    CausalSelfAttention,
    Embedding,
    LayerNorm,
    Linear,
    Module,
    Parameter,
    Residual,
    cross_entropy,
    cross_entropy_backward,
)
from hpctrain.nn.attention import SOFTMAX_BLOCK
from hpctrain.nn.gradcheck import check_array, check_parameters, rel_error

TOL = 1e-6


def rng(seed=0):
    return np.random.default_rng(seed)


def check_layer(layer, x, seed=1):
    """Check dx and every parameter gradient of ``sum(layer(x) * w)`` for a random w."""
    y, _ = layer.forward(x)
    w = rng(seed).standard_normal(y.shape)
    layer.zero_grad()
    y, cache = layer.forward(x)
    dx = layer.backward(w, cache)

    def loss():
        return float(np.sum(layer.forward(x)[0] * w))

    errors = check_parameters(loss, layer.named_parameters())
    if dx is not None:
        errors["input"] = check_array(loss, x, dx)
    assert errors and max(errors.values()) < TOL, errors
    return errors


# ---------------------------------------------------------------------------------
# Parameter and Module


class _Pair(Module):
    def __init__(self):
        self.first = Linear(3, 4, rng=rng(), dtype=np.float64)
        self.scale = Parameter(np.ones(2))
        self.stack = [LayerNorm(4), GELU(), Linear(4, 2, bias=False, rng=rng())]
        self.shared = self.first  # reached twice: listed once


def test_named_parameters_walk_attributes_in_definition_order():
    names = [name for name, _ in _Pair().named_parameters("model.")]
    assert names == ["model.first.weight", "model.first.bias", "model.scale",
                     "model.stack.0.weight", "model.stack.0.bias", "model.stack.2.weight"]


def test_parameter_grad_matches_data_and_zero_grad_resets():
    m = _Pair()
    assert m.num_parameters() == 3 * 4 + 4 + 2 + 4 + 4 + 4 * 2
    for p in m.parameters():
        assert p.grad.shape == p.data.shape and p.grad.dtype == p.data.dtype
        p.grad += 1.0
    m.zero_grad()
    assert all(not p.grad.any() for p in m.parameters())


# ---------------------------------------------------------------------------------
# gradient checks, one per layer


@pytest.mark.parametrize("bias", [True, False])
def test_linear_gradcheck_on_leading_dims(bias):
    layer = Linear(5, 7, bias=bias, rng=rng(), dtype=np.float64, std=0.5)
    if bias:
        layer.bias.data[:] = rng(2).standard_normal(7)
    check_layer(layer, rng(3).standard_normal((2, 3, 5)))


def test_linear_is_x_at_w_plus_b():
    layer = Linear(4, 3, rng=rng(), dtype=np.float64)
    layer.bias.data[:] = [1.0, 2.0, 3.0]
    x = rng(1).standard_normal((6, 4))
    np.testing.assert_allclose(layer.forward(x)[0], x @ layer.weight.data + layer.bias.data)


def test_embedding_gradcheck_with_repeated_indices():
    layer = Embedding(6, 4, rng=rng(), dtype=np.float64, std=1.0)
    idx = np.array([[0, 2, 2, 5], [2, 0, 1, 1]])  # repeats must add up
    assert layer.forward(idx)[0].shape == (2, 4, 4)
    errors = check_layer(layer, idx)
    assert "input" not in errors  # integer input: backward returns None


def test_embedding_backward_with_narrow_integer_tokens():
    """Token files hold uint16; flat offsets row * dim must not wrap around."""
    layer = Embedding(300, 256, rng=rng())
    idx = np.array([[299, 3, 299]], dtype=np.uint16)
    layer.backward(np.ones((1, 3, 256), np.float32), layer.forward(idx)[1])
    assert (layer.weight.grad[299] == 2.0).all() and (layer.weight.grad[3] == 1.0).all()
    assert layer.weight.grad.sum() == 3 * 256


def test_layernorm_gradcheck():
    layer = LayerNorm(6, dtype=np.float64)
    layer.weight.data[:] = rng(4).standard_normal(6)
    layer.bias.data[:] = rng(5).standard_normal(6)
    check_layer(layer, rng(6).standard_normal((3, 2, 6)) * 3.0 + 1.0)


def test_layernorm_normalises_the_last_axis():
    y, _ = LayerNorm(8, dtype=np.float64).forward(rng(1).standard_normal((5, 8)) * 4 + 2)
    np.testing.assert_allclose(y.mean(axis=-1), 0.0, atol=1e-12)
    np.testing.assert_allclose(y.var(axis=-1), 1.0, rtol=1e-4)  # var / (var + eps)


def test_gelu_gradcheck_and_values():
    check_layer(GELU(), rng(7).standard_normal((4, 9)) * 2.0)
    x = np.array([-3.0, -1.0, 0.0, 1.0, 3.0])
    ref = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(GELU().forward(x)[0], ref, rtol=1e-12)


def test_residual_forward_and_gradcheck_of_both_inputs():
    layer = Residual()
    a, b = rng(1).standard_normal((2, 3, 4)), rng(2).standard_normal((2, 3, 4))
    w = rng(3).standard_normal((2, 3, 4))
    y, cache = layer.forward(a, b)
    np.testing.assert_array_equal(y, a + b)
    da, db = layer.backward(w, cache)

    def loss():
        return float(np.sum(layer.forward(a, b)[0] * w))

    assert check_array(loss, a, da) < TOL and check_array(loss, b, db) < TOL


def test_attention_gradcheck():
    layer = CausalSelfAttention(12, 3, rng=rng(), dtype=np.float64, std=0.4)
    layer.qkv.bias.data[:] = rng(8).standard_normal(36) * 0.3
    check_layer(layer, rng(9).standard_normal((2, 5, 12)))


@pytest.mark.parametrize("dloss", [1.0, 0.7])
def test_cross_entropy_gradcheck(dloss):
    logits = rng(1).standard_normal((6, 5)) * 2.0
    targets = np.array([0, 4, 2, 2, 1, 3])
    _, cache = cross_entropy(logits, targets)
    dlogits = cross_entropy_backward(dloss, cache)
    err = check_array(lambda: dloss * cross_entropy(logits, targets)[0], logits, dlogits)
    assert err < TOL


def test_cross_entropy_value_and_stability():
    logits = rng(1).standard_normal((4, 7))
    targets = np.array([1, 0, 6, 3])
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    ref = -np.mean(np.log(p[np.arange(4), targets]))
    assert cross_entropy(logits, targets)[0] == pytest.approx(ref, rel=1e-12)
    big, cache = cross_entropy(logits + 1e4, targets)  # would overflow exp without the max
    assert big == pytest.approx(ref, rel=1e-9)
    np.testing.assert_allclose(cross_entropy_backward(1.0, cache).sum(axis=1), 0.0, atol=1e-12)


# ---------------------------------------------------------------------------------
# attention against a loop-over-heads reference; head count taken from n_head


def naive_attention(layer, x):
    """One (batch, head) at a time, with the causal mask written as a loop bound."""
    B, T, C = x.shape
    H, D = layer.n_head, layer.head_dim
    qkv = x @ layer.qkv.weight.data + layer.qkv.bias.data
    y = np.zeros((B, T, H * D))
    for b in range(B):
        for h in range(H):
            q = qkv[b, :, h * D:(h + 1) * D]
            k = qkv[b, :, H * D + h * D:H * D + (h + 1) * D]
            v = qkv[b, :, 2 * H * D + h * D:2 * H * D + (h + 1) * D]
            for i in range(T):
                s = k[:i + 1] @ q[i] / np.sqrt(D)
                p = np.exp(s - s.max())
                y[b, i, h * D:(h + 1) * D] = (p / p.sum()) @ v[:i + 1]
    return y @ layer.proj.weight.data + layer.proj.bias.data


def test_attention_matches_loop_reference():
    layer = CausalSelfAttention(8, 2, rng=rng(), dtype=np.float64, std=0.5)
    x = rng(1).standard_normal((3, 6, 8))
    np.testing.assert_allclose(layer.forward(x)[0], naive_attention(layer, x), atol=1e-12)


def test_attention_over_several_softmax_blocks_matches_loop_reference():
    T = 2 * SOFTMAX_BLOCK + 6  # two whole blocks of query rows and a partial one
    layer = CausalSelfAttention(8, 2, rng=rng(), dtype=np.float64, std=0.5)
    x = rng(1).standard_normal((2, T, 8))
    np.testing.assert_allclose(layer.forward(x)[0], naive_attention(layer, x), atol=1e-12)


def test_attention_uses_n_head_not_d_model():
    """Keeping heads {0, 1} of 4 (sliced qkv columns and proj rows, n_head = 2) gives
    those heads' share of the full output: the contract a tensor-parallel wrapper needs."""
    full = CausalSelfAttention(16, 4, rng=rng(), dtype=np.float64, std=0.5)
    x = rng(1).standard_normal((2, 5, 16))
    D = full.head_dim
    halves = []
    for heads in (range(0, 2), range(2, 4)):
        cols = np.concatenate([np.arange(part * 16 + h * D, part * 16 + (h + 1) * D)
                               for part in range(3) for h in heads])
        rows = np.concatenate([np.arange(h * D, (h + 1) * D) for h in heads])
        local = CausalSelfAttention(16, 4, rng=rng(), dtype=np.float64)
        local.n_head = len(heads)
        local.qkv = Linear(16, len(cols), rng=rng(), dtype=np.float64)
        local.qkv.weight.data[:] = full.qkv.weight.data[:, cols]
        local.qkv.bias.data[:] = full.qkv.bias.data[cols]
        local.proj = Linear(len(rows), 16, bias=False, rng=rng(), dtype=np.float64)
        local.proj.weight.data[:] = full.proj.weight.data[rows]
        halves.append(local.forward(x)[0])
    expected = full.forward(x)[0] - full.proj.bias.data
    np.testing.assert_allclose(halves[0] + halves[1], expected, atol=1e-12)


def test_attention_is_causal():
    layer = CausalSelfAttention(8, 2, rng=rng(), dtype=np.float64, std=0.5)
    x = rng(1).standard_normal((1, 6, 8))
    x2 = x.copy()
    x2[:, 4:] += 10.0  # change the future
    y, y2 = layer.forward(x)[0], layer.forward(x2)[0]
    np.testing.assert_array_equal(y[:, :4], y2[:, :4])
    assert not np.allclose(y[:, 4:], y2[:, 4:])


# ---------------------------------------------------------------------------------
# the contract: accumulation, caches outside the layer, dtype


def test_backward_accumulates_and_caches_are_independent():
    """Two microbatches in flight (forward, forward, backward, backward) give the sum
    of the two gradients computed one at a time."""
    layer = CausalSelfAttention(8, 2, rng=rng(), dtype=np.float64, std=0.5)
    x1, x2 = rng(1).standard_normal((2, 4, 8)), rng(2).standard_normal((2, 4, 8))
    dy1, dy2 = rng(3).standard_normal((2, 4, 8)), rng(4).standard_normal((2, 4, 8))
    grads = []
    for x, dy in ((x1, dy1), (x2, dy2)):
        layer.zero_grad()
        layer.backward(dy, layer.forward(x)[1])
        grads.append([p.grad.copy() for p in layer.parameters()])
    layer.zero_grad()
    c1, c2 = layer.forward(x1)[1], layer.forward(x2)[1]
    layer.backward(dy2, c2)
    layer.backward(dy1, c1)
    for p, g1, g2 in zip(layer.parameters(), *grads, strict=True):
        np.testing.assert_allclose(p.grad, g1 + g2, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("make", [
    lambda: Linear(8, 6, rng=rng()),
    lambda: LayerNorm(8),
    lambda: GELU(),
    lambda: CausalSelfAttention(8, 2, rng=rng()),
])
def test_float32_in_float32_out(make):
    layer = make()
    x = rng(1).standard_normal((2, 4, 8)).astype(np.float32)
    y, cache = layer.forward(x)
    dx = layer.backward(np.ones_like(y), cache)
    assert y.dtype == np.float32 and dx.dtype == np.float32
    assert all(p.data.dtype == p.grad.dtype == np.float32 for p in layer.parameters())


def test_embedding_float32_and_cross_entropy_float32():
    emb = Embedding(10, 4, rng=rng())
    y, cache = emb.forward(np.array([[1, 2, 1]]))
    emb.backward(np.ones_like(y), cache)
    assert y.dtype == emb.weight.grad.dtype == np.float32
    logits = rng(1).standard_normal((3, 10)).astype(np.float32)
    loss, cache = cross_entropy(logits, np.array([0, 1, 2]))
    assert isinstance(loss, float) and cross_entropy_backward(1.0, cache).dtype == np.float32


def test_rel_error_is_normwise():
    assert rel_error(np.ones(4), np.ones(4)) == 0.0
    assert rel_error(np.array([1.0, 0.0]), np.array([0.0, 0.0])) == 1.0
    assert rel_error(np.zeros(3), np.zeros(3)) == 0.0
