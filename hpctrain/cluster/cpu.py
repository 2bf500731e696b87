"""The CPUs of an emulated node: a cgroup that pins it to its cores and caps its share.

A node's processes (its MPI ranks, its ``slurmd`` and every job step) join the node's
cgroup before they enter its namespace, and everything they start stays in it:

* ``cpu_limit = "cpuset"``: the node runs only on its own cores (``cpuset.cpus``);
* the CFS quota caps it at ``cores * cpu_share`` cores (5000 us of every 10000 us is
  half a core), so nodes can be unequal; not when the node is pinned to its cores and
  gets all of them (``NodeSpec.capped``: the pinning enforces that, and a quota equal
  to it only throttles the node's threads when they run at once).

Both cgroup versions are supported. cgroup v1 (a hierarchy per controller, as on this
kind of machine)::

    /sys/fs/cgroup/cpu/hpctrain-{name}/{host}/     cpu.cfs_period_us, cpu.cfs_quota_us
    /sys/fs/cgroup/cpuset/hpctrain-{name}/{host}/  cpuset.cpus, cpuset.mems
    /sys/fs/cgroup/cpuacct/hpctrain-{name}/{host}/ cpuacct.usage (what the node used)

cgroup v2 (one hierarchy; the controllers enabled in each parent's
``cgroup.subtree_control``)::

    /sys/fs/cgroup/hpctrain-{name}/{host}/         cpu.max, cpuset.cpus, cpu.stat

``plan`` is the pure part (which directories, which values, in which order), tested
for both versions; ``create`` and ``remove`` apply it as root.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hpctrain.cluster.spec import PERIOD_US, ClusterSpec, NodeSpec
from hpctrain.cluster.system import ClusterError, kill_all

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class Cgroups:
    """Where the CPU controllers are mounted. ``version`` 1: ``cpu``, ``cpuset`` and
    ``cpuacct`` are the mount points of those controllers (``cpuacct`` may be None);
    version 2: all three are the unified root."""

    version: int
    cpu: Path
    cpuset: Path
    cpuacct: Path | None

    def top(self, name: str) -> list[Path]:
        """The cluster's own directories, one per hierarchy (``hpctrain-{name}``)."""
        roots = {self.cpu, self.cpuset} | ({self.cpuacct} if self.cpuacct else set())
        return sorted({(r / f"hpctrain-{name}") for r in roots})

    def node_dirs(self, name: str, node: NodeSpec) -> list[Path]:
        return [top / node.hostname for top in self.top(name)]


def detect(root: Path = CGROUP_ROOT) -> Cgroups:
    """The cgroup version and controller mounts of this machine."""
    controllers = root / "cgroup.controllers"
    if controllers.exists():
        have = controllers.read_text().split()
        missing = [c for c in ("cpu", "cpuset") if c not in have]
        if missing:
            raise ClusterError(f"cgroup v2 at {root} lacks the {' and '.join(missing)} "
                               f"controller(s) (it has: {' '.join(have) or 'none'})")
        return Cgroups(2, root, root, root)
    if (root / "cpu" / "cpu.cfs_quota_us").exists() and (root / "cpuset").is_dir():
        cpuacct = root / "cpuacct"
        # resolved: cpu and cpuacct are often one hierarchy behind two links
        return Cgroups(1, (root / "cpu").resolve(), (root / "cpuset").resolve(),
                       cpuacct.resolve() if (cpuacct / "cpuacct.usage").exists() else None)
    raise ClusterError(f"no cgroup CPU controller found under {root} (need cgroup v2 with "
                       f"cpu and cpuset, or v1's cpu and cpuset hierarchies)")


def plan(cg: Cgroups, spec: ClusterSpec) -> list[tuple[Path, str | None]]:
    """The steps that create the cluster's cgroups, in order: ``(dir, None)`` makes a
    directory, ``(file, value)`` writes a control file."""
    steps: list[tuple[Path, str | None]] = []
    if cg.version == 2:
        top = cg.cpu / f"hpctrain-{spec.name}"
        steps += [(cg.cpu / "cgroup.subtree_control", "+cpu +cpuset"), (top, None),
                  (top / "cgroup.subtree_control", "+cpu +cpuset")]
        for n in spec.nodes:
            d = top / n.hostname
            quota = n.quota_us if n.capped else "max"
            steps += [(d, None), (d / "cpu.max", f"{quota} {PERIOD_US}")]
            if n.cpus:
                steps.append((d / "cpuset.cpus", _cpu_list(n.cpus)))
        return steps
    for top in cg.top(spec.name):
        steps.append((top, None))
        if top.parent == cg.cpuset:
            # a v1 cpuset group starts empty: the parent must have cores and memory first
            steps += [(top / "cpuset.cpus", _read(cg.cpuset / "cpuset.cpus")),
                      (top / "cpuset.mems", _read(cg.cpuset / "cpuset.mems"))]
    for n in spec.nodes:
        d = cg.cpu / f"hpctrain-{spec.name}" / n.hostname
        steps += [(d, None), (d / "cpu.cfs_period_us", str(PERIOD_US)),
                  (d / "cpu.cfs_quota_us", str(n.quota_us if n.capped else -1))]
        if cg.cpuset != cg.cpu:
            d = cg.cpuset / f"hpctrain-{spec.name}" / n.hostname
            cpus = _cpu_list(n.cpus) if n.cpus else _read(cg.cpuset / "cpuset.cpus")
            steps += [(d, None), (d / "cpuset.cpus", cpus),
                      (d / "cpuset.mems", _read(cg.cpuset / "cpuset.mems"))]
        if cg.cpuacct is not None and cg.cpuacct not in (cg.cpu, cg.cpuset):
            steps.append((cg.cpuacct / f"hpctrain-{spec.name}" / n.hostname, None))
    return steps


def _read(path: Path) -> str:
    return path.read_text().strip() if path.exists() else ""


def _cpu_list(cpus: tuple[int, ...]) -> str:
    return ",".join(str(c) for c in cpus)


def create(cg: Cgroups, spec: ClusterSpec) -> None:
    """Apply ``plan`` (root)."""
    for path, value in plan(cg, spec):
        try:
            if value is None:
                path.mkdir(exist_ok=True)
            else:
                path.write_text(value)
        except OSError as err:
            raise ClusterError(f"cgroup step {path} = {value!r} failed: {err}") from None


def procs_files(cg: Cgroups, spec: ClusterSpec, node: NodeSpec) -> list[Path]:
    """The files a process writes its pid into to join the node's cgroups."""
    return [d / "cgroup.procs" for d in cg.node_dirs(spec.name, node)]


def pids(cg: Cgroups, name: str) -> list[int]:
    """Every process in any of the cluster's cgroups."""
    found: set[int] = set()
    for top in cg.top(name):
        for procs in top.glob("*/cgroup.procs"):
            found.update(int(p) for p in procs.read_text().split())
    return sorted(found)


def remove(cg: Cgroups, name: str) -> list[str]:
    """End the processes in the cluster's cgroups, then remove them; what was removed."""
    left = kill_all(pids(cg, name))
    if left:
        raise ClusterError(f"process(es) {left} in the cgroups of cluster {name!r} "
                           f"survived SIGKILL")
    removed = []
    for top in cg.top(name):
        if not top.is_dir():
            continue
        for d in sorted(p for p in top.iterdir() if p.is_dir()):
            d.rmdir()
        top.rmdir()
        removed.append(f"cgroup {top}")
    return removed


def usage_s(cg: Cgroups, spec: ClusterSpec, node: NodeSpec) -> float | None:
    """CPU seconds the node's processes have used (None where nothing counts them)."""
    if cg.version == 2:
        stat = cg.cpu / f"hpctrain-{spec.name}" / node.hostname / "cpu.stat"
        for line in stat.read_text().splitlines():
            key, value = line.split()
            if key == "usage_usec":
                return int(value) / 1e6
        return None
    if cg.cpuacct is None:
        return None
    usage = cg.cpuacct / f"hpctrain-{spec.name}" / node.hostname / "cpuacct.usage"
    return int(usage.read_text()) / 1e9
