"""Which pipeline rank holds which part of the GPT: pure arithmetic, tested without MPI.

The model is cut into ``K = pp * v`` contiguous *model chunks* of transformer blocks.
Model chunk 0 also holds the embedding, model chunk ``K - 1`` the final LayerNorm,
the output head and the loss. With the interleaved schedule every rank holds ``v``
chunks, round-robin (Megatron's virtual pipeline)::

    local chunk c of pipeline rank r holds model chunk  k = c * pp + r

    pp = 2, v = 2, 8 blocks, balance "layers":

    model chunk |  0          1          2          3
    rank        |  0          1          0          1
    blocks      |  embed 0 1  2 3        4 5        6 7 head

A microbatch therefore visits the ranks 0 1 0 1 and the activation leaving the last
rank wraps round to rank 0 for its next chunk.

Balancing: ``"layers"`` gives every chunk the same number of blocks (earlier chunks
take the remainder, as ``np.array_split`` does); ``"params"`` minimises the largest
parameter count of any chunk, counting the embedding on chunk 0 and the head on chunk
``K - 1`` (with tied embeddings the last chunk holds a copy of the token table, and it
is counted there too).

``ModelChunk`` runs the embed, blocks and head one ChunkSpec selects as one forward
and one backward; everything else here is arithmetic on the config.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpctrain.config import ModelConfig


@dataclass(frozen=True)
class ChunkSpec:
    """Model chunk ``index`` of ``n_chunks``: blocks ``[start, stop)``, plus the ends."""

    index: int
    n_chunks: int
    start: int
    stop: int

    @property
    def has_embed(self) -> bool:
        return self.index == 0

    @property
    def has_head(self) -> bool:
        return self.index == self.n_chunks - 1

    @property
    def blocks(self) -> range:
        return range(self.start, self.stop)


def model_chunk(local: int, pp_rank: int, pp: int) -> int:
    """Local chunk ``local`` of pipeline rank ``pp_rank`` -> model chunk index."""
    return local * pp + pp_rank


def chunk_owner(k: int, pp: int) -> tuple[int, int]:
    """Model chunk ``k`` -> (pipeline rank, local chunk) that holds it."""
    return k % pp, k // pp


def block_params(m: ModelConfig) -> int:
    """Parameters of one transformer block: two LayerNorms, attention, MLP."""
    c, f = m.d_model, m.ffn_dim
    return 2 * 2 * c + (c * 3 * c + 3 * c) + (c * c + c) + (c * f + f) + (f * c + c)


def end_params(m: ModelConfig) -> tuple[int, int]:
    """(embedding parameters, head parameters) as held by the first and last chunk."""
    embed = m.vocab_size * m.d_model + m.seq_len * m.d_model  # wte + wpe
    head = 2 * m.d_model + m.d_model * m.vocab_size  # ln_f + lm_head (or the tied copy)
    return embed, head


def partition(costs: list[float], n_chunks: int, *, first: float = 0.0,
              last: float = 0.0) -> list[int]:
    """Split ``costs`` (one per block) into ``n_chunks`` contiguous non-empty runs.

    Minimises the largest run cost, where run 0 also pays ``first`` and the last run
    ``last``; among those splits, takes the most even one (least sum of squared run
    costs), and among equally even ones gives earlier runs more blocks. Returns the
    number of blocks in each run.
    """
    n = len(costs)
    if not 1 <= n_chunks <= n:
        raise ValueError(f"n_chunks ({n_chunks}) must be between 1 and the number of "
                         f"blocks ({n})")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def run(i: int, j: int) -> float:  # the cost of blocks [i, j) as one run
        return prefix[j] - prefix[i] + (first if i == 0 else 0.0) + (last if j == n else 0.0)

    # the optimal bound is the cost of some run: binary search over the candidates
    candidates = sorted({run(i, j) for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(costs, n_chunks, first, last, candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    bound = candidates[lo]
    # under that bound, the most even split: dynamic programme over (runs, blocks used)
    best: dict[tuple[int, int], tuple[float, list[int]]] = {(0, 0): (0.0, [])}
    for k in range(1, n_chunks + 1):
        for j in range(k, n - (n_chunks - k) + 1):
            options = [(best[k - 1, i][0] + run(i, j) ** 2, best[k - 1, i][1] + [j - i])
                       for i in range(k - 1, j) if (k - 1, i) in best and run(i, j) <= bound]
            if options:
                best[k, j] = min(options, key=lambda o: (o[0], [-s for s in o[1]]))
    return best[n_chunks, n][1]


def _fits(costs, n_chunks, first, last, bound) -> bool:
    """Whether some split keeps every run within ``bound``: greedy left-to-right fill,
    each run as long as it may be while leaving a block for every later run."""
    n, start = len(costs), 0
    for c in range(n_chunks):
        remaining = n_chunks - c - 1
        stop, total = start, first if c == 0 else 0.0
        while stop < n - remaining:
            extra = last if stop + 1 == n else 0.0
            if total + costs[stop] + extra > bound and stop > start:
                break
            total += costs[stop]
            stop += 1
        if total + (last if stop == n else 0.0) > bound:
            return False
        start = stop
    return start == n


def plan(m: ModelConfig, pp: int, virtual_stages: int = 1,
         balance: str = "layers") -> list[ChunkSpec]:
    """The ``pp * virtual_stages`` model chunks of a GPT, in model order."""
    n_chunks = pp * virtual_stages
    if balance == "layers":
        sizes = partition([1.0] * m.n_layer, n_chunks)
    elif balance == "params":
        embed, head = end_params(m)
        sizes = partition([float(block_params(m))] * m.n_layer, n_chunks,
                          first=embed, last=head)
    else:
        raise ValueError(f"balance ({balance!r}) must be 'layers' or 'params'")
    specs, start = [], 0
    for k, size in enumerate(sizes):
        specs.append(ChunkSpec(k, n_chunks, start, start + size))
        start += size
    return specs


def rank_chunks(specs: list[ChunkSpec], pp_rank: int, pp: int) -> list[ChunkSpec]:
    """The chunks pipeline rank ``pp_rank`` holds, by local index."""
    v = len(specs) // pp
    return [specs[model_chunk(c, pp_rank, pp)] for c in range(v)]


class ModelChunk:
    """The parts of a GPT one ChunkSpec selects, run as one forward and one backward.

    ``forward(inp, targets)``: ``inp`` is the token ids (B, T) on chunk 0, else the
    activation (B, T, C); returns the output activation (B, T, C), or the loss on the
    last chunk, and the list of part caches. ``backward(dout, caches)``: ``dout`` is
    the output gradient (B, T, C), or the scalar d(objective)/d(loss) on the last
    chunk; returns the input gradient (None on chunk 0, whose input is integer).
    """

    def __init__(self, spec: ChunkSpec, model):
        self.spec = spec
        self.embed = model.embed if spec.has_embed else None
        self.blocks = [model.blocks[j] for j in spec.blocks]
        self.head = model.head if spec.has_head else None

    @property
    def parts(self) -> list:
        return ([self.embed] if self.embed else []) + self.blocks + \
            ([self.head] if self.head else [])

    def parameters(self) -> list:
        """Each parameter once (a tied table reached by embed and head is one)."""
        seen = {}
        for part in self.parts:
            for p in part.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def forward(self, inp: np.ndarray, targets: np.ndarray | None):
        caches = []
        x = inp
        if self.embed is not None:
            x, cache = self.embed.forward(inp)  # (B, T) -> (B, T, C)
            caches.append(cache)
        for block in self.blocks:
            x, cache = block.forward(x)  # (B, T, C)
            caches.append(cache)
        if self.head is not None:
            loss, cache = self.head.forward(x, targets)
            caches.append(cache)
            return loss, caches
        return x, caches

    def backward(self, dout, caches: list) -> np.ndarray | None:
        caches = list(caches)
        dx = dout
        if self.head is not None:
            dx = self.head.backward(dout, caches.pop())  # scalar -> (B, T, C)
        for block in reversed(self.blocks):
            dx = block.backward(dx, caches.pop())  # (B, T, C)
        if self.embed is not None:
            self.embed.backward(dx, caches.pop())
            return None
        return dx
