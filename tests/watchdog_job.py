"""A training job in which one rank stalls, for ``test_watchdog_jobs.py``.

    mpiexec -n N python tests/watchdog_job.py CONFIG RUN_DIR --stall-timeout S \\
        --rank R --at K --sleep SECONDS --where data|forward|eval|open|close \
        [--dp D --tp T --pp P]

Rank R sleeps SECONDS in its K-th batch read (``data``), in the forward of the first
microbatch of its K-th step (``forward``), in its K-th evaluation, after step K
(``eval``), while it opens the data at the start (``open``) or closes the loader after
the last step (``close``), and first prints ``sleeping at <time.time()>`` to stderr. Nothing of MPI
is replaced: the stall is a real sleep inside ``hpctrain.train.train``.
"""

import argparse
import sys
import time

from mpi4py import MPI

import hpctrain.train as train_mod
from hpctrain import config
from hpctrain.runtime import abort_on_error


def sleep_on_call(fn, at: int, seconds: float):
    """``fn`` that sleeps ``seconds`` before its ``at``-th call."""
    calls = 0

    def slow(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == at:
            print(f"sleeping at {time.time()}", file=sys.stderr, flush=True)
            time.sleep(seconds)
        return fn(*args, **kwargs)

    return slow


def inject(where: str, at: int, seconds: float) -> None:
    if where == "data":
        open_loader = train_mod.open_loader

        def opened(*args, **kwargs):
            loader = open_loader(*args, **kwargs)
            if kwargs.get("split") == "train":
                loader.next_batch = sleep_on_call(loader.next_batch, at, seconds)
            return loader

        train_mod.open_loader = opened
    elif where == "forward":
        build_engine = train_mod.build_engine

        def built(cfg, topo):
            engine = build_engine(cfg, topo)
            first = (at - 1) * cfg.parallel.microbatches + 1  # its first microbatch
            # inside the F span: the whole model, or a pipeline stage's first chunk
            holder = engine.stage.parts[0] if hasattr(engine, "stage") else engine.model
            holder.forward = sleep_on_call(holder.forward, first, seconds)
            return engine

        train_mod.build_engine = built
    elif where == "eval":
        train_mod.evaluate = sleep_on_call(train_mod.evaluate, at + 1, seconds)  # 1: step 0
    elif where == "open":
        train_mod._open_data = sleep_on_call(train_mod._open_data, 1, seconds)
    else:  # "close", after the last step
        open_loader = train_mod.open_loader

        def closing(*args, **kwargs):
            loader = open_loader(*args, **kwargs)
            loader.close = sleep_on_call(loader.close, 1, seconds)
            return loader

        train_mod.open_loader = closing


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("run_dir")
    parser.add_argument("--stall-timeout", type=float, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--at", type=int, required=True)
    parser.add_argument("--sleep", type=float, required=True)
    parser.add_argument("--where", choices=("data", "forward", "eval", "open", "close"),
                        default="data")
    for axis in ("dp", "tp", "pp"):
        parser.add_argument(f"--{axis}", type=int)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    overrides = {"train.run_dir": args.run_dir, "train.stall_timeout": args.stall_timeout}
    overrides |= {f"parallel.{axis}": getattr(args, axis) for axis in ("dp", "tp", "pp")
                  if getattr(args, axis) is not None}
    with abort_on_error(comm):
        cfg = config.load(args.config, overrides).validate(comm.Get_size())
        if comm.Get_rank() == args.rank:
            inject(args.where, args.at, args.sleep)
        train_mod.train(cfg, comm, quiet=True)


if __name__ == "__main__":
    main()
