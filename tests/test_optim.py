"""Optimizers against steps computed by hand, state save/load, the schedule, clipping."""

import math
from itertools import pairwise

import numpy as np
import pytest

from hpctrain.nn import Parameter
from hpctrain.optim import SGD, AdamW, clip_grads, grad_norm, lr_at


def params():
    """A matrix (decayed) and a vector (not decayed), with fixed gradients."""
    w = Parameter(np.array([[1.0, -2.0], [0.5, 3.0]]))
    b = Parameter(np.array([0.25, -1.0]))
    return [("w", w), ("b", b)]


def set_grads(named, step):
    named[0][1].grad[...] = np.array([[0.1, -0.2], [0.3, 0.0]]) * (step + 1)
    named[1][1].grad[...] = np.array([-0.5, 0.4]) / (step + 1)


def test_adamw_matches_two_hand_computed_steps():
    lr, (b1, b2), eps, wd = 0.1, (0.9, 0.99), 1e-8, 0.5
    named = params()
    opt = AdamW(named, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    ref = {n: p.data.copy() for n, p in named}
    m = {n: 0.0 for n in ref}
    v = {n: 0.0 for n in ref}
    for t in (1, 2):
        set_grads(named, t - 1)
        for n, p in named:
            g = p.grad
            if n == "w":  # decoupled decay, matrices only
                ref[n] = ref[n] - lr * wd * ref[n]
            m[n] = b1 * m[n] + (1 - b1) * g
            v[n] = b2 * v[n] + (1 - b2) * g * g
            m_hat, v_hat = m[n] / (1 - b1**t), v[n] / (1 - b2**t)
            ref[n] = ref[n] - lr * m_hat / (np.sqrt(v_hat) + eps)
        opt.step()
        for n, p in named:
            np.testing.assert_allclose(p.data, ref[n], rtol=1e-13, atol=1e-15)
    assert opt.t == 2


def test_adamw_first_step_is_lr_times_sign():
    named = params()
    set_grads(named, 0)
    start = named[1][1].data.copy()
    AdamW(named, lr=0.01, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.1).step()
    # m_hat = g and v_hat = g^2 after one step; the bias vector is not decayed
    np.testing.assert_allclose(named[1][1].data, start - 0.01 * np.sign([-0.5, 0.4]))


def test_sgd_momentum_matches_two_hand_computed_steps():
    lr, mu, wd = 0.1, 0.9, 0.01
    named = params()
    opt = SGD(named, lr=lr, momentum=mu, weight_decay=wd)
    ref = {n: p.data.copy() for n, p in named}
    buf = {n: 0.0 for n in ref}
    for t in range(2):
        set_grads(named, t)
        step_lr = lr if t == 0 else 0.05  # step(lr) overrides the constructor's lr
        for n, p in named:
            d = p.grad + (wd * ref[n] if n == "w" else 0.0)
            buf[n] = mu * buf[n] + d
            ref[n] = ref[n] - step_lr * buf[n]
        opt.step(None if t == 0 else step_lr)
        for n, p in named:
            np.testing.assert_allclose(p.data, ref[n], rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("make", [
    lambda named: AdamW(named, lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
    lambda named: SGD(named, lr=0.1, momentum=0.9, weight_decay=0.1),
])
def test_state_round_trip_resumes_identically(make):
    a_named, b_named = params(), params()
    a = make(a_named)
    for t in range(2):
        set_grads(a_named, t)
        a.step()
    saved = {k: v.copy() for k, v in a.state_arrays().items()}
    assert int(saved["t"]) == 2 and any(k.endswith(".w") for k in saved)
    for (_, pa), (_, pb) in zip(a_named, b_named, strict=True):
        pb.data[...] = pa.data
    b = make(b_named)
    b.load_state_arrays(saved)
    for opt, named in ((a, a_named), (b, b_named)):
        set_grads(named, 2)
        opt.step()
    for (_, pa), (_, pb) in zip(a_named, b_named, strict=True):
        np.testing.assert_array_equal(pa.data, pb.data)


def test_load_state_names_the_mismatch():
    opt = AdamW(params(), lr=0.1)
    state = opt.state_arrays()
    del state["m.b"]
    with pytest.raises(ValueError, match=r"missing \['m.b'\]"):
        opt.load_state_arrays(state)
    state = {k: v.copy() for k, v in opt.state_arrays().items()}
    state["v.w"] = np.zeros(3)
    with pytest.raises(ValueError, match=r"'v.w': saved shape \(3,\) vs parameter shape"):
        opt.load_state_arrays(state)


def test_float32_parameters_stay_float32():
    w = Parameter(np.ones((3, 2), np.float32))
    w.grad[...] = 0.5
    for opt in (AdamW([("w", w)], lr=0.1, weight_decay=0.1), SGD([("w", w)], lr=0.1)):
        opt.step()
        assert w.data.dtype == np.float32
        assert all(a.dtype == np.float32 for k, a in opt.state_arrays().items() if k != "t")


# ---------------------------------------------------------------------------------
# schedule


def test_schedule_warmup_midpoint_and_end():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10, total_steps=110)
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(4, **kw) == pytest.approx(0.5)
    assert lr_at(9, **kw) == pytest.approx(1.0)  # the warm-up ends at lr
    assert lr_at(10, **kw) == pytest.approx(1.0)  # the cosine starts at lr
    assert lr_at(60, **kw) == pytest.approx(0.55)  # half-way: (lr + min_lr) / 2
    assert lr_at(110, **kw) == pytest.approx(0.1)
    assert lr_at(500, **kw) == pytest.approx(0.1)
    steps = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in pairwise(steps))


def test_schedule_without_warmup():
    kw = dict(lr=2.0, min_lr=0.0, warmup_steps=0, total_steps=4)
    assert [lr_at(s, **kw) for s in range(5)] == pytest.approx([2.0, 1.0 + 2**-0.5, 1.0,
                                                                1.0 - 2**-0.5, 0.0])


# ---------------------------------------------------------------------------------
# clipping


def test_grad_norm_is_the_global_two_norm():
    named = params()
    set_grads(named, 0)
    expected = math.sqrt(0.01 + 0.04 + 0.09 + 0.25 + 0.16)
    assert grad_norm(p for _, p in named) == pytest.approx(expected, rel=1e-15)


def test_grad_norm_accumulates_float32_in_float64():
    p = Parameter(np.zeros(1 << 18, np.float32))
    p.grad[...] = np.float32(1e-3)
    exact = math.sqrt((1 << 18) * float(np.float32(1e-3)) ** 2)
    assert grad_norm([p]) == pytest.approx(exact, rel=1e-12)


def test_grad_norm_is_the_same_float_on_any_number_of_threads():
    from hpctrain.nn import threads

    rng = np.random.default_rng(0)
    ps = [Parameter(np.zeros(n, np.float32)) for n in (3, 1 << 20, 70_001)]  # ~18 chunks
    for p in ps:
        p.grad[...] = rng.standard_normal(p.grad.shape)
    norms = []
    for n in (1, 2, 3):
        threads.set_threads(n)
        norms.append(grad_norm(ps))
    threads.set_threads(1)
    assert norms[1] == norms[0] and norms[2] == norms[0]
    exact = math.sqrt(sum(float(np.sum(p.grad.astype(np.float64) ** 2)) for p in ps))
    assert norms[0] == pytest.approx(exact, rel=1e-12)


def test_clip_scales_only_above_max_norm():
    named = params()
    ps = [p for _, p in named]
    set_grads(named, 0)
    norm = grad_norm(ps)
    assert clip_grads(ps, max_norm=10.0, total_norm=norm) == 1.0
    assert clip_grads(ps, max_norm=0.0, total_norm=norm) == 1.0  # 0 disables clipping
    scale = clip_grads(ps, max_norm=0.5, total_norm=norm)
    assert scale == pytest.approx(0.5 / (norm + 1e-6), rel=1e-15)
    assert grad_norm(ps) == pytest.approx(0.5, rel=1e-5)
