"""A job for ``test_finalize.py``: every rank ends through ``runtime.finalize_on_exit``
with ``sys.exit(STATUS)``, but the rank named by ``--late`` reaches ``MPI_Finalize``
only ``--sleep`` seconds after the others (it meets them in their last collectives,
then sleeps). MPI_Finalize waits for every rank, so the others' finalize cannot return in
time: a real finalize that does not return, nothing of MPI replaced. The rank named by
``--stuck`` sleeps ``--sleep`` seconds inside the command instead: it never comes to
the end (stuck after the stall watchdog stopped).

    mpiexec -n 2 python tests/finalize_job.py --timeout 2 --late 1 --sleep 60 --status 7
"""

import argparse
import sys
import time

from mpi4py import MPI

from hpctrain import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--timeout", type=float, required=True)
parser.add_argument("--late", type=int, default=-1, help="this rank finalizes late")
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--status", type=int, default=0)
parser.add_argument("--stuck", type=int, default=-1,
                    help="this rank sleeps inside the command (the others exit)")
parser.add_argument("--crash", type=int, default=-1,
                    help="this rank raises instead of exiting (the others exit)")
args = parser.parse_args()
comm = MPI.COMM_WORLD
# together from here, as a command's ranks are after its first collective: the
# arrival's bound (--timeout) must not count one process starting later than another
comm.Barrier()
if comm.Get_rank() == args.late:
    runtime.meet_before_finalize(comm)  # with the others, as finalize_on_exit does
    print(f"rank {args.late} late by {args.sleep:g} s", file=sys.stderr, flush=True)
    time.sleep(args.sleep)
    MPI.Finalize()
    sys.exit(args.status)
with runtime.finalize_on_exit(timeout=args.timeout):
    if comm.Get_rank() == args.crash:
        raise RuntimeError("an error outside abort_on_error")
    if comm.Get_rank() == args.stuck:
        print(f"rank {args.stuck} stuck for {args.sleep:g} s", file=sys.stderr, flush=True)
        time.sleep(args.sleep)
    sys.exit(args.status)
