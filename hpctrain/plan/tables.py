"""The embedding-table sharding planner: each rank's predicted step, and a greedy choice.

``rank_costs(work, placements, rates)`` predicts, for every rank of a table group of
``G`` ranks, the step of a DLRM whose tables are placed as ``placements`` say
(``parallel.tables.place_tables``), from rates measured on this machine
(``plan/tables_calibrate.py``, ``Rates``). Per step, with ``b`` samples per rank and
``n_t = b * ids_t`` ids of table t per rank (``ids_t``: filled slots per sample), ids
drawn uniformly over a table's rows:

    forward   replicated t: pool n_t rows of d                        pool(n_t, d)
              sharded t: route each id to its owners                  route * n_t * shards
                         3 exchanges (counts, ids, pooled blocks)     3 a2a(bytes)
                         its own work outside those (half of)         shard_s / 2
                         owner of shard s (rows R_s, cols w_s):       pool(G n_t R_s/R, w_s)
    backward  replicated t: add n_t rows to its SparseGrad            grad(n_t, d)
              sharded t: 1 exchange (dy blocks)                       a2a(b w_s per shard)
                         and the other half of its own work           shard_s / 2
                         owner: add its G n_t R_s/R rows              grad(., w_s)
    sync      replicated tables: one gather of every rank's unique    3 gather(bytes)
              rows (row ids and values, all tables at once) and       grad(G u_t, d)
              their merge
              column-wise with row-wise AdaGrad: the owners' row sums 2 gather
    update    the optimizer on each unique row a rank updates: the    update(u, w)
              global batch's for a replicated table, the group's in
              the shard for a sharded one
    dense     the MLPs, the interaction, the bias tables (forward,    dense[term] b / dense_b
              backward), the dense all-reduce (sync) and optimizer
              (update): measured per term, added to each

    a2a(x)    = a2a.latency_s + max(sent, received) / a2a.bytes_per_s   (one Alltoallv)
    pool(n, w) = n * (row_s + w * itemsize * byte_s), at the cached rate when the shard
                fits the last-level cache (``cache_bytes``), else the uncached one;
                grad and update likewise
    u(R, n)   = R (1 - (1 - 1/R)^n)   distinct rows among n uniform draws from R

Every collective makes the ranks wait for each other, so a rank's measured step is the
slowest rank's work plus the exchanges: ``Prediction.step_s`` is that, the same for
every rank; ``RankCost.own_s`` is a rank's own work (what the greedy balances).

Memory per rank: each shard (or replicated table) and its optimizer state (row-wise
AdaGrad one value per row, Adam two per element), ``memory_bytes``.

``plan_tables``: largest tables first (by bytes), each given the candidate placement
(replicated; table-wise on each rank; row-wise over the group; column-wise over the
group when the dimension divides) that keeps the largest predicted per-rank time
lowest (then the total, then the fullest rank's memory) among those that fit every
rank's memory with room left for the tables still to place, each at its smallest. The
gather's latencies are left out of that comparison: paid once for all replicated
tables, they would otherwise push the first small table to be sharded to avoid them
(and then every one after it). A table that fits nowhere is a ``PlanError`` naming
it, its bytes, the memory per rank and the closest miss.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from hpctrain.config import ConfigError, TableSharding
from hpctrain.parallel.tables import Placement, format_plan, place_tables, plan_toml

OPTIMIZERS = ("rowwise_adagrad", "adam")
TERMS = ("fwd", "bwd", "sync", "update")


class PlanError(ConfigError):
    """A table that fits no placement, or a plan over the memory per rank."""


# ---------------------------------------------------------------------------------
# inputs


@dataclass(frozen=True)
class TableLoad:
    """One table: ``rows`` x ``dim``, ``ids`` filled slots per sample (a bag's mean)."""

    name: str
    rows: int
    dim: int
    ids: float = 1.0


@dataclass(frozen=True)
class Workload:
    """The tables of a model and a step: ``batch`` samples per rank, the tables'
    element size and sparse optimizer."""

    tables: tuple[TableLoad, ...]
    batch: int
    itemsize: int = 4
    optimizer: str = "rowwise_adagrad"

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"sparse optimizer ({self.optimizer!r}) must be one of "
                              f"{OPTIMIZERS}")
        dims = {t.dim for t in self.tables}
        if len(dims) > 1:
            raise ConfigError(f"the tables' dimensions must be equal (embed_dim); got {dims}")


def workload_of(model: Any, batch: int, optimizer: str, bag_fill: float = 1.0) -> Workload:
    """A ``ModelConfig``'s tables: a bag (width > 1) fills ``bag_fill`` of its slots."""
    itemsize = 8 if model.dtype == "float64" else 4
    return Workload(tuple(TableLoad(t.name, t.rows, model.embed_dim,
                                    t.width * (bag_fill if t.width > 1 else 1.0))
                          for t in model.tables), batch, itemsize, optimizer)


@dataclass(frozen=True)
class RowRate:
    """Seconds for n rows of ``width`` elements: n (row_s + width itemsize byte_s)."""

    row_s: float
    byte_s: float

    def time(self, n: float, row_bytes: float) -> float:
        return n * (self.row_s + row_bytes * self.byte_s) if n > 0 else 0.0


@dataclass(frozen=True)
class Line:
    """One collective: latency_s + bytes / bytes_per_s."""

    latency_s: float
    bytes_per_s: float

    def time(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class Rates:
    """What ``plan/tables_calibrate.py`` measured with ``ranks`` ranks at once."""

    ranks: int
    a2a: Line
    gather: Line
    route_s: float  # per id and shard, the requester's split of its ids
    pool: dict[str, RowRate]  # "cached", "uncached"
    grad: dict[str, RowRate]
    update: dict[str, RowRate]  # "<optimizer>/cached", "<optimizer>/uncached"
    cache_bytes: int
    dense: dict[str, float]  # the dense part of a step of dense_batch samples per rank,
    dense_batch: int  # per term (TERMS)
    load: str = ""  # /proc/loadavg when measured
    shard_s: float = 0.0  # per sharded table and step: its lookup's and gradient's own
    # work outside the exchanges and the row kernels (id splitting, packing, Python)

    def regime(self, nbytes: float) -> str:
        return "cached" if nbytes <= self.cache_bytes else "uncached"


def _row_rate(raw: dict) -> RowRate:
    return RowRate(float(raw["row_s"]), float(raw["byte_s"]))


def rates_from_dict(raw: dict, ranks: int, source: str = "rates",
                    measured_with: str = "--config CONFIG") -> Rates:
    """The ``[ranks.N]`` section of a rates file (``tables_calibrate.to_toml``); one
    missing says how to measure it: ``hpctrain calibrate-tables`` with the file's other
    options (``measured_with``) and every rank count, those already measured too (it
    rewrites the whole file)."""
    got = raw.get("ranks", {}).get(str(ranks))
    if got is None:
        have = sorted(int(k) for k in raw.get("ranks", {}))
        counts = ",".join(str(n) for n in sorted({*have, ranks}))
        raise ConfigError(f"{source}: no rates measured at {ranks} ranks (measured: {have}); "
                          f"run hpctrain calibrate-tables {measured_with} --ranks {counts} "
                          f"--out {shlex.quote(source)}")
    return Rates(ranks, Line(**got["a2a"]), Line(**got["gather"]), float(got["route_s"]),
                 {k: _row_rate(v) for k, v in got["pool"].items()},
                 {k: _row_rate(v) for k, v in got["grad"].items()},
                 {k: _row_rate(v) for k, v in got["update"].items()},
                 int(got["cache_bytes"]), {k: float(v) for k, v in got["dense"].items()},
                 int(got["dense_batch"]),
                 str(got.get("load", "")), float(got.get("shard_s", 0.0)))


# ---------------------------------------------------------------------------------
# the cost model


def distinct(rows: float, draws: float) -> float:
    """Expected distinct rows among ``draws`` uniform draws from ``rows``."""
    if rows <= 0 or draws <= 0:
        return 0.0
    return rows * -math.expm1(draws * math.log1p(-1.0 / rows)) if rows > 1 else 1.0


def memory_bytes(p: Placement, owner: int, itemsize: int, optimizer: str) -> int:
    """Bytes of table ``p`` on group rank ``owner``: its shard and optimizer state."""
    if p.kind == "replicated":
        rows, elements = p.rows, p.rows * p.dim
    else:
        s = p.shard_of(owner)
        if s is None:
            return 0
        rows, elements = s.rows[1] - s.rows[0], s.elements
    state = rows if optimizer == "rowwise_adagrad" else 2 * elements
    return (elements + state) * itemsize


@dataclass
class RankCost:
    """One group rank's predicted seconds per term (``TERMS``) and bytes held."""

    rank: int
    time: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TERMS, 0.0))
    comm_s: float = 0.0  # of which in exchanges and gathers
    memory: int = 0

    @property
    def own_s(self) -> float:
        return sum(self.time.values())


@dataclass(frozen=True)
class Prediction:
    ranks: list[RankCost]

    @property
    def step_s(self) -> float:
        """Each rank waits for the slowest at the collectives: its work plus theirs."""
        return max(r.own_s for r in self.ranks)

    @property
    def max_memory(self) -> int:
        return max(r.memory for r in self.ranks)


def rank_costs(work: Workload, placements: dict[str, Placement], rates: Rates,
               group: int, *, dense: bool = True, gather_latency: bool = True) -> Prediction:
    """Every group rank's predicted step (module docstring) for the tables in
    ``placements``; ``dense=False`` leaves the dense part out, ``gather_latency=False``
    the replicated tables' gather's latencies (the greedy's partial plans)."""
    G, isz, b = group, work.itemsize, work.batch
    loads = {t.name: t for t in work.tables}
    out = [RankCost(r) for r in range(G)]
    replicated = []
    columns = False
    for name, p in placements.items():
        t = loads[name]
        n = b * t.ids  # this rank's ids of the table
        reg = rates.regime(p.rows * p.dim * isz)
        if p.kind == "replicated":
            replicated.append((t, reg))
            for rc in out:
                rc.time["fwd"] += rates.pool[reg].time(n, t.dim * isz)
                rc.time["bwd"] += rates.grad["cached"].time(n, t.dim * isz)
                u = distinct(t.rows, G * n)  # the global batch's rows, on every rank
                rc.time["update"] += rates.update[f"{work.optimizer}/{reg}"].time(u, t.dim * isz)
                rc.memory += memory_bytes(p, rc.rank, isz, work.optimizer)
            continue
        columns |= p.kind == "column"
        shards = [(s, (s.rows[1] - s.rows[0]) / p.rows, s.cols[1] - s.cols[0])
                  for s in p.shards]
        for rc in out:
            # requester: ids out (its count, bag sizes, ids in the shard), blocks back
            ids_out = sum((1 + b + n * frac) * 8 for _, frac, _ in shards)
            pooled_in = sum(b * w * isz for _, _, w in shards)
            ids_in = pooled_out = grads_in = 0.0
            mine = p.shard_of(rc.rank)
            if mine is not None:
                frac = (mine.rows[1] - mine.rows[0]) / p.rows
                w = mine.cols[1] - mine.cols[0]
                rows_owned = G * n * frac
                ids_in = G * (1 + b + n * frac) * 8
                pooled_out = grads_in = G * b * w * isz
                sreg = rates.regime((mine.rows[1] - mine.rows[0]) * w * isz)
                rc.time["fwd"] += rates.pool[sreg].time(rows_owned, w * isz)
                rc.time["bwd"] += rates.grad["cached"].time(rows_owned, w * isz)
                u = distinct(mine.rows[1] - mine.rows[0], rows_owned)
                rc.time["update"] += rates.update[f"{work.optimizer}/{sreg}"].time(u, w * isz)
                rc.memory += memory_bytes(p, rc.rank, isz, work.optimizer)
            a2a_fwd = (rates.a2a.time(0) + rates.a2a.time(max(ids_out, ids_in))
                       + rates.a2a.time(max(pooled_in, pooled_out)))
            a2a_bwd = rates.a2a.time(max(pooled_in, grads_in))  # dy blocks, same sizes
            rc.time["fwd"] += rates.route_s * n * len(shards) + a2a_fwd + rates.shard_s / 2
            rc.time["bwd"] += a2a_bwd + rates.shard_s / 2
            rc.comm_s += a2a_fwd + a2a_bwd
    if replicated and G > 1:
        # one gather of all replicated tables: counts, row ids, values; then the merge
        got = sum(G * distinct(t.rows, b * t.ids) * (8 + t.dim * isz) for t, _ in replicated)
        merge = sum(rates.grad["cached"].time(G * distinct(t.rows, b * t.ids), t.dim * isz)
                    for t, _ in replicated)
        for rc in out:
            gather = rates.gather.time(got) + 2 * rates.gather.time(0)
            if not gather_latency:
                gather -= 3 * rates.gather.latency_s
            rc.time["sync"] += gather + merge
            rc.comm_s += gather
    if columns and work.optimizer == "rowwise_adagrad" and G > 1:
        for rc in out:  # the column owners' row sums: an Allgather and an Allgatherv
            rc.time["sync"] += 2 * rates.gather.time(0)
            rc.comm_s += 2 * rates.gather.time(0)
    if dense:
        for rc in out:
            for k in TERMS:
                rc.time[k] += rates.dense.get(k, 0.0) * b / rates.dense_batch
    return Prediction(out)


# ---------------------------------------------------------------------------------
# the planner


def _model(work: Workload, names: list[str]) -> Any:
    loads = {t.name: t for t in work.tables}
    dim = work.tables[0].dim if work.tables else 1
    return SimpleNamespace(kind="dlrm", embed_dim=dim,
                           tables=[SimpleNamespace(name=n, rows=loads[n].rows) for n in names])


def place(work: Workload, group: int, choices: dict[str, TableSharding],
          default: str = "replicated") -> dict[str, Placement]:
    """``parallel.tables.place_tables`` over a group of ``group`` ranks (its rules and
    errors), for the tables in ``choices`` (all of the workload's when ``default`` is
    given for the rest)."""
    names = [t.name for t in work.tables if t.name in choices or default]
    par = SimpleNamespace(dp=group, table_group=group, tp=1, pp=1, sp=1,
                          table_default=default or "replicated",
                          table_sharding=tuple(choices[n] for n in names if n in choices))
    return place_tables(_model(work, names), par)


def candidates(t: TableLoad, group: int) -> list[TableSharding]:
    """Replicated, table-wise on each rank, row- and column-wise over the group."""
    out = [TableSharding(t.name, "replicated")]
    out += [TableSharding(t.name, "table", (r,)) for r in range(group)]
    if group > 1 and t.rows >= group:
        out.append(TableSharding(t.name, "row"))
    if group > 1 and t.dim % group == 0:
        out.append(TableSharding(t.name, "column"))
    return out


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def describe(s: TableSharding) -> str:
    return _kind(s.sharding) + (f" on ranks {list(s.ranks)}" if s.ranks else "")


@dataclass(frozen=True)
class Plan:
    choices: dict[str, TableSharding]
    placements: dict[str, Placement]
    prediction: Prediction
    group: int

    def toml(self) -> str:
        """The plan file (``parallel.tables.read_plan`` reads it)."""
        return plan_toml(self.group, "replicated", list(self.choices.values()))


def least_bytes(work: Workload, t: TableLoad, group: int) -> int:
    """The smallest fullest-rank bytes any placement of ``t`` alone needs."""
    return min(max(memory_bytes(p, r, work.itemsize, work.optimizer) for r in range(group))
               for cand in candidates(t, group)
               for p in [place(work, group, {t.name: cand}, default="")[t.name]])


def plan_tables(work: Workload, group: int, memory_per_rank: float, rates: Rates) -> Plan:
    """The greedy of the module docstring; a ``PlanError`` when a table fits nowhere.
    A candidate must leave room for the tables still to place, each at its smallest
    (``least_bytes``, on the fullest rank); when none does, room for itself suffices."""
    choices: dict[str, TableSharding] = {}
    order = sorted(work.tables, key=lambda t: (-t.rows * t.dim, t.name))
    least = {t.name: least_bytes(work, t, group) for t in order}
    for i, t in enumerate(order):
        reserve = sum(least[u.name] for u in order[i + 1:])
        tried = []  # (candidate, its plan so far's prediction)
        for cand in candidates(t, group):
            trial = {**choices, t.name: cand}
            tried.append((cand, rank_costs(work, place(work, group, trial, default=""),
                                           rates, group, dense=False, gather_latency=False)))
        for room in (reserve, 0):
            fit = [(c, p) for c, p in tried if p.max_memory + room <= memory_per_rank]
            if fit:
                break
        if not fit:
            whole = memory_bytes(place(work, 1, {t.name: TableSharding(t.name, "table")},
                                       default="")[t.name], 0, work.itemsize, work.optimizer)
            cand, pred = min(tried, key=lambda cp: cp[1].max_memory)
            raise PlanError(
                f"table {t.name!r} ({t.rows:,} x {t.dim}, {_bytes(whole)} with its "
                f"{work.optimizer} state) fits no placement over {group} ranks of "
                f"{_bytes(memory_per_rank)} each (the tables placed before it: "
                f"{sorted(choices) or 'none'}); the closest, {describe(cand)}, needs "
                f"{_bytes(pred.max_memory)} on its fullest rank, "
                f"{_bytes(pred.max_memory - memory_per_rank)} over")

        def key(cp):
            own = [r.own_s for r in cp[1].ranks]
            return max(own), sum(own), cp[1].max_memory

        choices[t.name] = min(fit, key=key)[0]
    ordered = {t.name: choices[t.name] for t in work.tables}
    placements = place(work, group, ordered, default="")
    return Plan(ordered, placements, rank_costs(work, placements, rates, group), group)


def check_plan(work: Workload, group: int, memory_per_rank: float,
               placements: dict[str, Placement]) -> None:
    """A placement (a hand-written plan's) over the memory per rank is a ``PlanError``
    naming the rank, its bytes and the tables that fill it."""
    for r in range(group):
        held = {n: memory_bytes(p, r, work.itemsize, work.optimizer)
                for n, p in placements.items()}
        total = sum(held.values())
        if total > memory_per_rank:
            top = sorted(held.items(), key=lambda kv: -kv[1])[:3]
            raise PlanError(
                f"the plan does not fit: group rank {r} holds {_bytes(total)} of tables and "
                f"{work.optimizer} state, over its {_bytes(memory_per_rank)} by "
                f"{_bytes(total - memory_per_rank)}; largest there: "
                + ", ".join(f"table {n!r} ({_kind(placements[n].kind)}) {_bytes(v)}"
                            for n, v in top))


def _kind(kind: str) -> str:
    return kind if kind == "replicated" else f"{kind}-wise"


def format_prediction(placements: dict[str, Placement], work: Workload, pred: Prediction,
                      rates: Rates, group: int) -> str:
    """The plan as a table (table, sharding, ranks, bytes per rank, predicted ms per
    rank of that table alone), then each rank's predicted terms and the step."""
    lines = [format_plan(placements, group, work.itemsize).replace("rank ", "bytes r"),
             "", f"{'table':<12} {'sharding':<10} "
             + " ".join(f"{'ms r' + str(r):>9}" for r in range(group))]
    for name, p in placements.items():
        alone = rank_costs(work, {name: p}, rates, group, dense=False)
        lines.append(f"{name:<12} {p.kind:<10} "
                     + " ".join(f"{r.own_s * 1e3:>9.2f}" for r in alone.ranks))
    lines += ["", f"{'rank':<5} " + " ".join(f"{k + ' ms':>10}" for k in TERMS)
              + f" {'own ms':>9} {'comm ms':>8} {'memory':>11}"]
    for r in pred.ranks:
        lines.append(f"{r.rank:<5} " + " ".join(f"{r.time[k] * 1e3:>10.2f}" for k in TERMS)
                     + f" {r.own_s * 1e3:>9.2f} {r.comm_s * 1e3:>8.2f} {_bytes(r.memory):>11}")
    lines.append(f"predicted step (every rank waits for the slowest): "
                 f"{pred.step_s * 1e3:.2f} ms")
    return "\n".join(lines)
