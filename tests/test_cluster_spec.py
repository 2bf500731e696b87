"""The emulated cluster's pure parts, without root: the spec and its rules, the
launcher, the mpiexec command, the cgroup plan for both cgroup versions, slurm.conf.

The parts that need root (namespaces, links, cgroups, daemons) are tested on a real
emulated cluster in ``tests/cluster``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpctrain.cli import main
from hpctrain.cluster import cpu, launch, lifecycle, slurmd
from hpctrain.cluster import spec as spec_mod
from hpctrain.config import ConfigError
from hpctrain.testing import mpiexec

ROOT = Path(__file__).resolve().parents[1]


def build(**cluster):
    return spec_mod.build(cluster, machine_cores=2)


@pytest.mark.parametrize("text, bps", [
    ("100mbit", 10**8), ("1gbit", 10**9), ("2.5Gbit", 25 * 10**8), ("64kbit", 64_000),
    ("1gbit/s", 10**9), (" 10 mbit ", 10**7)])
def test_rates_are_parsed_and_written_back(text, bps):
    assert spec_mod.parse_rate(text) == bps
    assert spec_mod.parse_rate(spec_mod.format_rate(bps)) == bps


@pytest.mark.parametrize("text", ["0mbit", "0", "fast", "-1gbit", "1 gigabit", "", 100, None])
def test_bad_rates_are_refused_naming_the_value(text):
    with pytest.raises(ConfigError, match=r"link \(.*\) must be a positive rate"):
        spec_mod.parse_rate(text)


def test_nodes_are_numbered_addressed_pinned_and_capped():
    spec = build(name="emu", link="100mbit", nodes=[
        {"count": 2, "cores": 1}, {"count": 1, "cores": 2, "cpu_share": 0.5, "link": "1gbit"}])
    assert [n.hostname for n in spec.nodes] == ["emu0", "emu1", "emu2"]
    assert [n.address for n in spec.nodes] == ["10.213.0.10", "10.213.0.11", "10.213.0.12"]
    assert [n.cpus for n in spec.nodes] == [(0,), (1,), (0, 1)]  # round robin over 2 cores
    assert [n.quota_us for n in spec.nodes] == [10_000, 10_000, 10_000]
    assert [n.cpu_cores for n in spec.nodes] == [1.0, 1.0, 1.0]
    assert [n.link_bps for n in spec.nodes] == [10**8, 10**8, 10**9]
    assert spec.bridge == "emubr" and spec.host_address == "10.213.0.1"
    assert spec.netns(spec.nodes[2]) == "emu-emu2" and spec.switch_port(spec.nodes[2]) == "emuv2"
    assert build(nodes=[{"count": 1, "cpu_share": 0.5}]).nodes[0].quota_us == 5_000
    quota = build(cpu_limit="quota", nodes=[{"count": 2}])
    assert [n.cpus for n in quota.nodes] == [(), ()]


def test_a_spec_round_trips_through_its_saved_form():
    spec = build(name="emu", nodes=[{"count": 1}, {"count": 1, "cpu_share": 0.25,
                                                   "link": "10mbit"}], slurm=True)
    assert spec_mod.build(spec.to_dict(), machine_cores=2) == spec


@pytest.mark.parametrize("cluster, message", [
    ({"nodes": []}, r"nodes \(0\) must be between 1 and 64"),
    ({"nodes": [{"count": 0}]}, r"count \(0\) must be at least 1"),
    ({"nodes": [{"cores": 3}]}, r"cores \(3\) must be between 1 and this machine's cores \(2\)"),
    ({"nodes": [{"cores": 0}]}, r"cores \(0\) must be between 1"),
    ({"nodes": [{"cpu_share": 0}]}, r"cpu_share \(0.0\) must be in \(0, 1\]"),
    ({"nodes": [{"cpu_share": 1.5}]}, r"cpu_share \(1.5\) must be in \(0, 1\]"),
    ({"nodes": [{"cpu_share": "half"}]}, r"cpu_share \('half'\) must be a number"),
    ({"link": "0gbit"}, r"link \('0gbit'\) must be a positive rate"),
    ({"nodes": [{"link": "quick"}]}, r"link \('quick'\) must be a positive rate"),
    ({"name": "Bad-Name"}, r"name \('Bad-Name'\) must be 1 to 8 lowercase"),
    ({"name": "muchtoolong"}, r"name \('muchtoolong'\) must be 1 to 8"),
    ({"subnet": "8.8.8.0/24"}, r"subnet \('8.8.8.0/24'\) must be a private IPv4 network"),
    ({"subnet": "10.1.2.0/29"}, r"has 8 addresses; 2 node\(s\) need 13"),
    ({"subnet": "nonsense"}, r"subnet \('nonsense'\) must be an IPv4 network"),
    ({"subnet": 10}, r"subnet \(10\) must be a string such as '10.213.0.0/24'"),
    ({"subnet": "10.240.3.5/24"}, r"must be an IPv4 network .*: 10.240.3.5/24 has host bits"),
    *[({"subnet": net}, r"must be a private IPv4 network .*\(inside 10.0.0.0/8, "
                        r"172.16.0.0/12, 192.168.0.0/16\)")
      for net in ["0.0.0.0/24", "240.0.0.0/24", "169.254.0.0/24", "198.18.0.0/24",
                  "127.0.0.0/24", "fd00::/64"]],
    ({"nodes": [{"cpu_share": 0.01}]},
     r"cpu_share \(0.01\) must be at least 0.1 for 1 core\(s\): the CPU quota cannot be "
     r"below 1000 us"),
    ({"nodes": [{"cores": 2, "cpu_share": 0.04}]}, r"cpu_share \(0.04\) must be at least 0.05 "),
    ({"nodes": [{"count": 10**9}]}, r"nodes \(1000000000\) must be between 1 and 64"),
    ({"nodes": [{"count": 60}, {"count": 10**12}]}, r"nodes \(1000000000060\) must be "),
    ({"link": "100tbit"}, r"link \('100tbit'\) must be between 1kbit and 10tbit"),
    ({"nodes": [{"link": "1bit"}]}, r"link \('1bit'\) must be between 1kbit and 10tbit"),
    ({"cpu_limit": "nice"}, r"cpu_limit \('nice'\) must be one of cpuset, quota"),
    ({"speed": 1}, r"unknown key\(s\) \['speed'\] in \[cluster\]"),
    ({"nodes": [{"count": 1, "gpus": 1}]}, r"unknown key\(s\) \['gpus'\]"),
    ({"slurm": "yes"}, r"slurm \('yes'\) must be true or false"),
])
def test_bad_input_is_refused_naming_the_value_and_the_rule(cluster, message):
    with pytest.raises(ConfigError, match=message):
        build(**cluster)


def test_the_smallest_share_and_the_rate_range_are_allowed():
    assert build(nodes=[{"cpu_share": 0.1}]).nodes[0].quota_us == 1000
    assert build(nodes=[{"cores": 2, "cpu_share": 0.05}]).nodes[0].quota_us == 1000
    assert spec_mod.parse_rate("1kbit") == 10**3 and spec_mod.parse_rate("10tbit") == 10**13
    with pytest.raises(ConfigError, match=r"link \('999bit'\) must be between 1kbit"):
        spec_mod.parse_rate("999bit")


def test_uniform_clusters_name_their_rules_without_group_numbers():
    with pytest.raises(ConfigError, match=r"^nodes \(0\) must be at least 1$"):
        spec_mod.uniform(0)
    with pytest.raises(ConfigError, match=r"^cores \(\d+\) must be between 1 and this "):
        spec_mod.uniform(2, cores=(os.cpu_count() or 1) + 1)
    with pytest.raises(ConfigError, match=r"^nodes \(100000000\) must be between 1 and 64$"):
        spec_mod.uniform(10**8)  # refused before a node is made, not after 10**8 of them


def test_the_example_cluster_files_are_valid(tmp_path):
    files = sorted((ROOT / "configs").glob("cluster-*.toml"))
    assert files, "configs/cluster-*.toml: the examples the README uses"
    for f in files:
        spec = spec_mod.load(f)
        assert spec.nodes
    bad = tmp_path / "bad.toml"
    bad.write_text("[cluster]\nnodes = [{count = 1, cpu_share = 2.0}]\n")
    with pytest.raises(ConfigError, match=r"bad.toml: \[\[cluster.nodes\]\] 1: cpu_share"):
        spec_mod.load(bad)
    bad.write_text("[model]\n")
    with pytest.raises(ConfigError, match=r"unknown section\(s\) \['model'\]"):
        spec_mod.load(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        spec_mod.load(tmp_path / "missing.toml")


def test_the_launcher_is_valid_shell_and_refuses_unknown_hosts(tmp_path):
    spec = build(name="emu", nodes=[{"count": 2}])
    procs = {n.hostname: [tmp_path / n.hostname / "cgroup.procs"] for n in spec.nodes}
    script = tmp_path / "ssh"
    script.write_text(launch.launcher_script(spec, procs))
    script.chmod(0o755)
    assert subprocess.run(["sh", "-n", str(script)]).returncode == 0
    # hydra's options come first; the host is the first non-option word
    result = subprocess.run([str(script), "-x", "-o", "BatchMode=yes", "emu9", "hostname"],
                            capture_output=True, text=True)
    assert result.returncode == 255 and "emu9 is not a node of cluster emu" in result.stderr
    result = subprocess.run([str(script), "emu0"], capture_output=True, text=True)
    assert result.returncode == 255 and "usage" in result.stderr
    assert "emu1|10.213.0.11)" in script.read_text()


def test_the_mpiexec_command_places_ranks_node_by_node():
    spec = build(name="emu", nodes=[{"count": 3}])
    cmd = launch.mpiexec_command(spec, Path("/run/x/ssh"), "mpiexec", ["python", "t.py"],
                                 ranks_per_node=2, ranks=5, flavour="hydra")
    assert cmd[:7] == ["mpiexec", "-launcher", "ssh", "-launcher-exec", "/run/x/ssh",
                       "-iface", "emubr"]
    assert cmd[cmd.index("-hosts") + 1] == "emu0:2,emu1:2,emu2:2"
    assert cmd[cmd.index("-n") + 1] == "5" and cmd[-2:] == ["python", "t.py"]
    assert "UCX_TLS" in cmd and cmd[cmd.index("UCX_NET_DEVICES") + 1] == "eth0"
    cyclic = launch.mpiexec_command(spec, Path("ssh"), "mpiexec", ["x"], ranks_per_node=2,
                                    placement="cyclic", flavour="hydra")
    assert cyclic[cyclic.index("-hosts") + 1] == "emu0:1,emu1:1,emu2:1"
    assert cyclic[cyclic.index("-n") + 1] == "6"
    with pytest.raises(ConfigError, match=r"placement \('random'\) must be one of block, "):
        launch.mpiexec_command(spec, Path("ssh"), "mpiexec", ["x"], ranks_per_node=2,
                               placement="random")
    with pytest.raises(ConfigError, match=r"ranks \(7\) must be between 1 and ranks per node "
                                          r"\* nodes \(2 \* 3 = 6\)"):
        launch.mpiexec_command(spec, Path("ssh"), "mpiexec", ["x"], ranks_per_node=2, ranks=7)
    with pytest.raises(ConfigError, match=r"node \('emu7'\) is not one of emu0, emu1, emu2"):
        launch.mpiexec_command(spec, Path("ssh"), "mpiexec", ["x"], ranks_per_node=1,
                               nodes=["emu7"])


def test_open_mpis_mpirun_gets_the_launcher_the_subnet_and_tcp_between_nodes():
    spec = build(name="emu", nodes=[{"count": 3}])
    cmd = launch.mpiexec_command(spec, Path("/run/x/ssh"), "mpirun", ["python", "t.py"],
                                 ranks_per_node=2, ranks=5, flavour="openmpi")
    mca = {cmd[i + 1]: cmd[i + 2] for i, a in enumerate(cmd) if a == "--mca"}
    assert mca == {"plm_rsh_agent": "/run/x/ssh", "oob_tcp_if_include": "10.213.0.0/24",
                   "btl_tcp_if_include": "10.213.0.0/24", "pml": "ob1",
                   "btl": "self,vader,tcp", "plm_rsh_no_tree_spawn": "1"}
    assert cmd[cmd.index("--host") + 1] == "emu0:2,emu1:2,emu2:2"
    assert cmd[cmd.index("--map-by") + 1] == "slot" and cmd[cmd.index("-n") + 1] == "5"
    assert cmd[:2] == ["mpirun", "--allow-run-as-root"] and cmd[-2:] == ["python", "t.py"]
    cyclic = launch.mpiexec_command(spec, Path("ssh"), "mpirun", ["x"], ranks_per_node=2,
                                    placement="cyclic", flavour="openmpi")
    assert cyclic[cyclic.index("--map-by") + 1] == "node"
    assert cyclic[cyclic.index("--host") + 1] == "emu0:2,emu1:2,emu2:2"
    with pytest.raises(ConfigError, match=r"flavour \('intel'\) must be one of hydra, openmpi"):
        launch.mpiexec_command(spec, Path("ssh"), "mpirun", ["x"], ranks_per_node=1,
                               flavour="intel")


def test_the_launchers_flavour_comes_from_its_version(tmp_path):
    assert launch.mpiexec_flavour(mpiexec()) == "hydra"  # the pip MPICH beside this Python
    with pytest.raises(ConfigError, match=r"mpiexec \(/bin/true\) must be MPICH's mpiexec "
                                          r"\(hydra\) or Open MPI's mpirun; its --version "
                                          r"says 'true \(GNU coreutils"):
        launch.mpiexec_flavour("/bin/true")
    with pytest.raises(ConfigError, match=r"does not run"):
        launch.mpiexec_flavour(str(tmp_path / "no-such-mpiexec"))


def _fake_cgroup_root(tmp_path: Path, version: int) -> Path:
    root = tmp_path / f"v{version}"
    if version == 2:
        root.mkdir()
        (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
        return root
    for controller in ("cpu", "cpuset", "cpuacct"):
        (root / controller).mkdir(parents=True)
    (root / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (root / "cpuset" / "cpuset.cpus").write_text("0-1\n")
    (root / "cpuset" / "cpuset.mems").write_text("0\n")
    (root / "cpuacct" / "cpuacct.usage").write_text("0\n")
    return root


def test_cgroup_v1_plan_pins_caps_and_counts_each_node(tmp_path):
    root = _fake_cgroup_root(tmp_path, 1)
    cg = cpu.detect(root)
    assert cg.version == 1
    spec = build(name="emu", nodes=[{"count": 1}, {"count": 1, "cpu_share": 0.5}])
    steps = {str(p.relative_to(root)): v for p, v in cpu.plan(cg, spec)}
    assert steps["cpuset/hpctrain-emu/cpuset.cpus"] == "0-1"  # the parent has cores first
    assert steps["cpuset/hpctrain-emu/emu1/cpuset.cpus"] == "1"
    assert steps["cpuset/hpctrain-emu/emu1/cpuset.mems"] == "0"
    # emu0 is pinned to its core and gets all of it: the pinning caps it, no quota
    assert steps["cpu/hpctrain-emu/emu0/cpu.cfs_quota_us"] == "-1"
    assert steps["cpu/hpctrain-emu/emu1/cpu.cfs_quota_us"] == "5000"
    assert steps["cpuacct/hpctrain-emu/emu1"] is None
    quota = build(name="emu", cpu_limit="quota", nodes=[{"count": 1}])
    unpinned = {str(p.relative_to(root)): v for p, v in cpu.plan(cg, quota)}
    assert unpinned["cpu/hpctrain-emu/emu0/cpu.cfs_quota_us"] == "10000"  # nothing pins it
    order = [str(p.relative_to(root)) for p, _ in cpu.plan(cg, spec)]
    assert order.index("cpuset/hpctrain-emu/cpuset.mems") < order.index("cpuset/hpctrain-emu/emu0")
    assert [str(p.relative_to(root)) for p in cpu.procs_files(cg, spec, spec.nodes[1])] == [
        "cpu/hpctrain-emu/emu1/cgroup.procs", "cpuacct/hpctrain-emu/emu1/cgroup.procs",
        "cpuset/hpctrain-emu/emu1/cgroup.procs"]


def test_cgroup_v2_plan_enables_the_controllers_then_caps_each_node(tmp_path):
    root = _fake_cgroup_root(tmp_path, 2)
    cg = cpu.detect(root)
    assert cg.version == 2
    spec = build(name="emu", nodes=[{"count": 1, "cpu_share": 0.5}, {"count": 1, "cores": 2}])
    steps = [(str(p.relative_to(root)), v) for p, v in cpu.plan(cg, spec)]
    assert steps[:3] == [("cgroup.subtree_control", "+cpu +cpuset"), ("hpctrain-emu", None),
                         ("hpctrain-emu/cgroup.subtree_control", "+cpu +cpuset")]
    assert ("hpctrain-emu/emu0/cpu.max", "5000 10000") in steps
    assert ("hpctrain-emu/emu1/cpu.max", "max 10000") in steps  # pinned to both, all of them
    assert ("hpctrain-emu/emu1/cpuset.cpus", "0,1") in steps
    assert cpu.procs_files(cg, spec, spec.nodes[0]) == [root / "hpctrain-emu/emu0/cgroup.procs"]


def test_cgroups_without_cpu_controllers_are_named(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("memory pids\n")
    with pytest.raises(Exception, match="lacks the cpu and cpuset controller"):
        cpu.detect(tmp_path)
    with pytest.raises(Exception, match="no cgroup CPU controller"):
        cpu.detect(tmp_path / "nothing")


def test_slurm_conf_names_every_node_at_its_address(tmp_path):
    spec = build(name="emu", nodes=[{"count": 2, "cores": 1}], slurm=True, slurm_cpus=4)
    conf = slurmd.conf_text(spec, tmp_path, first_job_id=12301)
    assert "NodeName=emu1 NodeAddr=10.213.0.11 NodeHostname=emu1 CPUs=4" in conf
    assert "PartitionName=debug Nodes=emu0,emu1" in conf
    assert f"TaskProlog={tmp_path}/task-prolog" in conf and "FirstJobId=12301" in conf
    assert "(10.213.0.1)" in conf and "SlurmdSpoolDir=" in conf and "-%n" in conf
    assert 'echo "export UCX_TLS=tcp,self"' in slurmd.task_prolog()
    assert 'echo "export UCX_ADDRESS_VERSION=v2"' in slurmd.task_prolog()


def test_cli_refuses_bad_input_before_anything_else():
    runner = CliRunner()
    for args, message in [(["--nodes", "0"], "nodes (0) must be at least 1"),
                          (["--link", "0mbit"], "link ('0mbit') must be a positive rate"),
                          (["--cpu-share", "1.5"], "cpu_share (1.5) must be in (0, 1]")]:
        result = runner.invoke(main, ["cluster", "up", *args])
        assert result.exit_code == 2 and message in result.output, result.output
    result = runner.invoke(main, ["cluster", "up", "--config", "configs/cluster-unequal.toml",
                                  "--nodes", "3", "--link", "10mbit"])
    assert result.exit_code == 2, result.output
    assert "--nodes, --link describe a cluster without a file" in result.output


def test_without_root_the_cluster_commands_say_so():
    # as root (CI), the command runs as the user nobody
    as_user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] \
        if os.geteuid() == 0 else []
    result = subprocess.run([*as_user, sys.executable, "-m", "hpctrain.cli", "cluster", "down",
                             "--name", "nobody"], capture_output=True, text=True, timeout=60,
                            cwd=ROOT)
    assert result.returncode == 1 and "needs root" in result.stderr, result.stderr


NAME_RULE = "must be 1 to 8 lowercase letters or digits"


@pytest.fixture
def state_root(tmp_path, monkeypatch):
    """The cluster state under tmp_path instead of /run/hpctrain."""
    root = tmp_path / "run"
    (root / "cluster-hpcx").mkdir(parents=True)
    monkeypatch.setattr(lifecycle, "STATE_ROOT", root)
    return root


@pytest.mark.parametrize("command", [["down"], ["status"], ["run", "--ranks-per-node", "1"],
                                     ["exec"]])
def test_every_command_applies_the_name_rule_before_using_the_name(command, state_root):
    victim = state_root.parent / "victim"
    (victim / "inside").mkdir(parents=True)
    bad = "hpcx/../../victim"  # state_dir: run/cluster-hpcx/../../victim
    args = ["cluster", command[0], "--name", bad, *command[1:]]
    args += {"run": ["--", "true"], "exec": ["hpcx0", "--", "true"]}.get(command[0], [])
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and NAME_RULE in result.output, result.output
    assert (victim / "inside").is_dir() and not (state_root.parent / "victim.lock").exists()
    with pytest.raises(ConfigError, match=NAME_RULE):
        lifecycle.state_dir(bad)
    with pytest.raises(ConfigError, match=NAME_RULE):
        lifecycle.down(bad)


def test_up_refuses_an_empty_name_instead_of_the_default(monkeypatch):
    made = []
    monkeypatch.setattr(lifecycle, "up", lambda spec, **kw: made.append(spec) or 1 / 0)
    runner = CliRunner()
    for args in [[], ["--config", "configs/cluster-unequal.toml"]]:
        result = runner.invoke(main, ["cluster", "up", "--name", "", *args])
        assert result.exit_code == 2 and f"name ('') {NAME_RULE}" in result.output, \
            result.output
    assert made == []


def test_cli_refuses_rates_tc_refuses_and_shares_below_the_smallest_quota(monkeypatch):
    monkeypatch.setattr(lifecycle, "up", lambda spec, **kw: pytest.fail(f"built {spec}"))
    runner = CliRunner()
    for args, message in [(["--link", "100tbit"], "must be between 1kbit and 10tbit"),
                          (["--link", "1bit"], "must be between 1kbit and 10tbit"),
                          (["--cpu-share", "0.01"], "cpu_share (0.01) must be at least 0.1"),
                          (["--nodes", "100000000"], "nodes (100000000) must be between 1"),
                          (["--subnet", "127.0.0.0/24"], "must be a private IPv4 network")]:
        result = runner.invoke(main, ["cluster", "up", "--name", "hpcxbad", *args])
        assert result.exit_code == 2 and message in result.output, result.output


def test_status_names_what_a_half_built_cluster_left(state_root):
    spec = build(name="hpcxh", subnet="10.241.0.0/24", nodes=[{"count": 1}])
    lifecycle.state_dir("hpcxh").mkdir()
    lifecycle._write_state(lifecycle.state_dir("hpcxh"), spec, "building", None)
    result = CliRunner().invoke(main, ["cluster", "status", "--name", "hpcxh"])
    assert result.exit_code == 1, result.output
    assert "no cluster 'hpcxh' is up" in result.output
    assert "removed by `hpctrain cluster down --name hpcxh`" in result.output
    assert f"state {lifecycle.state_dir('hpcxh')}" in result.output


def test_exec_says_its_command_is_a_program_not_a_shell_line():
    result = CliRunner().invoke(main, ["cluster", "exec", "--help"])
    assert "-- sh -c 'hostname; getent hosts x'" in " ".join(result.output.split())
