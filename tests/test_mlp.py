"""The MLP classifier: gradient check, dtype, prediction, learning, and build_model."""

import numpy as np
import pytest

from hpctrain.config import ModelConfig
from hpctrain.models import GPT, MLPClassifier, build_model
from hpctrain.nn.gradcheck import check_array, check_parameters
from hpctrain.optim import SGD

TOL = 1e-6


def small(dtype="float64", hidden=(10, 8)):
    return ModelConfig(kind="mlp", dtype=dtype, input_dim=12, hidden=hidden, n_classes=5)


def data(cfg, B=6, seed=1):
    r = np.random.default_rng(seed)
    return r.random((B, cfg.input_dim)), r.integers(0, cfg.n_classes, B)


@pytest.mark.parametrize("hidden", [(10, 8), ()])
def test_mlp_gradcheck_parameters_and_input(hidden):
    cfg = small(hidden=hidden)
    model = MLPClassifier(cfg, seed=0)
    x, y = data(cfg)
    model.zero_grad()
    loss, cache = model.forward(x, y)
    dx = model.backward(cache, input_grad=True)

    def f():
        return model.forward(x, y)[0]

    errors = check_parameters(f, model.named_parameters())
    errors["input"] = check_array(f, x, dx)
    assert max(errors.values()) < TOL, errors


def test_input_gradient_is_skipped_unless_asked_and_grads_agree():
    cfg = small()
    model = MLPClassifier(cfg, 0)
    x, y = data(cfg)
    model.zero_grad()
    assert model.backward(model.forward(x, y)[1]) is None
    skipped = [p.grad.copy() for p in model.parameters()]
    model.zero_grad()
    model.backward(model.forward(x, y)[1], input_grad=True)
    for p, g in zip(model.parameters(), skipped, strict=True):
        np.testing.assert_array_equal(p.grad, g)


def test_names_shapes_float32_and_predict():
    cfg = ModelConfig(kind="mlp", input_dim=12, hidden=(10, 8), n_classes=5)
    model = build_model(cfg, 0)
    assert [n for n, _ in model.named_parameters()] == [
        "hidden.0.weight", "hidden.0.bias", "hidden.1.weight", "hidden.1.bias",
        "out.weight", "out.bias"]
    x, y = data(cfg)
    x = x.astype(np.float32)
    loss, cache = model.forward(x, y)
    model.backward(cache)
    assert cache.logits.shape == (6, 5) and cache.logits.dtype == np.float32
    assert all(p.data.dtype == p.grad.dtype == np.float32 for p in model.parameters())
    np.testing.assert_array_equal(model.predict(x), cache.logits.argmax(axis=1))
    np.testing.assert_allclose(model.logits(x), cache.logits)


def test_mlp_learns_a_separable_problem_with_sgd():
    cfg = ModelConfig(kind="mlp", input_dim=8, hidden=(32,), n_classes=2)
    model = MLPClassifier(cfg, 0)
    r = np.random.default_rng(3)
    x = r.random((128, 8)).astype(np.float32)
    y = (x[:, :4].sum(axis=1) > x[:, 4:].sum(axis=1)).astype(np.int64)
    opt = SGD(model.named_parameters(), lr=0.2, momentum=0.9)
    for _ in range(150):
        model.zero_grad()
        loss, cache = model.forward(x, y)
        model.backward(cache)
        opt.step()
    assert (model.predict(x) == y).mean() > 0.95, loss


def test_build_model_picks_the_kind_and_is_deterministic():
    gpt_cfg = ModelConfig(n_layer=1, d_model=8, n_head=2, seq_len=4, vocab_size=16)
    assert isinstance(build_model(gpt_cfg, 0), GPT)
    a, b = build_model(small(), 3), build_model(small(), 3)
    assert isinstance(a, MLPClassifier)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        np.testing.assert_array_equal(pa.data, pb.data)
    with pytest.raises(ValueError, match="model kind .'resnet'. must be one of gpt, mlp, cnn"):
        build_model(ModelConfig(kind="resnet"), 0)
