"""A decoder-only, pre-LayerNorm GPT (as in GPT-2 / nanoGPT), built from hpctrain.nn.

    x = wte[idx] + wpe[0..T-1]                    embed           (B, T, C)
    x = x + attn(ln1(x));  x = x + mlp(ln2(x))    blocks[i]       (B, T, C)
    loss = cross_entropy(ln_f(x) @ W_lm, targets) head            (B, T, V)

The model is three kinds of separable part, ``embed``, ``blocks`` (a list) and ``head``,
each with ``forward -> (y, cache)`` and ``backward(dy, cache) -> dx``, so a pipeline
stage can run the embedding, a range of blocks, or the head on its own: they are its
``pipeline_pieces`` (``hpctrain.models.protocol``). With
``tie_embeddings`` the head multiplies by ``wte.weight.T`` instead of owning a
``lm_head``, and its gradient is added into the token embedding.

Initialisation: one ``np.random.default_rng(seed)`` consumed in construction order;
weights normal(0, init_std), the two residual projections of each block normal(0,
init_std / sqrt(2 n_layer)) as in GPT-2, biases zero, LayerNorm weights one. The
constructor hands each piece to ``on_piece`` as soon as it is built (ZeRO 3 shards it
there, so the whole model is never held at once); the draws are the same either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from hpctrain.config import ConfigError, ModelConfig
from hpctrain.data.format import TOKENS
from hpctrain.models.protocol import Model, Pieces, TensorPlan, aux_rng
from hpctrain.nn import (
    GELU,
    AttentionCache,
    CausalSelfAttention,
    CrossEntropyCache,
    Embedding,
    EmbeddingCache,
    GELUCache,
    LayerNorm,
    LayerNormCache,
    Linear,
    LinearCache,
    Module,
    Parameter,
    cross_entropy,
    cross_entropy_backward,
)

# ---------------------------------------------------------------------------------
# embed: token plus position embedding


class EmbedCache(NamedTuple):
    wte: EmbeddingCache
    wpe: EmbeddingCache


class Embed(Module):
    """``x[b, t] = wte[idx[b, t]] + wpe[t]``; backward adds into both tables."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, *,
                 rng: np.random.Generator, dtype, std: float):
        self.wte = Embedding(vocab_size, d_model, rng=rng, dtype=dtype, std=std)
        self.wpe = Embedding(seq_len, d_model, rng=rng, dtype=dtype, std=std)

    def forward(self, idx: np.ndarray) -> tuple[np.ndarray, EmbedCache]:
        # idx (B, T) int -> x (B, T, C)
        T, max_T = idx.shape[1], self.wpe.weight.shape[0]
        if T > max_T:
            raise ValueError(f"sequence length ({T}) must not exceed seq_len ({max_T})")
        x, wte_cache = self.wte.forward(idx)  # (B, T, C), a fresh array
        pos, wpe_cache = self.wpe.forward(np.arange(T))  # (T, C)
        x += pos
        return x, EmbedCache(wte_cache, wpe_cache)

    def backward(self, dx: np.ndarray, cache: EmbedCache) -> None:
        # dx (B, T, C); the input is integer, so there is nothing to return
        self.wte.backward(dx, cache.wte)
        self.wpe.backward(dx.sum(axis=0), cache.wpe)  # (T, C): positions are shared over B
        return None


def _nothing() -> None:
    """The default ``after_half`` / ``after_piece``: no one is waiting for gradients."""


# ---------------------------------------------------------------------------------
# blocks


class FeedForwardCache(NamedTuple):
    fc: LinearCache
    gelu: GELUCache
    proj: LinearCache


class FeedForward(Module):
    """``y = gelu(x @ W_fc + b_fc) @ W_proj + b_proj``, width C -> d_ff -> C."""

    def __init__(self, d_model: int, d_ff: int, *, rng: np.random.Generator, dtype,
                 std: float, proj_std: float):
        self.fc = Linear(d_model, d_ff, rng=rng, dtype=dtype, std=std)
        self.gelu = GELU()
        self.proj = Linear(d_ff, d_model, rng=rng, dtype=dtype, std=proj_std)

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, FeedForwardCache]:
        # x (B, T, C) -> y (B, T, C)
        # fc's bias is added by GELU's pass over (B, T, d_ff), not by a pass of its own
        h, fc = self.fc.forward(x, add_bias=False)  # (B, T, d_ff), the bare product
        h, gelu = self.gelu.forward(h, None if self.fc.bias is None else self.fc.bias.data)
        y, proj = self.proj.forward(h)  # (B, T, C)
        return y, FeedForwardCache(fc, gelu, proj)

    def backward(self, dy: np.ndarray, cache: FeedForwardCache) -> np.ndarray:
        # dy (B, T, C) -> dx (B, T, C)
        dh = self.proj.backward(dy, cache.proj)  # (B, T, d_ff)
        dh = self.gelu.backward(dh, cache.gelu)  # (B, T, d_ff)
        return self.fc.backward(dh, cache.fc)  # (B, T, C)


class BlockCache(NamedTuple):
    ln1: LayerNormCache
    attn: AttentionCache
    ln2: LayerNormCache
    mlp: FeedForwardCache


class Block(Module):
    """``x = x + attn(ln1(x))``, then ``x = x + mlp(ln2(x))``.

    The residual adds are written inline (in place, on the branch's fresh output);
    in backward the gradient of each sum goes unchanged to both the skip path and the
    branch, as in ``nn.Residual``.
    """

    def __init__(self, d_model: int, n_head: int, d_ff: int, *, rng: np.random.Generator,
                 dtype, std: float, proj_std: float):
        self.ln1 = LayerNorm(d_model, dtype=dtype)
        self.attn = CausalSelfAttention(d_model, n_head, rng=rng, dtype=dtype, std=std,
                                        proj_std=proj_std)
        self.ln2 = LayerNorm(d_model, dtype=dtype)
        self.mlp = FeedForward(d_model, d_ff, rng=rng, dtype=dtype, std=std,
                               proj_std=proj_std)

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, BlockCache]:
        # x (B, T, C) -> y (B, T, C); the input x is not modified
        h, ln1 = self.ln1.forward(x)
        h, attn = self.attn.forward(h)  # (B, T, C)
        h += x
        x = h
        h, ln2 = self.ln2.forward(x)
        h, mlp = self.mlp.forward(h)  # (B, T, C)
        h += x
        return h, BlockCache(ln1, attn, ln2, mlp)

    def backward(self, dy: np.ndarray, cache: BlockCache,
                 after_half: Callable[[], None] = _nothing) -> np.ndarray:
        # dy (B, T, C) -> dx (B, T, C); after_half() runs once the (mlp, ln2) gradients
        # are complete, then once the (attn, ln1) ones are
        # each LayerNorm's backward adds the residual's skip path in its own pass
        dh = self.ln2.backward(self.mlp.backward(dy, cache.mlp), cache.ln2, skip=dy)
        after_half()
        dx = self.ln1.backward(self.attn.backward(dh, cache.attn), cache.ln1, skip=dh)
        after_half()
        return dx

    def backward_halves(self) -> list[list[Parameter]]:
        """The parameters of each half, in the order ``backward`` finishes them."""
        return [self.mlp.parameters() + self.ln2.parameters(),
                self.attn.parameters() + self.ln1.parameters()]


# ---------------------------------------------------------------------------------
# head: final LayerNorm, output projection, loss


class HeadCache(NamedTuple):
    ln_f: LayerNormCache
    lm: LinearCache  # lm_head's cache; with tied embeddings, the projection's input
    ce: CrossEntropyCache  # holds the logits, (B T, V)

    @property
    def logits(self) -> np.ndarray:
        """(B, T, V)"""
        return self.ce.logits.reshape(*self.ln_f.xhat.shape[:-1], -1)


class Head(Module):
    """``logits = ln_f(x) @ W`` with ``W = lm_head.weight (C, V)``, or ``wte.weight.T``
    when the embeddings are tied (then ``lm_head`` is None and ``wte`` is the model's
    token Embedding, so its gradient gets both contributions);
    ``loss = cross_entropy(logits, targets)``.
    """

    def __init__(self, d_model: int, vocab_size: int, *, rng: np.random.Generator, dtype,
                 std: float, tied: Embedding | None = None):
        self.ln_f = LayerNorm(d_model, dtype=dtype)
        self.lm_head = None
        if tied is None:
            self.lm_head = Linear(d_model, vocab_size, bias=False, rng=rng, dtype=dtype,
                                  std=std)
        self.wte = tied

    def _project(self, h: np.ndarray) -> tuple[np.ndarray, LinearCache]:
        # h (B, T, C) -> logits (B, T, V)
        if self.lm_head is not None:
            return self.lm_head.forward(h)
        logits = h.reshape(-1, h.shape[-1]) @ self.wte.weight.data.T  # (B T, V)
        return logits.reshape(*h.shape[:-1], -1), LinearCache(h)

    def logits(self, x: np.ndarray) -> np.ndarray:
        # x (B, T, C) -> logits (B, T, V)
        return self._project(self.ln_f.forward(x)[0])[0]

    def forward(self, x: np.ndarray, targets: np.ndarray) -> tuple[float, HeadCache]:
        # x (B, T, C), targets (B, T) int -> loss, mean over B T
        h, ln_f = self.ln_f.forward(x)  # (B, T, C)
        logits, lm = self._project(h)  # (B, T, V)
        loss, ce = cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return loss, HeadCache(ln_f, lm, ce)

    def backward(self, dloss: float, cache: HeadCache) -> np.ndarray:
        # dloss scalar -> dx (B, T, C)
        shape = cache.ln_f.xhat.shape  # (B, T, C)
        dlogits = cross_entropy_backward(dloss, cache.ce)  # (B T, V)
        if self.lm_head is not None:
            dh = self.lm_head.backward(dlogits.reshape(*shape[:-1], -1), cache.lm)
        else:
            h = cache.lm.x.reshape(-1, shape[-1])  # (B T, C)
            self.wte.weight.add_product(dlogits.T, h)  # += dlogits^T h (V, C)
            dh = (dlogits @ self.wte.weight.data).reshape(shape)  # (B, T, C)
        return self.ln_f.backward(dh, cache.ln_f)


# ---------------------------------------------------------------------------------
# the whole model


class GPTCache(NamedTuple):
    embed: EmbedCache
    blocks: list[BlockCache]
    head: HeadCache


class GPT(Model):
    """The full model; ``forward`` and ``backward`` just chain embed, blocks and head.

    Declares (``hpctrain.models.protocol``): pipeline pieces embed / blocks / head, their
    parameter counts as costs, the tensor-parallel plan of ``tensor_parallel.py``, the
    backward pieces of the overlapped all-reduce, and its model FLOPs.
    """

    name = "GPT"
    data_format = TOKENS
    config_keys = ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "d_ff",
                   "tie_embeddings")

    builds_by_piece = True
    splits_batch = True  # loss a mean over (B, T); no state but the gradients
    has_attention = True  # every block (recompute "selective", "attention")

    def __init__(self, cfg: ModelConfig, seed: int,
                 on_piece: Callable[[Module], None] = lambda piece: None):
        """``on_piece(piece)``: after each pipeline piece is built (embed, each block,
        head), before the next is drawn (``protocol.Model.builds_by_piece``)."""
        rng = np.random.default_rng(seed)
        dtype = np.dtype(cfg.dtype)
        std = cfg.init_std
        proj_std = std / math.sqrt(2 * cfg.n_layer)  # GPT-2: residual projections
        self.cfg = cfg
        self.embed = Embed(cfg.vocab_size, cfg.seq_len, cfg.d_model, rng=rng, dtype=dtype,
                           std=std)
        on_piece(self.embed)
        self.blocks = []
        for _ in range(cfg.n_layer):
            self.blocks.append(Block(cfg.d_model, cfg.n_head, cfg.ffn_dim, rng=rng,
                                     dtype=dtype, std=std, proj_std=proj_std))
            on_piece(self.blocks[-1])
        # with tied embeddings the head holds the token Embedding, never reading its data
        self.head = Head(cfg.d_model, cfg.vocab_size, rng=rng, dtype=dtype, std=std,
                         tied=self.embed.wte if cfg.tie_embeddings else None)
        on_piece(self.head)

    def forward(self, idx: np.ndarray, targets: np.ndarray) -> tuple[float, GPTCache]:
        # idx (B, T) int, targets (B, T) int -> loss, mean over B T
        x, embed = self.embed.forward(idx)  # (B, T, C)
        blocks = []
        for block in self.blocks:
            x, cache = block.forward(x)
            blocks.append(cache)
        loss, head = self.head.forward(x, targets)
        return loss, GPTCache(embed, blocks, head)

    def backward(self, cache: GPTCache, dloss: float = 1.0,
                 after_piece: Callable[[], None] = _nothing) -> None:
        """Add the gradients of ``dloss * loss`` into every parameter's ``.grad``.

        ``after_piece()`` runs after each piece of ``backward_pieces()``, in that
        order: a data-parallel caller sends those gradients while the rest runs.
        """
        dx = self.head.backward(dloss, cache.head)  # (B, T, C)
        after_piece()
        for block, block_cache in zip(reversed(self.blocks), reversed(cache.blocks),
                                      strict=True):
            dx = block.backward(dx, block_cache, after_half=after_piece)
        self.embed.backward(dx, cache.embed)
        after_piece()

    def backward_pieces(self) -> list[list[Parameter]]:
        """The parameters of each piece ``backward`` finishes, in backward order: the
        head; per block from the last, (mlp, ln2) then (attn, ln1); the embedding. A
        shared parameter (the tied token table) appears in every piece using it."""
        pieces = [self.head.parameters()]
        for block in reversed(self.blocks):
            pieces += block.backward_halves()
        return pieces + [self.embed.parameters()]

    def logits(self, idx: np.ndarray) -> np.ndarray:
        # idx (B, T) int -> logits (B, T, V)
        x, _ = self.embed.forward(idx)
        for block in self.blocks:
            x, _ = block.forward(x)
        return self.head.logits(x)

    # -----------------------------------------------------------------------------
    # what the engine reads (hpctrain.models.protocol)

    @classmethod
    def check_config(cls, m: ModelConfig, par) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            value = getattr(m, name)
            _require(value >= 1, f"{name} ({value}) must be at least 1")
        _require(m.d_ff >= 0, f"d_ff ({m.d_ff}) must be at least 1, or 0 for 4 * d_model")
        _require(m.d_model % m.n_head == 0,
                 f"n_head ({m.n_head}) must divide d_model ({m.d_model})")
        _require(m.n_head % par.tp == 0, f"tp ({par.tp}) must divide n_head ({m.n_head})")
        _require(m.ffn_dim % par.tp == 0,
                 f"tp ({par.tp}) must divide the MLP width d_ff ({m.ffn_dim})")
        _require(m.vocab_size % par.tp == 0,
                 f"tp ({par.tp}) must divide vocab_size ({m.vocab_size})")
        if par.sequence_parallel:
            _require(m.seq_len % par.tp == 0,
                     f"sequence parallelism needs tp ({par.tp}) to divide seq_len ({m.seq_len})")
        chunks = par.pp * par.virtual_stages
        _require(chunks <= m.n_layer,
                 f"pp * virtual_stages ({par.pp} * {par.virtual_stages} = {chunks}) must not "
                 f"exceed n_layer ({m.n_layer}): every model chunk needs a layer")

    @classmethod
    def model_flops(cls, m: ModelConfig, samples: int) -> float:
        """FLOPs of one training step (forward + backward) over ``samples`` sequences of
        ``T = seq_len``: the matrix products, forward ``2 m n k`` each, backward twice::

            per token and layer, forward:  2 (3 C^2 + C^2 + 2 C F)    qkv, proj, fc, fc-proj
                                           + 2 (2 T C)                 S = q k^T and P v
            per token, head:               2 C V

        Attention counts the whole ``T x T`` products, the masked half included,
        because the batched products compute them.
        """
        C, F, T, V = m.d_model, m.ffn_dim, m.seq_len, m.vocab_size
        per_token_layer = 2 * (3 * C * C + C * C + 2 * C * F) + 2 * (2 * T * C)
        forward = samples * T * (m.n_layer * per_token_layer + 2 * C * V)
        return 3.0 * forward

    @classmethod
    def sample_len(cls, m: ModelConfig) -> int:
        return m.seq_len

    @classmethod
    def piece_costs(cls, m: ModelConfig) -> Pieces[float]:
        """Parameters of the embedding, of each block, of the head (with tied embeddings
        the last stage holds a copy of the token table: it is counted there too)."""
        c, f = m.d_model, m.ffn_dim
        block = 2 * 2 * c + (c * 3 * c + 3 * c) + (c * c + c) + (c * f + f) + (f * c + c)
        embed = m.vocab_size * m.d_model + m.seq_len * m.d_model  # wte + wpe
        head = 2 * m.d_model + m.d_model * m.vocab_size  # ln_f + lm_head (or the tied copy)
        return Pieces(float(embed), [float(block)] * m.n_layer, float(head))

    def pipeline_pieces(self) -> Pieces[Module]:
        return Pieces(self.embed, self.blocks, self.head)

    @classmethod
    def has_aux_heads(cls, m: ModelConfig) -> bool:
        return True

    def aux_head(self, k: int, seed: int) -> Head:
        """Local losses: a LayerNorm and a Linear to the vocabulary of its own (never
        tied) on block ``k``'s output (B, T, C), next-token cross-entropy."""
        c = self.cfg
        return Head(c.d_model, c.vocab_size, rng=aux_rng(seed, k), dtype=np.dtype(c.dtype),
                    std=c.init_std)

    @classmethod
    def activation_shape(cls, m: ModelConfig, x_shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*x_shape, m.d_model)  # (B, T) -> (B, T, C)

    @classmethod
    def tensor_plan(cls, sequence_parallel: bool) -> TensorPlan:
        from hpctrain.models.gpt import tensor_parallel  # only when tp > 1: it loads MPI

        return tensor_parallel.tensor_plan(sequence_parallel)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
