"""The MPI suite runs as ``mpiexec -n N python -m mpi4py -m pytest --with-mpi tests/mpi``.

Only rank 0 prints pytest's report: the other ranks run the same tests and their
assertions are collective (``hpctrain.testing``), so rank 0's report names any rank
that failed. The other ranks' reports go to files under the temporary folder.
"""

import os
import tempfile

import pytest
from mpi4py import MPI

from hpctrain import runtime


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


def pytest_unconfigure(config):
    """Every pair of ranks exchanges a byte before mpi4py's MPI_Finalize at exit, as
    hpctrain's commands do: an endpoint never used can hang the finalize under MPICH
    4.0 with UCX over TCP (the suite across emulated nodes; runtime.meet_before_finalize)."""
    if MPI.Is_initialized() and not MPI.Is_finalized():
        runtime.meet_before_finalize(MPI.COMM_WORLD)


@pytest.fixture
def comm():
    return MPI.COMM_WORLD
