"""The CNN classifier: gradient check, BatchNorm's train and eval modes, its config
rules and registration, its FLOPs, and a short training run on an image file."""

import json
import math

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.config import (
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
)
from hpctrain.data.format import IMAGES
from hpctrain.models import build_model
from hpctrain.models.cnn import CNNClassifier
from hpctrain.models.registry import kinds_for, model_class
from hpctrain.nn.gradcheck import check_parameters

TOL = 1e-6


def tiny(dtype="float64", channels=(2, 3), input_dim=36) -> ModelConfig:
    """6 x 6 images: 6 -> 3 -> 1 over two stages."""
    return ModelConfig(kind="cnn", dtype=dtype, input_dim=input_dim, channels=channels,
                       n_classes=4)


def data(cfg, B=5, seed=1):
    r = np.random.default_rng(seed)
    return r.random((B, cfg.input_dim)), r.integers(0, cfg.n_classes, B)


@pytest.mark.parametrize("channels", [(2, 3), (3,)])
def test_cnn_gradcheck_every_parameter(channels):
    cfg = tiny(channels=channels)
    model = CNNClassifier(cfg, seed=0)
    x, y = data(cfg)
    model.zero_grad()
    loss, cache = model.forward(x, y)
    model.backward(cache)

    def f():
        return model.forward(x, y)[0]  # train mode: the batch's statistics

    errors = check_parameters(f, model.named_parameters())
    assert max(errors.values()) < TOL, errors


def test_names_shapes_and_dtype():
    model = build_model(ModelConfig(kind="cnn", channels=(4, 8)), 0)
    names = dict(model.named_parameters())
    assert list(names)[:3] == ["layers.0.conv.weight", "layers.0.bn.weight", "layers.0.bn.bias"]
    assert names["layers.0.conv.weight"].shape == (4, 1, 3, 3)
    assert names["layers.3.conv.weight"].shape == (8, 8, 3, 3)
    assert names["out.weight"].shape == (8 * 7 * 7, 10)  # 28 -> 14 -> 7
    assert all(p.data.dtype == np.float32 for p in model.parameters())
    x = np.random.default_rng(0).random((3, 784), dtype=np.float32)
    loss, cache = model.forward(x, np.array([0, 1, 2]))
    assert cache.logits.shape == (3, 10) and cache.logits.dtype == np.float32


def test_eval_uses_running_statistics_and_leaves_them():
    cfg = tiny()
    model = CNNClassifier(cfg, 0)
    x, y = data(cfg, B=8)
    for _ in range(3):  # move the running statistics away from (0, 1)
        model.forward(x, y)
    bn = model.layers[0].bn
    mean, var = bn.running_mean.copy(), bn.running_var.copy()
    assert not np.allclose(mean, 0)
    loss = model.eval_loss(x, y)
    counts = model.eval_metrics(x, y)["accuracy"]
    np.testing.assert_array_equal(bn.running_mean, mean)
    np.testing.assert_array_equal(bn.running_var, var)
    assert loss != pytest.approx(model.forward(x, y)[0])  # the batch's statistics differ
    assert counts[1] == 8 and 0 <= counts[0] <= 8
    # in eval mode a prediction does not depend on the rest of its batch
    np.testing.assert_allclose(model.logits(x)[:2], model.logits(x[:2]), rtol=1e-12)


def test_share_batch_reaches_every_batchnorm():
    model = CNNClassifier(tiny(), 0)
    calls = []

    def reduce(a):
        calls.append(a.shape)
        return a

    model.share_batch(reduce)
    x, y = data(tiny())
    model.backward(model.forward(x, y)[1])
    assert calls == [(3, 2), (3, 2), (3, 3), (3, 3)] + [(2, 3), (2, 3), (2, 2), (2, 2)]
    model.eval_loss(x, y)  # eval: no reduction, so ranks may evaluate different batches
    assert len(calls) == 8


def test_registered_and_validated():
    assert model_class("cnn") is CNNClassifier
    assert "cnn" in kinds_for(IMAGES)
    assert Config(model=ModelConfig(kind="cnn")).validate(1).model.channels == (32, 64)


@pytest.mark.parametrize("model, par, words", [
    (dict(input_dim=780), {}, ["input_dim (780)", "square", "784 = 28 * 28"]),
    (dict(channels=(16, 0)), {}, ["channels ([16, 0])", "positive"]),
    (dict(channels=()), {}, ["channels ([])"]),
    (dict(channels=(2,) * 5), {}, ["5 stages", "image side 28 to 0", "at most 4 stages"]),
    (dict(n_classes=1), {}, ["n_classes (1)", "at least 2"]),
    (dict(hidden=(8,)), {}, ["['hidden']", "not read by model kind 'cnn'", "'channels'"]),
    ({}, dict(tp=2), ["CNN classifier declares no tensor-parallel plan", "tp (2)"]),
    ({}, dict(pp=8), ["8 * 1 = 8", "the 4 middle pipeline pieces of the CNN classifier"]),
    ({}, dict(pp=2, sp=2), ["pp (2) must be 1 when sp (2) > 1"]),
])
def test_config_errors_name_the_values(model, par, words):
    cfg = Config(model=ModelConfig(kind="cnn", **model), parallel=ParallelConfig(**par))
    with pytest.raises(ConfigError) as err:
        cfg.validate(math.prod(par.values()) if par else 1)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_model_flops_counts_the_convolutions_and_the_head():
    m = tiny(channels=(2, 3))  # 6 x 6: convs 1->2, 2->2 at 6x6; 2->3, 3->3 at 3x3; 3 -> 4
    per_sample = 2 * 9 * 36 * (1 * 2 + 2 * 2) + 2 * 9 * 9 * (2 * 3 + 3 * 3) + 2 * 3 * 4
    assert CNNClassifier.model_flops(m, 10) == 3 * 10 * per_sample


def test_a_short_run_on_an_image_file_lowers_the_loss(tmp_path, datasets):
    from hpctrain.train import train

    path = datasets.make_images(tmp_path / "images.h5", n_train=64, n_test=32)
    cfg = Config(model=ModelConfig(kind="cnn", channels=(4, 8)),
                 train=TrainConfig(steps=30, batch_size=32, lr=3e-3, warmup_steps=3,
                                   eval_interval=30, eval_batches=1, log_interval=1,
                                   run_dir=str(tmp_path / "run")),
                 data=DataConfig(path=str(path), eval_split="test")).validate(1)
    summary = train(cfg, MPI.COMM_SELF, quiet=True)
    first, last = np.mean(summary.losses[:4]), np.mean(summary.losses[-4:])
    assert last < 0.7 * first, summary.losses
    assert summary.val_accuracy is not None and 0.0 <= summary.val_accuracy <= 1.0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert records[-1]["val_accuracy"] == summary.val_accuracy


def test_a_checkpoint_holds_the_running_statistics(tmp_path):
    from hpctrain.checkpoint import load_training, save_training
    from hpctrain.parallel.engine import build_engine
    from hpctrain.parallel.topology import Topology
    from hpctrain.train import make_data_parallel, train_step

    cfg = Config(model=tiny(), train=TrainConfig(batch_size=5, run_dir=str(tmp_path)))
    cfg = cfg.validate(1)

    def fresh():
        topo = Topology.build(MPI.COMM_SELF, cfg.parallel)
        engine = build_engine(cfg, topo)
        return topo, engine, make_data_parallel(cfg, engine, topo)

    topo, engine, dp = fresh()
    x, y = data(cfg.model)
    for _ in range(2):
        train_step(engine, dp, x, y, lr=1e-2, grad_clip=1.0)
    path = save_training(cfg, topo, engine, dp, step=2, loader_state={"step": 2})
    topo2, engine2, dp2 = fresh()
    load_training(path, cfg, topo2, engine2, dp2)
    saved = dict(engine.named_buffers)
    assert list(saved)[:2] == ["layers.0.bn.running_mean", "layers.0.bn.running_var"]
    for name, array in engine2.named_buffers:
        assert not np.allclose(saved[name], np.zeros_like(array) + (name.endswith("var")))
        np.testing.assert_array_equal(array, saved[name], err_msg=name)
    assert engine2.loss(x, y) == engine.loss(x, y)
    topo.free()
    topo2.free()
