"""The GPT: gradient checks of the whole model, the separable parts a pipeline runs,
accumulation over microbatches, causality, dtype, determinism, and a quick overfit."""

import numpy as np
import pytest

from hpctrain.config import ModelConfig
from hpctrain.models import GPT, build_model
from hpctrain.nn.gradcheck import check_array, check_parameters
from hpctrain.optim import AdamW

TOL = 1e-6
TINY = dict(n_layer=2, d_model=16, n_head=2, seq_len=8, vocab_size=32)


def tiny(dtype="float64", **kw):
    # init_std 0.3 (not 0.02) so that attention is far from uniform and every gradient
    # is large enough for finite differences to resolve it well below TOL
    return ModelConfig(**{**TINY, "dtype": dtype, "init_std": 0.3, **kw})


def batch(cfg, B=3, seed=1):
    r = np.random.default_rng(seed)
    idx = r.integers(0, cfg.vocab_size, (B, cfg.seq_len))
    return idx, r.integers(0, cfg.vocab_size, (B, cfg.seq_len))


def stages_forward(model, x, targets):
    """Blocks then head from the embedding output x, as a pipeline's later stages run."""
    block_caches = []
    for block in model.blocks:
        x, cache = block.forward(x)
        block_caches.append(cache)
    loss, head_cache = model.head.forward(x, targets)
    return loss, block_caches, head_cache


def stages_backward(model, block_caches, head_cache):
    """The gradient of the loss with respect to the embedding output."""
    dx = model.head.backward(1.0, head_cache)
    for block, cache in zip(reversed(model.blocks), reversed(block_caches), strict=True):
        dx = block.backward(dx, cache)
    return dx


@pytest.mark.parametrize("tie", [False, True])
def test_gpt_gradcheck_every_parameter_and_the_activations(tie):
    cfg = tiny(tie_embeddings=tie)
    model = build_model(cfg, seed=0)
    idx, targets = batch(cfg)
    model.zero_grad()
    loss, cache = model.forward(idx, targets)
    model.backward(cache)

    errors = check_parameters(lambda: model.forward(idx, targets)[0],
                              model.named_parameters(), max_probes=24)
    assert len(errors) == len(model.parameters())
    assert max(errors.values()) < TOL, errors

    # the gradient reaching the embedding output, through all blocks and the head
    x, _ = model.embed.forward(idx)
    dx = stages_backward(model, *stages_forward(model, x, targets)[1:])
    err = check_array(lambda: stages_forward(model, x, targets)[0], x, dx, max_probes=48)
    assert err < TOL


def test_parameter_names_and_tied_embeddings():
    untied, tied = GPT(tiny(), 0), GPT(tiny(tie_embeddings=True), 0)
    names = [n for n, _ in untied.named_parameters()]
    assert names[:2] == ["embed.wte.weight", "embed.wpe.weight"]
    assert "blocks.1.attn.qkv.weight" in names and "blocks.0.mlp.proj.bias" in names
    assert names[-3:] == ["head.ln_f.weight", "head.ln_f.bias", "head.lm_head.weight"]
    assert untied.blocks[0].attn.qkv.weight.shape == (16, 48)
    assert untied.blocks[0].mlp.fc.weight.shape == (16, 64)  # ffn_dim = 4 * d_model
    assert tied.head.lm_head is None and tied.head.wte is tied.embed.wte
    tied_names = [n for n, _ in tied.named_parameters()]
    assert tied_names == [n for n in names if n != "head.lm_head.weight"]
    assert untied.num_parameters() - tied.num_parameters() == 16 * 32


def test_same_seed_same_model_and_float32_rounds_float64():
    a, b, c = GPT(tiny(), 7), GPT(tiny(), 7), GPT(tiny(), 8)
    f32 = GPT(tiny("float32"), 7)
    for (_, pa), (_, pb), (_, pc), (_, p32) in zip(*(m.named_parameters()
                                                     for m in (a, b, c, f32)), strict=True):
        np.testing.assert_array_equal(pa.data, pb.data)
        np.testing.assert_array_equal(p32.data, pa.data.astype(np.float32))
        assert pa.data.ndim == 1 or not np.array_equal(pa.data, pc.data)


def test_init_biases_zero_layernorm_ones_residual_projections_scaled():
    cfg = ModelConfig(n_layer=8, d_model=64, n_head=4, seq_len=16, vocab_size=64)
    model = GPT(cfg, 0)
    block = model.blocks[0]
    assert not block.attn.qkv.bias.data.any() and (block.ln1.weight.data == 1).all()
    assert block.attn.qkv.weight.data.std() == pytest.approx(0.02, rel=0.05)
    assert block.mlp.proj.weight.data.std() == pytest.approx(0.02 / 4.0, rel=0.05)


def test_float32_is_the_default_and_is_kept():
    assert ModelConfig().dtype == "float32"
    cfg = ModelConfig(**TINY)
    model = build_model(cfg, 0)
    idx, targets = batch(cfg)
    loss, cache = model.forward(idx, targets)
    model.backward(cache)
    assert isinstance(loss, float) and cache.head.logits.dtype == np.float32
    assert all(p.data.dtype == p.grad.dtype == np.float32 for p in model.parameters())
    x, _ = model.embed.forward(idx)
    y, block_cache = model.blocks[0].forward(x)
    assert y.dtype == model.blocks[0].backward(y, block_cache).dtype == np.float32
    assert model.head.backward(1.0, model.head.forward(x, targets)[1]).dtype == np.float32


def test_two_half_batches_accumulate_to_one_full_batch():
    cfg = tiny()
    model = GPT(cfg, 0)
    idx, targets = batch(cfg, B=4)
    model.zero_grad()
    full_loss, cache = model.forward(idx, targets)
    model.backward(cache)
    full = [p.grad.copy() for p in model.parameters()]
    model.zero_grad()
    losses = []
    for half in (slice(0, 2), slice(2, 4)):
        loss, cache = model.forward(idx[half], targets[half])
        model.backward(cache, dloss=0.5)  # each half's mean weighs 1/2 of the full mean
        losses.append(loss)
    assert np.mean(losses) == pytest.approx(full_loss, rel=1e-12)
    for p, g in zip(model.parameters(), full, strict=True):
        np.testing.assert_allclose(p.grad, g, rtol=1e-10, atol=1e-14)


def test_parts_run_separately_match_the_whole_model():
    """embed / blocks / head driven one by one, two microbatches in flight at once."""
    cfg = tiny(tie_embeddings=True)
    model = GPT(cfg, 0)
    idx, targets = batch(cfg, B=4)
    model.zero_grad()
    for half in (slice(0, 2), slice(2, 4)):
        _, cache = model.forward(idx[half], targets[half])
        model.backward(cache)
    reference = [p.grad.copy() for p in model.parameters()]

    model.zero_grad()
    in_flight = []
    for half in (slice(0, 2), slice(2, 4)):
        x, embed_cache = model.embed.forward(idx[half])
        in_flight.append((embed_cache, *stages_forward(model, x, targets[half])[1:]))
    for embed_cache, block_caches, head_cache in reversed(in_flight):
        dx = stages_backward(model, block_caches, head_cache)
        assert model.embed.backward(dx, embed_cache) is None
    for p, g in zip(model.parameters(), reference, strict=True):
        np.testing.assert_allclose(p.grad, g, rtol=1e-10, atol=1e-14)


def test_changing_a_future_token_leaves_earlier_logits_unchanged():
    cfg = tiny()
    model = GPT(cfg, 0)
    idx, _ = batch(cfg, B=2)
    changed = idx.copy()
    changed[:, 5] = (changed[:, 5] + 1) % cfg.vocab_size
    before, after = model.logits(idx), model.logits(changed)
    assert before.shape == (2, cfg.seq_len, cfg.vocab_size)
    np.testing.assert_array_equal(before[:, :5], after[:, :5])
    assert not np.allclose(before[:, 5:], after[:, 5:])


def test_logits_match_the_cached_logits_and_shorter_sequences_work():
    cfg = tiny()
    model = GPT(cfg, 0)
    idx, targets = batch(cfg)
    _, cache = model.forward(idx, targets)
    np.testing.assert_allclose(model.logits(idx), cache.head.logits, rtol=1e-12)
    assert model.logits(idx[:, :5]).shape == (3, 5, cfg.vocab_size)
    with pytest.raises(ValueError, match=r"sequence length \(9\) must not exceed seq_len \(8\)"):
        model.logits(np.zeros((1, 9), dtype=np.int64))


def test_tiny_gpt_overfits_one_repeated_batch():
    cfg = ModelConfig(**TINY)  # float32, init_std 0.02: the real defaults
    model = GPT(cfg, 0)
    idx, targets = batch(cfg, B=4)
    opt = AdamW(model.named_parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    first, _ = model.forward(idx, targets)
    for _ in range(50):
        model.zero_grad()
        loss, cache = model.forward(idx, targets)
        model.backward(cache)
        opt.step()
    assert first == pytest.approx(np.log(cfg.vocab_size), rel=0.05)
    assert loss < 0.25 * first, (first, loss)
