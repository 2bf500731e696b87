"""The GEMM ceiling of a GPT step: every matrix product of one training step at its own
shape, each timed at its best, as a rate (the "per-step GEMM probe").

    python benchmarks/gemm_shapes.py --batch 8 --threads 2 --out probe.json [--n-layer ..]

The products of one rank's step over ``b`` sequences of ``T`` tokens (``M = b T``),
per layer, with ``C`` = d_model, ``F`` = 4 C, ``H`` heads of ``D`` = C / H:

    forward   qkv (M, C) @ (C, 3C)   proj (M, C) @ (C, C)   fc (M, C) @ (C, F)
              fc-proj (M, F) @ (F, C)   b H x [ q k^T (T, D) @ (D, T),  P v (T, T) @ (T, D) ]
    backward  each Linear (M, K) @ (K, N):  dx = dy W^T (M, N) @ (N, K),
                                            dW = x^T dy (K, M) @ (M, N)
              attention: dP = dy v^T, dv = P^T dy, dq = dS k, dk = dS^T q, per head
    head      (M, C) @ (C, V), forward and its two backward products

2 m k n FLOPs each: they add up to ``GPT.model_flops`` exactly (the test checks it).
The probe times each product alone, float32, with this process's BLAS threads (a batched
product also split over the threads by batch, one BLAS thread each, as hpctrain's
attention does; the faster counts), and the step's GEMM time is the sum of the best
times. Its rate, the model FLOPs over that time, is what the step would reach if every
product ran as fast as it can alone on this machine: MFU against it says how much of a
step is lost outside the products, or to products slower in place than alone.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Gemm:
    """``count`` products ``A @ B`` of ``batch`` x (m, k) @ (k, n); ``trans_a`` /
    ``trans_b``: the operand is a transposed view, as in a backward product."""

    name: str
    count: int
    batch: int
    m: int
    k: int
    n: int
    trans_a: bool = False
    trans_b: bool = False

    @property
    def flops(self) -> float:
        return 2.0 * self.count * self.batch * self.m * self.k * self.n


def _linear(name: str, count: int, M: int, K: int, N: int) -> list[Gemm]:
    """A Linear (M, K) @ (K, N) in forward and its two backward products."""
    return [Gemm(f"{name}", count, 1, M, K, N),
            Gemm(f"{name} dx", count, 1, M, N, K, trans_b=True),  # dy @ W^T
            Gemm(f"{name} dW", count, 1, K, M, N, trans_a=True)]  # x^T @ dy


def gpt_gemms(*, batch: int, seq_len: int, n_layer: int, n_head: int, d_model: int,
              vocab_size: int, d_ff: int = 0) -> list[Gemm]:
    """Every matrix product of one training step of the GPT over ``batch`` sequences."""
    B, T, L, H, C, V = batch, seq_len, n_layer, n_head, d_model, vocab_size
    F, D, M = d_ff or 4 * C, C // H, B * T
    gemms = (_linear("qkv", L, M, C, 3 * C) + _linear("proj", L, M, C, C)
             + _linear("fc", L, M, C, F) + _linear("fc-proj", L, M, F, C)
             + _linear("head", 1, M, C, V))
    bh = B * H
    gemms += [Gemm("q k^T", L, bh, T, D, T, trans_b=True),  # S = q k^T
              Gemm("P v", L, bh, T, T, D),
              Gemm("dP = dy v^T", L, bh, T, D, T, trans_b=True),
              Gemm("dv = P^T dy", L, bh, T, T, D, trans_a=True),
              Gemm("dq = dS k", L, bh, T, T, D),
              Gemm("dk = dS^T q", L, bh, T, T, D, trans_a=True)]
    return gemms


def _operands(g: Gemm, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    def make(rows: int, cols: int, trans: bool) -> np.ndarray:
        shape = (g.batch, cols, rows) if trans else (g.batch, rows, cols)
        x = rng.standard_normal(shape, dtype=np.float32)
        x = x.transpose(0, 2, 1) if trans else x
        return x[0] if g.batch == 1 else x

    return make(g.m, g.k, g.trans_a), make(g.k, g.n, g.trans_b)


def _best(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def probe(gemms: list[Gemm], threads: int, repeats: int = 5) -> list[float]:
    """The best seconds of one product of each shape, with ``threads`` BLAS threads;
    a batched product also split by batch over ``threads`` threads of one BLAS thread
    each, the faster counting."""
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    best = []
    with threadpool_limits(limits=threads, user_api="blas"):
        for g in gemms:
            a, b = _operands(g, rng)
            out = np.empty((g.batch, g.m, g.n) if g.batch > 1 else (g.m, g.n), np.float32)
            seconds = _best(lambda a=a, b=b, out=out: np.matmul(a, b, out=out), repeats)
            if g.batch > 1 and threads > 1:
                edges = np.linspace(0, g.batch, threads + 1).astype(int)
                parts = [slice(lo, hi) for lo, hi in zip(edges[:-1], edges[1:], strict=True)]
                with threadpool_limits(limits=1, user_api="blas"), \
                        ThreadPoolExecutor(threads) as pool:
                    def split(a=a, b=b, out=out, parts=parts, pool=pool):
                        list(pool.map(lambda s: np.matmul(a[s], b[s], out=out[s]), parts))
                    seconds = min(seconds, _best(split, repeats))
            best.append(seconds)
    return best


def step_rate(gemms: list[Gemm], seconds: list[float]) -> tuple[float, float]:
    """(the step's GEMM time, its rate): each product at its best time."""
    total = sum(g.count * s for g, s in zip(gemms, seconds, strict=True))
    return total, sum(g.flops for g in gemms) / total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, required=True, help="sequences on this rank")
    parser.add_argument("--threads", type=int, required=True, help="BLAS threads")
    parser.add_argument("--out", required=True, help="the figures, JSON")
    parser.add_argument("--repeats", type=int, default=5)
    for name, default in (("seq-len", 256), ("n-layer", 6), ("n-head", 6), ("d-model", 384),
                          ("vocab-size", 256)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args(argv)
    gemms = gpt_gemms(batch=args.batch, seq_len=args.seq_len, n_layer=args.n_layer,
                      n_head=args.n_head, d_model=args.d_model, vocab_size=args.vocab_size)
    seconds = probe(gemms, args.threads, args.repeats)
    total, rate = step_rate(gemms, seconds)
    with open(args.out, "w") as f:
        json.dump({"threads": args.threads, "batch": args.batch, "gemm_time_s": total,
                   "flops_per_s": rate, "gemms": [asdict(g) | {"best_s": s}
                                                  for g, s in zip(gemms, seconds, strict=True)]},
                  f, indent=2)


if __name__ == "__main__":
    main()
