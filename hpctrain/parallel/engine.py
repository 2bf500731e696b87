"""The coordinator: turn a serial model into this rank's part of a parallel layout.

``build_engine(cfg, topo)`` is the one short place that decides how parallelism is
applied. The model itself (``hpctrain.models``) knows nothing of it, and this package imports
no model: it reads what the model declares (``hpctrain.models.protocol``):

1. build the full model the config's kind names (``hpctrain.models.registry``) from
   the global seed, identically on every rank, so the parameters are the same
   whatever the layout; under ZeRO 3 (tp = 1) each piece is sharded over the data
   group as soon as it is built, so the whole model is never held
   (``hpctrain.parallel.zero3_build``);
2. tensor parallelism (``tp > 1``) swaps sharded layers in, following the plan the
   model declares as data (``Model.tensor_plan``, ``hpctrain.parallel.tensor``);
3. pipeline parallelism (``pp > 1``) keeps only this rank's stage(s) of the model's
   pipeline pieces and runs a schedule of microbatches (``hpctrain.parallel.pipeline``),
   or, with ``pipeline_training = "local"``, trains each stage on its own auxiliary
   head's loss (``hpctrain.parallel.local_loss``);
4. spatial parallelism (``sp > 1``) puts the model's window layers on slabs of each
   sample and sums the ranks' shares (``hpctrain.parallel.spatial_engine``);
5. data parallelism is applied by the training loop around whatever engine results;
   here the model is only handed the sum over the ranks sharing a batch (data group
   times spatial group, ``Model.share_batch``) for statistics of the global batch
   (BatchNorm), when there is more than one.

An engine exposes what the training loop needs (``LocalEngine`` is the reference):

* ``named_params`` / ``params``: this rank's parameter shards;
* ``zero_grad()``;
* ``forward_backward(x, y, scale=1.0) -> float``: accumulate the gradients of
  ``scale * mean loss`` over the microbatches of this rank's batch; return the mean
  loss, the same value on every rank of the model replica;
* ``loss(x, y) -> float``: forward only (evaluation), same on every rank of the replica;
* ``eval_metrics(x, y) -> {name: (sum, count)}``: the model's figures beyond the loss
  (``Model.eval_metrics``; in a pipeline the last stage's, none with virtual stages);
* ``grad_norm() -> float``: the global gradient norm of the whole model replica,
  each replicated parameter counted once (collective over the model group);
* ``metrics() -> dict``: extra per-step figures for ``metrics.jsonl``;
* ``on_grads_ready``: None, or a callable the data-parallel wrapper sets
  (``hpctrain.parallel.data``). During the *last* microbatch's backward the engine may
  call it with parameters whose gradients are now final for the step, so their
  bucket's all-reduce starts while backward goes on; each parameter at most once.
  Calling it is an optimisation only: whatever is never reported is reduced after
  ``forward_backward`` returns. Gradients are accumulated into ``param.grad`` in place
  (the wrapper makes them views of its flat buffers).

Built under ZeRO 3 a piece at a time, an engine also carries ``zero3_units``: the
units its build sharded, which ``Zero3DataParallel`` takes over.
"""

from __future__ import annotations

from typing import Any

from hpctrain import precision
from hpctrain.models.build import build_model
from hpctrain.parallel import recompute
from hpctrain.parallel.batch_threads import BatchThreadsEngine, threads_for
from hpctrain.parallel.local import LocalEngine
from hpctrain.parallel.local_loss import LocalLossEngine
from hpctrain.parallel.pipeline import PipelineEngine
from hpctrain.parallel.spatial import batchnorm_reduce
from hpctrain.parallel.spatial_engine import SpatialEngine, apply_spatial
from hpctrain.parallel.tensor import TensorParallelEngine, apply_tensor_parallel

__all__ = ["LocalEngine", "build_engine"]

# [parallel] pipeline_training -> the engine of a pipeline stage
PIPELINE_ENGINES = {"backprop": PipelineEngine, "local": LocalLossEngine}


def build_engine(cfg: Any, topo: Any):
    """This rank's engine for a validated config and its topology."""
    units = None
    if cfg.parallel.zero == 3 and topo.tp_size == 1:  # tp slices whole layers after
        from hpctrain.parallel.zero3_build import build_sharded

        model, units = build_sharded(cfg, topo)
    else:
        model = build_model(cfg.model, cfg.train.seed)
    engine = _engine(model, cfg, topo)
    if units is not None:
        engine.zero3_units = units
    return engine


def _engine(model: Any, cfg: Any, topo: Any):
    """The engine of the layout around the built model."""
    if topo.batch_comm.Get_size() > 1:
        category = "halo" if topo.spatial else "dp_comm"
        model.share_batch(batchnorm_reduce(topo.batch_comm, category=category))
    if topo.spatial:
        return SpatialEngine(apply_spatial(model, topo.sp_comm), cfg.parallel.microbatches,
                             topo.sp_comm)
    if topo.tp_size > 1:
        model = apply_tensor_parallel(model, cfg, topo.tp_comm)
    # after tp (its layers' forwards are what is run again), before the stages are cut
    recompute.apply(model, cfg.train.recompute, cfg.train.recompute_pieces)
    # around recomputation's wrappers: the kept input is stored in the low dtype too
    precision.apply(model, cfg.train.precision)
    if topo.pp_size > 1:
        return PIPELINE_ENGINES[cfg.parallel.pipeline_training](model, cfg, topo)
    if topo.tp_size > 1:
        return TensorParallelEngine(model, cfg, topo)
    threads = threads_for(cfg)  # 1, or a layout that allows it (validated)
    if threads > 1:
        return BatchThreadsEngine(model, cfg.parallel.microbatches, threads)
    return LocalEngine(model, cfg.parallel.microbatches)
