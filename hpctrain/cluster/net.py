"""The network of an emulated cluster: one namespace per node, a switch, shaped links.

::

         this machine (root namespace): mpiexec, slurmctld
                  {name}br  10.213.0.1/24          the switch (a Linux bridge)
           +----------+----------+----------+
      {name}v0   {name}v1   {name}v2   {name}v3    switch ports, tbf: node's ingress
           |          |          |          |
         eth0       eth0       eth0       eth0     tbf: node's egress
      10.213.0.10  .11        .12        .13
      netns {name}-{name}0 ...                     one network namespace per node

Each node's link is shaped in both directions by a token bucket (``tc qdisc ... tbf``):
egress on the node's ``eth0``, ingress on its switch port, so a node sends and
receives at most the link rate, as through its own NIC on a non-blocking switch.
Traffic between processes of one node never reaches a shaped device: TCP to the
node's own address goes over the namespace's loopback, and MPICH uses shared memory
between ranks with the same host name. Only bandwidth is emulated: without ``netem``
there is no added latency.

Host names resolve through ``/etc/hosts`` lines that end with a marker naming the
cluster; ``remove_hosts`` deletes exactly those lines. Every function here runs as
root; every removal is idempotent, so ``down`` also clears what a killed ``up`` or a
killed test left behind.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from hpctrain.cluster.spec import NODE_IFACE, ClusterSpec, NodeSpec
from hpctrain.cluster.system import ClusterError, kill_all, sh

HOSTS = Path("/etc/hosts")
NETNS_DIR = Path("/run/netns")


def hosts_marker(name: str) -> str:
    return f"# hpctrain-cluster {name}"


def tbf_args(bps: int) -> list[str]:
    """``tc qdisc ... tbf`` parameters for a link of ``bps``.

    The bucket holds 2 ms of traffic (at least 32 KiB, several full packets): smaller
    buckets held a 1 Gbit/s link to 75% of its rate in an all-reduce, this one to 95%.
    ``latency`` bounds the queue (400 ms of traffic); TCP never filled it here.
    """
    burst = max(32 * 1024, bps // 8 // 500)
    return ["rate", f"{bps}bit", "burst", str(burst), "latency", "400ms"]


def existing_netns(name: str) -> list[str]:
    """The network namespaces of cluster ``name`` (by their name prefix)."""
    if not NETNS_DIR.is_dir():
        return []
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(f"{name}-"))


def existing_links(name: str) -> list[str]:
    """Interfaces of the root namespace that belong to cluster ``name``."""
    out = sh("ip", "-o", "link", "show", check=False).stdout
    links = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()
             if line.count(":") >= 2]
    return [n for n in links if n == f"{name}br" or
            (n.startswith(f"{name}v") and n[len(name) + 1:].isdigit())]


def subnet_in_use(spec: ClusterSpec) -> list[str]:
    """Addresses of this machine (outside the cluster) that fall inside its subnet."""
    subnet = ipaddress.ip_network(spec.subnet)
    out = sh("ip", "-o", "-4", "addr", "show", check=False).stdout
    clash = []
    for line in out.splitlines():
        parts = line.split()
        dev, addr = parts[1], parts[3]
        if dev == spec.bridge:
            continue
        if ipaddress.ip_interface(addr).network.overlaps(subnet):
            clash.append(f"{addr} on {dev}")
    return clash


def create_switch(spec: ClusterSpec) -> None:
    """The bridge, with this machine's address on it."""
    sh("ip", "link", "add", spec.bridge, "type", "bridge")
    sh("ip", "addr", "add", f"{spec.host_address}/{spec.prefix_len}", "dev", spec.bridge)
    sh("ip", "link", "set", spec.bridge, "up")


def create_node(spec: ClusterSpec, node: NodeSpec) -> None:
    """The node's namespace, its link to the switch, its address, both shapers."""
    ns, port = spec.netns(node), spec.switch_port(node)
    sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", port, "type", "veth", "peer", "name", NODE_IFACE, "netns", ns)
    sh("ip", "link", "set", port, "master", spec.bridge, "up")
    sh("ip", "-n", ns, "addr", "add", f"{node.address}/{spec.prefix_len}", "dev", NODE_IFACE)
    sh("ip", "-n", ns, "link", "set", NODE_IFACE, "up")
    sh("ip", "-n", ns, "link", "set", "lo", "up")
    shape_link(spec, node, node.link_bps)


def shape_link(spec: ClusterSpec, node: NodeSpec, bps: int) -> None:
    """Set both shapers of ``node``'s link to ``bps`` (``calibrate --emulated`` runs its
    collectives again on links fast enough that the nodes' cores bound them)."""
    shape = tbf_args(bps)
    sh("tc", "qdisc", "replace", "dev", spec.switch_port(node), "root", "tbf", *shape)
    sh("ip", "netns", "exec", spec.netns(node), "tc", "qdisc", "replace", "dev", NODE_IFACE,
       "root", "tbf", *shape)


def add_hosts(spec: ClusterSpec) -> None:
    """One ``/etc/hosts`` line per node, marked as this cluster's (written in place:
    the file may be a bind mount)."""
    text = _without_marked(HOSTS.read_text(), spec.name)
    if text and not text.endswith("\n"):
        text += "\n"
    text += "".join(f"{n.address} {n.hostname}  {hosts_marker(spec.name)}\n"
                    for n in spec.nodes)
    HOSTS.write_text(text)


def remove_hosts(name: str) -> bool:
    """Delete the marked lines of cluster ``name``; whether there were any."""
    if not HOSTS.exists():
        return False
    text = HOSTS.read_text()
    kept = _without_marked(text, name)
    if kept != text:
        HOSTS.write_text(kept)
    return kept != text


def marked_hosts() -> set[str]:
    """The cluster names that have lines in ``/etc/hosts``."""
    marker = hosts_marker("")
    text = HOSTS.read_text() if HOSTS.exists() else ""
    return {line.rsplit(marker, 1)[1].strip() for line in text.splitlines()
            if marker in line}


def hosts_in_use(spec: ClusterSpec) -> list[str]:
    """The cluster's host names that ``/etc/hosts`` already gives, outside this cluster's
    own lines: node 0 of cluster "a1" and node 10 of cluster "a" are both "a10"."""
    ours, marker = hosts_marker(spec.name), hosts_marker("")
    wanted = {n.hostname for n in spec.nodes}
    text = HOSTS.read_text() if HOSTS.exists() else ""
    clash = []
    for line in text.splitlines():
        if line.rstrip().endswith(ours):
            continue
        fields = line.partition("#")[0].split()
        whose = (f"cluster {line.rsplit(marker, 1)[1].strip()!r}" if marker in line
                 else "/etc/hosts")
        clash += [f"{host} ({fields[0]}, {whose})" for host in fields[1:] if host in wanted]
    return clash


def _without_marked(text: str, name: str) -> str:
    marker = hosts_marker(name)
    return "".join(line for line in text.splitlines(keepends=True)
                   if not line.rstrip().endswith(marker))


def netns_pids(ns: str) -> list[int]:
    return [int(p) for p in sh("ip", "netns", "pids", ns, check=False).stdout.split()]


def kill_netns_processes(ns: str) -> int:
    """End every process inside namespace ``ns``; how many survived.

    A namespace with a process inside outlives ``ip netns del``, and so do its links.
    """
    kill_all(netns_pids(ns))
    return len(netns_pids(ns))


def remove(name: str) -> list[str]:
    """Remove every namespace, link and hosts line of cluster ``name``; what was removed."""
    removed = []
    for ns in existing_netns(name):
        left = kill_netns_processes(ns)
        if left:
            raise ClusterError(f"{left} process(es) in namespace {ns} survived SIGKILL "
                               f"(pids {netns_pids(ns)})")
        sh("ip", "netns", "del", ns)
        removed.append(f"netns {ns}")
    for link in existing_links(name):
        # the switch ports go with their namespaces; whatever is left goes now
        if sh("ip", "link", "del", link, check=False).returncode == 0:
            removed.append(f"link {link}")
    if remove_hosts(name):
        removed.append("/etc/hosts lines")
    return removed


def link_bytes(spec: ClusterSpec, node: NodeSpec) -> tuple[int, int]:
    """(bytes the node sent, bytes it received) through its link so far: the switch
    port's counters, seen from the root namespace."""
    base = Path("/sys/class/net") / spec.switch_port(node) / "statistics"
    received_by_port = int((base / "rx_bytes").read_text())
    sent_by_port = int((base / "tx_bytes").read_text())
    return received_by_port, sent_by_port
