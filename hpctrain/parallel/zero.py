"""ZeRO stages 1 and 2: the optimizer state, and then the gradients, sharded over ``dp_comm``.

Parameters and gradients use the bucket layout of ``data.py`` (backward order, cut at
parameter boundaries), each bucket padded to a multiple of ``dp`` so it splits into
``dp`` equal shards; rank ``r`` owns shard ``r`` of every bucket. dp = 2, 2 buckets::

    flat parameters | bucket 0: rank 0 | rank 1 | bucket 1: rank 0 | rank 1 |pad|
    optimizer state |           rank 0's m, v   and             rank 0's m, v      (rank 0)

Per step, collective over ``dp_comm``:

1. backward; each bucket is **reduce-scattered** as soon as it is final (non-blocking,
   launched from the engine's hook like the all-reduce of stage 0): rank r receives
   the sum of shard r. Stage 1 reduces in place (MPI puts the shard at the bucket's
   start); stage 2 into a persistent ``1/dp`` gradient shard and then drops the
   whole-gradient buffers. ``dp_reduce = "hierarchical"``: in three phases, reduce in
   the node, reduce-scatter among the node leaders, scatter in the node
   (``hierarchy.HierarchicalReduceScatter``), with the same result.
2. the global norm over the owned shards (collective over all ranks: each element
   of the model is owned once in its data group, and replicated copies are counted
   once in the model group, see ``counted_once``); clipping of the shards.
3. the serial optimizer (AdamW or SGD, the same update code) over the owned *pieces*:
   a piece is the part of one parameter inside this rank's shard, decayed when the
   parameter has ``ndim >= 2``.
4. **all-gather** of every parameter bucket in place: every rank has the whole
   updated parameters again.

Memory per rank (``expected_memory``), ``N`` parameters on this rank, ``N'`` with the
bucket padding, ``s`` bytes per element, ``K`` optimizer arrays per element (AdamW 2,
SGD 1), measured after the step::

    stage | parameters | gradients | optimizer state
      0   |   N  s     |   N  s    |   K N s
      1   |   N' s     |   N' s    |   K N'/dp s
      2   |   N' s     |   N'/dp s |   K N'/dp s

Stage 2's whole-gradient buffers still exist during backward (layers accumulate into
``param.grad`` over the microbatches); they are released once reduce-scattered, so the
optimizer step and the time between steps hold only the shard. After a ZeRO step
``param.grad`` is not the reduced gradient: the reduced shard is.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from hpctrain import trace
from hpctrain.nn.module import Parameter
from hpctrain.optim import clip
from hpctrain.parallel.data import POLL_INTERVAL, GradBuckets, state_nbytes


class ShardPiece(Parameter):
    """Elements ``[lo, hi)`` of one parameter, flattened: views into the flat parameter
    buffer and the reduced gradient shard, as the optimizer sees a Parameter."""

    __slots__ = ()

    def __init__(self, data: np.ndarray, grad: np.ndarray):  # no copy, no fresh grad
        self.data, self.grad = data, grad


def expected_memory(numel: int, padded: int, dp: int, stage: int, states: int,
                    itemsize: int) -> dict[str, int]:
    """The table of the module docstring, in bytes."""
    if stage == 0:
        return {"param_bytes": numel * itemsize, "grad_bytes": numel * itemsize,
                "optim_bytes": states * numel * itemsize}
    if padded % dp:
        raise ValueError(f"the padded size ({padded}) must be divisible by dp ({dp})")
    shard = padded // dp
    return {"param_bytes": padded * itemsize,
            "grad_bytes": (padded if stage == 1 else shard) * itemsize,
            "optim_bytes": states * shard * itemsize}


def counted_once(named_params: list, model_comm: Any, tp_size: int) -> list[bool]:
    """Whether this rank adds each parameter's squared gradient to the global norm.

    A parameter is known by its model-wide name. Replicated over the model group
    (``tp_split`` None, or the tied embedding a pipeline keeps on two stages), it is
    counted on the lowest model rank holding that name; split over tp, on the lowest
    model rank holding that name for each tp rank. Collective over ``model_comm``
    (one pickled allgather of the names, at construction).
    """
    names = [name for name, _ in named_params]
    everyone = model_comm.allgather(names) if model_comm.Get_size() > 1 else [names]
    first: dict[Any, int] = {}
    for rank, held in enumerate(everyone):  # model rank = pp_rank * tp + tp_rank
        for name in held:
            first.setdefault(name, rank)
            first.setdefault((name, rank % tp_size), rank)
    me = model_comm.Get_rank()
    return [first[(name, me % tp_size) if getattr(p, "tp_split", None) is not None
                  else name] == me for name, p in named_params]


class ZeroDataParallel:
    """ZeRO stage 1 or 2 over ``topo.dp_comm`` for ``engine``'s parameters.

    Same per-step interface as ``data.DataParallel``; ``make_optimizer(named, decay=)``
    builds the serial optimizer over this rank's pieces. ``reduce_scatter(view, out)``:
    how a bucket is reduce-scattered (default: one ``Ireduce_scatter_block`` over
    ``dp_comm``; ``hierarchy.hierarchical_reduce_scatter`` for nodes), with its shard
    into ``out``, or with ``out`` None at the start of ``view``.
    """

    def __init__(self, engine: Any, topo: Any, *, stage: int, bucket_mb: float,
                 make_optimizer, reduce_scatter=None):
        if stage not in (1, 2):
            raise ValueError(f"ZeRO stage ({stage}) must be 1 or 2")
        self.stage, self.engine = stage, engine
        self.dp_comm, self.world_comm = topo.dp_comm, topo.world_comm
        self.dp_size, self.dp_rank = self.dp_comm.Get_size(), self.dp_comm.Get_rank()
        self.reduce_scatter = reduce_scatter
        self.grads = GradBuckets(engine.params, self._launch, bucket_mb=bucket_mb,
                                 align=self.dp_size,
                                 poll_interval=POLL_INTERVAL if self.dp_size > 1 else 0.0)
        engine.on_grads_ready = self.grads.mark_ready
        dp = self.dp_size
        # every bucket: shard size, and where its shard lives in the dtype's shard buffer
        self.shard_start, ends = {}, {}
        for b in self.grads.buckets:
            self.shard_start[b.index] = ends.get(b.dtype, 0)
            ends[b.dtype] = self.shard_start[b.index] + b.size // dp
        self.grad_shard = {dt: np.zeros(n, dt) for dt, n in ends.items()} if stage == 2 else {}
        self.param_flat = self._flatten_params()
        counted = dict(zip(map(id, engine.params),
                           counted_once(engine.named_params, topo.model_comm, topo.tp_size),
                           strict=True))
        named, decay, self.norm_pieces = self._cut_pieces(engine.named_params, counted)
        self.pieces = [piece for _, piece in named]
        # a rank may own only padding (a model tiny next to dp): then it updates nothing
        self.optimizer = make_optimizer(named, decay=decay) if named else None
        self.gather_s = 0.0

    def _cut_pieces(self, named_params: list, counted: dict[int, bool]):
        """This rank's pieces: ``[(name[lo:hi], piece)]``, their decay flags, and the
        pieces the norm counts."""
        name_of = {id(p): name for name, p in named_params}
        named, decay, norm = [], [], []
        for b in self.grads.buckets:
            shard = b.size // self.dp_size
            own_lo = b.start + self.dp_rank * shard
            grads = self._owned_grads(b)
            for p, off in zip(b.params, b.offsets, strict=True):
                lo, hi = max(off, own_lo), min(off + p.size, own_lo + shard)
                if lo >= hi:
                    continue
                piece = ShardPiece(self.param_flat[b.dtype][lo:hi],
                                   grads[lo - own_lo:hi - own_lo])
                named.append((f"{name_of[id(p)]}[{lo - off}:{hi - off}]", piece))
                decay.append(p.ndim >= 2)
                if counted[id(p)]:
                    norm.append(piece)
        return named, decay, norm

    def _flatten_params(self) -> dict[np.dtype, np.ndarray]:
        """Move every ``p.data`` into a flat buffer with the gradients' layout."""
        flat = {dt: np.zeros(n, dt) for dt, n in self.grads.sizes.items()}
        for b in self.grads.buckets:
            for p, off in zip(b.params, b.offsets, strict=True):
                view = flat[b.dtype][off:off + p.size].reshape(p.shape)
                view[...] = p.data
                p.data = view
        return flat

    def _owned_grads(self, b) -> np.ndarray:
        """Where the reduced shard of bucket ``b`` lands (``shard`` elements)."""
        n = b.size // self.dp_size
        if self.stage == 2:
            return self.grad_shard[b.dtype][self.shard_start[b.index]:][:n]
        return self.grads.flat[b.dtype][b.start:b.start + n]  # in place: at the start

    def _launch(self, b, view: np.ndarray):
        """``launch`` for GradBuckets: the sum of this rank's shard of bucket ``b``."""
        if self.dp_size == 1:
            if self.stage == 2:
                self._owned_grads(b)[...] = view
            return None
        if self.reduce_scatter is not None:
            return self.reduce_scatter(view, None if self.stage == 1 else self._owned_grads(b))
        from mpi4py import MPI

        if self.stage == 1:
            return self.dp_comm.Ireduce_scatter_block(MPI.IN_PLACE, view, op=MPI.SUM)
        return self.dp_comm.Ireduce_scatter_block(view, self._owned_grads(b), op=MPI.SUM)

    # ---- the step -----------------------------------------------------------------

    def zero_grad(self) -> None:
        """Fresh zero gradient buffers, then the engine's own ``zero_grad``."""
        self.grads.zero()
        self.engine.zero_grad()

    def finish_grads(self) -> None:
        """Wait for every reduce-scatter; stage 2 then drops the whole gradients."""
        self.grads.wait()
        if self.stage == 2:
            self.grads.release()

    def grad_norm(self) -> float:
        """The global gradient norm from the owned shards (collective over all ranks)."""
        return shard_grad_norm(self.norm_pieces, self.world_comm)

    def clip(self, max_norm: float, norm: float) -> float:
        return clip.clip_grads(self.pieces, max_norm, norm)

    def step(self, lr: float) -> None:
        """Update the owned pieces, then all-gather every bucket of parameters."""
        if self.optimizer is not None:
            self.optimizer.step(lr)
        t0 = time.perf_counter()
        if self.dp_size > 1:
            from mpi4py import MPI

            with trace.span("zero_gather", "dp_comm"):
                requests = [self.dp_comm.Iallgather(MPI.IN_PLACE,
                                                    self.param_flat[b.dtype][b.start:b.stop])
                            for b in self.grads.buckets]
                MPI.Request.Waitall(requests)
        self.gather_s = time.perf_counter() - t0

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state."""
        return {"param_bytes": sum(f.nbytes for f in self.param_flat.values()),
                "grad_bytes": self.grads.nbytes() + sum(g.nbytes for g in
                                                        self.grad_shard.values()),
                "optim_bytes": state_nbytes(self.optimizer)}

    def metrics(self) -> dict[str, float]:
        """The bucket timings, the parameters' gather, and ``dp_bytes``: what this rank
        sent for the step's reduce-scatter and all-gather by the ring model, together
        what one all-reduce of the (padded) gradients sends (``data.DataParallel``'s)."""
        from hpctrain.parallel.averaging import ring_bytes

        return {**self.grads.take_times(), "zero_gather_s": self.gather_s,
                "dp_bytes": ring_bytes(self.grads.layout_nbytes(), self.dp_size)}


def shard_grad_norm(pieces: list, world_comm: Any) -> float:
    """The global gradient norm from each rank's owned shards (``pieces`` counted once
    over the job): their squares summed over every rank. Collective over
    ``world_comm``."""
    buf = np.array([clip.grad_sq_sum(pieces)])
    if world_comm.Get_size() > 1:
        from mpi4py import MPI

        with trace.span("grad_norm", "optimizer", comm="world_comm"):
            world_comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    return math.sqrt(buf[0])
