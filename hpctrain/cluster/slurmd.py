"""A real SLURM cluster on the emulated nodes: one slurmctld, one slurmd per node.

``slurmctld`` and ``munged`` run on this machine and listen on the switch address;
each node's ``slurmd`` runs inside the node (its cgroups, network namespace and host
name, started through the cluster's launcher), with its own ``NodeName`` and
``NodeAddr``, so every job step it starts is on that node, held to its CPU share and
its link. ``sbatch --nodes 2 jobscripts/train.sbatch`` is then one job on two nodes,
launched with ``srun --mpi=pmi2`` or with ``mpiexec`` inside the allocation.

What it takes (Debian's SLURM 22.05, no systemd):

* ``slurmd`` is started with ``nsenter``, not ``ip netns exec``, which remounts
  ``/sys``: slurmd then finds no cgroups and exits;
* ``SlurmctldHost`` is this machine's short host name with the switch address in
  parentheses; the node names resolve through ``/etc/hosts`` (``net.add_hosts``);
* per-node spool, pid and log files (``%n``);
* the jobs' MPI must use TCP on ``eth0`` (``SLURM_UCX_ENV``): a ``TaskProlog``
  exports it to every task, the batch script included, so job scripts stay as they
  are on a real cluster; an ``Epilog`` removes the MPICH segments of killed steps
  from the node's ``/dev/shm``, as sites do;
* the rest as in ``tests/slurm`` before: job ids from the clock (``FirstJobId``),
  ``config_overrides`` (nodes may declare more CPUs than their cores), short
  ``cred_expire`` and scheduler intervals so a requeued job restarts in seconds.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from hpctrain.cluster.launch import UCX_ENV, node_command
from hpctrain.cluster.spec import ClusterSpec
from hpctrain.cluster.system import ClusterError, alive, kill_all, sh

SLURMCTLD_PORT = 16817
SLURMD_PORT = 16818
MUNGE_KEY = Path("/etc/munge/munge.key")
DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "srun", "scontrol", "sinfo")


def install() -> None:
    """Debian's slurmctld, slurmd, slurm-client and munge, if any is missing."""
    if all(shutil.which(d) for d in DAEMONS):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", "slurmctld",
                 "slurmd", "slurm-client", "munge"]):
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if result.returncode != 0:
            raise ClusterError(f"`{' '.join(cmd)}` failed: {result.stderr.strip()[-500:]}")


def conf_text(spec: ClusterSpec, folder: Path, first_job_id: int) -> str:
    """slurm.conf of the cluster, its state and logs in ``folder``."""
    host = socket.gethostname().split(".")[0]
    nodes = "\n".join(
        f"NodeName={n.hostname} NodeAddr={n.address} NodeHostname={n.hostname} "
        f"CPUs={max(spec.slurm_cpus, n.cores)} RealMemory=1000 State=UNKNOWN"
        for n in spec.nodes)
    names = ",".join(n.hostname for n in spec.nodes)
    return f"""# the SLURM cluster of emulated cluster {spec.name!r} (hpctrain cluster up --slurm)
ClusterName=hpctrain-{spec.name}
SlurmctldHost={host}({spec.host_address})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={folder}/munge.socket,cred_expire=10
CredType=cred/munge
SlurmctldPort={SLURMCTLD_PORT}
SlurmdPort={SLURMD_PORT}
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool-%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
TaskProlog={folder}/task-prolog
Epilog={folder}/epilog
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=pmi2
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
FirstJobId={first_job_id}
MailProg=/bin/true
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MinJobAge=600
KillWait=10
{nodes}
PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


# Compact (v2) UCX worker addresses for jobs under SLURM: the default ones are long
# enough that MPICH cuts them into several PMI values, which SLURM's PMI-2 plugin
# (22.05) misreads, and `srun --mpi=pmi2` across two nodes often failed in MPI_Init
# (18 of 48 started; 80 of 80 with v2). Only here: v2 addresses made the hierarchical
# gradient sync between two nodes 15-35% slower (hydra's PMI takes long values).
SLURM_UCX_ENV = {**UCX_ENV, "UCX_ADDRESS_VERSION": "v2"}


def task_prolog() -> str:
    exports = "".join(f'echo "export {k}={v}"\n' for k, v in SLURM_UCX_ENV.items())
    return ("#!/bin/sh\n# every task of the emulated cluster: MPI between nodes on the link\n"
            + exports)


def epilog() -> str:
    """After every job, on each of its nodes (in the node's own ``/dev/shm``): remove
    the MPICH segments no process maps. A job step killed before MPI_Finalize leaves
    its segment, named after the job and step, and a requeued job (same id) joins it
    and fails in MPI_Init. A segment some process maps, here or on another node under
    the same name, is left alone."""
    return """#!/bin/sh
# every job's end on every node: drop MPICH shared-memory segments that no process maps
for f in /dev/shm/mpich_shm_*; do
  [ -e "$f" ] || continue
  grep -qs "$f" /proc/[0-9]*/maps || rm -f "$f"
done
exit 0
"""


def start(spec: ClusterSpec, folder: Path, launcher: Path, *, log=print,
          timeout: float = 60) -> None:
    """Write the configuration, start munged, slurmctld and every slurmd; wait until
    every node is idle."""
    install()
    _check_port_free(SLURMCTLD_PORT)
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "state").mkdir(parents=True)
    (folder / "munge").mkdir()
    # job ids differ from one start to the next: MPICH names its shared-memory segments
    # after the job step, and a segment a killed job left would be joined by the next
    first_job_id = (int(time.time()) % 100000) * 100 + 1
    conf = folder / "slurm.conf"
    conf.write_text(conf_text(spec, folder, first_job_id))
    for script, text in (("task-prolog", task_prolog()), ("epilog", epilog())):
        (folder / script).write_text(text)
        (folder / script).chmod(0o755)
    if not MUNGE_KEY.exists() or MUNGE_KEY.stat().st_size == 0:
        MUNGE_KEY.parent.mkdir(parents=True, exist_ok=True)
        MUNGE_KEY.write_bytes(os.urandom(1024))
        MUNGE_KEY.chmod(0o400)
    sh("munged", "--force", f"--socket={folder}/munge.socket",
       f"--pid-file={folder}/munged.pid", f"--seed-file={folder}/munge/seed",
       f"--log-file={folder}/munged.log")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    subprocess.run(["slurmctld", "-f", str(conf)], env=env, check=True, timeout=30)
    for n in spec.nodes:
        subprocess.run(node_command(launcher, n.hostname,
                                    ["env", f"SLURM_CONF={conf}", "slurmd", "-f", str(conf),
                                     "-N", n.hostname]),
                       env=env, check=True, timeout=30)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = node_states(folder)
        if len(states) == len(spec.nodes) and all(
                s.rstrip("*") in ("idle", "mixed", "allocated") for s in states.values()):
            log(f"slurm: {len(states)} node(s) idle; SLURM_CONF={conf}")
            return
        time.sleep(0.5)
    logs = "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text().splitlines()[-10:])
                     for p in sorted(folder.glob("*.log")))
    raise ClusterError(f"the SLURM nodes did not become idle within {timeout:.0f} s "
                       f"(states: {node_states(folder)}); last log lines:\n{logs}")


def node_states(folder: Path) -> dict[str, str]:
    """``sinfo``'s state of every node (empty if slurmctld does not answer)."""
    result = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True,
                            text=True, timeout=30,
                            env={**os.environ, "SLURM_CONF": str(folder / "slurm.conf")})
    return dict(line.split() for line in result.stdout.splitlines() if len(line.split()) == 2)


def pids(folder: Path) -> list[int]:
    """The daemons started for this cluster that still run."""
    found = []
    for pidfile in folder.glob("*.pid"):
        try:
            pid = int(pidfile.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        if alive(pid):
            found.append(pid)
    return found


def stop(folder: Path) -> list[str]:
    """End the cluster's SLURM daemons (job steps die with their node's namespace)."""
    daemons = pids(folder)
    left = kill_all(daemons, grace=5.0)
    if left:
        raise ClusterError(f"SLURM daemon(s) {left} of {folder} survived SIGKILL")
    return [f"{len(daemons)} SLURM daemon(s)"] if daemons else []


def _check_port_free(port: int) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            raise ClusterError(f"port {port} (slurmctld) is in use: another SLURM cluster "
                               f"runs here; take it down first") from None
