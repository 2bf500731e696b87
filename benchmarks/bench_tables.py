"""Per-rank step time of each sharding of the DLRM's tables (``parallel.tables``).

    mpiexec -n 2 python benchmarks/bench_tables.py [--batch 1024] [--steps 10]
    mpiexec -n 4 python benchmarks/bench_tables.py

The MovieLens tables (configs/dlrm-movielens.toml: user, item, five small side
features, the genres bag of 6 averaged) and a 10-million-row hashed table, dim 16,
float32, row-wise AdaGrad for the tables and AdamW for the MLPs, ``--batch`` samples
per rank (ids drawn uniformly; the hashed column over its whole range). Each sharding
in turn, every table placed so (``row``: but a table of fewer rows than ranks
replicated; ``mixed``: the hashed table row-wise, user and item
table-wise, the rest replicated); ``--steps`` timed steps after two warm ones. Printed
per rank, medians over the steps, so a planner can be fitted to them:

    fwd / bwd ms     forward and backward of the model, lookups and all-to-alls included
    a2a fwd / bwd    of which in the all-to-alls (ids out and pooled back; gradients)
    sync ms          the dense all-reduce, the replicated tables' gather and the shards'
                     sum over replicas
    update ms        norm, clipping and both optimizers
    rows             ids this rank pooled as an owner of sharded tables (forward)
    sent / recv KB   all-to-all bytes of one step (forward and backward)

with the load average before and after (compare shardings only within one run).

``--plan``: the planner's check (``hpctrain.plan.tables``). In each of ``--rounds``
rounds the planner's rates are measured in the same job
(``tables_calibrate.measure_rates``) and every sharding is predicted from them and
measured; the planner places the tables for ``--memory-gib`` per rank from the first
round's rates. Rank 0 prints per rank the medians over the rounds of the predicted and
measured forward + backward and step, their ratio, and the ratio's range over the
rounds (a machine's speed drifts from minute to minute: the rounds interleave
calibration and measurement so that both see the same drift).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace

import numpy as np

import hpctrain  # noqa: F401  (before NumPy: OpenBLAS's idle threads sleep)
from hpctrain.config import (
    Config,
    ModelConfig,
    ParallelConfig,
    TableConfig,
    TableSharding,
    TrainConfig,
)

MOVIELENS = (("user", 943, 1), ("item", 1682, 1), ("age_bucket", 7, 1), ("gender", 2, 1),
             ("occupation", 21, 1), ("zip_prefix", 11, 1), ("decade", 9, 1),
             ("genres", 19, 6))
HASHED = 10_000_000
SHARDINGS = {
    "replicated": dict(table_default="replicated"),
    "table": dict(table_default="table"),
    "row": dict(table_default="row"),
    "column": dict(table_default="column"),
    "mixed": dict(table_sharding=(TableSharding("hashed", "row"),
                                  TableSharding("user", "table"),
                                  TableSharding("item", "table"))),
}


def config(size: int, batch: int, dim: int, sharding: str) -> Config:
    tables = tuple(TableConfig(n, r, w, "mean" if w > 1 else "sum")
                   for n, r, w in (*MOVIELENS, ("hashed", HASHED, 1)))
    model = ModelConfig(kind="dlrm", dtype="float32", tables=tables, embed_dim=dim,
                        bottom_mlp=(16, dim), top_mlp=(64, 32),
                        dense_features=("age", "year"), bias_features=("user", "item"),
                        output_bias=3.5)
    par = dict(SHARDINGS[sharding])
    if sharding == "row":  # a table of fewer rows than ranks stays replicated
        par["table_sharding"] = tuple(TableSharding(n, "replicated")
                                      for n, r, _ in MOVIELENS if r < size)
    return Config(model=model, parallel=ParallelConfig(**par),
                  train=TrainConfig(batch_size=batch * size, lr=1e-3, sparse_lr=0.02,
                                    grad_clip=1.0)).validate(size)


def batches(n: int, batch: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    K = sum(w for _, _, w in MOVIELENS) + 1
    out = []
    for _ in range(n):
        x = np.empty(batch, np.dtype([("dense", "<f8", (2,)), ("ids", "<i8", (K,))]))
        x["dense"] = rng.random((batch, 2))
        cols = [rng.integers(0, r, (batch, w)) for _, r, w in MOVIELENS]
        bag = cols[-1]
        bag[rng.random(bag.shape) < 0.6] = -1  # most films have 1-3 genres
        x["ids"] = np.concatenate([*cols, rng.integers(0, HASHED, (batch, 1))], axis=1)
        out.append((x, rng.integers(1, 6, batch).astype(np.float64)))
    return out


def measure(cfg: Config, comm, data, warm: int) -> dict[str, float]:
    """Median per-step figures of this rank (see the module docstring)."""
    from hpctrain.parallel.engine import build_engine
    from hpctrain.parallel.topology import Topology
    from hpctrain.train import make_data_parallel

    topo = Topology.build(comm, cfg.parallel)
    engine = build_engine(cfg, topo)
    dp = make_data_parallel(cfg, engine, topo)
    stats = getattr(dp, "stats", None)
    model = engine.model
    rows = []
    for i, (x, y) in enumerate(data):
        comm.Barrier()
        dp.zero_grad()
        t0 = time.perf_counter()
        loss, cache = model.forward(x, y)
        t1 = time.perf_counter()
        fwd = stats.take() if stats else {}
        model.backward(cache, dloss=1.0 / dp.dp_size)
        t2 = time.perf_counter()
        bwd = stats.take() if stats else {}
        dp.finish_grads()
        t3 = time.perf_counter()
        norm = dp.grad_norm()
        dp.clip(cfg.train.grad_clip, norm)
        dp.step(1e-3)
        t4 = time.perf_counter()
        if i >= warm:
            rows.append({"fwd": t1 - t0, "bwd": t2 - t1, "sync": t3 - t2, "update": t4 - t3,
                         "a2a_fwd": fwd.get("a2a_s", 0.0), "a2a_bwd": bwd.get("a2a_s", 0.0),
                         "rows": fwd.get("lookup_rows", 0),
                         "sent": fwd.get("a2a_sent_bytes", 0) + bwd.get("a2a_sent_bytes", 0),
                         "recv": fwd.get("a2a_recv_bytes", 0) + bwd.get("a2a_recv_bytes", 0)})
    held = sum(p.data.nbytes for n, p in engine.named_params if n.startswith("tables."))
    topo.free()
    out = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return {**out, "held_mb": held / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1024, help="samples per rank and step")
    ap.add_argument("--dim", type=int, default=16, help="embedding width")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per sharding")
    ap.add_argument("--sharding", choices=list(SHARDINGS), action="append",
                    help="sharding(s) to time (default: all)")
    ap.add_argument("--plan", action="store_true",
                    help="calibrate, plan, and compare predicted with measured per rank")
    ap.add_argument("--memory-gib", type=float, default=0.5,
                    help="with --plan: memory per rank for the tables and their state")
    ap.add_argument("--rounds", type=int, default=3,
                    help="with --plan: rounds of calibration and measurement, interleaved")
    args = ap.parse_args()
    from mpi4py import MPI

    from hpctrain.runtime import keep_freed_memory, set_blas_threads

    keep_freed_memory()
    set_blas_threads(1)
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    warm = 2
    data = batches(warm + args.steps, args.batch * size, seed=0)
    mine = [(x[rank * args.batch:(rank + 1) * args.batch],
             y[rank * args.batch:(rank + 1) * args.batch]) for x, y in data]
    if args.plan:
        return compare(args, comm, mine, warm)
    if rank == 0:
        print(f"{size} ranks, {args.batch} samples per rank, dim {args.dim}, float32; "
              f"tables: MovieLens {', '.join(n for n, _, _ in MOVIELENS)} and hashed "
              f"({HASHED:,} rows); median of {args.steps} steps; load average "
              f"{os.getloadavg()[0]:.2f}")
        print(f"{'sharding':<11}{'rank':>4} {'fwd ms':>7} {'a2a':>6} {'bwd ms':>7} "
              f"{'a2a':>6} {'sync ms':>8} {'update':>7} {'step ms':>8} {'rows':>6} "
              f"{'sent KB':>8} {'recv KB':>8} {'tables MB':>9}")
    for name in args.sharding or list(SHARDINGS):
        got = measure(config(size, args.batch, args.dim, name), comm, mine, warm)
        every = comm.gather(got, root=0)
        if rank == 0:
            for r, g in enumerate(every):
                step = g["fwd"] + g["bwd"] + g["sync"] + g["update"]
                print(f"{name:<11}{r:>4} {g['fwd'] * 1e3:>7.2f} {g['a2a_fwd'] * 1e3:>6.2f} "
                      f"{g['bwd'] * 1e3:>7.2f} {g['a2a_bwd'] * 1e3:>6.2f} "
                      f"{g['sync'] * 1e3:>8.2f} {g['update'] * 1e3:>7.2f} "
                      f"{step * 1e3:>8.2f} {g['rows']:>6.0f} {g['sent'] / 1e3:>8.1f} "
                      f"{g['recv'] / 1e3:>8.1f} {g['held_mb']:>9.1f}", flush=True)
    if rank == 0:
        print(f"load average after: {os.getloadavg()[0]:.2f}")


def compare(args, comm, data, warm: int) -> None:
    """``--plan``: rates measured here, the planner's choice and the hand-written
    shardings, each predicted and measured, in ``--rounds`` interleaved rounds
    (module docstring)."""
    from hpctrain.parallel.tables import place_tables
    from hpctrain.plan import tables as tp
    from hpctrain.plan.tables_calibrate import measure_rates

    size, rank = comm.Get_size(), comm.Get_rank()
    base = config(size, args.batch, args.dim, "replicated")
    work = tp.workload_of(base.model, args.batch, "rowwise_adagrad", bag_fill=0.4)
    load0 = os.getloadavg()[0]
    cases, preds, meas, plan = {}, {}, {}, None
    for rnd in range(args.rounds):
        rates = measure_rates(comm, base.model, args.batch, bag_fill=0.4)
        if plan is None:  # the plan of the first round's rates, measured every round
            plan = tp.plan_tables(work, size, args.memory_gib * 2**30, rates)
            cases["planned"] = replace(base, parallel=replace(
                base.parallel, table_sharding=tuple(plan.choices.values())))
            for name in args.sharding or list(SHARDINGS):
                cases[name] = config(size, args.batch, args.dim, name)
            if rank == 0:
                print(f"{size} ranks, {args.batch} samples per rank, dim {args.dim}, "
                      f"{args.rounds} rounds of calibration and {args.steps} measured "
                      f"steps a sharding; load average {load0:.2f}\nthe planner's "
                      f"choice for {args.memory_gib:g} GiB per rank (first round's rates):")
                print(tp.format_prediction(plan.placements, work, plan.prediction, rates,
                                           size))
        if rank == 0:
            print(f"round {rnd + 1}: a2a {rates.a2a.latency_s * 1e6:.0f} us + "
                  f"{rates.a2a.bytes_per_s / 1e9:.2f} GB/s, gather "
                  f"{rates.gather.latency_s * 1e6:.0f} us + "
                  f"{rates.gather.bytes_per_s / 1e9:.2f} GB/s (latencies from inside "
                  f"steps), dense {sum(rates.dense.values()) * 1e3:.2f} ms", flush=True)
        for name, cfg in cases.items():
            cfg = cfg.validate(size)
            pred = tp.rank_costs(work, place_tables(cfg.model, cfg.parallel), rates, size)
            got = comm.gather(measure(cfg, comm, data, warm), root=0)
            preds.setdefault(name, []).append(pred)
            meas.setdefault(name, []).append(got)
    if rank != 0:
        return
    print(f"\nstep: the slowest rank's forward + backward + sync + update (every rank "
          f"waits for it at the next step's collectives), median over the rounds; "
          f"rounds: the ratio's range\n{'sharding':<11} {'pred f+b':>9} {'meas f+b':>9} "
          f"{'pred step':>9} {'meas step':>9} {'meas/pred':>9} {'rounds':>11}   "
          f"per term, predicted/measured ms (the slowest rank)")
    for name in cases:
        pred_steps = [p.step_s for p in preds[name]]
        slowest = [max(range(size), key=lambda r, m=m: sum(m[r][k] for k in tp.TERMS))
                   for m in meas[name]]
        meas_steps = [sum(m[r][k] for k in tp.TERMS) for m, r in zip(meas[name], slowest,
                                                                      strict=True)]
        ratios = [m / p for m, p in zip(meas_steps, pred_steps, strict=True)]
        step, got = statistics.median(pred_steps), statistics.median(meas_steps)
        t = {k: statistics.median(max(p.ranks, key=lambda c: c.own_s).time[k]
                                  for p in preds[name]) for k in tp.TERMS}
        g = {k: statistics.median(m[r][k] for m, r in zip(meas[name], slowest, strict=True))
             for k in tp.TERMS}
        terms = " ".join(f"{k} {t[k] * 1e3:.2f}/{g[k] * 1e3:.2f}" for k in tp.TERMS)
        print(f"{name:<11} {(t['fwd'] + t['bwd']) * 1e3:>9.2f} "
              f"{(g['fwd'] + g['bwd']) * 1e3:>9.2f} {step * 1e3:>9.2f} {got * 1e3:>9.2f} "
              f"{got / step:>9.2f} {min(ratios):>5.2f}-{max(ratios):<5.2f}   {terms}",
              flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
