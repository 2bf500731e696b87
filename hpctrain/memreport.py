"""The memory report (``[train] memory_report``, ``hpctrain train --memory-report``):
each rank's measured peak by term, next to the planner's prediction for the layout.

Measured with ``tracemalloc``, which sees every NumPy array (NumPy reports its
allocations to it) and every Python object, from the start of ``train`` on. After each
step, with the step's caches freed::

    peak         tracemalloc's peak since the last step (then reset)
    params       the engine's parameter arrays (each base buffer once)
    grads        the gradients' base buffers (data parallelism's flat buckets)
    optimizer    arrays the optimizer holds (moments, ZeRO's shards, its scratch)
    buffers      arrays the data-parallel wrapper holds beyond those (communication
                 buffers: ZeRO-2's whole gradients, the flat parameter copy)
    other        what else is alive between steps (data loader, code, Python objects):
                 the traced current size minus the four above
    activations  peak - current: the caches alive at the peak and the transient
                 working set of a forward or backward (the planner's activations +
                 workspace)

and the process's peak resident size (``resource.getrusage``, which tracemalloc does
not see: the interpreter, libraries, MPI's shared memory). The prediction is
``plan.cost.predict_memory`` (``plan/memory.py``'s terms) with the run's recomputation.
Tracing costs time on every allocation (measured in ``benchmarks/README.md``), so it is
opt-in; the first step is recorded but not compared (the optimizer's state appears
in its update).
"""

from __future__ import annotations

import resource
import tracemalloc
from typing import Any

import numpy as np

from hpctrain.nn.module import ALIGN

TERMS = ("params", "grads", "optimizer", "buffers", "other", "activations")


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


class _Ledger:
    """Arrays counted once each, by their base buffer."""

    def __init__(self):
        self.seen: set[int] = set()

    def count(self, arrays) -> int:
        total = 0
        for a in arrays:
            root = _root(a)
            if id(root) not in self.seen:
                self.seen.add(id(root))
                total += a.nbytes if _aligned_carve(a, root) else root.nbytes
        return total


def _aligned_carve(a: np.ndarray, root: np.ndarray) -> bool:
    """Whether ``a`` is an array ``nn.module.aligned_empty`` made: its buffer is bytes,
    ``ALIGN`` longer than it. It counts as its own bytes: the padding is the
    allocator's, which the prediction (``plan.cost.predict_memory``) does not model."""
    return root.dtype == np.uint8 and root.ndim == 1 and root.nbytes == a.nbytes + ALIGN


def _arrays(obj: Any, depth: int = 4, seen: set | None = None):
    """Every ndarray reachable from ``obj``'s attributes, lists, tuples and dicts."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _arrays(v, depth - 1, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _arrays(v, depth - 1, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for v in vars(obj).values():
            yield from _arrays(v, depth - 1, seen)


def account(engine: Any, dp: Any) -> dict[str, int]:
    """Bytes of the persistent state by term (params, grads, optimizer, buffers)."""
    ledger = _Ledger()
    params = ledger.count(p.data for p in engine.params)
    grads = ledger.count(p.grad for p in engine.params if isinstance(p.grad, np.ndarray))
    optimizer = ledger.count(_arrays(getattr(dp, "optimizer", None),
                                     seen={id(engine)}))
    buffers = ledger.count(_arrays(dp, seen={id(engine), id(getattr(dp, "optimizer", 0))}))
    return {"params": params, "grads": grads, "optimizer": optimizer, "buffers": buffers}


def predicted(cfg: Any) -> list[dict[str, int]] | None:
    """The planner's terms for this config (the GPT only), per pipeline rank."""
    if cfg.model.kind != "gpt":
        return None
    from hpctrain.plan import cost

    # the default practice takes the config's [train] recompute
    return [m.terms() | {"total": m.total} for m in cost.predict_memory(cfg)]


class MemoryReport:
    """Started before the engine is built (so its arrays are traced); ``after_step``
    measures a step and, every ``log_interval`` steps and at the last, returns the
    record joining metrics.jsonl (collective: an allgather over the world)."""

    def __init__(self, cfg: Any, comm: Any):
        self.cfg, self.comm = cfg, comm
        self.step = 0  # the training step just taken (a resumed run starts past 0)
        self.taken = 0  # steps this process took
        self.last: list[dict] = []
        tracemalloc.start()

    def attach(self, engine: Any, dp: Any, topo: Any) -> None:
        self.engine, self.dp, self.pp_rank = engine, dp, topo.pp_rank

    def measure(self) -> dict[str, int]:
        current, peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        terms = account(self.engine, self.dp)
        terms["other"] = current - sum(terms.values())
        terms["activations"] = peak - current
        return terms | {"peak": peak, "rss_peak": resource.getrusage(
            resource.RUSAGE_SELF).ru_maxrss * 1024, "pp_rank": self.pp_rank}

    def after_step(self) -> dict[str, Any]:
        """Measure the step; report every ``log_interval`` training steps, at the last
        and at this process's second (its first after the allocations settle)."""
        self.step += 1
        self.taken += 1
        mine = self.measure()
        t = self.cfg.train
        if self.step % t.log_interval and self.taken != 2 and self.step != t.steps:
            return {}
        self.last = self.comm.allgather(mine)
        return {"memory_per_rank": self.last}

    def table(self) -> str:
        """Each rank's last measured peak by term against the prediction, MiB."""
        pred = predicted(self.cfg)
        mib = 2 ** 20
        head = "rank | " + " | ".join(TERMS) + " | peak | predicted | error | RSS peak"
        lines = ["memory per rank (MiB, tracemalloc; predicted: hpctrain.plan.memory)", head]
        for r, m in enumerate(self.last):
            p = pred[m["pp_rank"]]["total"] if pred else None
            err = f"{100 * (p / m['peak'] - 1):+.1f}%" if p else "-"
            cells = " | ".join(f"{m[k] / mib:.1f}" for k in TERMS)
            lines.append(f"{r:4d} | {cells} | {m['peak'] / mib:.1f} | "
                         f"{'-' if p is None else f'{p / mib:.1f}'} | {err} | "
                         f"{m['rss_peak'] / mib:.0f}")
        if self.cfg.train.recompute_pieces:
            lines.append("(the prediction recomputes every block: recompute_pieces is not "
                         "in the planner's model)")
        return "\n".join(lines)

    def stop(self) -> None:
        tracemalloc.stop()


def chain(first, second):
    """Two after_step hooks as one (either may be None); their records merged."""
    if first is None or second is None:
        return first or second
    return lambda: first() | second()
