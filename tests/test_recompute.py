"""Activation recomputation (``hpctrain.parallel.recompute``): full, selective and attention give
gradients bitwise equal to keeping every cache, in float32 and float64, through the
model's backward, the local engine's overlapped-all-reduce hook and the pipeline
chunks; they keep what they say; bad names are ConfigErrors before any collective."""

from dataclasses import replace

import numpy as np
import pytest

from hpctrain.config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.models.gpt import GPT
from hpctrain.nn import CausalSelfAttention
from hpctrain.parallel import recompute, stages
from hpctrain.parallel.local import LocalEngine

MODEL = ModelConfig(vocab_size=32, seq_len=16, n_layer=3, n_head=4, d_model=32)


def batch(b=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, MODEL.vocab_size, (b, MODEL.seq_len))
    return x, (3 * x + 1) % MODEL.vocab_size


def grads(model):
    return [(n, p.grad.copy()) for n, p in model.named_parameters()]


def assert_bitwise(a, b):
    assert [n for n, _ in a] == [n for n, _ in b]
    for (name, ga), (_, gb) in zip(a, b, strict=True):
        assert ga.dtype == gb.dtype and np.array_equal(ga, gb), f"{name} differs"
        assert ga.any(), f"{name}: no gradient at all"


def step(model, x, y):
    loss, cache = model.forward(x, y)
    model.backward(cache)
    return loss


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("mode, names", [
    ("full", ()), ("full", ("first", "middle.1", "last")), ("full", ("middle",)),
    ("selective", ()), ("selective", ("middle.0",)),
    ("attention", ()), ("attention", ("middle.1",)),
])
@pytest.mark.parametrize("tie", [False, True])
def test_gradients_are_bitwise_those_without_recomputation(dtype, mode, names, tie):
    m = replace(MODEL, dtype=dtype, tie_embeddings=tie)
    x, y = batch()
    plain, again = GPT(m, seed=3), GPT(m, seed=3)
    assert recompute.apply(again, mode, names)
    assert step(plain, x, y) == step(again, x, y)
    assert step(plain, x, y) == step(again, x, y)  # a second step accumulates alike
    assert_bitwise(grads(plain), grads(again))
    assert [n for n, _ in plain.named_parameters()] == \
        [n for n, _ in again.named_parameters()]  # checkpoints keep their names


def test_full_keeps_the_input_only_and_selective_all_but_the_attention_core():
    x, y = batch()
    full, sel, att = GPT(MODEL, seed=0), GPT(MODEL, seed=0), GPT(MODEL, seed=0)
    recompute.apply(full, "full")
    recompute.apply(sel, "selective")
    recompute.apply(att, "attention")
    _, cache = full.forward(x, y)
    for k, kept in enumerate(cache.blocks):
        assert isinstance(kept, recompute.Kept) and kept.args == ()
        assert kept.x.shape == (4, MODEL.seq_len, MODEL.d_model)
        if k:  # block k's input is block k - 1's output, nothing else holds it
            assert kept.x is not cache.blocks[k - 1].x
    assert not isinstance(cache.head, recompute.Kept)  # the head is not selected
    _, cache = sel.forward(x, y)
    assert all(c.attn.p is None and c.attn.proj is None for c in cache.blocks)
    assert all(c.attn.q is not None for c in cache.blocks)
    _, cache = att.forward(x, y)  # attention: the layer's input only (qkv's cache)
    assert all(c.attn[1:] == (None,) * 5 for c in cache.blocks)
    assert all(c.attn.qkv.x.shape == (4, 16, MODEL.d_model) for c in cache.blocks)
    plain_cache = GPT(MODEL, seed=0).forward(x, y)[1]
    assert plain_cache.blocks[0].attn.p.shape == (4, MODEL.n_head, 16, 16)


def test_the_local_engine_hook_reports_the_same_pieces_with_the_same_gradients():
    """The data-parallel overlap: after_piece passes through the recomputed blocks."""
    x, y = batch(b=8)
    out = {}
    for mode in ("none", "full", "selective", "attention"):
        engine = LocalEngine(GPT(MODEL, seed=1), microbatches=2)
        recompute.apply(engine.model, mode)
        seen = []
        engine.on_grads_ready = lambda params, seen=seen: seen.append(
            [p.grad.copy() for p in params])
        loss = engine.forward_backward(x, y)
        out[mode] = (loss, seen, grads(engine.model))
    for mode in ("full", "selective", "attention"):
        assert out[mode][0] == out["none"][0]
        assert len(out[mode][1]) == len(out["none"][1]) == 2 + 2 * MODEL.n_layer
        for a, b in zip(out[mode][1], out["none"][1], strict=True):
            assert all(np.array_equal(u, v) for u, v in zip(a, b, strict=True))
        assert_bitwise(out[mode][2], out["none"][2])


@pytest.mark.parametrize("mode", ["full", "selective", "attention"])
def test_pipeline_chunks_run_recomputed_pieces_bitwise(mode):
    """The chunks a pipeline stage runs (ModelChunk) call the pieces' own methods."""
    x, y = batch()
    runs = []
    for rc in ("none", mode):
        model = GPT(MODEL, seed=2)
        recompute.apply(model, rc, ("first", "middle", "last"))
        specs = stages.plan(GPT.piece_costs(MODEL), 2, 1, "layers")
        chunks = [stages.ModelChunk(s, model) for s in specs]
        act, c0 = chunks[0].forward(x, None)
        loss, c1 = chunks[1].forward(act, y)
        chunks[0].backward(chunks[1].backward(1.0, c1), c0)
        runs.append((loss, grads(model)))
    assert runs[0][0] == runs[1][0]
    assert_bitwise(runs[0][1], runs[1][1])


def test_recomputed_forward_draws_no_random_numbers(monkeypatch):
    """Nothing to replay: a forward that drew from NumPy's generators would fail here."""
    def refuse(*args, **kwargs):
        raise AssertionError("a forward drew random numbers")

    model = GPT(MODEL, seed=0)  # weights and data drawn before the guard
    x, y = batch()
    recompute.apply(model, "full")
    monkeypatch.setattr(np.random, "default_rng", refuse)
    monkeypatch.setattr(np.random, "random", refuse)
    step(model, x, y)


def config(**train):
    return Config(model=MODEL, train=TrainConfig(batch_size=4, **train))


def test_a_piece_that_does_not_exist_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match=r"'middle\.3'.*'middle\.0' to 'middle\.2'"):
        config(recompute="full", recompute_pieces=("middle.3",)).validate(1)
    with pytest.raises(ConfigError, match=r"'blocks\.0'"):
        config(recompute="selective", recompute_pieces=("blocks.0",)).validate(1)
    with pytest.raises(ConfigError, match=r"recompute \('some'\) must be one of none, full"):
        config(recompute="some").validate(1)
    with pytest.raises(ConfigError, match=r"recompute_pieces \(\['last'\]\) needs recompute"):
        config(recompute_pieces=("last",)).validate(1)
    seg3d = Config(model=ModelConfig(kind="seg3d"), parallel=ParallelConfig(),
                   train=TrainConfig(batch_size=4, recompute="full"))
    with pytest.raises(ConfigError, match=r"declares none: it must be \"none\""):
        seg3d.validate(1)
    assert config(recompute="full", recompute_pieces=("first", "middle.2")).validate(1)


def test_selective_on_pieces_without_attention_is_refused_by_name():
    with pytest.raises(ValueError, match=r"pieces \['first', 'last'\] of the GPT hold no"):
        recompute.apply(GPT(MODEL, seed=0), "selective", ("first", "last"))


def test_select_orders_the_pieces_and_counts_each_once():
    assert recompute.select((), 3) == ["middle.0", "middle.1", "middle.2"]
    assert recompute.select(("last", "middle.1", "middle", "first"), 2) == \
        ["first", "middle.0", "middle.1", "last"]
    assert CausalSelfAttention.recompute_scores is False  # the class default is untouched


def test_the_planner_counts_what_recomputation_keeps_and_makes_again():
    """plan/memory.py against the caches above: selective drops P (b, H, T, T) a block
    and makes one again in backward; full keeps each block's input, which on a later
    pipeline stage is the received activation itself (counted once)."""
    from hpctrain.plan import memory as mem

    b, s = 4, 4
    p_bytes = s * b * MODEL.n_head * MODEL.seq_len ** 2
    y_bytes = s * b * MODEL.seq_len * MODEL.d_model  # the weighted sum, proj's input
    x, y = batch(b)
    cache = GPT(MODEL, seed=0).forward(x, y)[1]
    assert cache.blocks[0].attn.p.nbytes == p_bytes
    assert cache.blocks[0].attn.proj.x.nbytes == y_bytes
    assert mem.kept_block_bytes(MODEL, b, 1, False, "none") - \
        mem.kept_block_bytes(MODEL, b, 1, False, "selective") == p_bytes + y_bytes
    assert mem.recompute_bytes(MODEL, b, 1, False, "selective") == p_bytes + y_bytes
    qkv_bytes = s * b * MODEL.seq_len * 3 * MODEL.d_model
    assert cache.blocks[0].attn.q.base.nbytes == qkv_bytes  # q, k, v: views of one array
    assert mem.kept_block_bytes(MODEL, b, 1, False, "none") - \
        mem.kept_block_bytes(MODEL, b, 1, False, "attention") == p_bytes + y_bytes + qkv_bytes
    assert mem.recompute_bytes(MODEL, b, 1, False, "attention") == \
        p_bytes + y_bytes + qkv_bytes
    assert mem.recompute_bytes(MODEL, b, 1, False, "full") == \
        mem.block_activation_bytes(MODEL, b, 1, False)
    boundary = mem.boundary_bytes(MODEL, b, 1, False)
    assert mem.chunk_activation_bytes(MODEL, b, 1, False, 2, False, False, True, "full") \
        == 2 * boundary
    assert mem.chunk_activation_bytes(MODEL, b, 1, False, 2, False, False, True, "none") \
        == 2 * mem.block_activation_bytes(MODEL, b, 1, False) + boundary


def attention_kept_bytes(layer, x):
    """Bytes of the arrays one attention forward keeps for its backward, each base
    buffer once (``memreport``'s ledger): (without, with) the layer's input x."""
    from hpctrain.memreport import _Ledger

    _, cache = layer.forward(x)
    arrays = [a for a in (cache.q, cache.k, cache.v, cache.p) if a is not None]
    arrays += [] if cache.proj is None else [cache.proj.x]
    core = _Ledger().count(arrays)
    ledger = _Ledger()
    return core, ledger.count([cache.qkv.x]) + ledger.count(arrays)


@pytest.mark.parametrize("d_model, n_head", [(256, 8), (384, 6)])
def test_selective_cuts_attention_activations_to_q_k_v(d_model, n_head):
    """At T = 256, the attention sub-layer's kept bytes with and without selective
    recomputation, counted from the arrays its cache holds. Selective keeps q, k, v
    (3 C a token) and the layer input (C); none adds P (H T) and y = P v (C). So the
    factor is (4 C + H T) / 3 C = (4 + T / D) / 3 on the core, (5 + T / D) / 4 with
    the input: with head size D = 32, 4.0x and 3.25x (>= 3x); with the benchmark
    GPT's D = 64, 2.67x and 2.25x, the most any scheme that keeps q, k and v can
    reach at T = 256 (3x needs T >= 5 D)."""
    b, T = 2, 256
    x = np.random.default_rng(0).standard_normal((b, T, d_model)).astype(np.float32)
    kept = {}
    for selective in (False, True):
        layer = CausalSelfAttention(d_model, n_head, rng=np.random.default_rng(1))
        layer.recompute_scores = selective
        kept[selective] = attention_kept_bytes(layer, x)
    (core0, all0), (core1, all1) = kept[False], kept[True]
    C, H, D = d_model, n_head, d_model // n_head
    assert core1 == 4 * b * T * 3 * C  # q, k, v: one (B, T, 3C) array
    assert core0 == 4 * b * T * (4 * C + H * T)
    assert core0 / core1 == pytest.approx((4 + T / D) / 3)
    assert all0 / all1 == pytest.approx((5 + T / D) / 4)
    if D <= 32:
        assert core0 / core1 >= 3 and all0 / all1 >= 3


@pytest.mark.parametrize("d_model, n_head", [(256, 8), (384, 6), (1024, 16)])
def test_attention_recomputation_cuts_attention_activations_past_3x(d_model, n_head):
    """Attention recomputation keeps only the sub-layer's input x (C a token, which
    qkv's weight gradient reads in every mode); without recomputation the sub-layer
    keeps x, q, k, v, P and y: (5 C + H T) / C = 5 + T / D, 9x at T = 256 and head
    size D = 64 (the benchmark GPT's and bench_largest's), 13x at D = 32. Gradients
    stay bitwise (test_gradients_are_bitwise_those_without_recomputation)."""
    b, T = 1, 256
    x = np.random.default_rng(0).standard_normal((b, T, d_model)).astype(np.float32)
    kept = {}
    for mode in ("none", "attention"):
        layer = CausalSelfAttention(d_model, n_head, rng=np.random.default_rng(1))
        layer.recompute_scores = layer.recompute_qkv = mode == "attention"
        kept[mode] = attention_kept_bytes(layer, x)
    (_, all0), (core1, all1) = kept["none"], kept["attention"]
    C, D = d_model, d_model // n_head
    assert core1 == 0 and all1 == 4 * b * T * C  # the layer's input only
    assert all0 / all1 == pytest.approx(5 + T / D)
    assert all0 / all1 >= 3


@pytest.mark.parametrize("kind, mode, pieces, message", [
    ("cnn", "full", (), r"recompute \('full'\) of pieces \['middle.0', 'middle.1', "
                        r"'middle.2', .*'middle.5'\]: they keep BatchNorm's running "
                        r"statistics, which a second forward would update twice"),
    ("cnn", "full", ("first", "middle.1"), r"of pieces \['middle.1'\]: they keep BatchNorm"),
    ("cnn", "selective", ("last",), r"recompute \('selective'\) recomputes attention, but "
                                    r"pieces \['last'\] of the CNN classifier hold no"),
    ("mlp", "selective", (), r"recompute \('selective'\) recomputes attention, but pieces "
                             r"\['middle.0', 'middle.1'\] of the MLP classifier hold no "
                             r"attention layer"),
    ("mlp", "attention", (), r"of the MLP classifier hold no attention layer"),
    ("gpt", "selective", ("first", "last"), r"pieces \['first', 'last'\] of the GPT hold no"),
])
def test_what_the_built_pieces_would_refuse_is_refused_by_the_config(kind, mode, pieces,
                                                                      message):
    """Before the data is opened and the model built (where recompute.apply refused),
    in its words; what the pieces take still passes."""
    model = {"cnn": ModelConfig(kind="cnn", input_dim=64, channels=(2, 3, 4), n_classes=4),
             "mlp": ModelConfig(kind="mlp", input_dim=8, hidden=(8, 8, 8), n_classes=4),
             "gpt": MODEL}[kind]
    cfg = Config(model=model, parallel=ParallelConfig(pp=2, microbatches=2),
                 train=TrainConfig(batch_size=4, recompute=mode, recompute_pieces=pieces))
    with pytest.raises(ConfigError, match=message):
        cfg.validate(2)
    taken = {"cnn": ("full", ("first", "last")), "mlp": ("full", ()),
             "gpt": ("selective", ("middle.0",))}[kind]
    assert replace(cfg, train=replace(cfg.train, recompute=taken[0],
                                      recompute_pieces=taken[1])).validate(2)
