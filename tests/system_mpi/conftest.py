"""The system-MPI leg (``make test-system-mpi MPI=mpich|openmpi``), in a venv whose mpi4py
and h5py were built against Debian's MPICH or Open MPI and its parallel HDF5.

``tests/system_mpi`` holds what runs as one process (the doctor, a rank killed during an
mpio save: those start ``mpiexec`` themselves); ``tests/system_mpi/mpi`` what runs under
``mpiexec -n N python -m mpi4py -m pytest --with-mpi``, beside ``tests/mpi``. These tests
fail, never skip, when h5py has no MPI: this leg exists to run the mpio paths. Only rank 0
prints pytest's report (as in ``tests/mpi``); the others write theirs to
``$TMPDIR/hpctrain-pytest-rankN.log``.
"""

import os
import tempfile

import pytest


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    if rank == 0:
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        path = os.path.join(tempfile.gettempdir(), f"hpctrain-pytest-rank{rank}.log")
        from _pytest.terminal import TerminalWriter

        reporter._tw = TerminalWriter(open(path, "w"))  # noqa: SIM115 - lives for the session
