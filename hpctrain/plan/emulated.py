"""``hpctrain calibrate --emulated NODES:LINK``: the description of an emulated cluster.

Brings up ``NODES`` one-core nodes of ``hpctrain cluster`` (a network namespace and a
cgroup a node, each link shaped by ``tbf`` at ``LINK``; ``hpctrain/cluster/``), measures
them with the same workers as ``hpctrain calibrate`` launched one rank a node through
the cluster's ``mpiexec`` (UCX over TCP on each node's shaped ``eth0``,
``cluster/launch.py``), and removes the cluster, pass or fail:

* **the node kind**, with every node computing at once (``NODES`` ranks, one BLAS
  thread each): the GEMM tables (operands from memory and in the caches) and the
  element-wise (stream) rate of one rank, sustained (samples of about 0.2 s, their
  median: ``calibrate.gemm_rates``). Nodes
  beyond this machine's cores share them (``cpuset`` pins node k to core k mod
  cores) and each is capped at its share (``node_share``: the CFS quota, half a core
  for 4 nodes on 2 cores), so a node measures what it has while its peers compute,
  and a node waiting in a collective (MPICH's UCX progress loop spins) burns its own
  share, not the core of the node beside it (``bench_plan.py measure --nodes`` caps
  its nodes alike);
* **the links between nodes**: all-reduce, all-gather, reduce-scatter over p = 2 and
  p = ``NODES`` ranks, one a node, and a ping-pong between nodes 0 and 1, fitted per
  op by ``calibrate.fit_pieces``. With an even number of nodes, 4 or more, p = 2 and
  the ping-pong are timed in pairs of nodes, every pair at once (``calibrate.
  pair_times``), as a layout's groups of two run beside each other: on 4 half-core
  nodes two nodes timed alone, the other two idle, took 2-3 times as long at 1-256 KiB
  (an all-reduce of 1 KiB 161 against 56 us, of 256 KiB 4.2 against 2.2 ms) and about
  as long from 1 MiB on. The switch port of node 0 counts what the node sent;
  a job whose count is below ``MIN_ON_LINK`` of what the ring model says rank 0 sent
  did not go over the link (UCX chose shared memory), and is an error;
* **how a sum and the compute beside it slow each other** (``comm_slowdown``,
  ``compute_slowdown``): gradient buckets summed by the data-parallel engine's own
  machinery beside a loop of products, on every node at once over the shaped links,
  against each alone, in groups of every size the nodes divide into (``overlap.py``:
  groups of two nodes were slowed 4.6 times, one of four 2.9 times); more than one
  size is written as a table by the nodes a data group spans.

Every node has one rank, so no collective stays inside a node: ``[links.intra]`` is a
copy of ``[links.inter]`` and the file says so. ``describe`` is the pure part (what a
result becomes), tested without root.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import click

from hpctrain.plan import calibrate as cal
from hpctrain.plan import cluster as cl
from hpctrain.plan import overlap

NAME, SUBNET = "hpctcal", "10.223.0.0/24"  # the calibration's own cluster and switch
MIN_ON_LINK = 0.9  # node 0's port must count at least this share of rank 0's ring bytes
DEFAULT_MESSAGES = tuple(cal.KiB * 4**i for i in range(8))  # 1 KiB .. 16 MiB
QUICK_MESSAGES = (cal.KiB, 64 * cal.KiB, cal.MiB)
OVERLAP_BYTES = 16 * cal.MiB  # gradient buckets summed beside compute (overlap.py)


def parse(text: str) -> tuple[int, str]:
    """``"4:1gbit"`` -> (4, "1gbit"); a ValueError naming the value and the rule."""
    from hpctrain.cluster.spec import parse_rate
    from hpctrain.config import ConfigError

    nodes, sep, link = text.partition(":")
    if not sep or not nodes.strip().isdigit():
        raise ValueError(f"{text!r} must be NODES:LINK, e.g. 2:1gbit or 4:100mbit")
    n = int(nodes)
    if not 2 <= n <= 16:
        raise ValueError(f"nodes ({n}) must be between 2 and 16")
    try:
        parse_rate(link)
    except ConfigError as err:
        raise ValueError(str(err)) from None
    return n, link.strip()


@dataclass(frozen=True)
class Measured:
    """What the jobs on the emulated cluster returned."""

    nodes: int
    link: str
    gemm: dict[int, list[float]]  # n -> each rank's FLOP/s, every node at once
    stream: list[float]  # each rank's bytes/s, every node at once
    samples: list[cal.Sample]
    on_link: list[tuple[int, float, int]]  # per job: (ranks, ring bytes of rank 0, port bytes)
    memory_bytes: float  # this machine's memory
    # nodes a data group spans -> overlap.overlap_times (overlap.group_times), shaped links
    overlap: dict[int, dict] | None = None
    gemm_cached: dict[int, list[float]] | None = None  # as gemm, operands in the caches


def describe(m: Measured, name: str | None = None) -> tuple[cl.Cluster, list[str]]:
    """The description (one node kind, ``m.nodes`` nodes, fitted inter links copied to
    intra) and the fit report's lines. Pure."""
    gemm = {1: cal.median_table(m.gemm)}
    cached = None if m.gemm_cached is None else {1: cal.median_table(m.gemm_cached)}
    by_size, unread = {}, []
    for p, times in sorted((m.overlap or {}).items()):
        try:
            by_size[p] = overlap.slowdowns(times)
        except ValueError as err:  # the rest of the calibration stands; say so
            unread.append(f"groups of {p}: {err}")
    slowed = {}
    if by_size:  # one size: one number; more: a table by the nodes a group spans
        slowed = {field: ({p: f[i] for p, f in by_size.items()} if len(by_size) > 1
                          else next(iter(by_size.values()))[i])
                  for i, field in enumerate(cl.SLOWDOWNS)}
    kind = cl.NodeKind("node", 1, m.memory_bytes / m.nodes, gemm,
                       {1: statistics.median(m.stream)}, cached, **slowed)
    links, report = {}, []
    for op in cl.OPS:
        mine = [s for s in m.samples if s.op == op]
        links[op] = cal.fit_pieces(op, mine)
        report += cal.fit_report(op, links[op], mine)
    cluster = cl.Cluster(name or f"emulated-{m.nodes}x{m.link}", "mpiexec", {"node": kind},
                         (("node", m.nodes),), {"intra": dict(links), "inter": links})
    for p, (comm_x, compute_x) in by_size.items():
        o = m.overlap[p]
        report.append(f"  {o['nbytes'] / 2**20:.0f} MiB of gradient buckets summed in groups "
                      f"of {p} nodes: alone {o['comm_s']:.3f} s; beside {o['compute_s']:.3f} "
                      f"s of products, done after {o['done_s']:.3f} s, the products "
                      f"{o['both_s']:.3f} s: the sum {comm_x:.2f}x as long (comm_slowdown), "
                      f"the products {compute_x:.2f}x while it ran (compute_slowdown)")
    if unread:
        have = (f"the description prices every group at the sizes measured "
                f"({', '.join(map(str, by_size))})" if by_size else
                "the description has none (1 and 1)")
        report.append(f"  the slowdowns of a sum beside compute were not measured "
                      f"({'; '.join(unread)}): {have}; calibrate again on a quieter machine, "
                      f"or add them by hand")
    return cluster, report


def check_on_link(on_link: list[tuple[int, float, int]]) -> list[str]:
    """Lines saying what each job's node-0 port counted against the ring model; a
    ClickException when one counted less than ``MIN_ON_LINK`` of it."""
    lines = []
    for ranks, ring, port in on_link:
        share = port / ring if ring else float("inf")
        lines.append(f"  {ranks} nodes: node 0's switch port counted {port / 1e6:.1f} MB, the "
                     f"ring model's bytes of rank 0 {ring / 1e6:.1f} MB ({share:.2f}x)")
        if share < MIN_ON_LINK:
            raise click.ClickException(
                f"the collectives over {ranks} nodes did not cross the shaped link: node 0's "
                f"port counted {port / 1e6:.1f} MB of the {ring / 1e6:.1f} MB rank 0 sent "
                f"(less than {MIN_ON_LINK:.0%}); is UCX_TLS=tcp reaching the ranks?")
    return lines


def node_share(nodes: int, cores: int) -> float:
    """The share of its one core a node gets when ``nodes`` one-core nodes share this
    machine's ``cores``: 1 when each has its own, else cores / nodes (the quota)."""
    return min(1.0, cores / nodes)


def note(nodes: int, link: str, cores: int) -> str:
    share = node_share(nodes, cores)
    return (f"# {nodes} emulated one-core nodes at {link} on a machine of {cores} cores: a "
            f"node has\n# {share:.2g} of a core (its CFS quota; the GEMM "
            f"and stream rates were measured\n# with all {nodes} nodes at once, one rank "
            f"and one BLAS thread each, sustained over 0.2 s samples)\n")


INTRA_NOTE = ("# intra: one rank a node, so nothing stays inside a node; these are the "
              "inter-node fits copied\n")


def measure(nodes: int, link: str, settings: cal.Settings, mpiexec: str,
            timeout: float, overlap_bytes: int = OVERLAP_BYTES) -> Measured:
    """Bring the cluster up, run the jobs, take it down (root)."""
    from hpctrain.cluster import lifecycle, net
    from hpctrain.cluster import spec as spec_mod

    spec = spec_mod.uniform(nodes, cores=1, cpu_share=node_share(nodes, cal.core_count()),
                            link=link, name=NAME, subnet=SUBNET)
    gemm, cached, stream, samples, on_link, overlapped = {}, {}, [], [], [], None
    with lifecycle.running(spec, log=lambda text: click.echo(text, err=True)) as c:
        def command(ranks, argv):
            return c.mpiexec_command(argv, ranks_per_node=1, ranks=ranks, mpiexec=mpiexec)

        node0 = spec.nodes[0]
        pairs = nodes >= 4 and nodes % 2 == 0  # p = 2 timed in pairs, every node busy
        for ranks in [nodes] if pairs else sorted({nodes, 2}, reverse=True):
            first = ranks == nodes
            click.echo(f"== {ranks} node(s), one rank each: "
                       + ("GEMM, stream and collectives" if first else "collectives")
                       + (", the collectives also in pairs" if pairs else ""), err=True)
            t0 = time.perf_counter()
            before = net.link_bytes(spec, node0)[0]
            result = cal.run_worker(mpiexec, ranks, 1, settings.sizes if first else (),
                                    settings.messages,
                                    (settings.gemm_repeats, settings.comm_repeats), timeout,
                                    stream=first, sustained=True, command=command,
                                    overlap=overlap_bytes if first else 0, pairs=pairs)
            on_link.append((ranks, result["sent_bytes"],
                            net.link_bytes(spec, node0)[0] - before))
            if first:
                gemm = {int(n): r for n, r in result["gemm"].items()}
                cached = {int(n): r for n, r in result["gemm_cached"].items()}
                stream = result["stream"]
                overlapped = ({int(p): t for p, t in result["overlap"].items()}
                              if result.get("overlap") else None)
            samples += [cal.Sample(**s) for s in result["samples"]]
            click.echo(f"   {time.perf_counter() - t0:.0f} s", err=True)
    return Measured(nodes, link, gemm, stream, samples, on_link, cal.memory_gib() * 2**30,
                    overlapped, cached)


def calibrate(spec_text: str, out: str, sizes, messages, repeats, name, mpiexec: str,
              timeout: float, quick: bool, command_line: str) -> None:
    """The ``--emulated`` path of ``hpctrain calibrate``: measure, check, fit, write."""
    from hpctrain.cluster.system import ClusterError

    try:
        nodes, link = parse(spec_text)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--emulated") from None
    cores = cal.core_count()
    settings = cal.Settings(1, (1,), sizes or (cal.QUICK_SIZES if quick else cal.DEFAULT_SIZES),
                            messages or (QUICK_MESSAGES if quick else DEFAULT_MESSAGES),
                            repeats or (2 if quick else 3), repeats or (2 if quick else 7))
    load = Path("/proc/loadavg").read_text().strip()
    click.echo(f"calibrating {nodes} emulated one-core nodes at {link} on {cores} cores; "
               f"load {load}", err=True)
    try:
        m = measure(nodes, link, settings, mpiexec, timeout,
                    OVERLAP_BYTES // 4 if quick else OVERLAP_BYTES)
    except ClusterError as err:
        raise click.ClickException(str(err)) from None
    click.echo("\ntraffic between nodes, on the link:")
    click.echo("\n".join(check_on_link(m.on_link)))
    try:
        cluster, report = describe(m, name)
    except ValueError as err:
        raise click.ClickException(str(err)) from None
    click.echo("\ncollectives between nodes, measured against fitted:")
    click.echo("\n".join(report))
    how = (f"{nodes} one-core nodes at {link}, one rank each; GEMM n "
           f"{','.join(map(str, settings.sizes))}, best of {settings.gemm_repeats}; "
           f"collectives over p = {','.join(map(str, sorted({2, nodes})))} nodes, "
           f"{cal._bytes(settings.messages[0])} to {cal._bytes(settings.messages[-1])}, "
           f"median of {settings.comm_repeats}")
    text = cal.header(command_line, how, load) + note(nodes, link, cores)
    text += cl.to_toml(cluster).replace("[links.intra]", INTRA_NOTE + "[links.intra]")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text.rstrip("\n") + "\n")
    try:
        back = cl.load_cluster(out)
    except cl.ClusterError as err:
        raise click.ClickException(f"{out} was written but does not read back: {err}") from None
    kind = back.kinds["node"]
    click.echo(f"\nGEMM, GFLOP/s per node with all {nodes} computing, operands from memory "
               f"(in the caches): " + cal.gemm_row(kind.gemm[1], (kind.gemm_cached or {}).get(1))
               + f"; stream {kind.stream[1] / 1e9:.1f} GB/s")
    click.echo(f"wrote {out} (read back: {back.num_nodes} nodes of 1 core, "
               f"{kind.memory_bytes / 2**30:.1f} GiB each)")
