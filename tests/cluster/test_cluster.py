"""A real emulated cluster: two nodes in network namespaces, shaped links, cgroups.

The module's cluster (``hpctest``: 2 nodes of one core each, 1 Gbit/s) is built once
and removed at the end, pass or fail; its owner is this process, so if the process
is killed the next ``up`` of the name clears it (and ``make test`` runs
``hpctrain cluster down`` after the suite). Each test that needs a cluster of
another shape builds its own, under another name.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpctrain.cluster import lifecycle, net
from hpctrain.cluster import spec as spec_mod
from hpctrain.metrics import read_metrics
from hpctrain.testing import mpiexec, run_train, tiny_corpus_config

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the emulated cluster needs root (network namespaces, cgroups): "
                              "run `sudo make test-cluster`")

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("probe.py")
HPCTRAIN = [sys.executable, "-m", "hpctrain.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}

TINY_GPT = """
[model]
seq_len = 16
n_layer = 2
n_head = 4
d_model = 32
dtype = "float64"
[train]
steps = 8
batch_size = 8
lr = 3e-3
warmup_steps = 2
eval_interval = 0
log_interval = 1
seed = 7
[data]
path = "{data}"
"""


@pytest.fixture(scope="module")
def cluster():
    spec = spec_mod.uniform(2, cores=1, link="1gbit", name="hpctest")
    with lifecycle.running(spec) as cl:
        yield cl


def run_on(cl, argv: list[str], *, ranks_per_node: int, ranks: int | None = None,
           placement: str = "block", timeout: float = 300,
           env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = cl.mpiexec_command(argv, ranks_per_node=ranks_per_node, ranks=ranks,
                             mpiexec=mpiexec(), placement=placement)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=env or ENV, cwd=ROOT)


def probe(cl, nbytes: int, **placement) -> list[dict]:
    result = run_on(cl, [sys.executable, str(PROBE), str(nbytes)], **placement, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def link_bytes(cl) -> list[int]:
    """Bytes each node has sent through its link so far."""
    return [net.link_bytes(cl.spec, n)[0] for n in cl.spec.nodes]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*HPCTRAIN, "cluster", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_ranks_fill_the_nodes_in_order_and_mpi_sees_each_node(cluster):
    records = probe(cluster, 8, ranks_per_node=2)
    assert [r["host"] for r in records] == ["hpctest0", "hpctest0", "hpctest1", "hpctest1"]
    assert [r["node_size"] for r in records] == [2, 2, 2, 2]
    assert [r["node_rank"] for r in records] == [0, 1, 0, 1]
    assert all(r["sum_ok"] for r in records)
    # each node has its own /dev/shm, which its ranks share, apart from this machine's
    shm = [r["shm"] for r in records]
    assert shm[0] == shm[1] != shm[2] == shm[3] and os.stat("/dev/shm").st_dev not in shm
    records = probe(cluster, 8, ranks_per_node=2, placement="cyclic")
    assert [r["host"] for r in records] == ["hpctest0", "hpctest1", "hpctest0", "hpctest1"]
    assert [r["node_size"] for r in records] == [2, 2, 2, 2]


def test_jobs_across_the_nodes_end_without_waiting_in_mpi_finalize(cluster):
    """Jobs that end through ``runtime.finalize_on_exit``, as hpctrain's commands do:
    none may need its bound on ``MPI_Finalize``. Under Debian's MPICH 4.0 (UCX over
    TCP between the nodes) 11 of 40 such jobs hung there until the bound before every
    pair of ranks was connected first (DEVELOPERS.md); 8 jobs here."""
    env = {**ENV, "HPCTRAIN_FINALIZE_TIMEOUT_S": "10"}
    for i in range(8):
        placement = ("block", "cyclic")[i % 2]
        result = run_on(cluster, [sys.executable, str(PROBE), "8"], ranks_per_node=2,
                        placement=placement, timeout=60, env=env)
        assert result.returncode == 0, (i, placement, result.stderr)
        assert "MPI_Finalize has not returned" not in result.stderr, (i, placement,
                                                                      result.stderr)


def test_traffic_between_nodes_crosses_the_link_and_inside_a_node_does_not(cluster):
    nbytes = 8 << 20
    before = link_bytes(cluster)
    records = probe(cluster, nbytes, ranks_per_node=1)  # one rank on each node
    between = [a - b for a, b in zip(link_bytes(cluster), before, strict=True)]
    assert all(r["sum_ok"] for r in records)
    # an all-reduce of two ranks sends the whole vector each way (and MPI_Init's chatter)
    assert all(nbytes <= sent <= 3 * nbytes for sent in between), between
    before = link_bytes(cluster)
    records = probe(cluster, nbytes, ranks_per_node=2, ranks=2)  # both ranks on node 0
    inside = [a - b for a, b in zip(link_bytes(cluster), before, strict=True)]
    assert [r["host"] for r in records] == ["hpctest0", "hpctest0"]
    assert all(r["sum_ok"] for r in records)
    assert all(sent < nbytes // 16 for sent in inside), inside  # control messages only


LAYOUTS = ["dp2-tp2-pp1-1f1b-zero0", "dp2-tp2-pp1-1f1b-zero2", "dp2-tp1-pp2-1f1b-zero1",
           "dp1-tp2-pp2-interleaved-zero0", "dp4-tp1-pp1-1f1b-zero0"]


def test_layouts_across_nodes_reproduce_the_serial_loss_curve(cluster):
    """The MPI equivalence suite's layouts on 2 nodes x 2 ranks: each tensor group inside
    a node, the pipeline stages of dp2-pp2 and tp2-pp2 on different nodes; and the
    node-aware suite, whose "mpi" placement now sees two real nodes."""
    tests = [f"tests/mpi/test_equivalence.py::test_every_layout_reproduces_the_serial_loss_"
             f"curve[{layout}]" for layout in LAYOUTS] + ["tests/mpi/test_hierarchy_mpi.py"]
    result = run_on(cluster, [sys.executable, "-m", "mpi4py", "-m", "pytest", "--with-mpi",
                              *tests, "-q", "-p", "no:cacheprovider", "--timeout=300",
                              "--color=no"],  # Open MPI's ranks print to a terminal
                    ranks_per_node=2, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    passed = re.search(r"^(\d+) passed in", result.stdout, re.M)
    assert passed and int(passed.group(1)) >= len(LAYOUTS) + 18, result.stdout[-2000:]
    assert "failed" not in result.stdout and "skipped" not in result.stdout


def test_hpctrain_train_across_nodes_equals_one_node(cluster, tmp_path):
    cfg = tiny_corpus_config(tmp_path, TINY_GPT, "to be, or not to be, that is the question",
                             400)
    one_node = run_train(4, cfg, tmp_path / "one", "--tp", "2")
    assert one_node.returncode == 0, one_node.stderr
    across = run_on(cluster, [*HPCTRAIN, "train", "--config", str(cfg), "--run-dir",
                              str(tmp_path / "two"), "--tp", "2"], ranks_per_node=2)
    assert across.returncode == 0, across.stderr
    assert "spans nodes" not in across.stdout
    want = [r["loss"] for r in read_metrics(tmp_path / "one" / "metrics.jsonl")]
    got = [r["loss"] for r in read_metrics(tmp_path / "two" / "metrics.jsonl")]
    assert len(got) == len(want) == 8
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True)) <= 1e-8
    # data parallelism across the nodes, gradients summed hierarchically
    hier = run_on(cluster, [*HPCTRAIN, "train", "--config", str(cfg), "--run-dir",
                            str(tmp_path / "hier"), "--dp-reduce", "hierarchical"],
                  ranks_per_node=2)
    assert hier.returncode == 0, hier.stderr
    flat = run_train(4, cfg, tmp_path / "flat")
    assert flat.returncode == 0, flat.stderr
    want = [r["loss"] for r in read_metrics(tmp_path / "flat" / "metrics.jsonl")]
    got = [r["loss"] for r in read_metrics(tmp_path / "hier" / "metrics.jsonl")]
    assert len(got) == len(want) == 8
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True)) <= 1e-8
    # a tensor group across the two nodes trains, but says its all-reduces cross the network
    spans = run_on(cluster, [*HPCTRAIN, "train", "--config", str(cfg), "--run-dir",
                             str(tmp_path / "spans"), "--tp", "4", "--steps", "1"],
                   ranks_per_node=2)
    assert spans.returncode == 0, spans.stderr
    assert "warning: a tensor-parallel group (tp = 4) spans nodes" in spans.stdout


def test_a_node_at_half_share_gets_half_a_core():
    """The CPU cap holds: a spinning process on the half node uses <= 0.5 core, on the
    full node about 1 (cgroup accounting of the node's own processes)."""
    spec = spec_mod.build({"name": "hpctcpu", "subnet": "10.214.0.0/24",
                           "nodes": [{"count": 1, "cpu_share": 1.0},
                                     {"count": 1, "cpu_share": 0.5}]})
    spin = [sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 2: pass"]
    with lifecycle.running(spec) as cl:
        cores = []
        for n in spec.nodes:
            start = lifecycle.node_status(cl)[n.index]["cpu_s"]
            t0 = time.monotonic()
            subprocess.run(cl.node_command(n.hostname, spin), check=True, timeout=60)
            used = lifecycle.node_status(cl)[n.index]["cpu_s"] - start
            cores.append(used / (time.monotonic() - t0))
    print(f"cores used: full node {cores[0]:.2f}, half node {cores[1]:.2f}")
    assert cores[1] <= 0.55, cores
    # the full node was not capped: clearly more than the half node (a fixed 0.7 failed
    # with other jobs on the machine's cores: 0.65 beside 0.49; on a machine whose cores
    # are all taken, 0.57 beside 0.49, no cap can be seen and this fails as well)
    assert cores[0] >= 1.25 * cores[1], cores


def test_up_refuses_a_cluster_that_is_up_and_down_twice_is_harmless(cluster):
    result = cli("up", "--name", "hpctest")
    assert result.returncode == 1 and "cluster 'hpctest' is already up" in result.stderr
    assert "nothing of cluster 'hpctnone' to remove" in cli("down", "--name", "hpctnone").stdout
    status = cli("status", "--name", "hpctest")
    assert status.returncode == 0 and "hpctest1" in status.stdout, status.stderr


def test_a_second_up_after_a_killed_run_works():
    name = "hpctkill"
    owner = subprocess.Popen(["sleep", "60"])
    try:
        # a run killed while building its cluster: the cluster is half made or whole
        up = subprocess.Popen([*HPCTRAIN, "cluster", "up", "--name", name, "--nodes", "6",
                               "--subnet", "10.215.0.0/24",
                               "--owner", str(owner.pid)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
        state = lifecycle.state_dir(name) / "state.json"
        deadline = time.monotonic() + 60
        while not state.exists() and time.monotonic() < deadline and up.poll() is None:
            time.sleep(0.002)
        up.send_signal(signal.SIGKILL)
        up.wait()
        owner.kill()  # the run that owned it has ended
        owner.wait()
        assert lifecycle.leftovers(name), "the killed up left nothing: it was killed too early"
        again = cli("up", "--name", name, "--nodes", "2", "--subnet", "10.215.0.0/24")
        assert again.returncode == 0, again.stderr
        assert f"removing what is left of an earlier cluster '{name}'" in again.stdout
        assert net.existing_netns(name) == [f"{name}-{name}0", f"{name}-{name}1"]
    finally:
        owner.kill()
        gone = cli("down", "--name", name)
    assert gone.returncode == 0 and not lifecycle.leftovers(name), gone.stderr


@pytest.mark.parametrize("args, message", [
    (["--nodes", "0"], "nodes (0) must be at least 1"),
    (["--cores", str((os.cpu_count() or 1) + 1)], "must be between 1 and this machine's cores"),
    (["--link", "0mbit"], "link ('0mbit') must be a positive rate"),
    (["--link", "1 gigabit"], "link ('1 gigabit') must be a positive rate"),
    (["--cpu-share", "0"], "cpu_share (0.0) must be in (0, 1]"),
    (["--cpu-share", "1.01"], "cpu_share (1.01) must be in (0, 1]"),
])
def test_bad_input_is_refused_before_anything_is_made(args, message):
    result = cli("up", "--name", "hpctbad", *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert lifecycle.leftovers("hpctbad") == []
    assert "hpctbad" not in Path("/etc/hosts").read_text()


def test_up_refuses_host_names_another_cluster_holds():
    """Cluster hpcthn's node 10 and cluster hpcthn1's node 0 are both 'hpcthn10': both
    went into /etc/hosts, and the name found the other cluster's node."""
    first = spec_mod.uniform(11, cores=1, link="1gbit", name="hpcthn", subnet="10.218.1.0/24")
    with lifecycle.running(first):
        result = cli("up", "--name", "hpcthn1", "--nodes", "1", "--subnet", "10.218.2.0/24")
        assert result.returncode == 1, result.stdout + result.stderr
        assert "host name(s) of cluster 'hpcthn1' are already in /etc/hosts: hpcthn10 " \
            "(10.218.1.20, cluster 'hpcthn')" in result.stderr, result.stderr
        assert not lifecycle.leftovers("hpcthn1")


def test_up_leaves_an_interface_it_did_not_make():
    """A bridge of the cluster's name that no `up` made (no state folder): `up` removed
    it as 'what is left of an earlier cluster'; now it refuses and names it."""
    subprocess.run(["ip", "link", "add", "hpctubr", "type", "bridge"], check=True)
    try:
        result = cli("up", "--name", "hpctu", "--nodes", "1", "--subnet", "10.218.3.0/24")
        assert result.returncode == 1, result.stdout + result.stderr
        assert "link hpctubr exist(s) but cluster 'hpctu' has no state" in result.stderr
        assert subprocess.run(["ip", "link", "show", "hpctubr"],
                              capture_output=True).returncode == 0  # still there
    finally:
        subprocess.run(["ip", "link", "del", "hpctubr"], capture_output=True)
    assert not lifecycle.state_dir("hpctu").exists()


def test_status_names_a_node_whose_link_is_gone():
    """`status` of a cluster whose node link was deleted: a traceback before."""
    spec = spec_mod.uniform(2, cores=1, link="1gbit", name="hpctst", subnet="10.218.4.0/24")
    with lifecycle.running(spec):
        subprocess.run(["ip", "link", "del", spec.switch_port(spec.nodes[0])], check=True)
        result = cli("status", "--name", "hpctst")
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        out = result.stdout + result.stderr
        assert "broken: link hpctstv0 missing" in out, out
        assert "`hpctrain cluster down --name hpctst`, then `hpctrain cluster up`" in out, out


def test_one_up_at_a_time_on_this_machine(monkeypatch):
    """Two `up`s of different names both found one subnet free and both built on it:
    an `up` now holds /run/hpctrain/up.lock from its checks to the end of its build."""
    import fcntl

    monkeypatch.setattr(lifecycle, "UP_LOCK_WAIT_S", 0.5)
    spec = spec_mod.uniform(1, cores=1, link="1gbit", name="hpctlk", subnet="10.218.5.0/24")
    lifecycle.STATE_ROOT.mkdir(parents=True, exist_ok=True)
    with open(lifecycle.STATE_ROOT / "up.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # another `up` is checking or building
        with pytest.raises(lifecycle.ClusterError, match="another `hpctrain cluster up` on "
                                                         "this machine"):
            lifecycle.up(spec, log=lambda *a: None)
    assert not lifecycle.leftovers("hpctlk")
