"""A cluster, described for the planner: node kinds, how many of each, the links.

A TOML file (``hpctrain calibrate`` writes one for this machine or an emulated
cluster; ``configs/clusters/`` holds examples)::

    name = "laptop"
    launcher = "mpiexec"

    [[kinds]]
    name = "cpu"
    cores = 2
    memory_gib = 24.0
    # a rank's float32 GEMM rate (FLOP/s) on square n x n x n products, with every
    # rank of a node computing at once: one table per ranks-per-node count
    # with the operands coming from memory, as a layer's weights do (cycled through more
    # than the caches hold; `calibrate.gemm_rates`)
    gemm = { 1 = [[128, 6.0e10], [512, 1.4e11], [2048, 1.7e11]],
             2 = [[128, 3.5e10], [512, 7.5e10], [2048, 8.5e10]] }
    # optional: the same with the operands in the caches (one product repeated), the
    # rate of attention's per-head products, whose operands the product before wrote;
    # gemm where not given
    gemm_cached = { 1 = [[128, 9.0e10], [512, 1.6e11], [2048, 1.7e11]],
                    2 = [[128, 4.5e10], [512, 8.0e10], [2048, 8.5e10]] }
    # optional: a rank's rate of memory-bound element-wise work (bytes read + written a
    # second), per ranks-per-node count, for the non-GEMM part of a step
    stream = { 1 = 8.0e9, 2 = 5.0e9 }
    # optional: how a data-parallel sum and the backward's compute share a node when
    # they run beside each other: the sum takes comm_slowdown times as long as it does
    # alone, the compute compute_slowdown times (1 and 1, the defaults: neither slows
    # the other, as with an adapter that moves the bytes itself). On a node whose cores
    # move the bytes (TCP) and whose MPI moves a non-blocking sum only when polled, both
    # are above 1. Either one number or a table by the nodes a data group spans (the
    # measured size nearest a layout's group in ratio prices it). `calibrate --emulated`
    # measures them at every group size the nodes divide into: gradient buckets summed
    # beside a loop of products, every group at once (overlap.py)
    comm_slowdown = { 2 = 4.6, 4 = 2.9 }
    compute_slowdown = 1.3

    # instead of a gemm table, a device's published peak and the share of it its GEMMs
    # reach (a roofline: a product is also bound by moving its operands, gemm_bytes an
    # element, at the stream rate)
    # peak_flops = 312.0e12
    # gemm_efficiency = 0.80
    # gemm_bytes = 2

    [[nodes]]
    kind = "cpu"
    count = 1

    # each collective's time over p ranks of n bytes, inside a node (intra) and across
    # nodes (inter): steps(p) * latency + volume(p, n) / bandwidth, the ring model
    [links.intra]
    all_reduce = { latency_s = 2.0e-5, bandwidth_Bps = 4.0e9 }
    all_gather = { latency_s = 2.0e-5, bandwidth_Bps = 4.0e9 }
    reduce_scatter = { latency_s = 2.0e-5, bandwidth_Bps = 4.0e9 }
    p2p = { latency_s = 1.0e-5, bandwidth_Bps = 5.0e9 }
    [links.inter]
    ...
    # or one line per range of message sizes (n bytes, as above), ascending; the last
    # range has no upper bound
    all_reduce = [{ upto_bytes = 16777216, latency_s = 2.0e-5, bandwidth_Bps = 4.0e9 },
                  { latency_s = 1.0e-3, bandwidth_Bps = 1.5e9 }]

The ring model (``volume``, ``steps``): an all-reduce of n bytes over p ranks sends
``2 (p - 1) / p n`` bytes per rank in ``2 (p - 1)`` steps; an all-gather or a
reduce-scatter of a whole of n bytes ``(p - 1) / p n`` in ``p - 1``; a point-to-point
message n in 1. ``load_cluster`` refuses a missing, unknown or malformed field by name,
with its value and the rule: a table that is not a table, a number that is not finite
or not positive where it must be, a count (cores, ranks per node, GEMM sizes, nodes)
that is not a positive integer (``true`` is not 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain.config import ConfigError, read_toml, toml_string

OPS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
LEVELS = ("intra", "inter")


class ClusterError(ConfigError):
    """A cluster description breaks a rule; the message names the field."""


def volume(op: str, p: int, nbytes: float) -> float:
    """Bytes each rank sends for ``op`` over ``p`` ranks on ``nbytes`` (ring model)."""
    if op == "p2p":
        return float(nbytes)
    if p <= 1:
        return 0.0
    share = (p - 1) / p * nbytes
    return 2 * share if op == "all_reduce" else share


def steps(op: str, p: int) -> int:
    """Latency-bound steps of ``op`` over ``p`` ranks (ring model)."""
    if op == "p2p":
        return 1
    if p <= 1:
        return 0
    return 2 * (p - 1) if op == "all_reduce" else p - 1


@dataclass(frozen=True)
class Link:
    """Alpha-beta: ``latency_s`` per step, ``bandwidth_Bps`` bytes a second."""

    latency_s: float
    bandwidth_Bps: float

    def time(self, op: str, p: int, nbytes: float) -> float:
        return steps(op, p) * self.latency_s + volume(op, p, nbytes) / self.bandwidth_Bps


@dataclass(frozen=True)
class Pieces:
    """Alpha-beta lines per range of message sizes: ``ranges`` is ``((upto_bytes,
    Link), ...)`` ascending, the last ``upto_bytes`` infinite. A message of n bytes (the
    collective's whole, as ``volume`` takes it) uses the first range with n <= upto.

    A range after the first may have a negative latency (large messages whose time
    grows faster than their size, as when they leave the caches); a message never takes
    less than the largest message of the range before it."""

    ranges: tuple[tuple[float, Link], ...]

    def line(self, nbytes: float) -> Link:
        return next(link for upto, link in self.ranges if nbytes <= upto)

    def time(self, op: str, p: int, nbytes: float) -> float:
        floor = 0.0
        for upto, link in self.ranges:
            if nbytes <= upto:
                return max(floor, link.time(op, p, nbytes))
            floor = max(floor, link.time(op, p, upto))
        raise AssertionError("the last range is unbounded")


@dataclass(frozen=True)
class NodeKind:
    name: str
    cores: int
    memory_bytes: float
    # ranks per node -> ((n, FLOP/s per rank), ...) ascending in n; empty with peak_flops
    gemm: dict[int, tuple[tuple[int, float], ...]]
    stream: dict[int, float] | None = None  # ranks per node -> bytes/s per rank
    # the products with their operands in the caches, as ``gemm``; None: ``gemm``
    gemm_cached: dict[int, tuple[tuple[int, float], ...]] | None = None
    peak_flops: float | None = None  # a device's published peak (the roofline form)
    gemm_efficiency: float | None = None  # the share of it large products reach
    gemm_bytes: int = 2  # bytes an operand element, for the roofline's memory bound
    # a data-parallel sum beside compute takes comm_slowdown x as long as alone, the
    # compute compute_slowdown x; each one factor or nodes a data group spans -> factor
    comm_slowdown: float | dict[int, float] = 1.0
    compute_slowdown: float | dict[int, float] = 1.0

    def slowdowns(self, nodes: int) -> tuple[float, float]:
        """``(comm_slowdown, compute_slowdown)`` of a data-parallel sum over a group
        spanning ``nodes`` nodes: a table's size nearest ``nodes`` in ratio (the
        larger on a tie)."""
        return _by_group(self.comm_slowdown, nodes), _by_group(self.compute_slowdown, nodes)

    def peak_rate(self, ranks_per_node: int) -> float:
        """A rank's best measured GEMM rate, or the published peak: the denominator of MFU."""
        if self.peak_flops:
            return self.peak_flops
        counts = sorted(self.gemm)
        use = next((c for c in counts if c >= ranks_per_node), counts[-1])
        return max(rate for _, rate in self.gemm[use])

    def unmeasured(self, ranks_per_node: int) -> dict[str, tuple[int, ...]]:
        """The rate tables (gemm, gemm_cached, stream) measured only at fewer ranks a
        node than ``ranks_per_node``, each with its measured counts: the rate methods
        price such a count with the largest measured count's rates, each rank as if
        it had that count's share of the node's cores."""
        tables = {"gemm": self.gemm, "gemm_cached": self.gemm_cached, "stream": self.stream}
        return {name: tuple(sorted(t)) for name, t in tables.items()
                if t and max(t) < ranks_per_node}

    def stream_rate(self, ranks_per_node: int) -> float | None:
        """A rank's element-wise bytes/s (the nearest measured count at or above)."""
        if not self.stream:
            return None
        counts = sorted(self.stream)
        return self.stream[next((c for c in counts if c >= ranks_per_node), counts[-1])]

    def gemm_rate(self, ranks_per_node: int, m: int, n: int, k: int,
                  cached: bool = False) -> float:
        """A rank's FLOP/s on an (m, k) @ (k, n) product, interpolated in log size
        between the measured square products (by the geometric mean side), flat beyond
        them; the table of the nearest measured ranks-per-node count at or above.
        ``cached``: a product whose operands are in the caches (``gemm_cached``, where
        the kind has it). Roofline form (``peak_flops``): ``peak * efficiency``, or
        slower when moving the three operands at the stream rate takes longer than the
        products."""
        if self.peak_flops:
            flops = 2.0 * m * n * k
            t = flops / (self.peak_flops * self.gemm_efficiency)
            stream = self.stream_rate(ranks_per_node)
            if stream:
                t = max(t, self.gemm_bytes * (m * k + k * n + m * n) / stream)
            return flops / t
        tables = self.gemm_cached if cached and self.gemm_cached else self.gemm
        counts = sorted(tables)
        use = next((c for c in counts if c >= ranks_per_node), counts[-1])
        table = tables[use]
        side = (max(m, 1) * max(n, 1) * max(k, 1)) ** (1.0 / 3.0)
        if side <= table[0][0]:
            return table[0][1] * side / table[0][0]  # small products: latency-bound
        for (n0, r0), (n1, r1) in zip(table, table[1:], strict=False):
            if side <= n1:
                t = math.log(side / n0) / math.log(n1 / n0)
                return r0 + t * (r1 - r0)
        return table[-1][1]


@dataclass(frozen=True)
class Cluster:
    name: str
    launcher: str
    kinds: dict[str, NodeKind]
    nodes: tuple[tuple[str, int], ...]  # (kind, count) in rank order
    links: dict[str, dict[str, Link | Pieces]]  # level -> op -> line(s)

    @property
    def num_nodes(self) -> int:
        return sum(count for _, count in self.nodes)

    def node_kinds(self) -> list[NodeKind]:
        """The kind of every node, in rank order."""
        return [self.kinds[k] for k, count in self.nodes for _ in range(count)]

    def collective_time(self, op: str, p: int, nbytes: float, inter: bool) -> float:
        """Seconds of ``op`` over ``p`` ranks on ``nbytes``, inside a node or across."""
        return self.links["inter" if inter else "intra"][op].time(op, p, nbytes)


# ---------------------------------------------------------------------------------
# reading


def _show(value: Any) -> str:
    """A value as the TOML file spells it (true, not Python's True)."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _number(where: str, value: Any, *, positive: bool = True) -> float:
    """A finite number (``positive``: above 0); a bool, a string, nan or inf is refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ClusterError(f"{where} ({_show(value)}) must be a number")
    if not math.isfinite(value):
        raise ClusterError(f"{where} ({value!r}) must be a finite number")
    if positive and not value > 0:
        raise ClusterError(f"{where} ({value!r}) must be positive")
    return float(value)


def _count(where: str, value: Any, what: str = "") -> int:
    """A positive integer (TOML's true is not 1, nor 2.0 or 0.5 a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ClusterError(f"{where} ({_show(value)}) must be a positive integer{what}")
    return value


def _int_key(key: str, where: str, least: int, what: str) -> int:
    """A table key that is an integer of at least ``least`` (TOML keys are strings:
    "2"); ``what`` says what it counts, in the error."""
    try:
        n = int(key)
    except (TypeError, ValueError):
        n = least - 1
    if n < least or key != str(n):  # "01" or " 1" would stand beside "1" unseen
        raise ClusterError(f"{where} key {key!r} must be {what} written plainly, as \"2\")")
    return n


def _ranks_key(key: str, where: str) -> int:
    """A table key that counts ranks per node."""
    return _int_key(key, where, 1, "a ranks-per-node count (a positive integer")


def _text(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ClusterError(f"{where} ({_show(value)}) must be a non-empty string")
    return value


def _at(where: str) -> str:
    """A message's prefix: the field it is about (nothing at the top level, which the
    source's name prefixes)."""
    return f"{where}: " if where else ""


def _field(table: dict, key: str, where: str) -> Any:
    if key not in table:
        raise ClusterError(f"{_at(where)}missing field {key!r}")
    return table[key]


# a node kind's two factors for a data-parallel sum beside compute (NodeKind, cost.beside)
SLOWDOWNS = ("comm_slowdown", "compute_slowdown")
_BY_SLOWDOWNS = ("comm_slowdown and compute_slowdown (a data-parallel sum and the compute "
                 "beside it, each slowed by the other): measure them again with `hpctrain "
                 "calibrate --emulated`")
# fields of older descriptions -> what replaced them, and how to get it
REPLACED_FIELDS = {"comm_overlap": _BY_SLOWDOWNS, "comm_cpu_s_per_byte": _BY_SLOWDOWNS}


def _known(table: Any, keys: tuple[str, ...], where: str,
           replaced: dict[str, str] | None = None) -> None:
    """``table`` is a table whose fields are all among ``keys``; a field of
    ``replaced`` is named with what replaced it."""
    if not isinstance(table, dict):
        raise ClusterError(f"{where or 'the description'} ({table!r}) must be a table "
                           f"with the fields {sorted(keys)}")
    for old, new in (replaced or {}).items():
        if old in table:
            raise ClusterError(f"{_at(where)}{old} was replaced by {new}, or remove {old}")
    unknown = sorted(set(table) - set(keys))
    if unknown:
        raise ClusterError(f"{_at(where)}unknown field(s) {unknown}; known: {sorted(keys)}")


def _kind(raw: dict, i: int) -> NodeKind:
    where = f"kinds[{i}]"
    _known(raw, ("name", "cores", "memory_gib", "gemm", "gemm_cached", "stream", "peak_flops",
                 "gemm_efficiency", "gemm_bytes", *SLOWDOWNS), where, replaced=REPLACED_FIELDS)
    name = _text(f"{where}.name", _field(raw, "name", where))
    cores = _count(f"{where}.cores", _field(raw, "cores", where))
    memory = _number(f"{where}.memory_gib", _field(raw, "memory_gib", where)) * 2**30
    roof = _roofline(raw, where)
    if roof and "gemm" in raw:
        raise ClusterError(f"{where}: give a gemm table or peak_flops with gemm_efficiency, "
                           f"not both")
    if roof and "gemm_cached" in raw:
        raise ClusterError(f"{where}: gemm_cached goes with a gemm table, not with "
                           f"peak_flops")
    gemm = {} if roof else _gemm_table(_field(raw, "gemm", where), f"{where}.gemm")
    cached = _gemm_table(raw["gemm_cached"], f"{where}.gemm_cached") \
        if "gemm_cached" in raw else None
    stream = None
    if "stream" in raw:
        if not isinstance(raw["stream"], dict) or not raw["stream"]:
            raise ClusterError(f"{where}.stream ({_show(raw['stream'])}) must be a table: "
                               f"ranks per node -> bytes/s")
        stream = {_ranks_key(k, f"{where}.stream"): _number(f"{where}.stream.{k}", v)
                  for k, v in raw["stream"].items()}
    slowdowns = {field: _slowdown(raw.get(field, 1.0), f"{where}.{field}")
                 for field in SLOWDOWNS}
    return NodeKind(name, cores, memory, gemm, stream, cached, **roof, **slowdowns)


def _slowdown(raw, where: str) -> float | dict[int, float]:
    """A slowdown field: one factor, or a table of nodes a data group spans (2 or
    more) -> factor; every factor at least 1."""
    def factor(value, at: str) -> float:
        value = _number(at, value)
        if value < 1.0:
            raise ClusterError(f"{at} ({value!r}) must be 1 or more (how many times as "
                               f"long as alone)")
        return value
    if isinstance(raw, list) or raw == {}:
        raise ClusterError(f"{where} ({_show(raw)}) must be a number or a table: nodes a "
                           f"data group spans -> factor")
    if not isinstance(raw, dict):
        return factor(raw, where)
    return {_int_key(k, where, 2, "the nodes a data group spans (an integer of 2 or more"):
            factor(v, f"{where}.{k}") for k, v in raw.items()}


def _by_group(value: float | dict[int, float], nodes: int) -> float:
    """``value``'s factor for a group spanning ``nodes`` nodes (``NodeKind.slowdowns``)."""
    if not isinstance(value, dict):
        return value
    nearest = min(value, key=lambda size: (abs(math.log(size / max(nodes, 1))), -size))
    return value[nearest]


def _gemm_table(raw, where: str) -> dict[int, tuple[tuple[int, float], ...]]:
    """A GEMM table: ranks per node -> ((n, FLOP/s), ...) ascending in n."""
    if not isinstance(raw, dict) or not raw:
        raise ClusterError(f"{where} ({_show(raw)}) must be a table: ranks per node -> "
                           f"[[n, FLOP/s], ...]")
    gemm = {}
    for key, rows in raw.items():
        ranks = _ranks_key(key, where)
        if not isinstance(rows, list) or not rows:
            raise ClusterError(f"{where}.{key} ({rows!r}) must list [n, FLOP/s] pairs")
        table = {}
        for j, row in enumerate(rows):
            if not isinstance(row, list) or len(row) != 2:
                raise ClusterError(f"{where}.{key}[{j}] ({row!r}) must be [n, FLOP/s]")
            n = _count(f"{where}.{key}[{j}][0]", row[0], " (n of an n x n x n product)")
            if n in table:
                raise ClusterError(f"{where}.{key}[{j}]: n ({n}) is listed twice; each size "
                                   f"has one rate")
            table[n] = _number(f"{where}.{key}[{j}][1]", row[1])
        gemm[ranks] = tuple(sorted(table.items()))
    return gemm


def _roofline(raw: dict, where: str) -> dict:
    """The roofline fields of a kind (none, or peak_flops and gemm_efficiency both)."""
    given = [k for k in ("peak_flops", "gemm_efficiency", "gemm_bytes") if k in raw]
    if not given:
        return {}
    for k in ("peak_flops", "gemm_efficiency"):
        if k not in raw:
            raise ClusterError(f"{where}: missing field {k!r} (the roofline form needs "
                               f"peak_flops and gemm_efficiency)")
    eff = _number(f"{where}.gemm_efficiency", raw["gemm_efficiency"])
    if eff > 1:
        raise ClusterError(f"{where}.gemm_efficiency ({eff}) must be at most 1 (a share "
                           f"of peak_flops)")
    out = {"peak_flops": _number(f"{where}.peak_flops", raw["peak_flops"]),
           "gemm_efficiency": eff}
    if "gemm_bytes" in raw:
        out["gemm_bytes"] = _count(f"{where}.gemm_bytes", raw["gemm_bytes"])
    return out


def _links(raw: dict) -> dict[str, dict[str, Link]]:
    _known(raw, LEVELS, "links")
    out = {}
    for level in LEVELS:
        table = _field(raw, level, "links")
        _known(table, OPS, f"links.{level}")
        out[level] = {}
        for op in OPS:
            where = f"links.{level}.{op}"
            link = _field(table, op, f"links.{level}")
            if isinstance(link, list):
                out[level][op] = _pieces(link, where)
            else:
                out[level][op] = _line(link, where)
    return out


def _line(raw: Any, where: str, keys: tuple[str, ...] = ("latency_s", "bandwidth_Bps"),
          negative: bool = False) -> Link:
    if not isinstance(raw, dict):
        raise ClusterError(f"{where} ({raw!r}) must be a table {{ latency_s, bandwidth_Bps }}")
    _known(raw, keys, where)
    link = Link(_number(f"{where}.latency_s", _field(raw, "latency_s", where), positive=False),
                _number(f"{where}.bandwidth_Bps", _field(raw, "bandwidth_Bps", where)))
    if link.latency_s < 0 and not negative:
        raise ClusterError(f"{where}.latency_s ({link.latency_s}) must not be negative"
                           + (" (only a range after the first may have one)" if
                              "upto_bytes" in keys else ""))
    return link


def _pieces(raw: list, where: str) -> Pieces:
    """A list of ranges: every one but the last with upto_bytes, ascending."""
    if not raw:
        raise ClusterError(f"{where} must list one or more ranges")
    ranges, below = [], 0.0
    for j, piece in enumerate(raw):
        at = f"{where}[{j}]"
        link = _line(piece, at, ("upto_bytes", "latency_s", "bandwidth_Bps"), negative=j > 0)
        last = j == len(raw) - 1
        if last:
            if "upto_bytes" in piece:
                raise ClusterError(f"{at}: the last range must have no upto_bytes (it takes "
                                   f"every larger message)")
            upto = math.inf
        else:
            upto = _number(f"{at}.upto_bytes", _field(piece, "upto_bytes", at))
            if upto <= below:
                raise ClusterError(f"{at}.upto_bytes ({upto:g}) must be larger than the "
                                   f"range before's ({below:g})")
            below = upto
        ranges.append((upto, link))
    return Pieces(tuple(ranges))


def from_dict(raw: dict, source: str = "cluster") -> Cluster:
    """A Cluster from nested dicts (as TOML gives them); every rule by name."""
    try:
        _known(raw, ("name", "launcher", "kinds", "nodes", "links"), "")
        kinds_raw = _field(raw, "kinds", "")
        if not isinstance(kinds_raw, list) or not kinds_raw:
            raise ClusterError(f"kinds ({kinds_raw!r}) must list one or more node kinds "
                               f"([[kinds]] tables)")
        kinds = {}
        for i, k in enumerate(kinds_raw):
            kind = _kind(k, i)
            if kind.name in kinds:
                raise ClusterError(f"kinds[{i}]: the name {kind.name!r} is used twice")
            kinds[kind.name] = kind
        nodes_raw = _field(raw, "nodes", "")
        if not isinstance(nodes_raw, list) or not nodes_raw:
            raise ClusterError(f"nodes ({nodes_raw!r}) must list one or more groups of "
                               f"nodes ([[nodes]] tables)")
        nodes = []
        for i, n in enumerate(nodes_raw):
            _known(n, ("kind", "count"), f"nodes[{i}]")
            kind, count = _field(n, "kind", f"nodes[{i}]"), _field(n, "count", f"nodes[{i}]")
            if not isinstance(kind, str):
                raise ClusterError(f"nodes[{i}].kind ({_show(kind)}) must be a string naming "
                                   f"a kind, one of {sorted(kinds)}")
            if kind not in kinds:
                raise ClusterError(f"nodes[{i}].kind ({kind!r}) must be one of {sorted(kinds)}")
            nodes.append((kind, _count(f"nodes[{i}].count", count)))
        links = _links(_field(raw, "links", ""))
        name = _text("name", raw.get("name", "cluster"))
        launcher = _text("launcher", raw.get("launcher", "mpiexec"))
    except ClusterError as err:
        raise ClusterError(f"{source}: {err}") from None
    return Cluster(name, launcher, kinds, tuple(nodes), links)


def load_cluster(path: str | Path) -> Cluster:
    return from_dict(read_toml(path, "cluster description"), source=str(path))


def to_toml(c: Cluster) -> str:
    """The description as TOML, the way ``load_cluster`` reads it back."""
    lines = [f"name = {toml_string(c.name)}", f"launcher = {toml_string(c.launcher)}", ""]
    for k in c.kinds.values():
        lines += ["[[kinds]]", f"name = {toml_string(k.name)}", f"cores = {k.cores}",
                  f"memory_gib = {k.memory_bytes / 2**30:.3f}"]
        if k.peak_flops:
            lines += [f"peak_flops = {k.peak_flops:.4e}",
                      f"gemm_efficiency = {k.gemm_efficiency}", f"gemm_bytes = {k.gemm_bytes}"]
        else:
            for field, tables in (("gemm", k.gemm), ("gemm_cached", k.gemm_cached)):
                if tables:
                    text = ", ".join(
                        f"{r} = [{', '.join(f'[{n}, {rate:.4e}]' for n, rate in rows)}]"
                        for r, rows in sorted(tables.items()))
                    lines.append(f"{field} = {{ {text} }}")
        if k.stream:
            lines.append("stream = { " + ", ".join(f"{r} = {v:.4e}" for r, v in
                                                   sorted(k.stream.items())) + " }")
        for field in SLOWDOWNS:
            value = getattr(k, field)
            if isinstance(value, dict):
                lines.append(f"{field} = {{ " + ", ".join(
                    f"{n} = {f:.3f}" for n, f in sorted(value.items())) + " }")
            elif value != 1.0:
                lines.append(f"{field} = {value:.3f}")
        lines.append("")
    for kind, count in c.nodes:
        lines += ["[[nodes]]", f"kind = {toml_string(kind)}", f"count = {count}", ""]
    for level in LEVELS:
        lines.append(f"[links.{level}]")
        for op in OPS:
            lines.append(f"{op} = {_link_toml(c.links[level][op])}")
        lines.append("")
    return "\n".join(lines)


def _link_toml(link: Link | Pieces) -> str:
    def one(line: Link, upto: float = math.inf) -> str:
        head = "" if math.isinf(upto) else f"upto_bytes = {int(upto)}, "
        return (f"{{ {head}latency_s = {line.latency_s:.4e}, "
                f"bandwidth_Bps = {line.bandwidth_Bps:.4e} }}")
    if isinstance(link, Link):
        return one(link)
    return "[" + ", ".join(one(line, upto) for upto, line in link.ranges) + "]"
