"""Run under mpiexec on an emulated cluster: where each rank runs, which ranks MPI puts
on one node, which ``/dev/shm`` it sees (its device), and whether an all-reduce of
``NBYTES`` (argv[1]) gives the right sum.

Rank 0 prints one JSON list, a record per rank, on its last line of output. The job
ends as hpctrain's commands do (``runtime.finalize_on_exit``): a bare mpi4py script
across the emulated nodes hung in ``MPI_Finalize`` in about one job in eight under
Debian's MPICH (DEVELOPERS.md).
"""

import json
import os
import socket
import sys
import time

import numpy as np
from mpi4py import MPI

from hpctrain.runtime import finalize_on_exit


def main() -> None:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    x = np.full(int(sys.argv[1]) // 8, float(rank))
    comm.Barrier()
    t0 = time.perf_counter()
    comm.Allreduce(MPI.IN_PLACE, x)
    seconds = time.perf_counter() - t0
    record = {"rank": rank, "host": socket.gethostname(), "node_size": node.Get_size(),
              "node_rank": node.Get_rank(), "shm": os.stat("/dev/shm").st_dev,
              "sum_ok": bool(np.all(x == size * (size - 1) / 2)),
              "seconds": seconds}
    records = comm.gather(record)
    if rank == 0:
        print(json.dumps(records))


with finalize_on_exit():
    main()
