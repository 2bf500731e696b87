"""The GPT under tensor parallelism: its plan, written as data, and the sharded parts
it needs beyond the generic layers of ``hpctrain.parallel.tensor``.

``GPT.tensor_plan`` returns ``tensor_plan(sequence_parallel)``, a ``TensorPlan``
(``hpctrain.models.protocol``). The plan names, in order, each module to replace and
the style to replace it with; ``STYLES`` maps the GPT's own styles to the function
that builds the sharded module from the full one (the generic linear and embedding
styles are ``hpctrain.parallel.tensor.STYLES``). Plain tensor parallelism
(``TENSOR_PLAN``) splits the attention heads (qkv column-parallel head by head, the
output projection row-parallel), the MLP (fc column-, proj row-parallel) and the
vocabulary (embedding rows, output columns, and a cross-entropy that never gathers
the logits). LayerNorm, the position embedding and
the row-parallel biases are replicated.

Sequence parallelism (``SEQUENCE_PLAN``) also splits the residual stream along the
sequence: the embedding reduce-scatters where it all-reduced, LayerNorm runs on T/tp
tokens (its gradients then summed over tp), and each region of split features
all-gathers its input and reduce-scatters its output. The attention core reads T
from its input, so there the gather and reduce-scatter sit around the core, whose
linears run without communication of their own.

Also here: the divisibility rules, the per-step communication volume and the
activation memory sequence parallelism saves, as formulas the tests check.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from hpctrain.config import ConfigError, ModelConfig
from hpctrain.models.gpt.model import Embed, EmbedCache, Head
from hpctrain.models.protocol import TensorPlan
from hpctrain.nn import CausalSelfAttention, EmbeddingCache, LayerNorm, LayerNormCache, LinearCache
from hpctrain.parallel.collectives import all_gather, all_reduce
from hpctrain.parallel.tensor import (
    ColumnParallelLinear,
    CopyToTensorRegion,
    GatherFromSequenceRegion,
    NoCommunication,
    ScatterToSequenceRegion,
    VocabParallelEmbedding,
    gradients_summed_over,
)

# (path pattern, style), applied in order; `*` matches every block
TENSOR_PLAN = (
    ("embed.wte", "vocab"),  # rows split by token id; all-reduce of the lookup
    ("blocks.*.attn", "local-heads"),  # n_head -> n_head / tp
    ("blocks.*.attn.qkv", "column-heads"),  # each of [q | k | v] split by heads; f
    ("blocks.*.attn.proj", "row"),  # g
    ("blocks.*.mlp.fc", "column"),  # f
    ("blocks.*.mlp.proj", "row"),  # g
    ("head", "vocab-parallel-loss"),  # f; output split by token id; parallel loss
)

SEQUENCE_PLAN = (
    ("embed", "sequence-embed"),  # reduce-scatter of the lookup; this rank's positions
    ("embed.wte", "vocab-local"),
    ("blocks.*.ln1", "sequence-norm"),  # T/tp tokens; gradients summed over tp
    ("blocks.*.attn", "sequence-heads"),  # all-gather before, reduce-scatter after
    ("blocks.*.attn.qkv", "column-heads-local"),
    ("blocks.*.attn.proj", "row-local"),
    ("blocks.*.ln2", "sequence-norm"),
    ("blocks.*.mlp.fc", "column-gather"),  # all-gather along T at the input
    ("blocks.*.mlp.proj", "row-scatter"),  # reduce-scatter along T at the output
    ("head", "sequence-vocab-parallel-loss"),  # all-gather along T at the input
    ("head.ln_f", "sequence-norm"),
)


def plan(sequence_parallel: bool) -> tuple[tuple[str, str], ...]:
    return SEQUENCE_PLAN if sequence_parallel else TENSOR_PLAN


def tensor_plan(sequence_parallel: bool) -> TensorPlan:
    """The GPT's plan, its styles, its divisibility rules and its extra metrics."""
    return TensorPlan(plan(sequence_parallel), STYLES, check_divisible,
                      _sp_metrics if sequence_parallel else _no_metrics)


def _sp_metrics(m: ModelConfig, microbatch_shape: tuple[int, int], tp: int) -> dict:
    return {"sp_activation_bytes_saved": sequence_parallel_saving(m, *microbatch_shape, tp)}


def _no_metrics(m: ModelConfig, microbatch_shape: tuple[int, int], tp: int) -> dict:
    return {}


def check_divisible(m: ModelConfig, tp: int, sequence_parallel: bool) -> None:
    """Refuse, naming the values, a tp that does not divide what it splits."""
    rules = [("n_head", m.n_head), ("d_model", m.d_model), ("the MLP width d_ff", m.ffn_dim),
             ("vocab_size", m.vocab_size)]
    if sequence_parallel:
        rules.append(("seq_len under sequence parallelism", m.seq_len))
    for name, value in rules:
        if value % tp:
            raise ConfigError(f"tp ({tp}) must divide {name} ({value})")


# ---------------------------------------------------------------------------------
# sequence-parallel LayerNorm, attention and embedding


class SequenceParallelLayerNorm(LayerNorm):
    """LayerNorm of this rank's ``(B, T/tp, C)`` tokens.

    forward: as LayerNorm, no communication. backward: as LayerNorm; the weight and
    bias gradients come from this rank's tokens only, so they are summed over the
    tensor group (one all-reduce of 2C) and stay whole and the same on every rank.
    """

    def __init__(self, serial: LayerNorm, comm: Any):
        self.eps = serial.eps
        self.weight = serial.weight
        self.bias = serial.bias
        self.comm = comm

    def backward(self, dy: np.ndarray, cache: LayerNormCache,
                 skip: np.ndarray | None = None) -> np.ndarray:
        with gradients_summed_over(self.comm, [self.weight, self.bias]):
            return super().backward(dy, cache, skip)


class SequenceParallelAttention(CausalSelfAttention):
    """Attention of this rank's heads inside a sequence-parallel block.

        forward:  x = all-gather_T(x_r)       (B, T/tp, C) -> (B, T, C)
                  y = attention(x)            local heads; qkv, proj without communication
                  out_r = reduce-scatter_T(y) (B, T, C) partial sums -> (B, T/tp, C)
        backward: the conjugates: all-gather of dout, reduce-scatter of dx.
    """

    def __init__(self, serial: CausalSelfAttention, comm: Any):
        # the inherited core reads T from its input, so the collectives wrap it here
        self.n_head = serial.n_head // comm.Get_size()
        self.head_dim = serial.head_dim
        self.qkv = serial.qkv
        self.proj = serial.proj
        self.gather = GatherFromSequenceRegion(comm)
        self.scatter = ScatterToSequenceRegion(comm)

    def forward(self, x: np.ndarray):
        # x (B, T/tp, C) -> out (B, T/tp, C)
        out, cache = super().forward(self.gather.forward(x))  # (B, T, C), partial over tp
        return self.scatter.forward(out), cache

    def backward(self, dout: np.ndarray, cache) -> np.ndarray:
        # dout (B, T/tp, C) -> dx (B, T/tp, C)
        dx = super().backward(self.scatter.backward(dout), cache)  # (B, T, C), partial
        return self.gather.backward(dx)


class SequenceParallelEmbed(Embed):
    """``x_r = reduce-scatter_T(sum_r wte_r[idx]) + wpe[this rank's positions]``.

    forward:  the vocabulary-parallel lookup (partial: this rank's tokens only),
              reduce-scattered along T, (B, T/tp, C); then the positions
              ``[r T/tp, (r + 1) T/tp)`` of this rank.
    backward: all-gather of dx to (B, T, C); the token rows of this rank's slice, and
              every position from the whole dx, so wpe's gradient is whole everywhere.
    """

    def __init__(self, serial: Embed, comm: Any):
        self.wte = serial.wte
        self.wpe = serial.wpe
        self.scatter = ScatterToSequenceRegion(comm)
        self.tp_rank = comm.Get_rank()

    def forward(self, idx: np.ndarray) -> tuple[np.ndarray, EmbedCache]:
        # idx (B, T) int -> x (B, T/tp, C)
        T, max_T = idx.shape[1], self.wpe.weight.shape[0]
        if T > max_T:
            raise ValueError(f"sequence length ({T}) must not exceed seq_len ({max_T})")
        x, wte_cache = self.wte.forward(idx)  # (B, T, C), partial over tp
        x = self.scatter.forward(x)  # (B, T/tp, C), a fresh array
        t = x.shape[1]
        pos, _ = self.wpe.forward(np.arange(self.tp_rank * t, (self.tp_rank + 1) * t))
        x += pos
        return x, EmbedCache(wte_cache, EmbeddingCache(np.arange(T)))

    def backward(self, dx: np.ndarray, cache: EmbedCache) -> None:
        # dx (B, T/tp, C); integer input, nothing to return
        dx = self.scatter.backward(dx)  # (B, T, C)
        self.wte.backward(dx, cache.wte)
        self.wpe.backward(dx.sum(axis=0), cache.wpe)  # (T, C)
        return None


# ---------------------------------------------------------------------------------
# the vocabulary-parallel head and its cross-entropy


class VocabParallelCECache(NamedTuple):
    logits: np.ndarray  # (N, V/tp), this rank's slice of the vocabulary
    lse: np.ndarray  # (N, 1), logsumexp over the whole vocabulary
    target: np.ndarray  # (N,) int, the target's column in this slice (0 where not here)
    mine: np.ndarray  # (N,) bool, the target is in this rank's slice


def vocab_parallel_cross_entropy(logits: np.ndarray, targets: np.ndarray, vocab_start: int,
                                 comm: Any) -> tuple[float, VocabParallelCECache]:
    """``loss = mean_n [logsumexp_v z_nv - z_n,t_n]`` with the columns of z split over
    ``comm``; the logits are never gathered. Collective: an all-reduce (max) of the row
    maxima (N,) and an all-reduce (sum) of [sum exp(z - max), target logit] (N, 2).

    logits (N, V/tp), columns ``vocab_start ...`` of the vocabulary; targets (N,) int.
    The loss is the same on every rank.
    """
    n, v_local = logits.shape
    zmax = all_reduce(logits.max(axis=1, keepdims=True), comm, op="max")  # (N, 1)
    e = logits - zmax  # (N, V/tp)
    np.exp(e, out=e)
    target = targets - vocab_start
    mine = (target >= 0) & (target < v_local)
    target[~mine] = 0
    stats = np.empty((n, 2), dtype=logits.dtype)  # [sum exp, target logit], partial
    stats[:, 0] = e.sum(axis=1)
    stats[:, 1] = np.where(mine, logits[np.arange(n), target], 0)
    stats = all_reduce(stats, comm)
    lse = np.log(stats[:, :1])  # (N, 1)
    lse += zmax
    loss = float(np.mean(lse[:, 0] - stats[:, 1], dtype=np.float64))
    return loss, VocabParallelCECache(logits, lse, target, mine)


def vocab_parallel_cross_entropy_backward(dloss: float,
                                          cache: VocabParallelCECache) -> np.ndarray:
    # dloss scalar -> dlogits (N, V/tp) = dloss/N (softmax - onehot), no communication
    logits, lse, target, mine = cache
    dlogits = logits - lse  # (N, V/tp), log softmax
    np.exp(dlogits, out=dlogits)
    rows = np.flatnonzero(mine)
    dlogits[rows, target[rows]] -= 1.0
    dlogits *= float(dloss) / logits.shape[0]
    return dlogits


class VocabParallelHeadCache(NamedTuple):
    ln_f: LayerNormCache
    lm: LinearCache  # the projection's input (B, T, C), after `enter`
    ce: VocabParallelCECache

    @property
    def logits(self) -> np.ndarray:
        """(B, T, V/tp): this rank's slice of the vocabulary."""
        return self.ce.logits.reshape(*self.lm.x.shape[:-1], -1)


class VocabParallelHead(Head):
    """``logits_r = enter(ln_f(x)) @ W_r``, ``loss = vocab_parallel_cross_entropy``.

    ``W_r`` is this rank's V/tp columns of ``lm_head`` (or rows of the tied, already
    split token embedding). ``enter`` is f (identity; backward all-reduce) or, under
    sequence parallelism, an all-gather along T (backward reduce-scatter).
    """

    def __init__(self, serial: Head, comm: Any, enter, tied: VocabParallelEmbedding | None):
        self.ln_f = serial.ln_f
        self.lm_head = None
        if tied is None:
            self.lm_head = ColumnParallelLinear.from_serial(serial.lm_head, comm,
                                                            NoCommunication())
        self.wte = tied
        self.enter = enter
        self.comm = comm
        v_local = tied.weight.shape[0] if tied is not None else self.lm_head.out_features
        self.vocab_start = comm.Get_rank() * v_local

    def forward(self, x: np.ndarray, targets: np.ndarray):
        # x (B, T, C) or SP (B, T/tp, C), targets (B, T) int -> loss, mean over B T
        h, ln_f = self.ln_f.forward(x)
        h = self.enter.forward(h)  # (B, T, C)
        logits = self._project_local(h)  # (B, T, V/tp)
        loss, ce = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                targets.reshape(-1), self.vocab_start,
                                                self.comm)
        return loss, VocabParallelHeadCache(ln_f, LinearCache(h), ce)

    def backward(self, dloss: float, cache: VocabParallelHeadCache) -> np.ndarray:
        # dloss scalar -> dx, the shape of the forward's x
        dlogits = vocab_parallel_cross_entropy_backward(dloss, cache.ce)  # (B T, V/tp)
        if self.lm_head is not None:
            dh = self.lm_head.backward(dlogits, cache.lm)
        else:
            h = cache.lm.x.reshape(-1, cache.lm.x.shape[-1])  # (B T, C)
            self.wte.weight.add_product(dlogits.T, h)  # += dlogits^T h (V/tp, C)
            dh = dlogits @ self.wte.weight.data  # (B T, C), partial over tp
        dh = self.enter.backward(dh.reshape(cache.lm.x.shape))
        return self.ln_f.backward(dh, cache.ln_f)

    def logits(self, x: np.ndarray) -> np.ndarray:
        # x -> logits (B, T, V), gathered over the vocabulary: inference and tests only
        h = self.enter.forward(self.ln_f.forward(x)[0])
        return all_gather(self._project_local(h), self.comm, axis=-1)

    def _project_local(self, h: np.ndarray) -> np.ndarray:
        # h (B, T, C) -> logits (B, T, V/tp), this rank's slice of the vocabulary
        if self.lm_head is not None:
            return self.lm_head.forward(h)[0]
        logits = h.reshape(-1, h.shape[-1]) @ self.wte.weight.data.T  # (B T, V/tp)
        return logits.reshape(*h.shape[:-1], -1)


# ---------------------------------------------------------------------------------
# the styles: module, tensor communicator, whole model -> sharded module


def _local_heads(attn, comm, model):
    attn.n_head //= comm.Get_size()
    return attn


def _head(enter_pair):
    def build(head, comm, model):
        tied = model.embed.wte if head.wte is not None else None  # already split
        return VocabParallelHead(head, comm, enter_pair(comm), tied)
    return build


STYLES = {  # the GPT's own; the linear and embedding styles are parallel.tensor's
    "local-heads": _local_heads,
    "vocab-parallel-loss": _head(CopyToTensorRegion),
    "sequence-vocab-parallel-loss": _head(GatherFromSequenceRegion),
    "sequence-embed": lambda m, comm, model: SequenceParallelEmbed(m, comm),
    "sequence-norm": lambda m, comm, model: SequenceParallelLayerNorm(m, comm),
    "sequence-heads": lambda m, comm, model: SequenceParallelAttention(m, comm),
}


# ---------------------------------------------------------------------------------
# what it costs: communication per step, activation memory saved


def tp_comm_bytes(m: ModelConfig, batch: int, microbatches: int, tp: int,
                  sequence_parallel: bool) -> float:
    """Bytes each rank sends over the tensor group in one training step (ring model).

    ``batch`` sequences of ``T = seq_len`` per data-parallel rank, ``N = batch T /
    microbatches`` tokens per microbatch, ``s`` bytes per element, ``u = (tp - 1)/tp``;
    an all-reduce of n bytes sends 2u n, an all-gather or reduce-scatter u n:

    * activations: all-reduces of (N, C) at the embedding (forward), twice per layer
      in forward and twice in backward, and at the head's input (backward): 4L + 2.
      Sequence parallelism turns each into an all-gather plus a reduce-scatter (the
      same bytes), and adds the LayerNorm gradient sums: 2L + 1 norms of 2C;
    * the loss: all-reduces of the row maxima (N) and [sum exp, target logit] (2N);
    * the gradient norm: one float64 all-reduce per step.

        bytes = 2u s mb [(4L + 2) C (N + [SP]) + 3N] + 2u 8
    """
    u = (tp - 1) / tp
    s = np.dtype(m.dtype).itemsize
    n = batch * m.seq_len // microbatches
    per_microbatch = (4 * m.n_layer + 2) * m.d_model * (n + int(sequence_parallel)) + 3 * n
    return 2 * u * s * microbatches * per_microbatch + 2 * u * 8


def sequence_parallel_saving(m: ModelConfig, batch: int, seq: int, tp: int) -> int:
    """Activation bytes per microbatch and rank that sequence parallelism saves.

    The caches of the 2L + 1 LayerNorms, xhat (B, T, C) and 1/std (B, T, 1), are
    held for T/tp tokens instead of T; everything else is held alike either way.
    """
    s = np.dtype(m.dtype).itemsize
    return (2 * m.n_layer + 1) * batch * (seq - seq // tp) * (m.d_model + 1) * s
