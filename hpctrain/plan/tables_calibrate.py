"""The table planner's rates measured on this machine, and ``hpctrain plan-tables``.

``measure_rates(comm, model, batch, ...)`` runs on every rank of ``comm`` at once (so
the ranks share the cores and the memory bus as in training) and returns the ``Rates``
of ``plan/tables.py``:

    a2a, gather   one Alltoallv (Allgatherv) of 8 B to 128 KiB per rank pair, median of
                  repeats; a least-squares line of seconds over the bytes a rank
                  receives: its bytes_per_s (its latency_s: see below)
    route_s       the requester's split of n ids for one shard, per id
                  (this and the kernels below: ``_shared_time``, every rank running
                  the kernel at once, call after call, for 50 ms, as a step's phase
                  runs; with more ranks than cores they share them)
    pool          ``parallel.tables._pool_sum`` of n random rows of a table in the
                  last-level cache (256 KiB) and far beyond it (the largest table to
                  be planned, 128 MiB to 1 GiB), at dims 16 and 64: a line over the
                  row's bytes (row_s, byte_s)
    grad          ``SparseGrad.add`` of n rows (a batch's, always cached)
    update        the sparse optimizer's update of n distinct rows, both optimizers,
                  cached and uncached tables
    dense         a whole training step of the model at ``batch`` samples per rank with
                  every table cut to 8 rows per rank and replicated (the MLPs,
                  interaction, bias tables, dense all-reduce and optimizer), forward,
                  backward, sync and update apart, less the model's own prediction for
                  those small tables
    latencies     the gather's and the all-to-all's latency_s, the dense all-reduce
                  and shard_s (a sharded table's own work) from inside whole steps:
                  the replicated step, and the same step with every table row-wise
                  (``measure_rates``, ``probe_step``)

``hpctrain calibrate-tables`` launches that job at each ``--ranks`` and writes a TOML
file of ``[ranks.N]`` sections; ``hpctrain plan-tables`` reads it and plans.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
import numpy as np

from hpctrain.clitypes import FiniteRange
from hpctrain.config import ConfigError, TableConfig, read_toml
from hpctrain.plan import tables as tp

RESULT_TAG = "TABLE_RATES "
MESSAGES = (8, 1024, 16384, 131072)  # bytes per rank pair
N_IDS = 8192
CACHED_BYTES = 256 * 1024
UNCACHED_BYTES = 128 * 2**20  # the uncached rates' table: at least this, the largest
MAX_UNCACHED_BYTES = 1 << 30  # table to be planned if larger, at most this


def _median_time(comm, fn, repeats: int) -> float:
    """The median over repeats of the slowest rank's seconds for ``fn()``."""
    times = []
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return comm.allreduce(statistics.median(times), op=_max())


def _shared_time(comm, make, min_s: float = 0.05) -> float:
    """Seconds per call when every rank runs the kernel at once, call after call, for
    at least ``min_s``, as a training step runs a phase on every rank at once: ranks
    that share a core then share its time. (A median of single calls would not see
    that: a call shorter than the scheduler's slice mostly runs alone.) ``make(i)``
    gives the i-th call, with inputs of its own (rows drawn afresh stay uncached); the
    slowest rank's mean over the calls."""
    first = make(0)
    first()  # warm: pages, code
    t0 = time.perf_counter()
    first()
    one = max(time.perf_counter() - t0, 1e-7)
    k = comm.allreduce(max(3, math.ceil(min_s / one)), op=_max())
    calls = [make(i) for i in range(1, k + 1)]
    comm.Barrier()
    t0 = time.perf_counter()
    for fn in calls:
        fn()
    return comm.allreduce((time.perf_counter() - t0) / k, op=_max())


def _max():
    from mpi4py import MPI

    return MPI.MAX


def _line(xs: list[float], ts: list[float]) -> tp.Line:
    slope, icept = np.polyfit(np.array(xs, float), np.array(ts, float), 1)
    return tp.Line(max(float(icept), 1e-7), 1.0 / max(float(slope), 1e-13))


def collective_lines(comm, repeats: int = 15) -> tuple[tp.Line, tp.Line]:
    """(a2a, gather) lines over the bytes a rank receives (collective)."""
    from hpctrain.parallel.tables import alltoallv

    G = comm.Get_size()
    if G == 1:
        return tp.Line(0.0, 1e30), tp.Line(0.0, 1e30)
    xs, a2a, gat = [], [], []
    for m in MESSAGES:
        parts = [np.ones(m // 4, np.float32) for _ in range(G)]
        counts = [m // 4] * G
        a2a.append(_median_time(comm, lambda p=parts, c=counts: alltoallv(
            comm, p, np.float32, c), repeats))
        mine = np.ones(m // 4, np.float32)
        out = np.empty(G * (m // 4), np.float32)
        gat.append(_median_time(comm, lambda a=mine, o=out, c=counts: comm.Allgatherv(
            a, [o, c]), repeats))
        xs.append(G * m)
    return _line(xs, a2a), _line(xs, gat)


def _rows_rate(per_row: dict[int, float], itemsize: int) -> tp.RowRate:
    """A line through (dim 16, dim 64) seconds per row."""
    (d0, t0), (d1, t1) = sorted(per_row.items())
    byte_s = max((t1 - t0) / ((d1 - d0) * itemsize), 0.0)
    return tp.RowRate(max(t0 - d0 * itemsize * byte_s, 0.0), byte_s)


def kernel_rates(comm, itemsize: int = 4,
                 uncached_bytes: int = UNCACHED_BYTES) -> dict[str, Any]:
    """route_s, pool, grad and update rates (every rank at once, ``_shared_time``:
    with more ranks than cores each kernel runs at its share of one); the uncached ones
    on a table of ``uncached_bytes`` (random rows of a larger table miss the TLB as
    well as the cache: measure at the size of the tables to be planned)."""
    from hpctrain.nn.module import SparseGrad, SparseParameter
    from hpctrain.optim.sparse import RowWiseAdaGrad, SparseAdam
    from hpctrain.parallel.tables import _pool_sum

    dtype = np.float32 if itemsize == 4 else np.float64
    rng = np.random.default_rng(comm.Get_rank())
    b = N_IDS
    ids = rng.integers(0, 1 << 20, (b, 1))
    route = _shared_time(comm, lambda _: lambda: np.concatenate(
        [[b], ((ids >= 0) & (ids < 1 << 19)).sum(axis=1), ids[(ids >= 0) & (ids < 1 << 19)]])
    ) / b
    pool: dict[str, dict[int, float]] = {"cached": {}, "uncached": {}}
    update: dict[str, dict[int, float]] = {}
    grad: dict[int, float] = {}
    lens = np.ones(b, np.int64)
    for dim in (16, 64):
        g = rng.standard_normal((b, dim)).astype(dtype)
        rows_of = rng.integers(0, 4096, b)
        grad[dim] = _shared_time(comm, lambda _, d=dim, r=rows_of, v=g: lambda: SparseGrad(
            (4096, d), dtype).add(r, v)) / b
        for reg, nbytes in (("cached", CACHED_BYTES), ("uncached", uncached_bytes)):
            rows = nbytes // (dim * itemsize)
            W = np.full((rows, dim), 0.5, dtype)  # written: every page present

            def pooled(_, w=W, n=rows):
                local = rng.integers(0, n, b)
                return lambda: _pool_sum(w, local, lens, b)

            pool[reg][dim] = _shared_time(comm, pooled) / b
            for name, cls in (("rowwise_adagrad", RowWiseAdaGrad), ("adam", SparseAdam)):
                opt = cls([("t", SparseParameter(W))], lr=1e-3)
                opt.t = 1  # its state written at construction: every page present
                n_rows = []

                def updated(_, o=opt, w=W, n=rows, seen=n_rows, g=g):
                    uniq = np.unique(rng.integers(0, n, b))
                    seen.append(len(uniq))
                    gu = g[:len(uniq)]
                    return lambda: o._update(0, w, uniq, gu, 1e-3)

                t = _shared_time(comm, updated)
                update.setdefault(f"{name}/{reg}", {})[dim] = t / statistics.fmean(n_rows)
                del opt
            del W
    return {"route_s": route,
            "pool": {k: _rows_rate(v, itemsize) for k, v in pool.items()},
            "grad": {"cached": _rows_rate(grad, itemsize)},
            "update": {k: _rows_rate(v, itemsize) for k, v in update.items()}}


def probe_step(comm, model: Any, batch: int, *, optimizer: str, bag_fill: float,
               sharding: str = "replicated", steps: int = 12, warm: int = 3
               ) -> dict[str, float]:
    """A whole training step of ``model`` with every table cut to 8 rows per rank
    (``G * 8``) and placed ``sharding`` (``replicated`` or ``row``), ``batch`` samples
    per rank, timed as training runs it: a barrier before each step, then the step's
    own collectives only (collective). Returns the medians over ``steps`` of each
    term's seconds (``plan.tables.TERMS``) on the rank whose median step is the
    longest, and the mean over ranks of the medians of the collectives' seconds and
    bytes inside a step: ``gather_s`` (the replicated tables' gradient gather),
    ``a2a_s`` and ``a2a_bytes`` (the sharded tables' exchanges, the larger of sent and
    received)."""
    from hpctrain.config import Config, ParallelConfig, TrainConfig
    from hpctrain.parallel.engine import build_engine
    from hpctrain.parallel.topology import Topology
    from hpctrain.train import make_data_parallel

    G = comm.Get_size()
    small = replace(model, tables=tuple(  # row-wise: every table split over every rank
        replace(t, rows=8 * G if sharding == "row" else min(t.rows, 8 * G))
        for t in model.tables))
    cfg = Config(model=small, parallel=ParallelConfig(table_default=sharding),
                 train=TrainConfig(batch_size=batch * G, lr=1e-3, sparse_lr=0.02,
                                   grad_clip=1.0, sparse_optimizer=optimizer)).validate(G)
    topo = Topology.build(comm, cfg.parallel)
    engine = build_engine(cfg, topo)
    dp = make_data_parallel(cfg, engine, topo)
    stats = getattr(dp, "stats", None)
    rng = np.random.default_rng(comm.Get_rank())
    times, inner = [], []
    for i in range(warm + steps):
        x, y = synthetic_batch(small, batch, bag_fill, rng)
        comm.Barrier()  # each step starts together, as the ranks of a step do
        dp.zero_grad()
        t = [time.perf_counter()]
        loss, cache = engine.model.forward(x, y)
        t.append(time.perf_counter())
        engine.model.backward(cache, dloss=1.0 / G)
        t.append(time.perf_counter())
        dp.finish_grads()
        t.append(time.perf_counter())
        dp.clip(cfg.train.grad_clip, dp.grad_norm())
        dp.step(1e-3)
        t.append(time.perf_counter())
        a2a = stats.take() if stats is not None else {}
        if i >= warm:
            times.append(np.diff(t))
            inner.append([getattr(dp, "table_sync_s", 0.0), a2a.get("a2a_s", 0.0),
                          max(a2a.get("a2a_sent_bytes", 0), a2a.get("a2a_recv_bytes", 0))])
    topo.free()
    med = np.median(np.array(times), axis=0)
    every = np.empty((G, len(med)))
    comm.Allgather(med, every)
    worst = every[int(np.argmax(every.sum(axis=1)))]  # the slowest rank's terms: a
    # faster rank's wait at the collectives is the slowest one's work, counted once
    mine = np.median(np.array(inner, float), axis=0)
    mean = np.empty_like(mine)
    comm.Allreduce(mine, mean)
    mean /= G
    return {**dict(zip(tp.TERMS, worst.tolist(), strict=True)),
            "gather_s": float(mean[0]), "a2a_s": float(mean[1]), "a2a_bytes": float(mean[2])}


def synthetic_batch(model: Any, batch: int, bag_fill: float, rng) -> tuple[Any, Any]:
    """x (structured: dense, ids) and y for ``model``: ids uniform over each table's
    rows, a bag's slots filled with probability ``bag_fill`` (-1 otherwise)."""
    K = sum(t.width for t in model.tables)
    D = len(model.dense_features)
    x = np.empty(batch, np.dtype([("dense", "<f8", (D,)), ("ids", "<i8", (K,))]))
    x["dense"] = rng.random((batch, D))
    cols = []
    for t in model.tables:
        c = rng.integers(0, t.rows, (batch, t.width))
        if t.width > 1:
            c[rng.random(c.shape) >= bag_fill] = -1
        cols.append(c)
    x["ids"] = np.concatenate(cols, axis=1)
    return x, rng.integers(1, 6, batch).astype(np.float64)


def measure_rates(comm, model: Any, batch: int, *, optimizer: str = "rowwise_adagrad",
                  bag_fill: float = 1.0) -> tp.Rates:
    """Every rate of ``plan/tables.py`` at ``comm``'s size (collective).

    The collectives' bandwidths come from tight loops (``collective_lines``); the rest
    from two probes of whole steps (``probe_step``), as training runs them, where a
    rank meets its partners after compute of its own (and, with more ranks than
    cores, after they were descheduled: a latency timed in a tight loop is many times
    smaller). Ranks that meet at an exchange are in step at the next collective, so
    a wait is counted where it falls:

    - the row-wise probe: its dense all-reduce (the ranks already in step: the dense
      part's ``sync``), the exchanges' latency (``a2a_s`` less the bytes, over 4
      exchanges a table), and the tables' own work outside the exchanges and row
      kernels (``shard_s``: what is left of its forward and backward per table);
    - the replicated probe: the dense part's forward, backward and update, and the
      gather's latency (its ``sync`` less the dense all-reduce, the merge and the
      bytes, over 3 collectives): the gather is the first collective after the
      replicated tables' local work, so it holds the wait for the slowest rank.
    """
    itemsize = 8 if model.dtype == "float64" else 4
    load = open("/proc/loadavg").read().strip()
    G = comm.Get_size()
    a2a, gather = collective_lines(comm)
    largest = max(t.rows * model.embed_dim * itemsize for t in model.tables)
    k = kernel_rates(comm, itemsize, uncached_bytes=int(min(max(largest, UNCACHED_BYTES),
                                                            MAX_UNCACHED_BYTES)))
    rates = tp.Rates(G, a2a, gather, k["route_s"], k["pool"], k["grad"],
                     k["update"], cache_bytes(), {}, batch, load)
    rep = probe_step(comm, model, batch, optimizer=optimizer, bag_fill=bag_fill)
    small = replace(model, tables=tuple(replace(t, rows=min(t.rows, 8 * G))
                                        for t in model.tables))
    work = tp.workload_of(small, batch, optimizer, bag_fill)
    if G == 1:
        tables = tp.rank_costs(work, tp.place(work, G, {}), rates, G, dense=False).ranks[0]
        return replace(rates, dense={k: max(rep[k] - tables.time[k], 0.0) for k in tp.TERMS})
    row = probe_step(comm, model, batch, optimizer=optimizer, bag_fill=bag_fill,
                     sharding="row")
    n_tables = len(model.tables)
    lat = (row["a2a_s"] - row["a2a_bytes"] / a2a.bytes_per_s) / (4 * n_tables)
    rates = replace(rates, a2a=tp.Line(max(lat, 1e-7), a2a.bytes_per_s))
    dense_sync = row["sync"]
    got = sum(G * tp.distinct(t.rows, batch * t.ids) * (8 + t.dim * itemsize)
              for t in work.tables)
    merge = sum(rates.grad["cached"].time(G * tp.distinct(t.rows, batch * t.ids),
                                          t.dim * itemsize) for t in work.tables)
    lat = (rep["sync"] - dense_sync - merge - got / gather.bytes_per_s) / 3
    rates = replace(rates, gather=tp.Line(max(lat, 1e-7), gather.bytes_per_s))
    tables = tp.rank_costs(work, tp.place(work, G, {}), rates, G, dense=False).ranks[0]
    dense = {k: max(rep[k] - tables.time[k], 0.0) for k in tp.TERMS}
    dense["sync"] = dense_sync
    rates = replace(rates, dense=dense)
    # what the row-wise step spent beyond the dense part and the modelled table work
    wide = replace(model, tables=tuple(replace(t, rows=8 * G) for t in model.tables))
    wwork = tp.workload_of(wide, batch, optimizer, bag_fill)
    placed = tp.place(wwork, G, {}, default="row")
    modelled = tp.rank_costs(wwork, placed, rates, G, dense=True)
    mod = max(modelled.ranks, key=lambda r: r.own_s).time
    extra = (row["fwd"] + row["bwd"]) - (mod["fwd"] + mod["bwd"])
    return replace(rates, shard_s=max(extra / n_tables, 0.0))


def cache_bytes() -> int:
    """The last-level cache's size (sysfs), 32 MiB when it cannot be read."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    sizes = []
    for f in base.glob("index*/size"):
        text = f.read_text().strip()
        sizes.append(int(text[:-1]) * 1024 if text.endswith("K") else int(text))
    return max(sizes, default=32 * 2**20)


# ---------------------------------------------------------------------------------
# the rates file


def to_toml(rates: list[tp.Rates], note: str) -> str:
    def rr(r: tp.RowRate) -> str:
        return f"{{ row_s = {r.row_s:.4e}, byte_s = {r.byte_s:.4e} }}"

    lines = [f"# {line}" for line in note.splitlines()] + [""]
    for r in rates:
        s = f"ranks.{r.ranks}"
        lines += [f"[{s}]", f'load = "{r.load}"',
                  f"route_s = {r.route_s:.4e}", f"shard_s = {r.shard_s:.4e}",
                  f"cache_bytes = {r.cache_bytes}",
                  "dense = { " + ", ".join(f"{k} = {v:.4e}" for k, v in r.dense.items())
                  + " }", f"dense_batch = {r.dense_batch}",
                  f"a2a = {{ latency_s = {r.a2a.latency_s:.4e}, "
                  f"bytes_per_s = {r.a2a.bytes_per_s:.4e} }}",
                  f"gather = {{ latency_s = {r.gather.latency_s:.4e}, "
                  f"bytes_per_s = {r.gather.bytes_per_s:.4e} }}",
                  f"pool = {{ {', '.join(f'{k} = {rr(v)}' for k, v in r.pool.items())} }}",
                  f"grad = {{ {', '.join(f'{k} = {rr(v)}' for k, v in r.grad.items())} }}",
                  "update = { " + ", ".join(f'"{k}" = {rr(v)}' for k, v in r.update.items())
                  + " }", ""]
    return "\n".join(lines)


WRITTEN_BY = "Written by: hpctrain calibrate-tables "


def load_rates(path: str, ranks: int) -> tp.Rates:
    return tp.rates_from_dict(read_toml(path, "table rates"), ranks, source=path,
                              measured_with=measured_with(path))


def measured_with(path: str) -> str:
    """The options a rates file was measured with but --ranks and --out (its first
    line, ``calibrate_tables_command``'s note), or ``--config CONFIG`` when it has none."""
    first = (Path(path).read_text().splitlines() or [""])[0].removeprefix("# ")
    try:
        words = shlex.split(first.removeprefix(WRITTEN_BY))
    except ValueError:
        words = []
    if not first.startswith(WRITTEN_BY) or not words:
        return "--config CONFIG"
    kept, words = [], iter(words)
    for w in words:
        if w in ("--ranks", "--out"):
            next(words, None)  # its value
        elif not w.startswith(("--ranks=", "--out=")):
            kept.append(w)
    return shlex.join(kept)


def rates_dict(r: tp.Rates) -> dict:
    """``Rates`` as the raw dict ``rates_from_dict`` reads (the worker's JSON)."""
    def rr(x):
        return {"row_s": x.row_s, "byte_s": x.byte_s}

    return {"a2a": r.a2a.__dict__, "gather": r.gather.__dict__, "route_s": r.route_s,
            "shard_s": r.shard_s,
            "pool": {k: rr(v) for k, v in r.pool.items()},
            "grad": {k: rr(v) for k, v in r.grad.items()},
            "update": {k: rr(v) for k, v in r.update.items()},
            "cache_bytes": r.cache_bytes, "dense": r.dense,
            "dense_batch": r.dense_batch, "load": r.load}


# ---------------------------------------------------------------------------------
# the model to plan: a config's tables, and optionally a large hashed one


def model_of(config_path: str, hashed_rows: int) -> Any:
    from hpctrain import config as config_mod

    model = config_mod.load(config_path).model
    if not model.tables:
        raise ConfigError(f"{config_path}: model kind {model.kind!r} has no embedding tables")
    if hashed_rows:
        if any(t.name == "hashed" for t in model.tables):
            raise ConfigError(f"{config_path}: --hashed-rows adds a table 'hashed', and the "
                              f"config has one already: rename it or leave the option out")
        model = replace(model, tables=(*model.tables, TableConfig("hashed", hashed_rows)))
    return model


def worker(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="hpctrain.plan.tables_calibrate")
    ap.add_argument("--config", required=True)
    ap.add_argument("--hashed-rows", type=int, default=0)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--optimizer", default="rowwise_adagrad")
    ap.add_argument("--bag-fill", type=float, default=1.0)
    args = ap.parse_args(argv)
    from mpi4py import MPI

    from hpctrain.runtime import keep_freed_memory, set_blas_threads

    keep_freed_memory()
    set_blas_threads(1)
    comm = MPI.COMM_WORLD
    rates = measure_rates(comm, model_of(args.config, args.hashed_rows), args.batch,
                          optimizer=args.optimizer, bag_fill=args.bag_fill)
    if comm.Get_rank() == 0:
        print(RESULT_TAG + json.dumps(rates_dict(rates)), flush=True)


def run_job(launcher: str, ranks: int, argv: list[str], timeout: float) -> dict:
    from hpctrain.plan.calibrate import job_result

    return job_result([launcher, "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m",
                       "hpctrain.plan.tables_calibrate", *argv], RESULT_TAG, timeout)


# ---------------------------------------------------------------------------------
# the commands

POSITIVE = FiniteRange(min=0, min_open=True)

_model_options = [
    click.option("--config", "config_path", required=True,
                 type=click.Path(exists=True, dir_okay=False),
                 help="The model's TOML config ([model] tables, embed_dim, dtype)."),
    click.option("--hashed-rows", type=click.IntRange(min=0), default=0, show_default=True,
                 help="Add a table 'hashed' of this many rows (width 1) to the config's "
                      "(0: none)."),
    click.option("--batch", type=click.IntRange(min=1), default=1024, show_default=True,
                 help="Samples per rank and step."),
    click.option("--optimizer", type=click.Choice(tp.OPTIMIZERS),
                 help="The tables' sparse optimizer (default: the config's [train] "
                      "sparse_optimizer)."),
    click.option("--bag-fill", type=FiniteRange(0, 1, min_open=True), default=0.4,
                 show_default=True,
                 help="Share of a bag's slots (width > 1) that hold an id."),
]


def model_options(fn):
    for opt in reversed(_model_options):
        fn = opt(fn)
    return fn


def _ranks(ctx, param, value: str) -> list[int]:
    try:
        got = [int(v) for v in value.split(",") if v]
    except ValueError:
        raise click.BadParameter(f"{value!r} must be comma-separated integers") from None
    if not got or min(got) < 1:
        raise click.BadParameter(f"{value!r}: rank counts must be 1 or more")
    return sorted(set(got))  # one [ranks.N] section each: TOML refuses a repeated one


DEFAULT_RATES = "configs/clusters/tables-this-machine.toml"


@click.command("calibrate-tables")
@model_options
@click.option("--ranks", default="2,4", show_default=True, callback=_ranks,
              help="Group sizes to measure at (one MPI job each).")
@click.option("--out", default=DEFAULT_RATES, show_default=True,
              help="The rates file to write.")
@click.option("--mpiexec", help="MPI launcher (default: the one beside this Python, else "
                                 "PATH's).")
@click.option("--timeout", type=POSITIVE, default=600, show_default=True,
              help="Seconds per MPI job before it is killed.")
def calibrate_tables_command(config_path, hashed_rows, batch, optimizer, bag_fill, ranks,
                             out, mpiexec, timeout) -> None:
    """Measure the table planner's rates (all-to-all, gather, lookups, sparse updates,
    the model's dense step) at each --ranks and write them to --out.

    \b
    Example:
      hpctrain calibrate-tables --config configs/dlrm-movielens.toml \\
          --hashed-rows 10000000 --ranks 2,4
    """
    from hpctrain.clitypes import launcher
    from hpctrain.plan.calibrate import check_output

    mpiexec = launcher(mpiexec)  # the default was PATH's: maybe another MPI than mpi4py's
    check_output(Path(out))  # before the jobs
    optimizer = optimizer or _optimizer(config_path)
    argv = ["--config", config_path, "--hashed-rows", str(hashed_rows), "--batch",
            str(batch), "--optimizer", optimizer, "--bag-fill", str(bag_fill)]
    got = []
    for n in ranks:
        click.echo(f"measuring at {n} ranks ...", err=True)
        got.append(tp.rates_from_dict({"ranks": {str(n): run_job(mpiexec, n, argv, timeout)}},
                                      n))
    cmd = WRITTEN_BY + shlex.join(sys.argv[2:])
    Path(out).write_text(to_toml(got, f"{cmd}\n(seconds, bytes; "
                                      f"hpctrain/plan/tables_calibrate.py)"))
    click.echo(f"wrote {out}")
    for r in got:
        a2a = "none at 1 rank" if r.ranks == 1 else \
            f"{r.a2a.latency_s * 1e6:.0f} us + {r.a2a.bytes_per_s / 1e9:.2f} GB/s"
        click.echo(f"  {r.ranks} ranks (load {r.load.split()[0]}): a2a {a2a}, "
                   f"pool {r.pool['cached'].time(1, 64) * 1e9:.0f}/"
                   f"{r.pool['uncached'].time(1, 64) * 1e9:.0f} ns per row of 64 B, "
                   f"dense {sum(r.dense.values()) * 1e3:.2f} ms")


@click.command("plan-tables")
@model_options
@click.option("--ranks", type=click.IntRange(min=1), required=True,
              help="Ranks in the table group.")
@click.option("--memory-gib", type=POSITIVE, required=True,
              help="Memory per rank for the tables and their optimizer state, GiB.")
@click.option("--rates", default=DEFAULT_RATES, show_default=True,
              help="The rates file (hpctrain calibrate-tables).")
@click.option("--out", help="Write the plan here (for hpctrain train --table-plan; its "
                             "folder is made; never the --config, --rates or --check file).")
@click.option("--force", is_flag=True, help="Let --out replace an existing file.")
@click.option("--check", "check_path", type=click.Path(exists=True, dir_okay=False),
              help="Instead of planning, cost this plan file (a hand-written one) and "
                   "refuse it when it does not fit.")
def plan_tables_command(config_path, hashed_rows, batch, optimizer, bag_fill, ranks,
                        memory_gib, rates, out, force, check_path) -> None:
    """Choose each embedding table's sharding: fit the memory per rank, balance the
    predicted per-rank step; print the plan and its prediction.

    \b
    Example:
      hpctrain plan-tables --config configs/dlrm-movielens.toml --hashed-rows 10000000 \\
          --ranks 4 --memory-gib 2 --out plan.toml
      mpiexec -n 4 hpctrain train --config ... --table-plan plan.toml
    """
    if out:  # before the planning: the file is writable and replaces no input
        _check_plan_output(Path(out), force, check_path,
                           {"--config": config_path, "--rates": rates})
    try:
        model = model_of(config_path, hashed_rows)
        optimizer = optimizer or _optimizer(config_path)
        work = tp.workload_of(model, batch, optimizer, bag_fill)
        r = load_rates(rates, ranks)
        limit = memory_gib * 2**30
        if check_path:
            placements = plan_file_placements(check_path, config_path, model, ranks)
            tp.check_plan(work, ranks, limit, placements)
            pred = tp.rank_costs(work, placements, r, ranks)
        else:
            plan = tp.plan_tables(work, ranks, limit, r)
            placements, pred = plan.placements, plan.prediction
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{len(work.tables)} tables, {ranks} ranks of {memory_gib:g} GiB, {batch} "
               f"samples per rank, {optimizer}; rates {rates} (load then: {r.load})")
    click.echo(tp.format_prediction(placements, work, pred, r, ranks))
    if out:
        from hpctrain.data.format import atomic_output

        with atomic_output(out, force=force) as tmp:
            tmp.write_text(plan.toml())
        click.echo(f"wrote {out} (hpctrain train --table-plan {out})")


def _check_plan_output(out: Path, force: bool, check_path: str | None,
                       inputs: dict[str, str]) -> None:
    """--out is refused with --check (nothing is planned), else checked as
    ``check_new_output`` checks a new file."""
    from hpctrain.plan.calibrate import check_new_output

    if check_path:
        raise click.BadParameter("--check costs a plan file and plans nothing: there is no "
                                 "plan to write", param_hint="--out")
    check_new_output(out, "--out", force, inputs)


def _optimizer(config_path: str) -> str:
    from hpctrain import config as config_mod

    return config_mod.load(config_path).train.sparse_optimizer


def plan_file_placements(path: str, config_path: str, model: Any,
                         ranks: int) -> dict[str, Any]:
    """The placement of plan file ``path`` over a table group of ``ranks``, refused as
    ``hpctrain train --config CONFIG --table-plan FILE`` refuses it, by the same code:
    its keys (``read_plan``), their form (``config.load``'s, with the file as
    overrides), the placement's rules (``place_tables``, as ``Config.validate`` runs
    them), over ``model`` (``model_of``'s: the config's tables and --hashed-rows')."""
    from hpctrain import config as config_mod
    from hpctrain.parallel.tables import group_size, place_tables, read_plan

    overrides = read_plan(path)  # its errors name the file
    try:
        par = config_mod.load(config_path, overrides).parallel
        par = replace(par, dp=par.dp or ranks)
        if group_size(par) != ranks:
            raise ConfigError(f"group ({par.table_group}) must be --ranks ({ranks}), the "
                              f"table group planned for (0: the whole data group, dp = "
                              f"{par.dp})")
        return place_tables(model, par)
    except ConfigError as e:
        raise ConfigError(f"table plan {path!r}: {e}") from None


if __name__ == "__main__":
    worker(sys.argv[1:])
