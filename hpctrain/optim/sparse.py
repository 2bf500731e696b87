"""Optimizers for embedding tables: they update only the rows a step's gradient holds.

A table is a ``SparseParameter``; its ``.grad`` a ``SparseGrad`` (``rows`` (n,) unique,
``values`` (n, dim)). ``step(lr)`` reads, and writes, only those rows of the table and
of the state: its cost follows the batch, not the table. Both optimizers keep their
state as lists of arrays aligned with the tables (``StateLists``: ``state_arrays()``
for checkpoints, keys ``"<state>.<table name>"``) and a step counter ``t``.

Weight decay (``weight_decay``, 0 by default) is decoupled, as AdamW's, and lazy: only
the rows a step touches shrink, ``W[r] *= 1 - lr wd`` before their update, once per step
whatever the number of samples that read them (decaying every row every step would
touch the whole table; a row unseen for many steps keeps its value). A penalty scaled
by how often a row is read is the model's ``embed_l2`` instead.

Row-wise AdaGrad (``RowWiseAdaGrad``, torchrec's and FBGEMM's default for tables): one
accumulator value per row, the mean over the row of the squared gradient::

    for each row r of the gradient (g_r (dim,)):
        acc[r] += mean(g_r^2)
        W[r]   -= lr g_r / (sqrt(acc[r]) + eps)

Lazy Adam (``SparseAdam``, as ``torch.optim.SparseAdam`` and TensorFlow's LazyAdam):
moments per element, but a row's moments are updated, and the row moved, only at the
steps whose gradient holds that row. Between those steps its moments do not decay (dense
Adam would shrink them by b1 and b2 at every step and keep moving the row on its
momentum). The bias correction uses the global step count ``t``, as torch does::

    t += 1
    for each row r of the gradient:
        m[r] = b1 m[r] + (1 - b1) g_r;   v[r] = b2 v[r] + (1 - b2) g_r^2
        W[r] -= lr / (1 - b1^t) m[r] / (sqrt(v[r] / (1 - b2^t)) + eps)

A sharded engine hands each optimizer its own shard tables (``SparseParameter`` of
the shard's rows, with gradients in the shard's row numbers): the update is the same.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from hpctrain.nn.module import Parameter, is_sparse
from hpctrain.optim.optimizers import StateLists


def _written_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """Zeros written now: ``np.zeros`` maps untouched pages, and a step's scattered
    rows would then fault a page each in the step (about 4,000 a step on a large table)."""
    return np.full(shape, 0, dtype)


class SparseOptimizer(StateLists):
    """Shared plumbing: the tables, their names, the step loop over touched rows."""

    def __init__(self, named_params: Iterable[tuple[str, Parameter]], *, lr: float,
                 eps: float, weight_decay: float = 0.0):
        named = list(named_params)
        if not named:
            raise ValueError("the sparse optimizer got no tables")
        dense = [name for name, p in named if not is_sparse(p)]
        if dense:
            raise ValueError(f"{type(self).__name__} updates embedding tables (sparse "
                             f"gradients); {dense} have dense ones: give them to AdamW or SGD")
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.lr, self.eps, self.t = lr, eps, 0
        self.weight_decay = weight_decay

    def zero_grad(self) -> None:
        for p in self.params:
            p.zero_grad()

    def step(self, lr: float | None = None) -> None:
        """One update of the rows each table's gradient holds."""
        lr = self.lr if lr is None else float(lr)
        self.t += 1
        for k, p in enumerate(self.params):
            if len(p.grad.rows):
                if self.weight_decay:  # decoupled and lazy: the touched rows only
                    p.data[p.grad.rows] *= 1.0 - lr * self.weight_decay
                self._update(k, p.data, p.grad.rows, p.grad.values, lr)

    def _update(self, k: int, W: np.ndarray, rows: np.ndarray, g: np.ndarray,
                lr: float) -> None:
        raise NotImplementedError


class RowWiseAdaGrad(SparseOptimizer):
    """Row-wise AdaGrad (module docstring); state ``acc`` (rows,) per table."""

    _state_lists = ("acc",)

    def __init__(self, named_params, *, lr: float, eps: float = 1e-8,
                 weight_decay: float = 0.0):
        super().__init__(named_params, lr=lr, eps=eps, weight_decay=weight_decay)
        self.acc = [_written_zeros(p.shape[:1], p.data.dtype) for p in self.params]

    def _update(self, k, W, rows, g, lr):
        # rows (n,) unique, g (n, dim): only these rows of W and acc are read or written
        acc = self.acc[k][rows] + np.mean(g * g, axis=1)  # (n,)
        self.acc[k][rows] = acc
        W[rows] -= g * (lr / (np.sqrt(acc) + self.eps))[:, None]


class SparseAdam(SparseOptimizer):
    """Lazy Adam (module docstring); state ``m`` and ``v`` (rows, dim) per table."""

    _state_lists = ("m", "v")

    def __init__(self, named_params, *, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(named_params, lr=lr, eps=eps, weight_decay=weight_decay)
        self.beta1, self.beta2 = betas
        self.m = [_written_zeros(p.shape, p.data.dtype) for p in self.params]
        self.v = [_written_zeros(p.shape, p.data.dtype) for p in self.params]

    def _update(self, k, W, rows, g, lr):
        # rows (n,) unique, g (n, dim): only these rows of W, m and v are read or written
        b1, b2 = self.beta1, self.beta2
        m = b1 * self.m[k][rows] + (1.0 - b1) * g  # (n, dim)
        v = b2 * self.v[k][rows] + (1.0 - b2) * (g * g)
        self.m[k][rows], self.v[k][rows] = m, v
        step_size = lr / (1.0 - b1 ** self.t)
        denom = np.sqrt(v) * (1.0 / math.sqrt(1.0 - b2 ** self.t)) + self.eps
        W[rows] -= step_size * m / denom


def make_sparse_optimizer(t, named_params) -> SparseOptimizer:
    """``[train] sparse_optimizer`` over the tables ``named_params``: its lr is
    ``sparse_lr`` (or ``lr``), its weight decay ``sparse_weight_decay``, eps and betas
    the dense optimizer's."""
    lr, wd = t.sparse_lr or t.lr, t.sparse_weight_decay
    if t.sparse_optimizer == "adam":
        return SparseAdam(named_params, lr=lr, betas=(t.beta1, t.beta2), eps=t.eps,
                          weight_decay=wd)
    return RowWiseAdaGrad(named_params, lr=lr, eps=t.eps, weight_decay=wd)


class TablesAndDense(StateLists):
    """The dense optimizer (AdamW or SGD) and the tables' one, stepped together.

    ``step(lr)``: the dense parameters at ``lr`` (the schedule's), the tables at
    ``lr * sparse_scale`` (``sparse_lr / lr``: the same warm-up and decay). Its
    ``state_arrays`` are both optimizers' (their parameter names are distinct), ``t``
    their common step counter: a checkpoint saves and resumes them like one optimizer.
    """

    def __init__(self, dense, sparse: SparseOptimizer, sparse_scale: float = 1.0):
        self.dense, self.sparse, self.sparse_scale = dense, sparse, sparse_scale

    @property
    def t(self) -> int:
        return self.sparse.t

    @t.setter
    def t(self, value: int) -> None:
        self.sparse.t = int(value)
        if self.dense is not None:
            self.dense.t = int(value)

    def step(self, lr: float) -> None:
        if self.dense is not None:
            self.dense.step(lr)
        self.sparse.step(lr * self.sparse_scale)

    def state_arrays(self) -> dict[str, np.ndarray]:
        state = {} if self.dense is None else self.dense.state_arrays()
        return state | self.sparse.state_arrays()

    def sparse_keys(self) -> set[str]:
        """The keys of ``state_arrays`` that are the tables' state."""
        return set(self.sparse.state_arrays()) - {"t"}

    def load_state_arrays(self, state: dict[str, np.ndarray]) -> None:
        sparse = self.sparse_keys() | {"t"}
        self.sparse.load_state_arrays({k: v for k, v in state.items() if k in sparse})
        if self.dense is not None:
            self.dense.load_state_arrays({k: v for k, v in state.items()
                                          if k not in sparse or k == "t"})
