"""Data parallelism for a model with embedding tables replicated on every rank.

The dense parameters go through the bucketed all-reduce of ``data.py``. A table's
gradient is sparse (``SparseGrad``: the rows this rank's batch touched), and summing
it as a dense array would cost the whole table per step. The replicated lookup is a
conjugate pair over ``dp_comm``:

    forward    identity: every rank reads its own copy of the table
    backward   every rank's (rows, values) gathered (Allgather of the counts,
               Allgatherv of the rows and of the values, all tables in one buffer
               each) and summed per row (``coalesce``, in rank order)

so each rank ends with the rows of the global batch and their summed gradient: the
same floats on every rank (the same input in the same order), equal to the serial
gradient up to the order of the sums. Then the norm, clipping and both optimizers
(``optim.sparse.TablesAndDense``) run as in ``DataParallel``, identically on every
rank. Only ZeRO stage 0 and synchronous averaging: a model with tables refuses the
others in its ``check_config``.

Tables sharded over ranks (row-, column- or table-wise, ``[parallel] table_sharding``)
are ``tables.py``'s: ``make_sparse_data_parallel`` hands such a config to it, which
keeps this wrapper for the dense layers and the replicated tables.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from hpctrain import trace
from hpctrain.checkpoint.reshard import Sharding
from hpctrain.checkpoint.state import Held, optimizer_entries, param_sharding
from hpctrain.nn.module import coalesce, is_sparse
from hpctrain.optim import clip
from hpctrain.optim.optimizers import SGD, AdamW
from hpctrain.optim.sparse import TablesAndDense, make_sparse_optimizer
from hpctrain.parallel.data import POLL_INTERVAL, GradBuckets, allreduce_launcher


def has_tables(engine: Any) -> bool:
    """Whether the engine's model has parameters with sparse gradients."""
    return any(is_sparse(p) for p in engine.params)


def allgather_sparse(grads: list, comm: Any) -> None:
    """Replace each ``SparseGrad`` of ``grads`` by the sum of every rank's (collective
    over ``comm``; every rank passes the same tables, in the same order, each with
    any number of rows, none included)."""
    if comm.Get_size() == 1 or not grads:
        return
    dims = np.array([g.shape[1] for g in grads])
    mine = np.array([len(g.rows) for g in grads], np.int64)  # (tables,)
    counts = np.empty((comm.Get_size(), len(grads)), np.int64)
    comm.Allgather(mine, counts)  # (dp, tables) rows each rank holds per table
    rows = np.empty(int(counts.sum()), np.int64)
    comm.Allgatherv(np.concatenate([g.rows for g in grads]), [rows, counts.sum(axis=1)])
    sizes = counts * dims  # values per (rank, table)
    dtype = grads[0].values.dtype
    values = np.empty(int(sizes.sum()), dtype)
    comm.Allgatherv(np.concatenate([g.values.reshape(-1) for g in grads]).astype(dtype),
                    [values, sizes.sum(axis=1)])
    row_at = np.concatenate([[0], np.cumsum(counts.reshape(-1))]).reshape(-1)
    value_at = np.concatenate([[0], np.cumsum(sizes.reshape(-1))]).reshape(-1)
    n_tables = len(grads)
    for k, g in enumerate(grads):
        pieces = [r * n_tables + k for r in range(comm.Get_size())]  # rank order
        r = np.concatenate([rows[row_at[i]:row_at[i + 1]] for i in pieces])
        v = np.concatenate([values[value_at[i]:value_at[i + 1]] for i in pieces])
        g.rows, g.values = coalesce(r, v.reshape(-1, dims[k]).astype(g.dtype, copy=False))


class SparseDataParallel:
    """``DataParallel``'s interface (stage 0) for a model with replicated tables.

    Per step, collective over ``dp_comm``: ``zero_grad``, the engine's
    ``forward_backward(scale=1 / dp)``, ``finish_grads`` (the dense buckets, then the
    tables' exchange), ``grad_norm``, ``clip``, ``step``.
    """

    stage = 0

    def __init__(self, engine: Any, optimizer: TablesAndDense, dp_comm: Any, *,
                 bucket_mb: float, launch=None):
        self.engine, self.optimizer, self.dp_comm = engine, optimizer, dp_comm
        self.dp_size = dp_comm.Get_size()
        self.dense = [p for p in engine.params if not is_sparse(p)]
        self.tables = [p for p in engine.params if is_sparse(p)]
        self.grads = None
        if self.dense:
            self.grads = GradBuckets(self.dense, launch or allreduce_launcher(dp_comm),
                                     bucket_mb=bucket_mb,
                                     poll_interval=POLL_INTERVAL if self.dp_size > 1 else 0.0)
        self.table_rows = 0  # rows of the last step's gathered table gradients
        self.table_sync_s = 0.0  # seconds of the last step's gather of table gradients

    def zero_grad(self) -> None:
        if self.grads is not None:
            self.grads.zero()
        self.engine.zero_grad()

    def finish_grads(self) -> None:
        """Wait for the dense buckets, then sum the tables' rows over the data group."""
        if self.grads is not None:
            self.grads.wait()
        t0 = time.perf_counter()
        with trace.span("table_grads", "dp_comm", comm="dp_comm"):
            allgather_sparse([p.grad for p in self.tables], self.dp_comm)
        self.table_sync_s = time.perf_counter() - t0
        self.table_rows = sum(len(p.grad.rows) for p in self.tables)

    def grad_norm(self) -> float:
        return self.engine.grad_norm()

    def clip(self, max_norm: float, norm: float) -> float:
        return clip.clip_grads(self.engine.params, max_norm, norm)

    def step(self, lr: float) -> None:
        self.optimizer.step(lr)

    def memory(self) -> dict[str, int]:
        return {"param_bytes": sum(p.data.nbytes for p in self.engine.params),
                "grad_bytes": (0 if self.grads is None else self.grads.nbytes())
                + sum(p.grad.nbytes for p in self.tables),
                "optim_bytes": sum(a.nbytes for k, a in self.optimizer.state_arrays().items()
                                   if k != "t")}

    def metrics(self) -> dict[str, float]:
        times = {} if self.grads is None else self.grads.take_times()
        return {**times, "table_rows": self.table_rows}

    def held_tensors(self, engine: Any, tp_rank: int, tp_size: int) -> list[Held]:
        """The parameters and the dense optimizer's state as ``checkpoint.state`` holds
        them; the tables' optimizer state under its own shape (row-wise AdaGrad's
        accumulator is (rows,), not the table's shape)."""
        params = dict(engine.named_params)
        held = [Held(f"model/{name}", p.data, param_sharding(p, tp_rank, tp_size))
                for name, p in engine.named_params]
        tables = self.optimizer.sparse_keys()
        for state, name, _, array in optimizer_entries(self.optimizer, sliced=False):
            sharding = (Sharding(array.shape, None, 1, 0, 1, None)
                        if f"{state}.{name}" in tables
                        else param_sharding(params[name], tp_rank, tp_size))
            held.append(Held(f"optim/{state}/{name}", array, sharding))
        return held


def make_sparse_data_parallel(cfg: Any, engine: Any, topo: Any) -> SparseDataParallel:
    """The data-parallel wrapper and optimizers of a model with tables: the
    ``[train] optimizer`` for the dense parameters, ``sparse_optimizer`` for the tables
    (``hpctrain.optim.sparse``)."""
    t, par = cfg.train, cfg.parallel

    def make_dense(dense):
        if not dense:
            return None
        return (AdamW(dense, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                      weight_decay=t.weight_decay) if t.optimizer == "adamw"
                else SGD(dense, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay))

    launch = None
    if par.dp_reduce == "hierarchical":
        from hpctrain.parallel.hierarchy import hierarchical_launcher

        launch = hierarchical_launcher(topo)
    if getattr(topo, "table_comm", None) is not None:  # some table sharded
        from hpctrain.parallel.tables import make_sharded_data_parallel

        return make_sharded_data_parallel(cfg, engine, topo, make_dense, launch)
    dense = [(n, p) for n, p in engine.named_params if not is_sparse(p)]
    tables = [(n, p) for n, p in engine.named_params if is_sparse(p)]
    optimizer = TablesAndDense(make_dense(dense), make_sparse_optimizer(t, tables),
                               (t.sparse_lr or t.lr) / t.lr)
    return SparseDataParallel(engine, optimizer, topo.dp_comm, bucket_mb=par.bucket_mb,
                              launch=launch)
