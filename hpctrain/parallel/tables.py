"""Embedding tables sharded over a group of ranks: table-, row- and column-wise.

A model's tables (the DLRM's ``self.tables[k]``) are placed over the *table group*
(``Topology.table_comm``: ``table_group`` consecutive data-parallel ranks); the groups
are replicas of each other (``table_replica_comm``), and the dense layers stay data
parallel over the whole data group. Per table (``[parallel] table_sharding``, or
``table_default``; ``place_tables`` resolves it, ``check_sharding`` refuses what cannot
run):

    table       the whole table on one rank (``ranks = [r]``, default the least loaded)
    row         rows in contiguous blocks over ``ranks`` (default the whole group): each
                owner pools the ids that fall in its block, the partial bags are summed
    column      the embedding dimension in equal blocks over ``ranks``; each owner pools
                its columns of every bag, the blocks are put side by side
    replicated  on every rank, its sparse gradient gathered over the data group
                (``sparse_data.SparseDataParallel``, as without sharding)

Every shard is a box ``rows [r0, r1) x columns [c0, c1)`` of its table, and a rank
holds at most one shard of a table (``Shard``). The lookup of one table is a conjugate
pair over ``table_comm`` (``ShardedBag``, swapped in for the model's ``EmbeddingBag``,
with its ``forward(ids)`` / ``backward(dy, cache)``)::

    forward   requester: per shard, the ids of each bag inside the shard's rows, as
              (b, per-bag counts (b,), ids - r0) int64 to the shard's owner
              -> Alltoall of the counts, Alltoallv of the ids
              owner: the sum of its rows over each bag, (b_q, c1 - c0) per requester q
              -> Alltoallv back (sizes known to both sides, no counts)
              requester: y[:, c0:c1] += each shard's block, in shard order; mean pooling
              divides by the bag's size after the sum
    backward  requester: dy (mean: divided by the bag's size), its columns [c0, c1) of
              every bag to each shard's owner -> Alltoallv (sizes known)
              owner: each id of the forward gets its bag's row of dy; all requesters'
              rows added into the shard's ``SparseGrad`` at once (in requester order)

All buffers are NumPy arrays sent with the buffer methods (no pickle); the spans are
``a2a_ids``, ``a2a_pooled`` and ``a2a_grads`` (category ``dp_comm``). After backward a
shard's gradient holds its group's batch; ``ShardedDataParallel.finish_grads`` sums it
over the replicas (``allgather_sparse`` over ``table_replica_comm``, in replica order:
every replica ends with the same floats). The gradient norm adds the shards' squares
over the group (an Allgather, summed in rank order); row-wise AdaGrad on a column shard
needs the mean square over the *whole* row, so the owners of a column-wise table pool
their partial row sums before the update (``ColumnAwareAdaGrad``); lazy Adam is
element-wise and needs nothing.

Checkpoints hold every shard as a box of its table (``Sharding.box``), the optimizer's
state likewise (row-wise AdaGrad's accumulator: the shard's rows), so a run saved at one
sharding loads at any other and serially. The model is built whole from the seed (the
serial initialisation, then each rank keeps a copy of its boxes and drops the rest):
the full tables exist on every rank during construction.

Bad input is refused before any collective, naming the table and the values: the rules
of ``check_sharding`` run in ``Config.validate`` on every rank; an id beyond a table's
rows is refused when the ratings file is read (every rank reads it whole,
``data.ratings``) and again by ``ShardedBag.forward`` on the rank whose batch holds it.

A plan is data (``read_plan``, ``plan_toml``): a TOML file ``hpctrain train --table-plan
FILE`` takes in place of the config's keys, which a planner can write::

    group = 2                 # ranks per table group (0: the whole data group)
    default = "replicated"    # tables not listed
    [[tables]]
    name = "user"
    sharding = "row"
    ranks = [0, 1]            # optional
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from hpctrain import trace
from hpctrain.checkpoint.reshard import Sharding
from hpctrain.checkpoint.state import Held, optimizer_entries, param_sharding
from hpctrain.config import ConfigError, TableSharding, read_toml, toml_string
from hpctrain.nn.embedding import check_ids
from hpctrain.nn.module import Module, SparseParameter, is_sparse
from hpctrain.optim import clip
from hpctrain.optim.optimizers import StateLists
from hpctrain.optim.sparse import RowWiseAdaGrad, make_sparse_optimizer
from hpctrain.parallel.sparse_data import SparseDataParallel, allgather_sparse

KINDS = ("table", "row", "column", "replicated")


# ---------------------------------------------------------------------------------
# the placement: pure, checked once per rank in Config.validate


@dataclass(frozen=True)
class Shard:
    """The box ``rows [r0, r1) x cols [c0, c1)`` of a table, held by group rank ``owner``."""

    owner: int
    rows: tuple[int, int]
    cols: tuple[int, int]

    @property
    def box(self) -> tuple[tuple[int, int], tuple[int, int]]:
        return self.rows, self.cols

    @property
    def elements(self) -> int:
        return (self.rows[1] - self.rows[0]) * (self.cols[1] - self.cols[0])


@dataclass(frozen=True)
class Placement:
    """Where one table (``rows`` x ``dim``) lives: ``kind`` and its ``shards`` (none
    when replicated)."""

    name: str
    kind: str
    rows: int
    dim: int
    shards: tuple[Shard, ...] = ()

    def shard_of(self, owner: int) -> Shard | None:
        return next((s for s in self.shards if s.owner == owner), None)


def _row_blocks(rows: int, n: int) -> list[tuple[int, int]]:
    """``rows`` split into ``n`` contiguous blocks, the first ``rows % n`` one longer."""
    size, extra = divmod(rows, n)
    starts = np.cumsum([0] + [size + (i < extra) for i in range(n)])
    return [(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:], strict=True)]


def group_size(par: Any) -> int:
    """Ranks per table group: ``table_group``, or the whole data group when 0."""
    return par.table_group or par.dp


def place_tables(model: Any, par: Any) -> dict[str, Placement]:
    """Each of ``model.tables`` (a ``ModelConfig``'s, all ``embed_dim`` wide) placed over
    the table group of a ``ParallelConfig`` with ``dp`` resolved; a rule broken is a
    ``ConfigError`` naming the table and the values. Table-wise tables without ranks go,
    in config order, to the rank holding the fewest elements so far (row- and
    column-wise shards counted first), the lowest such rank on a tie."""
    tables = [(t.name, t.rows, model.embed_dim) for t in model.tables]
    if not tables:
        raise ConfigError(f"[parallel] table_sharding, table_default and table_group place "
                          f"embedding tables; model kind {model.kind!r} has none")
    names = [n for n, _, _ in tables]
    G, dp = group_size(par), par.dp
    if par.table_group < 0 or G > dp or dp % G:
        raise ConfigError(f"table_group ({par.table_group}) must divide the data-parallel "
                          f"ranks (dp = {dp}): a table group of {G} ranks needs "
                          f"{'more ranks than exist' if G > dp else 'dp to be a multiple'}")
    if par.tp != 1 or par.pp != 1 or par.sp != 1:
        raise ConfigError(f"sharded tables run with data parallelism only: tp ({par.tp}), "
                          f"pp ({par.pp}) and sp ({par.sp}) must be 1")
    if par.table_default not in KINDS:
        raise ConfigError(f"table_default ({par.table_default!r}) must be one of "
                          f"{', '.join(KINDS)}")
    specs: dict[str, TableSharding] = {}
    for s in par.table_sharding:
        if s.name not in names:
            raise ConfigError(f"table_sharding names table {s.name!r}, which the model does "
                              f"not have; its tables: {names}")
        if s.name in specs:
            raise ConfigError(f"table_sharding places table {s.name!r} twice")
        if s.sharding not in KINDS:
            raise ConfigError(f"table {s.name!r}: sharding ({s.sharding!r}) must be one of "
                              f"{', '.join(KINDS)}")
        specs[s.name] = s
    load = [0] * G
    out: dict[str, Placement] = {}
    later = []
    for name, rows, dim in tables:
        spec = specs.get(name, TableSharding(name, par.table_default))
        kind, ranks = spec.sharding, list(spec.ranks)
        outside = [r for r in ranks if not 0 <= r < G]
        if outside:
            raise ConfigError(f"table {name!r}: {kind}-wise on ranks {ranks} needs a table "
                              f"group of {max(ranks) + 1} ranks; it has {G} (table_group "
                              f"{par.table_group}, dp {dp}): ranks {outside} do not exist")
        if len(set(ranks)) != len(ranks):
            raise ConfigError(f"table {name!r}: ranks {ranks} repeat a rank (a rank holds "
                              f"one shard of a table)")
        if kind == "replicated":
            if ranks:
                raise ConfigError(f"table {name!r}: a replicated table is on every rank; "
                                  f"ranks ({ranks}) must be empty")
            out[name] = Placement(name, kind, rows, dim)
            continue
        if kind == "table":
            if len(ranks) > 1:
                raise ConfigError(f"table {name!r}: table-wise puts the whole table on one "
                                  f"rank; ranks ({ranks}) name {len(ranks)}")
            if not ranks:
                later.append((name, rows, dim))
                continue
            shards = [Shard(ranks[0], (0, rows), (0, dim))]
        else:
            ranks = ranks or list(range(G))
            n = len(ranks)
            if kind == "row" and rows < n:
                raise ConfigError(f"table {name!r}: row-wise over {n} ranks needs at least "
                                  f"{n} rows; it has {rows}")
            if kind == "column" and dim % n:
                raise ConfigError(f"table {name!r}: column-wise over {n} ranks needs its "
                                  f"dimension (embed_dim {dim}) divisible by {n}")
            if kind == "row":
                shards = [Shard(r, blk, (0, dim))
                          for r, blk in zip(ranks, _row_blocks(rows, n), strict=True)]
            else:
                w = dim // n
                shards = [Shard(r, (0, rows), (i * w, (i + 1) * w))
                          for i, r in enumerate(ranks)]
        for s in shards:
            load[s.owner] += s.elements
        out[name] = Placement(name, kind, rows, dim, tuple(shards))
    for name, rows, dim in later:  # table-wise, placed where the fewest elements are
        owner = int(np.argmin(load))
        load[owner] += rows * dim
        out[name] = Placement(name, "table", rows, dim, (Shard(owner, (0, rows), (0, dim)),))
    return {name: out[name] for name in names}


def check_sharding(model: Any, par: Any) -> None:
    """``Config.validate``'s rules for sharded tables (``place_tables`` raising)."""
    place_tables(model, par)


def sharded(par: Any) -> bool:
    """Whether any table is sharded (else every table is replicated, as without this)."""
    return par.table_default != "replicated" or any(
        s.sharding != "replicated" for s in par.table_sharding)


def format_plan(placements: dict[str, Placement], group: int, itemsize: int) -> str:
    """The placement as a table: table, sharding, ranks, bytes on each group rank."""
    lines = [f"{'table':<12} {'sharding':<10} {'ranks':<14} "
             + " ".join(f"{'rank ' + str(r):>12}" for r in range(group))]
    for p in placements.values():
        per = [0] * group
        if p.kind == "replicated":
            per = [p.rows * p.dim * itemsize] * group
        for s in p.shards:
            per[s.owner] += s.elements * itemsize
        ranks = "all" if p.kind == "replicated" else ",".join(str(s.owner) for s in p.shards)
        lines.append(f"{p.name:<12} {p.kind:<10} {ranks:<14} "
                     + " ".join(f"{b:>12,}" for b in per))
    return "\n".join(lines)


def read_plan(path: str) -> dict[str, Any]:
    """A plan file (module docstring) as config overrides (``config.load``'s
    ``{"parallel.table_group": ...}``); unknown keys are ``ConfigError``s."""
    raw = read_toml(path, "table plan")
    bad = sorted(set(raw) - {"group", "default", "tables"})
    if bad:
        raise ConfigError(f"table plan {path!r}: unknown key(s) {bad}; known: default, "
                          f"group, tables")
    out: dict[str, Any] = {"parallel.table_sharding": raw.get("tables", [])}
    if "group" in raw:
        out["parallel.table_group"] = raw["group"]
    if "default" in raw:
        out["parallel.table_default"] = raw["default"]
    return out


def plan_toml(group: int, default: str, tables: list[TableSharding]) -> str:
    """A plan file's text (``read_plan`` reads it back)."""
    lines = [f"group = {group}", f'default = "{default}"']
    for t in tables:
        lines += ["", "[[tables]]", f"name = {toml_string(t.name)}",
                  f'sharding = "{t.sharding}"']
        if t.ranks:
            lines.append(f"ranks = [{', '.join(str(r) for r in t.ranks)}]")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------
# the all-to-all and the layer


def alltoallv(comm: Any, parts: list[np.ndarray], dtype: Any,
              recv_counts: list[int] | None = None) -> list[np.ndarray]:
    """Send ``parts[d]`` to rank d of ``comm``; return what each rank sent here, in rank
    order (collective). ``recv_counts`` (elements from each rank) when both sides know
    them; else one Alltoall of the counts first. Buffer methods only."""
    dtype = np.dtype(dtype)
    if comm.Get_size() == 1:
        return [np.asarray(parts[0], dtype)]
    send_counts = np.array([len(p) for p in parts], np.int64)
    if recv_counts is None:
        got = np.empty(len(parts), np.int64)
        comm.Alltoall(send_counts, got)
        recv_counts = got.tolist()
    send = (np.concatenate(parts).astype(dtype, copy=False) if send_counts.sum()
            else np.empty(0, dtype))
    recv = np.empty(int(sum(recv_counts)), dtype)
    sdispl = np.concatenate([[0], np.cumsum(send_counts)[:-1]]).tolist()
    rdispl = np.concatenate([[0], np.cumsum(recv_counts)[:-1]]).astype(np.int64).tolist()
    comm.Alltoallv([send, (send_counts.tolist(), sdispl)],
                   [recv, (list(recv_counts), rdispl)])
    return np.split(recv, rdispl[1:])


@dataclass
class A2AStats:
    """What the sharded lookups of this rank did since ``take``: rows it looked up as
    an owner, bytes it sent and received in the all-to-alls, and their seconds."""

    lookup_rows: int = 0
    sent_bytes: int = 0
    recv_bytes: int = 0
    a2a_s: float = 0.0
    calls: int = 0
    per_table: dict = field(default_factory=dict)  # name -> seconds in its all-to-alls

    def count(self, name: str, parts: list[np.ndarray], got: list[np.ndarray],
              seconds: float) -> None:
        self.sent_bytes += sum(p.nbytes for p in parts)
        self.recv_bytes += sum(g.nbytes for g in got)
        self.a2a_s += seconds
        self.calls += 1
        self.per_table[name] = self.per_table.get(name, 0.0) + seconds

    def take(self) -> dict[str, float]:
        out = {"lookup_rows": self.lookup_rows, "a2a_sent_bytes": self.sent_bytes,
               "a2a_recv_bytes": self.recv_bytes, "a2a_s": self.a2a_s}
        self.lookup_rows = self.sent_bytes = self.recv_bytes = self.calls = 0
        self.a2a_s = 0.0
        self.per_table = {}
        return out


class ShardParameter(SparseParameter):
    """A table's shard: the box ``box`` of the table of ``global_shape``."""

    __slots__ = ("box", "global_shape")

    def __init__(self, data: np.ndarray, global_shape: tuple[int, int], box):
        super().__init__(data)
        self.global_shape, self.box = tuple(global_shape), tuple(box)


class OwnerPart(NamedTuple):
    source: int  # the requesting group rank
    b: int  # its bags
    bag: np.ndarray  # (n,) each id's bag
    local: np.ndarray  # (n,) each id's row in the shard


class ShardedBagCache(NamedTuple):
    b: int
    scale: np.ndarray | None  # (b,) 1 / max(bag size, 1) for mean pooling
    owned: list[OwnerPart]


def _pool_sum(W: np.ndarray, local: np.ndarray, lens: np.ndarray, b: int) -> np.ndarray:
    """(b, cols) sums of ``W[local]`` over consecutive bags of ``lens`` ids."""
    out = np.zeros((b, W.shape[1]), W.dtype)
    if len(local) == 0:
        return out
    rows = W[local]
    filled = lens > 0
    if lens.max() == 1:
        out[filled] = rows
    else:
        starts = np.cumsum(lens) - lens
        out[filled] = np.add.reduceat(rows, starts[filled], axis=0)
    return out


class ShardedBag(Module):
    """``EmbeddingBag``'s interface over a table sharded on ``comm`` (the table group):
    ``weight`` is this rank's shard (a ``ShardParameter``) or None; see the module
    docstring for the exchange. ``stats`` counts the all-to-alls (benchmarks)."""

    def __init__(self, placement: Placement, table: np.ndarray, *, pooling: str, comm: Any,
                 stats: A2AStats | None = None):
        self.name, self.pooling, self.kind = placement.name, pooling, placement.kind
        self.rows, self.dim = placement.rows, placement.dim
        self.shards = placement.shards
        self.comm, self.stats = comm, stats if stats is not None else A2AStats()
        self.dtype = table.dtype
        mine = placement.shard_of(comm.Get_rank())
        self.weight = None
        if mine is not None:
            (r0, r1), (c0, c1) = mine.box
            self.weight = ShardParameter(table[r0:r1, c0:c1].copy(), table.shape, mine.box)
        self.mine = mine

    def _exchange(self, what: str, parts: list[np.ndarray], dtype: Any,
                  counts: list[int] | None = None) -> list[np.ndarray]:
        t0 = time.perf_counter()
        with trace.span(what, "dp_comm", comm="table_comm", table=self.name):
            got = alltoallv(self.comm, parts, dtype, counts)
        self.stats.count(self.name, parts, got, time.perf_counter() - t0)
        return got

    def forward(self, ids: np.ndarray) -> tuple[np.ndarray, ShardedBagCache]:
        # ids (b, w) int, -1 empty -> y (b, dim)
        ids = np.asarray(ids, np.int64)
        check_ids(ids, self.rows, self.name)  # before the collectives
        b = len(ids)
        G = self.comm.Get_size()
        send = [np.empty(0, np.int64)] * G
        for s in self.shards:
            r0, r1 = s.rows
            inside = (ids >= r0) & (ids < r1) if self.kind == "row" else ids >= 0
            send[s.owner] = np.concatenate([[b], inside.sum(axis=1), ids[inside] - r0])
        got = self._exchange("a2a_ids", send, np.int64)
        owned, back = [], [np.empty(0, self.dtype)] * G
        if self.mine is not None:
            W = self.weight.data
            for q, msg in enumerate(got):
                if len(msg) == 0:
                    continue
                bq = int(msg[0])
                lens, local = msg[1:1 + bq], msg[1 + bq:]
                self.stats.lookup_rows += len(local)
                back[q] = _pool_sum(W, local, lens, bq).reshape(-1)
                owned.append(OwnerPart(q, bq, np.repeat(np.arange(bq), lens), local))
        widths = {s.owner: s.cols[1] - s.cols[0] for s in self.shards}
        pooled = self._exchange("a2a_pooled", back, self.dtype,
                                [b * widths.get(d, 0) for d in range(G)])
        y = np.zeros((b, self.dim), self.dtype)
        for s in self.shards:  # row-wise partial bags summed in shard order
            y[:, s.cols[0]:s.cols[1]] += pooled[s.owner].reshape(b, -1)
        scale = None
        if self.pooling == "mean":
            scale = 1.0 / np.maximum((ids >= 0).sum(axis=1), 1)  # (b,)
            y *= scale[:, None]
        return y, ShardedBagCache(b, scale, owned)

    def backward(self, dy: np.ndarray, cache: ShardedBagCache) -> None:
        # dy (b, dim): each shard's columns to its owner, which adds its rows' gradient
        if cache.scale is not None:
            dy = dy * cache.scale[:, None]
        G = self.comm.Get_size()
        send = [np.empty(0, self.dtype)] * G
        for s in self.shards:
            send[s.owner] = np.ascontiguousarray(dy[:, s.cols[0]:s.cols[1]],
                                                 self.dtype).reshape(-1)
        width = 0 if self.mine is None else self.mine.cols[1] - self.mine.cols[0]
        counts = [0] * G
        for part in cache.owned:
            counts[part.source] = part.b * width
        got = self._exchange("a2a_grads", send, self.dtype, counts)
        if cache.owned:
            rows = np.concatenate([p.local for p in cache.owned])
            values = np.concatenate([got[p.source].reshape(p.b, width)[p.bag]
                                     for p in cache.owned])
            self.weight.grad.add(rows, values)
        return None


# ---------------------------------------------------------------------------------
# optimizers and the data-parallel wrapper


class NoTables(StateLists):
    """The sparse optimizer of a rank holding no table at all: it only counts steps."""

    _state_lists = ()

    def __init__(self):
        self.names, self.params, self.t = [], [], 0

    def zero_grad(self) -> None:
        pass

    def step(self, lr: float | None = None) -> None:
        self.t += 1


class ColumnAwareAdaGrad(RowWiseAdaGrad):
    """Row-wise AdaGrad whose accumulator, for a column shard, adds the mean square of
    the whole row (``row_mean_sq[k]``, set before each step by the owners' exchange)
    instead of its own columns'; other tables as ``RowWiseAdaGrad``."""

    row_mean_sq: list

    def _update(self, k, W, rows, g, lr):
        full = self.row_mean_sq[k]
        if full is None:
            return super()._update(k, W, rows, g, lr)
        acc = self.acc[k][rows] + full  # (n,)
        self.acc[k][rows] = acc
        W[rows] -= g * (lr / (np.sqrt(acc) + self.eps))[:, None]
        return None


def shard_tables(model: Any, placements: dict[str, Placement], comm: Any,
                 stats: A2AStats) -> None:
    """Swap each sharded table of ``model.tables`` for a ``ShardedBag`` holding this
    rank's box (a copy; the whole table is dropped)."""
    for k, table in enumerate(model.tables):
        p = placements[table.name]
        if p.kind != "replicated":
            model.tables[k] = ShardedBag(p, table.weight.data, pooling=table.pooling,
                                         comm=comm, stats=stats)


class ShardedDataParallel(SparseDataParallel):
    """``SparseDataParallel`` with some tables sharded over the table group.

    Per step: the dense buckets over the data group and the replicated tables' gather
    (as ``SparseDataParallel``), then each shard's gradient summed over the replicas;
    the norm adds the shards over the group; AdaGrad on column shards gets the whole
    rows' mean squares first. ``held_tensors`` gives shards as boxes of their tables.
    """

    def __init__(self, engine: Any, optimizer: Any, topo: Any,
                 placements: dict[str, Placement], stats: A2AStats, *, bucket_mb: float,
                 launch=None):
        super().__init__(engine, optimizer, topo.dp_comm, bucket_mb=bucket_mb, launch=launch)
        self.shards = [p for p in self.tables if isinstance(p, ShardParameter)]
        self.tables = [p for p in self.tables if not isinstance(p, ShardParameter)]
        self.table_comm, self.replica_comm = topo.table_comm, topo.table_replica_comm
        self.placements, self.stats = placements, stats
        self.shard_rows = 0
        # the column-wise tables, in model order, with this rank's shard's optimizer slot
        sparse = optimizer.sparse
        slot = {id(p): k for k, p in enumerate(sparse.params)}
        self.columns = []  # (placement, optimizer slot or None)
        for table in engine.model.tables:
            pl = placements[table.name]
            if pl.kind == "column" and isinstance(sparse, ColumnAwareAdaGrad):
                held = getattr(table, "weight", None)
                self.columns.append((pl, None if held is None else slot[id(held)]))

    def finish_grads(self) -> None:
        super().finish_grads()
        if self.replica_comm is not None and self.replica_comm.Get_size() > 1:
            with trace.span("shard_grads", "dp_comm", comm="table_replica_comm"):
                allgather_sparse([p.grad for p in self.shards], self.replica_comm)
        self.shard_rows = sum(len(p.grad.rows) for p in self.shards)

    def grad_norm(self) -> float:
        same = [p for p in self.engine.params if not isinstance(p, ShardParameter)]
        total = clip.grad_sq_sum(same)  # the same on every rank
        mine = np.array([clip.grad_sq_sum(self.shards)])
        if self.table_comm.Get_size() > 1:
            every = np.empty(self.table_comm.Get_size())
            self.table_comm.Allgather(mine, every)
            mine = every  # added in rank order: the same float on every rank
        return float(np.sqrt(total + sum(mine.tolist())))

    def _column_row_means(self) -> None:
        """Each column shard's rows: the mean over the whole row of its squared
        gradient, from every owner's partial sums (collective over the table group)."""
        opt = self.optimizer.sparse
        opt.row_mean_sq = [None] * len(opt.params)
        if not self.columns:
            return
        partial, counts = [], np.zeros(len(self.columns), np.int64)
        for j, (_, slot) in enumerate(self.columns):
            if slot is not None:
                g = opt.params[slot].grad.values
                partial.append(np.einsum("nd,nd->n", g, g))
                counts[j] = len(g)
        G = self.table_comm.Get_size()
        every = counts[None, :].copy()  # (G, column tables) gradient rows of each owner
        if G > 1:
            every = np.empty((G, len(self.columns)), np.int64)
            self.table_comm.Allgather(counts, every)
        dtype = opt.params[0].data.dtype if opt.params else np.float64
        mine = np.concatenate(partial).astype(dtype) if partial else np.empty(0, dtype)
        sizes = every.sum(axis=1)
        flat = np.empty(int(sizes.sum()), dtype)
        if G > 1:
            displ = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
            self.table_comm.Allgatherv(mine, [flat, (sizes.tolist(), displ)])
        else:
            flat[...] = mine
        at = np.concatenate([[0], np.cumsum(every.reshape(-1))])  # (rank, table) offsets
        for j, (pl, slot) in enumerate(self.columns):
            if slot is None:
                continue
            n = counts[j]
            total = np.zeros(n, dtype)
            for r in range(G):  # rank order: the same floats on every owner
                if every[r, j]:
                    if every[r, j] != n:
                        raise RuntimeError(f"table {pl.name!r}: column shards hold "
                                           f"{every[r, j]} and {n} gradient rows")
                    i = r * len(self.columns) + j
                    total += flat[at[i]:at[i + 1]]
            opt.row_mean_sq[slot] = total / pl.dim

    def step(self, lr: float) -> None:
        if isinstance(self.optimizer.sparse, ColumnAwareAdaGrad):
            self._column_row_means()
        self.optimizer.step(lr)

    def metrics(self) -> dict[str, float]:
        return {**super().metrics(), "shard_rows": self.shard_rows, **self.stats.take()}

    def held_tensors(self, engine: Any, tp_rank: int, tp_size: int) -> list[Held]:
        """Parameters and optimizer state; a shard (and its state) as its box of the
        table, AdaGrad's accumulator as the shard's rows."""
        params = dict(engine.named_params)

        def sharding(p, array):
            if isinstance(p, ShardParameter):
                if array.ndim == 1:  # a value per row
                    return Sharding(p.global_shape[:1], box=p.box[:1])
                return Sharding(p.global_shape, box=p.box)
            if is_sparse(p):
                return Sharding(array.shape)
            return param_sharding(p, tp_rank, tp_size)

        held = [Held(f"model/{name}", p.data, sharding(p, p.data))
                for name, p in engine.named_params]
        for state, name, _, array in optimizer_entries(self.optimizer, sliced=False):
            held.append(Held(f"optim/{state}/{name}", array, sharding(params[name], array)))
        return held


def make_sharded_data_parallel(cfg: Any, engine: Any, topo: Any, make_dense, launch=None):
    """Shard the engine's model's tables as ``[parallel]`` says, then the optimizers
    (``make_dense(named)``: the dense one, None for no parameters; the tables' over
    this rank's shards and the replicated tables) and the wrapper."""
    placements = place_tables(cfg.model, cfg.parallel)
    stats = A2AStats()
    shard_tables(engine.model, placements, topo.table_comm, stats)
    engine.named_params = engine.model.named_parameters()
    engine.params = [p for _, p in engine.named_params]
    dense = [(n, p) for n, p in engine.named_params if not is_sparse(p)]
    tables = [(n, p) for n, p in engine.named_params if is_sparse(p)]
    sparse = make_sparse_optimizer(cfg.train, tables) if tables else NoTables()
    if isinstance(sparse, RowWiseAdaGrad):
        # the factory's arguments stay in one place; the column shards' rule is added
        sparse.__class__ = ColumnAwareAdaGrad
        sparse.row_mean_sq = [None] * len(sparse.params)
    from hpctrain.optim.sparse import TablesAndDense

    t = cfg.train
    optimizer = TablesAndDense(make_dense(dense), sparse, (t.sparse_lr or t.lr) / t.lr)
    return ShardedDataParallel(engine, optimizer, topo, placements, stats,
                               bucket_mb=cfg.parallel.bucket_mb, launch=launch)
