"""The predicted step of a layout on a cluster: time and memory of every pipeline rank.

``estimate(cfg, cluster)`` takes a validated Config (a GPT; ``memory.py`` has the
memory arithmetic) and a ``Cluster`` and returns an ``Estimate``. Ranks are laid out
tp innermost, then dp, then pp (``parallel/topology.py``) and placed on the nodes in
blocks of ``ranks_per_node = ranks / nodes``. Ranks of one pipeline stage do the same
work, so the model works per pipeline rank, on the slowest node kind holding that
stage (the others wait for it at the tensor and data collectives).

Per microbatch of ``b = batch / (dp m)`` sequences, on one model chunk:

* compute: the GEMMs of ``GPT.model_flops`` at the cluster's rate for their shapes
  (``NodeKind.gemm_rate``), split by tp (qkv, attention projection, MLP, the
  per-head ``T x T`` products, the head; the per-head products at the rate of
  operands in the caches, ``gemm_cached``, the others from memory); backward twice
  the forward's FLOPs at the same rates; element-wise passes (LayerNorm, GELU,
  softmax, residuals, the loss) as bytes at ``stream_rate``, or left out when the
  cluster gives none (a note says so);
* tensor parallelism: per block two all-reduces of (b, T, C) forward and two
  backward, one at the embedding and one at the head (``tp_comm_bytes``); with
  sequence parallelism an all-gather plus a reduce-scatter of the whole instead; on
  the node's links or across nodes when the tensor group spans nodes;
* pipeline: the schedule's compute recorded (``timeline.record_compute``) and
  replayed (``replay``) with each rank's chunk forward and backward times, each
  including the point-to-point transfer of its output; the bubble is what the replay
  leaves idle. The search's first pass uses the closed form ``busy + (p - 1) max chunk
  (F + B)`` instead, and the caches each rank holds come from the schedule's closed
  form (``pipeline.peak_caches``) without recording it. A
  tied token table (``tie_embeddings``) lives on the first and the last stage, whose
  gradients of it are summed after the last backward (``PipelineEngine``'s
  ``_sum_tied_grads``, Megatron's embedding all-reduce): one exchange of ``V C / tp``
  gradient elements between the two, added to both ranks' point-to-point time;
* data parallelism, per step: the gradients of this rank summed over dp (ring
  all-reduce; ZeRO: reduce-scatter, then an all-gather of the updated parameters
  after the optimizer; hierarchical: a reduce-scatter in the node (the reduce), an
  all-reduce among the node leaders, an all-gather in the node (the broadcast)), in
  the engine's buckets (``grad_buckets``: ``bucket_mb`` each, in backward order). A
  bucket is ready when the engine reports its last gradient final (``ready_times``:
  with one stage, the last microbatch's backward piece by piece, head first and the
  embedding last; with more, each chunk whole at the end of its last backward in the
  replayed schedule), and the buckets go over the data group one after the other,
  each when it is ready and the one before it is done; **exposed = what runs past the
  end of the step's compute** (so the last buckets, ready as the backward ends, are
  always exposed, and a pipeline stage's sum overlaps only the other stages' remaining
  work). Two properties of the node kind refine it, for sums across nodes:
  ``comm_slowdown`` and ``compute_slowdown`` (1 and 1 unless the description says
  more; a table of them is read at the nodes the rank's data group spans): while a
  sum runs beside the rank's compute, the sum takes ``comm_slowdown`` and the compute
  ``compute_slowdown`` times as long as each does alone, and the step ends when the
  later of the two does (``beside``; on four half-core emulated nodes here about 4.6
  for groups of two nodes and 2.9 for all four, the compute 1.2-1.6, where the copies
  of TCP and the helper thread that moves the sum share the core with the backward).
  ``calibrate --emulated`` measures them (``overlap.py``). ZeRO's all-gather is never hidden.
  Periodic averaging strategies send the parameters (an all-reduce) every
  ``average_every`` steps, amortised per step;
  ``hierarchical`` averaging all-reduces the gradients in the node every step;
* optimizer: the bytes of its passes over the parameters it owns (AdamW: read p, g,
  m, v, write p, m, v, plus a scratch copy, 10 passes, 7 with the numba kernel; SGD
  6), the gradient norm and clipping (3 passes over the gradients), at ``stream_rate``.

How the software runs a layout beyond the layout itself is a ``Practice``, one for a
whole comparison (the default is hpctrain's own engine): the element size of
activations, gradients and messages (bf16: 2); mixed precision (fp32 master weights
and optimizer state); activation recomputation (the config's ``[train] recompute``
unless the practice names one; ``full``: each block's forward again
before its backward, keeping only its input; ``selective``: the attention scores,
softmax and weighted sum only, both per-head products again; ``attention``: those
and the qkv product); whether the
data-parallel reduction overlaps the backward; the element-wise kernels (hpctrain's
NumPy passes or its numba kernels, whichever this process runs unless the practice
names one, or fused GPU kernels as Megatron's); pipeline messages split over the
tensor group's links and all-gathered in the node. The memory of a config whose
``[train] precision`` is bf16 or fp16 is what ``hpctrain.precision`` stores whatever the
practice's element sizes say (``memory.elements``: 16-bit caches, all else float32, the
masters being the parameters); those sizes are another software's mixed precision for
an fp32 config (Megatron's 16-bit parameters and gradients beside float32 masters).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from hpctrain.config import Config, ConfigError, ModelConfig
from hpctrain.parallel import recompute as recompute_modes
from hpctrain.parallel.pipeline import peak_caches
from hpctrain.plan import memory as mem
from hpctrain.plan.cluster import Cluster, NodeKind
from hpctrain.plan.cluster import from_dict as cluster_from_dict

GiB = 2**30
OPT_PASSES = {"adamw": 10, "sgd": 6}
# hpctrain's numba AdamW: one read of p, g, m, v and one write of p, m, v
NUMBA_OPT_PASSES = {**OPT_PASSES, "adamw": 7}
# hpctrain's element-wise kernels, (forward, backward) passes of LayerNorm over (N, C),
# GELU over (N, F/t) and the causal softmax over the scores (block_stream_bytes says
# where each count comes from)
HPCTRAIN_PASSES = {"numpy": ((10, 18), (19, 20), (2.5, 7)),
                   "numba": ((2.1, 6.5), (12.6, 6.6), (1.4, 2.6))}
GRAD_PASSES = 3  # norm (read), clip (read, write)
RECOMPUTE = recompute_modes.MODES  # the modes train runs (parallel/recompute.py)
KERNELS = ("numpy", "numba", "fused")


@dataclass(frozen=True)
class Practice:
    """How the training software runs any layout (module docstring); fixed for a whole
    comparison, never per layout."""

    element_bytes: int | None = None  # activations, gradients, messages; None: the dtype's
    master_bytes: int = 0  # mixed precision: master weights and optimizer state (fp32: 4)
    # "none", "selective", "attention" or "full"; None: the config's [train] recompute
    recompute: str | None = None
    dp_overlap: bool = True  # gradient buckets reduced during the last backward
    # element-wise passes: hpctrain's "numpy" or "numba" kernels (``hpctrain.nn.kernels``),
    # or Megatron's "fused" GPU kernels; None: the ones hpctrain runs in this process
    kernels: str | None = None
    p2p_scatter_gather: bool = False  # stage messages split over the tp ranks' links
    # pp > 1: every pipeline rank keeps the whole (tp-sharded) model it was built from,
    # the other stages' parameters and gradients included (hpctrain's PipelineEngine
    # did, until it stopped holding the serial model: 41 MiB a rank at pp2 of the
    # benchmark GPT)
    keeps_whole_model: bool = False

    def __post_init__(self):
        if self.recompute is not None and self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute ({self.recompute!r}) must be one of {RECOMPUTE}")
        if self.kernels is not None and self.kernels not in KERNELS:
            raise ValueError(f"kernels ({self.kernels!r}) must be one of {KERNELS}")


HPCTRAIN = Practice()


@dataclass(frozen=True)
class RankCost:
    """One pipeline rank (every dp and tp rank of that stage alike)."""

    pp_rank: int
    kind: str
    blocks: int
    has_embed: bool
    has_head: bool
    live: int  # microbatch caches alive at the schedule's peak
    memory: mem.Memory
    time: dict[str, float]  # compute, tp, pp_bubble, p2p, dp, optimizer (seconds)
    memory_limit: float = float("inf")  # the smallest node memory of the stage / rpn
    split: int = 1  # threads its microbatch's rows are split over (batch_threads)

    @property
    def step_s(self) -> float:
        return sum(self.time.values())

    def describe(self) -> str:
        parts = (["embedding"] if self.has_embed else []) + [f"{self.blocks} blocks"] + \
            (["head"] if self.has_head else [])
        threads = f", its rows over {self.split} threads" if self.split > 1 else ""
        return f"pp rank {self.pp_rank} ({self.kind}): {' + '.join(parts)}, {self.live} " \
               f"microbatch cache(s) alive{threads}"


@dataclass(frozen=True)
class Estimate:
    cfg: Config
    world: int
    ranks_per_node: int
    step_s: float
    tokens_per_s: float
    mfu: float
    ranks: list[RankCost]
    notes: list[str] = field(default_factory=list)

    @property
    def max_memory(self) -> int:
        return max(r.memory.total for r in self.ranks)

    @property
    def shares(self) -> dict[str, float]:
        """Each term's share of the slowest rank's step."""
        r = max(self.ranks, key=lambda r: r.step_s)
        total = r.step_s or 1.0
        return {k: v / total for k, v in r.time.items()}

    def bottleneck(self) -> str:
        """The most loaded rank and why (time first, memory second)."""
        slow = max(self.ranks, key=lambda r: r.step_s)
        big = max(self.ranks, key=lambda r: r.memory.total)
        text = f"slowest: {slow.describe()}"
        if big is not slow or len(self.ranks) == 1:
            text += f"; most memory: {big.describe()}"
        return text


# ---------------------------------------------------------------------------------
# compute


def _gemm(kind: NodeKind, rpn: int, m: int, n: int, k: int, count: int = 1,
          cached: bool = False) -> float:
    return count * 2.0 * m * n * k / kind.gemm_rate(rpn, m, n, k, cached)


def attention_forward_s(m: ModelConfig, kind: NodeKind, rpn: int, b: int, tp: int,
                        causal: bool = True) -> float:
    """GEMM seconds of one block's per-head products (S = q k^T, P v): with ``causal``
    as ``nn/attention.py`` runs them, by blocks of query rows each over the keys it
    sees; else whole ``T x T`` (Megatron's kernels). At the rate of products whose
    operands are in the caches: the q, k, v product just wrote them."""
    from hpctrain.nn.attention import _query_blocks

    count = 2 * b * m.n_head // tp
    if not causal:
        return _gemm(kind, rpn, m.seq_len, m.seq_len, m.head_dim, count, cached=True)
    return sum(_gemm(kind, rpn, i1 - i0, i1, m.head_dim, count, cached=True)
               for i0, i1 in _query_blocks(m.seq_len))


def causal_fraction(t: int) -> float:
    """The share of a T x T score matrix that attention's blocks compute."""
    from hpctrain.nn.attention import _query_blocks

    return sum((i1 - i0) * i1 for i0, i1 in _query_blocks(t)) / (t * t)


def block_forward_s(m: ModelConfig, kind: NodeKind, rpn: int, b: int, tp: int,
                    causal: bool = True) -> float:
    """GEMM seconds of one block's forward over b sequences on a tp shard."""
    c, f, t = m.d_model, m.ffn_dim, m.seq_len
    n = b * t
    return (_gemm(kind, rpn, n, 3 * c // tp, c) + _gemm(kind, rpn, n, c, c // tp)
            + _gemm(kind, rpn, n, f // tp, c) + _gemm(kind, rpn, n, c, f // tp)
            + attention_forward_s(m, kind, rpn, b, tp, causal))


def head_forward_s(m: ModelConfig, kind: NodeKind, rpn: int, b: int, tp: int) -> float:
    return _gemm(kind, rpn, b * m.seq_len, m.vocab_size // tp, m.d_model)


def block_stream_bytes(m: ModelConfig, b: int, tp: int, sp: bool, kernels: str,
                       s: int | None = None) -> tuple[float, float, float]:
    """(forward, backward, the forward's attention-score part) bytes of one block's
    element-wise passes, an estimate by pass counting.

    numpy (hpctrain's NumPy kernels): LayerNorm 10 and 18 passes of (N, C), residual
    adds 3, GELU 19 and 20 of (N, F/t), causal softmax 5 of the half (b, H/t, T, T) and
    its backward 7 of the blocks attention computes (``causal_fraction``), bias
    gradients and q's scaling; with sequence parallelism, the copies its all-gathers
    and reduce-scatters make (4 of (N, C) each way, read and written).
    numba (hpctrain's fused kernels, ``hpctrain.nn.fused``): each kernel one read of its
    inputs and one write of its outputs, but not all at the memory's speed (GELU's
    forward computes an exp an element), so the counts are NumPy's scaled by the time
    of each numba kernel over NumPy's, measured side by side (``bench_fused.py``,
    float32, 2 threads, 2026-12-04 21:56: GELU 2.38/3.59 and 1.74/5.28 ms, LayerNorm
    0.46/2.16 and 0.42/1.78, softmax 3.12/5.50 and 1.06/2.90): LayerNorm 2.1 and 6.5
    (the backward's kernel 3.5, its weight and bias gradients 3, NumPy's), GELU 12.6
    and 6.6, the causal softmax 1.4 of the whole scores and its backward 2.6 of the
    blocks; the rest as numpy.
    fused (Megatron's GPU kernels, one read and one write each): LayerNorm 2 and 3 of
    (N, C) twice, bias-dropout-add 3.5 and 2.5 twice (the mask a byte), bias-GELU 2
    and 3 of (N, F/t), scale-mask-softmax 2 and 3 of (b, H/t, T, T) and its dropout
    2.5 and 2.5, the q/k/v and context transposes 8 of (N, C/t) each way.
    """
    s = s or mem.itemsize(m)
    c, f, t, h = m.d_model, m.ffn_dim, m.seq_len, m.n_head
    n = b * t
    rows = n // tp if sp else n
    scores = b * h // tp * t * t
    if kernels == "fused":
        fwd = 2 * 2 * rows * c + 2 * 3.5 * rows * c + 2 * n * f // tp + 4.5 * scores \
            + 8 * n * c // tp
        bwd = 2 * 3 * rows * c + 2 * 2.5 * rows * c + 3 * n * f // tp + 5.5 * scores \
            + 8 * n * c // tp
        return s * fwd, s * bwd, s * 4.5 * scores
    # LayerNorm, GELU and softmax passes: (forward, backward) counts of (N, C),
    # (N, F/t) and the scores (the backward's of the blocks attention computes)
    ln, gelu, soft = HPCTRAIN_PASSES[kernels]
    # sequence parallelism regroups whole (N, C) tensors around its four collectives a
    # direction: the all-gather's concatenation along T, the reduce-scatter's stack of
    # T blocks (``parallel/collectives.py``), one read and one write each
    regroup = 4 * 2 * n * c if sp else 0
    fwd = 2 * ln[0] * rows * c + 2 * 3 * rows * c + gelu[0] * n * f // tp \
        + soft[0] * scores + 2 * n * c // tp + regroup
    bwd = 2 * ln[1] * rows * c + 2 * 3 * rows * c + gelu[1] * n * f // tp \
        + soft[1] * scores * causal_fraction(t) \
        + n * (4 * c // tp + 2 * c + f // tp) + 2 * n * c // tp + regroup
    return s * fwd, s * bwd, s * soft[0] * scores


def head_stream_bytes(m: ModelConfig, b: int, tp: int, kernels: str,
                      s: int | None = None, sp: bool = False) -> tuple[float, float]:
    """numpy and numba: LayerNorm's passes of (N, C) as in ``block_stream_bytes``, the
    loss 8 and 6 of (N, V/t), sequence parallelism's regrouping copy (the gather before
    the head, its reduce-scatter in backward: 2 of (N, C) each way); fused: 2 and 3,
    and the vocabulary-parallel cross-entropy 4 and 3."""
    s, n = s or mem.itemsize(m), b * m.seq_len
    if kernels == "fused":
        return s * (2 * n * m.d_model + 4 * n * m.vocab_size // tp), \
            s * (3 * n * m.d_model + 3 * n * m.vocab_size // tp)
    ln = HPCTRAIN_PASSES[kernels][0]
    regroup = 2 * n * m.d_model if sp else 0
    return s * (ln[0] * n * m.d_model + 8 * n * m.vocab_size // tp + regroup), \
        s * (ln[1] * n * m.d_model + 6 * n * m.vocab_size // tp + regroup)


def running_kernels(m: ModelConfig) -> str:
    """The element-wise kernels hpctrain runs in this process for ``m``'s dtype:
    "numba" (numba installed, ``HPCTRAIN_FUSED`` not 0) or "numpy"."""
    from hpctrain.nn import kernels as nn_kernels

    return "numba" if nn_kernels.fused_running(m.dtype) else "numpy"


def embed_stream_bytes(m: ModelConfig, b: int, tp: int, s: int | None = None,
                       regroup: bool = False) -> tuple[float, float]:
    """The lookup, positions and their gradients; ``regroup``: sequence parallelism's
    copy around the reduce-scatter after the lookup (its all-gather in backward), 2 of
    (N, C) each way (hpctrain's collectives)."""
    s, n = s or mem.itemsize(m), b * m.seq_len
    extra = 2 * n * m.d_model if regroup else 0
    return s * (5 * n * m.d_model + extra), s * (4 * n * m.d_model + extra)


# ---------------------------------------------------------------------------------
# placement


def _stage_kinds(cluster: Cluster, world: int, rpn: int, lo: int, hi: int) -> list[NodeKind]:
    """Node kinds holding ranks [lo, hi) with ``rpn`` ranks per node in blocks."""
    kinds, node = [], 0
    for name, count in cluster.nodes:
        first, last = node * rpn, (node + count) * rpn
        if first < hi and last > lo:
            kinds.append(cluster.kinds[name])
        node += count
    return kinds


def ranks_per_node(cluster: Cluster, world: int) -> int:
    nodes = cluster.num_nodes
    if world % nodes:
        from hpctrain.config import ConfigError

        raise ConfigError(f"the number of ranks ({world}) must be a multiple of the "
                          f"cluster's nodes ({nodes}) for a block placement")
    return world // nodes


# ---------------------------------------------------------------------------------
# the estimate


@lru_cache(maxsize=64)
def _orders(schedule: str, pp: int, m: int, v: int):
    """A schedule's compute operations on each rank, in order (for its replay)."""
    from hpctrain.parallel import timeline
    from hpctrain.parallel.pipeline import SCHEDULES

    return timeline.record_compute(SCHEDULES[schedule], pp, m, v)


def check_model(cfg: Config) -> None:
    """Raise a ConfigError unless the cost model prices ``cfg``'s model (the GPT)."""
    kind = cfg.model.kind
    if kind == "gpt":
        return
    hint = (": for the DLRM's embedding tables, `hpctrain plan-tables` chooses each "
            "table's sharding and predicts each rank's step") if kind == "dlrm" else ""
    raise ConfigError(f"hpctrain plan prices the GPT's layouts only ([model] kind is "
                      f"{kind!r}, not 'gpt'){hint}")


def estimate(cfg: Config, cluster: Cluster, *, placement: str = "block",
             replay: bool = True, memo: dict | None = None,
             practice: Practice = HPCTRAIN) -> Estimate:
    """Predicted step of a validated ``cfg`` on ``cluster`` (module docstring).

    ``replay``: the pipeline by the schedule's timeline (False: the closed form, for
    the search's first pass). ``memo``: a dict the search shares between calls on one
    cluster, keeping the GEMM times of each shape. ``practice``: how the software runs
    the layout (``Practice``; default hpctrain's engine).
    """
    memo = {} if memo is None else memo

    def cached(fn, kind, *args):
        key = (fn.__name__, kind.name, *args)
        if key not in memo:
            memo[key] = fn(m, kind, *args)
        return memo[key]

    if placement != "block":
        raise ValueError(f"placement ({placement!r}) must be 'block'")
    m, par, t = cfg.model, cfg.parallel, cfg.train
    check_model(cfg)
    dp, tp, pp, mb, v = par.dp, par.tp, par.pp, par.microbatches, par.virtual_stages
    world = dp * tp * pp
    rpn = ranks_per_node(cluster, world)
    sp, s = par.sequence_parallel and tp > 1, practice.element_bytes or mem.itemsize(m)
    rc = t.recompute if practice.recompute is None else practice.recompute
    kernels = practice.kernels or running_kernels(m)
    b = t.batch_size // (dp * mb)
    n_tokens = b * m.seq_len
    notes = []
    # links: which groups of each stage leave a node, which stage-to-stage sends cross one
    tp_inter, dp_inter = spanning_groups(dp, tp, pp, rpn)
    dp_nodes = data_group_nodes(dp, tp, pp, rpn)
    spans = mem.chunk_blocks(m, pp, v, par.balance)
    n_chunks = len(spans)
    # the peak caches in closed form; the order itself only for a replay (a search's
    # first pass prices thousands of layouts, each schedule's order m v p operations)
    live = peak_caches(par.schedule, pp, mb, v) if pp > 1 else (1,)
    orders = _orders(par.schedule, pp, mb, v) if pp > 1 and replay else None
    boundary = mem.boundary_bytes(m, b, tp, sp, s)

    def p2p(src: int, dst: int) -> float:  # one message from stage src to stage dst
        return p2p_s(cluster, boundary, tp, sp, sends_cross(dp * tp, rpn, src, dst),
                     practice.p2p_scatter_gather)
    states = mem.OPTIMIZER_STATES[t.optimizer]
    # memory: what each kind of array is stored in (the config's precision, else the practice's)
    e = mem.elements(m, t.precision, practice.element_bytes, practice.master_bytes)
    stream_missing = False

    per_rank, chunk_times = [], []
    priced_at: dict[str, int] = {}  # kind -> the most ranks a node its rates are read at
    for r in range(pp):
        kinds = _stage_kinds(cluster, world, rpn, r * dp * tp, (r + 1) * dp * tp)
        slow = min(kinds, key=lambda k: k.gemm_rate(rpn, 2048, 2048, 2048))
        small = min(k.memory_bytes for k in kinds)
        stream = min((k.stream_rate(rpn) or 0.0) for k in kinds)
        stream_missing |= stream == 0.0
        # a batch split over the rank's threads (parallel/batch_threads.py): each of
        # `split` threads computes cb rows on one core, as split * rpn ranks a node would
        split = batch_split(cfg, kinds, rpn, b)
        crpn, cb = rpn * split, -(-b // split)
        for k in kinds:
            priced_at[k.name] = max(priced_at.get(k.name, 0), crpn)
        cstream = min((k.stream_rate(crpn) or 0.0) for k in kinds)
        causal = kernels != "fused"  # hpctrain's attention skips the masked blocks
        blk_f = cached(block_forward_s, slow, crpn, cb, tp, causal)
        f_bytes, b_bytes, score_bytes = block_stream_bytes(m, cb, tp, sp, kernels, s)
        # recomputation: what a block's backward does again of its forward
        core = cached(attention_forward_s, slow, rpn, b, tp, causal) if rc != "none" else 0.0
        again = {"none": 0.0, "full": blk_f, "selective": core,
                 "attention": core + _gemm(slow, rpn, n_tokens, 3 * m.d_model // tp,
                                           m.d_model)}[rc]
        again_bytes = {"none": 0.0, "full": f_bytes, "selective": score_bytes,
                       "attention": score_bytes}[rc]
        tp_op = tp_collective_s(cluster, tp, s * n_tokens * m.d_model, sp, tp_inter[r])
        times, pieces = {}, {}
        chunks = [c * pp + r for c in range(v)]
        blocks = 0
        act_max = 0
        for k in chunks:
            nb = spans[k][1] - spans[k][0]
            blocks += nb
            first, last = k == 0, k == n_chunks - 1
            fwd = nb * blk_f
            bwd = nb * (2 * blk_f + again)
            ef, eb = nb * f_bytes, nb * (b_bytes + again_bytes)
            comm_f, comm_b = 2 * nb * tp_op, (4 if rc == "full" else 2) * nb * tp_op
            if first:
                e1, e2 = embed_stream_bytes(m, cb, tp, s, sp and kernels != "fused")
                ef, eb = ef + e1, eb + e2
                comm_f += tp_op
            if last:
                hf = cached(head_forward_s, slow, crpn, cb, tp)
                fwd, bwd = fwd + hf, bwd + 2 * hf
                h1, h2 = head_stream_bytes(m, cb, tp, kernels, s, sp)
                ef, eb = ef + h1, eb + h2
                comm_b += tp_op
            if cstream:
                fwd, bwd = fwd + ef / cstream, bwd + eb / cstream
            link_f = 0.0 if last else p2p(r, (k + 1) % pp)  # chunk k + 1's rank
            link_b = 0.0 if first else p2p(r, (k - 1) % pp)
            times[k] = (fwd, bwd, comm_f, comm_b, link_f, link_b)
            if pp == 1:  # the backward's pieces, for when the buckets are ready
                # (head, each block's MLP then attention half from the last block,
                # the embedding; a pipeline reports each chunk whole instead)
                blk_b = 2 * blk_f + again + (4 if rc == "full" else 2) * tp_op \
                    + ((b_bytes + again_bytes) / cstream if cstream else 0.0)
                mlp_f = _gemm(slow, crpn, cb * m.seq_len, m.ffn_dim // tp, m.d_model) \
                    + _gemm(slow, crpn, cb * m.seq_len, m.d_model, m.ffn_dim // tp)
                pieces[k] = (bwd + comm_b - nb * blk_b, nb * [blk_b], min(1.0, mlp_f / blk_f))
            act_max = max(act_max, mem.chunk_activation_bytes(
                m, b, tp, sp, nb, first, last, pp > 1, rc, e.cache,
                e.work if e.work != e.cache else None))
        chunk_times.append(times)
        sizes = mem.rank_param_sizes(m, tp, pp, v, par.balance, r)
        params, grads, optim = mem.state_bytes(sizes, e.state, dp, par.zero, states,
                                               par.bucket_mb, e.master)
        grads += (split - 1) * sum(sizes) * e.state  # each extra thread's gradients
        work = split * mem.workspace_bytes(m, cb, tp, sp, n_chunks - 1 in chunks, e.work)
        work += mem.recompute_bytes(m, b, tp, sp, rc, e.work)  # what a backward makes again
        if e.copies:  # reduced precision: the float32 copies of the piece in backward
            work += mem.precision_copies(m, b, tp, sp, rc, 0 in chunks, blocks > 0,
                                         n_chunks - 1 in chunks, e.work)
        work = max(work, e.state * max(sizes))  # the optimizer's scratch
        buckets = params if par.zero == 2 else 0  # whole gradients during backward
        if par.zero == 3:  # gathered pieces, whole gradients in backward
            buckets = mem.zero3_transient_bytes(m, tp, e.state, sum(sizes), mb,
                                                par.reshard_after_forward, dp, pp > 1)
        retained = 0
        if pp > 1 and practice.keeps_whole_model:  # the other stages' data and grad
            whole = sum(mem.rank_param_sizes(m, tp, 1, 1, par.balance, 0))
            retained = 2 * e.state * max(0, whole - sum(sizes))
        memory = mem.Memory(params, grads, optim, live[r] * act_max, work, buckets, retained)
        # the extra threads' gradients added into the model's, the threads sharing it
        summed = (split - 1) * sum(sizes) * e.state * 3 / split
        per_rank.append(dict(kinds=kinds, slow=slow, small=small, stream=stream,
                             blocks=blocks, chunks=chunks, memory=memory,
                             numel=sum(sizes), pieces=pieces, split=split,
                             grad_sum=summed / cstream if cstream else 0.0))

    makespan, busy, ends = _pipeline(orders, chunk_times, n_chunks, pp, mb, v, replay)
    tied = (tied_exchange_s(cluster, m, tp, s, sends_cross(dp * tp, rpn, 0, pp - 1))
            if pp > 1 else 0.0)
    ranks = []
    for r, info in enumerate(per_rank):
        times = chunk_times[r]
        compute = sum(mb * (f + b_) for f, b_, *_ in times.values()) + info["grad_sum"]
        tp_s = sum(mb * (cf + cb) for _, _, cf, cb, _, _ in times.values())
        link = sum(mb * (lf + lb) for *_, lf, lb in times.values()) \
            + (tied if r in (0, pp - 1) else 0.0)
        bubble = max(0.0, makespan - busy[r])
        # beside the backward, by the node kind slowed most; inside a node no TCP
        slowed = [k.slowdowns(dp_nodes[r]) for k in info["kinds"]]
        slowdowns = ((max(c for c, _ in slowed), max(x for _, x in slowed))
                     if dp_inter[r] else (1.0, 1.0))
        zero_align = dp if par.zero else 1
        planned = grad_buckets(m, tp, pp, v, par.balance, r, s, par.bucket_mb, zero_align)
        if par.grad_comm_dtype == "bf16" and s > 2:  # bf16_reduce: 2 bytes an element sent
            planned = tuple((nbytes * 2 // s, unit) for nbytes, unit in planned)
        if practice.dp_overlap:
            ready = ready_times(info["pieces"], times, ends[r], makespan, pp)
            sums = [(nbytes, ready[unit]) for nbytes, unit in planned]
        else:  # the sum after the backward
            sums = [(nbytes, makespan) for nbytes, _ in planned]
        dp_s = dp_time(cfg, cluster, sums, makespan, rpn, dp_inter[r], slowdowns,
                       max(ends[r].values(), default=makespan), info["numel"] * s)
        passes = (NUMBA_OPT_PASSES if kernels == "numba" else OPT_PASSES).get(t.optimizer, 10)
        opt_bytes = (practice.master_bytes or s) * passes * \
            info["numel"] * (1 if par.zero == 0 else 1 / dp) + s * GRAD_PASSES * info["numel"]
        opt_s = opt_bytes / info["stream"] if info["stream"] else 0.0
        ranks.append(RankCost(r, info["slow"].name, info["blocks"], 0 in info["chunks"],
                              n_chunks - 1 in info["chunks"], live[r], info["memory"],
                              {"compute": compute, "tp": tp_s, "pp_bubble": bubble,
                               "p2p": link, "dp": dp_s, "optimizer": opt_s},
                              info["small"] / rpn, info["split"]))
    for name, used in priced_at.items():
        if beyond := cluster.kinds[name].unmeasured(used):
            measured = "; ".join(f"{t} at {', '.join(map(str, c))}" for t, c in beyond.items())
            notes.append(f"node kind {name!r}: rates measured at fewer ranks a node "
                         f"({measured}) stand in for the {used} this layout computes at "
                         f"once (ranks a node times batch threads), pricing each with "
                         f"more cores than it has: the times are too short")
    if pp > 1 and par.pipeline_training == "local":
        notes.append("pipeline_training 'local' is priced as backpropagation through the "
                     "pipeline: its auxiliary heads and the forward-only pipeline are not "
                     "in the times or the memory")
    if t.recompute_pieces and rc != "none":
        notes.append(f"recompute_pieces {list(t.recompute_pieces)} is priced as {rc!r} "
                     f"recomputation of every block: the blocks kept whole are not in the "
                     f"times or the memory")
    if t.blas_threads and any(t.blas_threads != max(1, k.cores // rpn)
                              for r in per_rank for k in r["kinds"]):
        notes.append(f"blas_threads {t.blas_threads}: the rates are read at a rank's share "
                     f"of its node's cores ({rpn} ranks a node), not at {t.blas_threads} "
                     f"thread(s) a rank")
    if stream_missing:
        notes.append("the cluster gives no stream rate: element-wise work and the "
                     "optimizer update are left out of the times")
    step = max(r.step_s for r in ranks)
    from hpctrain.models.registry import model_class

    flops = model_class(m.kind).model_flops(m, t.batch_size)
    peak = sum(rpn * cluster.kinds[n].peak_rate(rpn) * count for n, count in cluster.nodes)
    return Estimate(cfg, world, rpn, step, t.batch_size * m.seq_len / step,
                    flops / step / peak, ranks, notes)


@lru_cache(maxsize=4096)
def spanning_groups(dp: int, tp: int, pp: int, rpn: int) -> tuple[tuple[bool, ...], ...]:
    """(per pipeline rank: whether one of its tensor groups spans two nodes, the same
    for its data groups) under the block placement, ``rpn`` ranks a node: world rank
    ``(r dp + d) tp + t`` for stage r, data rank d, tensor rank t. A group on two
    nodes runs its collective over the link between them, whatever the group's size
    (a node of 6 cores holds one tensor group of 4 whole and half of the next)."""
    size = dp * tp
    tensor, data = [], []
    for r in range(pp):
        starts = r * size + np.arange(dp) * tp  # each tensor group's first rank
        tensor.append(bool(np.any(starts // rpn != (starts + tp - 1) // rpn)))
        firsts = r * size + np.arange(tp)  # each data group's first rank; its last
        data.append(bool(np.any(firsts // rpn != (firsts + (dp - 1) * tp) // rpn)))
    return tuple(tensor), tuple(data)


@lru_cache(maxsize=4096)
def data_group_nodes(dp: int, tp: int, pp: int, rpn: int) -> tuple[int, ...]:
    """Per pipeline rank, the most nodes one of its data groups spans (placement as
    ``spanning_groups``): the size at which the node kind's slowdowns are read."""
    out = []
    for r in range(pp):
        members = r * dp * tp + np.arange(tp)[:, None] + np.arange(dp)[None, :] * tp
        nodes = members // rpn
        out.append(max(len(np.unique(row)) for row in nodes))
    return tuple(out)


@lru_cache(maxsize=4096)
def sends_cross(size: int, rpn: int, src: int, dst: int) -> bool:
    """Whether a rank of pipeline stage ``src`` and its peer in stage ``dst`` (``size``
    ranks a stage, block placement) sit on different nodes, for some rank."""
    ranks = src * size + np.arange(size)
    return bool(np.any(ranks // rpn != (ranks + (dst - src) * size) // rpn))


def batch_split(cfg: Config, kinds: list[NodeKind], rpn: int, b: int) -> int:
    """The threads a rank of ``kinds`` splits its ``b``-row microbatch over
    (``[parallel] batch_threads``: 0 is the rank's cores, as ``train`` gives its BLAS
    threads, where the layout allows a split), at most one a row; 1 when it does not
    split."""
    from hpctrain.parallel.batch_threads import refusal

    par = cfg.parallel
    if par.batch_threads == 1 or (par.batch_threads == 0
                                  and refusal(cfg.model, par, cfg.train) is not None):
        return 1
    threads = par.batch_threads or max(1, min(k.cores for k in kinds) // rpn)
    return max(1, min(threads, b))


def predict_memory(cfg: Config, practice: Practice = HPCTRAIN) -> list[mem.Memory]:
    """Each pipeline rank's memory terms for a validated ``cfg`` without a cluster
    description: ``estimate``'s on a nominal cluster (the memory terms read no rate)."""
    world = cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp
    kind = {"name": "nominal", "cores": 1, "memory_gib": 1024.0,
            "gemm": {"1": [[64, 1e10], [2048, 1e11]]}, "stream": {"1": 1e10}}
    line = {"latency_s": 1e-5, "bandwidth_Bps": 1e9}
    links = {lvl: dict.fromkeys(("all_reduce", "all_gather", "reduce_scatter", "p2p"), line)
             for lvl in ("intra", "inter")}
    nominal = cluster_from_dict({"name": "nominal", "kinds": [kind], "links": links,
                                 "nodes": [{"kind": "nominal", "count": world}]})
    return [r.memory for r in estimate(cfg, nominal, practice=practice).ranks]


def tied_exchange_s(cluster: Cluster, m: ModelConfig, tp: int, s: int, inter: bool) -> float:
    """The first and the last stage's exchange of the tied token table's gradient
    (``V C / tp`` elements of ``s`` bytes; ``inter``: the two stages on different
    nodes); 0 when the table is not tied."""
    if not m.tie_embeddings:
        return 0.0
    return cluster.collective_time("p2p", 2, s * m.vocab_size * m.d_model / tp, inter)


def p2p_s(cluster: Cluster, nbytes: float, tp: int, sp: bool, inter: bool,
          scatter_gather: bool) -> float:
    """One stage-to-stage message of ``nbytes``. Scatter-gather (Megatron): across
    nodes each of the tp ranks sends its 1/tp over its own link, and the receivers
    all-gather the whole inside the node (not with SP: the message is already a shard)."""
    if scatter_gather and inter and tp > 1 and not sp:
        return (cluster.collective_time("p2p", 2, nbytes / tp, True)
                + cluster.collective_time("all_gather", tp, nbytes, False))
    return cluster.collective_time("p2p", 2, nbytes, inter)


def tp_collective_s(cluster: Cluster, tp: int, nbytes: float, sp: bool, inter: bool) -> float:
    """One tensor-parallel activation exchange of a whole (b, T, C) of ``nbytes``."""
    if tp == 1:
        return 0.0
    if sp:
        return (cluster.collective_time("all_gather", tp, nbytes, inter)
                + cluster.collective_time("reduce_scatter", tp, nbytes, inter))
    return cluster.collective_time("all_reduce", tp, nbytes, inter)


def reduction_s(cluster: Cluster, op: str, dp: int, nbytes: float, rpn: int, tp: int,
                hierarchical: bool, inter: bool) -> float:
    """Seconds of ``op`` (all_reduce / reduce_scatter) of ``nbytes`` over the data group."""
    if dp == 1:
        return 0.0
    if not hierarchical or not inter:
        return cluster.collective_time(op, dp, nbytes, inter)
    local = max(1, min(dp, rpn // tp))  # data-group members on one node
    nodes = dp // local
    return (cluster.collective_time("reduce_scatter", local, nbytes, False)
            + cluster.collective_time(op, nodes, nbytes, True)
            + cluster.collective_time("all_gather", local, nbytes, False))


@lru_cache(maxsize=4096)
def grad_buckets(m: ModelConfig, tp: int, pp: int, v: int, balance: str, pp_rank: int,
                 itemsize: int, bucket_mb: float, align: int) -> tuple[tuple[int, tuple], ...]:
    """The data-parallel buckets of a pipeline rank's gradients, in launch order: (bytes,
    the unit whose end makes the bucket ready). The engine's plan (``data.plan_buckets``
    over the parameters in backward order); the units are what the engine reports
    final: with one pipeline stage the backward's pieces (``("head",)``, ``("mlp", j)``,
    ``("attn", j)`` for block j, ``("embed",)``), with more each model chunk whole
    (``("chunk", k)``) at the end of its last backward."""
    from hpctrain.parallel.data import plan_buckets

    spans = mem.chunk_blocks(m, pp, v, balance)
    backward = [(n, ("chunk", k) if pp > 1 else piece)
                for n, k, piece in reversed(mem.rank_params(m, tp, pp, v, balance, pp_rank))]
    order = {unit: i for i, unit in enumerate(_unit_order(m, pp, spans))}
    out = []
    for first, stop, _, size in plan_buckets([n for n, _ in backward], itemsize, bucket_mb,
                                             align):
        unit = max((u for _, u in backward[first:stop]), key=order.__getitem__)
        out.append((size * itemsize, unit))
    return tuple(out)


def _unit_order(m: ModelConfig, pp: int, spans) -> list[tuple]:
    """The units of ``grad_buckets`` in the order the backward completes them."""
    if pp > 1:
        return [("chunk", k) for k in reversed(range(len(spans)))]
    blocks = range(spans[0][0], spans[-1][1])
    return [("head",)] + [u for j in reversed(blocks) for u in (("mlp", j), ("attn", j))] \
        + [("embed",)]


def ready_times(pieces: dict, times: dict, ends: dict, makespan: float, pp: int) -> dict:
    """Seconds into the step's compute at which each unit of ``grad_buckets`` is final.

    One stage: the last microbatch's backward, which ends at the makespan, runs the head,
    each block's MLP half then its attention half (the block's backward split by their
    GEMM time) from the last block, then the embedding. More stages: each chunk at the
    end of its last backward on this rank, from the schedule's replay (``ends``)."""
    if pp > 1:
        return {("chunk", k): end for k, end in ends.items()}
    (k, (head, blocks, mlp_share)), = pieces.items()
    _, b, _, cb, _, lb = times[k]
    t = makespan - (b + cb + lb)  # the last backward starts
    ready = {("head",): t + head}
    t += head
    for j, blk in zip(reversed(range(len(blocks))), blocks, strict=True):
        t += mlp_share * blk
        ready[("mlp", j)] = t
        t += (1.0 - mlp_share) * blk
        ready[("attn", j)] = t
    ready[("embed",)] = makespan
    return ready


def dp_time(cfg: Config, cluster: Cluster, buckets: list[tuple[float, float]],
            makespan: float, rpn: int, inter: bool, slowdowns: tuple[float, float] = (1.0, 1.0),
            busy_end: float | None = None, grad_bytes: float | None = None) -> float:
    """Exposed seconds per step of the data-parallel sums (module docstring).

    ``buckets``: (bytes, ready seconds) in launch order; ``makespan``: when the step's
    compute ends. The buckets go over the data group one after the other, each when it
    is ready and the one before it is done; what runs past the makespan is exposed.
    ``slowdowns``: the node kind's ``(comm_slowdown, compute_slowdown)``: while a sum
    runs beside the rank's compute (up to ``busy_end``, default the makespan; a
    pipeline stage is idle after its last backward) the sum takes ``comm_slowdown``
    and the compute ``compute_slowdown`` times as long as alone (``beside``)."""
    par = cfg.parallel
    dp, tp = par.dp, par.tp
    if dp == 1:
        return 0.0
    grad_bytes = sum(n for n, _ in buckets) if grad_bytes is None else grad_bytes
    hier = par.dp_reduce == "hierarchical"
    if par.averaging != "sync":
        every = par.average_every
        across = cluster.collective_time("all_reduce", dp, grad_bytes, inter) / every
        if par.averaging == "hierarchical":
            local = max(1, min(dp, rpn // tp))
            return cluster.collective_time("all_reduce", local, grad_bytes, False) + across
        return across
    op = "all_reduce" if par.zero == 0 else "reduce_scatter"
    priced: dict[float, float] = {}  # the buckets are mostly of one size
    sums = []
    for nbytes, ready in buckets:
        if nbytes not in priced:
            priced[nbytes] = reduction_s(cluster, op, dp, nbytes, rpn, tp, hier, inter)
        sums.append((priced[nbytes], ready))
    exposed = beside(sums, makespan, makespan if busy_end is None else busy_end, *slowdowns)
    if par.zero == 0:
        return exposed
    gather = cluster.collective_time("all_gather", dp, grad_bytes, inter)
    if par.zero == 3:  # each microbatch gathers for its forward (and again for its
        # backward when resharding): zero3.py; stages 1-2 gather once, after the update
        gather *= par.microbatches * (2 if par.reshard_after_forward else 1)
    return exposed + gather


def beside(sums: list[tuple[float, float]], makespan: float, busy_end: float,
           comm_slowdown: float = 1.0, compute_slowdown: float = 1.0) -> float:
    """Seconds past ``makespan`` that a rank's step ends, its sums sharing the node with
    its compute.

    ``sums``: (seconds alone, ready time) in launch order, run one after the other,
    each once ready and the one before it done. The rank computes until ``busy_end``
    of its own clock (the schedule without sums, in which the ready times are given;
    a pipeline stage then waits for the others until ``makespan``). While a sum and
    the compute both run, the sum advances at ``1 / comm_slowdown`` of its rate alone
    and the compute at ``1 / compute_slowdown``, so the compute's lost time delays the
    later buckets' readiness and the end of the compute alike; once the compute is
    done, the rest of the sums run at their full rate (a bucket ready after
    ``busy_end`` is ready at that time of the step). Slowdowns of 1: each sum ends at
    ``max(ready, previous end) + seconds``, as on an adapter that moves the bytes
    itself. Approximations: a pipeline rank's waits for the other stages before
    ``busy_end`` count as compute (the replay's spans would tell them apart), and a
    hierarchical sum is slowed whole, its steps inside the node too. Pure."""
    pending = [[took, ready] for took, ready in sums if took > 0]
    t = x = 0.0  # wall clock, and the compute's own clock
    while x < busy_end:  # computing
        active = bool(pending) and pending[0][1] <= x
        dx = 1.0 / compute_slowdown if active else 1.0
        # wall seconds to the next event: the compute's end, the sum's end, the next
        # bucket ready; each lands exactly (no creeping up on it in rounding steps)
        event, dt = "computed", (busy_end - x) / dx
        if active and pending[0][0] * comm_slowdown < dt:
            event, dt = "summed", pending[0][0] * comm_slowdown
        elif not active and pending and (pending[0][1] - x) / dx < dt:
            event, dt = "ready", (pending[0][1] - x) / dx
        t += dt
        if event == "computed":
            x = busy_end
        elif event == "ready":
            x = pending[0][1]
        else:
            x += dt * dx
        if active:
            pending[0][0] -= dt / comm_slowdown
            if event == "summed":
                pending.pop(0)
    end = t  # the compute's end; then the sums alone
    for took, ready in pending:
        end = max(end, ready) + took
    return max(0.0, end - makespan)


def _pipeline(orders, chunk_times, n_chunks: int, pp: int, mb: int, v: int,
              replay: bool) -> tuple[float, list[float], list[dict[int, float]]]:
    """(makespan, busy seconds per rank, per rank the end of each of its chunks' last
    backward) of the compute+tp+p2p operations."""
    def dur(r, k, kind):
        f, b, cf, cb, lf, lb = chunk_times[r][k]
        return f + cf + lf if kind == "F" else b + cb + lb

    busy = [sum(mb * (dur(r, k, "F") + dur(r, k, "B")) for k in chunk_times[r])
            for r in range(pp)]
    if pp == 1:
        return busy[0], busy, [dict.fromkeys(chunk_times[0], busy[0])]
    if not replay:
        worst = max(dur(r, k, "F") + dur(r, k, "B") for r in range(pp) for k in chunk_times[r])
        makespan = max(busy) + (pp - 1) * worst
        return makespan, busy, [dict.fromkeys(chunk_times[r], makespan) for r in range(pp)]
    from hpctrain.parallel import timeline

    compute = []
    for r, ops in enumerate(orders):
        took = {(kind, k): dur(r, k, kind) for k in chunk_times[r] for kind in "FB"}
        compute.append([(kind, k, i, took[kind, k]) for kind, k, i in ops])
    played = timeline.replay(compute, n_chunks)
    ends = [{} for _ in range(pp)]
    for r, spans in enumerate(played.spans):
        for _, stop, kind, k, _ in spans:
            if kind == "B":
                ends[r][k] = max(ends[r].get(k, 0.0), stop)
    return played.makespan, busy, ends
