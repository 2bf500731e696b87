"""The DLRM and its pieces: EmbeddingBag (sparse gradient), the dot interaction, the
sparse optimizers, the model against finite differences, and training through
``hpctrain train``'s loop with checkpoints, on synthetic structured batches."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hpctrain.config import (
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    TableConfig,
    TrainConfig,
    from_dict,
)
from hpctrain.models.dlrm import DLRM
from hpctrain.nn import DotInteraction, EmbeddingBag, Linear, SparseParameter
from hpctrain.nn.gradcheck import check_array, check_parameters
from hpctrain.nn.module import coalesce
from hpctrain.optim import AdamW, clip
from hpctrain.optim.sparse import RowWiseAdaGrad, SparseAdam
from hpctrain.parallel.data import GradBuckets

TABLES = (TableConfig("user", 20), TableConfig("item", 30),
          TableConfig("genres", 5, width=3, pooling="mean"))


def model_cfg(**kw) -> ModelConfig:
    base = dict(kind="dlrm", dtype="float64", tables=TABLES, embed_dim=4, bottom_mlp=(6, 4),
                top_mlp=(8,), dense_features=("age", "year"), bias_features=("user", "item"),
                output_bias=3.0)
    return ModelConfig(**{**base, **kw})


def batch(n: int, seed: int = 0, tables=TABLES) -> tuple[np.ndarray, np.ndarray]:
    """A structured batch of the loader's interface: dense (n, 2), ids (n, K)."""
    rng = np.random.default_rng(seed)
    K = sum(t.width for t in tables)
    x = np.empty(n, np.dtype([("dense", "<f8", (2,)), ("ids", "<i8", (K,))]))
    x["dense"] = rng.random((n, 2))
    cols = [rng.integers(0, t.rows, (n, t.width)) for t in tables]
    ids = np.concatenate(cols, axis=1)
    bag = ids[:, -3:]
    bag[rng.random(bag.shape) < 0.4] = -1  # unused slots of the genres bag
    bag[0] = -1  # an empty bag
    x["ids"] = ids
    return x, rng.integers(1, 6, n).astype(np.float64)


# ---------------------------------------------------------------------------------
# EmbeddingBag


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_embedding_bag_gradcheck_and_only_the_batch_rows(pooling):
    rng = np.random.default_rng(1)
    bag = EmbeddingBag(rng.standard_normal((50, 3)), pooling=pooling, name="t")
    ids = rng.integers(0, 50, (7, 4))
    ids[rng.random(ids.shape) < 0.3] = -1
    ids[2] = -1  # an empty bag pools to zero
    ids[3] = [5, 5, -1, 5]  # a repeated row
    w = rng.standard_normal((7, 3))
    y, cache = bag.forward(ids)
    assert np.all(y[2] == 0)
    if pooling == "mean":
        np.testing.assert_allclose(y[3], bag.weight.data[5])
    bag.backward(w, cache)
    g = bag.weight.grad
    assert np.array_equal(g.rows, np.unique(ids[ids >= 0]))  # the batch's rows, nothing else
    assert g.values.shape == (len(g.rows), 3)
    errors = check_parameters(lambda: float(np.sum(bag.forward(ids)[0] * w)),
                              bag.named_parameters())
    assert max(errors.values()) < 1e-8, errors


def test_embedding_bag_never_allocates_a_table_sized_gradient():
    bag = EmbeddingBag(np.zeros((1_000_000, 8)), name="big")
    assert not isinstance(bag.weight.grad, np.ndarray)
    y, cache = bag.forward(np.array([[3], [999_999], [3]]))
    bag.backward(np.ones((3, 8)), cache)
    assert bag.weight.grad.nbytes < 1000  # 2 rows, not 64 MB
    assert bag.weight.grad.rows.tolist() == [3, 999_999]
    assert bag.weight.grad.values[:, 0].tolist() == [2.0, 1.0]
    bag.weight.zero_grad()
    assert len(bag.weight.grad.rows) == 0


def test_an_id_outside_the_table_names_the_table_and_the_values():
    bag = EmbeddingBag(np.zeros((10, 2)), name="item")
    with pytest.raises(ValueError, match=r"table 'item'.*\[0, 10\).*\[10, 12\]"):
        bag.forward(np.array([[1], [10], [12]]))
    with pytest.raises(ValueError, match=r"table 'item'.*-3"):
        bag.forward(np.array([[1, -1], [-3, 2]]))


def test_coalesce_sums_repeats_in_order():
    rows, values = coalesce(np.array([4, 1, 4, 9, 1]), np.arange(5.0)[:, None])
    assert rows.tolist() == [1, 4, 9] and values[:, 0].tolist() == [1 + 4, 0 + 2, 3]


# ---------------------------------------------------------------------------------
# the interaction


def test_dot_interaction_values_and_gradcheck():
    rng = np.random.default_rng(2)
    z, e = rng.standard_normal((5, 4)), rng.standard_normal((5, 3, 4))
    layer = DotInteraction()
    y, cache = layer.forward(z, e)
    assert y.shape == (5, 4 + 6)
    np.testing.assert_allclose(y[:, 4], np.sum(z * e[:, 0], axis=1))  # pair (0, 1)
    np.testing.assert_allclose(y[:, -1], np.sum(e[:, 1] * e[:, 2], axis=1))  # pair (2, 3)
    w = rng.standard_normal(y.shape)
    dz, de = layer.backward(w, cache)

    def loss():
        return float(np.sum(layer.forward(z, e)[0] * w))

    assert check_array(loss, z, dz) < 1e-8
    assert check_array(loss, e, de) < 1e-8


# ---------------------------------------------------------------------------------
# the model


def test_dlrm_gradcheck_every_parameter_dense_and_sparse():
    model = DLRM(model_cfg(), seed=3)
    rng = np.random.default_rng(4)
    for name, p in model.named_parameters():  # off ReLU's kink: a dead unit's input is 0
        if name.endswith("bias") or name.startswith("biases"):
            p.data[...] += 0.1 * rng.standard_normal(p.shape)
    x, y = batch(12)
    loss, cache = model.forward(x, y)
    model.backward(cache)
    for name, p in model.named_parameters():
        if isinstance(p, SparseParameter):  # the batch's rows only
            assert len(p.grad.rows) <= 12 * 3, name
    errors = check_parameters(lambda: model.forward(x, y)[0], model.named_parameters())
    assert max(errors.values()) < 1e-7, errors
    names = [n for n, _ in model.named_parameters()]
    assert names[:5] == ["tables.0.weight", "tables.1.weight", "tables.2.weight",
                         "biases.0.weight", "biases.1.weight"]


def test_dlrm_rejects_bad_ids_and_batches_naming_them():
    model = DLRM(model_cfg(), seed=3)
    x, y = batch(4)
    x["ids"][1, 1] = 30  # item has 30 rows
    with pytest.raises(ValueError, match=r"table 'item'.*\[0, 30\).*\[30\]"):
        model.forward(x, y)
    wrong = np.zeros(4, np.dtype([("dense", "<f8", (3,)), ("ids", "<i8", (5,))]))
    with pytest.raises(ValueError, match=r"3 dense values and 5 ids.*take 2.*tables 5"):
        model.forward(wrong, y)


def test_feature_layout_of_the_model_and_of_its_config():
    m = model_cfg()
    layout = (["age", "year"], [("user", 20, 1), ("item", 30, 1), ("genres", 5, 3)])
    assert DLRM(m, seed=0).feature_layout() == layout
    assert DLRM.feature_layout(m) == layout


@pytest.mark.parametrize("change, message", [
    (dict(tables=()), r"needs \[model\] tables"),
    (dict(tables=(TableConfig("a", 3), TableConfig("a", 4))), r"\['a'\] repeat"),
    (dict(tables=(TableConfig("a", 0),)), r"table 'a': rows \(0\)"),
    (dict(tables=(TableConfig("a", 3, pooling="max"),)), r"pooling \('max'\)"),
    (dict(bias_features=("movie",)), r"\['movie'\] are not tables"),
    (dict(bottom_mlp=(6, 5)), r"bottom_mlp \(\[6, 5\]\) must end with embed_dim \(4\)"),
    (dict(dense_features=()), "at least one dense feature"),
])
def test_config_rules_name_the_values(change, message):
    with pytest.raises(ConfigError, match=message):
        Config(model=model_cfg(**change)).validate(1)


def test_config_refuses_zero_and_local_averaging_naming_only_what_breaks_the_rule():
    with pytest.raises(ConfigError, match=r"gathered each step: zero \(1\) must be 0$"):
        Config(model=model_cfg(), parallel=ParallelConfig(zero=1)).validate(1)
    # it listed the values that were fine too: "zero (0) must be 0, averaging ..."
    with pytest.raises(ConfigError, match=r"step: averaging \('periodic'\) must be 'sync'$"):
        Config(model=model_cfg(), parallel=ParallelConfig(dp=2, averaging="periodic")
               ).validate(2)


def test_tables_load_from_toml_as_inline_tables():
    cfg = from_dict({"model": {"kind": "dlrm", "tables": [{"name": "u", "rows": 3},
                                                           {"name": "g", "rows": 4, "width": 2,
                                                            "pooling": "mean"}],
                               "dense_features": ["a"], "embed_dim": 16}})
    assert cfg.model.tables == (TableConfig("u", 3), TableConfig("g", 4, 2, "mean"))
    assert from_dict(cfg.to_dict()).model == cfg.model  # a saved config reads back
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['size'\]"):
        from_dict({"model": {"tables": [{"name": "u", "rows": 3, "size": 2}]}})
    with pytest.raises(ConfigError, match=r"rows \('x'\) must be an integer"):
        from_dict({"model": {"tables": [{"name": "u", "rows": "x"}]}})


# ---------------------------------------------------------------------------------
# the optimizers, clipping, and the dense paths' refusals


def sparse_table(rows=6, dim=3, seed=0):
    return SparseParameter(np.random.default_rng(seed).standard_normal((rows, dim)))


def test_rowwise_adagrad_moves_only_the_rows_seen_by_the_formula():
    p = sparse_table()
    before = p.data.copy()
    opt = RowWiseAdaGrad([("t", p)], lr=0.1, eps=1e-8)
    g = np.array([[1.0, 2.0, 2.0], [0.5, 0.0, 0.0]])
    p.grad.add(np.array([4, 1]), g)  # row 4 gets g[0], row 1 g[1]
    opt.step()
    acc1, acc4 = 0.25 / 3, 9 / 3
    np.testing.assert_allclose(opt.acc[0], [0, acc1, 0, 0, acc4, 0])
    np.testing.assert_allclose(p.data[1], before[1] - 0.1 * g[1] / (np.sqrt(acc1) + 1e-8))
    np.testing.assert_allclose(p.data[4], before[4] - 0.1 * g[0] / (np.sqrt(acc4) + 1e-8))
    untouched = [0, 2, 3, 5]
    assert np.array_equal(p.data[untouched], before[untouched])  # bitwise


def test_sparse_adam_is_adam_when_every_row_is_seen_and_lazy_otherwise():
    dense, table = Linear(6, 3, rng=np.random.default_rng(0), dtype=np.float64), sparse_table()
    table.data[...] = dense.weight.data
    ref = AdamW([("w", dense.weight)], lr=0.01, betas=(0.9, 0.99), weight_decay=0.0)
    lazy = SparseAdam([("w", table)], lr=0.01, betas=(0.9, 0.99))
    rng = np.random.default_rng(1)
    for _ in range(3):  # every row each step: lazy Adam is Adam
        g = rng.standard_normal((6, 3))
        dense.weight.grad[...] = g
        table.zero_grad()
        table.grad.add(np.arange(6), g)
        ref.step()
        lazy.step()
    np.testing.assert_allclose(table.data, dense.weight.data, rtol=1e-13)
    m, v, before = lazy.m[0].copy(), lazy.v[0].copy(), table.data.copy()
    table.zero_grad()
    table.grad.add(np.array([2]), np.ones((1, 3)))
    lazy.step()  # only row 2 and its moments change
    others = [0, 1, 3, 4, 5]
    assert np.array_equal(table.data[others], before[others])
    assert np.array_equal(lazy.m[0][others], m[others])
    assert np.array_equal(lazy.v[0][others], v[others])
    assert not np.array_equal(table.data[2], before[2])


def test_norm_and_clipping_count_a_sparse_gradient_as_its_dense_array():
    p, q = sparse_table(), SparseParameter(np.zeros((4, 2)))
    p.grad.add(np.array([0, 5, 0]), np.full((3, 3), 2.0))
    dense = p.grad.to_dense()
    assert clip.grad_norm([p, q]) == pytest.approx(np.linalg.norm(dense))
    clip.clip_grads([p, q], 1.0, clip.grad_norm([p]))
    assert np.linalg.norm(p.grad.to_dense()) == pytest.approx(1.0, rel=1e-5)


def test_dense_code_paths_refuse_sparse_gradients_by_name():
    p = sparse_table()
    with pytest.raises(ValueError, match="sparse ones.*hpctrain.optim.sparse"):
        AdamW([("tables.0.weight", p)], lr=0.1)
    with pytest.raises(ValueError, match="sparse_data exchanges"):
        GradBuckets([p], lambda b, v: None, bucket_mb=1)
    with pytest.raises(ValueError, match=r"\['w'\] have dense ones"):
        RowWiseAdaGrad([("w", Linear(2, 2, rng=np.random.default_rng(0)).weight)], lr=0.1)


# ---------------------------------------------------------------------------------
# training through the loop's pieces, and checkpoints


def run_config(tmp_path, **train) -> Config:
    t = dict(steps=6, batch_size=16, lr=1e-2, warmup_steps=1, grad_clip=0.5, sparse_lr=0.05,
             run_dir=str(tmp_path / "run"), eval_interval=0)
    return Config(model=model_cfg(), train=TrainConfig(**{**t, **train}),
                  data=DataConfig(path=str(tmp_path / "none.h5"))).validate(1)


@pytest.mark.parametrize("sparse_optimizer", ["rowwise_adagrad", "adam"])
def test_the_training_step_lowers_the_loss(tmp_path, sparse_optimizer):
    from mpi4py import MPI

    from hpctrain.testing import train_losses

    cfg = run_config(tmp_path, steps=40, sparse_optimizer=sparse_optimizer)
    data = [batch(16, seed=s) for s in range(2)]
    losses = train_losses(cfg, MPI.COMM_SELF, data, steps=40)
    assert np.mean(losses[-4:]) < 0.5 * np.mean(losses[:2]), losses


@pytest.mark.parametrize("sparse_optimizer", ["rowwise_adagrad", "adam"])
def test_save_and_resume_are_bitwise(tmp_path, sparse_optimizer):
    from mpi4py import MPI

    from hpctrain.checkpoint.training import load_training, save_training
    from hpctrain.parallel.engine import build_engine
    from hpctrain.parallel.topology import Topology
    from hpctrain.train import make_data_parallel, train_step

    cfg = run_config(tmp_path, sparse_optimizer=sparse_optimizer)
    data = [batch(16, seed=s) for s in range(6)]

    def build():
        topo = Topology.build(MPI.COMM_SELF, cfg.parallel)
        engine = build_engine(cfg, topo)
        return topo, engine, make_data_parallel(cfg, engine, topo)

    def run(engine, dp, steps):
        return [train_step(engine, dp, *data[s], lr=1e-2, grad_clip=0.5)[0] for s in steps]

    topo, engine, dp = build()
    straight = run(engine, dp, range(6))
    topo, engine, dp = build()
    run(engine, dp, range(3))
    path = save_training(cfg, topo, engine, dp, step=3, loader_state={}, say=lambda s: None)
    assert any("optim/acc/" in n or "optim/m/tables" in n
               for n in _saved_names(path))  # the tables' state is in the checkpoint
    topo, engine, dp = build()
    load_training(path, cfg, topo, engine, dp)
    assert dp.optimizer.t == 3
    resumed = run(engine, dp, range(3, 6))
    assert resumed == straight[3:]  # bitwise


def _saved_names(path) -> list[str]:
    from hpctrain.checkpoint.reader import Checkpoint

    with Checkpoint(path) as ckpt:
        return sorted(ckpt.tensors)


def test_model_flops_count_the_mlps_and_the_interaction():
    m = model_cfg()
    n, d = 4, 4
    gemm = 2 * (2 * 6 + 6 * 4) + 2 * ((4 + 6) * 8 + 8 * 1)
    assert DLRM.model_flops(m, 10) == 3.0 * 10 * (gemm + 2 * n * n * d)
    assert dataclasses.replace(m, embed_dim=4) == m


# ---------------------------------------------------------------------------------
# regularisation, the factorisation-machine output, clipping


def test_dlrm_penalties_and_fm_output_gradcheck_and_values():
    cfg = model_cfg(embed_l2=0.3, bias_l2=0.2, fm_output=True, top_mlp=())
    model = DLRM(cfg, seed=3)
    rng = np.random.default_rng(4)
    for _, p in model.named_parameters():
        p.data[...] += 0.1 * rng.standard_normal(p.shape)
    x, y = batch(12)
    loss, cache = model.forward(x, y)
    # the loss is the MSE plus the penalties on what each sample looked up
    plain = DLRM(dataclasses.replace(cfg, embed_l2=0.0, bias_l2=0.0), seed=3)
    for (_, a), (_, b) in zip(plain.named_parameters(), model.named_parameters(), strict=True):
        a.data[...] = b.data
    mse = plain.forward(x, y)[0]
    e = np.stack([t.forward(x["ids"][:, model.cols[c.name]])[0]
                  for t, c in zip(model.tables, cfg.tables, strict=True)], axis=1)  # (B, F, d)
    b = np.concatenate([t.forward(x["ids"][:, model.cols[n]])[0]
                        for t, n in zip(model.biases, cfg.bias_features, strict=True)], axis=1)
    assert loss == pytest.approx(mse + 0.3 * np.sum(e * e) / 12 + 0.2 * np.sum(b * b) / 12,
                                 rel=1e-12)
    assert loss > mse
    # fm_output: the prediction holds the sum of the interaction's dot products
    h, _ = model.interaction.forward(_bottom_out(model, x), e)  # (B, d + pairs)
    fm = DLRM(dataclasses.replace(cfg, fm_output=False), seed=3)
    for (_, a), (_, c) in zip(fm.named_parameters(), model.named_parameters(), strict=True):
        a.data[...] = c.data
    dots = h[:, cfg.embed_dim:].sum(axis=1)
    assert np.abs(dots).max() > 1e-3
    assert np.allclose(model.predict(x) - fm.predict(x), dots, atol=1e-12)
    model.backward(cache)
    errors = check_parameters(lambda: model.forward(x, y)[0], model.named_parameters())
    assert max(errors.values()) < 1e-7, errors


def _bottom_out(model, x):
    z = x["dense"]
    for layer in model.bottom:
        z = np.maximum(layer.forward(z)[0], 0.0)
    return z


def test_evaluation_clips_to_the_rating_range_and_leaves_out_the_penalties():
    cfg = model_cfg(output_bias=4.8, rating_min=1.0, rating_max=5.0, embed_l2=0.5)
    model = DLRM(cfg, seed=3)
    model.biases[0].weight.data[...] = 1.0  # every prediction near 5.8: clipped to 5
    x, y = batch(12)
    raw = model.predict_cached(x)[0]
    assert raw.max() > 5.0 and model.predict(x).max() == 5.0
    assert np.array_equal(model.predict(x), np.clip(raw, 1.0, 5.0))
    err = np.clip(raw, 1.0, 5.0) - y
    assert model.eval_loss(x, y) == pytest.approx(np.mean(err * err), rel=1e-12)
    assert model.eval_metrics(x, y)["mse"] == (pytest.approx(float(err @ err)), 12)
    assert model.forward(x, y)[0] > model.eval_loss(x, y)  # training: unclipped, penalised
    unclipped = DLRM(model_cfg(output_bias=4.8), seed=3)
    unclipped.biases[0].weight.data[...] = 1.0
    assert np.array_equal(unclipped.predict(x), raw)


def test_regularisation_config_rules_name_the_values():
    with pytest.raises(ConfigError, match=r"embed_l2 \(-0.1\) and bias_l2 \(0.0\) must not"):
        DLRM.check_config(model_cfg(embed_l2=-0.1), ParallelConfig())
    with pytest.raises(ConfigError, match=r"rating_min \(5.0\) not above rating_max \(1.0\)"):
        DLRM.check_config(model_cfg(rating_min=5.0, rating_max=1.0), ParallelConfig())


@pytest.mark.parametrize("optimizer", [RowWiseAdaGrad, SparseAdam])
def test_sparse_weight_decay_shrinks_only_the_touched_rows_before_the_update(optimizer):
    p = sparse_table()
    q = sparse_table()
    before = p.data.copy()
    rows, g = np.array([1, 4]), np.ones((2, 3))
    decayed = optimizer([("t", p)], lr=0.1, weight_decay=0.5)
    plain = optimizer([("t", q)], lr=0.1)
    for param, opt in ((p, decayed), (q, plain)):
        param.grad.add(rows, g.copy())
        opt.step()
    untouched = [0, 2, 3, 5]
    assert np.array_equal(p.data[untouched], before[untouched])
    # W[r] * (1 - lr wd), then the same update as without decay (the update reads g only)
    assert np.allclose(p.data[rows] - before[rows] * (1 - 0.1 * 0.5),
                       q.data[rows] - before[rows], atol=1e-12)
    assert not np.allclose(p.data[rows], q.data[rows])
