"""A step of an embedding table costs what the batch touches, not what the table holds.

    python benchmarks/bench_embedding.py [--batch 4096] [--dim 16] [--steps 30]

Two measurements, each of the two tables: ``table``, the table alone, and ``dlrm``, a
whole DLRM step (``hpctrain.models.dlrm``: the MovieLens tables, the MLPs, AdamW)
with the hashed table as one more feature, the issue's setting. Times forward (pooled
lookup), backward (the ``SparseGrad`` of the batch's rows) and
the sparse update (row-wise AdaGrad, and lazy Adam) of a 10-million-row hashed table
beside a 10-thousand-row one, with the same batch of ids: raw 64-bit feature values
hashed into the table (``value % rows``), bags of ``--width`` slots. The two tables'
steps are interleaved (``--rounds`` rounds of ``--steps`` steps each) and the median
step of each is printed, with their ratio; the target is within 20% (ratio <= 1.2).
One BLAS thread; float32 tables. The 10M x 16 table is 640 MB, lazy Adam's state
twice that.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import hpctrain  # noqa: F401  (before NumPy: OpenBLAS's idle threads sleep)
from hpctrain.config import ModelConfig, TableConfig
from hpctrain.models.dlrm import DLRM
from hpctrain.nn import EmbeddingBag
from hpctrain.nn.module import is_sparse
from hpctrain.optim import AdamW
from hpctrain.optim.sparse import RowWiseAdaGrad, SparseAdam, TablesAndDense

OPTIMIZERS = {"rowwise_adagrad": RowWiseAdaGrad, "adam": SparseAdam}


def table(rows: int, dim: int, seed: int) -> EmbeddingBag:
    rng = np.random.default_rng(seed)
    init = rng.uniform(-1, 1, (rows, dim)).astype(np.float32) / np.float32(np.sqrt(rows))
    return EmbeddingBag(init, pooling="sum", name=f"{rows} rows")


def batches(n: int, batch: int, width: int, seed: int) -> list[np.ndarray]:
    """Raw feature values (b, width) as 64-bit integers, to be hashed into a table."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 2**62, (batch, width), dtype=np.int64) for _ in range(n)]


def step(bag: EmbeddingBag, opt, raw: np.ndarray, dy: np.ndarray) -> float:
    """One forward + backward + sparse update; its seconds."""
    t0 = time.perf_counter()
    bag.weight.zero_grad()
    y, cache = bag.forward(raw % bag.rows)  # (b, dim), hashed ids
    bag.backward(dy, cache)
    opt.step(0.01)
    return time.perf_counter() - t0


MOVIELENS = (("user", 943), ("item", 1682), ("age_bucket", 7), ("gender", 2),
             ("occupation", 21), ("zip_prefix", 11), ("decade", 9))


def dlrm(rows: int, dim: int, optimizer: str) -> tuple[DLRM, TablesAndDense]:
    """The MovieLens DLRM (configs/dlrm-movielens.toml, without the genres bag) with a
    hashed table of ``rows`` as its last feature, and its optimizers."""
    tables = tuple(TableConfig(n, r) for n, r in (*MOVIELENS, ("hashed", rows)))
    cfg = ModelConfig(kind="dlrm", tables=tables, embed_dim=dim, bottom_mlp=(16, dim),
                      top_mlp=(64, 32), dense_features=("age", "year"),
                      bias_features=("user", "item"), output_bias=3.5)
    model = DLRM(cfg, seed=0)
    named = model.named_parameters()
    dense = AdamW([(n, p) for n, p in named if not is_sparse(p)], lr=1e-3)
    sparse = OPTIMIZERS[optimizer]([(n, p) for n, p in named if is_sparse(p)], lr=0.01)
    return model, TablesAndDense(dense, sparse)


def model_batches(n: int, batch: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Structured batches: MovieLens-like ids, the last column raw 64-bit values."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = np.empty(batch, np.dtype([("dense", "<f8", (2,)), ("ids", "<i8", (8,))]))
        x["dense"] = rng.random((batch, 2))
        x["ids"][:, :7] = np.stack([rng.integers(0, r, batch) for _, r in MOVIELENS], 1)
        x["ids"][:, 7] = rng.integers(0, 2**62, batch, dtype=np.int64)
        out.append((x, rng.integers(1, 6, batch).astype(np.float64)))
    return out


def model_step(model: DLRM, opt: TablesAndDense, x: np.ndarray, y: np.ndarray) -> float:
    """One DLRM step (forward, backward, AdamW + sparse update), the hashed column
    hashed into the table; its seconds."""
    t0 = time.perf_counter()
    x = x.copy()
    x["ids"][:, 7] %= model.tables[-1].rows
    model.zero_grad()
    _, cache = model.forward(x, y)
    model.backward(cache)
    opt.step(1e-3)
    return time.perf_counter() - t0


def compare(label: str, pairs, rounds: int) -> list[float]:
    """Interleaved rounds of ``pairs``: [(run one step of data item, data)]; medians."""
    times: list[list[float]] = [[] for _ in pairs]
    for _ in range(rounds):
        for k, (run, data) in enumerate(pairs):
            run(data[0])  # warm
            times[k] += [run(item) for item in data]
    return [statistics.median(t) for t in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4096, help="samples per step")
    ap.add_argument("--width", type=int, default=1, help="ids per sample (a bag when > 1)")
    ap.add_argument("--dim", type=int, default=16, help="embedding width")
    ap.add_argument("--steps", type=int, default=30, help="steps per round and table")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), action="append",
                    help="sparse optimizer(s) to time (default: both)")
    ap.add_argument("--rows", type=int, nargs=2, default=[10_000, 10_000_000],
                    metavar=("SMALL", "LARGE"), help="the two tables' rows")
    args = ap.parse_args()
    from hpctrain.runtime import keep_freed_memory, set_blas_threads

    keep_freed_memory()
    set_blas_threads(1)
    data = batches(args.steps, args.batch, args.width, seed=0)
    dy = np.random.default_rng(1).standard_normal((args.batch, args.dim)).astype(np.float32)
    print(f"batch {args.batch} x {args.width} id(s), dim {args.dim}, float32, "
          f"{args.rounds} rounds x {args.steps} steps, median step (forward + backward + "
          f"update)")
    print(f"{'optimizer':<16} {'rows':>12} {'table MB':>9} {'state MB':>9} "
          f"{'step ms':>8} {'rows/step':>9}")
    for name in args.optimizer or sorted(OPTIMIZERS):
        bags = [table(rows, args.dim, seed=2) for rows in args.rows]
        opts = [OPTIMIZERS[name]([("t", b.weight)], lr=0.01) for b in bags]
        times: list[list[float]] = [[] for _ in bags]
        for _ in range(args.rounds):
            for k, (bag, opt) in enumerate(zip(bags, opts, strict=True)):
                step(bag, opt, data[0], dy)  # warm
                times[k] += [step(bag, opt, raw, dy) for raw in data]
        med = [statistics.median(t) for t in times]
        for bag, opt, m in zip(bags, opts, med, strict=True):
            state = sum(a.nbytes for k, a in opt.state_arrays().items() if k != "t")
            print(f"{name:<16} {bag.rows:>12,} {bag.weight.data.nbytes / 1e6:>9.1f} "
                  f"{state / 1e6:>9.1f} {m * 1e3:>8.3f} {len(bag.weight.grad.rows):>9,}")
        ratio = med[1] / med[0]
        print(f"{name:<16} large / small step time: {ratio:.3f} "
              f"({'within' if ratio <= 1.2 else 'NOT within'} 20%)")
        del bags, opts
    print(f"\nwhole DLRM step: the MovieLens tables + the hashed table, batch {args.batch}")
    print(f"{'optimizer':<16} {'rows':>12} {'step ms':>8}")
    data = model_batches(args.steps, args.batch, seed=3)
    for name in args.optimizer or sorted(OPTIMIZERS):
        built = [dlrm(rows, args.dim, name) for rows in args.rows]
        pairs = [(lambda xy, m=m, o=o: model_step(m, o, *xy), data) for m, o in built]
        med = compare(name, pairs, args.rounds)
        for rows, m in zip(args.rows, med, strict=True):
            print(f"{name:<16} {rows:>12,} {m * 1e3:>8.3f}")
        ratio = med[1] / med[0]
        print(f"{name:<16} large / small step time: {ratio:.3f} "
              f"({'within' if ratio <= 1.2 else 'NOT within'} 20%)")
        del built, pairs


if __name__ == "__main__":
    main()
