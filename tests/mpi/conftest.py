"""The MPI suite runs as ``mpiexec -n N python -m mpi4py -m pytest --with-mpi tests/mpi``.

Only rank 0 prints pytest's report: the other ranks run the same tests and their
assertions are collective (``hpctrain.testing``), so rank 0's report names any rank
that failed. The other ranks' reports go to files under the temporary folder.
"""

import os
import tempfile

import pytest
from mpi4py import MPI


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    rank = MPI.COMM_WORLD.Get_rank()
    if rank == 0:
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        path = os.path.join(tempfile.gettempdir(), f"hpctrain-pytest-rank{rank}.log")
        from _pytest.terminal import TerminalWriter

        reporter._tw = TerminalWriter(open(path, "w"))  # noqa: SIM115 - lives for the session


@pytest.fixture
def comm():
    return MPI.COMM_WORLD
