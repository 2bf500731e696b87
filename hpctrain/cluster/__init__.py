"""A cluster of emulated nodes on one machine: shaped links, unequal CPUs, MPI and SLURM.

Read in this order: ``spec`` (what a cluster is, validated), ``net`` (namespaces,
switch, shaped links), ``cpu`` (cgroups), ``launch`` (starting processes on nodes,
mpiexec), ``slurmd`` (SLURM on the nodes), ``lifecycle`` (up, down, state), ``cli``.
"""
