"""Reduced precision (``hpctrain.precision``): the configuration's rules and errors,
the caches and parameters of bf16 and fp16 pieces, the loss scaler, the demo GPT's
loss curve in bf16 against fp32, and checkpoints across precisions."""

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain import precision
from hpctrain.checkpoint import Checkpoint
from hpctrain.config import (
    Config,
    ConfigError,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    load,
)
from hpctrain.models.build import build_model
from hpctrain.train import train

ROOT = Path(__file__).resolve().parents[1]
TINY = ModelConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=32)
# the demo's bf16 loss may differ from fp32's by DEMO_TOLERANCE at any of its first
# DEMO_STEPS steps, and its mean over any DEMO_WINDOW steps by DEMO_SMOOTH (measured
# here: 0.022 and 0.008; the trajectories part slowly, over 400 steps see
# benchmarks/bench_precision.py and benchmarks/README.md)
DEMO_STEPS, DEMO_TOLERANCE, DEMO_WINDOW, DEMO_SMOOTH = 30, 0.05, 10, 0.02


def config(precision_name="fp32", world=1, model=TINY, **parallel) -> Config:
    return Config(model=model, parallel=ParallelConfig(**parallel),
                  train=TrainConfig(precision=precision_name)).validate(world)


# ---------------------------------------------------------------------------------
# bad input: errors before any collective (Config.validate is pure)


def test_unknown_precision_is_a_config_error():
    with pytest.raises(ConfigError, match=r"precision \('bf8'\) must be one of fp32, bf16, "
                                          r"fp16"):
        config("bf8")
    with pytest.raises(ConfigError, match=r"grad_comm_dtype \('fp8'\) must be one of"):
        config(grad_comm_dtype="fp8")
    with pytest.raises(precision.PrecisionError, match="must be one of"):
        precision.storage_dtype("tf32")


def test_bf16_without_ml_dtypes_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # import raises ImportError
    with pytest.raises(ConfigError, match=r"precision \(\"bf16\"\) needs NumPy's bfloat16 "
                                          r"dtype, but the ml_dtypes package is not "
                                          r"installed.*pip install ml_dtypes"):
        config("bf16")
    with pytest.raises(ConfigError, match=r"grad_comm_dtype \(\"bf16\"\).*pip install"):
        config(grad_comm_dtype="bf16")
    with pytest.raises(precision.PrecisionError, match="pip install ml_dtypes"):
        precision.storage_dtype("bf16")
    config("fp16")  # float16 is NumPy's own


@pytest.mark.parametrize("name, kwargs, message", [
    ("fp16", {"zero": 1}, r"fp16 loss scaling .* needs zero 0"),
    ("bf16", {"zero": 3}, r"zero 3 and spatial parallelism are not supported"),
    ("fp32", {"grad_comm_dtype": "bf16", "dp_reduce": "hierarchical"},
     r"grad_comm_dtype \(\"bf16\"\) replaces the flat all-reduce"),
    ("fp32", {"grad_comm_dtype": "bf16", "zero": 1}, r"needs zero 0"),
])
def test_layouts_a_precision_cannot_run_at(name, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        config(name, **kwargs)


def test_other_precision_rules():
    with pytest.raises(ConfigError, match=r"\[model\] dtype \('float64'\) must be"):
        config("bf16", model=replace(TINY, dtype="float64"))
    with pytest.raises(ConfigError, match=r"loss_scale \(128\) .* needs precision"):
        Config(model=TINY, train=TrainConfig(precision="bf16", loss_scale=128)).validate(1)
    mlp = ModelConfig(kind="mlp", input_dim=16, hidden=(8,), n_classes=4)
    # the MLP's pieces serve a pipeline only: its own forward would pass their wrappers
    with pytest.raises(ConfigError, match=r"MLP classifier runs its pieces only in a "
                                          r"pipeline: it needs pp > 1"):
        config("bf16", model=mlp)
    config("bf16", zero=2)  # ZeRO's shards are the float32 masters
    config("fp32", grad_comm_dtype="bf16")


# ---------------------------------------------------------------------------------
# pieces: caches, parameters, gradients


def test_compress_and_expand_keep_the_cache_structure():
    from hpctrain.nn import LinearCache
    from hpctrain.parallel.recompute import Kept

    bf16 = precision.bfloat16()
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    ids = np.arange(3)
    cache = (LinearCache(x), [Kept(x, (ids,))], None, 2.5)
    low = precision.compress(cache, bf16)
    assert isinstance(low[0], LinearCache) and isinstance(low[1][0], Kept)
    assert low[0].x.dtype == bf16 and low[1][0].args[0] is ids and low[2:] == (None, 2.5)
    back = precision.expand(low, bf16)
    np.testing.assert_array_equal(back[0].x, precision.round_to(x, bf16))
    assert back[0].x.dtype == np.float32 and precision.nbytes(low) < precision.nbytes(cache)


def test_fp32_leaves_the_model_as_it_is():
    model = build_model(TINY, 1)
    assert precision.apply(model, "fp32") == 0
    assert "forward" not in vars(model.embed) and "forward" not in vars(model.head)


def _grads(name: str, tied: bool = False):
    m = replace(TINY, tie_embeddings=tied)
    model = build_model(m, 7)
    n = precision.apply(model, name)
    masters = {k: p.data.copy() for k, p in model.named_parameters()}
    r = np.random.default_rng(3)
    x, y = (r.integers(0, 256, (4, 16)) for _ in range(2))
    loss, cache = model.forward(x, y)
    model.backward(cache, 1.0)
    for k, p in model.named_parameters():  # the masters are float32 and untouched
        assert p.data.dtype == np.float32 and np.array_equal(p.data, masters[k]), k
    return n, loss, cache, {k: p.grad.copy() for k, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_low_precision_pieces_store_half_and_stay_close(name, tied):
    _, loss32, cache32, grads32 = _grads("fp32", tied)
    n, loss, cache, grads = _grads(name, tied)
    assert n == TINY.n_layer + 2  # embedding, blocks, head
    low = precision.storage_dtype(name)

    def arrays(tree):
        if isinstance(tree, np.ndarray):
            yield tree
        elif isinstance(tree, (tuple, list)):
            for t in tree:
                yield from arrays(t)

    floats = [a for a in arrays(cache) if a.dtype.kind in "fV"]
    assert floats and all(a.dtype == low for a in floats)  # no float32 activation kept
    assert precision.nbytes(cache) < 0.55 * precision.nbytes(cache32)
    assert abs(loss - loss32) < 1e-2
    tol = 3e-2 if name == "bf16" else 5e-3  # 8 against 11 significant bits
    for k, g in grads32.items():
        err = np.linalg.norm(grads[k] - g) / max(np.linalg.norm(g), 1e-12)
        assert err < tol, (k, err)


# ---------------------------------------------------------------------------------
# fp16 loss scaling


class _P:
    def __init__(self, g):
        self.grad = np.array(g, np.float32)


def test_loss_scaler_unscales_backs_off_and_grows():
    s = precision.LossScaler(scale=8.0, growth_interval=2)
    p = _P([8.0, 16.0])
    assert s.unscale([p], 40.0) == 5.0 and np.array_equal(p.grad, [1.0, 2.0])
    assert s.scale == 8.0 and s.good_steps == 1
    assert s.unscale([_P([1.0])], float("inf")) == float("inf")
    assert (s.scale, s.good_steps, s.overflows) == (4.0, 0, 1)
    s.unscale([_P([1.0])], 1.0)
    s.unscale([_P([1.0])], 1.0)
    assert s.scale == 8.0  # two finite steps in a row: doubled
    fixed = precision.LossScaler(scale=128.0, static=True)
    fixed.unscale([_P([1.0])], float("nan"))
    assert fixed.scale == 128.0
    again = precision.Precision("fp16")
    again.load_state(precision.Precision("fp16").state() | {"loss_scale": 4.0})
    assert again.scaler.scale == 4.0 and again.state()["storage"] == "float16"


def test_fp16_gradients_underflow_without_scaling_and_not_with_it():
    """A gradient flowing between pieces below fp16's smallest subnormal (6e-8) is
    lost; scaled by 2^16 first, it survives and is divided back in float32."""
    f16 = np.dtype(np.float16)
    dx = np.full(4, 1e-8, np.float32)
    assert not precision.round_to(dx, f16).any()
    s = precision.LossScaler()
    p = _P(precision.round_to(dx * s.scale, f16))
    s.unscale([p], 1.0)
    np.testing.assert_allclose(p.grad, dx, rtol=1e-3)


# ---------------------------------------------------------------------------------
# whole runs: the demo's loss curve, checkpoints across precisions


def _shakespeare(tmp_path_factory) -> Path:
    path = ROOT / "data/shakespeare.h5"
    if path.exists():
        return path
    from data_prep import sources
    from data_prep.write import write_tokens

    path = tmp_path_factory.mktemp("data") / "shakespeare.h5"
    write_tokens(path, sources.shakespeare_files(), val_fraction=0.1)
    return path


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory) -> Path:
    return _shakespeare(tmp_path_factory)


@pytest.mark.slow
def test_demo_gpt_bf16_loss_within_tolerance_of_fp32(tmp_path, shakespeare):
    losses = {}
    for name in ("fp32", "bf16"):
        cfg = load(ROOT / "configs/gpt-shakespeare.toml",
                   {"train.steps": DEMO_STEPS, "train.precision": name,
                    "train.eval_interval": 0, "train.run_dir": str(tmp_path / name),
                    "data.path": str(shakespeare)}).validate(1)
        losses[name] = train(cfg, MPI.COMM_SELF, quiet=True).losses
    gap = np.array(losses["bf16"]) - np.array(losses["fp32"])
    smooth = np.convolve(gap, np.ones(DEMO_WINDOW) / DEMO_WINDOW, mode="valid")
    assert np.abs(gap).max() < DEMO_TOLERANCE, gap
    assert np.abs(smooth).max() < DEMO_SMOOTH, smooth
    assert losses["bf16"][-1] < losses["bf16"][0] - 1.0  # and it learns


def _run(tmp_path, shakespeare, name, run, steps, resume=None):
    cfg = Config(model=TINY, train=TrainConfig(
        precision=name, steps=steps, batch_size=4, warmup_steps=1, eval_interval=0,
        save_interval=3, run_dir=str(tmp_path / run)),
        data=replace(Config().data, path=str(shakespeare))).validate(1)
    return train(cfg, MPI.COMM_SELF, quiet=True, resume=resume)


class _Same(dict):
    """Tensors by name; equal when the names and every bit are."""

    def __eq__(self, other):
        return self.keys() == other.keys() and all(np.array_equal(self[k], other[k])
                                                    for k in self)


def _tensors(path) -> dict:
    with Checkpoint(path) as ck:
        return _Same({name: ck.read_full(name) for name in ck.tensors})


def _loaded(path, name) -> dict:
    """The model and optimizer state an engine of precision ``name`` loads."""
    from hpctrain.checkpoint import load_training
    from hpctrain.checkpoint.state import held_tensors
    from hpctrain.parallel.engine import build_engine
    from hpctrain.parallel.topology import Topology
    from hpctrain.train import make_data_parallel

    cfg = Config(model=TINY, train=TrainConfig(precision=name, run_dir=str(path.parent.parent
                                                                           / "load"))
                 ).validate(1)
    topo = Topology.build(MPI.COMM_SELF, cfg.parallel)
    engine = build_engine(cfg, topo)
    dp = make_data_parallel(cfg, engine, topo)
    load_training(path, cfg, topo, engine, dp, say=lambda _: None)
    return _Same({h.name: h.array.copy() for h in held_tensors(engine, dp, 0, 1)})


def test_checkpoints_load_across_precisions(tmp_path, shakespeare):
    """A bf16 run's checkpoint holds float32 masters and loads into an fp32 run, and
    back; the precision is in its metadata, each tensor's dtype in its index."""
    step3 = "checkpoints/step-000003"
    bf16 = _run(tmp_path, shakespeare, "bf16", "bf16", 6)
    with Checkpoint(tmp_path / "bf16" / step3) as ck:
        assert ck.meta["precision"] == {"name": "bf16", "storage": "bfloat16",
                                        "master": "float32"}
        assert {np.dtype(t.dtype) for t in ck.tensors.values()} == {np.dtype(np.float32)}
    for name in ("fp32", "bf16"):  # the loaded masters are the saved ones, bit for bit
        assert _loaded(tmp_path / "bf16" / step3, name) == _tensors(tmp_path / "bf16" / step3)
    again = _run(tmp_path, shakespeare, "bf16", "bf16b", 6,
                 resume=str(tmp_path / "bf16" / step3))
    assert again.losses == bf16.losses[3:]  # a bf16 resume is exact
    fp32 = _run(tmp_path, shakespeare, "fp32", "fp32", 6)
    # fp32 -> bf16 and bf16 -> fp32: close to the run that stayed in one precision
    to16 = _run(tmp_path, shakespeare, "bf16", "to16", 6,
                resume=str(tmp_path / "fp32" / step3))
    to32 = _run(tmp_path, shakespeare, "fp32", "to32b", 6,
                resume=str(tmp_path / "bf16" / step3))
    np.testing.assert_allclose(to16.losses, fp32.losses[3:], atol=2e-2)
    np.testing.assert_allclose(to32.losses, bf16.losses[3:], atol=2e-2)
    a = _tensors(tmp_path / "to32b/checkpoints/step-000006")
    b = _tensors(tmp_path / "fp32/checkpoints/step-000006")
    assert a.keys() == b.keys()
    with Checkpoint(tmp_path / "to16/checkpoints/step-000006") as ck:
        assert ck.meta["precision"]["name"] == "bf16"


def test_fp16_checkpoint_keeps_the_loss_scale(tmp_path, shakespeare):
    _run(tmp_path, shakespeare, "fp16", "fp16", 3)
    with Checkpoint(tmp_path / "fp16/checkpoints/step-000003") as ck:
        meta = ck.meta["precision"]
    assert meta["name"] == "fp16" and meta["loss_scale"] == precision.INITIAL_SCALE
    assert meta["good_steps"] == 3
