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
    gemm = { 1 = [[128, 6.0e10], [512, 1.4e11], [2048, 1.7e11]],
             2 = [[128, 3.5e10], [512, 7.5e10], [2048, 8.5e10]] }
    # optional: a rank's rate of memory-bound element-wise work (bytes read + written a
    # second), per ranks-per-node count, for the non-GEMM part of a step
    stream = { 1 = 8.0e9, 2 = 5.0e9 }

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

The ring model (``volume``, ``steps``): an all-reduce of n bytes over p ranks sends
``2 (p - 1) / p n`` bytes per rank in ``2 (p - 1)`` steps; an all-gather or a
reduce-scatter of a whole of n bytes ``(p - 1) / p n`` in ``p - 1``; a point-to-point
message n in 1. ``load_cluster`` refuses a missing, negative or unknown field by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain.config import ConfigError, read_toml

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
class NodeKind:
    name: str
    cores: int
    memory_bytes: float
    # ranks per node -> ((n, FLOP/s per rank), ...) ascending in n
    gemm: dict[int, tuple[tuple[int, float], ...]]
    stream: dict[int, float] | None = None  # ranks per node -> bytes/s per rank

    def peak_rate(self, ranks_per_node: int) -> float:
        """A rank's best measured GEMM rate: the denominator of MFU."""
        counts = sorted(self.gemm)
        use = next((c for c in counts if c >= ranks_per_node), counts[-1])
        return max(rate for _, rate in self.gemm[use])

    def stream_rate(self, ranks_per_node: int) -> float | None:
        """A rank's element-wise bytes/s (the nearest measured count at or above)."""
        if not self.stream:
            return None
        counts = sorted(self.stream)
        return self.stream[next((c for c in counts if c >= ranks_per_node), counts[-1])]

    def gemm_rate(self, ranks_per_node: int, m: int, n: int, k: int) -> float:
        """A rank's FLOP/s on an (m, k) @ (k, n) product, interpolated in log size
        between the measured square products (by the geometric mean side), flat beyond
        them; the table of the nearest measured ranks-per-node count at or above."""
        counts = sorted(self.gemm)
        use = next((c for c in counts if c >= ranks_per_node), counts[-1])
        table = self.gemm[use]
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
    links: dict[str, dict[str, Link]]  # level -> op -> Link

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


def _number(where: str, value: Any, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ClusterError(f"{where} ({value!r}) must be a number")
    if positive and not value > 0:
        raise ClusterError(f"{where} ({value!r}) must be positive")
    return float(value)


def _field(table: dict, key: str, where: str) -> Any:
    if key not in table:
        raise ClusterError(f"{where}: missing field {key!r}")
    return table[key]


def _known(table: dict, keys: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(table) - set(keys))
    if unknown:
        raise ClusterError(f"{where}: unknown field(s) {unknown}; known: {sorted(keys)}")


def _kind(raw: dict, i: int) -> NodeKind:
    where = f"kinds[{i}]"
    _known(raw, ("name", "cores", "memory_gib", "gemm", "stream"), where)
    name = str(_field(raw, "name", where))
    cores = _field(raw, "cores", where)
    if not isinstance(cores, int) or cores < 1:
        raise ClusterError(f"{where}.cores ({cores!r}) must be a positive integer")
    memory = _number(f"{where}.memory_gib", _field(raw, "memory_gib", where)) * 2**30
    gemm_raw = _field(raw, "gemm", where)
    if not isinstance(gemm_raw, dict) or not gemm_raw:
        raise ClusterError(f"{where}.gemm must be a table: ranks per node -> [[n, FLOP/s], ...]")
    gemm = {}
    for key, rows in gemm_raw.items():
        try:
            ranks = int(key)
        except ValueError:
            raise ClusterError(f"{where}.gemm key {key!r} must be a ranks-per-node count") from None
        if not isinstance(rows, list) or not rows:
            raise ClusterError(f"{where}.gemm.{key} must list [n, FLOP/s] pairs")
        table = []
        for j, row in enumerate(rows):
            if not isinstance(row, list) or len(row) != 2:
                raise ClusterError(f"{where}.gemm.{key}[{j}] ({row!r}) must be [n, FLOP/s]")
            table.append((int(_number(f"{where}.gemm.{key}[{j}][0]", row[0])),
                          _number(f"{where}.gemm.{key}[{j}][1]", row[1])))
        gemm[ranks] = tuple(sorted(table))
    stream = None
    if "stream" in raw:
        if not isinstance(raw["stream"], dict) or not raw["stream"]:
            raise ClusterError(f"{where}.stream must be a table: ranks per node -> bytes/s")
        stream = {int(k): _number(f"{where}.stream.{k}", v) for k, v in raw["stream"].items()}
    return NodeKind(name, cores, memory, gemm, stream)


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
            _known(link, ("latency_s", "bandwidth_Bps"), where)
            out[level][op] = Link(
                _number(f"{where}.latency_s", _field(link, "latency_s", where), positive=False),
                _number(f"{where}.bandwidth_Bps", _field(link, "bandwidth_Bps", where)))
            if out[level][op].latency_s < 0:
                raise ClusterError(f"{where}.latency_s ({out[level][op].latency_s}) must not "
                                   f"be negative")
    return out


def from_dict(raw: dict, source: str = "cluster") -> Cluster:
    """A Cluster from nested dicts (as TOML gives them); every rule by name."""
    try:
        _known(raw, ("name", "launcher", "kinds", "nodes", "links"), source)
        kinds_raw = _field(raw, "kinds", source)
        if not isinstance(kinds_raw, list) or not kinds_raw:
            raise ClusterError(f"{source}: 'kinds' must list one or more node kinds")
        kinds = {}
        for i, k in enumerate(kinds_raw):
            kind = _kind(k, i)
            if kind.name in kinds:
                raise ClusterError(f"kinds[{i}]: the name {kind.name!r} is used twice")
            kinds[kind.name] = kind
        nodes_raw = _field(raw, "nodes", source)
        if not isinstance(nodes_raw, list) or not nodes_raw:
            raise ClusterError(f"{source}: 'nodes' must list one or more groups of nodes")
        nodes = []
        for i, n in enumerate(nodes_raw):
            _known(n, ("kind", "count"), f"nodes[{i}]")
            kind, count = _field(n, "kind", f"nodes[{i}]"), _field(n, "count", f"nodes[{i}]")
            if kind not in kinds:
                raise ClusterError(f"nodes[{i}].kind ({kind!r}) must be one of {sorted(kinds)}")
            if not isinstance(count, int) or count < 1:
                raise ClusterError(f"nodes[{i}].count ({count!r}) must be a positive integer")
            nodes.append((kind, count))
        links = _links(_field(raw, "links", source))
    except ClusterError as err:
        raise ClusterError(f"{source}: {err}") from None
    return Cluster(str(raw.get("name", "cluster")), str(raw.get("launcher", "mpiexec")),
                   kinds, tuple(nodes), links)


def load_cluster(path: str | Path) -> Cluster:
    return from_dict(read_toml(path, "cluster description"), source=str(path))


def to_toml(c: Cluster) -> str:
    """The description as TOML, the way ``load_cluster`` reads it back."""
    lines = [f"name = {c.name!r}".replace("'", '"'), f'launcher = "{c.launcher}"', ""]
    for k in c.kinds.values():
        gemm = ", ".join(f"{r} = [{', '.join(f'[{n}, {rate:.4e}]' for n, rate in rows)}]"
                         for r, rows in sorted(k.gemm.items()))
        lines += ["[[kinds]]", f'name = "{k.name}"', f"cores = {k.cores}",
                  f"memory_gib = {k.memory_bytes / 2**30:.3f}", f"gemm = {{ {gemm} }}"]
        if k.stream:
            lines.append("stream = { " + ", ".join(f"{r} = {v:.4e}" for r, v in
                                                   sorted(k.stream.items())) + " }")
        lines.append("")
    for kind, count in c.nodes:
        lines += ["[[nodes]]", f'kind = "{kind}"', f"count = {count}", ""]
    for level in LEVELS:
        lines.append(f"[links.{level}]")
        for op in OPS:
            link = c.links[level][op]
            lines.append(f"{op} = {{ latency_s = {link.latency_s:.4e}, "
                         f"bandwidth_Bps = {link.bandwidth_Bps:.4e} }}")
        lines.append("")
    return "\n".join(lines)
