"""The parallel-scan backward without MPI: stage Jacobians against finite differences
and against backprop of unit vectors, the scan against the sequential product at
every pp, a whole pipeline simulated serially against serial backprop, the checks."""

import numpy as np
import pytest

from hpctrain.nn import Embedding, LayerNorm, Linear
from hpctrain.parallel.scan_backward import (
    build_chain,
    flop_counts,
    message_shape,
    scan_rounds,
    serial_step,
    simulate_scan,
    split_stages,
    step,
)

B, W = 3, 5


def batch(width=W, b=B, seed=1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((b, width)), rng.integers(0, width, b)


@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_stage_jacobian_equals_finite_differences(activation):
    stage = split_stages(build_chain(4, W, seed=0, activation=activation), 2, W)[1]
    x, _ = batch()
    _, cache = stage.forward(x)
    jac = stage.jacobian(cache)  # (B, out, in)
    assert jac.shape == (B, W, W)
    eps = 1e-6
    for i in range(W):
        e = np.zeros(W)
        e[i] = eps
        # rows are independent samples: column i of every sample's Jacobian at once
        num = (stage.forward(x + e)[0] - stage.forward(x - e)[0]) / (2 * eps)  # (B, out)
        np.testing.assert_allclose(jac[:, :, i], num, rtol=1e-6, atol=1e-8)


def test_stage_jacobian_equals_backprop_of_unit_vectors():
    stage = split_stages(build_chain(6, W, seed=3), 3, W)[1]
    x, _ = batch()
    _, cache = stage.forward(x)
    jac = stage.jacobian(cache)
    for o in range(W):
        dy = np.zeros((B, W))
        dy[:, o] = 1.0
        # row o of dy/dx is the input gradient of unit output o
        np.testing.assert_allclose(jac[:, o, :], stage.backward(dy, cache), rtol=1e-13,
                                   atol=1e-15)


@pytest.mark.parametrize("pp", range(1, 18))
def test_scan_equals_the_sequential_product(pp):
    rng = np.random.default_rng(pp)
    elements = [rng.standard_normal((2, 1, 4))] + \
        [rng.standard_normal((2, 4, 4)) for _ in range(pp - 2)] + ([None] if pp > 1 else [])
    excl = simulate_scan(elements)
    assert excl[0] is None
    running = elements[0]
    for j in range(1, pp):
        np.testing.assert_allclose(excl[j], running, rtol=1e-12)
        if j < pp - 1:
            running = running @ elements[j]
    assert len(scan_rounds(pp)) == (pp - 1).bit_length()  # ceil(log2 pp)


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_messages_have_the_shapes_the_receiver_expects(pp):
    # every received product is (B, 1, w) when its window starts at position 0
    stages = split_stages(build_chain(pp, W, seed=0), pp, W)
    rng = np.random.default_rng(0)
    elements = [rng.standard_normal((B, 1, W))] + \
        [rng.standard_normal((B, W, W)) for _ in range(pp - 2)] + [None]
    from hpctrain.parallel.scan_backward import ScanPosition

    pos = [ScanPosition(j, pp, e) for j, e in enumerate(elements)]
    for d in scan_rounds(pp):
        sent = {p.send_to(d): p.incl for p in pos if p.send_to(d) is not None}
        for j, r in sent.items():
            assert r.shape == message_shape(j, d, B, stages), (pp, d, j)
            pos[j].receive(d, r)


@pytest.mark.parametrize("pp", [2, 3, 4, 5, 8])
def test_a_pipeline_simulated_serially_gives_serial_gradients(pp):
    """The scan's algebra end to end without MPI: forward each stage, Jacobians,
    simulate_scan, local backward; the gradients equal serial backprop."""
    depth = 2 * pp
    x, t = batch(b=4)
    serial = build_chain(depth, W, seed=7)
    serial_step(serial, x, t)
    layers = build_chain(depth, W, seed=7)
    stages = split_stages(layers, pp, W)
    h, caches = x, []
    for stage in stages:
        h, c = stage.forward(h)
        caches.append(c)
    from hpctrain.nn import cross_entropy, cross_entropy_backward

    _, ce = cross_entropy(h, t)
    dy = cross_entropy_backward(1.0, ce)
    g_last = stages[-1].backward(dy, caches[-1])[:, None, :]
    elements = [g_last] + [stages[s].jacobian(caches[s]) for s in range(pp - 2, 0, -1)] \
        + [None]
    excl = simulate_scan(elements)
    for s in range(pp - 1):
        stages[s].backward(excl[pp - 1 - s][:, 0, :], caches[s], need_dx=False)
    for a, b in zip(layers, serial, strict=True):
        for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
            np.testing.assert_allclose(p.grad, q.grad, rtol=1e-10, atol=1e-14, err_msg=name)
            assert np.any(q.grad != 0), name  # the comparison says something


def test_bad_input_is_refused_with_the_values():
    with pytest.raises(ValueError, match=r"pp \(1\) must be >= 2"):
        split_stages(build_chain(4, W, seed=0), 1, W)
    with pytest.raises(ValueError, match=r"chain's 10 layers must split into pp \(4\)"):
        split_stages(build_chain(5, W, seed=0), 4, W)
    rng = np.random.default_rng(0)
    chain = build_chain(2, W, seed=0)
    with pytest.raises(ValueError, match=r"layer 2 \(LayerNorm\) in stage 1 has no Jacobian"):
        split_stages([*chain[:2], LayerNorm(W), chain[3]], 2, W)
    with pytest.raises(ValueError, match=r"layer 0 \(Embedding\) takes integer indices.*"
                                         r"stage 0 is not differentiable end to end"):
        split_stages([Embedding(10, W, rng=rng), *chain[1:]], 2, W)
    with pytest.raises(ValueError, match=r"layer 2 \(Linear 8->5\) receives width 5"):
        split_stages([*chain[:2], Linear(8, W, rng=rng), chain[3]], 2, W)
    with pytest.raises(ValueError, match=r"depth \(0\) and width \(5\) must be >= 1"):
        build_chain(0, W, seed=0)
    with pytest.raises(ValueError, match=r"activation \('tanh'\) must be one of"):
        build_chain(2, W, seed=0, activation="tanh")


class _NeverCalled:
    """A communicator that fails the test if any message is attempted."""

    def __init__(self, size):
        self.size = size

    def Get_size(self):
        return self.size

    def Get_rank(self):
        return 0

    def __getattr__(self, name):
        raise AssertionError(f"{name} called before the input was checked")


def test_step_checks_before_any_message():
    stages = split_stages(build_chain(4, W, seed=0), 2, W)
    x, t = batch()
    with pytest.raises(ValueError, match=r"pp_comm has 4 ranks but the chain 2 stages"):
        step(stages, x, t, _NeverCalled(4))
    with pytest.raises(ValueError, match=r"x \(3, 4\) must be \(B, 5\)"):
        step(stages, x[:, :4], t, _NeverCalled(2))
    with pytest.raises(ValueError, match=r"method \('tree'\) must be 'scan' or 'chain'"):
        step(stages, x, t, _NeverCalled(2), method="tree")


def test_flop_counts():
    # pp = 2 is the chain; pp = 4 pays 2 w^3 per layer on two stages and only vector
    # combines; narrow layers on many stages shorten the critical path, wide ones not
    assert flop_counts(64, 8, 2, 1)["scan_path"] == flop_counts(64, 8, 2, 1)["chain_path"]
    c = flop_counts(64, 8, 4, 1)
    assert c["scan_work"] == c["chain_work"] + 2 * 2 * 8 ** 3 * 15 + 3 * 2 * 8 * 8
    assert flop_counts(256, 4, 8, 1)["scan_path"] < flop_counts(256, 4, 8, 1)["chain_path"]
    assert flop_counts(256, 64, 8, 1)["scan_path"] > flop_counts(256, 64, 8, 1)["chain_path"]
