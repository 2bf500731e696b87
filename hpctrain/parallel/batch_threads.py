"""A rank's batch split over its threads: ``BatchThreadsEngine``.

A rank with ``k`` cores usually runs its model once over its whole microbatch and lets
BLAS split each product over ``k`` threads. On small models the products are small
(the benchmark GPT's attention products are 64 x 64 x 64 to 64 x 256 x 64): every one
is handed to the BLAS threads and waited for, and the element-wise passes between
them are handed off the same way. Here the microbatch's rows are split instead, as
data parallelism splits a batch over ranks, but inside the rank: ``k`` threads each run
the whole forward and backward on their rows, each on one BLAS thread, with no
hand-off until the gradients are summed::

    rows 0..b          thread 0 (the caller): model      forward, backward -> grads
       split  --->     thread 1:              replica 1  forward, backward -> grads 1
                       ...                                                       |
    model.grad += grads 1 + ... + grads k-1   <---------------------------------+

The replicas are the model's modules copied with their ``Parameter``s rebuilt around
the *same* ``data`` arrays (``replica``): one set of weights, which the optimizer
updates in place, and a gradient set per extra thread. Where a wrapper moves the
weights (ZeRO 1 and 2 into a flat buffer), each step points the replicas at them
again. NumPy's products and ufuncs and the numba kernels release the GIL, so the
threads run at once.

The maths: with the microbatch's ``b`` rows split into parts of ``b_i`` rows, the loss
is a mean over rows, ``L = sum_i (b_i / b) L_i``, so thread ``i`` runs backward with
``dloss * b_i / b`` and the gradients add. The same sums as one pass over the whole
rows, in another order: equal to the plain engine within float rounding, not bitwise
(``tests/test_batch_threads.py``). Results depend on ``k``, as they do on the BLAS
thread count; for a given ``k`` they are the same from run to run.

With an ``on_grads_ready`` hook (the overlapped data-parallel all-reduce) the last
microbatch's backward reports each piece when every thread has finished it: the
caller's thread waits for the others at each piece, adds their gradients of the
piece, and only then calls the hook, so the all-reduce sends the whole sum.

What may run so, checked by ``Config.validate`` (``refusal``; ``batch_threads = 0``
splits where it may and runs plain elsewhere): the model
declares ``splits_batch`` (its loss a mean over rows, no state but its gradients:
the GPT and the MLP), and the layout is ``LocalEngine``'s (no tp, pp, sp, ZeRO-3),
in fp32 precision without recomputation (their wrappers keep state of their own).
"""

from __future__ import annotations

import copy
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from hpctrain import trace
from hpctrain.nn import threads as nn_threads
from hpctrain.nn.module import Module, Parameter, _Unallocated
from hpctrain.parallel.local import LocalEngine

# the extra threads' work is not in the trace (its categories count the main thread)
_untraced = trace.NullTracer()


def replica(model: Module) -> Module:
    """A copy of ``model``'s modules whose Parameters share ``data`` with the model's
    and have gradients of their own. A Parameter reached twice (a tied weight) is one
    Parameter in the replica too; attributes other than Modules and Parameters (ints,
    read-only arrays) are shared."""
    memo: dict[int, Any] = {}

    def copy_of(value: Any) -> Any:
        if id(value) in memo:
            return memo[id(value)]
        if isinstance(value, Parameter):
            twin = copy.copy(value)  # the same data array, a gradient of its own
            twin._grad = _Unallocated(value.data.shape, value.data.dtype)
            twin._zero = False
        elif isinstance(value, Module):
            twin = copy.copy(value)
            memo[id(value)] = twin  # before the children: a module may be reached again
            for name, child in vars(value).items():
                setattr(twin, name, copy_of(child))
        elif isinstance(value, (list, tuple)) and any(
                isinstance(v, (Module, Parameter)) for v in value):
            twin = type(value)(copy_of(v) for v in value)
        else:
            return value
        memo[id(value)] = twin
        return twin

    return copy_of(model)


def refusal(m: Any, par: Any, t: Any) -> str | None:
    """Why ``[parallel] batch_threads`` cannot split this config's batch (the
    ``ModelConfig``, ``ParallelConfig`` and ``TrainConfig``), or None when it can."""
    from hpctrain.models.registry import model_class

    cls = model_class(m.kind)
    if not cls.splits_batch:
        return (f"the {cls.name} does not declare splits_batch (a loss that is a mean "
                f"over rows and no state but its gradients)")
    for name in ("tp", "sp", "pp"):
        if getattr(par, name) > 1:
            return f"it runs the whole model on a rank: {name} ({getattr(par, name)}) must be 1"
    if par.zero == 3:
        return "zero 3 gathers shards around the pieces: zero (3) must be below 3"
    if t.precision != "fp32":
        return f"precision ({t.precision!r}) keeps copies of its own: it must be 'fp32'"
    if t.recompute != "none":
        return f"recompute ({t.recompute!r}) wraps the pieces: it must be 'none'"
    return None


def threads_for(cfg: Any) -> int:
    """The threads a rank of validated ``cfg`` splits its batch over: ``batch_threads``;
    for 0, the rank's BLAS threads now set where the layout allows a split, else 1."""
    par = cfg.parallel
    if par.batch_threads:
        return par.batch_threads
    if refusal(cfg.model, par, cfg.train) is not None:
        return 1
    return nn_threads.blas_threads()


def split_rows(b: int, k: int) -> list[tuple[int, int]]:
    """[(r0, r1)] of at most ``k`` parts of ``b`` rows, as even as they come, none empty:
    ``split_rows(5, 2) == [(0, 3), (3, 5)]``."""
    n = min(k, b)
    edges = [b * i // n for i in range(n + 1)]
    return [(r0, r1) for r0, r1 in zip(edges, edges[1:], strict=False)]


class BatchThreadsEngine(LocalEngine):
    """``LocalEngine`` with each microbatch's rows split over ``threads`` threads (see
    the module docstring): the same interface, the same gradients within rounding."""

    def __init__(self, model: Any, microbatches: int, threads: int):
        if threads < 2:
            raise ValueError(f"threads ({threads}) must be at least 2 to split a batch")
        super().__init__(model, microbatches)
        self.threads = threads
        self.replicas = [replica(model) for _ in range(threads - 1)]
        params = [r.parameters() for r in self.replicas]
        for ps in params:
            if len(ps) != len(self.params):
                raise ValueError(f"a replica has {len(ps)} parameters, the model "
                                 f"{len(self.params)}")
        # the replicas' Parameters of each of the model's, by the model's identity
        self._twins = {id(p): [ps[i] for ps in params] for i, p in enumerate(self.params)}
        self._pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="hpctrain-batch")
        self._used = 0  # replicas that ran in the step: min(threads, rows) - 1
        self._summed: set[int] = set()  # parameters whose replica grads are added

    def zero_grad(self) -> None:
        super().zero_grad()
        for r in self.replicas:
            r.zero_grad()

    def forward_backward(self, x: np.ndarray, y: np.ndarray, scale: float = 1.0) -> float:
        """Accumulate gradients of ``scale * mean loss``; return the mean loss (unscaled).

        x, y: (b, ...) with b divisible by ``microbatches``.
        """
        self._share_weights()
        total = 0.0
        m = self.microbatches
        with nn_threads.single():  # one BLAS and element-wise thread per part
            for i, (xs, ys) in enumerate(zip(np.split(x, m), np.split(y, m), strict=True)):
                total += self._split(i, xs, ys, scale / m, last=i == m - 1) / m
            with trace.span("grad_sum", "compute"):
                self._sum_rest()
        return total

    def _split(self, mb: int, x: np.ndarray, y: np.ndarray, dloss: float, *,
               last: bool) -> float:
        """Forward and backward of microbatch ``mb``, its rows over the threads; its
        mean loss. With the hook set on the ``last`` microbatch, pieces are summed and
        reported as every thread finishes them."""
        b = len(x)
        parts = split_rows(b, self.threads)
        self._used = len(parts) - 1  # replicas that run (every microbatch: as many rows)
        hooked = last and self.on_grads_ready is not None and self._final is not None
        done = [threading.Semaphore(0) for _ in parts[1:]]
        failed: list[BaseException] = []

        def run(model: Any, rows: tuple[int, int], after_piece, traced: bool) -> float:
            r0, r1 = rows
            spans = trace if traced else _untraced
            with spans.span("F", "compute", mb=mb, chunk=0):
                loss, cache = model.forward(x[r0:r1], y[r0:r1])
            share = (r1 - r0) / b
            with spans.span("B", "compute", mb=mb, chunk=0):
                if hooked:
                    model.backward(cache, dloss=dloss * share, after_piece=after_piece)
                else:
                    model.backward(cache, dloss=dloss * share)
            return loss * share

        def worker(j: int) -> float:
            try:
                return run(self.replicas[j], parts[j + 1], done[j].release, False)
            except BaseException as e:
                failed.append(e)
                for sem in done:  # the caller waiting at a piece must not wait forever
                    sem.release(len(self._final or ()) + 1)
                raise

        futures = [self._pool.submit(worker, j) for j in range(self._used)]
        final = iter(self._final or ())

        def after_piece() -> None:  # the caller's thread, after each of its pieces
            for sem in done:
                sem.acquire()
            if failed:
                raise RuntimeError("a batch thread failed") from failed[0]
            piece = next(final)
            self._add_twins(piece)
            self.on_grads_ready(piece)

        self._summed = set()
        try:
            loss = run(self.model, parts[0], after_piece, True)
        finally:
            losses = [f.result() for f in futures]  # waits; re-raises a thread's error
        return loss + sum(losses)

    def _share_weights(self) -> None:
        """Point each replica Parameter at its model Parameter's ``data`` again: a
        wrapper may have moved the weights since (ZeRO 1 and 2 move them into a flat
        buffer after the engine is built)."""
        for p in self.params:
            for twin in self._twins[id(p)]:
                if twin.data is not p.data:
                    twin.data = p.data

    def _add_twins(self, params: list[Parameter]) -> None:
        """model.grad += the grad of each replica that ran, for ``params``."""
        for p in params:
            self._summed.add(id(p))
            for twin in self._twins[id(p)][:self._used]:
                p.grad += twin.grad

    def _sum_rest(self) -> None:
        """Add every replica gradient not yet added (all of them, without a hook),
        the parameters spread over the threads by size."""
        rest = [p for p in self.params if id(p) not in self._summed]
        if not rest:
            return
        shares: list[list[Parameter]] = [[] for _ in range(self.threads)]
        sizes = [0] * self.threads
        for p in sorted(rest, key=lambda p: -p.size):
            j = sizes.index(min(sizes))
            shares[j].append(p)
            sizes[j] += p.size
        futures = [self._pool.submit(self._add_twins, s) for s in shares[1:]]
        self._add_twins(shares[0])
        for f in futures:
            f.result()
