"""The training loop: one optimizer step = forward and backward over the microbatches
of this rank's part of the global batch, gradient averaging over the data group
(bucketed and overlapped with backward, optionally ZeRO-sharded), clipping by the
global gradient norm, and the update.

``train(cfg, comm)`` is what ``hpctrain train`` runs on every rank. It is a plain
function of a validated config and a communicator, so tests call it directly.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpctrain import preempt, runlock, trace, watchdog
from hpctrain.checkpoint.background import BackgroundWriter
from hpctrain.checkpoint.format import INDEX_NAME
from hpctrain.checkpoint.retention import NO_PRUNING, Retention
from hpctrain.checkpoint.state import schedule_of
from hpctrain.checkpoint.training import averaging_changes, checkpoint_root
from hpctrain.checkpoint.writer import arrive, wait_for_pruning
from hpctrain.config import Config
from hpctrain.data import eval_batches, open_loader
from hpctrain.data.contents import check_fits, read_contents
from hpctrain.guard import DivergenceError, NonFiniteGuard
from hpctrain.metrics import MetricsWriter, keep_earlier, progress_line
from hpctrain.models.registry import model_class
from hpctrain.nn import kernels as nn_kernels
from hpctrain.nn import threads as nn_threads
from hpctrain.optim import schedule
from hpctrain.optim.optimizers import SGD, AdamW
from hpctrain.parallel.data import DataParallel
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.shares import ShareBalancer
from hpctrain.parallel.sparse_data import has_tables, make_sparse_data_parallel
from hpctrain.parallel.topology import Topology
from hpctrain.precision import Precision
from hpctrain.runtime import (
    UserError,
    blas_spin_warning,
    keep_freed_memory,
    set_blas_threads,
    startup_check,
)
from hpctrain.slurm.placement import blas_threads_per_rank, tensor_group_warning


@dataclass
class Summary:
    """What a finished run reports back (tests compare these across layouts)."""

    losses: list[float]
    val_losses: list[float]
    val_accuracy: float | None
    seconds: float
    preempted: bool = False  # stopped early by a signal, after saving a checkpoint
    interrupted: bool = False  # ... and the signal was a Ctrl-C (no requeue)


def make_optimizer(cfg: Config, named_params, decay=None):
    """The configured optimizer over ``named_params``; ``decay``: per-entry weight-decay
    flags, for flat slices of parameters (default: ``ndim >= 2``)."""
    t = cfg.train
    if t.optimizer == "adamw":
        return AdamW(named_params, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                     weight_decay=t.weight_decay, decay=decay)
    return SGD(named_params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay,
               decay=decay)


def make_data_parallel(cfg: Config, engine, topo: Topology):
    """Gradient synchronisation and optimizer for ``cfg.parallel.zero``: stage 0 is
    ``DataParallel``, stages 1 and 2 ``ZeroDataParallel``, stage 3 ``Zero3DataParallel``
    (collective over the model group at construction); each sums flat or
    hierarchically (``cfg.parallel.dp_reduce``: over the topology's node groups,
    ``hierarchy.py``). A model with embedding tables
    (sparse gradients) gets ``sparse_data.SparseDataParallel``."""
    par = cfg.parallel
    if has_tables(engine):
        return make_sparse_data_parallel(cfg, engine, topo)
    if par.averaging != "sync":
        from hpctrain.parallel.averaging import LocalDataParallel, check_nodes

        check_nodes(par, topo)
        optimizer = make_optimizer(cfg, engine.named_params)
        if par.shares != "equal":  # periodic with unequal shares: throughput-weighted
            from hpctrain.parallel.weighted import WeightedLocalDataParallel

            return WeightedLocalDataParallel(engine, optimizer, topo, par,
                                             cfg.train.batch_size)
        return LocalDataParallel(engine, optimizer, topo, par)
    hierarchical = par.dp_reduce == "hierarchical"
    if par.zero == 0:
        launch = None
        if hierarchical:
            from hpctrain.parallel.hierarchy import hierarchical_launcher

            launch = hierarchical_launcher(topo)
        elif par.grad_comm_dtype == "bf16":
            from hpctrain.parallel.bf16_reduce import Bf16Reduce

            launch = Bf16Reduce(topo.dp_comm)
        return DataParallel(engine, make_optimizer(cfg, engine.named_params), topo.dp_comm,
                            bucket_mb=par.bucket_mb, launch=launch)
    from hpctrain.parallel.hierarchy import hierarchical_reduce_scatter
    from hpctrain.parallel.zero import ZeroDataParallel

    if par.zero == 3:
        from hpctrain.parallel.zero3 import Zero3DataParallel

        return Zero3DataParallel(engine, topo, make_optimizer=functools.partial(make_optimizer,
                                                                                cfg),
                                 reshard_after_forward=par.reshard_after_forward,
                                 reduce_scatter=hierarchical_reduce_scatter(topo)
                                 if hierarchical else None,
                                 units=getattr(engine, "zero3_units", None))
    return ZeroDataParallel(engine, topo, stage=par.zero, bucket_mb=par.bucket_mb,
                            make_optimizer=functools.partial(make_optimizer, cfg),
                            reduce_scatter=hierarchical_reduce_scatter(topo) if hierarchical
                            else None)


def train_step(engine, dp, x, y, *, lr: float, grad_clip: float, guard=None,
               step: int = 0, before_update: Callable[[], None] | None = None,
               share: float | None = None, scaler=None) -> tuple[float, float]:
    """One optimizer step on this rank's batch; returns (mean loss over dp, grad norm).

    ``dp`` is ``make_data_parallel``'s. Collective over the data group, and over the
    model group inside the engine and the norm. ``guard`` (``hpctrain.guard``), if
    given, may skip the update of a step with a non-finite loss or norm (collective
    over the world); ``step`` names the step in its messages. ``before_update``, if
    given, is called right before the update changes the parameters and optimizer
    state (ZeRO's too): forward and backward only read them, so a background
    checkpoint copies them meanwhile (``BackgroundWriter.captured``). ``share``: this
    rank's fraction of the global batch when the ranks hold unequal parts
    (``hpctrain.parallel.shares``; None: equal parts). ``scaler``: fp16's loss scaling
    (``precision.LossScaler``): backward from the scaled loss, the gradients divided
    after their sum; an overflow is a non-finite norm, which the guard skips.
    """
    if hasattr(dp, "local_round"):  # throughput-weighted local SGD: a round of steps
        return dp.local_round(engine, x, y, lr=lr, grad_clip=grad_clip, guard=guard,
                              step=step, share=share, before_update=before_update)
    with trace.span("zero_grad", "optimizer"):
        dp.zero_grad()
    # the gradient of loss / dp (b_r / B with unequal shares): summed over the data group
    # it is the global mean's; a local averaging step takes this rank's own mean
    scale = share if share is not None else getattr(dp, "grad_scale", 1.0 / dp.dp_size)
    if scaler is not None:
        scale *= scaler.scale
    loss = engine.forward_backward(x, y, scale=scale)
    with trace.span("dp_wait", "dp_comm"):
        dp.finish_grads()
    with trace.span("optimizer", "optimizer"):
        norm = dp.grad_norm()
        if scaler is not None:
            norm = scaler.unscale(engine.params, norm)
        if guard is None or guard.check(step, loss, norm):
            if before_update is not None:
                before_update()
            if grad_clip > 0:
                dp.clip(grad_clip, norm)
            dp.step(lr)
        elif hasattr(dp, "skip_step"):  # local averaging: the step counts in its period
            dp.skip_step()
    if share is not None:
        return mean_over(dp.dp_comm, loss * share * dp.dp_size), norm
    return mean_over(dp.dp_comm, loss), norm


def mean_over(comm, value: float, terms: float | None = None) -> float:
    """Mean of a scalar over ``comm`` (collective); with ``terms``, ``value`` is a sum
    of that many terms on this rank, and the result the mean of every rank's terms
    (nan when there are none)."""
    if terms is not None:
        pair = np.array([value, terms], np.float64)  # terms exact below 2^53
        if comm.Get_size() > 1:
            from mpi4py import MPI

            with trace.span("loss_mean", "other", comm="dp_comm"):
                comm.Allreduce(MPI.IN_PLACE, pair, op=MPI.SUM)
        return float(pair[0] / pair[1]) if pair[1] else float("nan")
    if comm.Get_size() == 1:
        return float(value)
    with trace.span("loss_mean", "other", comm="dp_comm"):
        return comm.allreduce(float(value)) / comm.Get_size()


def evaluate(cfg: Config, engine, batches, dp_comm) -> tuple[float, dict[str, float]]:
    """Mean validation loss over fixed batches, and the model's own figures
    (``Model.eval_metrics``, e.g. a classifier's accuracy), each summed over the data
    group (collective). The loss is the mean over every term of every batch on every
    rank: each batch's mean weighed by its terms (``Model.eval_weight``: its rows, a
    segmentation's valid voxels), so it is the same at any dp. A figure with nothing
    counted (the Dice of a class neither predicted nor present in the batches) is left
    out: it has no value."""
    weigh = model_class(cfg.model.kind).eval_weight
    loss_sum, terms, sums = 0.0, 0, {}
    for x, y in batches:
        loss, weight = engine.loss(x, y), weigh(y)  # every rank calls loss (collective)
        if weight:
            loss_sum, terms = loss_sum + loss * weight, terms + weight
        for name, (total, count) in engine.eval_metrics(x, y).items():
            kept = sums.setdefault(name, [0, 0])
            kept[0] += total
            kept[1] += count
    val_loss = mean_over(dp_comm, loss_sum, terms)
    if dp_comm.Get_size() > 1:
        sums = {name: [dp_comm.allreduce(total), dp_comm.allreduce(count)]
                for name, (total, count) in sorted(sums.items())}
    return val_loss, {name: total / count for name, (total, count) in sums.items() if count}


def _sample_len(cfg: Config) -> int | None:
    """Tokens per sample (a sequence model's T), None when a sample is one item."""
    return model_class(cfg.model.kind).sample_len(cfg.model)


def _tokens_per_sample(cfg: Config) -> int:
    return _sample_len(cfg) or 1


def _open_data(cfg: Config, topo: Topology):
    """The training loader and the validation batches, after checking that the model
    can take the data (``data.contents``)."""
    check_fits(read_contents(cfg.data.path), cfg.model)
    common = dict(batch_size=cfg.train.batch_size, dp_rank=topo.dp_rank,
                  dp_size=topo.dp_size, seq_len=_sample_len(cfg), crop=cfg.model.crop,
                  fold=cfg.data.fold)
    loader = open_loader(cfg.data.path, split="train", seed=cfg.train.seed,
                         prefetch=cfg.data.prefetch, **common)
    val = None
    if cfg.train.eval_interval > 0 or cfg.train.steps == 0:
        val = list(eval_batches(cfg.data.path, split=cfg.data.eval_split,
                                num_batches=cfg.train.eval_batches, **common))
    return loader, val


def _build_engine(cfg: Config, topo: Topology):
    """The model shard, after the layout's checks that need the node table (every rank
    raises them alike: one line from rank 0, not one error and abort per rank)."""
    from hpctrain.parallel.averaging import check_nodes

    check_nodes(cfg.parallel, topo)
    return build_engine(cfg, topo)


def _resume(resume: str | None, cfg: Config, topo: Topology, engine, dp, loader):
    """Load the checkpoint ``--resume`` names into the run (collective), or None.

    Every rank looks for the checkpoint on its own node first, and every rank must find
    the same one, before the load's first collective: a path some nodes cannot see (a
    copy on one node's local disk), or ``--resume auto`` reading different ``latest``
    files, is refused on every rank with the ranks named. (A rank failing inside the
    load's own collectives would have left the others waiting there.)"""
    from hpctrain.checkpoint import find_resume, load_training

    if not resume:
        return None
    comm = topo.world_comm
    path = startup_check(comm, lambda: find_resume(resume, cfg.train.run_dir))
    found = comm.allgather(None if path is None else str(path))
    startup_check(comm, lambda: _same_checkpoint(resume, found))
    if path is None:
        return None
    return load_training(path, cfg, topo, engine, dp, loader=loader)


def _same_checkpoint(resume: str, found: list[str | None]) -> None:
    """Refuse a ``--resume`` that the ranks resolved differently (``found[rank]``: the
    index each found, None: none, start afresh)."""
    if len(set(found)) == 1:
        return
    groups: dict[str | None, list[int]] = {}
    for rank, path in enumerate(found):
        groups.setdefault(path, []).append(rank)
    seen = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {_spans(ranks)}: "
                     f"{path or 'no checkpoint (start afresh)'}"
                     for path, ranks in groups.items())
    raise UserError(f"--resume {resume}: the ranks found different checkpoints ({seen}); "
                    f"the run folder and the checkpoint must be one path that every node "
                    f"sees alike (a shared file system)")


def _spans(ranks: list[int]) -> str:
    """``0-3, 6`` for [0, 1, 2, 3, 6]."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _refuse_overwrite(cfg: Config) -> None:
    """A fresh run that saves checkpoints into a run folder holding an earlier run's
    would replace them step by step and move ``latest`` back: refused, with the ways
    out, before anything is built or written."""
    from hpctrain.checkpoint.format import latest_checkpoint
    from hpctrain.checkpoint.training import checkpoint_root

    if not cfg.train.save_interval:
        return
    root = checkpoint_root(cfg.train.run_dir)
    latest = latest_checkpoint(root)
    if latest is not None:
        raise UserError(f"{root} already holds an earlier run's checkpoints (latest: "
                        f"{latest.name}), which a fresh run saving every "
                        f"{cfg.train.save_interval} steps would overwrite: continue it "
                        f"with --resume auto, or start afresh in another --run-dir")


def _check_outputs(cfg: Config, resume: str | None, trace_path: str | None) -> None:
    """What rank 0 will write, checked before anything is built: the run folder exists
    or can be made and takes files, ``checkpoints`` in it is a folder if it exists, a
    resumed run's ``metrics.jsonl`` can be read, the trace's folder takes files. Found
    at the end (the first save, the trace after the last step), these failed after the
    whole run."""
    import tempfile

    from hpctrain.data.format import same_file
    from hpctrain.metrics import read_metrics

    def writable(folder: Path, what: str) -> None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".hpctrain-probe-"):
                pass
        except OSError as err:
            where = f": {err.filename}" if err.filename and Path(err.filename) != folder else ""
            raise UserError(f"{what} {folder}: cannot be made or written to "
                            f"({err.strerror or err}{where}); choose another") from None

    run_dir = Path(cfg.train.run_dir)
    writable(run_dir, "the run folder (--run-dir)")
    root = checkpoint_root(run_dir)
    if root.exists() and not root.is_dir():
        raise UserError(f"{root} is a file, where the run keeps its checkpoints (a folder): "
                        f"move it away, or choose another --run-dir")
    metrics = run_dir / "metrics.jsonl"
    if resume and metrics.is_file():
        read_metrics(metrics)  # the records a resume keeps: a MetricsError names the line
    if trace_path is not None:  # (click refuses a folder)
        writable(Path(trace_path).parent, "--trace's folder")
        for own in (metrics, run_dir / "config.json"):
            if same_file(trace_path, own) or Path(trace_path).resolve() == own.resolve():
                raise UserError(f"--trace {trace_path}: is the run's own {own.name}, which "
                                f"the trace would replace; write it elsewhere (e.g. "
                                f"{run_dir / 'trace.json'})")
    if not resume:
        _refuse_overwrite(cfg)


def _save(cfg: Config, topo: Topology, engine, dp, loader, step: int, sched: dict,
          background, writer, extra: dict | None = None) -> Path | None:
    """Checkpoint after ``step`` (collective); rank 0 says where and how long; returns
    the folder (None: the state was not finite, nothing was written). ``background``:
    a ``BackgroundWriter`` (``--async-save``) or None. Nothing is pruned here: the
    run's ``checkpoint.retention`` does it once the checkpoint is confirmed."""
    from hpctrain.checkpoint.training import NonFiniteState, save_training

    _wait_for_save(background, writer)  # at most one write in flight
    t0 = time.perf_counter()
    try:
        path = save_training(cfg, topo, engine, dp, step=step,
                             loader_state=loader.state_dict(), schedule=sched,
                             background=background, say=writer.say if writer else None,
                             keep=NO_PRUNING, extra=extra)
    except NonFiniteState as err:  # every rank alike; the last finite checkpoint stays
        if writer is not None:
            writer.say(f"warning: {err}")
        return None
    if writer is not None:
        how = "" if background is None else "; writing it in the background"
        writer.say(f"checkpoint {path} ({time.perf_counter() - t0:.2f} s{how})")
    return path


def _healthy(path: Path | None, retention: Retention) -> str:
    """The end of a divergence message: where to continue from."""
    if path is None:
        return (" (no checkpoint of this run was followed by a finite step: start afresh "
                "with a lower learning rate)")
    if not retention.holds(path):  # the checkpoint resumed from, outside the run's folder
        return (f" ({path}, which this run resumed from, is the newest checkpoint whose next "
                f"step was finite; it is not in {retention.root}, so 'latest' cannot name "
                f"it: continue with --resume {path} instead of --resume auto)")
    return f" ({path} is the newest checkpoint whose next step was finite; 'latest' names it)"


def _wait_for_save(background, writer) -> bool:
    """Wait for the background write in flight, if any; its error is raised on every
    rank; rank 0 says when it landed, or warns that the state was not finite (as the
    synchronous save does: nothing written). False: it was refused so."""
    from hpctrain.checkpoint.training import NonFiniteState

    try:
        path = None if background is None else background.wait()
    except NonFiniteState as err:  # every rank alike; the last finite checkpoint stays
        if writer is not None:
            writer.say(f"warning: {err}")
        return False
    if path is not None and writer is not None:
        writer.say(f"checkpoint {path} written ({background.write_s:.2f} s in the background)")
    return True


def sequence_parallel_warning(par, tp: int) -> str | None:
    """Sequence parallelism asked for where it does nothing (one rank a tensor group)."""
    if par.sequence_parallel and tp == 1:
        return ("warning: sequence parallelism shards the activations over the tensor-"
                "parallel group; at tp 1 it changes nothing (give --tp 2 or more)")
    return None


def _announce(writer, cfg: Config, comm, topo: Topology, nodes, threads: int, engine, dp,
              resumed, sched: dict) -> None:
    """Rank 0's opening lines: the layout, the memory, warnings, what was resumed."""
    inner = f"sp={topo.sp_size}" if topo.spatial else f"tp={topo.tp_size}"
    split = getattr(engine, "threads", 1)  # BatchThreadsEngine: the batch over threads
    how = (f"its batch split over {split} threads of 1 BLAS thread" if split > 1
           else f"{threads} BLAS thread(s)/rank")
    writer.say(f"hpctrain: {comm.Get_size()} rank(s), dp={topo.dp_size} {inner} "
               f"pp={topo.pp_size}, {how}, {cfg.model.kind} shard "
               f"of {sum(p.data.size for p in engine.params):,} parameters on rank 0")
    mem = dp.memory()
    extra = (f" (and {(split - 1) * mem['param_bytes'] / 2**20:.1f} MiB, the other batch "
             f"threads')" if split > 1 else "")
    writer.say(f"memory on rank 0 (zero {cfg.parallel.zero}): parameters "
               f"{mem['param_bytes'] / 2**20:.1f} MiB, gradients "
               f"{mem['grad_bytes'] / 2**20:.1f} MiB{extra}, optimizer state "
               f"{mem['optim_bytes'] / 2**20:.1f} MiB")
    for warning in (tensor_group_warning(nodes, topo.shape.tp), blas_spin_warning(threads),
                    sequence_parallel_warning(cfg.parallel, topo.shape.tp)):
        if warning:
            writer.say(warning)
    if resumed is not None:
        if sched != resumed.schedule:
            kept = f", with the config's schedule {sched} instead of its {resumed.schedule}"
        else:
            kept = "" if sched == schedule_of(cfg) else f", keeping its schedule {sched}"
        writer.say(f"resumed from {resumed.path} after step {resumed.step}{kept}")
        for name, old, new in averaging_changes(resumed.meta, cfg):
            writer.say(f"warning: {name} {new} where the checkpoint's run had {old} "
                       f"(averaging {cfg.parallel.averaging!r}): the new value applies "
                       f"from step {resumed.step + 1}")
        # where the rate is min_lr for good: past total_steps, but never inside the
        # warm-up, which a schedule of fewer steps than warmup_steps still runs to its end
        ends = max(sched.get("total_steps", cfg.train.steps), sched.get("warmup_steps", 0))
        if cfg.train.steps > max(ends, resumed.step) and sched["min_lr"] != sched["lr"]:
            writer.say(f"warning: the schedule ends at step {ends} and the run goes on to "
                       f"step {cfg.train.steps}: steps {max(ends, resumed.step) + 1}-"
                       f"{cfg.train.steps} train at min_lr {sched['min_lr']:.2e}; "
                       f"--reset-schedule takes the config's schedule, which ends at "
                       f"--steps")
        if cfg.train.checkpoint_read == "shared" and topo.dp_size > 1:
            writer.say(f"checkpoint read shared: rank 0 read {resumed.bytes_read / 1e6:.1f} "
                       f"MB of its {resumed.bytes_held / 1e6:.1f} MB from the files, the "
                       f"rest from its {topo.dp_size - 1} data-parallel replica(s)")


def breakdown_over(comm, totals: dict[str, float]) -> dict[str, float]:
    """Mean over the ranks of ``comm`` of each category's seconds (collective)."""
    values = np.array([totals[c] for c in trace.CATEGORIES])
    if comm.Get_size() > 1:
        from mpi4py import MPI

        comm.Allreduce(MPI.IN_PLACE, values, op=MPI.SUM)
        values /= comm.Get_size()
    return dict(zip(trace.CATEGORIES, values.tolist(), strict=True))


def _write_trace(cfg: Config, comm, topo: Topology, tracer, path: str, writer) -> None:
    """Every rank's spans into one Chrome trace at ``path`` (collective)."""
    dp_rank, pp_rank, tp_rank = topo.dp_rank, topo.pp_rank, topo.tp_rank
    coords = comm.allgather([dp_rank, pp_rank, tp_rank])
    par = cfg.parallel
    written = trace.write_chrome(
        comm, tracer, path,
        process_name=f"rank {comm.Get_rank()} (dp {dp_rank}, pp {pp_rank}, tp {tp_rank})",
        other={"dp": topo.dp_size, "tp": topo.tp_size, "sp": topo.sp_size, "pp": topo.pp_size,
               "schedule": par.schedule if topo.pp_size > 1 else "none",
               "microbatches": par.microbatches, "virtual_stages": par.virtual_stages,
               "coords": coords})
    if writer is not None:
        writer.say(f"trace of every rank in {written} (open it in ui.perfetto.dev)")


def train(cfg: Config, comm: Any, *, quiet: bool = False, resume: str | None = None,
          reset_schedule: bool = False, trace_path: str | None = None,
          after_step: Callable[[], dict[str, Any]] | None = None,
          resume_hint: str = "--resume auto") -> Summary:
    """Train on every rank of ``comm`` with a config already validated for its size.

    ``resume``: "auto" (the run's latest checkpoint, if any) or a checkpoint path; the
    run then continues after the saved step, with the saved learning-rate schedule
    (the config's with ``reset_schedule``).
    ``trace_path``: write every rank's timeline of the training steps there (Chrome
    trace). Every step's record in metrics.jsonl carries ``time_s``, the mean over
    ranks of each trace category's seconds (``hpctrain.trace.CATEGORIES``).
    ``after_step``: called on every rank after each step, outside its timing (the
    benchmark measures the GEMM rate there); rank 0's dict joins the step's record.
    ``resume_hint``: how the command that called this continues a run a signal
    stopped (its line after the checkpoint names it).
    """
    topo = Topology.build(comm, cfg.parallel)
    tracer = trace.Tracer(keep_events=False)  # the start-up's phases: timed, not traced
    # from here to the end, every phase is timed against the stall timeout: the
    # start-up's (a rank stuck checking its outputs, opening the data or loading the
    # checkpoint leaves the others in startup_check's collective), each step, and the
    # work between and after
    watch = watchdog.start(topo, tracer, cfg.train.stall_timeout)
    memory = lock = None
    try:
        with _phase(tracer, "check_outputs"):
            # one run at a time in the folder (hpctrain.runlock), taken before the
            # check: a live run's checkpoints are no earlier run's to be continued
            lock = runlock.take(comm, cfg.train.run_dir, "train",
                                None if quiet else functools.partial(print, flush=True))
            startup_check(comm, lambda: _check_outputs(cfg, resume, trace_path)
                          if comm.Get_rank() == 0 else None)
        with _phase(tracer, "load_kernels"):  # numba's machine code now, not in a step
            nn_kernels.load(cfg.model.dtype)
        if cfg.train.memory_report:  # traced from here: the engine's arrays included
            from hpctrain.memreport import MemoryReport

            memory = MemoryReport(cfg, comm)
        summary = _run(cfg, comm, topo, tracer, memory, quiet=quiet, resume=resume,
                       reset_schedule=reset_schedule, trace_path=trace_path,
                       after_step=after_step, resume_hint=resume_hint)
        # the ranks leave together, still watched: rank 0's last work (a long trace to
        # write, say) is bounded by the stall timeout, not by the finalize's shorter
        # wait for the ranks that come to the end (runtime.meet_before_finalize)
        with trace.recording(tracer), trace.span("end_of_run", "other", comm="world_comm"):
            arrive(comm)
    except SystemExit as err:  # alone, it would leave the others waiting: rank 0 ends them
        watch.exiting(err)
        raise
    finally:
        watch.stop()
        if lock is not None:  # finished, failed or preempted, the folder is free again
            lock.release()
    if memory is not None:
        memory.stop()
    topo.free()
    return summary


def _run(cfg: Config, comm: Any, topo: Topology, tracer: trace.Tracer, memory, *,
         quiet: bool, resume: str | None, reset_schedule: bool, trace_path: str | None,
         after_step, resume_hint: str) -> Summary:
    """``train`` from the start-up's phases to the metrics file's last line, under the
    watchdog of ``tracer``'s phases (collective)."""
    nodes = topo.nodes
    threads = set_blas_threads(cfg.train.blas_threads
                               or blas_threads_per_rank(nodes.ranks_on_node))
    keep_freed_memory()
    if cfg.train.row_threads:
        nn_threads.set_threads(cfg.train.row_threads)
    with _phase(tracer, "open_data"):
        loader, val = startup_check(comm, lambda: _open_data(cfg, topo))

    # a layout the model cannot take in ways only its built pieces show (recomputing a
    # piece with running statistics, or attention where there is none): every rank
    # builds the whole model first, so all refuse alike, in one line
    with _phase(tracer, "build_model"):
        engine = startup_check(comm, lambda: _build_engine(cfg, topo))
    dp = make_data_parallel(cfg, engine, topo)
    if memory is not None:
        from hpctrain.memreport import chain

        memory.attach(engine, dp, topo)
        after_step = chain(after_step, memory.after_step)
    t = cfg.train
    sched = schedule_of(cfg)  # lr_at's keyword arguments; a resumed run keeps its own
    with _phase(tracer, "load_checkpoint"):
        # the load's errors are agreed by every rank (writer.all_ranks), reported once
        resumed = startup_check(comm, lambda: _resume(resume, cfg, topo, engine, dp, loader))
    first = 1 if resumed is None else resumed.step + 1
    if memory is not None:
        memory.step = first - 1  # its records at the training steps, resumed or not
    if resumed is not None and not reset_schedule:
        sched = resumed.schedule

    writer = None
    if comm.Get_rank() == 0:
        kept = keep_earlier(t.run_dir) if resumed is None else []
        writer = MetricsWriter(t.run_dir, resume_after=None if resumed is None
                               else resumed.step,
                               evaluates_again=resumed is not None and resumed.step >= t.steps)
        if kept and not quiet:
            writer.say(f"{t.run_dir} held an earlier run's records: kept as "
                       f"{' and '.join(p.name for p in kept)}")
        (Path(t.run_dir) / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        if not quiet:
            _announce(writer, cfg, comm, topo, nodes, threads, engine, dp, resumed, sched)

    tracer.take_totals()  # the start-up's seconds are no step's
    tracer.keep_events = trace_path is not None  # the trace shows the steps
    loop = _Loop(cfg, comm, topo, engine, dp, loader, writer, quiet, sched, tracer,
                 after_step, resume_hint)
    if resumed is not None and loop.shares is not None:
        saved = resumed.meta.get("shares")
        why = loop.shares.load_state(saved)
        if why is not None and writer is not None and not quiet:
            writer.say(f"note: the checkpoint's batch shares {saved['shares']} do not fit "
                       f"this run ({why}): equal shares until they are measured again")
    if resumed is not None:
        loop.precision.load_state(resumed.meta.get("precision"))
        loop.guard.load_state(resumed.meta.get("guard"))
    early = preempt.agreed(comm)  # signalled while the data, model or checkpoint loaded
    if val is not None and (resumed is None or first > t.steps) and not early:
        # before the first step; or a checkpoint with no step left to train: evaluate it
        loop.evaluate(first - 1, val, {"step": first - 1}, alone=True)
    if resumed is not None:
        # pending until its first step is finite: the step folder, or the consolidated file
        loop.retention.saved(resumed.path.parent if resumed.path.name == INDEX_NAME
                             else resumed.path)
    trace.align_origin(comm, loop.tracer)
    start = time.perf_counter()
    stop, step = 0, first - 1
    steps = range(first, t.steps + 1)
    stop = (early or preempt.agreed(comm)) if steps else 0  # during start-up
    if stop:
        loop.stop_at_start(stop)
        steps = range(0)
    for step in steps:
        try:
            record = loop.step(step)
        except DivergenceError:  # every rank at once (the guard's verdict is collective):
            if trace_path is not None:  # the steps that led to it are the ones to see
                _write_trace(cfg, comm, topo, loop.tracer, trace_path,
                             None if quiet else writer)
            raise
        if val is not None and (step % t.eval_interval == 0 or step == t.steps):
            loop.evaluate(step, val, record)
        loop.report(record)
        saved = bool(t.save_interval) and (step % t.save_interval == 0 or step == t.steps)
        if saved:
            saved = loop.save(step, record["loss"])
        stop = preempt.agreed(comm) if step < t.steps else 0
        if stop:
            loop.stop_preempted(step, saved, stop)
            break
    loop.wait_for_save()  # the last write lands first
    preempted = bool(stop)
    if not preempted:
        loop.retention.finished()
    seconds = time.perf_counter() - start
    loader.close()
    if trace_path is not None:
        _write_trace(cfg, comm, topo, loop.tracer, trace_path, None if quiet else writer)
    if writer is not None:
        if not quiet:
            if preempted:
                ran = f"stopped after step {step} of {t.steps}"
            elif resumed is not None and first > t.steps:
                ran = (f"no step left to train (the checkpoint is at step {first - 1}, "
                       f"--steps {t.steps})")
            elif first > 1:
                ran = f"steps {first}-{t.steps} ({t.steps - first + 1} trained)"
            else:
                ran = f"{t.steps} steps"
            writer.say(f"done: {ran} in {seconds:.1f} s; metrics in {writer.path}")
        if memory is not None and memory.last and not quiet:
            writer.say(memory.table())
        writer.close()
    wait_for_pruning()  # a daemon thread: ended with the process, it left step-N.pruned
    return Summary(loop.losses, loop.val_losses, loop.accuracy, seconds, preempted,
                   bool(stop & preempt.INTERRUPTED))


@contextmanager
def _phase(tracer: trace.Tracer, name: str):
    """A phase of the start-up (``watchdog.STARTUP``): a span the watchdog times, with
    the spans inside it (``startup_check``'s collective) recorded, so that a stall
    report says who waits there and who has not come."""
    with trace.recording(tracer), tracer.span(name, "other"):
        yield


def _stopped_by(stop: int) -> str:
    """What stopped the run (``stop``: ``preempt.agreed``'s bits), for its last line."""
    if stop & preempt.INTERRUPTED:
        return "interrupted (Ctrl-C)"
    return f"preempted ({preempt.signal_name() or 'signal on another rank'})"


class _Loop:
    """What the training loop keeps from step to step, and the four things it does
    after a step's arithmetic: evaluate, report, save, stop on preemption. Each part
    of a step lives in its own module: the non-finite ``guard``, the checkpoints'
    ``retention`` and ``background`` writer, the ``tracer``; ``writer`` is rank 0's
    metrics writer (None elsewhere)."""

    def __init__(self, cfg: Config, comm, topo: Topology, engine, dp, loader, writer,
                 quiet: bool, sched: dict, tracer: trace.Tracer, after_step,
                 resume_hint: str = "--resume auto"):
        t = cfg.train
        self.cfg, self.comm, self.topo, self.engine, self.dp = cfg, comm, topo, engine, dp
        self.loader, self.writer, self.quiet, self.sched = loader, writer, quiet, sched
        self.after_step, self.resume_hint = after_step, resume_hint
        self.tokens_per_step = t.batch_size * _tokens_per_sample(cfg)
        self.losses: list[float] = []
        self.val_losses: list[float] = []
        self.accuracy: float | None = None
        self.guard = NonFiniteGuard(comm, t.max_skipped_steps)
        self.precision = Precision.from_config(cfg)  # the engine's pieces store in it
        self.retention = Retention(checkpoint_root(t.run_dir), t.keep_checkpoints,
                                   writes=comm.Get_rank() == 0)
        self.background = (BackgroundWriter(topo.ckpt_comm, overlap=True) if t.async_save
                           else None)
        self.tracer = tracer  # the watchdog's too (train)
        self.shares = (ShareBalancer(cfg.parallel, t.batch_size, topo.dp_comm, loader,
                                     multiple=getattr(dp, "unit", None),
                                     model_comm=topo.model_comm)
                       if cfg.parallel.shares != "equal" else None)
        self.step_s = 0.0  # the last step's time
        self.stop_checked = False  # whether the time a stop takes was weighed (preempt)

    @property
    def say_to(self):
        """Where rank 0's optional lines go: the writer, or nowhere when quiet."""
        return None if self.quiet else self.writer

    def step(self, step: int) -> dict[str, Any]:
        """One optimizer step, timed and traced; its metrics record (collective)."""
        t = self.cfg.train
        t0 = time.perf_counter()
        lr = schedule.lr_at(step - 1, **self.sched)
        background = self.background
        with trace.recording(self.tracer):
            self.tracer.step = step
            with trace.span("step", "other"):
                with trace.span("data", "data"):
                    x, y = self.loader.next_batch()
                try:
                    loss, norm = train_step(
                        self.engine, self.dp, x, y, lr=lr, grad_clip=t.grad_clip,
                        guard=self.guard, step=step,
                        before_update=None if background is None else background.captured,
                        share=None if self.shares is None else self.shares.share,
                        scaler=self.precision.scaler)
                except DivergenceError as err:  # every rank: keep the healthy checkpoint
                    self.wait_for_save()
                    where = _healthy(self.retention.diverged(), self.retention)
                    raise DivergenceError(f"{err}{where}") from None
            self.tracer.step = None
        if not self.guard.skipped_last:
            self.retention.finite_step(loss)  # the last checkpoint led to a sane step
        dt = self.step_s = time.perf_counter() - t0
        self.losses.append(loss)
        totals = self.tracer.take_totals()
        shares = {}
        if self.shares is not None:  # this step's shares, then the next step's
            shares = self.shares.metrics()
            self.shares.after_step(step, totals["compute"])
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": norm,
                  "tokens_per_s": self.tokens_per_step / dt, "step_time_s": dt,
                  "time_s": breakdown_over(self.comm, totals), **shares,
                  **self.engine.metrics(), **self.dp.metrics(), **self.guard.metrics(),
                  **self.precision.metrics()}
        if self.after_step is not None:
            record |= self.after_step()
        return record

    def evaluate(self, step: int, val, record: dict[str, Any], alone: bool = False) -> None:
        """The validation loss (and the model's figures, e.g. accuracy) into ``record``
        (collective); ``alone`` (before any step is trained) writes the record at once."""
        record["val_loss"], figures = evaluate(self.cfg, self.engine, val, self.topo.dp_comm)
        self.val_losses.append(record["val_loss"])
        self.accuracy = figures.get("accuracy")
        record |= {f"val_{name}": value for name, value in figures.items()}
        if alone and self.writer is not None:
            self.writer.write(record)
            if not self.quiet:
                shown = " | ".join(f"{name.replace('_', ' ')} {value:.4f}"
                                   for name, value in figures.items())
                self.writer.say(f"step {step}/{self.cfg.train.steps} | val "
                                f"{record['val_loss']:.4f}" + (f" | {shown}" if shown else ""))

    def report(self, record: dict[str, Any]) -> None:
        """Rank 0: the record into metrics.jsonl, and the progress line."""
        if self.writer is None:
            return
        t, step = self.cfg.train, record["step"]
        self.writer.write(record)
        if self.guard.skipped_last and not self.quiet:
            self.writer.say(f"skipped {self.guard.last_problem}: no update")
        if not self.quiet and (step % t.log_interval == 0 or step == 1 or "val_loss" in record):
            unit = "tok/s" if _sample_len(self.cfg) else "samp/s"
            self.writer.say(progress_line(record, t.steps, unit))

    def save(self, step: int, loss: float, say=None) -> Path | None:
        """A checkpoint after ``step`` (collective), pending until confirmed."""
        extra = {"precision": self.precision.state(),  # the name, the storage, fp16's scale
                 "guard": self.guard.state()}  # the skipped steps so far
        if self.shares is not None:
            extra["shares"] = self.shares.state()
        t0 = time.perf_counter()
        saved = _save(self.cfg, self.topo, self.engine, self.dp, self.loader, step,
                      self.sched, self.background, say if say is not None else self.say_to,
                      extra)
        save_s = time.perf_counter() - t0
        self.retention.saved(saved, loss)
        background = self.background
        if background is None or background.write_s:  # an earlier write has landed
            self.check_stop_time(save_s + (0.0 if background is None else background.write_s))
        return saved

    def check_stop_time(self, save_s: float) -> None:
        """Once, rank 0: say so when the launcher would kill a stop (after a signal)
        before its checkpoint is written (``preempt.stop_time_note``)."""
        if self.stop_checked or self.writer is None:
            return
        self.stop_checked = True
        note = preempt.stop_time_note(self.step_s, save_s)
        if note is not None:
            self.writer.say(note)

    def wait_for_save(self) -> bool:
        return _wait_for_save(self.background, self.say_to)

    def stop_preempted(self, step: int, saved, stop: int) -> None:
        """A signal asked the job to stop (``stop``: ``preempt.agreed``'s bits): save
        (if this step did not), let the write land, say so (collective)."""
        if not saved:
            saved = self.save(step, self.losses[-1], say=self.writer)
        saved = _wait_for_save(self.background, self.writer) and saved  # it lands first
        if self.writer is not None:
            what = "checkpoint saved" if saved else "no checkpoint (the state is not finite)"
            self.writer.say(f"{_stopped_by(stop)} after step {step}: {what}; resume with "
                            f"{self.resume_hint}")

    def stop_at_start(self, stop: int) -> None:
        """A signal came during start-up: stop before the first step, with nothing to
        save (a resumed run's checkpoint is still the latest)."""
        if self.writer is not None:
            self.writer.say(f"{_stopped_by(stop)} during start-up: no step trained, nothing "
                            f"saved")
