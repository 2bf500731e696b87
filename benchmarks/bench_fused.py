"""numba's fused element-wise kernels (``hpctrain.nn.fused``) against NumPy's, at the
benchmark GPT's shapes (batch 8, T 256, d_model 384, d_ff 1536, 6 heads).

    python benchmarks/bench_fused.py            each kernel, three ways (below)
    python benchmarks/bench_fused.py --step     the serial step, one kernel set at a time

Kernels, each timed three ways in turn, round after round (this machine is shared and
its speed drifts; medians over the rounds):

    numpy   NumPy's kernel, rows split over the element-wise threads (threads.over_rows)
    rows    numba's kernel, the same split (what hpctrain runs)
    pool    numba's kernel, the rows split by numba's own thread pool (parallel=True,
            its workqueue layer); GELU and LayerNorm only: the softmax runs inside
            attention's threads

The softmax kernels run as attention calls them: split over the batch, the forward on
each block's whole (b, H, T, T) scores, the backward on each 64-row query block and
the columns it sees.

``--step``: forward and backward of the benchmark GPT (no optimizer, as
``bench_step.py``) with NumPy's kernels, numba's GELU only, numba's LayerNorm only,
numba's softmax only, and all of numba's, one step of each in turn per round: the gain
of each kernel on its own.
The load average is printed before and after: figures taken under load say little.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import click

from hpctrain.runtime import keep_freed_memory, set_blas_threads


def _median_ms(times: list[float]) -> str:
    q = statistics.quantiles(times, n=4) if len(times) > 1 else times * 3
    return f"{1e3 * statistics.median(times):7.2f} ms  ({1e3 * q[0]:.2f}-{1e3 * q[2]:.2f})"


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _interleaved(cases: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each case once per round, in turn; a case returns its own time (its set-up is
    outside it)."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for case in cases.values():  # compile, page in
        case()
    for _ in range(rounds):
        for name, case in cases.items():
            times[name].append(case())
    return times


def _timed(fn: Callable[[], None], setup: Callable[[], None] | None = None
           ) -> Callable[[], float]:
    def case() -> float:
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return case


def kernel_cases(dtype, threads: int) -> dict[str, Callable[[], float]]:
    import numba
    import numpy as np

    from hpctrain.nn import attention, fused, kernels
    from hpctrain.nn.threads import over_rows

    # workqueue: numba's pool threads sleep between launches; OpenMP's (numba's default
    # layer when libgomp is found) spin after each and slowed the cases after them
    numba.config.THREADING_LAYER = "workqueue"
    numba.set_num_threads(threads)
    rng = np.random.default_rng(0)
    B, T, C, F, H = 8, 256, 384, 1536, 6
    N = B * T

    def array(*shape):
        return rng.standard_normal(shape).astype(dtype)

    # GELU on (N, F)
    x, dy = array(N, F), array(N, F)
    s, y, dx = np.empty_like(x), np.empty_like(x), np.empty_like(x)
    kernels.gelu_forward(x, s, y)
    # LayerNorm on (N, C)
    xc, dyc = array(N, C), array(N, C)
    w, b = 1 + 0.1 * array(C), 0.1 * array(C)
    xhat, yc, dxc = np.empty_like(xc), np.empty_like(xc), np.empty_like(xc)
    rstd = np.empty((N, 1), dtype)
    kernels.layernorm_forward(xc, xhat, rstd, yc, w, b, 1e-5)
    # softmax on (B, H, T, T)
    scores, dp = array(B, H, T, T), array(B, H, T, T)
    p, ds = np.empty_like(scores), np.empty_like(scores)
    blocks = attention._query_blocks(T)

    def softmax_backward(kernel):
        def run(ds, p):
            for i0, i1 in blocks:
                kernel(ds[..., i0:i1, :i1], p[..., i0:i1, :i1])
        return run

    def fresh_scores():
        np.copyto(p, scores)

    def fresh_dp():
        np.copyto(ds, dp)

    fresh_dp()
    fresh_scores()
    kernels.causal_softmax(p)
    p_done = p.copy()
    pool = _pool_kernels(numba, fused)
    np_softmax_backward = softmax_backward(kernels.softmax_backward)
    nb_softmax_backward = softmax_backward(fused.softmax_backward)
    return {
        "gelu forward, numpy": _timed(lambda: over_rows(kernels.gelu_forward, x, s, y)),
        "gelu forward, rows": _timed(lambda: over_rows(fused.gelu_forward, x, s, y)),
        "gelu forward, pool": _timed(lambda: pool["gelu_forward"](x, s, y, threads)),
        "gelu backward, numpy": _timed(lambda: over_rows(kernels.gelu_backward, x, s, dy, dx)),
        "gelu backward, rows": _timed(lambda: over_rows(fused.gelu_backward, x, s, dy, dx)),
        "gelu backward, pool": _timed(lambda: pool["gelu_backward"](x, s, dy, dx, threads)),
        "layernorm forward, numpy": _timed(lambda: over_rows(
            lambda *r: kernels.layernorm_forward(*r, w, b, 1e-5), xc, xhat, rstd, yc)),
        "layernorm forward, rows": _timed(lambda: over_rows(
            lambda *r: fused.layernorm_forward(*r, w, b, 1e-5), xc, xhat, rstd, yc)),
        "layernorm forward, pool": _timed(
            lambda: pool["layernorm_forward"](xc, xhat, rstd, yc, w, b, 1e-5, threads)),
        "layernorm backward, numpy": _timed(lambda: over_rows(
            lambda *r: kernels.layernorm_backward(*r, w), dyc, xhat, rstd, dxc)),
        "layernorm backward, rows": _timed(lambda: over_rows(
            lambda *r: fused.layernorm_backward(*r, w), dyc, xhat, rstd, dxc)),
        "layernorm backward, pool": _timed(
            lambda: pool["layernorm_backward"](dyc, xhat, rstd, dxc, w, threads)),
        "softmax forward, numpy": _timed(
            lambda: over_rows(kernels.causal_softmax, p), fresh_scores),
        "softmax forward, rows": _timed(lambda: over_rows(fused.causal_softmax, p),
                                        fresh_scores),
        "softmax backward, numpy": _timed(lambda: over_rows(np_softmax_backward, ds, p_done),
                                          fresh_dp),
        "softmax backward, rows": _timed(lambda: over_rows(nb_softmax_backward, ds, p_done),
                                         fresh_dp),
    }


def _pool_kernels(numba, fused) -> dict[str, Callable]:
    """The row kernels over numba's pool: ``n`` blocks of rows, one per prange step."""
    prange = numba.prange

    @numba.njit(parallel=True, nogil=True)
    def gelu_forward(x, s, y, n):
        rows = x.shape[0]
        for k in prange(n):
            i0, i1 = k * rows // n, (k + 1) * rows // n
            fused._gelu_forward_rows(x[i0:i1], s[i0:i1], y[i0:i1])

    @numba.njit(parallel=True, nogil=True)
    def gelu_backward(x, s, dy, dx, n):
        rows = x.shape[0]
        for k in prange(n):
            i0, i1 = k * rows // n, (k + 1) * rows // n
            fused._gelu_backward_rows(x[i0:i1], s[i0:i1], dy[i0:i1], dx[i0:i1])

    @numba.njit(parallel=True, nogil=True)
    def layernorm_forward(x, xhat, rstd, y, w, b, eps, n):
        rows = x.shape[0]
        for k in prange(n):
            i0, i1 = k * rows // n, (k + 1) * rows // n
            fused._layernorm_forward_rows(x[i0:i1], xhat[i0:i1], rstd[i0:i1], y[i0:i1],
                                          w, b, eps)

    @numba.njit(parallel=True, nogil=True)
    def layernorm_backward(dy, xhat, rstd, dx, w, n):
        rows = dy.shape[0]
        for k in prange(n):
            i0, i1 = k * rows // n, (k + 1) * rows // n
            fused._layernorm_backward_rows(dy[i0:i1], xhat[i0:i1], rstd[i0:i1], dx[i0:i1], w)

    return dict(gelu_forward=gelu_forward, gelu_backward=gelu_backward,
                layernorm_forward=layernorm_forward, layernorm_backward=layernorm_backward)


def step_cases(threads: int) -> dict[str, Callable[[], float]]:
    import numpy as np

    from hpctrain.bench import BENCH_CONFIG, layout_config
    from hpctrain.models.build import build_model
    from hpctrain.nn import fused, kernels

    cfg = layout_config("serial", data=BENCH_CONFIG["data"]["path"], steps=1, run_dir="unused")
    model = build_model(cfg.model, cfg.train.seed)
    rng = np.random.default_rng(0)
    shape = (cfg.train.batch_size, cfg.model.seq_len)
    x, y = (rng.integers(0, cfg.model.vocab_size, shape) for _ in range(2))
    numpy_k, fused_k = kernels.NUMPY_KERNELS, fused.KERNELS

    def only(*names: str) -> kernels.Kernels:
        return numpy_k._replace(**{name: getattr(fused_k, name) for name in names})

    sets = {
        "numpy": numpy_k,
        "gelu fused": only("gelu_forward", "gelu_backward"),
        "layernorm fused": only("layernorm_forward", "layernorm_backward"),
        "softmax fused": only("causal_softmax", "softmax_backward"),
        "all fused": fused_k,
    }

    def step_with(chosen: kernels.Kernels) -> Callable[[], float]:
        def step() -> float:
            kernels.set_kernels(chosen)
            model.zero_grad()
            t0 = time.perf_counter()
            _, cache = model.forward(x, y)
            model.backward(cache)
            return time.perf_counter() - t0
        return step

    return {name: step_with(k) for name, k in sets.items()}


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--step", is_flag=True, help="Time the serial step per kernel set instead.")
@click.option("--rounds", default=15, show_default=True, type=click.IntRange(min=1),
              help="Rounds; each runs every case once, in turn.")
@click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1),
              help="BLAS and element-wise threads (and numba's pool).")
@click.option("--dtype", default="float32", show_default=True,
              type=click.Choice(["float32", "float64"]), help="The kernels' dtype.")
def main(step: bool, rounds: int, threads: int, dtype: str) -> None:
    """Print the median time of each case (and its quartiles) over the rounds."""
    keep_freed_memory()
    set_blas_threads(threads)
    click.echo(f"load average before: {_loadavg()}")
    cases = step_cases(threads) if step else kernel_cases(dtype, threads)
    times = _interleaved(cases, rounds)
    for name, ts in times.items():
        click.echo(f"{name:28s} {_median_ms(ts)}")
    click.echo(f"load average after:  {_loadavg()}; {threads} thread(s), {rounds} rounds"
               + ("" if step else f", {dtype}"))


if __name__ == "__main__":
    main()
