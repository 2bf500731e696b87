"""``hpctrain check`` under the system MPI, as the README tells a cluster user to run it
after building mpi4py and h5py against the site's MPI: a 4-rank layout (tp 2, ZeRO 1,
dp 2) started by this MPI's own ``mpiexec`` trains as one rank does, in float64."""

import sys

from hpctrain.testing import run_mpi, tiny_corpus_config, tiny_gpt_template

CONFIG = tiny_gpt_template(train="batch_size = 8")


def test_a_layout_under_this_mpi_equals_one_rank(tmp_path):
    config = tiny_corpus_config(tmp_path, CONFIG, "to be, or not to be, that is the question.",
                                400)
    result = run_mpi(4, [sys.executable, "-m", "hpctrain.cli", "check", "--config",
                         str(config), "--steps", "3", "--tp", "2", "--zero", "1"],
                     timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "at dp=2 tp=2 pp=1 zero=1 (4 ranks)" in lines[0], lines[0]
    assert lines[-1].startswith("equal to one rank: largest relative difference ")
    assert float(lines[-1].split()[7]) <= 1e-12
