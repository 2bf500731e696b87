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
import math
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
MIN_QUOTA_US = 1000  # the kernel's smallest CFS quota (cgroup v1 refuses less)
# link rates tc's tbf shapes with the bucket ``net.tbf_args`` gives: below 1 kbit tc
# shrinks the bucket under a packet (8 bit: 57 bytes), and at 17.2 tbit the 2 ms bucket
# passes 4 GiB, which tc refuses ("illegal value for burst"); 1bit is 0 bytes/s to tc
MIN_RATE_BPS = 10**3
MAX_RATE_BPS = 10 * 10**12
# RFC 1918: ipaddress.is_private also takes 0.0.0.0/8, 127/8, 169.254/16, 198.18/15, 240/4
PRIVATE_NETWORKS = tuple(ipaddress.ip_network(n) for n in
                         ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"))
DEFAULT_NAME = "hpct"
DEFAULT_SUBNET = "10.213.0.0/24"
NODE_IFACE = "eth0"  # every node's end of its link has the same name (UCX_NET_DEVICES)

_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?bit)(?:/s)?\s*$", re.IGNORECASE)
_NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")


def is_name(name: Any) -> bool:
    return isinstance(name, str) and bool(_NAME.match(name))


def check_name(name: Any) -> str:
    """``name`` if it is a cluster name, else a ConfigError naming the rule. Every
    command checks it before using it: it becomes interface, namespace, cgroup and
    host names and the state folder ``/run/hpctrain/cluster-{name}``."""
    if not is_name(name):
        raise ConfigError(f"name ({name!r}) must be 1 to 8 lowercase letters or digits, "
                          f"starting with a letter (it prefixes interface names, which Linux "
                          f"limits to 15 characters)")
    return name


def parse_rate(text: Any) -> int:
    """A link rate such as '100mbit', '1gbit' or '2.5gbit' in bits per second, between
    ``MIN_RATE_BPS`` and ``MAX_RATE_BPS`` (what tc's tbf shapes)."""
    m = _RATE.match(text) if isinstance(text, str) else None
    bps = round(float(m.group(1)) * _UNITS[m.group(2).lower()]) if m else 0
    if bps <= 0:
        raise ConfigError(f"link ({text!r}) must be a positive rate such as '100mbit' or "
                          f"'1gbit' (units: bit, kbit, mbit, gbit, tbit)")
    if not MIN_RATE_BPS <= bps <= MAX_RATE_BPS:
        raise ConfigError(f"link ({text!r}) must be between {format_rate(MIN_RATE_BPS)} and "
                          f"{format_rate(MAX_RATE_BPS)} (the rates tc's tbf shaper takes)")
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
        return max(MIN_QUOTA_US, round(self.cores * self.cpu_share * PERIOD_US))

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
    name = check_name(raw.get("name", DEFAULT_NAME))
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
    subnet = _subnet(subnet_text)

    # every group is checked, and the nodes counted, before any node is made: a count
    # of 10**9 is refused at once instead of filling the memory
    checked = []
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
        # the quota is cores * share of a period, and the kernel takes no less than
        # MIN_QUOTA_US: a smaller share would silently get more than it says
        smallest = math.ceil(MIN_QUOTA_US / (cores * PERIOD_US) * 10**4) / 10**4
        _require(round(cores * share * PERIOD_US) >= MIN_QUOTA_US,
                 f"{where}: cpu_share ({share}) must be at least {smallest:g} for "
                 f"{cores} core(s): the CPU quota cannot be below {MIN_QUOTA_US} us of "
                 f"every {PERIOD_US} us")
        rate = parse_rate(group["link"]) if "link" in group else link
        checked.append((count, cores, share, rate))
    total = sum(count for count, *_ in checked)
    _require(1 <= total <= MAX_NODES, f"nodes ({total}) must be between 1 and {MAX_NODES}")

    nodes: list[NodeSpec] = []
    next_cpu = 0
    for count, cores, share, rate in checked:
        for _ in range(count):
            k = len(nodes)
            cpus = ()
            if cpu_limit == "cpuset":
                cpus = tuple(sorted((next_cpu + j) % machine_cores for j in range(cores)))
                next_cpu = (next_cpu + cores) % machine_cores
            nodes.append(NodeSpec(k, f"{name}{k}", "", cores, share, cpus, rate))
    _require(subnet.num_addresses >= FIRST_NODE_HOST + len(nodes) + 1,
             f"subnet ({subnet_text!r}) has {subnet.num_addresses} addresses; "
             f"{len(nodes)} node(s) need {FIRST_NODE_HOST + len(nodes) + 1}")
    nodes = [NodeSpec(n.index, n.hostname, str(subnet[FIRST_NODE_HOST + n.index]), n.cores,
                      n.cpu_share, n.cpus, n.link_bps) for n in nodes]
    return ClusterSpec(name, str(subnet), cpu_limit, slurm, tuple(nodes), slurm_cpus)


def _subnet(text: Any) -> ipaddress.IPv4Network:
    """The switch's network: a string naming an RFC 1918 IPv4 network."""
    _require(isinstance(text, str),
             f"subnet ({text!r}) must be a string such as '{DEFAULT_SUBNET}'")
    try:
        subnet = ipaddress.ip_network(text)
    except ValueError as err:
        raise ConfigError(f"subnet ({text!r}) must be an IPv4 network such as "
                          f"'{DEFAULT_SUBNET}': {err}") from None
    _require(subnet.version == 4 and any(subnet.subnet_of(p) for p in PRIVATE_NETWORKS),
             f"subnet ({text!r}) must be a private IPv4 network such as '{DEFAULT_SUBNET}' "
             f"(inside {', '.join(map(str, PRIVATE_NETWORKS))})")
    return subnet


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
