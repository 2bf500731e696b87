"""Spatial parallelism for a whole model: its window layers on slabs, its shares summed.

``apply_spatial(model, sp_comm)`` turns the full serial model (built from the global
seed, the same on every rank) into this rank's slab of it, a local rewrite with no
collective:

1. every convolution becomes a ``SpatialConv`` and every pooling layer a
   ``SpatialPool`` over ``sp_comm`` along the model's first split axis
   (``Model.spatial_axes``). Nearest upsampling by an integer factor, ReLU,
   BatchNorm and every other element-wise layer need no change: the slab of their
   output is their output on the slab. A transposed convolution has no slab form
   here and is refused;
2. the model is handed a ``Space`` (``Model.split_space``): its rank and size, and
   the conjugate pair ``gather`` (forward: all-gather of the slabs along the split
   axis) / ``gather_backward`` (backward: reduce-scatter, each rank's share of the
   gradient of the whole summed into the owner's slab), for a layer that needs the
   whole sample.

``SpatialEngine`` runs it: the same samples on every rank of the spatial group (the
loader hands them the same batch), each rank its slab. What the model returns is a
share (``hpctrain.models.protocol``), so after backward the engine sums the
gradients over ``sp_comm`` (one all-reduce of the packed gradients, before the data
group's reduction sees them) and sums the loss and the evaluation figures. The
spatial group then holds identical gradients, so the gradient norm, the optimizer,
ZeRO over the data group and checkpoints work as for a replicated model: a
checkpoint written at sp = 4 loads at sp = 1 and back.

BatchNorm sums its statistics over ``Topology.batch_comm`` (data x spatial group),
set by the coordinator (``engine.build_engine``) through ``Model.share_batch``.

Every spatial transfer (halos, their scatter-adds, gathers, the gradient and loss
sums) is traced in the ``halo`` category of the step breakdown.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpctrain import trace
from hpctrain.config import ConfigError
from hpctrain.models.protocol import Space
from hpctrain.nn import Module
from hpctrain.nn.conv import ConvNd, ConvTransposeNd
from hpctrain.nn.pool import _Pool
from hpctrain.parallel import collectives
from hpctrain.parallel.local import LocalEngine
from hpctrain.parallel.spatial import SpatialConv, SpatialPool, sum_gradients


def apply_spatial(model: Module, sp_comm: Any, axis: int | None = None) -> Module:
    """Put ``model``'s window layers on slabs of ``axis`` (default: the model's first
    declared split axis) over ``sp_comm`` and give it its ``Space``. Local work only:
    no collective. Returns the model."""
    axes = model.spatial_axes(model.cfg)
    if not axes:
        raise ConfigError(f"the {model.name} declares no spatial split: sp must be 1")
    axis = axes[0] if axis is None else axis
    splits = [(axis, sp_comm)]
    _swap_windows(model, splits)
    model.split_space(Space(sp_comm.Get_rank(), sp_comm.Get_size(), axis,
                            gather=lambda a: all_gather(a, axis, sp_comm),
                            gather_backward=lambda da: reduce_scatter(da, axis, sp_comm),
                            sum=lambda a: all_reduce(a, sp_comm)))
    return model


def _swap_windows(module: Module, splits: list) -> None:
    """Replace each ConvNd / pooling layer under ``module`` by its slab form, in place.
    The slab forms keep the layer's parameters under the layer's own names."""
    for name, value in list(vars(module).items()):
        items = value if isinstance(value, list) else [value]
        for i, child in enumerate(items):
            if not isinstance(child, Module):
                continue
            if isinstance(child, ConvTransposeNd):
                raise ConfigError(f"{type(child).__name__} ({name}) has no spatial form: "
                                  f"use Upsample and a convolution")
            if isinstance(child, ConvNd):
                swapped = SpatialConv(child, splits)
            elif isinstance(child, _Pool):
                swapped = SpatialPool(child, splits)
            else:
                _swap_windows(child, splits)
                continue
            if isinstance(value, list):
                value[i] = swapped
            else:
                setattr(module, name, swapped)


def all_gather(a: np.ndarray, axis: int, comm: Any) -> np.ndarray:
    """The whole array along ``axis`` from every rank's equal slab ``a`` (collective)."""
    with trace.span("spatial_all_gather", "halo", bytes=a.nbytes * comm.Get_size()):
        return collectives.all_gather(a, comm, axis)


def reduce_scatter(da: np.ndarray, axis: int, comm: Any) -> np.ndarray:
    """This rank's slab along ``axis`` of the sum over ranks of ``da`` (collective);
    the conjugate of ``all_gather``."""
    with trace.span("spatial_reduce_scatter", "halo", bytes=da.nbytes):
        return collectives.reduce_scatter(da, comm, axis)


def all_reduce(a: np.ndarray, comm: Any) -> np.ndarray:
    """The sum of ``a`` over ``comm`` (collective), into a copy of ``a``."""
    with trace.span("spatial_sum", "halo", bytes=a.nbytes):
        return collectives.all_reduce(np.array(a, copy=True), comm)


class SpatialEngine(LocalEngine):
    """The whole model's slab on this rank: ``LocalEngine`` plus the sums over the
    spatial group of the gradients, the loss and the evaluation figures (module
    docstring). Backward is not overlapped with the data group's reduction: the
    gradients are final only after the spatial sum."""

    def __init__(self, model: Any, microbatches: int, sp_comm: Any):
        super().__init__(model, microbatches)
        self.sp_comm = sp_comm
        self._final = None  # never report a piece early (LocalEngine.backward)

    def forward_backward(self, x: np.ndarray, y: np.ndarray, scale: float = 1.0) -> float:
        share = super().forward_backward(x, y, scale)
        sum_gradients(self.params, self.sp_comm)
        return self._sum(share)

    def loss(self, x: np.ndarray, y: np.ndarray) -> float:
        return self._sum(self.model.eval_loss(x, y))

    def eval_metrics(self, x: np.ndarray, y: np.ndarray) -> dict[str, tuple[float, int]]:
        shares = self.model.eval_metrics(x, y)
        sums = self._sum_array([v for pair in shares.values() for v in pair])
        return {name: (float(sums[2 * i]), float(sums[2 * i + 1]))
                for i, name in enumerate(shares)}

    def _sum(self, value: float) -> float:
        return float(self._sum_array([value])[0])

    def _sum_array(self, values: list[float]) -> np.ndarray:
        return all_reduce(np.array(values, dtype=np.float64), self.sp_comm)
