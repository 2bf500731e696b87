"""Bringing an emulated cluster up and down, and knowing whether one is up.

A cluster named ``name`` keeps its state in ``/run/hpctrain/cluster-{name}/``
(``state.json``, the launcher ``ssh``, the SLURM folder). ``/run`` is a tmpfs, so the
state goes with a reboot, as the namespaces do. ``up`` and ``down`` hold a lock file
beside it, so two of them never interleave; ``up`` also holds ``up.lock``, so two
``up``s of different names cannot both find the same subnet or host names free.
A name that breaks the name rule is refused before any path is formed from it.

``up`` validates before it creates anything (the spec is checked when it is built;
then root, the tools, the cgroup controllers, a free subnet and free names), records
``building``, builds (switch, nodes with their links and shapers, cgroups, host
names, launcher, SLURM), and records ``up``. If building fails, what was made is
removed before the error is raised. A cluster already up is refused, unless its
owner (``--owner PID``, what tests pass) has died: that cluster is a leftover of a
killed run, and ``up`` removes it first, as it does a half-built one. Interfaces or
namespaces of the name without a state folder are not ``up``'s (it makes the folder
before anything else and removes it last): it refuses, naming them.

``down`` removes everything of the name it is given, by name prefix, whether or not
the state survived: processes inside the nodes, SLURM daemons, cgroups, namespaces,
links, ``/etc/hosts`` lines and the state folder. With nothing up it does nothing.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hpctrain.cluster import cpu, launch, net, slurmd
from hpctrain.cluster import spec as spec_mod
from hpctrain.cluster.spec import ClusterSpec
from hpctrain.cluster.system import ClusterError, alive, require_root

STATE_ROOT = Path("/run/hpctrain")
TOOLS = ("ip", "tc", "nsenter", "unshare")
UP_LOCK_WAIT_S = 300  # how long an `up` waits for another `up` on this machine to end


def state_dir(name: str) -> Path:
    """The state folder of cluster ``name``; a name that breaks the name rule (such as
    ``x/../../tmp``) is a ConfigError, so nothing outside STATE_ROOT is read or removed."""
    return STATE_ROOT / f"cluster-{spec_mod.check_name(name)}"


@dataclass(frozen=True)
class Cluster:
    """A cluster that is up: its spec and where its state lives."""

    spec: ClusterSpec
    folder: Path
    owner: int | None
    since: float

    @property
    def launcher(self) -> Path:
        return self.folder / "ssh"

    @property
    def slurm_conf(self) -> Path | None:
        return self.folder / "slurm" / "slurm.conf" if self.spec.slurm else None

    def mpiexec_command(self, argv: list[str], *, ranks_per_node: int,
                        ranks: int | None = None, mpiexec: str = "mpiexec",
                        placement: str = "block") -> list[str]:
        return launch.mpiexec_command(self.spec, self.launcher, mpiexec, argv,
                                      ranks_per_node=ranks_per_node, ranks=ranks,
                                      placement=placement)

    def node_command(self, host: str, argv: list[str]) -> list[str]:
        self.spec.node(host)
        return launch.node_command(self.launcher, host, argv)

    def env(self) -> dict[str, str]:
        """What a shell needs to use the cluster: SLURM_CONF with SLURM."""
        return {"SLURM_CONF": str(self.slurm_conf)} if self.spec.slurm else {}


@contextmanager
def _locked(name: str) -> Iterator[None]:
    """The cluster's own lock: an `up` or `down` of ``name`` refuses to interleave."""
    lock = STATE_ROOT / f"cluster-{spec_mod.check_name(name)}.lock"
    STATE_ROOT.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ClusterError(f"another `hpctrain cluster up` or `down` of cluster {name!r} "
                               f"is running") from None
        yield


@contextmanager
def _machine_locked() -> Iterator[None]:
    """One `up` at a time on this machine, whatever its name: its checks (a free subnet,
    free host names) hold only if no other `up` builds between them and its own build."""
    STATE_ROOT.mkdir(parents=True, exist_ok=True)
    with open(STATE_ROOT / "up.lock", "w") as fh:
        wait_s = UP_LOCK_WAIT_S
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ClusterError(f"another `hpctrain cluster up` on this machine has "
                                       f"held {STATE_ROOT / 'up.lock'} for {wait_s:.0f} s; "
                                       f"try again when it has ended") from None
                time.sleep(0.05)
        yield


def _read_state(name: str) -> dict | None:
    try:
        return json.loads((state_dir(name) / "state.json").read_text())
    except (OSError, ValueError):
        return None


def _write_state(folder: Path, spec: ClusterSpec, status: str, owner: int | None) -> None:
    tmp = folder / "state.json.tmp"
    tmp.write_text(json.dumps({"status": status, "spec": spec.to_dict(), "owner": owner,
                               "since": time.time()}, indent=2))
    tmp.replace(folder / "state.json")


def current(name: str = spec_mod.DEFAULT_NAME) -> Cluster:
    """The cluster ``name`` that is up, or a ClusterError saying how to start one."""
    state = _read_state(name)
    if state is None or state.get("status") != "up":
        try:
            found = leftovers(name)
        except ClusterError:  # no `ip`: `up` says so
            found = []
        left = (f"; what there is of the name ({', '.join(found)}: a cluster not "
                f"completed, or one being built now) is removed by "
                f"`hpctrain cluster down --name {name}`" if found else "")
        raise ClusterError(f"no cluster {name!r} is up: start one with "
                           f"`hpctrain cluster up` (as root){left}")
    return Cluster(spec_mod.build(state["spec"]), state_dir(name), state.get("owner"),
                   state.get("since", 0.0))


def leftovers(name: str) -> list[str]:
    """What exists of cluster ``name`` on this machine (namespaces, links, state)."""
    found = [f"netns {ns}" for ns in net.existing_netns(name)]
    found += [f"link {link}" for link in net.existing_links(name)]
    found += [f"cgroup {top}" for top in _cgroup_tops(name)]
    if state_dir(name).exists():
        found.append(f"state {state_dir(name)}")
    return found


def preflight(spec: ClusterSpec) -> cpu.Cgroups:
    """Everything ``up`` needs, checked before anything is made."""
    require_root("hpctrain cluster up")
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        raise ClusterError(f"missing tool(s) {', '.join(missing)} (Debian: apt-get install "
                           f"iproute2 util-linux)")
    cgroups = cpu.detect()
    clash = net.subnet_in_use(spec)
    if clash:
        raise ClusterError(f"subnet ({spec.subnet}) overlaps this machine's address(es) "
                           f"{', '.join(clash)}: choose another with --subnet")
    taken = net.hosts_in_use(spec)
    if taken:
        raise ClusterError(f"host name(s) of cluster {spec.name!r} are already in "
                           f"{net.HOSTS}: {', '.join(taken)}; choose another --name")
    return cgroups


def up(spec: ClusterSpec, *, owner: int | None = None, log=print) -> Cluster:
    """Build the cluster (root). See the module docstring for the rules."""
    require_root("hpctrain cluster up")
    name = spec.name
    with _machine_locked(), _locked(name):
        cgroups = preflight(spec)
        state = _read_state(name)
        if state and state.get("status") == "up" and _owner_alive(state):
            raise ClusterError(
                f"cluster {name!r} is already up ({len(state['spec']['nodes'])} node(s)): "
                f"`hpctrain cluster down --name {name}` removes it")
        found = leftovers(name)
        if found and not state_dir(name).exists():
            # no `up` of this name left them (it makes its state folder first and
            # removes it last): they may be someone else's, so they stay
            raise ClusterError(
                f"{', '.join(found)} exist(s) but cluster {name!r} has no state in "
                f"{state_dir(name)}: `up` removes only what an earlier `up` left. Choose "
                f"another --name, or remove them (`hpctrain cluster down --name {name}` "
                f"removes whatever bears the name)")
        if found:
            why = ("its owner (pid {}) has ended".format(state.get("owner"))
                   if state and state.get("status") == "up" else "it was not complete")
            log(f"removing what is left of an earlier cluster {name!r} ({why}): "
                f"{', '.join(found)}")
            _remove(name, cgroups)
        folder = state_dir(name)
        folder.mkdir(parents=True)
        _write_state(folder, spec, "building", owner)
        try:
            _build(spec, folder, cgroups, log)
        except BaseException:
            _remove(name, cgroups)
            raise
        _write_state(folder, spec, "up", owner)
    return current(name)


def _owner_alive(state: dict) -> bool:
    owner = state.get("owner")
    return owner is None or alive(int(owner))


def _build(spec: ClusterSpec, folder: Path, cgroups: cpu.Cgroups, log) -> None:
    t0 = time.perf_counter()
    net.create_switch(spec)
    for n in spec.nodes:
        net.create_node(spec, n)
    cpu.create(cgroups, spec)
    net.add_hosts(spec)
    procs = {n.hostname: cpu.procs_files(cgroups, spec, n) for n in spec.nodes}
    launcher = folder / "ssh"
    launcher.write_text(launch.launcher_script(spec, procs))
    launcher.chmod(0o755)
    log(f"cluster {spec.name!r}: {len(spec.nodes)} node(s) up in "
        f"{time.perf_counter() - t0:.2f} s (cgroup v{cgroups.version})")
    if spec.slurm:
        slurmd.start(spec, folder / "slurm", launcher, log=log)


@contextmanager
def running(spec: ClusterSpec, *, log=print) -> Iterator[Cluster]:
    """The cluster for the length of a ``with`` block (tests, benchmarks), removed at
    its end, pass or fail. It belongs to this process: if the process is killed
    first, the next ``up`` of the name removes it."""
    cluster = up(spec, owner=os.getpid(), log=log)
    try:
        yield cluster
    finally:
        down(spec.name)
        left = leftovers(spec.name)
        if left:
            raise ClusterError(f"cluster {spec.name!r} leaked: {', '.join(left)}")


def known() -> list[str]:
    """The names of every cluster with something on this machine: a state folder, a
    node namespace (``{name}-{name}K``) or marked ``/etc/hosts`` lines."""
    names = {p.name.removeprefix("cluster-") for p in STATE_ROOT.glob("cluster-*")
             if p.is_dir()}
    for ns in net.existing_netns(""):
        name, _, node = ns.partition("-")
        if node.startswith(name) and node[len(name):].isdigit():
            names.add(name)
    names.update(net.marked_hosts())
    names.update(top.name.removeprefix("hpctrain-") for top in _cgroup_tops("*"))
    return sorted(n for n in names if spec_mod.is_name(n))  # no `up` made the others


def _cgroup_tops(name: str) -> list[Path]:
    """The cluster's cgroup directories that exist (``name`` may be a glob)."""
    try:
        cg = cpu.detect()
    except ClusterError:
        return []
    return sorted(p for root in {cg.cpu, cg.cpuset} for p in root.glob(f"hpctrain-{name}")
                  if p.is_dir())


def down(name: str = spec_mod.DEFAULT_NAME) -> list[str]:
    """Remove everything of cluster ``name`` (root); what was removed (empty: nothing)."""
    require_root("hpctrain cluster down")
    with _locked(name):
        if not leftovers(name) and not net.remove_hosts(name):
            return []
        return _remove(name, cpu.detect())


def _remove(name: str, cgroups: cpu.Cgroups) -> list[str]:
    """Every step runs, even after one fails; the first failure is raised at the end."""
    removed: list[str] = []
    errors: list[str] = []
    folder = state_dir(name)
    steps = [lambda: slurmd.stop(folder / "slurm"), lambda: cpu.remove(cgroups, name),
             lambda: net.remove(name)]
    for step in steps:
        try:
            removed += step()
        except ClusterError as err:
            errors.append(str(err))
    if folder.exists():
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(f"state {folder}")
    if errors:
        raise ClusterError("; ".join(errors))
    return removed


def node_status(cluster: Cluster) -> list[dict]:
    """Per node: address, CPU, link rate, processes, bytes through its link, CPU used."""
    spec = cluster.spec
    cgroups = cpu.detect()
    rows = []
    for n in spec.nodes:
        missing = [] if (net.NETNS_DIR / spec.netns(n)).exists() else \
            [f"namespace {spec.netns(n)}"]
        try:
            sent, received = net.link_bytes(spec, n)
        except OSError:
            sent = received = None
            missing.append(f"link {spec.switch_port(n)}")
        try:
            used = cpu.usage_s(cgroups, spec, n)
        except OSError:
            used = None
            missing.append(f"cgroup of {n.hostname}")
        rows.append({"node": n.hostname, "address": n.address,
                     "cpus": ",".join(map(str, n.cpus)) or "any", "cores": n.cpu_cores,
                     "link": spec_mod.format_rate(n.link_bps),
                     "processes": len(net.netns_pids(spec.netns(n))),
                     "sent_bytes": sent, "received_bytes": received, "cpu_s": used,
                     "broken": f"{', '.join(missing)} missing" if missing else None})
    return rows
