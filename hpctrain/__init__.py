"""hpctrain: MPI-parallel training of NumPy models on CPUs and supercomputers.

Importing the package has no side effects: MPI is initialised by mpi4py only when a
module that needs a communicator imports ``mpi4py.MPI``.
"""

__version__ = "0.1.0"
