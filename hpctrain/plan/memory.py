"""What one rank of a GPT layout holds: parameters, gradients, optimizer state, the
activations kept for backward, and the transient working set. Pure arithmetic on the
config, checked against the real model in ``tests/test_plan_cost.py``.

Parameters of the pieces, ``C`` = d_model, ``F`` = the MLP width, ``V`` vocabulary,
``T`` seq_len, ``t`` = tp (split tensors marked ``/t``; in ``named_parameters``
order, the order the gradient buckets are cut in reverse)::

    embed   wte (V/t, C), wpe (T, C)
    block   ln1 2C | qkv C 3C/t + 3C/t | proj C/t C + C | ln2 2C | fc C F/t + F/t
            | proj F/t C + C
    head    ln_f 2C, lm_head (C, V/t)          (tied: a copy of wte when pp > 1)

Activations a block's forward keeps (``nn`` caches), per microbatch of ``b``
sequences, ``N = b T`` tokens, ``H`` heads, ``s`` bytes an element::

    ln1, ln2   xhat (N, C) + rstd (N, 1) each          SP: N / t tokens
    qkv        its input (N, C) and its output (N, 3C/t) (q, k, v are views)
    scores     P (b, H/t, T, T)
    proj       its input (N, C/t)
    fc         its input (N, C); GELU: x, s (N, F/t); fc-proj: its input (N, F/t)

    block = s [N (4C + 2 + (4C + 3F)/t) + b H/t T^2]        (plain tensor parallel)
    SP:     s [N/t (2C + 2) + 2 N C + N (4C + 3F)/t + b H/t T^2]
    head  = s [N (2C + 2) + N V/t]                           (ln_f, lm input, logits)
    SP:     s [N/t (C + 1) + N C + N + N V/t]

The embedding keeps only integer indices. A pipeline stage also keeps each received
input activation, ``s N C`` (``/t`` with SP), until its backward.

Reduced precision (``[train] precision``, ``hpctrain.precision``) stores only the caches
in 16 bits (``Elements``): the parameters are the float32 masters, gradients accumulate
in float32, arithmetic and its transient arrays are float32, and so are the activations
pieces hand each other (rounded, not cast: a received pipeline input is a float32
buffer). Each piece's backward holds float32 copies of its own (``precision_copies``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from hpctrain.config import ModelConfig
from hpctrain.parallel.data import plan_buckets

OPTIMIZER_STATES = {"adamw": 2, "sgd": 1}  # arrays per parameter element (m, v; momentum)


def itemsize(m: ModelConfig) -> int:
    return np.dtype(m.dtype).itemsize


@dataclass(frozen=True)
class Elements:
    """Bytes an element of each kind of array a rank holds."""

    state: int  # parameters, gradients (and their buckets), optimizer state
    master: int  # a master copy of the parameters and the optimizer state (0: none)
    cache: int  # the activations a forward keeps for its backward
    work: int  # the transient arrays of a forward or backward, received activations
    copies: bool = False  # a backward expands its piece's cache, rounds its parameters


def elements(m: ModelConfig, precision: str = "fp32", element_bytes: int | None = None,
             master_bytes: int = 0) -> Elements:
    """What a run of ``[train] precision`` stores in which size.

    "fp32": ``element_bytes`` everywhere (default the model's dtype), the optimizer
    keeping ``master_bytes`` masters and state when given (a practice's mixed precision,
    Megatron's: 16-bit parameters and gradients beside float32 masters). "bf16" and
    "fp16" are ``hpctrain.precision`` whatever the practice says: 2-byte caches, all
    else in the model's dtype (the float32 ``Parameter.data`` *is* the master, and the
    optimizer holds its moments only), and ``copies`` (``precision_copies``)."""
    if precision == "fp32":
        s = element_bytes or itemsize(m)
        return Elements(state=s, master=master_bytes, cache=s, work=s)
    full = itemsize(m)
    return Elements(state=full, master=0, cache=2, work=full, copies=True)


# ---------------------------------------------------------------------------------
# parameters


def embed_sizes(m: ModelConfig, tp: int) -> list[int]:
    return [m.vocab_size // tp * m.d_model, m.seq_len * m.d_model]


def block_sizes(m: ModelConfig, tp: int) -> list[int]:
    c, f = m.d_model, m.ffn_dim
    return [c, c, c * 3 * c // tp, 3 * c // tp, c // tp * c, c, c, c,
            c * f // tp, f // tp, f // tp * c, c]


def head_sizes(m: ModelConfig, tp: int, pp: int) -> list[int]:
    if m.tie_embeddings:
        return [m.d_model, m.d_model] + ([m.vocab_size // tp * m.d_model] if pp > 1 else [])
    return [m.d_model, m.d_model, m.d_model * m.vocab_size // tp]


@lru_cache(maxsize=4096)
def chunk_blocks(m: ModelConfig, pp: int, v: int, balance: str) -> tuple[tuple[int, int], ...]:
    """(start, stop) of the blocks of each model chunk (``stages.plan``)."""
    from hpctrain.parallel import stages

    return tuple((s.start, s.stop) for s in stages.plan(m, pp, v, balance))


def rank_chunks(m: ModelConfig, pp: int, v: int, balance: str, pp_rank: int) -> list[int]:
    """Model chunk indices pipeline rank ``pp_rank`` holds."""
    return [c * pp + pp_rank for c in range(v)]


@lru_cache(maxsize=4096)
def rank_params(m: ModelConfig, tp: int, pp: int, v: int, balance: str,
                pp_rank: int) -> tuple[tuple[int, int, tuple], ...]:
    """This rank's parameters in model order (the engine's ``params``): (elements, model
    chunk, the backward piece holding it: ``("embed",)``, ``("attn", j)`` (block j's
    ln1 and attention), ``("mlp", j)`` (its ln2 and MLP) or ``("head",)``)."""
    spans = chunk_blocks(m, pp, v, balance)
    params = []
    for k in sorted(rank_chunks(m, pp, v, balance, pp_rank)):
        start, stop = spans[k]
        if k == 0:
            params += [(n, k, ("embed",)) for n in embed_sizes(m, tp)]
        for j in range(start, stop):
            sizes = block_sizes(m, tp)
            params += [(n, k, ("attn", j)) for n in sizes[:6]]
            params += [(n, k, ("mlp", j)) for n in sizes[6:]]
        if k == len(spans) - 1:
            params += [(n, k, ("head",)) for n in head_sizes(m, tp, pp)]
    return tuple(params)


def rank_param_sizes(m: ModelConfig, tp: int, pp: int, v: int, balance: str,
                     pp_rank: int) -> list[int]:
    """Sizes of this rank's parameters in model order (the engine's ``params``)."""
    return list(_param_sizes(m, tp, pp, v, balance, pp_rank))


@lru_cache(maxsize=4096)
def _param_sizes(m: ModelConfig, tp: int, pp: int, v: int, balance: str,
                 pp_rank: int) -> tuple[int, ...]:
    return tuple(n for n, _, _ in rank_params(m, tp, pp, v, balance, pp_rank))


# ---------------------------------------------------------------------------------
# activations


def block_activation_bytes(m: ModelConfig, b: int, tp: int = 1, sp: bool = False,
                           s: int | None = None) -> int:
    """Bytes one block's forward cache keeps for ``b`` sequences of ``seq_len`` (``s``
    bytes an element; default the model's dtype)."""
    c, f, h, t = m.d_model, m.ffn_dim, m.n_head, m.seq_len
    n = b * t
    split = n * (4 * c + 3 * f) // tp + b * h // tp * t * t
    if sp:
        whole = n // tp * (2 * c + 2) + 2 * n * c
    else:
        whole = n * (4 * c + 2)
    return (s or itemsize(m)) * (whole + split)


def head_activation_bytes(m: ModelConfig, b: int, tp: int = 1, sp: bool = False,
                          s: int | None = None) -> int:
    c, v, n = m.d_model, m.vocab_size, b * m.seq_len
    if sp:
        return (s or itemsize(m)) * (n // tp * (c + 1) + n * c + n + n * v // tp)
    return (s or itemsize(m)) * (n * (2 * c + 2) + n * v // tp)


def boundary_bytes(m: ModelConfig, b: int, tp: int, sp: bool, s: int | None = None) -> int:
    """One activation passed between pipeline stages (b, T, C), its sequence shard with SP."""
    return (s or itemsize(m)) * b * m.seq_len * m.d_model // (tp if sp else 1)


def kept_block_bytes(m: ModelConfig, b: int, tp: int, sp: bool, recompute: str,
                     s: int | None = None) -> int:
    """What one block keeps per microbatch until its backward: its whole cache, or
    with ``recompute = "full"`` its input only, with ``"selective"`` all but the
    attention probabilities and their weighted sum (recomputed from q, k and v in
    backward), with ``"attention"`` all but those and q, k, v (recomputed from qkv's
    input)."""
    if recompute == "full":
        return boundary_bytes(m, b, tp, sp, s)
    whole = block_activation_bytes(m, b, tp, sp, s)
    if recompute in ("selective", "attention"):
        whole -= attention_core_bytes(m, b, tp, s)
    if recompute == "attention":
        whole -= qkv_output_bytes(m, b, tp, s)
    return whole


def qkv_output_bytes(m: ModelConfig, b: int, tp: int, s: int | None = None) -> int:
    """q, k and v (b, T, 3 C/t): what attention recomputation drops beyond selective's."""
    return (s or itemsize(m)) * b * m.seq_len * 3 * m.d_model // tp


def attention_core_bytes(m: ModelConfig, b: int, tp: int, s: int | None = None) -> int:
    """What selective recomputation makes again in a block's backward: P (b, H/t, T, T)
    and the weighted sum y = P v (b, T, C/t), proj's input."""
    t = m.seq_len
    return (s or itemsize(m)) * (b * m.n_head // tp * t * t + b * t * m.d_model // tp)


def chunk_activation_bytes(m: ModelConfig, b: int, tp: int, sp: bool, blocks: int,
                           first: bool, last: bool, pipelined: bool,
                           recompute: str = "none", s: int | None = None,
                           received: int | None = None) -> int:
    """One microbatch's cache of a model chunk (with its received input if pipelined).
    ``received``: the received input's element bytes when the caches are stored in
    another size (``hpctrain.precision``: the schedule's float32 buffer, beside a fully
    recomputed first block's 16-bit copy of it)."""
    total = blocks * kept_block_bytes(m, b, tp, sp, recompute, s)
    if last:
        total += head_activation_bytes(m, b, tp, sp, s)
    if pipelined and not first:
        if received is not None:
            total += boundary_bytes(m, b, tp, sp, received)
        elif not (recompute == "full" and blocks):  # (full: the first block keeps it)
            total += boundary_bytes(m, b, tp, sp, s)
    return total


def recompute_bytes(m: ModelConfig, b: int, tp: int, sp: bool, recompute: str,
                    s: int | None = None) -> int:
    """What a recomputed block's backward holds again beyond the workspace
    (``parallel/recompute.py``): its whole cache (full), or its attention
    probabilities P (b, H/t, T, T) and their weighted sum (b, T, C/t) (selective),
    and q, k, v (b, T, 3 C/t) (attention)."""
    if recompute == "full":
        return block_activation_bytes(m, b, tp, sp, s)
    if recompute == "selective":
        return attention_core_bytes(m, b, tp, s)
    if recompute == "attention":
        return attention_core_bytes(m, b, tp, s) + qkv_output_bytes(m, b, tp, s)
    return 0


def workspace_bytes(m: ModelConfig, b: int, tp: int, sp: bool, has_head: bool,
                    s: int | None = None) -> int:
    """The transient peak above the caches (an estimate): a block's backward runs its
    MLP half, then its attention half, each with the gradient flowing down (N, C)
    twice: the MLP's (N, F/t) twice, or the attention's dqkv (N, 3C/t) and dP (b, H/t,
    T, T), whichever is larger; the head's backward the logits' exponentials and
    dlogits (N, V/t) twice."""
    c, f, h, t, v = m.d_model, m.ffn_dim, m.n_head, m.seq_len, m.vocab_size
    n = b * t
    block = 2 * n * c + max(2 * n * f // tp, n * 3 * c // tp + b * h // tp * t * t)
    head = 2 * n * v // tp + 2 * n * c if has_head else 0
    return (s or itemsize(m)) * max(block, head)


def precision_copies(m: ModelConfig, b: int, tp: int, sp: bool, recompute: str,
                     first: bool, blocks: bool, last: bool, s: int) -> int:
    """``hpctrain.precision``'s float32 copies during one piece's backward, the largest
    piece of this rank's: the piece's cache expanded from 16 bits (its stored copy
    stays in the model's cache until the whole backward ends) and its parameters
    rounded to 16 bits as float32 arrays (beside the masters), ``s`` bytes an element.
    The embedding caches indices only; the head's parameters include a tied table."""
    copies = [s * sum(embed_sizes(m, tp))] if first else []
    if blocks:
        copies.append(kept_block_bytes(m, b, tp, sp, recompute, s)
                      + s * sum(block_sizes(m, tp)))
    if last:
        copies.append(head_activation_bytes(m, b, tp, sp, s)
                      + s * sum(head_sizes(m, tp, pp=2)))
    return max(copies, default=0)


# ---------------------------------------------------------------------------------
# the memory of one rank


@dataclass(frozen=True)
class Memory:
    """Bytes one rank holds at its peak, by term."""

    params: int
    grads: int
    optimizer: int
    activations: int  # caches of the microbatches alive at the schedule's peak
    workspace: int  # transient arrays of one forward or backward, and the optimizer scratch
    buckets: int  # communication buffers beyond the gradient buckets themselves
    retained: int = 0  # arrays the engine keeps alive but this rank never uses

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optimizer + self.activations
                + self.workspace + self.buckets + self.retained)

    def terms(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "workspace": self.workspace,
                "buckets": self.buckets, "retained": self.retained}


def state_bytes(sizes: list[int], s: int, dp: int, zero: int, states: int,
                bucket_mb: float, master: int = 0) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes for parameter ``sizes`` (model order), as
    ``zero.expected_memory``: stage 0 whole; 1 and 2 pad every bucket to a multiple of
    dp and shard the optimizer state (2: and the gradients) over dp; 3 shards all three
    (``parallel/zero3.py``; its transient gathered pieces are ``zero3_transient_bytes``).
    ``master``: mixed precision, the optimizer keeps a copy of the parameters and its states in
    ``master`` bytes an element (fp32: 4)."""
    numel = sum(sizes)
    per = (states + 1) * master if master else states * s
    if zero == 0:
        return numel * s, numel * s, per * numel
    if zero == 3:  # everything 1/dp (each piece padded by under dp elements: ignored)
        shard = -(-numel // dp)
        return shard * s, shard * s, per * shard
    padded = _padded(tuple(sizes), s, bucket_mb, dp)
    shard = padded // dp
    return padded * s, (padded if zero == 1 else shard) * s, per * shard


@lru_cache(maxsize=4096)
def _padded(sizes: tuple[int, ...], s: int, bucket_mb: float, dp: int) -> int:
    """Elements of ``sizes`` in ZeRO's buckets, each padded to a multiple of ``dp``."""
    return sum(size for *_, size in plan_buckets(list(reversed(sizes)), s, bucket_mb, dp))


def zero3_transient_bytes(m, tp: int, s: int, stage_numel: int = 0, microbatches: int = 1,
                          reshard: bool = True, dp: int = 2, pipelined: bool = False) -> int:
    """ZeRO-3's gathered state during a step (``parallel/zero3.py``), ``s`` bytes an
    element, pieces by the model's ``piece_costs`` (for the GPT parameter counts) per tp
    rank. Gathered parameters: the piece in use and the next one prefetched (two of
    the largest), or, without ``reshard`` after the forward, every piece of this rank
    (``stage_numel`` elements) from its forward to its backward.

    Whole gradients: a unit's lives from its first backward until its reduce-scatter
    completes, posted when the engine reports the unit's parameters final and reaped
    when the next piece ends. With several microbatches, or in a pipeline (which
    reports a chunk's gradients when its whole backward ends), every piece of this
    rank's. Otherwise two pieces' (the one in backward, and the one before it, still
    reducing); one without ``reshard`` (the piece before has freed its gathered
    parameters, counted in ``whole``) or at ``dp`` 1 (a shard is its whole unit:
    nothing is gathered, a gradient is copied to its shard at once). A tied token
    table (``tie_embeddings``, one stage) is bound by the head's backward and reported
    after the embedding's: its gradient lives through the whole backward."""
    from hpctrain.models.registry import model_class

    costs = model_class(m.kind).piece_costs(m)
    largest = max([costs.first, *costs.middle, costs.last]) / tp
    whole = max(stage_numel, largest)
    gathered = 0 if dp == 1 else 2 * largest if reshard else whole
    if microbatches > 1 or pipelined:
        grads = whole
    else:
        grads = largest if dp == 1 or not reshard else 2 * largest
        if m.tie_embeddings:
            grads += costs.first / tp
    return int(s * (gathered + grads))
