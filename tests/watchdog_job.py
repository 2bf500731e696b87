"""A training job in which one rank stalls or fails, for ``test_watchdog_jobs.py``.

    mpiexec -n N python tests/watchdog_job.py CONFIG RUN_DIR --stall-timeout S \\
        --rank R --at K --sleep SECONDS [--exit STATUS] \\
        --where data|forward|eval|open|close|outputs|kernels|helper|buckets \\
        [--dp D --tp T --pp P --zero Z]

Rank R sleeps SECONDS in its K-th batch read (``data``), in the forward of the first
microbatch of its K-th step (``forward``), in its K-th evaluation, after step K
(``eval``), while it opens the data at the start (``open``), checks its outputs
(``outputs``, rank 0's ``_check_outputs``) or loads the compiled kernels
(``kernels``), or closes the loader after the last step (``close``), and first prints
``sleeping at <time.time()>`` to stderr. With ``--exit STATUS`` it calls
``sys.exit(STATUS)`` there instead (``exiting at <time>``). ``helper``: ZeRO 3's
helper thread raises at its first test of the K-th gather this rank posts
(``failing at <time>``); ``buckets``: the data-parallel reduction's helper thread
raises at its first launch of gradient buckets in step K. Nothing of MPI is replaced:
the stall is a real sleep, the exit a real ``SystemExit``, inside
``hpctrain.train.train``; the job ends through ``runtime.finalize_on_exit``, as the
``hpctrain`` program does.
"""

import argparse
import sys
import threading
import time

from mpi4py import MPI

import hpctrain.train as train_mod
from hpctrain import config
from hpctrain.runtime import abort_on_error, finalize_on_exit


def act_on_call(fn, at: int, act):
    """``fn`` that calls ``act()`` before its ``at``-th call."""
    calls = 0

    def acting(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == at:
            act()
        return fn(*args, **kwargs)

    return acting


def sleeper(seconds: float):
    def slow():
        print(f"sleeping at {time.time()}", file=sys.stderr, flush=True)
        time.sleep(seconds)
    return slow


def exiter(status: int):
    def leave():
        print(f"exiting at {time.time()}", file=sys.stderr, flush=True)
        sys.exit(status)
    return leave


class FailingTest:
    """A real request whose ``Test`` raises: only ZeRO 3's helper thread tests a
    gather (the training thread waits for it), so the error is raised in the helper."""

    def __init__(self, request):
        self.request = request

    def Test(self):  # noqa: N802 - mpi4py's name
        print(f"failing at {time.time()}", file=sys.stderr, flush=True)
        raise RuntimeError("the helper's test of a gather fails on purpose")

    def Wait(self):  # noqa: N802
        return self.request.Wait()


def fail_helper(at: int) -> None:
    """ZeRO 3's helper thread raises on the ``at``-th gather this rank posts."""
    make = train_mod.make_data_parallel

    def made(cfg, engine, topo):
        dp = make(cfg, engine, topo)
        add, calls = dp.progress.add, 0

        def add_failing(request):
            nonlocal calls
            calls += 1
            add(FailingTest(request) if calls == at else request)

        dp.progress.add = add_failing
        return dp

    train_mod.make_data_parallel = made


def fail_buckets(at: int) -> None:
    """The data-parallel reduction's helper thread raises at its first launch of
    buckets in step ``at``; the training thread's hook waits until it has (else the
    wait for the sums could stop the helper first, and launch every bucket itself)."""
    make = train_mod.make_data_parallel

    def made(cfg, engine, topo):
        dp = make(cfg, engine, topo)
        grads, steps, failed = dp.grads, 0, threading.Event()
        zero, launch_ready, mark_ready = grads.zero, grads._launch_ready, grads.mark_ready

        def zeroed():
            nonlocal steps
            steps += 1
            zero()

        def launching():
            if steps == at and threading.current_thread().name == "hpctrain-grad-buckets":
                print(f"failing at {time.time()}", file=sys.stderr, flush=True)
                failed.set()
                raise RuntimeError("the helper's launch of a bucket fails on purpose")
            launch_ready()

        def marked(params):
            mark_ready(params)
            if steps == at:
                failed.wait(10)

        grads.zero, grads._launch_ready, grads.mark_ready = zeroed, launching, marked
        engine.on_grads_ready = marked
        return dp

    train_mod.make_data_parallel = made


def inject(where: str, at: int, act) -> None:
    if where == "data":
        open_loader = train_mod.open_loader

        def opened(*args, **kwargs):
            loader = open_loader(*args, **kwargs)
            if kwargs.get("split") == "train":
                loader.next_batch = act_on_call(loader.next_batch, at, act)
            return loader

        train_mod.open_loader = opened
    elif where == "forward":
        build_engine = train_mod.build_engine

        def built(cfg, topo):
            engine = build_engine(cfg, topo)
            first = (at - 1) * cfg.parallel.microbatches + 1  # its first microbatch
            # inside the F span: the whole model, or a pipeline stage's first chunk
            holder = engine.stage.parts[0] if hasattr(engine, "stage") else engine.model
            holder.forward = act_on_call(holder.forward, first, act)
            return engine

        train_mod.build_engine = built
    elif where == "eval":
        train_mod.evaluate = act_on_call(train_mod.evaluate, at + 1, act)  # 1: step 0
    elif where == "open":
        train_mod._open_data = act_on_call(train_mod._open_data, 1, act)
    elif where == "outputs":
        train_mod._check_outputs = act_on_call(train_mod._check_outputs, 1, act)
    elif where == "kernels":
        train_mod.nn_kernels.load = act_on_call(train_mod.nn_kernels.load, 1, act)
    elif where == "helper":
        fail_helper(at)
    elif where == "buckets":
        fail_buckets(at)
    else:  # "close", after the last step
        open_loader = train_mod.open_loader

        def closing(*args, **kwargs):
            loader = open_loader(*args, **kwargs)
            loader.close = act_on_call(loader.close, 1, act)
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
    parser.add_argument("--exit", type=int, help="sys.exit(EXIT) there instead of sleeping")
    parser.add_argument("--where", choices=("data", "forward", "eval", "open", "close",
                                            "outputs", "kernels", "helper", "buckets"),
                        default="data")
    for axis in ("dp", "tp", "pp", "zero"):
        parser.add_argument(f"--{axis}", type=int)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    overrides = {"train.run_dir": args.run_dir, "train.stall_timeout": args.stall_timeout}
    overrides |= {f"parallel.{axis}": getattr(args, axis) for axis in ("dp", "tp", "pp", "zero")
                  if getattr(args, axis) is not None}
    with abort_on_error(comm):
        cfg = config.load(args.config, overrides).validate(comm.Get_size())
        if comm.Get_rank() == args.rank:
            act = sleeper(args.sleep) if args.exit is None else exiter(args.exit)
            inject(args.where, args.at, act)
        train_mod.train(cfg, comm, quiet=True)


if __name__ == "__main__":
    with finalize_on_exit():
        main()
