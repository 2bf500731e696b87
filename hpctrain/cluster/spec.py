"""What an emulated cluster is: nodes, their CPUs, their links; read from TOML, validated once.

Pure (no root, no system calls): ``load`` and ``uniform`` return a ``ClusterSpec``
whose every value has been checked, so ``hpctrain cluster up`` refuses bad input
before it creates anything. A cluster file::

    [cluster]
    name = "hpct"            # prefix of every namespace, link, cgroup and host name
    link = "1gbit"           # each node's link to the switch, each direction (tc tbf)
    subnet = "10.213.0.0/24" # the bridge: .1 is this machine, .10 + k node k
    cpu_limit = "cpuset"     # "cpuset": each node pinned to its own cores; "quota": not
    slurm = false            # also start slurmctld and one slurmd per node
    slurm_cpus = 8           # CPUs each node declares to SLURM (may exceed its cores)

    [[cluster.nodes]]        # a group of alike nodes; groups are numbered in order
    count = 1
    cores = 1                # cores the node may use
    cpu_share = 1.0          # the fraction of those cores it gets, in (0, 1]

    [[cluster.nodes]]
    count = 1
    cores = 1
    cpu_share = 0.5          # a node at half speed
    link = "100mbit"         # this group's own link rate

Node ``k`` is host ``{name}{k}`` at address ``subnet[10 + k]``, in network namespace
``{name}-{name}{k}``, with its end of the link named ``eth0`` and the switch end
``{name}v{k}`` on the bridge ``{name}br``.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpctrain.config import ConfigError, read_toml

CPU_LIMITS = ("cpuset", "quota")
# the CFS period the CPU quota is a share of. Short, so that a node capped at half a core
# runs 5 ms of every 10 instead of 50 of every 100: a real slow node is slow all the
# time, while a 50 ms stop left its peers waiting in the next collective (measured by
# benchmarks/bench_averaging.py: 28-42 ms a step in the guard's check at 100 ms, 2 ms at
# 10 ms)
PERIOD_US = 10_000
FIRST_NODE_HOST = 10  # node k's address is subnet[FIRST_NODE_HOST + k]
MAX_NODES = 64
DEFAULT_NAME = "hpct"
DEFAULT_SUBNET = "10.213.0.0/24"
NODE_IFACE = "eth0"  # every node's end of its link has the same name (UCX_NET_DEVICES)

_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?bit)(?:/s)?\s*$", re.IGNORECASE)
_NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")


def parse_rate(text: Any) -> int:
    """A link rate such as '100mbit', '1gbit' or '2.5gbit' in bits per second."""
    m = _RATE.match(text) if isinstance(text, str) else None
    bps = round(float(m.group(1)) * _UNITS[m.group(2).lower()]) if m else 0
    if bps <= 0:
        raise ConfigError(f"link ({text!r}) must be a positive rate such as '100mbit' or "
                          f"'1gbit' (units: bit, kbit, mbit, gbit, tbit)")
    return bps


def format_rate(bps: int) -> str:
    """Bits per second in tc's words: 100000000 -> '100mbit'."""
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bps % _UNITS[unit] == 0:
            return f"{bps // _UNITS[unit]}{unit}"
    return f"{bps}bit"


@dataclass(frozen=True)
class NodeSpec:
    """One emulated node: its host name, address, CPUs and link."""

    index: int
    hostname: str
    address: str
    cores: int  # cores it may use
    cpu_share: float  # of those cores, in (0, 1]
    cpus: tuple[int, ...]  # the cores it is pinned to ("cpuset"), () with "quota"
    link_bps: int

    @property
    def quota_us(self) -> int:
        """CFS quota per ``PERIOD_US``: cores * share of a period."""
        return max(1000, round(self.cores * self.cpu_share * PERIOD_US))

    @property
    def capped(self) -> bool:
        """Whether the node needs a CFS quota: not when it is pinned to its cores and
        gets all of them, which the pinning alone enforces. A quota equal to the pinned
        cores only throttles the node whenever several of its threads run at once (the
        benchmark GPT's data-parallel ranks computed 5-8% slower under it)."""
        return not (self.cpus and self.cpu_share >= 1.0)

    @property
    def cpu_cores(self) -> float:
        """The CPU it gets, in cores."""
        return self.cores * self.cpu_share


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    subnet: str
    cpu_limit: str
    slurm: bool
    nodes: tuple[NodeSpec, ...] = field(default_factory=tuple)
    slurm_cpus: int = 8

    @property
    def bridge(self) -> str:
        return f"{self.name}br"

    @property
    def host_address(self) -> str:
        """This machine's address on the bridge (where mpiexec and slurmctld listen)."""
        return str(ipaddress.ip_network(self.subnet)[1])

    @property
    def prefix_len(self) -> int:
        return ipaddress.ip_network(self.subnet).prefixlen

    def netns(self, node: NodeSpec) -> str:
        return f"{self.name}-{node.hostname}"

    def switch_port(self, node: NodeSpec) -> str:
        """The bridge end of the node's link."""
        return f"{self.name}v{node.index}"

    def node(self, hostname: str) -> NodeSpec:
        for n in self.nodes:
            if n.hostname == hostname:
                return n
        raise ConfigError(f"node ({hostname!r}) is not one of "
                          f"{', '.join(n.hostname for n in self.nodes)}")

    def to_dict(self) -> dict[str, Any]:
        """The TOML-shaped description this spec was made from (one group a node)."""
        return {"name": self.name, "subnet": self.subnet, "cpu_limit": self.cpu_limit,
                "slurm": self.slurm, "slurm_cpus": self.slurm_cpus,
                "nodes": [{"count": 1, "cores": n.cores, "cpu_share": n.cpu_share,
                           "link": format_rate(n.link_bps)} for n in self.nodes]}


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _number(where: str, value: Any, kind: type) -> Any:
    ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value,
                                                                                      bool)
    _require(ok, f"{where} ({value!r}) must be {'a number' if kind is float else 'an integer'}")
    return kind(value)


def build(raw: dict[str, Any], machine_cores: int | None = None) -> ClusterSpec:
    """Validate a ``[cluster]`` table (as TOML gives it) into a ClusterSpec.

    ``machine_cores``: this machine's cores (default ``os.cpu_count()``); a node may
    not ask for more.
    """
    machine_cores = machine_cores or os.cpu_count() or 1
    known = {"name", "link", "subnet", "cpu_limit", "slurm", "slurm_cpus", "nodes"}
    unknown = sorted(set(raw) - known)
    _require(not unknown, f"unknown key(s) {unknown} in [cluster]; known: {sorted(known)}")
    name = raw.get("name", DEFAULT_NAME)
    _require(isinstance(name, str) and bool(_NAME.match(name)),
             f"name ({name!r}) must be 1 to 8 lowercase letters or digits, starting with "
             f"a letter (it prefixes interface names, which Linux limits to 15 characters)")
    cpu_limit = raw.get("cpu_limit", "cpuset")
    _require(cpu_limit in CPU_LIMITS,
             f"cpu_limit ({cpu_limit!r}) must be one of {', '.join(CPU_LIMITS)}")
    slurm = raw.get("slurm", False)
    _require(isinstance(slurm, bool), f"slurm ({slurm!r}) must be true or false")
    slurm_cpus = _number("slurm_cpus", raw.get("slurm_cpus", 8), int)
    _require(slurm_cpus >= 1, f"slurm_cpus ({slurm_cpus}) must be at least 1")
    link = parse_rate(raw.get("link", "1gbit"))
    groups = raw.get("nodes", [{"count": 2}])
    _require(isinstance(groups, list) and all(isinstance(g, dict) for g in groups),
             "[[cluster.nodes]] must be a list of tables")
    subnet_text = raw.get("subnet", DEFAULT_SUBNET)
    try:
        subnet = ipaddress.ip_network(subnet_text)
    except (TypeError, ValueError):
        raise ConfigError(f"subnet ({subnet_text!r}) must be an IPv4 network such as "
                          f"'{DEFAULT_SUBNET}'") from None
    _require(subnet.version == 4 and subnet.is_private,
             f"subnet ({subnet_text!r}) must be a private IPv4 network such as "
             f"'{DEFAULT_SUBNET}'")

    nodes: list[NodeSpec] = []
    next_cpu = 0
    for g, group in enumerate(groups):
        where = f"[[cluster.nodes]] {g + 1}"
        bad = sorted(set(group) - {"count", "cores", "cpu_share", "link"})
        _require(not bad, f"unknown key(s) {bad} in {where}; known: "
                          f"['count', 'cores', 'cpu_share', 'link']")
        count = _number(f"{where}: count", group.get("count", 1), int)
        _require(count >= 1, f"{where}: count ({count}) must be at least 1")
        cores = _number(f"{where}: cores", group.get("cores", 1), int)
        _require(1 <= cores <= machine_cores,
                 f"{where}: cores ({cores}) must be between 1 and this machine's cores "
                 f"({machine_cores})")
        share = _number(f"{where}: cpu_share", group.get("cpu_share", 1.0), float)
        _require(0 < share <= 1, f"{where}: cpu_share ({share}) must be in (0, 1]")
        rate = parse_rate(group["link"]) if "link" in group else link
        for _ in range(count):
            k = len(nodes)
            cpus = ()
            if cpu_limit == "cpuset":
                cpus = tuple(sorted((next_cpu + j) % machine_cores for j in range(cores)))
                next_cpu = (next_cpu + cores) % machine_cores
            nodes.append(NodeSpec(k, f"{name}{k}", "", cores, share, cpus, rate))
    _require(1 <= len(nodes) <= MAX_NODES,
             f"nodes ({len(nodes)}) must be between 1 and {MAX_NODES}")
    _require(subnet.num_addresses >= FIRST_NODE_HOST + len(nodes) + 1,
             f"subnet ({subnet_text!r}) has {subnet.num_addresses} addresses; "
             f"{len(nodes)} node(s) need {FIRST_NODE_HOST + len(nodes) + 1}")
    nodes = [NodeSpec(n.index, n.hostname, str(subnet[FIRST_NODE_HOST + n.index]), n.cores,
                      n.cpu_share, n.cpus, n.link_bps) for n in nodes]
    return ClusterSpec(name, str(subnet), cpu_limit, slurm, tuple(nodes), slurm_cpus)


def uniform(nodes: int, *, cores: int = 1, cpu_share: float = 1.0, link: str = "1gbit",
            **cluster: Any) -> ClusterSpec:
    """``nodes`` alike nodes (what ``hpctrain cluster up --nodes N`` builds)."""
    _require(isinstance(nodes, int) and nodes >= 1, f"nodes ({nodes}) must be at least 1")
    try:
        return build({**cluster, "link": link,
                      "nodes": [{"count": nodes, "cores": cores, "cpu_share": cpu_share}]})
    except ConfigError as err:  # one group: its number says nothing here
        raise ConfigError(str(err).removeprefix("[[cluster.nodes]] 1: ")) from None


def load(path: str | Path) -> ClusterSpec:
    """Read a cluster TOML file (its ``[cluster]`` table) and validate it."""
    path = Path(path)
    raw = read_toml(path, "cluster file")
    extra = sorted(set(raw) - {"cluster"})
    _require(not extra, f"{path}: unknown section(s) {extra}; the file holds [cluster]")
    _require(isinstance(raw.get("cluster"), dict), f"{path}: the [cluster] table is missing")
    try:
        return build(raw["cluster"])
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
