"""How a parameter is split over the tensor group: ``ShardedParameter`` and the
slicing maths, shared by tensor parallelism, the gradient norm and checkpoints.

A global array is split along one axis ``tp_split`` (or replicated, None). The axis
may be made of ``tp_blocks`` equal parts split separately: the qkv weight ``(C, 3C)``
is ``[q | k | v]``, and tp rank ``r`` of ``tp`` holds the same heads of all three::

    global columns   [ q_0 q_1 | k_0 k_1 | v_0 v_1 ]     (tp = 2, blocks = 3)
    rank 0 holds     [ q_0 | k_0 | v_0 ]
    rank 1 holds     [ q_1 | k_1 | v_1 ]

``take_shard`` cuts a rank's shard from the global array, ``join_shards`` puts every
rank's shards back together; both are pure, so they are tested without MPI.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpctrain.nn import Parameter
from hpctrain.optim.clip import grad_sq_sum


class ShardedParameter(Parameter):
    """A Parameter holding this rank's shard of a global array.

    ``tp_split``: the global axis split over the tensor group, or None (replicated:
    every rank holds the whole array and the same gradient). ``tp_blocks``: that axis
    is ``tp_blocks`` equal parts each split separately (3 for ``[q | k | v]``).
    ``global_shape``: the shape of the whole array (checkpoints, gradient norm).
    """

    __slots__ = ("tp_split", "tp_blocks", "global_shape")

    def __init__(self, data: np.ndarray, tp_split: int | None, global_shape: tuple[int, ...],
                 tp_blocks: int = 1):
        super().__init__(data)
        self.tp_split = tp_split
        self.tp_blocks = tp_blocks
        self.global_shape = tuple(global_shape)


def take_shard(full: np.ndarray, axis: int | None, rank: int, size: int,
               blocks: int = 1) -> np.ndarray:
    """Rank ``rank``'s shard of ``full`` (a copy): ``axis`` is cut into ``blocks`` equal
    parts, each part into ``size`` contiguous pieces, and the shard is piece ``rank``
    of every part, in order. ``axis`` None: the whole array."""
    if axis is None:
        return full.copy()
    n = full.shape[axis]
    if n % (blocks * size):
        raise ValueError(f"cannot split axis {axis} of shape {full.shape} into {blocks} "
                         f"part(s) of {size} shard(s): {blocks * size} must divide {n}")
    parts = np.split(full, blocks, axis=axis)
    return np.concatenate([np.split(part, size, axis=axis)[rank] for part in parts], axis=axis)


def join_shards(shards: list[np.ndarray], axis: int | None, blocks: int = 1) -> np.ndarray:
    """The full array from every rank's ``take_shard``, in rank order (the inverse)."""
    if axis is None:
        return shards[0]
    pieces = [np.split(s, blocks, axis=axis) for s in shards]  # [rank][block]
    return np.concatenate([pieces[r][b] for b in range(blocks) for r in range(len(shards))],
                          axis=axis)


def shard_parameter(p: Parameter, axis: int | None, comm: Any, blocks: int = 1):
    """This rank's ShardedParameter of the full serial ``p`` (gradient zero)."""
    data = take_shard(p.data, axis, comm.Get_rank(), comm.Get_size(), blocks)
    return ShardedParameter(data, axis, p.shape, blocks)


def grad_sq_sum_tp(params, tp_rank: int) -> float:
    """This rank's share of the squared gradient norm of the whole model: its split
    parameters, plus the replicated ones on tp rank 0 only (counted once). Summed over
    the tensor group (or the model group, with pipelining), it is the squared norm."""
    split = [p for p in params if getattr(p, "tp_split", None) is not None]
    replicated = [p for p in params if getattr(p, "tp_split", None) is None]
    return grad_sq_sum(split) + (grad_sq_sum(replicated) if tp_rank == 0 else 0.0)
