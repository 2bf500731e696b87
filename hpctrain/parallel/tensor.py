"""Tensor parallelism (Megatron-style): conjugate communication pairs, sharded layers,
and the coordinator that swaps them into a full serial model following a plan.

The pairs, each an object with ``forward(x)`` and ``backward(dy)`` over the one
communicator it is given (``tp_comm``, the ranks that split one layer)::

    pair                            forward                 backward
    CopyToTensorRegion       (f)    identity                all-reduce
    ReduceFromTensorRegion   (g)    all-reduce              identity
    GatherFromSequenceRegion        all-gather along T      reduce-scatter along T
    ScatterToSequenceRegion         reduce-scatter along T  all-gather along T
    NoCommunication                 identity                identity

One block of the GPT on each of tp ranks (``r`` marks what is split over the ranks)::

    plain tensor parallelism: the residual stream x is replicated, (B, T, C)
      x -> ln1 -> f -> qkv (column, H/tp heads)_r -> attention_r -> proj (row)_r -> g -> +x
        -> ln2 -> f -> fc (column)_r -> gelu_r -> proj (row)_r -> g -> +x

    sequence parallelism: x is split along the sequence, (B, T/tp, C) per rank
      x_r -> ln1 -> AG -> qkv_r -> attention_r -> proj_r -> RS -> +x_r
          -> ln2 -> AG -> fc_r -> gelu_r -> proj_r -> RS -> +x_r

An all-reduce is a reduce-scatter plus an all-gather, so both move the same volume;
sequence parallelism just stops holding LayerNorm and the residual in full.

``apply_tensor_parallel`` is the coordinator: the model knows nothing of this; its
plan is data it declares (``Model.tensor_plan``, a ``TensorPlan`` kept next to the
model, e.g. ``hpctrain/models/gpt/tensor_parallel.py``), a tuple of ``(path pattern,
style)``; each style (the generic ``STYLES`` below, or the model's own) slices the full
weights of the module it replaces, so the sharded model equals the serial one
whatever tp is. Every parameter
becomes a ``ShardedParameter`` saying how it is split.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from hpctrain.config import ConfigError
from hpctrain.nn import Embedding, EmbeddingCache, Linear, LinearCache, Module, Parameter
from hpctrain.parallel.collectives import CountingComm, all_gather, all_reduce, reduce_scatter
from hpctrain.parallel.local import LocalEngine
from hpctrain.parallel.shards import ShardedParameter, grad_sq_sum_tp, shard_parameter

SEQ_AXIS = 1  # T in (B, T, C): the axis sequence parallelism splits

# ---------------------------------------------------------------------------------
# the conjugate pairs


class CopyToTensorRegion:
    """f: forward identity, backward all-reduce over ``comm``.

    Entry of a region whose ranks all read the same replicated ``x``: each computes
    its part of the output from it, so ``dL/dx`` is the sum of every rank's part.
    """

    def __init__(self, comm: Any):
        self.comm = comm

    def forward(self, x: np.ndarray) -> np.ndarray:
        return x

    def backward(self, dx: np.ndarray) -> np.ndarray:
        return all_reduce(dx, self.comm)


class ReduceFromTensorRegion:
    """g: forward all-reduce over ``comm``, backward identity.

    Exit of a region whose ranks each hold a partial sum of the output: the sum is
    replicated, so its gradient is already what every rank needs.
    """

    def __init__(self, comm: Any):
        self.comm = comm

    def forward(self, y: np.ndarray) -> np.ndarray:
        return all_reduce(y, self.comm)

    def backward(self, dy: np.ndarray) -> np.ndarray:
        return dy


class GatherFromSequenceRegion:
    """Forward all-gather along T, backward reduce-scatter along T, over ``comm``.

    ``(B, T/tp, C)`` per rank -> ``(B, T, C)`` replicated: the sequence-parallel f.
    """

    def __init__(self, comm: Any):
        self.comm = comm

    def forward(self, x: np.ndarray) -> np.ndarray:
        return all_gather(x, self.comm, SEQ_AXIS)

    def backward(self, dx: np.ndarray) -> np.ndarray:
        return reduce_scatter(dx, self.comm, SEQ_AXIS)


class ScatterToSequenceRegion:
    """Forward reduce-scatter along T, backward all-gather along T, over ``comm``.

    Partial sums ``(B, T, C)`` per rank -> this rank's ``(B, T/tp, C)`` of their sum:
    the sequence-parallel g.
    """

    def __init__(self, comm: Any):
        self.comm = comm

    def forward(self, y: np.ndarray) -> np.ndarray:
        return reduce_scatter(y, self.comm, SEQ_AXIS)

    def backward(self, dy: np.ndarray) -> np.ndarray:
        return all_gather(dy, self.comm, SEQ_AXIS)


class NoCommunication:
    """Identity both ways: a sharded layer inside a region whose boundary communicates."""

    def forward(self, x: np.ndarray) -> np.ndarray:
        return x

    def backward(self, dx: np.ndarray) -> np.ndarray:
        return dx


# ---------------------------------------------------------------------------------
# sharded layers


class ColumnParallelLinear(Linear):
    """``y_r = enter(x) @ W_r + b_r``: this rank's block of the output features.

    ``W = [W_0 | ... | W_{tp-1}]`` split by columns, ``W_r (in, out/tp)``, ``b_r
    (out/tp,)``; with ``blocks = 3`` each of [q | k | v] is split, so a rank holds the
    same heads of all three. The output stays split (it feeds a row-parallel layer).

        forward:  x' = enter.forward(x)           f: identity | SP: all-gather along T
                  y_r = x' W_r + b_r              no communication
        backward: dW_r += x'^T dy_r,  db_r += sum_N dy_r
                  dx = enter.backward(dy_r W_r^T)  f: all-reduce of the partial dx
                                                  | SP: reduce-scatter along T
    """

    def __init__(self, weight: ShardedParameter, bias: ShardedParameter | None, enter):
        # built from the full layer by from_serial: Linear.__init__ would draw new weights
        self.weight = weight
        self.bias = bias
        self.enter = enter

    @classmethod
    def from_serial(cls, linear: Linear, comm: Any, enter, blocks: int = 1):
        bias = None if linear.bias is None else shard_parameter(linear.bias, 0, comm, blocks)
        return cls(shard_parameter(linear.weight, 1, comm, blocks), bias, enter)

    def forward(self, x: np.ndarray, add_bias: bool = True) -> tuple[np.ndarray, LinearCache]:
        # x (..., in) -> y (..., out/tp); SP: x (B, T/tp, in) -> y (B, T, out/tp); the
        # bias is this rank's block, so a caller may add it (add_bias=False) as in serial
        return super().forward(self.enter.forward(x), add_bias)

    def backward(self, dy: np.ndarray, cache: LinearCache, need_dx: bool = True):
        dx = super().backward(dy, cache, need_dx)
        return None if dx is None else self.enter.backward(dx)


class RowParallelLinear(Linear):
    """``y = leave(x_r @ W_r + [r = 0] b)``: the sum over ranks of their partial products.

    ``W = [W_0; ...; W_{tp-1}]`` split by rows, ``W_r (in/tp, out)``; ``x_r`` is this
    rank's block of the input features (the output of a column-parallel layer). The
    bias ``b (out,)`` is replicated and enters the sum once, on tp rank 0, so the
    layer is right whoever reduces (itself, or the enclosing region).

        forward:  y = leave.forward(x_r W_r + [r = 0] b)   g: all-reduce
                                                           | SP: reduce-scatter along T
        backward: dy' = leave.backward(dy)                 g: identity | SP: all-gather
                  dW_r += x_r^T dy',  dx_r = dy' W_r^T     no communication
                  db += sum_N dy'                          the same on every rank
    ``dy'`` covers every token on every rank, so each rank holds the full gradient of
    the replicated bias without a further reduction.
    """

    def __init__(self, weight: ShardedParameter, bias: ShardedParameter | None, leave,
                 tp_rank: int):
        self.weight = weight
        self.bias = bias
        self.leave = leave
        self.adds_bias = tp_rank == 0

    @classmethod
    def from_serial(cls, linear: Linear, comm: Any, leave):
        bias = None if linear.bias is None else shard_parameter(linear.bias, None, comm)
        return cls(shard_parameter(linear.weight, 0, comm), bias, leave, comm.Get_rank())

    def forward(self, x: np.ndarray, add_bias: bool = True) -> tuple[np.ndarray, LinearCache]:
        # x (..., in/tp) -> y (..., out); SP: x (B, T, in/tp) -> y (B, T/tp, out). The
        # bias enters before the sum over ranks, so it cannot be left to the caller
        if not add_bias:
            raise ValueError("a row-parallel linear adds its bias before the sum over "
                             "ranks: add_bias must be True")
        y = x.reshape(-1, x.shape[-1]) @ self.weight.data  # (N, out), this rank's share
        if self.bias is not None and self.adds_bias:
            y += self.bias.data
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return self.leave.forward(y), LinearCache(x)

    def backward(self, dy: np.ndarray, cache: LinearCache, need_dx: bool = True):
        return super().backward(self.leave.backward(dy), cache, need_dx)


class VocabEmbeddingCache(NamedTuple):
    lookup: EmbeddingCache  # row indices into this rank's slice (0 where outside)
    outside: np.ndarray  # (...) bool, the tokens of other ranks' slices


class VocabParallelEmbedding(Embedding):
    """``y = leave(sum_r W_r[idx])``, rows ``[r V/tp, (r + 1) V/tp)`` of the table on rank r.

    forward:  each rank looks up the tokens of its slice and writes zero for the others;
              leave sums the parts (g: all-reduce | none when the caller reduce-scatters).
    backward: dy' = leave.backward(dy); dW_r[i] += dy' at the positions of token i, for
              this rank's tokens only. Integer input: nothing to return.
    """

    def __init__(self, weight: ShardedParameter, vocab_start: int, leave):
        self.weight = weight
        self.vocab_start = vocab_start
        self.leave = leave

    @classmethod
    def from_serial(cls, embedding: Embedding, comm: Any, leave):
        weight = shard_parameter(embedding.weight, 0, comm)
        return cls(weight, comm.Get_rank() * weight.shape[0], leave)

    def forward(self, idx: np.ndarray) -> tuple[np.ndarray, VocabEmbeddingCache]:
        # idx (...) int, global token ids -> y (..., dim)
        local = idx - self.vocab_start  # a fresh array
        outside = (local < 0) | (local >= self.weight.shape[0])
        local[outside] = 0
        y, lookup = super().forward(local)  # (..., dim), a fresh array
        y[outside] = 0
        return self.leave.forward(y), VocabEmbeddingCache(lookup, outside)

    def backward(self, dy: np.ndarray, cache: VocabEmbeddingCache) -> None:
        dy = self.leave.backward(dy).copy()  # (..., dim); a copy: dy may be shared
        dy[cache.outside] = 0  # other ranks' tokens add nothing to this slice
        return super().backward(dy, cache.lookup)


@contextmanager
def gradients_summed_over(comm: Any, params: list[Parameter]):
    """Within the block, ``params`` accumulate into fresh zero gradients; on exit these
    are summed over ``comm`` (one all-reduce, collective) and added to the real ones.

    For a replicated parameter that sees only this rank's part of the data (LayerNorm
    under sequence parallelism), so its gradient stays whole and the same everywhere.
    """
    if comm.Get_size() == 1:
        yield
        return
    kept = [p.grad for p in params]
    for p in params:
        p.grad = np.zeros_like(p.data)
    yield
    flat = all_reduce(np.concatenate([p.grad.reshape(-1) for p in params]), comm)
    start = 0
    for p, grad in zip(params, kept, strict=True):
        grad += flat[start:start + grad.size].reshape(grad.shape)
        start += grad.size
        p.grad = grad


def activation_nbytes(cache: Any) -> int:
    """Bytes of the floating-point arrays a forward cache keeps alive, each memory
    block counted once (views such as q, k, v of one qkv output share theirs)."""
    bases: dict[int, np.ndarray] = {}
    stack = [cache]
    while stack:
        item = stack.pop()
        if isinstance(item, np.ndarray):
            if np.issubdtype(item.dtype, np.floating):
                while isinstance(item.base, np.ndarray):
                    item = item.base
                bases[id(item)] = item
        elif isinstance(item, (tuple, list)):
            stack.extend(item)
    return sum(a.nbytes for a in bases.values())


# ---------------------------------------------------------------------------------
# the coordinator


@dataclass
class TensorParallelState:
    """What apply_tensor_parallel leaves on the model for its engine."""

    comm: CountingComm  # the tensor communicator, counting what the layers send
    sequence_parallel: bool
    plan: tuple[tuple[str, str], ...]
    metrics: Any = None  # the TensorPlan's metrics(model config, (b, T), tp) -> dict


def apply_tensor_parallel(model: Module, cfg: Any, tp_comm: Any) -> Module:
    """Shard the full serial ``model`` (built from the global seed) over ``tp_comm``.

    The model's ``tensor_plan`` gives the entries; for each ``(pattern, style)``, in
    order, every module the pattern names (``*`` matching any list index) is replaced
    by ``style(module, comm, model)`` (the model's styles, else ``STYLES``), which
    slices the full weights it holds; every parameter no style split is then marked
    replicated. Local work only: no collective. Returns the model.
    """
    tp = tp_comm.Get_size()
    if cfg.parallel.tp != tp:
        raise ValueError(f"tp ({cfg.parallel.tp}) must equal the size of the tensor "
                         f"communicator ({tp})")
    tensor_plan = model.tensor_plan(cfg.parallel.sequence_parallel)
    if tensor_plan is None:
        raise ConfigError(f"tensor parallelism splits the {_models_with_plans()} only "
                          f"(model kind is {cfg.model.kind!r})")
    tensor_plan.check(cfg.model, tp, cfg.parallel.sequence_parallel)
    comm = CountingComm(tp_comm)
    styles = {**STYLES, **tensor_plan.styles}
    for pattern, style in tensor_plan.entries:
        matches = find_modules(model, pattern)
        if not matches:
            raise ValueError(f"plan entry {pattern!r} names no module of the model")
        for parent, key, module in matches:
            replacement = styles[style](module, comm, model)
            if isinstance(parent, list):
                parent[key] = replacement
            else:
                setattr(parent, key, replacement)
    mark_replicated(model)
    model.tensor_parallel = TensorParallelState(comm, cfg.parallel.sequence_parallel,
                                                tensor_plan.entries, tensor_plan.metrics)
    return model


def _models_with_plans() -> str:
    """'GPT': the registered models that declare a tensor-parallel plan."""
    from hpctrain.models.registry import MODELS

    return " and ".join(cls.name for cls in MODELS.values() if cls.tensor_plan(False))


# the generic styles: module, tensor communicator, whole model -> sharded module
STYLES = {
    "vocab": lambda m, comm, model: VocabParallelEmbedding.from_serial(
        m, comm, ReduceFromTensorRegion(comm)),
    "vocab-local": lambda m, comm, model: VocabParallelEmbedding.from_serial(
        m, comm, NoCommunication()),
    "column-heads": lambda m, comm, model: ColumnParallelLinear.from_serial(
        m, comm, CopyToTensorRegion(comm), blocks=3),
    "column-heads-local": lambda m, comm, model: ColumnParallelLinear.from_serial(
        m, comm, NoCommunication(), blocks=3),
    "column": lambda m, comm, model: ColumnParallelLinear.from_serial(
        m, comm, CopyToTensorRegion(comm)),
    "column-gather": lambda m, comm, model: ColumnParallelLinear.from_serial(
        m, comm, GatherFromSequenceRegion(comm)),
    "row": lambda m, comm, model: RowParallelLinear.from_serial(
        m, comm, ReduceFromTensorRegion(comm)),
    "row-local": lambda m, comm, model: RowParallelLinear.from_serial(
        m, comm, NoCommunication()),
    "row-scatter": lambda m, comm, model: RowParallelLinear.from_serial(
        m, comm, ScatterToSequenceRegion(comm)),
}


def find_modules(root: Module, pattern: str) -> list[tuple[Any, Any, Any]]:
    """``(parent, key, module)`` for every module at dotted ``pattern`` ('blocks.*.mlp')."""
    found = [(None, None, root)]
    for part in pattern.split("."):
        step = []
        for _, _, obj in found:
            if isinstance(obj, list):
                keys = range(len(obj)) if part == "*" else [int(part)]
                step += [(obj, k, obj[k]) for k in keys]
            elif getattr(obj, part, None) is not None:
                step.append((obj, part, getattr(obj, part)))
        found = step
    return found


def mark_replicated(root: Module) -> None:
    """Replace every plain Parameter by a replicated ShardedParameter on the same data
    (a parameter shared by two modules stays shared)."""
    memo: dict[int, ShardedParameter] = {}
    stack = [root]
    while stack:
        module = stack.pop()
        for name, value in vars(module).items():
            if isinstance(value, Parameter) and not isinstance(value, ShardedParameter):
                if id(value) not in memo:
                    memo[id(value)] = ShardedParameter(value.data, None, value.shape)
                setattr(module, name, memo[id(value)])
            elif isinstance(value, Module):
                stack.append(value)
            elif isinstance(value, list):
                stack.extend(v for v in value if isinstance(v, Module))


class TensorParallelEngine(LocalEngine):
    """LocalEngine over a model sharded by ``apply_tensor_parallel``.

    Every rank of the tensor group runs the same microbatches; the layers communicate
    inside forward and backward. Adds the collective gradient norm and per-step
    metrics: ``tp_comm_bytes`` (sent per rank, ring model, see ``collectives``),
    ``tp_comm_calls``, ``activation_bytes`` (floats one microbatch's forward keeps
    for backward, on this rank) and, with sequence parallelism,
    ``sp_activation_bytes_saved`` against plain tensor parallelism.
    """

    def __init__(self, model: Module, cfg: Any, topo: Any):
        super().__init__(model, cfg.parallel.microbatches)
        self.tp = model.tensor_parallel
        self.model_cfg = cfg.model
        self.activation_bytes = 0
        self.microbatch_shape = (0, 0)

    def zero_grad(self) -> None:
        super().zero_grad()
        self.tp.comm.reset()  # a step starts here

    def forward_backward(self, x: np.ndarray, y: np.ndarray, scale: float = 1.0) -> float:
        self.microbatch_shape = (len(x) // self.microbatches, x.shape[1])
        return super().forward_backward(x, y, scale)

    def backward(self, cache: Any, dloss: float, *, last: bool) -> None:
        self.activation_bytes = activation_nbytes(cache)  # what this microbatch kept
        super().backward(cache, dloss, last=last)

    def grad_norm(self) -> float:
        """The norm of the whole model's gradient (collective over the tensor group)."""
        local = np.array([grad_sq_sum_tp(self.params, self.tp.comm.Get_rank())])
        return math.sqrt(float(all_reduce(local, self.tp.comm)[0]))

    def metrics(self) -> dict[str, float]:
        out = {"tp_comm_bytes": self.tp.comm.bytes_sent, "tp_comm_calls": self.tp.comm.calls,
               "activation_bytes": self.activation_bytes}
        if self.tp.metrics is not None:
            out |= self.tp.metrics(self.model_cfg, self.microbatch_shape,
                                   self.tp.comm.Get_size())
        return out
