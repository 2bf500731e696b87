"""Local-loss pipeline training without MPI: the objective's gradients (finite
differences, and equal to backprop of the shallower networks each stage trains), the
MLP's pipeline pieces and heads, the schedule's order, and the errors for bad input."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/toy_model.py
from toy_model import TOY, ToyLM, register  # noqa: E402

from hpctrain.config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.models import MLPClassifier
from hpctrain.models.protocol import Model
from hpctrain.nn.gradcheck import check_parameters
from hpctrain.parallel import stages
from hpctrain.parallel.local_loss import LocalLossReference, decoupled, local_idle_theory

TOL = 1e-6


def mlp(hidden=(4, 4, 4), dtype="float64"):
    return ModelConfig(kind="mlp", dtype=dtype, input_dim=6, hidden=hidden, n_classes=3)


def config(m=None, pp=2, **par):
    return Config(model=m or mlp(), parallel=ParallelConfig(pp=pp, pipeline_training="local",
                                                            microbatches=2, **par),
                  train=TrainConfig(batch_size=8, seed=3))


def data(m, b=8, seed=1):
    r = np.random.default_rng(seed)
    return r.random((b, m.input_dim)), r.integers(0, m.n_classes, b)


def local_losses(ref, x, y):
    """Every stage's loss by forward only: stage s's input is stage s - 1's output."""
    losses, act = [], x
    for s, chunk in enumerate(ref.chunks):
        out = chunk.forward(act, y)[0]
        losses.append(ref.heads[s].forward(out, y)[0] if s < len(ref.heads) else out)
        act = out
    return losses


@pytest.mark.parametrize("hidden, pp", [((4, 4, 4), 2), ((4, 4, 4, 4), 3)])
def test_each_stage_gets_the_gradient_of_its_own_loss_only(hidden, pp):
    """d L_s / d theta_s by central differences of L_s alone: a stage's parameters
    move the later stages' losses too, and that gradient must not arrive."""
    cfg = config(mlp(hidden), pp=pp)
    model = MLPClassifier(cfg.model, seed=0)
    ref = LocalLossReference(model, cfg, pp)
    x, y = data(cfg.model)
    ref.zero_grad()
    ref.forward_backward(x, y)
    names = dict((id(p), n) for n, p in ref.named_params)
    for s, chunk in enumerate(ref.chunks):
        own = chunk.parameters() + (ref.heads[s].parameters() if s < len(ref.heads) else [])
        # with microbatches 2, the gradient is that of the mean of the halves' losses
        errors = check_parameters(
            lambda s=s: np.mean([local_losses(ref, xs, ys)[s]
                                 for xs, ys in zip(np.split(x, 2), np.split(y, 2),
                                                   strict=True)]),
            [(names[id(p)], p) for p in own])
        assert max(errors.values()) < TOL, (s, errors)
    # and the first stage's gradient is not the gradient of the sum of the losses
    total = check_parameters(lambda: sum(local_losses(ref, x, y)),
                             [("hidden.0.weight", model.hidden[0].weight)])
    assert total["hidden.0.weight"] > 1e-3


def test_two_stages_train_as_two_shallow_networks_by_backprop():
    """pp = 2, hidden (4, 4, 4): stage 0 is an MLP (6 -> 4 -> 4) with head 0 as its
    output layer; stage 1 an MLP (4 -> 4) on stage 0's output as data."""
    cfg = config()
    model = MLPClassifier(cfg.model, seed=0)
    ref = LocalLossReference(model, cfg, 2)
    x, y = data(cfg.model)
    ref.zero_grad()
    ref.forward_backward(x, y)
    grads = {n: p.grad.copy() for n, p in ref.named_params}
    assert set(grads) >= {"aux_heads.0.linear.weight", "aux_heads.0.linear.bias"}

    first = MLPClassifier(mlp(hidden=(4, 4)), seed=9)
    for mine, theirs in [(first.hidden[0], model.hidden[0]), (first.hidden[1], model.hidden[1]),
                         (first.out, ref.heads[0].linear)]:
        mine.weight.data[...], mine.bias.data[...] = theirs.weight.data, theirs.bias.data
    second = MLPClassifier(ModelConfig(kind="mlp", dtype="float64", input_dim=4, hidden=(4,),
                                       n_classes=3), seed=9)
    for mine, theirs in [(second.hidden[0], model.hidden[2]), (second.out, model.out)]:
        mine.weight.data[...], mine.bias.data[...] = theirs.weight.data, theirs.bias.data
    for net in (first, second):
        net.zero_grad()
    a0 = []
    for xs, ys in zip(np.split(x, 2), np.split(y, 2), strict=True):
        loss, cache = first.forward(xs, ys)
        first.backward(cache, dloss=0.5)
        a0.append(first._features(xs)[0])
    for xs, ys in zip(a0, np.split(y, 2), strict=True):
        loss, cache = second.forward(xs, ys)
        second.backward(cache, dloss=0.5)
    expected = {"hidden.0.weight": first.hidden[0].weight.grad,
                "hidden.1.bias": first.hidden[1].bias.grad,
                "aux_heads.0.linear.weight": first.out.weight.grad,
                "hidden.2.weight": second.hidden[0].weight.grad,
                "out.weight": second.out.weight.grad, "out.bias": second.out.bias.grad}
    for name, want in expected.items():
        np.testing.assert_allclose(grads[name], want, rtol=1e-12, atol=1e-15, err_msg=name)


def test_the_last_stage_loss_is_the_model_loss_and_heads_are_layout_free():
    cfg = config(mlp((4, 4, 4, 4)), pp=3)
    model = MLPClassifier(cfg.model, seed=0)
    x, y = data(cfg.model)
    ref = LocalLossReference(model, cfg, 3)
    loss = ref.forward_backward(x, y)
    want = np.mean([model.forward(xs, ys)[0] for xs, ys in
                    zip(np.split(x, 2), np.split(y, 2), strict=True)])
    assert loss == pytest.approx(want, rel=1e-14)
    assert len(ref.local_losses) == 3
    # the head after middle piece 1 is the same whichever layout asks for it
    again = MLPClassifier(cfg.model, seed=0).aux_head(1, 3)
    np.testing.assert_array_equal(ref.heads[1].linear.weight.data, again.linear.weight.data)
    assert not np.array_equal(ref.heads[0].linear.weight.data, again.linear.weight.data)
    # and drawing heads leaves the model's own weights as backprop training has them
    np.testing.assert_array_equal(model.out.weight.data,
                                  MLPClassifier(cfg.model, seed=0).out.weight.data)


def test_mlp_pipeline_pieces_compose_to_the_model():
    m = mlp()
    model = MLPClassifier(m, seed=0)
    x, y = data(m)
    pieces = model.pipeline_pieces()
    act = pieces.first.forward(x)[0]
    for piece in pieces.middle:
        act = piece.forward(act)[0]
    assert act.shape == MLPClassifier.activation_shape(m, x.shape)
    assert pieces.last.forward(act, y)[0] == pytest.approx(model.forward(x, y)[0], rel=1e-14)
    assert pieces.last.eval_metrics(act, y) == model.eval_metrics(x, y)
    costs = MLPClassifier.piece_costs(m)
    assert costs.first == 24 and costs.middle == [16.0, 16.0] and costs.last == 12
    assert [s.blocks for s in stages.plan(m, 2)] == [range(0, 1), range(1, 2)]


class Recorder:
    """A stage that writes the decoupled schedule's calls down."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, verb):
        return lambda i, *args: self.calls.append((verb, i))


def test_the_schedule_sends_forward_before_learning_and_never_backward():
    stage = Recorder()
    decoupled(stage, 3)
    verbs = [v for v, _ in stage.calls]
    assert verbs == ["recv_forward", "forward_step", "send_forward",
                     "local_backward_step"] * 3
    assert [i for _, i in stage.calls] == [0] * 4 + [1] * 4 + [2] * 4
    assert local_idle_theory(4, 4) == pytest.approx(3 / 15)


@pytest.mark.parametrize("change, message", [
    (dict(pp=1), r"pipeline_training 'local' .* needs pp > 1 \(pp is 1\)"),
    (dict(pipeline_training="greedy"), r"pipeline_training \('greedy'\) must be one of "
                                       r"backprop, local"),
    (dict(schedule="interleaved", virtual_stages=2),
     r"one whole chunk per rank: virtual_stages \(2\)"),
])
def test_bad_parallel_settings_are_config_errors(change, message):
    par = dict(pp=2, pipeline_training="local", microbatches=2) | change
    cfg = Config(model=mlp((4, 4, 4, 4)), parallel=ParallelConfig(**par),
                 train=TrainConfig(batch_size=8))
    with pytest.raises(ConfigError, match=message):
        cfg.validate(par["pp"])


def test_a_model_without_heads_is_refused_before_any_collective(monkeypatch):
    """The toy model declares pipeline pieces but no heads (the base class's default)."""
    register(monkeypatch)
    assert not Model.has_aux_heads(TOY) and not ToyLM.has_aux_heads(TOY)
    cfg = Config(model=TOY, parallel=ParallelConfig(pp=2, pipeline_training="local"),
                 train=TrainConfig(batch_size=8))
    with pytest.raises(ConfigError, match="the toy residual MLP declares no auxiliary heads: "
                                          "pipeline_training 'local' needs one per stage"):
        cfg.validate(2)
    ok = Config(model=TOY, parallel=ParallelConfig(pp=2), train=TrainConfig(batch_size=8))
    assert ok.validate(2).parallel.pipeline_training == "backprop"
    with pytest.raises(NotImplementedError, match="declares no auxiliary heads"):
        ToyLM(TOY, seed=0).aux_head(0, 1)


def test_unequal_hidden_widths_cannot_be_pipelined():
    cfg = Config(model=mlp((8, 4, 4)), parallel=ParallelConfig(pp=2),
                 train=TrainConfig(batch_size=8))
    with pytest.raises(ConfigError, match=r"equal hidden widths \(hidden is \[8, 4, 4\]\)"):
        cfg.validate(2)


def test_the_cli_exposes_the_mode():
    from click.testing import CliRunner

    from hpctrain.cli import OVERRIDES, main

    assert OVERRIDES["pipeline_training"] == "parallel.pipeline_training"
    out = CliRunner().invoke(main, ["train", "--help"]).output
    assert "--pipeline-training [backprop|local]" in out


# ---- the CNN: pipeline pieces of differing shapes, BatchNorm, auxiliary heads ----------

def cnn(dtype="float64"):
    return ModelConfig(kind="cnn", dtype=dtype, input_dim=64, channels=(2, 3), n_classes=3)


def test_cnn_pipeline_pieces_compose_to_the_model_in_training_and_evaluation():
    from hpctrain.models.cnn import CNNClassifier

    m = cnn()
    model, twin = CNNClassifier(m, seed=0), CNNClassifier(m, seed=0)
    x, y = data(m)
    pieces = model.pipeline_pieces()
    assert pieces is model.pipeline_pieces()  # built once: wrappers on them stay
    act, cache0 = pieces.first.forward(x)
    caches = []
    for j, piece in enumerate(pieces.middle):
        act, cache = piece.forward(act)
        caches.append(cache)
        assert act.shape == CNNClassifier.activation_shape_after(m, x.shape, j)
    loss, head = pieces.last.forward(act, y)
    want, want_cache = twin.forward(x, y)
    assert loss == pytest.approx(want, rel=1e-14)
    # backward through the pieces is the model's backward
    model.zero_grad()
    twin.zero_grad()
    d = pieces.last.backward(1.0, head)
    for piece, cache in zip(reversed(pieces.middle), reversed(caches), strict=True):
        d = piece.backward(d, cache)
    twin.backward(want_cache)
    for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters(),
                                 strict=True):
        np.testing.assert_allclose(p.grad, q.grad, rtol=1e-12, atol=1e-15, err_msg=name)
    # evaluation: running statistics, as the model's own evaluation
    act = pieces.first.forward(x)[0]
    for piece in pieces.middle:
        act = stages.forward_eval(piece, act)
    assert pieces.last.eval_metrics(act, y) == twin.eval_metrics(x, y)
    assert len(CNNClassifier.piece_costs(m).middle) == 4  # every conv: pp up to 4


@pytest.mark.parametrize("pp", [2, 4])
def test_cnn_stages_get_the_gradient_of_their_own_loss_only(pp):
    from hpctrain.models.cnn import CNNClassifier

    cfg = config(cnn(), pp=pp)
    ref = LocalLossReference(CNNClassifier(cfg.model, seed=0), cfg, pp)
    x, y = data(cfg.model)
    ref.zero_grad()
    ref.forward_backward(x, y)
    names = dict((id(p), n) for n, p in ref.named_params)
    halves = list(zip(np.split(x, 2), np.split(y, 2), strict=True))
    for s, chunk in enumerate(ref.chunks):
        own = chunk.parameters() + (ref.heads[s].parameters() if s < len(ref.heads) else [])
        errors = check_parameters(
            lambda s=s: np.mean([local_losses(ref, xs, ys)[s] for xs, ys in halves]),
            [(names[id(p)], p) for p in own])
        assert max(errors.values()) < TOL, (s, errors)


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_a_chunk_without_input_gradient_learns_the_same_bits(kind):
    """``input_grad=False`` (local losses) skips the first layer's input gradient and
    leaves every parameter gradient bitwise as it was."""
    from hpctrain.models.build import build_model

    m = mlp() if kind == "mlp" else cnn()
    specs = stages.plan(m, 2)
    x, y = data(m)
    got = {}
    for input_grad in (True, False):
        model = build_model(m, 0)
        first, second = (stages.ModelChunk(s, model) for s in specs)
        act, c0 = first.forward(x, y)
        loss, c1 = second.forward(act, y)
        model.zero_grad()
        dx = second.backward(1.0, c1, input_grad=input_grad)
        assert (dx is None) == (not input_grad)
        first.backward(np.ones_like(act), c0)
        got[input_grad] = {n: p.grad.copy() for n, p in model.named_parameters()}
    for name, grad in got[True].items():
        np.testing.assert_array_equal(grad, got[False][name], err_msg=name)
