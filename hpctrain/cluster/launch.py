"""Starting processes on emulated nodes: the ``ssh`` that mpiexec calls, and mpiexec itself.

MPICH's ``mpiexec`` (hydra) starts one proxy per host through a launcher called like
ssh: ``LAUNCHER [options] HOST COMMAND...``. ``launcher_script`` writes that launcher
for a cluster: it maps the host to its node, puts itself into the node's cgroups,
enters the node's network namespace, a fresh UTS namespace with the node's host name
and a fresh mount namespace with its own ``/dev/shm``, and runs the command there;
the proxy's ranks inherit all of it::

    mpiexec -launcher ssh -launcher-exec STATE/ssh -iface {name}br -hosts h0:2,h1:2 -n 4 CMD
       |-- STATE/ssh h0 proxy...  -> cgroup h0, netns {name}-h0, hostname h0 -> ranks 0, 1
       '-- STATE/ssh h1 proxy...  -> cgroup h1, netns {name}-h1, hostname h1 -> ranks 2, 3

The proxies reach mpiexec through the switch (``-iface``). Ranks on one node share a
host name and a ``/dev/shm``, so MPICH joins them through shared memory. The private
``/dev/shm`` goes with the node's last process: MPICH names its segments after the job
and step, with a weak hash, and a segment a killed job left in a shared ``/dev/shm``
was joined by a later job of another id, which then failed in ``MPI_Init``. Between
nodes, MPICH's UCX
network module must use TCP over the node's ``eth0`` (``UCX_ENV``): left to itself,
UCX finds the other "node" is this machine and moves the data through shared memory,
past the shaped link.

Open MPI's ``mpirun`` (ORTE in 4.x; PRRTE in 5.x takes the same parameters) takes the
same launcher as its remote shell (``plm_rsh_agent``) and starts one ``orted`` (``prted``)
per node through it, each reaching
``mpirun`` over the switch (``oob_tcp_if_include``, the cluster's subnet); its ranks
talk through shared memory inside a node and TCP on the subnet between nodes
(``OPENMPI_MCA``: ob1 with the self, vader and tcp transports, never UCX, which could
take shared memory past the link as it does for MPICH)::

    mpirun --mca plm_rsh_agent STATE/ssh --host h0:2,h1:2 --map-by slot -n 4 ... CMD
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from hpctrain.cluster.spec import NODE_IFACE, ClusterSpec

# UCX: TCP between nodes (and self for a rank's messages to itself), on the shaped link
UCX_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": NODE_IFACE}
# Open MPI: its own point-to-point layer over shared memory (vader) and TCP; every orted
# launched by mpirun itself (a node's launcher cannot start another node's orted)
OPENMPI_MCA = {"pml": "ob1", "btl": "self,vader,tcp", "plm_rsh_no_tree_spawn": "1"}
FLAVOURS = ("hydra", "openmpi")


def mpiexec_flavour(mpiexec: str) -> str:
    """Which launcher ``mpiexec`` is, from its ``--version``: "hydra" (MPICH's, and
    the pip MPICH's) or "openmpi" (Open MPI's ``mpirun``: ORTE in 4.x, PRRTE in 5.x,
    which take the same command line here)."""
    from hpctrain.config import ConfigError

    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ConfigError(f"mpiexec ({mpiexec}) does not run: {err}") from None
    text = out.stdout + out.stderr
    if "HYDRA" in text:
        return "hydra"
    if "OpenRTE" in text or "Open MPI" in text:
        return "openmpi"
    first = text.strip().splitlines()[0] if text.strip() else "nothing"
    raise ConfigError(f"mpiexec ({mpiexec}) must be MPICH's mpiexec (hydra) or Open MPI's "
                      f"mpirun; its --version says {first!r}")


def launcher_script(spec: ClusterSpec, procs: dict[str, list[Path]]) -> str:
    """The ssh-like launcher of ``spec``'s nodes; ``procs``: each host's cgroup.procs files."""
    cases = []
    for n in spec.nodes:
        files = " ".join(shlex.quote(str(p)) for p in procs[n.hostname])
        cases.append(f"  {n.hostname}|{n.address}) host={n.hostname} "
                     f"ns={shlex.quote(spec.netns(n))} procs={shlex.quote(files)} ;;")
    return f"""#!/bin/sh
# Runs a command on a node of the emulated cluster {spec.name!r}, as ssh would:
#   {{this file}} [ssh options] HOST COMMAND...
# Written by `hpctrain cluster up`; mpiexec calls it with -launcher ssh -launcher-exec.
while [ $# -gt 0 ]; do
  case $1 in
    -[bcDEeFIiJLlmOopQRSWw]) shift 2 ;;  # ssh options that take a value
    -*) shift ;;
    *) break ;;
  esac
done
[ $# -ge 2 ] || {{ echo "usage: $0 [options] HOST COMMAND..." >&2; exit 255; }}
case $1 in
{chr(10).join(cases)}
  *) echo "$0: $1 is not a node of cluster {spec.name}" >&2; exit 255 ;;
esac
shift
for f in $procs; do
  echo $$ > "$f" || {{ echo "$0: cannot join $f" >&2; exit 255; }}
done
exec nsenter --net=/run/netns/$ns -- unshare --uts --mount --propagation private -- \\
  /bin/sh -c 'mount -t tmpfs -o mode=1777 shm-"$1" /dev/shm && hostname "$1" && shift &&
              exec /bin/sh -c "$*"' sh "$host" "$@"
"""


PLACEMENTS = ("block", "cyclic")


def mpiexec_command(spec: ClusterSpec, launcher: Path, mpiexec: str, argv: list[str], *,
                    ranks_per_node: int, ranks: int | None = None,
                    nodes: list[str] | None = None, placement: str = "block",
                    flavour: str | None = None) -> list[str]:
    """``mpiexec`` over the cluster: ``ranks_per_node`` ranks on each node, ``ranks`` in
    all (default: all slots of ``nodes``, default every node). ``placement`` "block"
    fills the nodes one after the other (ranks 0..r-1 on the first, as SLURM does by
    default); "cyclic" deals the ranks out one per node in turn (SLURM's
    ``--distribution=cyclic``). ``flavour``: "hydra" or "openmpi" (None: ask
    ``mpiexec``, ``mpiexec_flavour``)."""
    if placement not in PLACEMENTS:
        from hpctrain.config import ConfigError

        raise ConfigError(f"placement ({placement!r}) must be one of {', '.join(PLACEMENTS)}")
    hosts = nodes or [n.hostname for n in spec.nodes]
    for h in hosts:
        spec.node(h)  # an unknown host fails here, naming the nodes there are
    slots = ranks_per_node * len(hosts)
    ranks = slots if ranks is None else ranks
    if not 1 <= ranks <= slots:
        from hpctrain.config import ConfigError

        raise ConfigError(f"ranks ({ranks}) must be between 1 and ranks per node * nodes "
                          f"({ranks_per_node} * {len(hosts)} = {slots})")
    flavour = flavour or mpiexec_flavour(mpiexec)
    if flavour not in FLAVOURS:
        from hpctrain.config import ConfigError

        raise ConfigError(f"flavour ({flavour!r}) must be one of {', '.join(FLAVOURS)}")
    if flavour == "openmpi":
        mca = {**OPENMPI_MCA, "plm_rsh_agent": str(launcher),
               "oob_tcp_if_include": spec.subnet, "btl_tcp_if_include": spec.subnet}
        return [mpiexec, "--allow-run-as-root", "--host",
                ",".join(f"{h}:{ranks_per_node}" for h in hosts),
                "--map-by", "slot" if placement == "block" else "node", "-n", str(ranks),
                *[a for k, v in mca.items() for a in ("--mca", k, v)], *argv]
    env = [a for k, v in UCX_ENV.items() for a in ("-genv", k, v)]
    slots_per_host = ranks_per_node if placement == "block" else 1  # hydra wraps around
    return [mpiexec, "-launcher", "ssh", "-launcher-exec", str(launcher), "-iface",
            spec.bridge, "-hosts", ",".join(f"{h}:{slots_per_host}" for h in hosts),
            "-n", str(ranks), *env, *argv]


def node_command(launcher: Path, host: str, argv: list[str]) -> list[str]:
    """``argv`` run on node ``host`` (its cgroups, namespace and host name)."""
    return [str(launcher), host, shlex.join(argv)]
