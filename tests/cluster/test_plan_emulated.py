"""``hpctrain calibrate --emulated``: a real emulated cluster measured over its shaped
links, removed afterwards (root; about 30 s)."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from hpctrain.cluster import lifecycle
from hpctrain.plan import cluster as cl
from hpctrain.plan import emulated
from hpctrain.plan.calibrate import calibrate_command

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the emulated cluster needs root (network namespaces, cgroups): "
                              "run `sudo make test-cluster`")

NAME, SUBNET = "hpctpcal", "10.225.0.0/24"  # this test's own cluster and switch


@pytest.mark.timeout(300)
def test_calibrating_two_emulated_nodes_measures_the_shaped_link(tmp_path, monkeypatch):
    monkeypatch.setattr(emulated, "NAME", NAME)
    monkeypatch.setattr(emulated, "SUBNET", SUBNET)
    out = tmp_path / "emulated.toml"
    try:
        result = CliRunner().invoke(calibrate_command, [
            "--out", str(out), "--emulated", "2:100mbit", "--quick", "--timeout", "200"])
    finally:
        left = lifecycle.leftovers(NAME)
        lifecycle.down(NAME)
    assert not left, f"the calibration's cluster leaked: {left}"
    assert result.exit_code == 0, result.output + str(result.exception)
    assert "switch port counted" in result.output
    assert "(comm_slowdown)" in result.output  # measured, overlap.py
    c = cl.load_cluster(out)
    kind = c.kinds["node"]
    assert (kind.cores, c.num_nodes, sorted(kind.gemm), sorted(kind.stream)) == (1, 2, [1], [1])
    # a 1 MiB all-reduce over 2 nodes sends 1 MiB each way: at 100 Mbit/s (12.5 MB/s) no
    # less than 84 ms; through shared memory (UCX past the link) it took about 0.2 ms
    nbytes = 1 << 20
    floor = nbytes / 12.5e6
    fitted = c.collective_time("all_reduce", 2, nbytes, inter=True)
    assert 0.95 * floor < fitted < 3 * floor, (fitted, floor)
