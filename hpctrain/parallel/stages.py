"""Which pipeline rank holds which pieces of the model: pure arithmetic, tested without MPI.

A model declares its pipeline pieces (``hpctrain.models.protocol``): a ``first``
piece (the GPT's embedding), ``middle`` pieces (its transformer blocks) and a
``last`` piece (the final LayerNorm, the output head and the loss). The model is cut
into ``K = pp * v`` contiguous *model chunks* of middle pieces; model chunk 0 also
holds the first piece, model chunk ``K - 1`` the last. With the interleaved schedule
every rank holds ``v`` chunks, round-robin (Megatron's virtual pipeline)::

    local chunk c of pipeline rank r holds model chunk  k = c * pp + r

    pp = 2, v = 2, 8 blocks, balance "layers":

    model chunk |  0          1          2          3
    rank        |  0          1          0          1
    blocks      |  embed 0 1  2 3        4 5        6 7 head

A microbatch therefore visits the ranks 0 1 0 1 and the activation leaving the last
rank wraps round to rank 0 for its next chunk.

Balancing: ``"layers"`` gives every chunk the same number of middle pieces (earlier
chunks take the remainder, as ``np.array_split`` does); ``"params"`` minimises the
largest cost of any chunk, the costs the model declares per piece (``piece_costs``:
the GPT's are parameter counts), counting the first piece on chunk 0 and the last on
chunk ``K - 1``.

``ModelChunk`` runs the pieces one ChunkSpec selects as one forward and one backward;
everything else here is arithmetic on the costs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpctrain.models.protocol import Pieces


@dataclass(frozen=True)
class ChunkSpec:
    """Model chunk ``index`` of ``n_chunks``: middle pieces ("blocks") ``[start, stop)``,
    plus the first piece (``has_embed``) on chunk 0 and the last (``has_head``) on the
    last chunk; the names are the GPT's."""

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


def costs_of(model) -> Pieces:
    """The per-piece costs of ``model``: its ``Pieces`` of costs as given, or those the
    registered model of a ModelConfig declares (``piece_costs``)."""
    if isinstance(model, Pieces):
        return model
    from hpctrain.models.registry import model_class  # a config: its kind's declaration

    costs = model_class(model.kind).piece_costs(model)
    if costs is None:
        raise ValueError(f"model kind {model.kind!r} declares no pipeline pieces")
    return costs


def block_params(m) -> int:
    """The cost of one middle piece of ModelConfig ``m`` (the GPT: a block's parameters)."""
    return int(costs_of(m).middle[0])


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


def plan(model, pp: int, virtual_stages: int = 1,
         balance: str = "layers") -> list[ChunkSpec]:
    """The ``pp * virtual_stages`` model chunks, in model order. ``model``: the
    ``Pieces`` of costs a model declares, or a ModelConfig (``costs_of``)."""
    n_chunks = pp * virtual_stages
    costs = costs_of(model)
    if balance == "layers":
        sizes = partition([1.0] * len(costs.middle), n_chunks)
    elif balance == "params":
        sizes = partition(list(costs.middle), n_chunks, first=costs.first, last=costs.last)
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
    """The pieces of a model one ChunkSpec selects, run as one forward and one backward.

    ``forward(inp, targets, train=True)``: ``inp`` is the model's input on chunk 0 (the
    GPT's token ids (B, T)), else the activation (B, T, C); returns the output
    activation, or the loss on the last chunk, and the list of piece caches; pieces
    whose ``forward`` takes ``train`` (BatchNorm's: running statistics in evaluation)
    get it. ``backward(dout, caches, input_grad=True)``: ``dout`` is the output
    gradient, or the scalar d(objective)/d(loss) on the last chunk; returns the input
    gradient (None on chunk 0, whose input is data, and with ``input_grad=False``).

    An input gradient nobody reads is not computed where the piece allows it (its
    ``backward`` takes ``need_dx``, as ``Linear``'s does): the first middle piece's
    with ``input_grad=False`` (local losses: nothing goes back a stage), or after a
    first piece without parameters (the CNN's image preparation).
    """

    def __init__(self, spec: ChunkSpec, model):
        pieces = model.pipeline_pieces()
        self.spec = spec
        self.first = pieces.first if spec.has_embed else None
        self.middle = [pieces.middle[j] for j in spec.blocks]
        self.last = pieces.last if spec.has_head else None
        self._takes_train = [takes(part, "forward", "train") for part in self.parts]
        # whether the first middle piece's input gradient feeds a first piece that learns
        self._dx_feeds_first = self.first is not None and bool(self.first.parameters())
        self._skip_dx = bool(self.middle) and takes(self.middle[0], "backward", "need_dx")

    @property
    def parts(self) -> list:
        return ([self.first] if self.first else []) + self.middle + \
            ([self.last] if self.last else [])

    def parameters(self) -> list:
        """Each parameter once (a tied table reached by first and last is one)."""
        seen = {}
        for part in self.parts:
            for p in part.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def forward(self, inp: np.ndarray, targets: np.ndarray | None, train: bool = True):
        caches = []
        x = inp
        modes = iter(self._takes_train)
        if self.first is not None:
            x, cache = _run(self.first, next(modes), train, inp)  # GPT: (B, T) -> (B, T, C)
            caches.append(cache)
        for piece in self.middle:
            x, cache = _run(piece, next(modes), train, x)  # (B, T, C)
            caches.append(cache)
        if self.last is not None:
            loss, cache = _run(self.last, next(modes), train, x, targets)
            caches.append(cache)
            return loss, caches
        return x, caches

    def backward(self, dout, caches: list, input_grad: bool = True) -> np.ndarray | None:
        caches = list(caches)
        dx = dout
        if self.last is not None:
            dx = self.last.backward(dout, caches.pop())  # scalar -> (B, T, C)
        for j in reversed(range(len(self.middle))):
            piece = self.middle[j]
            unread = j == 0 and not (input_grad if self.first is None else self._dx_feeds_first)
            if unread and self._skip_dx:
                dx = piece.backward(dx, caches.pop(), need_dx=False)  # None
            else:
                dx = piece.backward(dx, caches.pop())  # (B, T, C)
        if self.first is not None:
            if self._dx_feeds_first:  # a first piece without parameters has nothing to learn
                self.first.backward(dx, caches.pop())
            return None
        return dx if input_grad else None


def takes(piece, method: str, arg: str) -> bool:
    """Whether ``piece``'s class declares keyword ``arg`` in ``method`` (the class's:
    the wrappers recomputation, precision and ZeRO-3 put on an instance pass keywords
    through)."""
    import inspect

    fn = getattr(type(piece), method, None)
    return fn is not None and arg in inspect.signature(fn).parameters


def forward_eval(piece, x: np.ndarray) -> np.ndarray:
    """A middle (or first) piece's output in evaluation mode (BatchNorm's running
    statistics, for a piece whose ``forward`` takes ``train``)."""
    return _run(piece, takes(piece, "forward", "train"), False, x)[0]


def _run(piece, takes_train: bool, train: bool, *args):
    return piece.forward(*args, train=train) if takes_train else piece.forward(*args)
