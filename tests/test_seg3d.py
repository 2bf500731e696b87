"""The 3-D segmentation net: gradient check (with ignored voxels), the Dice sums, its
config and spatial rules, its registration and FLOPs."""

import numpy as np
import pytest

from hpctrain.config import Config, ConfigError, ModelConfig, ParallelConfig
from hpctrain.data.format import VOLUMES
from hpctrain.models.registry import kinds_for, model_class
from hpctrain.models.seg3d import Seg3D
from hpctrain.models.seg3d.model import IGNORE
from hpctrain.nn.gradcheck import check_parameters

TOL = 1e-6


def tiny(channels=(2, 3), crop=(4, 4, 4), dtype="float64") -> ModelConfig:
    return ModelConfig(kind="seg3d", dtype=dtype, channels=channels, n_classes=3, crop=crop)


def data(cfg, B=2, seed=1, ignore=0):
    r = np.random.default_rng(seed)
    x = r.random((B, 1, *cfg.crop))
    y = r.integers(0, cfg.n_classes, (B, *cfg.crop))
    if ignore:
        y[:, -ignore:] = IGNORE  # the padding of a tile beyond the volume
    return x, y


@pytest.mark.parametrize("channels,ignore", [((2, 3), 0), ((2, 3), 1), ((2,), 0),
                                             ((2, 3, 2), 0)])
def test_seg3d_gradcheck_every_parameter(channels, ignore):
    cfg = tiny(channels=channels)
    model = Seg3D(cfg, seed=0)
    x, y = data(cfg, ignore=ignore)
    model.zero_grad()
    loss, cache = model.forward(x, y)
    model.backward(cache)
    errors = check_parameters(lambda: model.forward(x, y)[0], model.named_parameters())
    assert max(errors.values()) < TOL, errors


def test_ignored_voxels_count_in_neither_loss_nor_dice():
    cfg = tiny()
    model = Seg3D(cfg, seed=0)
    x, y = data(cfg, ignore=1)
    inside = y[:, :-1]
    # the loss over the valid voxels equals the loss of the same voxels made explicit
    logits = model._logits(x, train=False)[0]  # (B, K, D, H, W)
    z = np.moveaxis(logits[:, :, :-1], 1, -1).reshape(-1, 3)
    t = inside.reshape(-1)
    want = np.mean(np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(t)), t])
    assert model.eval_loss(x, y) == pytest.approx(want, rel=1e-12)
    pred = logits.argmax(axis=1)[:, :-1]
    for k in (1, 2):
        num, den = model.eval_metrics(x, y)[f"dice_{k}"]
        p, g = pred == k, inside == k
        assert (num, den) == (2 * int((p & g).sum()), int(p.sum() + g.sum()))


def test_an_evaluation_without_a_voxel_of_a_class_leaves_its_dice_out():
    # tiles wholly beyond the volume (or of background only, predicted so): 0 / 0, which
    # ended the run with a ZeroDivisionError at its evaluation
    from mpi4py import MPI

    from hpctrain.parallel.engine import LocalEngine
    from hpctrain.train import evaluate

    cfg = tiny()
    engine = LocalEngine(Seg3D(cfg, seed=0), 1)
    x, y = data(cfg)
    padding = np.full_like(y, IGNORE)
    _, figures = evaluate(Config(model=cfg), engine, [(x, padding)], MPI.COMM_SELF)
    assert figures == {}
    _, figures = evaluate(Config(model=cfg), engine, [(x, padding), (x, y)], MPI.COMM_SELF)
    assert set(figures) == {"dice_1", "dice_2"} and all(0 <= v <= 1 for v in figures.values())


def test_the_evaluation_loss_is_the_mean_over_every_valid_voxel():
    # each batch's mean weighed by its valid voxels: a tile mostly beyond the volume
    # counts for what it holds (the unweighted mean of the batches' means moved with the
    # number of data-parallel ranks, 1.105 at dp 1 against 0.921 at dp 2)
    from mpi4py import MPI

    from hpctrain.parallel.engine import LocalEngine
    from hpctrain.train import evaluate

    cfg = tiny()
    model = Seg3D(cfg, seed=0)
    x, y = data(cfg)
    partly = y.copy()
    partly[:, 1:] = IGNORE  # one depth slice of four in the volume
    loss, _ = evaluate(Config(model=cfg), LocalEngine(model, 1), [(x, y), (x, partly)],
                       MPI.COMM_SELF)
    a, b = model.eval_loss(x, y), model.eval_loss(x, partly)
    na, nb = int((y != IGNORE).sum()), int((partly != IGNORE).sum())
    assert loss == pytest.approx((a * na + b * nb) / (na + nb), rel=1e-12)
    assert abs(loss - (a + b) / 2) > 1e-5  # the unweighted mean (1.7e-4 apart here)


def test_shapes_names_and_registration():
    cfg = tiny(channels=(4, 8, 16), crop=(8, 8, 8), dtype="float32")
    model = Seg3D(cfg, 0)
    names = dict(model.named_parameters())
    assert names["encoder.0.conv.weight"].shape == (4, 1, 3, 3, 3)
    assert names["decoder.0.conv.weight"].shape == (8, 16 + 8, 3, 3, 3)  # up + skip
    assert names["head.weight"].shape == (3, 4, 1, 1, 1)
    assert model_class("seg3d") is Seg3D and kinds_for(VOLUMES) == ["seg3d"]
    x, y = data(cfg)
    loss, cache = model.forward(x.astype(np.float32), y)
    assert np.isfinite(loss) and cache.head.cols.dtype == np.float32
    assert Seg3D.model_flops(cfg, 2) == 2 * Seg3D.model_flops(cfg, 1) > 0


@pytest.mark.parametrize("change,message", [
    (dict(crop=(4, 4)), "three positive sides"),
    (dict(crop=(6, 8, 8), channels=(2, 3, 4)), "divisible by 2^(levels - 1) = 4"),
    (dict(channels=()), "one or more positive widths"),
    (dict(n_classes=1), "n_classes (1) must be at least 2"),
])
def test_config_rules(change, message):
    cfg = Config(model=tiny().__class__(**{**tiny().__dict__, **change}))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("^", r"\^")):
        cfg.validate(1)


@pytest.mark.parametrize("crop,sp,ok,message", [
    ((8, 4, 4), 2, True, ""),
    ((8, 4, 4), 4, True, ""),  # 1 row per rank at level 1: as thick as the halo
    ((4, 4, 4), 4, False, r"spatial size \(4\) must divide the output length \(2"),
    ((6, 4, 4), 4, False, "must divide"),
    ((16, 4, 4), 4, True, ""),
])
def test_spatial_rules_before_any_collective(crop, sp, ok, message):
    cfg = Config(model=tiny(crop=crop), parallel=ParallelConfig(sp=sp))
    if ok:
        assert cfg.validate(sp).parallel.sp == sp
    else:
        with pytest.raises(ConfigError, match=message):
            cfg.validate(sp)


def test_a_model_without_a_spatial_split_refuses_sp():
    cfg = Config(model=ModelConfig(kind="mlp"), parallel=ParallelConfig(sp=2))
    with pytest.raises(ConfigError, match=r"declares no spatial split: sp \(2\) must be 1"):
        cfg.validate(2)


def test_tp_and_sp_share_one_axis():
    cfg = Config(model=tiny(crop=(8, 4, 4)), parallel=ParallelConfig(sp=2, tp=2))
    with pytest.raises(ConfigError, match=r"tp \(2\) and sp \(2\) share"):
        cfg.validate(4)


def test_the_model_ignores_what_the_loader_pads_with():
    from hpctrain.data.volumes import IGNORE as PADDING

    assert IGNORE == PADDING
