"""A DLRM-style rating model (Naumov et al. 2019), built from hpctrain.nn.

    x["dense"] (B, D), x["ids"] (B, K): the columns of the tables in [model] tables order
    z   = relu(... relu(dense @ W_1 + b_1) ...)           (B, d)   bottom MLP, d = embed_dim
    e_k = EmbeddingBag_k(ids[:, cols_k])                  (B, d)   one table per feature
    h   = [z, <v_i, v_j> for i < j]  over v = (z, e_1..e_F)  (B, d + n(n-1)/2), n = F + 1
    o   = relu(... h ...) @ W_out + b_out                 (B, 1)   top MLP
    r   = o + sum_k bias_k[ids of feature k]              (B,)     1-wide bias tables
          (+ sum_{i<j} <v_i, v_j>                                  with fm_output)
    loss = mean_B (r - y)^2                                        MSE on the rating
         + embed_l2 mean_B sum_k |e_k|^2 + bias_l2 mean_B sum_k bias_k^2

The penalties (``embed_l2``, ``bias_l2``, 0 by default) are L2 on what each sample
looks up: a row is penalised once per rating that reads it, so a user with many
ratings is held as firmly as the data behind it allows (the per-rating regularisation
of matrix factorisation, Koren et al. 2009), and only the rows a batch touches get a
gradient. A mean-pooled bag penalises its pooled vector. ``fm_output`` adds the sum
of the pairwise dot products (the interaction's own outputs) to the prediction, as a
factorisation machine does, besides feeding them to the top MLP. Evaluation
(``eval_loss``, ``eval_metrics``) clips the prediction to [rating_min, rating_max]
when they differ (ratings are 1..5: a prediction of 5.4 is no better than 5) and
leaves the penalties out: it is the MSE of the ratings alone.

The bias tables (``bias_features``, e.g. user and item) give each user and item its
own offset from the mean rating, the strongest single signal in MovieLens; the output
bias starts at ``output_bias`` (the mean rating), so the first steps do not spend
themselves climbing from 0 to 3.5.

Initialisation from one ``np.random.default_rng(seed)``, in this order: each table
uniform(-1/sqrt(rows), 1/sqrt(rows)) (DLRM's reference), the bottom and top MLPs
normal(0, sqrt(2 / fan_in)) (He), the output layer normal(0, sqrt(1 / fan_in)); bias
tables and Linear biases zero. ``init_std`` is not used.

The tables are ``self.tables[k]`` (``EmbeddingBag``): a sharded embedding engine swaps
a table for a layer with the same ``forward(ids)`` / ``backward(dy, cache)``.
"""

from __future__ import annotations

import math
from itertools import pairwise
from typing import Any, NamedTuple

import numpy as np

from hpctrain.config import POOLINGS, ConfigError, ModelConfig
from hpctrain.data.format import RATINGS
from hpctrain.models.protocol import Model
from hpctrain.nn import (
    DotInteraction,
    DotInteractionCache,
    EmbeddingBag,
    EmbeddingBagCache,
    Linear,
    LinearCache,
    ReLU,
)
from hpctrain.nn.interaction import pairs


class DLRMCache(NamedTuple):
    bottom: list[tuple[LinearCache, np.ndarray]]  # per layer: its input, its ReLU mask
    tables: list[EmbeddingBagCache]
    inter: DotInteractionCache
    top: list[tuple[LinearCache, np.ndarray]]
    out: LinearCache
    biases: list[EmbeddingBagCache]
    err: np.ndarray  # (B,) prediction - rating
    looked: np.ndarray | None = None  # (B, F, d) the embeddings, with embed_l2
    bias: np.ndarray | None = None  # (B, nb) the biases looked up, with bias_l2


def _mlp_forward(layers: list[Linear], act: ReLU, h: np.ndarray) -> tuple[np.ndarray, list]:
    caches = []
    for layer in layers:
        h, lin = layer.forward(h)
        h, mask = act.forward(h)
        caches.append((lin, mask))
    return h, caches


def _mlp_backward(layers: list[Linear], act: ReLU, dh: np.ndarray, caches: list,
                  need_dx: bool) -> np.ndarray | None:
    for i in reversed(range(len(layers))):
        lin, mask = caches[i]
        dh = layers[i].backward(act.backward(dh, mask), lin, need_dx=need_dx or i > 0)
    return dh


class DLRM(Model):
    """Tables, bottom MLP, dot interaction, top MLP, bias tables; see the module doc.

    Declares its config rules, model FLOPs, ``eval_metrics`` (the squared error's sum,
    for RMSE) and ``feature_layout`` (what the dataset must hold); data parallelism
    only, the tables replicated (``hpctrain.parallel.sparse_data``).
    """

    name = "DLRM"
    data_format = RATINGS
    config_keys = ("tables", "embed_dim", "bottom_mlp", "top_mlp", "dense_features",
                   "bias_features", "output_bias", "embed_l2", "bias_l2", "rating_min",
                   "rating_max", "fm_output")

    def __init__(self, cfg: ModelConfig, seed: int):
        rng = np.random.default_rng(seed)
        dtype = np.dtype(cfg.dtype)
        d = cfg.embed_dim
        self.cfg = cfg
        self.tables = [EmbeddingBag((rng.uniform(-1, 1, (t.rows, d)) / math.sqrt(t.rows))
                                    .astype(dtype), pooling=t.pooling, name=t.name)
                       for t in cfg.tables]
        by_name = {t.name: t for t in cfg.tables}
        self.biases = [EmbeddingBag(np.zeros((by_name[f].rows, 1), dtype),
                                    pooling=by_name[f].pooling, name=f"{f} bias")
                       for f in cfg.bias_features]
        self.act = ReLU()
        bottom = (len(cfg.dense_features), *cfg.bottom_mlp)
        self.bottom = [Linear(a, b, rng=rng, dtype=dtype, std=math.sqrt(2.0 / a))
                       for a, b in pairwise(bottom)]
        top = (d + pairs(len(cfg.tables) + 1), *cfg.top_mlp)
        self.top = [Linear(a, b, rng=rng, dtype=dtype, std=math.sqrt(2.0 / a))
                    for a, b in pairwise(top)]
        self.out = Linear(top[-1], 1, rng=rng, dtype=dtype, std=math.sqrt(1.0 / top[-1]))
        self.out.bias.data[...] = cfg.output_bias
        self.interaction = DotInteraction()
        # the columns of x["ids"] each table (and bias table) reads
        starts = np.cumsum([0] + [t.width for t in cfg.tables])
        self.cols = {t.name: slice(int(a), int(a + t.width))
                     for t, a in zip(cfg.tables, starts, strict=False)}
        self.n_ids = int(starts[-1])

    # -----------------------------------------------------------------------------

    def _inputs(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """x structured (B,) -> dense (B, D) in the model's dtype, ids (B, K) int64."""
        names = x.dtype.names or ()
        if "dense" not in names or "ids" not in names:
            raise ValueError(f"the DLRM takes a structured batch with fields dense and ids; "
                             f"got dtype {x.dtype}")
        dense, ids = x["dense"].reshape(len(x), -1), x["ids"].reshape(len(x), -1)
        D = len(self.cfg.dense_features)
        if dense.shape[1] != D or ids.shape[1] != self.n_ids:
            raise ValueError(f"the batch has {dense.shape[1]} dense values and {ids.shape[1]} "
                             f"ids per sample; the model's dense_features take {D} and its "
                             f"tables {self.n_ids} (the sum of their widths)")
        return dense.astype(self.out.weight.data.dtype, copy=False), ids.astype(np.int64)

    def predict_cached(self, x: np.ndarray) -> tuple[np.ndarray, tuple]:
        """x structured (B,) -> predicted ratings (B,) and the caches of every layer."""
        dense, ids = self._inputs(x)
        z, bottom = _mlp_forward(self.bottom, self.act, dense)  # (B, d)
        looked = [t.forward(ids[:, self.cols[t.name]]) for t in self.tables]
        e = np.stack([y for y, _ in looked], axis=1)  # (B, F, d)
        h, inter = self.interaction.forward(z, e)  # (B, d + n(n-1)/2)
        fm = h[:, z.shape[1]:].sum(axis=1) if self.cfg.fm_output else 0.0  # (B,)
        h, top = _mlp_forward(self.top, self.act, h)
        o, out = self.out.forward(h)  # (B, 1)
        r = o[:, 0] + fm
        biases, bias = [], []
        for name, table in zip(self.cfg.bias_features, self.biases, strict=True):
            b, cache = table.forward(ids[:, self.cols[name]])  # (B, 1)
            r = r + b[:, 0]
            biases.append(cache)
            bias.append(b)
        bias = np.concatenate(bias, axis=1) if bias else np.zeros((len(r), 0), r.dtype)
        return r, (bottom, [c for _, c in looked], inter, top, out, biases, e, bias)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """x structured (B,) -> ratings (B,), clipped to [rating_min, rating_max] when
        they differ."""
        r = self.predict_cached(x)[0]
        lo, hi = self.cfg.rating_min, self.cfg.rating_max
        return np.clip(r, lo, hi) if lo < hi else r

    def forward(self, x: np.ndarray, targets: np.ndarray) -> tuple[float, DLRMCache]:
        # x structured (B,), targets (B,) ratings -> loss: the MSE and the penalties
        r, (*caches, e, bias) = self.predict_cached(x)
        err = r - targets.astype(r.dtype, copy=False)  # (B,)
        loss = float(np.mean(err * err))
        m = self.cfg
        if m.embed_l2:
            loss += m.embed_l2 * float(np.sum(e * e)) / len(r)
        if m.bias_l2:
            loss += m.bias_l2 * float(np.sum(bias * bias)) / len(r)
        return loss, DLRMCache(*caches, err, e if m.embed_l2 else None,
                               bias if m.bias_l2 else None)

    def eval_loss(self, x: np.ndarray, targets: np.ndarray) -> float:
        """The MSE of the (clipped) prediction, without the penalties."""
        err = self.predict(x) - targets
        return float(np.mean(err * err))

    def backward(self, cache: DLRMCache, dloss: float = 1.0) -> None:
        """Add the gradients of ``dloss * loss`` into every parameter's ``.grad`` (the
        tables': their sparse rows)."""
        dr = (2.0 * dloss / len(cache.err)) * cache.err  # (B,)
        dr = dr[:, None]  # (B, 1)
        penalty = 2.0 * dloss / len(cache.err)  # d(l2 mean_B |v|^2) / dv = penalty l2 v
        for k, (table, c) in enumerate(zip(self.biases, cache.biases, strict=True)):
            db = dr if cache.bias is None else \
                dr + penalty * self.cfg.bias_l2 * cache.bias[:, k:k + 1]
            table.backward(db, c)
        dh = self.out.backward(dr, cache.out)  # (B, top[-1])
        dh = _mlp_backward(self.top, self.act, dh, cache.top, need_dx=True)
        if self.cfg.fm_output:
            dh[:, self.cfg.embed_dim:] += dr  # the dot products feed r directly too
        dz, de = self.interaction.backward(dh, cache.inter)  # (B, d), (B, F, d)
        if cache.looked is not None:
            de = de + (penalty * self.cfg.embed_l2) * cache.looked
        for k, (table, c) in enumerate(zip(self.tables, cache.tables, strict=True)):
            table.backward(de[:, k], c)
        _mlp_backward(self.bottom, self.act, dz, cache.bottom, need_dx=False)

    # -----------------------------------------------------------------------------
    # what the engine reads (hpctrain.models.protocol)

    def feature_layout(self_or_cfg: Any) -> tuple[list[str], list[tuple[str, int, int]]]:
        """``(dense names, [(name, rows, width)])`` the dataset must hold, in column
        order: of a built model (``model.feature_layout()``) or of a config
        (``DLRM.feature_layout(model_cfg)``, what ``hpctrain.data.contents`` calls)."""
        m = self_or_cfg.cfg if isinstance(self_or_cfg, DLRM) else self_or_cfg
        return list(m.dense_features), [(t.name, t.rows, t.width) for t in m.tables]

    @classmethod
    def check_config(cls, m: ModelConfig, par) -> None:
        if not m.tables:
            raise ConfigError("the DLRM needs [model] tables (an array of inline tables "
                              "{name, rows, width, pooling}), one per sparse feature")
        names = [t.name for t in m.tables]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"table names ({names}) must be distinct: {twice} repeat")
        for t in m.tables:
            if t.rows < 1 or t.width < 1 or t.pooling not in POOLINGS:
                raise ConfigError(f"table {t.name!r}: rows ({t.rows}) and width ({t.width}) "
                                  f"must be at least 1 and pooling ({t.pooling!r}) one of "
                                  f"{', '.join(POOLINGS)}")
        unknown = [f for f in m.bias_features if f not in names]
        if unknown:
            raise ConfigError(f"bias_features {unknown} are not tables; the tables: {names}")
        if not m.dense_features:
            raise ConfigError("the DLRM's bottom MLP needs at least one dense feature: "
                              "dense_features is empty")
        if not (m.embed_dim >= 1 and m.bottom_mlp and m.bottom_mlp[-1] == m.embed_dim):
            raise ConfigError(f"bottom_mlp ({list(m.bottom_mlp)}) must end with embed_dim "
                              f"({m.embed_dim}), at least 1: its output meets the embeddings "
                              f"in dot products")
        if not all(w >= 1 for w in (*m.bottom_mlp, *m.top_mlp)):
            raise ConfigError(f"bottom_mlp ({list(m.bottom_mlp)}) and top_mlp "
                              f"({list(m.top_mlp)}) widths must be positive")
        if m.embed_l2 < 0 or m.bias_l2 < 0 or m.rating_min > m.rating_max:
            raise ConfigError(f"embed_l2 ({m.embed_l2}) and bias_l2 ({m.bias_l2}) must not be "
                              f"negative, rating_min ({m.rating_min}) not above rating_max "
                              f"({m.rating_max})")
        broken = [rule for rule, ok in ((f"zero ({par.zero}) must be 0", par.zero == 0),
                                        (f"averaging ({par.averaging!r}) must be 'sync'",
                                         par.averaging == "sync"),
                                        (f"shares ({par.shares!r}) must be 'equal'",
                                         par.shares == "equal")) if not ok]
        if broken:
            raise ConfigError(f"the DLRM's tables are replicated with their sparse gradients "
                              f"gathered each step: {', '.join(broken)}")

    @classmethod
    def model_flops(cls, m: ModelConfig, samples: int) -> float:
        """``3 samples (sum 2 n_in n_out over the MLPs + 2 n^2 d)``: the GEMMs and the
        interaction, forward once and backward twice; lookups are memory, not FLOPs."""
        n, d = len(m.tables) + 1, m.embed_dim
        bottom = (len(m.dense_features), *m.bottom_mlp)
        top = (d + pairs(n), *m.top_mlp, 1)
        gemm = sum(2 * a * b for a, b in pairwise(bottom)) + sum(
            2 * a * b for a, b in pairwise(top))
        return 3.0 * samples * (gemm + 2 * n * n * d)

    def eval_metrics(self, x: np.ndarray, y: np.ndarray) -> dict[str, tuple[float, int]]:
        """``mse``: (sum of squared errors, ratings), summed over the data group; the
        validation RMSE is the square root of ``val_mse``."""
        err = self.predict(x) - y  # clipped to [rating_min, rating_max]
        return {"mse": (float(np.dot(err, err)), len(y))}
