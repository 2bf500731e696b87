"""What a model declares so the engine can run it at any layout.

A model is a ``Model`` (a ``Module``) whose class is registered under a kind in
``hpctrain.models.registry``. The engine (``hpctrain.parallel``) reads only what is
declared here; it never imports a model. Required, for serial and data parallelism:

    Model(cfg, seed)                 every parameter drawn from one rng(seed): the same
                                     weights on every rank, whatever the layout
    forward(x, targets)              -> (loss, cache), loss the mean over the batch
    backward(cache, dloss=1.0)       accumulates into each parameter's .grad
    name, data_format, config_keys   how messages call it; the dataset format it
                                     trains on; the [model] keys it reads (besides
                                     kind, dtype, init_std)
    check_config(m, par)             raise ConfigError naming the values (pure: runs on
                                     every rank before the first collective)
    model_flops(m, samples)          FLOPs of one training step over `samples` (MFU)

Optional, each one a layout or a feature (the defaults here decline it):

    sample_len(m)                    tokens per sample (T), or None: one item a sample
    piece_costs(m)                   Pieces of floats: the cost of each pipeline piece
    pipeline_pieces()                Pieces of modules: first(x) -> act; middle[i](act)
                                     -> act; last(act, targets) -> loss; each with
                                     forward -> (y, cache), backward(dy, cache) -> dx;
                                     a piece may take ``train`` in forward (evaluation
                                     unlike training: BatchNorm) and ``need_dx`` in
                                     backward (False: skip an input gradient nobody
                                     reads, returning None)
    activation_shape(m, x_shape)     the activation between pieces, for (b, T) input
    activation_shape_after(m, x_shape, j)
                                     the activation leaving middle piece j, when the
                                     boundaries differ (the CNN's); default the above
    tensor_plan(sequence_parallel)   TensorPlan: the tensor-parallel plan, as data
    backward_pieces()                [[Parameter]] each finished piece of backward, in
                                     order; backward(..., after_piece) calls
                                     after_piece() after each (overlapped all-reduce)
    eval_metrics(x, y)               {name: (sum, count)} beyond the loss (accuracy)
    eval_loss(x, targets)            the loss for evaluation (default: forward's); a
                                     model that trains and evaluates differently
                                     (BatchNorm's running statistics) overrides it
    share_batch(reduce)              reduce(a): the sum of a over the ranks sharing
                                     each batch (the data group, given when dp > 1;
                                     times the spatial group when sp > 1), for
                                     statistics of the whole batch (BatchNorm)
    spatial_axes(m)                  the axes of its activations (N, C, *S) that may be
                                     split in space (sp > 1 splits the first), or None
    check_spatial(m, sp)             raise ConfigError if sp slabs do not fit (a size
                                     sp does not divide, a slab thinner than a halo)
    split_space(space)               take a ``Space``: this rank's slab of each sample
    has_aux_heads(m)                 whether it declares auxiliary heads (below)
    aux_head(k, seed)                the auxiliary head reading the activation middle
                                     piece k outputs: forward(act, targets) -> (loss,
                                     cache), backward(dloss, cache) -> dact, like the
                                     last piece; weights from ``aux_rng(seed, k)``
    builds_by_piece                  True: ``Model(cfg, seed, on_piece=f)`` calls
                                     f(piece) on each pipeline piece, in order, as soon
                                     as it is built, before drawing the next; f may
                                     replace the arrays of the piece's parameters (ZeRO
                                     3 keeps its shard and drops the rest:
                                     ``parallel/zero3_build.py``), so the constructor
                                     never reads a piece's parameters after handing it
                                     over; the draws are those of ``Model(cfg, seed)``

Local-loss pipeline training (``hpctrain.parallel.local_loss``, ``[parallel]
pipeline_training = "local"``). Every stage but the last ends with an auxiliary head
and trains on its own cross-entropy; the last stage trains on the model's loss. The
head after middle piece k draws its weights from ``aux_rng(seed, k)``, a stream apart
from the model's: the model's weights are those of backprop training, and a head is
the same whatever the layout that uses it. Heads are parameters like any other
(``aux_heads.<k>.*`` in checkpoints).

Spatial parallelism (``hpctrain.parallel.spatial_engine``). The engine swaps every
convolution and pooling layer for its slab form and hands the model a ``Space``; the
model takes its slab of each input (``space.take``) and, where a layer needs the
whole sample (a classifier's head), gathers it (``space.gather`` forward,
``space.gather_backward`` in backward). Every sp rank runs the same samples; what
each returns is its *share*: forward's loss, ``eval_loss``, the sums of
``eval_metrics`` and every parameter gradient are summed over the spatial group by
the engine. A per-voxel loss's share is the sum over the slab divided by the
whole count; a value every rank computes whole (the classifier's loss after the
gather) is divided by ``space.size``, or counted on ``space.rank == 0`` only.

Stage balancing cuts only between middle pieces: the first piece rides with the first
chunk, the last with the last chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, TypeVar

import numpy as np

from hpctrain.nn import Module, Parameter

P = TypeVar("P")


def _whole(a: np.ndarray, *_: Any) -> np.ndarray:
    return a


AUX_STREAM = 0xA0C5  # aux_rng's second seed word: apart from every rng(seed) of a model


def aux_rng(seed: int, k: int) -> np.random.Generator:
    """The generator of the auxiliary head after middle piece ``k`` (local losses)."""
    return np.random.default_rng([seed, AUX_STREAM, k])


@dataclass(frozen=True)
class Space:
    """This rank's share of every sample's space: rows ``[rank n, (rank + 1) n)`` of
    axis ``axis`` of each activation (N, C, *S), ``n = L / size``. The default is the
    whole sample on one rank (serial, and every layout without sp).

    ``gather(a)``: the whole along ``axis`` from every rank's slab (an all-gather);
    ``gather_backward(da)``: its conjugate in backward, this rank's slab of the sum of
    every rank's ``da`` (a reduce-scatter): each rank's gradient of the whole is a
    share; ``sum(a)``: the sum of ``a`` over the group (a count of valid voxels).
    All three collective over the spatial group.
    """

    rank: int = 0
    size: int = 1
    axis: int = 2
    gather: Callable[[np.ndarray], np.ndarray] = _whole
    gather_backward: Callable[[np.ndarray], np.ndarray] = _whole
    sum: Callable[[np.ndarray], np.ndarray] = _whole  # all-reduce over the group

    def take(self, a: np.ndarray, axis: int | None = None) -> np.ndarray:
        """This rank's slab of ``a`` along ``axis`` (default: the split axis)."""
        if self.size == 1:
            return a
        axis = self.axis if axis is None else axis
        n = a.shape[axis] // self.size
        index = [slice(None)] * a.ndim
        index[axis] = slice(self.rank * n, (self.rank + 1) * n)
        return a[tuple(index)]


class Pieces(NamedTuple, Generic[P]):
    """A model cut for pipelining: ``first``, the ``middle`` pieces in order, ``last``.
    Of modules (``pipeline_pieces``) or of their costs (``piece_costs``)."""

    first: P
    middle: list[P]
    last: P


@dataclass(frozen=True)
class TensorPlan:
    """A tensor-parallel plan, kept next to its model.

    ``entries``: ``(path pattern, style)`` in the order applied (``*`` matches any list
    index); ``styles``: the model's own styles, style -> ``build(module, tp_comm,
    model)``, beside the generic ones of ``hpctrain.parallel.tensor.STYLES``;
    ``check(m, tp, sequence_parallel)``: raise ConfigError if tp does not divide what
    the plan splits; ``metrics(m, (b, T), tp)``: extra per-step figures.
    """

    entries: tuple[tuple[str, str], ...]
    styles: dict[str, Callable[[Any, Any, Any], Any]] = field(default_factory=dict)
    check: Callable[[Any, int, bool], None] = lambda m, tp, sequence_parallel: None
    metrics: Callable[[Any, tuple[int, int], int], dict] = lambda m, shape, tp: {}


class Model(Module):
    """The base of every registered model: the declarations above, and their defaults."""

    space: Space = Space()  # the whole of each sample, until split_space
    name: str = "model"
    # whether the model's own forward and backward run its pipeline pieces (the same
    # instances), so that wrappers put on the pieces (recompute, precision, ZeRO-3)
    # act at pp = 1 too; a model whose pieces serve only a pipeline says False
    runs_its_pieces: bool = True
    # whether Model(cfg, seed, on_piece=f) hands each pipeline piece to f as it is built
    builds_by_piece: bool = False
    # whether a rank may split its batch over threads (hpctrain.parallel.batch_threads):
    # forward's loss a mean over the rows, all of equal weight, and nothing changed by
    # forward or backward but the parameters' gradients
    splits_batch: bool = False
    # whether a sample's forward depends on the rest of the batch (BatchNorm's
    # statistics, summed by ``share_batch`` over the ranks sharing it in every forward
    # and backward): the ranks must then run the same number of passes a step
    batch_statistics: bool = False
    # whether its middle pipeline pieces hold attention layers (what recompute
    # "selective" and "attention" drop and recompute)
    has_attention: bool = False
    data_format: str = ""
    config_keys: tuple[str, ...] = ()

    @classmethod
    def check_config(cls, m: Any, par: Any) -> None:
        """Raise ConfigError for a value of ``m`` (ModelConfig) this model cannot take."""

    @classmethod
    def model_flops(cls, m: Any, samples: int) -> float:
        raise NotImplementedError(f"the {cls.name} does not declare its model FLOPs")

    @classmethod
    def sample_len(cls, m: Any) -> int | None:
        return None

    @classmethod
    def piece_costs(cls, m: Any) -> Pieces[float] | None:
        return None  # not cuttable: pp must be 1

    def pipeline_pieces(self) -> Pieces[Module]:
        raise NotImplementedError(f"the {self.name} declares no pipeline pieces")

    @classmethod
    def activation_shape(cls, m: Any, x_shape: tuple[int, ...]) -> tuple[int, ...]:
        raise NotImplementedError(f"the {cls.name} declares no pipeline activation")

    @classmethod
    def activation_shape_after(cls, m: Any, x_shape: tuple[int, ...],
                               j: int) -> tuple[int, ...]:
        return cls.activation_shape(m, x_shape)  # every boundary alike

    @classmethod
    def tensor_plan(cls, sequence_parallel: bool) -> TensorPlan | None:
        return None  # no tensor parallelism: tp must be 1

    def backward_pieces(self) -> list[list[Parameter]] | None:
        return None  # backward runs whole; the gradients are reduced after it

    def eval_metrics(self, x: np.ndarray, y: np.ndarray) -> dict[str, tuple[float, int]]:
        return {}

    def eval_loss(self, x: np.ndarray, targets: np.ndarray) -> float:
        return float(self.forward(x, targets)[0])

    def share_batch(self, reduce: Callable[[np.ndarray], np.ndarray]) -> None:
        """Nothing: each sample's loss depends on that sample only."""

    @classmethod
    def eval_weight(cls, y: np.ndarray) -> int:
        """How many terms a batch's ``eval_loss`` is the mean of (its rows): evaluation
        weighs each batch by it, so that a short last batch, or a rank holding fewer
        rows of it, counts for what it holds."""
        return len(y)

    @classmethod
    def spatial_axes(cls, m: Any) -> tuple[int, ...] | None:
        return None  # no spatial parallelism: sp must be 1

    @classmethod
    def check_spatial(cls, m: Any, sp: int) -> None:
        """Raise ConfigError if ``sp`` slabs do not fit the model's activations."""

    def split_space(self, space: Space) -> None:
        raise NotImplementedError(f"the {self.name} cannot be split in space")

    @classmethod
    def has_aux_heads(cls, m: Any) -> bool:
        return False  # no local losses: pipeline_training must be "backprop"

    def aux_head(self, k: int, seed: int) -> Module:
        raise NotImplementedError(f"the {self.name} declares no auxiliary heads")
