"""``hpctrain check``: a config's parallel layout against the serial computation.

The test suite checks every layout of its tiny models against one rank; this checks
the user's own config (a new model, a changed layer, another MPI library, a cluster)
the same way. Every rank of the job trains the config at the layout given (the same
options as ``hpctrain train``) for a few steps; then rank 0 alone trains it on one
rank (``MPI.COMM_SELF``: dp = tp = pp = 1, no ZeRO, one microbatch, its batch on one
thread) on the same data from the same initial parameters, while the other ranks
wait without spinning. Both runs are in float64 by default, so that the order in
which the layout sums is the only difference left: rank 0 compares the loss and the
gradient norm of every step (the loss of step k depends on every update before it)
and prints the largest relative difference against ``--rtol``; the command exits 1
if it is exceeded.

What differs from one rank by design is refused by name (averaging other than
``sync``, local-loss pipelines), and what rounds on purpose is set to the exact
setting for the check and said (reduced precision, bf16 gradient sums). The serial
reference needs the whole model on one rank: check a small version of a large config.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import click

from hpctrain.clitypes import FiniteRange
from hpctrain.cluster.system import alive
from hpctrain.config import Config, ConfigError, ParallelConfig

RTOL = {"float64": 1e-8, "float32": 1e-4}  # --rtol's default for each --dtype

# train's options that check has no use for: it trains from scratch, saves nothing
REFUSED = {"resume": "--resume", "reset_schedule": "--reset-schedule",
           "trace_path": "--trace", "save_interval": "--save-interval", "keep": "--keep",
           "async_save": "--async-save", "checkpoint_io": "--checkpoint-io",
           "checkpoint_read": "--checkpoint-read",
           "memory_report": "--memory-report", "run_dir": "--run-dir", "quiet": "--quiet"}


@dataclass
class Comparison:
    """Step by step: the serial run's and the layout's loss and gradient norm."""

    serial: list[tuple[float, float]]
    layout: list[tuple[float, float]]
    rtol: float

    @staticmethod
    def relative(a: float, b: float) -> float:
        if a == b or (math.isnan(a) and math.isnan(b)):  # both skipped alike: agreed
            return 0.0
        if not (math.isfinite(a) and math.isfinite(b)):
            return math.inf
        return abs(a - b) / max(abs(b), 1e-300)

    def differences(self) -> list[tuple[float, float]]:
        return [(self.relative(lay[0], ser[0]), self.relative(lay[1], ser[1]))
                for ser, lay in zip(self.serial, self.layout, strict=True)]

    @property
    def largest(self) -> float:
        return max((max(d) for d in self.differences()), default=0.0)

    @property
    def first_beyond(self) -> int | None:
        """The first step (1-based) whose loss or gradient norm differs beyond rtol."""
        return next((k + 1 for k, d in enumerate(self.differences()) if max(d) > self.rtol),
                    None)

    def table(self) -> list[str]:
        lines = [f"{'step':>4}  {'serial loss':>20} {'layout loss':>20} {'rel diff':>9}  "
                 f"{'serial gnorm':>14} {'rel diff':>9}"]
        for k, ((sl, sg), (ll, _), (dl, dg)) in enumerate(
                zip(self.serial, self.layout, self.differences(), strict=True)):
            lines.append(f"{k + 1:>4}  {sl:>20.15f} {ll:>20.15f} {dl:>9.1e}  {sg:>14.6e} "
                         f"{dg:>9.1e}")
        return lines


def prepare(cfg: Config, steps: int, dtype: str) -> tuple[Config, Config, list[str]]:
    """The layout's config and the one-rank reference for ``steps`` steps, both in
    ``dtype`` with nothing saved or evaluated; and what was changed for the check.
    Refuses (``ConfigError``) what trains differently from one rank by design."""
    par, t = cfg.parallel, cfg.train
    if par.averaging != "sync":
        raise ConfigError(f"averaging ({par.averaging!r}) trains each replica on its own "
                          f"between meetings, unlike one rank: check compares layouts with "
                          f"averaging = 'sync'")
    if par.pipeline_training != "backprop":
        raise ConfigError(f"pipeline_training ({par.pipeline_training!r}) trains each stage "
                          f"on a loss of its own, unlike one rank: check compares layouts "
                          f"with pipeline_training = 'backprop'")
    from hpctrain.models.registry import model_class

    model_cls = model_class(cfg.model.kind)
    if model_cls.batch_statistics and par.microbatches > 1:
        raise ConfigError(f"the {model_cls.name} takes BatchNorm's statistics per "
                          f"microbatch, so {par.microbatches} microbatches train unlike one "
                          f"rank's whole batch by design: check compares layouts of it "
                          f"with microbatches = 1")
    changed = []
    if cfg.model.dtype != dtype:
        changed.append(f"model dtype {cfg.model.dtype} -> {dtype}")
    if t.precision != "fp32":
        changed.append(f"precision {t.precision} -> fp32 (the model's dtype)")
    if par.grad_comm_dtype != "fp32":
        changed.append(f"grad_comm_dtype {par.grad_comm_dtype} -> fp32")
    train = replace(t, steps=steps, eval_interval=0, save_interval=0, precision="fp32",
                    memory_report=False, async_save=False)
    model = replace(cfg.model, dtype=dtype)
    layout = replace(cfg, model=model, train=train,
                     parallel=replace(par, grad_comm_dtype="fp32"))
    serial = replace(layout, parallel=replace(
        par, dp=1, tp=1, sp=1, pp=1, microbatches=1, virtual_stages=1, schedule="1f1b",
        sequence_parallel=False, zero=0, reshard_after_forward=True, batch_threads=1,
        dp_reduce="flat",
        grad_comm_dtype="fp32", shares="equal", batch_shares=(),
        remeasure_every=ParallelConfig.remeasure_every, table_group=0,
        table_default="replicated", table_sharding=()),
        train=replace(train, recompute="none", recompute_pieces=()))
    return layout, serial, changed


def layout_name(cfg: Config, world: int) -> str:
    """``dp=2 tp=2 pp=1 zero=1 (4 ranks)``: what the layout runs, for the report."""
    from hpctrain.parallel.batch_threads import refusal

    p = cfg.parallel
    parts = [f"dp={p.dp}", f"tp={p.tp}", f"pp={p.pp}"]
    if p.sp > 1:
        parts.append(f"sp={p.sp}")
    if p.pp > 1:
        parts.append(f"{p.schedule} m={p.microbatches}" +
                     (f" v={p.virtual_stages}" if p.virtual_stages > 1 else ""))
    elif p.microbatches > 1:
        parts.append(f"m={p.microbatches}")
    for flag, text in ((p.sequence_parallel, "sequence-parallel"), (p.zero, f"zero={p.zero}"),
                       (p.batch_threads > 1 or (p.batch_threads == 0 and refusal(
                           cfg.model, p, cfg.train) is None),
                        f"batch-threads={p.batch_threads or 'auto'}"),
                       (p.dp_reduce != "flat", f"dp-reduce={p.dp_reduce}"),
                       (p.shares != "equal", f"shares={p.shares}"),
                       (cfg.train.recompute != "none", f"recompute={cfg.train.recompute}")):
        if flag:
            parts.append(text)
    return f"{' '.join(parts)} ({world} rank{'s' if world > 1 else ''})"


def _records(run_dir: Path) -> list[tuple[float, float]]:
    from hpctrain.metrics import read_metrics

    return [(r["loss"], r["grad_norm"]) for r in read_metrics(run_dir / "metrics.jsonl")]


def compare(layout: Config, serial: Config, comm: Any, rtol: float, folder: Path | None,
            say=print) -> Comparison | None:
    """Train ``layout`` on every rank of ``comm``, then ``serial`` on rank 0 alone, in
    run folders under ``folder`` (rank 0's); rank 0 says how long each took and
    returns the comparison."""
    from mpi4py import MPI

    from hpctrain.checkpoint.writer import arrive
    from hpctrain.runtime import status_of
    from hpctrain.train import train

    rank = comm.Get_rank()
    folder = comm.bcast(folder)  # rank 0 writes the metrics; the others see one path
    runs = {k: folder / k for k in ("layout", "serial")}
    ran = train(replace(layout, train=replace(layout.train, run_dir=str(runs["layout"]))),
                comm, quiet=True)
    failed: BaseException | None = None  # rank 0's serial run's end, if not normal
    if rank == 0:
        say(f"the layout: {layout.train.steps} steps in {ran.seconds:.1f} s; now one rank")
        try:
            ran = train(replace(serial, train=replace(serial.train,
                                                      run_dir=str(runs["serial"]))),
                        MPI.COMM_SELF, quiet=True)
        except BaseException as err:  # noqa: BLE001 - the other ranks learn it first
            failed = err
        else:
            say(f"one rank: {serial.train.steps} steps in {ran.seconds:.1f} s")
    arrive(comm)  # the others wait without spinning a core: rank 0's serial run needs it
    # a user error or a divergence of the serial run ends rank 0 alone (its own
    # COMM_SELF run): every rank leaves with its status, rank 0 having said why
    status = comm.bcast(None if failed is None else status_of(failed))
    if failed is not None:
        raise failed
    if status is not None:
        sys.exit(status)
    if rank != 0:
        return None
    return Comparison(_records(runs["serial"]), _records(runs["layout"]), rtol)


FOLDER_PREFIX = "hpctrain-check-"  # then rank 0's pid, "-" and mkdtemp's letters


def make_folder() -> Path:
    """Rank 0's folder for the two runs, named after its process."""
    return Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-"))


def remove_abandoned(temp: str | Path | None = None) -> list[Path]:
    """Remove the folders of earlier checks whose process is gone: a check stopped by
    Ctrl-C or ended by another rank's MPI_Abort cannot remove its own. Returns them."""
    removed = []
    for path in sorted(Path(temp or tempfile.gettempdir()).glob(f"{FOLDER_PREFIX}*-*")):
        pid = path.name[len(FOLDER_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or alive(int(pid)) or not path.is_dir():
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


@click.command("check", context_settings={"ignore_unknown_options": True})
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="The TOML config to check (a small version of a large one: the serial "
                   "reference holds the whole model on one rank).")
@click.option("--steps", type=click.IntRange(1), default=5, show_default=True,
              help="Optimizer steps of each run.")
@click.option("--rtol", type=FiniteRange(0, min_open=True),
              help="Largest relative difference of a step's loss or gradient norm allowed "
                   "(default: 1e-8 in float64, 1e-4 in float32).")
@click.option("--dtype", type=click.Choice(["float64", "float32"]), default="float64",
              show_default=True,
              help="The arithmetic of both runs (float32: a correct layout differs by about "
                   "1e-7 to 1e-5 after a few steps).")
@click.argument("layout_options", nargs=-1, type=click.UNPROCESSED, metavar="[TRAIN OPTIONS]")
def check_command(config_path: str, steps: int, rtol: float | None, dtype: str,
                  layout_options: tuple[str, ...]) -> None:
    """Train a config at a parallel layout and on one rank, and compare them step by step.

    TRAIN OPTIONS are hpctrain train's layout options (--tp, --pp, --zero,
    --microbatches, --sequence-parallel, ...); dp is what the ranks leave. Every rank
    trains the layout; then rank 0 trains the config alone (dp = tp = pp = 1), on the
    same data from the same start. Rank 0 prints each step's loss and gradient norm
    from both, and the largest relative difference; the command exits 1 if it exceeds
    --rtol. Both run in float64 by default, where a correct layout differs by rounding
    only (about 1e-15).

    \b
    Examples:
      mpiexec -n 4 hpctrain check --config configs/gpt-shakespeare.toml --tp 2 --zero 1
      mpiexec -n 4 hpctrain check --config configs/gpt-shakespeare.toml --pp 2 \\
          --microbatches 4 --schedule interleaved --virtual-stages 2
      mpiexec -n 2 hpctrain check --config configs/seg3d-mni152.toml --sp 2 --steps 2
    """
    from mpi4py import MPI

    from hpctrain import config as config_mod
    from hpctrain.cli import config_overrides, train_params
    from hpctrain.runtime import abort_on_error, startup_check

    comm = MPI.COMM_WORLD
    rank0 = comm.Get_rank() == 0
    if rtol is None:
        rtol = RTOL[dtype]

    def setup():
        params = train_params(list(layout_options),
                              on_help="--help is check's own: hpctrain check --help")
        given = [flag for key, flag in REFUSED.items() if params.get(key)]
        if given:
            raise ConfigError(f"{', '.join(given)}: check trains from scratch, saves "
                              f"nothing and prints its own report")
        cfg = config_mod.load(config_path, config_overrides(params, params.get("table_plan")))
        cfg = cfg.validate(comm.Get_size())
        layout, serial, changed = prepare(cfg, steps, dtype)
        serial.validate(1)
        return layout, serial, changed

    with abort_on_error(comm):
        layout, serial, changed = startup_check(comm, setup)
        folder = make_folder() if rank0 else None
        if rank0:
            for path in remove_abandoned():
                click.echo(f"removed {path}: the folder of an earlier check that was "
                           f"stopped before it could remove it")
            click.echo(f"hpctrain check: {config_path} at "
                       f"{layout_name(layout, comm.Get_size())} against one rank, "
                       f"{steps} steps in {dtype}" +
                       (f" ({'; '.join(changed)})" if changed else ""))
        try:
            result = compare(layout, serial, comm, rtol, folder, click.echo)
        finally:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
    differs = comm.bcast(None if result is None else result.first_beyond is not None)
    if result is not None:
        for line in result.table():
            click.echo(line)
        if not differs:
            click.echo(f"equal to one rank: largest relative difference "
                       f"{result.largest:.1e} over {steps} steps (--rtol {rtol:g})")
        else:
            click.echo(f"DIFFERS from one rank from step {result.first_beyond} on: largest "
                       f"relative difference {result.largest:.1e} (--rtol {rtol:g})",
                       err=True)
    if differs:
        raise SystemExit(1)  # every rank: the job's status says it
