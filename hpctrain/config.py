"""Typed configuration: four dataclasses, loaded from TOML, validated once.

A run is described by one TOML file with the sections ``[model]``, ``[parallel]``,
``[train]`` and ``[data]``, each mapping onto the dataclass of the same name below.
The CLI overrides a handful of fields (``--dp --tp --pp ...``); everything else
lives in the file so a run is reproducible from its saved config.

``Config.validate(world_size)`` is the single place where the rules live. It is pure
(no MPI), so every rank runs it before the first collective and all ranks fail with
the same message, e.g. ``tp (3) must divide n_head (8)``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

SCHEDULES = ("gpipe", "1f1b", "interleaved")
PIPELINE_TRAINING = ("backprop", "local")  # hpctrain.parallel.local_loss: "local"
DTYPES = ("float32", "float64")
OPTIMIZERS = ("adamw", "sgd")
SPARSE_OPTIMIZERS = ("rowwise_adagrad", "adam")  # embedding tables (hpctrain.optim.sparse)
POOLINGS = ("sum", "mean")
BALANCE = ("layers", "params")
DP_REDUCE = ("flat", "hierarchical")
AVERAGING = ("sync", "periodic", "post_local", "diloco", "hierarchical")
SHARES = ("equal", "fixed", "measured")
# the averaging hyperparameters and the strategies that read them: any other strategy
# refuses a value other than the default, which it would ignore
AVERAGING_USES = {
    "average_every": ("periodic", "post_local", "diloco", "hierarchical"),
    "sync_steps": ("post_local",),
    "outer_lr": ("diloco",),
    "outer_momentum": ("diloco",),
}
PRECISIONS = ("fp32", "bf16", "fp16")  # [train] precision (hpctrain.precision)
GRAD_COMM_DTYPES = ("fp32", "bf16")  # [parallel] grad_comm_dtype (parallel/bf16_reduce.py)


class ConfigError(ValueError):
    """A configuration value breaks a rule; the message names the values and the rule."""


# the [model] keys every model reads; the others belong to the model of `kind`, which
# lists them (`config_keys`, hpctrain.models.protocol)
COMMON_MODEL_KEYS = ("kind", "dtype", "init_std")


@dataclass(frozen=True)
class TableConfig:
    """One embedding table of a recommendation model: ids of feature ``name`` lie in
    [0, rows), ``width`` slots per sample (a bag when > 1), pooled by ``pooling``."""

    name: str
    rows: int
    width: int = 1
    pooling: str = "sum"  # "sum" or "mean" over a bag's filled slots


@dataclass(frozen=True)
class TableSharding:
    """How embedding table ``name`` is placed over the table group
    (``hpctrain.parallel.tables``): ``sharding`` "table" (whole, on one rank), "row"
    (contiguous blocks of rows), "column" (blocks of the embedding dimension) or
    "replicated" (on every rank); ``ranks``: the group ranks holding its shards, in
    order (empty: the least loaded rank for "table", every group rank otherwise)."""

    name: str
    sharding: str
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    kind: str = "gpt"  # a registered model (hpctrain.models.registry): "gpt", "mlp", "cnn"
    dtype: str = "float32"  # "float32" or "float64" (gradient checks, equivalence tests)
    init_std: float = 0.02
    # GPT
    vocab_size: int = 256  # byte-level tokens
    seq_len: int = 128  # T, the context length
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128  # C
    d_ff: int = 0  # MLP width inside a block; 0 means 4 * d_model
    tie_embeddings: bool = False  # share the token embedding with the output head
    # MLP and CNN classifiers
    input_dim: int = 784  # values per image (the CNN: a square, S * S)
    hidden: tuple[int, ...] = (256, 256)  # MLP: hidden layer widths
    n_classes: int = 10
    channels: tuple[int, ...] = (32, 64)  # CNN: widths of its stages (two 3x3 convs each)
    image_pad: int = 0  # CNN: zero pixels added on every side of each image
    # 3-D segmentation: the (D, H, W) of one training crop and of one evaluation tile
    crop: tuple[int, ...] = (32, 32, 32)
    # DLRM (recommendation): one table per sparse feature, in the data's column order
    # (a TOML array of inline tables {name, rows, width, pooling}), the embedding width,
    # the bottom MLP over the dense features (its last width is embed_dim), the top MLP
    # over the pairwise interactions, 1-wide bias tables of the named features, and the
    # initial output bias (the mean rating)
    tables: tuple[TableConfig, ...] = ()
    embed_dim: int = 16
    bottom_mlp: tuple[int, ...] = (32, 16)
    top_mlp: tuple[int, ...] = (64, 32)
    dense_features: tuple[str, ...] = ()
    bias_features: tuple[str, ...] = ()
    output_bias: float = 0.0
    # DLRM regularisation and evaluation: L2 on each sample's looked-up embeddings
    # (embed_l2) and biases (bias_l2), added to the loss; predictions clipped to
    # [rating_min, rating_max] in evaluation (equal: no clipping); fm_output adds the
    # sum of the pairwise dot products straight to the prediction (a factorisation machine)
    embed_l2: float = 0.0
    bias_l2: float = 0.0
    rating_min: float = 0.0
    rating_max: float = 0.0
    fm_output: bool = False

    @property
    def ffn_dim(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


@dataclass(frozen=True)
class ParallelConfig:
    dp: int = 0  # data-parallel size; 0 means world_size // (tp * pp)
    tp: int = 1  # tensor-parallel size (innermost: one node)
    # spatial-parallel size: each sample's activations split into sp slabs along its
    # first spatial axis (hpctrain.parallel.spatial); the innermost axis, like tp, so a
    # model uses one of the two
    sp: int = 1
    pp: int = 1  # pipeline stages
    microbatches: int = 1  # per optimizer step, per data-parallel rank
    schedule: str = "1f1b"  # "gpipe", "1f1b" or "interleaved"
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved only)
    # "backprop": end to end through the stages (schedule); "local": each stage trains
    # on its own auxiliary head's loss, activations go forward only (parallel/local_loss.py)
    pipeline_training: str = "backprop"
    balance: str = "layers"  # split stages by "layers" or by "params"
    sequence_parallel: bool = False
    zero: int = 0  # 0: plain data parallel, 1: shard optimizer state, 2: and gradients,
    # 3: and parameters, gathered a pipeline piece at a time (hpctrain/parallel/zero3.py)
    # ZeRO-3: free a piece's gathered parameters after its forward (gather again for
    # backward); False keeps them until the backward (less communication, more memory)
    reshard_after_forward: bool = True
    bucket_mb: float = 4.0  # gradient all-reduce bucket size, MiB
    # "flat": one all-reduce (ZeRO: reduce-scatter) over the data group; "hierarchical":
    # reduce in each node, all-reduce (reduce-scatter) among one leader per node,
    # broadcast (scatter) in the node
    dp_reduce: str = "flat"
    # the data-parallel gradient sum on the wire: "fp32" (the gradients' dtype) or "bf16"
    # (rounded to bfloat16, summed in float32: half the bytes; parallel/bf16_reduce.py)
    grad_comm_dtype: str = "fp32"
    # how the data-parallel replicas meet (hpctrain.parallel.averaging): "sync" (all-reduce
    # every gradient every step), "periodic" (average the parameters every
    # average_every steps), "post_local" (sync for sync_steps, then periodic), "diloco"
    # (an outer Nesterov step on the averaged change every average_every steps, outer_lr
    # and outer_momentum), "hierarchical" (sync inside each node, periodic across nodes)
    averaging: str = "sync"
    average_every: int = 1  # H, steps between meetings
    sync_steps: int = 0  # S, post_local's synchronous steps first
    outer_lr: float = 0.7  # DiLoCo's outer learning rate
    outer_momentum: float = 0.9  # DiLoCo's outer Nesterov momentum
    # each data-parallel rank's share of the global batch (hpctrain.parallel.shares):
    # "equal", "fixed" (batch_shares, samples per dp rank) or "measured" (proportional
    # to each rank's measured speed, re-measured every remeasure_every steps); with
    # averaging "periodic", throughput-weighted local SGD (hpctrain.parallel.weighted)
    shares: str = "equal"
    batch_shares: tuple[int, ...] = ()
    remeasure_every: int = 50
    # embedding tables (hpctrain.parallel.tables): sharded over groups of table_group
    # data-parallel ranks (0: all of them), the groups replicated; per table
    # (table_sharding: {name = "row", ...} or [{name, sharding, ranks}]) or table_default
    # "table", "row", "column" or "replicated"; hpctrain train --table-plan FILE sets all
    table_group: int = 0
    table_default: str = "replicated"
    table_sharding: tuple[TableSharding, ...] = ()
    # threads that split each microbatch's rows inside a rank, each on one BLAS thread
    # (hpctrain.parallel.batch_threads): 1, the whole microbatch at once with BLAS
    # splitting each product; 0, as many as the rank's BLAS threads where the layout
    # allows it, else 1; n, n threads (a layout that cannot is refused)
    batch_threads: int = 1

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.sp * self.pp

    @property
    def inner(self) -> int:
        """The size of the grid's innermost axis: tensor or spatial parallelism."""
        return self.tp * self.sp


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    batch_size: int = 32  # global batch, in sequences (GPT) or samples (MLP)
    optimizer: str = "adamw"
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.9  # SGD only
    # embedding tables' optimizer (hpctrain.optim.sparse): "rowwise_adagrad" or "adam"
    # (lazy), at sparse_lr times the schedule's factor (0: the dense lr); dense AdamW or
    # SGD (optimizer) for the rest
    sparse_optimizer: str = "rowwise_adagrad"
    sparse_lr: float = 0.0
    sparse_weight_decay: float = 0.0  # decoupled, on the rows a step touches
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    seed: int = 1234
    eval_interval: int = 50  # steps between validation passes; 0 disables
    eval_batches: int = 8  # batches a validation pass; 0: the whole split (ratings, volumes)
    log_interval: int = 10
    run_dir: str = "runs/default"
    save_interval: int = 0  # steps between checkpoints (and at the last step); 0: none
    keep_checkpoints: int = 3  # the newest complete checkpoints kept in run_dir/checkpoints
    blas_threads: int = 0  # per rank; 0 means cores // ranks on this node
    row_threads: int = 0  # element-wise threads per rank (hpctrain.nn.threads); 0: as BLAS
    max_skipped_steps: int = 5  # consecutive non-finite steps skipped before the run stops
    # seconds a step, a start-up phase or the work between may take before the job is
    # aborted; 0: off
    stall_timeout: float = 300.0
    async_save: bool = False  # write checkpoints from a background thread while training
    # checkpoint data: "files" (one per rank), "mpio" (one shared file through MPI-IO:
    # h5py built with MPI), "auto" (mpio when h5py has MPI and the job several ranks)
    checkpoint_io: str = "auto"
    # how a resume reads checkpoint data that data-parallel replicas hold alike: "each"
    # (every rank reads all it holds) or "shared" (each replica reads 1/n of it, the
    # replicas exchange the rest over MPI: n times fewer bytes from the file system)
    checkpoint_read: str = "each"
    # activation recomputation (hpctrain.parallel.recompute): "none", "full" (keep each
    # piece's input, run its forward again in backward), "selective" (attention's
    # probabilities and their weighted sum) or "attention" (selective, and q, k, v from
    # qkv's input); of the pipeline pieces named ("first", "middle.K", "middle",
    # "last"), or every middle piece when empty
    recompute: str = "none"
    recompute_pieces: tuple[str, ...] = ()
    # memory report (hpctrain.memreport): trace allocations, record each rank's peak by
    # term next to the planner's prediction (tracing slows a step: opt-in)
    memory_report: bool = False
    # where parameters and activations rest (hpctrain.precision): "fp32" (the model's
    # dtype), "bf16" or "fp16" (float32 arithmetic and master weights); loss_scale: fp16's
    # (0: dynamic, from 2^16, halved on overflow, doubled after 1000 finite steps)
    precision: str = "fp32"
    loss_scale: float = 0.0


@dataclass(frozen=True)
class DataConfig:
    path: str = "data/shakespeare.h5"  # a dataset file, or a partition manifest
    prefetch: bool = False  # read the next batch on a background thread
    eval_split: str = "val"  # split for validation: "val" (token streams) or "test"
    fold: int = 0  # ratings: the validation fold (training reads the other folds)


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def validate(self, world_size: int) -> Config:
        """Check every rule against ``world_size``; return the config with ``dp`` resolved."""
        _check_finite(self)
        # model rules first: they hold whatever the world size, so `--tp 3` on an
        # 8-head model says so even when the rank count is wrong too
        _check_model(self.model, self.parallel)
        par = _resolve_dp(self.parallel, world_size)
        _check_parallel(par, world_size)
        if par.table_sharding or par.table_default != "replicated" or par.table_group:
            from hpctrain.parallel.tables import check_sharding  # imports this module

            check_sharding(self.model, par)
        _check_train(self.train, par)
        _check_eval(self.model, self.train)
        _check_fold(self.model, self.data)
        _check_recompute(self.model, par, self.train)
        _check_precision(self.model, par, self.train)
        _check_batch_threads(self.model, par, self.train)
        return replace(self, parallel=par)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {
            f.name: {k: (list(v) if isinstance(v, tuple) else v)
                     for k, v in dataclasses.asdict(getattr(self, f.name)).items()}
            for f in fields(self)
        }


# ---------------------------------------------------------------------------------
# validation: each rule says what the values are and what they must satisfy


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _require_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    _require(value in choices, f"{name} ({value!r}) must be one of {', '.join(choices)}")


def _check_finite(cfg: Config) -> None:
    """Every float field of every section is a finite number: inf passes range rules
    such as ``lr > 0`` and nan reaches none, and either shows only steps later, as NaN
    parameters. The range rules of each field follow in its section's checks."""
    for section in fields(cfg):
        part = getattr(cfg, section.name)
        for f in fields(part):
            value = getattr(part, f.name)
            if f.type == "float":
                _require(math.isfinite(value), f"{f.name} ({value}) must be a finite number")


def _inner(par: ParallelConfig) -> tuple[str, int]:
    """The name and size of the grid's innermost axis, as messages call it."""
    return ("sp", par.sp) if par.sp > 1 else ("tp", par.tp)


def _resolve_dp(par: ParallelConfig, world_size: int) -> ParallelConfig:
    mp = par.model_parallel_size
    if par.dp == 0:
        name, size = _inner(par)
        _require(world_size % mp == 0,
                 f"{name} * pp ({size} * {par.pp} = {mp}) must divide the number of "
                 f"ranks ({world_size}) to infer dp")
        return replace(par, dp=world_size // mp)
    return par


def _check_parallel(par: ParallelConfig, world_size: int) -> None:
    _require(par.dp >= 1, f"dp ({par.dp}) must be at least 1")
    total = par.dp * par.model_parallel_size
    name, size = _inner(par)
    _require(total == world_size,
             f"dp * {name} * pp ({par.dp} * {size} * {par.pp} = {total}) must equal "
             f"the number of ranks ({world_size})")
    _require(par.microbatches >= 1, f"microbatches ({par.microbatches}) must be at least 1")
    _require_choice("schedule", par.schedule, SCHEDULES)
    _require(par.virtual_stages >= 1,
             f"virtual_stages ({par.virtual_stages}) must be at least 1")
    if par.schedule == "interleaved":
        _require(par.pp > 1, "the interleaved schedule needs pp > 1 (pp is 1)")
        _require(par.microbatches % par.pp == 0,
                 f"the interleaved schedule needs microbatches ({par.microbatches}) "
                 f"divisible by pp ({par.pp})")
    else:
        _require(par.virtual_stages == 1,
                 f"virtual_stages ({par.virtual_stages}) > 1 needs schedule 'interleaved' "
                 f"(schedule is {par.schedule!r})")
    _require_choice("balance", par.balance, BALANCE)
    _require(par.zero in (0, 1, 2, 3), f"zero ({par.zero}) must be 0, 1, 2 or 3")
    _check_zero3(par)
    _require(par.bucket_mb > 0, f"bucket_mb ({par.bucket_mb}) must be positive")
    _require_choice("dp_reduce", par.dp_reduce, DP_REDUCE)
    _check_averaging(par)


def _check_zero3(par: ParallelConfig) -> None:
    """ZeRO-3 gathers parameters around the pieces of the local, tensor-parallel and
    pipeline engines (``parallel/zero3.py``); the others cannot use it."""
    _require(par.zero == 3 or par.reshard_after_forward,
             f"reshard_after_forward false keeps ZeRO-3's gathered parameters from the "
             f"forward to the backward: it needs zero 3 (zero is {par.zero})")
    if par.zero != 3:
        return
    _require(par.sp == 1, f"zero 3 gathers parameters around pipeline pieces, and spatial "
                          f"parallelism runs the model whole: sp ({par.sp}) must be 1")
    _require(par.pipeline_training == "backprop",
             f"zero 3 needs pipeline_training 'backprop' (it is "
             f"{par.pipeline_training!r}: each stage's own heads are not pieces)")


def _check_averaging(par: ParallelConfig) -> None:
    _require_choice("averaging", par.averaging, AVERAGING)
    _require(par.average_every >= 1, f"average_every ({par.average_every}) must be at least 1")
    _require(par.sync_steps >= 0, f"sync_steps ({par.sync_steps}) must not be negative")
    _require(par.outer_lr > 0, f"outer_lr ({par.outer_lr}) must be positive")
    _require(0 <= par.outer_momentum < 1,
             f"outer_momentum ({par.outer_momentum}) must be in [0, 1)")
    for name, users in AVERAGING_USES.items():
        _require_used(par, name, "averaging", users)
    local = par.averaging != "sync"
    _require(not local or par.zero == 0,
             f"averaging {par.averaging!r} keeps a whole optimizer on every data-parallel "
             f"rank: zero ({par.zero}) must be 0")
    _require_choice("shares", par.shares, SHARES)
    _require(par.remeasure_every >= 1,
             f"remeasure_every ({par.remeasure_every}) must be at least 1")
    _require_used(par, "remeasure_every", "shares", ("measured",))
    _require(par.shares == "equal" or par.averaging in ("sync", "periodic"),
             f"shares {par.shares!r} needs averaging 'sync', or 'periodic' (throughput-"
             f"weighted local SGD); averaging is {par.averaging!r}")
    _require(par.shares == "equal" or par.averaging != "periodic" or par.pp == 1,
             f"throughput-weighted local SGD (shares {par.shares!r}, averaging 'periodic') "
             f"runs without pipelining: pp ({par.pp}) must be 1")
    _require(par.shares == "equal" or par.zero == 0,
             f"shares {par.shares!r} needs zero 0 (zero is {par.zero})")
    _require((par.shares == "fixed") == bool(par.batch_shares),
             f"batch_shares ({list(par.batch_shares)}) go with shares 'fixed' and only "
             f"with it (shares is {par.shares!r})")


def _require_used(par: ParallelConfig, name: str, option: str, users: tuple[str, ...]) -> None:
    """A setting the run's ``option`` (averaging, shares) would ignore keeps its
    default: a value set for a strategy the run does not use is refused, not dropped
    without a word."""
    default = ParallelConfig.__dataclass_fields__[name].default
    value, chosen = getattr(par, name), getattr(par, option)
    named = ", ".join(map(repr, users[:-1])) + " or " * (len(users) > 1) + repr(users[-1])
    _require(chosen in users or value == default,
             f"{name} ({value}) is read only by {option} {named} ({option} is {chosen!r}): "
             f"use {'one of them' if len(users) > 1 else 'it'}, or leave {name} at its "
             f"default ({default})")


def _check_model(m: ModelConfig, par: ParallelConfig) -> None:
    """The generic rules, then the model's own (``check_config`` of its class), then
    whether it declares what tp > 1 and pp > 1 need (a tensor plan, pipeline pieces)."""
    from hpctrain.models.registry import model_class  # the models import this module

    _require(par.tp >= 1, f"tp ({par.tp}) must be at least 1")
    _require(par.pp >= 1, f"pp ({par.pp}) must be at least 1")
    _require(par.sp >= 1, f"sp ({par.sp}) must be at least 1")
    _require(par.tp == 1 or par.sp == 1,
             f"tp ({par.tp}) and sp ({par.sp}) share the grid's innermost axis: one of "
             f"them must be 1")
    _require(par.pp == 1 or par.sp == 1,
             f"spatial parallelism runs without pipelining: pp ({par.pp}) must be 1 "
             f"when sp ({par.sp}) > 1")
    cls = model_class(m.kind)
    _check_model_keys(m, cls.config_keys, cls.name)
    _require_choice("dtype", m.dtype, DTYPES)
    _require(m.init_std > 0, f"init_std ({m.init_std}) must be positive")
    has_plan = cls.tensor_plan(par.sequence_parallel) is not None
    costs = cls.piece_costs(m)
    _require(par.tp == par.pp == 1 or has_plan or costs is not None,
             f"the {cls.name} supports data parallelism only"
             f"{' (and spatial, sp)' if cls.spatial_axes(m) else ''} (tp is {par.tp}, pp is "
             f"{par.pp})")
    _require(par.tp == 1 or has_plan,
             f"the {cls.name} declares no tensor-parallel plan: tp ({par.tp}) must be 1")
    _require(par.pp == 1 or costs is not None,
             f"the {cls.name} declares no pipeline pieces: pp ({par.pp}) must be 1")
    cls.check_config(m, par)
    if par.sp > 1:
        _require(cls.spatial_axes(m) is not None,
                 f"the {cls.name} declares no spatial split: sp ({par.sp}) must be 1")
        cls.check_spatial(m, par.sp)
    _check_local_loss(cls, m, par)
    _require(not cls.batch_statistics or par.shares == "equal" or par.averaging == "sync",
             f"the {cls.name} sums BatchNorm's statistics over the data group in every "
             f"forward and backward, and throughput-weighted local SGD (shares "
             f"{par.shares!r}, averaging {par.averaging!r}) runs more of them on a rank "
             f"with a larger share: use shares 'equal', or averaging 'sync' with these "
             f"shares")
    if par.pp > 1:
        chunks = par.pp * par.virtual_stages
        _require(chunks <= len(costs.middle),
                 f"pp * virtual_stages ({par.pp} * {par.virtual_stages} = {chunks}) must not "
                 f"exceed the {len(costs.middle)} middle pipeline pieces of the {cls.name}")


def _check_local_loss(cls: Any, m: ModelConfig, par: ParallelConfig) -> None:
    """Local-loss pipeline training: stages to train, heads to train them with."""
    _require_choice("pipeline_training", par.pipeline_training, PIPELINE_TRAINING)
    if par.pipeline_training != "local":
        return
    _require(par.pp > 1, f"pipeline_training 'local' trains each pipeline stage on a loss "
                         f"of its own: it needs pp > 1 (pp is {par.pp})")
    _require(cls.has_aux_heads(m),
             f"the {cls.name} declares no auxiliary heads: pipeline_training 'local' needs "
             f"one per stage (use 'backprop')")
    _require(par.virtual_stages == 1 and par.tp == 1,
             f"pipeline_training 'local' runs one whole chunk per rank: virtual_stages "
             f"({par.virtual_stages}) and tp ({par.tp}) must be 1")


def _check_model_keys(m: ModelConfig, known: tuple[str, ...], name: str) -> None:
    """A [model] key set away from its default that the model of ``m.kind`` does not
    read is an error naming the keys it reads (so a typo'd kind is not silently a GPT)."""
    default = ModelConfig()
    foreign = [f.name for f in fields(m) if f.name not in COMMON_MODEL_KEYS + known
               and getattr(m, f.name) != getattr(default, f.name)]
    _require(not foreign, f"[model] key(s) {foreign} are not read by model kind {m.kind!r} "
                          f"(the {name}); its keys: {sorted(COMMON_MODEL_KEYS + known)}")


def _check_shares(t: TrainConfig, par: ParallelConfig) -> None:
    if par.shares != "fixed":
        return
    b = par.batch_shares
    _require(len(b) == par.dp, f"batch_shares ({list(b)}) must have one entry per "
                               f"data-parallel rank (dp is {par.dp})")
    _require(sum(b) == t.batch_size, f"batch_shares ({list(b)}) must sum to batch_size "
                                     f"({t.batch_size}), not {sum(b)}")
    mb, what = par.microbatches, "microbatches"
    if par.averaging == "periodic":  # weighted local SGD: whole local steps of B / (dp mb)
        mb, what = t.batch_size // (par.dp * par.microbatches), "a local step's samples"
    bad = [n for n in b if n < mb or n % mb]
    _require(not bad, f"batch_shares ({list(b)}) must each be a positive multiple of "
                      f"{what} ({mb}): {bad} are not")


def _check_train(t: TrainConfig, par: ParallelConfig) -> None:
    _check_shares(t, par)
    _require(t.steps >= 0, f"steps ({t.steps}) must not be negative")
    _require_choice("optimizer", t.optimizer, OPTIMIZERS)
    _require_choice("sparse_optimizer", t.sparse_optimizer, SPARSE_OPTIMIZERS)
    _require(t.sparse_lr >= 0, f"sparse_lr ({t.sparse_lr}) must not be negative (0: lr)")
    _require(t.sparse_weight_decay >= 0, f"sparse_weight_decay ({t.sparse_weight_decay}) "
                                         f"must not be negative")
    per_step = par.dp * par.microbatches
    _require(t.batch_size >= 1 and t.batch_size % per_step == 0,
             f"batch_size ({t.batch_size}) must be a positive multiple of dp * microbatches "
             f"({par.dp} * {par.microbatches} = {per_step})")
    _require(t.lr > 0, f"lr ({t.lr}) must be positive")
    _require(0 <= t.min_lr <= t.lr, f"min_lr ({t.min_lr}) must be between 0 and lr ({t.lr})")
    _require(t.warmup_steps >= 0, f"warmup_steps ({t.warmup_steps}) must not be negative")
    _require(t.weight_decay >= 0, f"weight_decay ({t.weight_decay}) must not be negative")
    # betas: the decay of Adam's averages (AdamW and the tables' Adam); eps: the floor
    # of Adam's and AdaGrad's denominator (at 0 a zero gradient divides 0 by 0)
    _require(0 <= t.beta1 < 1, f"beta1 ({t.beta1}) must be in [0, 1)")
    _require(0 <= t.beta2 < 1, f"beta2 ({t.beta2}) must be in [0, 1)")
    _require(t.eps > 0, f"eps ({t.eps}) must be positive")
    _require(0 <= t.momentum < 1, f"momentum ({t.momentum}) must be in [0, 1)")
    _require(t.grad_clip >= 0, f"grad_clip ({t.grad_clip}) must not be negative")
    _require(t.eval_interval >= 0, f"eval_interval ({t.eval_interval}) must not be negative")
    _require(t.log_interval >= 1, f"log_interval ({t.log_interval}) must be at least 1")
    _require(t.save_interval >= 0, f"save_interval ({t.save_interval}) must not be negative")
    _require(t.keep_checkpoints >= 1,
             f"keep_checkpoints ({t.keep_checkpoints}) must be at least 1")
    _require(t.run_dir.strip() != "", f"run_dir ({t.run_dir!r}) must name a folder: "
                                      f"metrics.jsonl, config.json and checkpoints go there")
    _require_choice("checkpoint_io", t.checkpoint_io, ("auto", "mpio", "files"))
    _require_choice("checkpoint_read", t.checkpoint_read, ("each", "shared"))
    if t.checkpoint_io == "mpio":
        from hpctrain.checkpoint.writer import MPIO_REMEDY, mpio_missing

        missing = mpio_missing()
        _require(missing is None, f"checkpoint_io (\"mpio\") needs h5py with MPI, but "
                                  f"{missing}: {MPIO_REMEDY}")
    _require(t.blas_threads >= 0, f"blas_threads ({t.blas_threads}) must not be negative")
    _require(t.row_threads >= 0, f"row_threads ({t.row_threads}) must not be negative")
    _require(t.max_skipped_steps >= 1,
             f"max_skipped_steps ({t.max_skipped_steps}) must be at least 1")
    _require(t.stall_timeout == 0 or t.stall_timeout >= 1,
             f"stall_timeout ({t.stall_timeout}) must be 0 (off) or at least 1 second")


def _check_eval(m: ModelConfig, t: TrainConfig) -> None:
    """eval_batches: validation batches drawn from token streams and images are at
    least one (none averages to a NaN loss); ratings and volumes are covered whole when
    it is 0 (``hpctrain.data.eval_batches``)."""
    from hpctrain.data.format import RATINGS, VOLUMES
    from hpctrain.models.registry import model_class

    cls = model_class(m.kind)
    if cls.data_format in (RATINGS, VOLUMES):
        _require(t.eval_batches >= 0, f"eval_batches ({t.eval_batches}) must not be "
                                      f"negative (0: the whole validation split)")
    else:
        _require(t.eval_batches >= 1,
                 f"eval_batches ({t.eval_batches}) must be at least 1 for the {cls.name} "
                 f"(0, the whole validation split, is for ratings and volumes)")


def _check_fold(m: ModelConfig, d: DataConfig) -> None:
    """fold picks the validation fold of ratings data; on any other data it would be
    ignored, so a run meant to validate on fold 9 must not train as if it did."""
    from hpctrain.data.format import RATINGS
    from hpctrain.models.registry import model_class

    cls = model_class(m.kind)
    _require(d.fold >= 0, f"fold ({d.fold}) must not be negative")
    if cls.data_format != RATINGS:
        _require(d.fold == 0, f"fold ({d.fold}) chooses a validation fold of ratings data; "
                              f"the {cls.name} trains on {cls.data_format}, which has no "
                              f"folds: leave fold at 0")


def _check_batch_threads(m: ModelConfig, par: ParallelConfig, t: TrainConfig) -> None:
    """batch_threads: 1 (off) and 0 (where allowed) whatever the layout; n > 1 a layout
    and model that allow it."""
    from hpctrain.parallel.batch_threads import refusal  # imports this module

    _require(par.batch_threads >= 0,
             f"batch_threads ({par.batch_threads}) must not be negative")
    if par.batch_threads <= 1:
        return
    why = refusal(m, par, t)
    _require(why is None, f"batch_threads ({par.batch_threads}) splits a rank's batch over "
                          f"threads, but {why}: set batch_threads 1, or 0 (split where "
                          f"the layout allows it)")


def _pieces_run(cls, par: ParallelConfig, what: str, value: str, off: str) -> None:
    """A model whose forward does not run its pipeline pieces (``runs_its_pieces``)
    takes wrappers on the pieces only in a pipeline, where the stages run them."""
    _require(cls.runs_its_pieces or par.pp > 1,
             f"{what} ({value!r}) wraps pipeline pieces, and the {cls.name} runs its "
             f"pieces only in a pipeline: it needs pp > 1, or {what} {off} (pp is {par.pp})")


def _check_recompute(m: ModelConfig, par: ParallelConfig, t: TrainConfig) -> None:
    """recompute's mode, and that every piece recompute_pieces names exists."""
    from hpctrain.models.registry import model_class
    from hpctrain.parallel import recompute

    _require_choice("recompute", t.recompute, recompute.MODES)
    if t.recompute == "none":
        _require(not t.recompute_pieces, f"recompute_pieces ({list(t.recompute_pieces)}) "
                                          f"needs recompute \"full\", \"selective\" or "
                                          f"\"attention\"")
        return
    cls = model_class(m.kind)
    costs = cls.piece_costs(m)
    _require(costs is not None, f"recompute ({t.recompute!r}) works on pipeline pieces, "
                                f"and the {cls.name} declares none: it must be \"none\"")
    _pieces_run(cls, par, "recompute", t.recompute, '"none"')
    try:
        chosen = recompute.select(t.recompute_pieces, len(costs.middle), cls.name)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    # what the built pieces would refuse (recompute.apply), said before the build: the
    # middle pieces hold a model's BatchNorm layers and its attention, first and last
    # (the input, the head) neither
    middle = [name for name in chosen if name.startswith("middle.")]
    _require(not (cls.batch_statistics and middle),
             f"recompute ({t.recompute!r}) of pieces {middle}: they keep BatchNorm's "
             f"running statistics, which a second forward would update twice")
    _require(t.recompute == "full" or (cls.has_attention and middle),
             f"recompute ({t.recompute!r}) recomputes attention, but pieces {chosen} of "
             f"the {cls.name} hold no attention layer")


def _check_precision(m: ModelConfig, par: ParallelConfig, t: TrainConfig) -> None:
    """precision and grad_comm_dtype: known names, ml_dtypes for bfloat16, and the
    layouts they run at (hpctrain.precision, parallel/bf16_reduce.py)."""
    from hpctrain.models.registry import model_class

    _require_choice("precision", t.precision, PRECISIONS)
    _require_choice("grad_comm_dtype", par.grad_comm_dtype, GRAD_COMM_DTYPES)
    _require(t.loss_scale >= 0, f"loss_scale ({t.loss_scale}) must not be negative "
                                f"(0: dynamic)")
    _require(t.loss_scale == 0 or t.precision == "fp16",
             f"loss_scale ({t.loss_scale}) scales fp16 gradients: it needs precision "
             f"\"fp16\" (precision is {t.precision!r})")
    if "bf16" in (t.precision, par.grad_comm_dtype):
        from hpctrain.precision import ML_DTYPES_REMEDY, ml_dtypes_missing

        missing = ml_dtypes_missing()
        what = "precision" if t.precision == "bf16" else "grad_comm_dtype"
        _require(missing is None, f"{what} (\"bf16\") needs NumPy's bfloat16 dtype, but "
                                  f"{missing}: {ML_DTYPES_REMEDY}")
    if par.grad_comm_dtype != "fp32":
        _require(not m.tables, "grad_comm_dtype (\"bf16\") sums dense gradients; the "
                               "embedding tables' sparse ones are exchanged apart: it "
                               "must be \"fp32\" with [model] tables")
        _require(par.zero == 0 and par.dp_reduce == "flat" and par.averaging == "sync",
                 f"grad_comm_dtype (\"bf16\") replaces the flat all-reduce of zero 0: it "
                 f"needs zero 0, dp_reduce 'flat' and averaging 'sync' (zero is {par.zero}, "
                 f"dp_reduce {par.dp_reduce!r}, averaging {par.averaging!r})")
    if t.precision == "fp32":
        return
    _require(m.dtype == "float32", f"precision ({t.precision!r}) stores in 16 bits and "
                                   f"computes in float32: [model] dtype ({m.dtype!r}) "
                                   f"must be 'float32'")
    cls = model_class(m.kind)
    _require(cls.piece_costs(m) is not None,
             f"precision ({t.precision!r}) works on pipeline pieces, and the {cls.name} "
             f"declares none: it must be \"fp32\"")
    _pieces_run(cls, par, "precision", t.precision, '"fp32"')
    _require(par.zero != 3 and par.sp == 1,
             f"precision ({t.precision!r}) rounds each piece's parameters around its "
             f"forward and backward: zero 3 and spatial parallelism are not supported "
             f"(zero is {par.zero}, sp {par.sp})")
    if t.precision == "fp16":
        _require(par.zero == 0 and par.averaging == "sync",
                 f"fp16 loss scaling divides whole gradients after their sum: it needs zero "
                 f"0 and averaging 'sync' (zero is {par.zero}, averaging {par.averaging!r})")


# ---------------------------------------------------------------------------------
# loading


def _coerce(section: str, f: dataclasses.Field, value: Any) -> Any:
    """Check one TOML value against the field's annotated type."""
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    where = f"[{section}] {f.name}"
    if kind == "bool":
        _require(isinstance(value, bool), f"{where} ({value!r}) must be true or false")
    elif kind == "int":
        _require(isinstance(value, int) and not isinstance(value, bool),
                 f"{where} ({value!r}) must be an integer")
    elif kind == "float":
        _require(isinstance(value, (int, float)) and not isinstance(value, bool),
                 f"{where} ({value!r}) must be a number")
        value = float(value)
    elif kind == "str":
        _require(isinstance(value, str), f"{where} ({value!r}) must be a string")
    elif kind == "tuple[TableConfig, ...]":
        value = tuple(_table(where, i, v) for i, v in enumerate(_list(where, value)))
    elif kind == "tuple[TableSharding, ...]":
        value = _table_shardings(where, value)
    elif kind == "tuple[str, ...]":
        _require(all(isinstance(v, str) for v in _list(where, value)),
                 f"{where} ({value!r}) must be a list of strings")
        value = tuple(value)
    elif kind.startswith("tuple"):
        _require(isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value),
                 f"{where} ({value!r}) must be a list of integers")
        value = tuple(value)
    return value


def _list(where: str, value: Any) -> list | tuple:
    _require(isinstance(value, (list, tuple)), f"{where} ({value!r}) must be a list")
    return value


def _table(where: str, i: int, value: Any) -> TableConfig:
    """One inline table {name, rows, width, pooling} of [model] tables, checked."""
    if isinstance(value, TableConfig):
        return value
    known = {f.name: f for f in fields(TableConfig)}
    _require(isinstance(value, dict) and "name" in value and "rows" in value,
             f"{where}[{i}] ({value!r}) must be an inline table with at least name and rows")
    bad = sorted(set(value) - set(known))
    _require(not bad, f"{where}[{i}]: unknown key(s) {bad}; known: {sorted(known)}")
    return TableConfig(**{k: _coerce(f"model.tables[{i}]", known[k], v)
                          for k, v in value.items()})


def _table_shardings(where: str, value: Any) -> tuple[TableSharding, ...]:
    """``{name = "row", other = {sharding = "table", ranks = [1]}}`` or a list of
    ``{name, sharding, ranks}`` -> TableShardings, checked for form (the rules:
    ``hpctrain.parallel.tables.check_sharding``)."""
    if isinstance(value, dict):
        value = [{"name": k, **(v if isinstance(v, dict) else {"sharding": v})}
                 for k, v in value.items()]
    out = []
    for i, v in enumerate(_list(where, value)):
        if isinstance(v, TableSharding):
            out.append(v)
            continue
        _require(isinstance(v, dict) and set(v) <= {"name", "sharding", "ranks"}
                 and "name" in v and "sharding" in v,
                 f"{where}[{i}] ({v!r}) must be {{name, sharding, ranks}} (ranks optional)")
        ranks = v.get("ranks", ())
        _require(isinstance(v["name"], str) and isinstance(v["sharding"], str)
                 and isinstance(ranks, (list, tuple))
                 and all(isinstance(r, int) and not isinstance(r, bool) for r in ranks),
                 f"{where}[{i}] ({v!r}): name and sharding are strings, ranks integers")
        out.append(TableSharding(v["name"], v["sharding"], tuple(ranks)))
    return tuple(out)


def from_dict(raw: dict[str, Any], source: str = "config") -> Config:
    """Build a Config from nested dicts (as TOML gives them); unknown keys are errors."""
    sections = {f.name: f for f in fields(Config)}
    unknown = sorted(set(raw) - set(sections))
    _require(not unknown, f"{source}: unknown section(s) {unknown}; known: {sorted(sections)}")
    parts = {}
    for name, sf in sections.items():
        cls = sf.default_factory().__class__
        given = raw.get(name, {})
        _require(isinstance(given, dict), f"{source}: [{name}] must be a table")
        known = {f.name: f for f in fields(cls)}
        bad = sorted(set(given) - set(known))
        _require(not bad, f"{source}: unknown key(s) {bad} in [{name}]; known: {sorted(known)}")
        parts[name] = cls(**{k: _coerce(name, known[k], v) for k, v in given.items()})
    return Config(**parts)


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string: JSON's escapes are TOML's (a name may hold a
    quote, a backslash or a control character and reads back as written)."""
    return json.dumps(text)


def read_toml(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """A TOML file's tables; a missing, unreadable or malformed file is a ConfigError
    naming it. A leading UTF-8 byte-order mark (some Windows editors write one) is
    skipped."""
    name = f"{what} {str(path)!r}"
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{name} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{name} is a folder, not a TOML file") from None
    except OSError as err:
        raise ConfigError(f"{name} cannot be read: {err.strerror or err}") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{name} is not a TOML text file (binary data: byte "
                          f"0x{data[err.start]:02x} at offset {err.start} is not "
                          "UTF-8)") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{name} is not valid TOML: {err}") from None


def load(path: str | Path, overrides: dict[str, Any] | None = None) -> Config:
    """Read a TOML config file and apply ``overrides`` (``{"parallel.tp": 2, ...}``)."""
    path = Path(path)
    raw = read_toml(path)
    for dotted, value in (overrides or {}).items():
        section, key = dotted.split(".")
        raw.setdefault(section, {})[key] = value
    return from_dict(raw, source=str(path))
