"""ZeRO 3's build: the model drawn a piece at a time, each piece sharded at once.

Every rank draws the whole model from the global seed, so the weights are the serial
model's at any layout, but no rank holds it whole: a model that ``builds_by_piece``
(``hpctrain.models.protocol``; the GPT) hands each pipeline piece, as soon as it is
built, to a ``PieceSharder``, which keeps this rank's 1/dp shard of the piece's new
parameters (a ``zero3.Unit``, the layout ``Zero3DataParallel`` runs) and replaces
their arrays by placeholders before the next piece is drawn (FSDP's deferred
initialisation). dp = 2, a GPT of L blocks::

    draw embed | shard, drop | draw block 0 | shard, drop | ... | draw head | shard, drop
    held       shards so far + the piece being drawn (its float32 arrays, the float64
               draw of its largest weight), never the whole model

A piece this rank's engine does not run (another pipeline stage's) is dropped whole
as it is built, except the first piece's parameters: the last piece may share them
(the tied token table, the one sharing a pipeline allows), so they wait until the
build ends and only those the last piece does not use are then dropped.

A model that does not build by piece, or whose one ZeRO-3 piece is the whole model
(it declares no pieces, or does not run them at pp = 1), is built whole and sharded by
``Zero3DataParallel`` afterwards, as is any model under tensor parallelism, whose
layers are sliced after the build (``engine.build_engine``): the whole model once
(a parameter's gradient is allocated when first read, never during the build).
"""

from __future__ import annotations

from typing import Any

from hpctrain.models.build import build_model
from hpctrain.models.registry import model_class
from hpctrain.parallel import stages
from hpctrain.parallel.zero3 import Unit, _absent, _no_grad


def held_pieces(cls: Any, cfg: Any, pp_rank: int, pp: int) -> list[int] | None:
    """The model pieces this rank's engine runs, by their index in build order (0 the
    first piece, 1..n the middle ones, n + 1 the last), in the engine's order
    (``zero3.engine_pieces``); None when its one ZeRO-3 piece is the whole model."""
    costs = cls.piece_costs(cfg.model)
    if costs is None or (pp == 1 and not cls.runs_its_pieces):
        return None
    n = len(costs.middle)
    if pp == 1:
        return list(range(n + 2))
    par = cfg.parallel
    held = []
    for spec in stages.rank_chunks(stages.plan(costs, pp, par.virtual_stages, par.balance),
                                   pp_rank, pp):
        held += ([0] if spec.has_embed else []) + [1 + j for j in spec.blocks] + \
            ([n + 1] if spec.has_head else [])
    return held


class PieceSharder:
    """The ``on_piece`` of a model's build: the units of the pieces ``held`` (indices
    in build order, ascending), each made as its piece is handed over; the parameters
    of the other pieces dropped (placeholders). Local work only: no collective."""

    def __init__(self, held: list[int], dp_comm: Any):
        self.held = set(held)
        self.last_held = max(held)
        self.dp_size, self.dp_rank = dp_comm.Get_size(), dp_comm.Get_rank()
        self.units: list[Unit] = []
        self.pieces = 0  # handed over so far
        self._sharded: set[int] = set()  # ids of the parameters in a unit
        self._dropped: set[int] = set()
        self._waiting: list = []  # the first piece's parameters, when it is not held

    def __call__(self, piece: Any) -> None:
        k, self.pieces = self.pieces, self.pieces + 1
        waiting = set(map(id, self._waiting))
        new = [p for p in piece.parameters() if id(p) not in self._sharded]
        if k not in self.held:
            if k == 0:
                self._waiting = new
            else:
                self._drop([p for p in new if id(p) not in waiting])
            return
        gone = [p for p in new if id(p) in self._dropped]
        if gone:
            raise ValueError(f"model piece {k} uses {len(gone)} parameter(s) of a piece this "
                             f"rank does not hold, dropped during ZeRO-3's build (only the "
                             f"first and last pieces may share parameters): {gone[:3]}")
        if new:
            self.units.append(Unit(len(self.units), new, self.dp_size, self.dp_rank))
            self._sharded.update(map(id, new))

    def finish(self) -> list[Unit]:
        """After the build: drop what waited for the last piece; the units."""
        if self.pieces <= self.last_held:
            raise ValueError(f"the model's build handed over {self.pieces} piece(s); this "
                             f"rank's engine runs piece {self.last_held}")
        self._drop([p for p in self._waiting if id(p) not in self._sharded])
        self._waiting = []
        return self.units

    def _drop(self, params: list) -> None:
        for p in params:
            p.data, p.grad = _absent(p.shape, p.data.dtype), _no_grad(p.data.dtype)
            self._dropped.add(id(p))


def build_sharded(cfg: Any, topo: Any):
    """``(model, units)``: the model of ``cfg`` from its seed, this rank's pieces
    sharded over ``topo.dp_comm`` as they were built (units None: built whole, for
    ``Zero3DataParallel`` to shard)."""
    cls = model_class(cfg.model.kind)
    held = held_pieces(cls, cfg, topo.pp_rank, topo.pp_size) if cls.builds_by_piece else None
    if held is None:
        return build_model(cfg.model, cfg.train.seed), None
    sharder = PieceSharder(held, topo.dp_comm)
    model = build_model(cfg.model, cfg.train.seed, on_piece=sharder)
    return model, sharder.finish()
