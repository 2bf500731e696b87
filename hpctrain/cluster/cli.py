"""``hpctrain cluster``: a cluster of emulated nodes on this machine (root).

A thin adapter: the spec is built and validated (``spec``) before anything is made,
``lifecycle`` builds and removes, ``launch`` forms the commands.
"""

from __future__ import annotations

import os
import sys
from functools import wraps
from pathlib import Path

import click

from hpctrain.cluster import spec as spec_mod
from hpctrain.cluster.spec import CPU_LIMITS, DEFAULT_NAME, DEFAULT_SUBNET, format_rate
from hpctrain.config import ConfigError


def _check_name(ctx, param, value: str | None) -> str | None:
    """Every subcommand applies the name rule before the name reaches a path."""
    try:
        return value if value is None else spec_mod.check_name(value)
    except ConfigError as err:
        raise click.BadParameter(str(err)) from None


NAME = click.option("--name", default=DEFAULT_NAME, show_default=True, callback=_check_name,
                    help="The cluster's name: prefix of its namespaces, links, cgroups and "
                         "host names (several clusters may be up at once).")


def _errors(fn):
    """Bad input is a usage error (exit 2); a failing system step an error (exit 1)."""
    @wraps(fn)
    def wrapper(*args, **kwargs):
        from hpctrain.cluster.system import ClusterError

        try:
            return fn(*args, **kwargs)
        except ConfigError as err:
            raise click.UsageError(str(err)) from None
        except ClusterError as err:
            raise click.ClickException(str(err)) from None
    return wrapper


@click.group("cluster")
def cluster() -> None:
    """A cluster of emulated nodes on this machine: network namespaces joined by a
    switch, each node's link shaped to a bandwidth, each node's CPUs pinned and
    capped by a cgroup, optionally SLURM on top. Needs root.

    \b
    Examples:
      hpctrain cluster up --nodes 2 --link 1gbit
      hpctrain cluster up --config configs/cluster-unequal.toml --slurm
      hpctrain cluster run --ranks-per-node 2 -- hpctrain train --config CONFIG.toml
      hpctrain cluster status
      hpctrain cluster down
    """


@cluster.command("up")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path),
              help="A cluster TOML file ([cluster] with [[cluster.nodes]] groups); "
                   "the options below describe a cluster of alike nodes instead.")
@click.option("--nodes", type=int, default=2, show_default=True, help="Nodes.")
@click.option("--cores", type=int, default=1, show_default=True,
              help="Cores each node may use.")
@click.option("--cpu-share", type=float, default=1.0, show_default=True,
              help="Fraction of its cores each node gets, in (0, 1].")
@click.option("--link", default="1gbit", show_default=True,
              help="Each node's link rate, each direction: 100mbit, 1gbit, 10gbit, ...")
@click.option("--subnet", default=DEFAULT_SUBNET, show_default=True,
              help="Private IPv4 network of the switch (must be unused on this machine).")
@click.option("--cpu-limit", type=click.Choice(CPU_LIMITS), default="cpuset",
              show_default=True,
              help="cpuset: pin each node to its own cores and cap its share; quota: cap "
                   "only.")
@click.option("--slurm/--no-slurm", default=None,
              help="Also start slurmctld and a slurmd on every node [default: no, or the "
                   "file's slurm].")
@click.option("--owner", type=int,
              help="The process this cluster belongs to: once it has ended, the next `up` "
                   "of this name removes the cluster as a leftover (tests pass their pid).")
@click.option("--name", callback=_check_name,
              help=f"The cluster's name [default: the file's, or {DEFAULT_NAME}].")
@_errors
def up_cmd(config_path, nodes, cores, cpu_share, link, subnet, cpu_limit, slurm, owner,
           name) -> None:
    """Build the cluster; refuse bad input before anything is made."""
    from hpctrain.cluster import lifecycle

    if config_path is not None:
        ctx = click.get_current_context()
        given = [f"--{p.replace('_', '-')}" for p in ("nodes", "cores", "cpu_share", "link",
                                                      "subnet", "cpu_limit")
                 if ctx.get_parameter_source(p) == click.core.ParameterSource.COMMANDLINE]
        if given:
            raise ConfigError(f"{', '.join(given)} describe a cluster without a file; with "
                              f"--config ({config_path}) only --name and --slurm apply")
        spec = spec_mod.load(config_path)
        if name is not None or slurm is not None:
            raw = spec.to_dict()
            raw["name"] = raw["name"] if name is None else name
            raw["slurm"] = spec.slurm if slurm is None else slurm
            spec = spec_mod.build(raw)
    else:
        spec = spec_mod.uniform(nodes, cores=cores, cpu_share=cpu_share, link=link,
                                subnet=subnet, cpu_limit=cpu_limit, slurm=bool(slurm),
                                name=DEFAULT_NAME if name is None else name)
    cl = lifecycle.up(spec, owner=owner, log=click.echo)
    _print_nodes(cl)
    click.echo(f"run across it:  hpctrain cluster run --name {spec.name} --ranks-per-node 2 "
               f"-- hpctrain train --config configs/gpt-shakespeare.toml")
    if spec.slurm:
        click.echo(f"SLURM:          export SLURM_CONF={cl.slurm_conf}; sinfo; "
                   f"sbatch --nodes {len(spec.nodes)} jobscripts/train.sbatch")
    click.echo(f"take it down:   hpctrain cluster down --name {spec.name}")


def _print_nodes(cl, status: list[dict] | None = None) -> None:
    header = f"{'node':<10} {'address':<15} {'cpus':<6} {'cores':>5} {'link':>8}"
    if status is not None:
        header += f" {'procs':>5} {'sent MB':>9} {'recv MB':>9} {'cpu s':>8}"
    click.echo(header)
    rows = status or [{"node": n.hostname, "address": n.address,
                       "cpus": ",".join(map(str, n.cpus)) or "any", "cores": n.cpu_cores,
                       "link": format_rate(n.link_bps)} for n in cl.spec.nodes]
    for r in rows:
        line = (f"{r['node']:<10} {r['address']:<15} {r['cpus']:<6} {r['cores']:>5.2f} "
                f"{r['link']:>8}")
        if status is not None:
            used = "-" if r["cpu_s"] is None else f"{r['cpu_s']:.1f}"
            sent, received = (("-", "-") if r["sent_bytes"] is None else
                              (f"{r['sent_bytes'] / 1e6:.1f}",
                               f"{r['received_bytes'] / 1e6:.1f}"))
            line += f" {r['processes']:>5} {sent:>9} {received:>9} {used:>8}"
            if r.get("broken"):
                line += f"  broken: {r['broken']}"
        click.echo(line)


@cluster.command("status")
@NAME
@_errors
def status_cmd(name: str) -> None:
    """The nodes of a cluster that is up: processes, bytes through each link, CPU used."""
    from hpctrain.cluster import lifecycle

    cl = lifecycle.current(name)
    owner = f", owner pid {cl.owner}" if cl.owner else ""
    click.echo(f"cluster {name!r}: {len(cl.spec.nodes)} node(s), switch {cl.spec.bridge} "
               f"{cl.spec.host_address}{owner}; state in {cl.folder}")
    rows = lifecycle.node_status(cl)
    _print_nodes(cl, rows)
    if cl.spec.slurm:
        from hpctrain.cluster import slurmd

        states = slurmd.node_states(cl.folder / "slurm")
        click.echo(f"SLURM (SLURM_CONF={cl.slurm_conf}): " +
                   (", ".join(f"{k} {v}" for k, v in states.items()) or "not answering"))
    broken = [r["node"] for r in rows if r.get("broken")]
    if broken:
        from hpctrain.cluster.system import ClusterError

        raise ClusterError(f"node(s) {', '.join(broken)} of cluster {name!r} are broken (a "
                           f"part was removed by hand): build it again with `hpctrain "
                           f"cluster down --name {name}`, then `hpctrain cluster up`")


@cluster.command("run", context_settings={"ignore_unknown_options": True})
@NAME
@click.option("--ranks-per-node", type=int, required=True,
              help="MPI ranks on each node; ranks fill the nodes in order (block).")
@click.option("-n", "--ranks", type=int,
              help="Ranks in all [default: ranks per node * nodes].")
@click.option("--placement", type=click.Choice(["block", "cyclic"]), default="block",
              show_default=True,
              help="block: fill each node before the next (ranks 0..r-1 on the first); "
                   "cyclic: one rank per node in turn.")
@click.option("--mpiexec", "mpiexec_path",
              help="MPICH's mpiexec (hydra) or Open MPI's mpirun [default: beside this "
                   "Python, else PATH's].")
@click.option("--dry-run", is_flag=True, help="Print the mpiexec command, run nothing.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@_errors
def run_cmd(name, ranks_per_node, ranks, placement, mpiexec_path, dry_run, command) -> None:
    """Run COMMAND as one MPI job across the nodes (mpiexec through each node's launcher).

    \b
    Examples:
      hpctrain cluster run --ranks-per-node 2 -- hpctrain train --config CONFIG.toml
      hpctrain cluster run --ranks-per-node 2 -n 3 -- python -m mpi4py my_script.py
    """
    import shlex

    from hpctrain.cluster import lifecycle
    from hpctrain.runtime import find_mpiexec

    cl = lifecycle.current(name)
    if ranks_per_node < 1:
        raise ConfigError(f"ranks per node ({ranks_per_node}) must be at least 1")
    argv = cl.mpiexec_command(list(command), ranks_per_node=ranks_per_node, ranks=ranks,
                              mpiexec=mpiexec_path or find_mpiexec(), placement=placement)
    if dry_run:
        click.echo(shlex.join(argv))
        return
    sys.stdout.flush()
    os.execv(argv[0], argv)


@cluster.command("exec", context_settings={"ignore_unknown_options": True})
@NAME
@click.argument("node")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@_errors
def exec_cmd(name, node, command) -> None:
    """Run COMMAND on NODE: in its cgroups, network namespace and host name.

    COMMAND is a program and its arguments, not a shell line (unlike ssh's remote
    command): a quoted line such as 'hostname; getent hosts x' is one program name. For
    a shell line, run a shell: -- sh -c 'hostname; getent hosts x'.

    \b
    Examples:
      hpctrain cluster exec hpct1 -- python -c "import socket; print(socket.gethostname())"
      hpctrain cluster exec --name hpct hpct0 -- sh -c 'hostname; ip -brief addr'
    """
    from hpctrain.cluster import lifecycle

    argv = lifecycle.current(name).node_command(node, list(command))
    sys.stdout.flush()
    os.execv(argv[0], argv)


@cluster.command("down")
@NAME
@click.option("--all", "everything", is_flag=True,
              help="Every cluster on this machine, whatever its name.")
@_errors
def down_cmd(name: str, everything: bool) -> None:
    """Remove everything of the cluster: processes on its nodes, SLURM daemons, cgroups,
    namespaces, links, /etc/hosts lines, state. With nothing up it does nothing."""
    from hpctrain.cluster import lifecycle

    names = lifecycle.known() if everything else [name]
    if not names:
        click.echo("no emulated cluster on this machine")
    for n in names:
        removed = lifecycle.down(n)
        if removed:
            click.echo(f"cluster {n!r} removed: {', '.join(removed)}")
        else:
            click.echo(f"nothing of cluster {n!r} to remove")
