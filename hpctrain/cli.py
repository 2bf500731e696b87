"""``hpctrain``: the command line, a thin adapter from options to ``hpctrain.train``.

Every rank parses the same options and validates the same config before the first
collective, so a bad value fails alike everywhere and is reported once.
"""

from __future__ import annotations

import sys

import click

from hpctrain import __version__
from hpctrain.bench_cli import bench_command
from hpctrain.check import check_command
from hpctrain.ckpt_cli import ckpt
from hpctrain.cluster.cli import cluster
from hpctrain.config import ConfigError
from hpctrain.crossval import cv_command
from hpctrain.doctor import doctor_command
from hpctrain.plan.calibrate import calibrate_command
from hpctrain.plan.search import plan as plan_command
from hpctrain.plan.tables_calibrate import calibrate_tables_command, plan_tables_command
from hpctrain.plot_cli import plot
from hpctrain.slurm.cli import slurm

# option name -> dotted config field it overrides
OVERRIDES = {
    "dp": "parallel.dp",
    "tp": "parallel.tp",
    "sp": "parallel.sp",
    "pp": "parallel.pp",
    "microbatches": "parallel.microbatches",
    "schedule": "parallel.schedule",
    "virtual_stages": "parallel.virtual_stages",
    "pipeline_training": "parallel.pipeline_training",
    "sequence_parallel": "parallel.sequence_parallel",
    "batch_threads": "parallel.batch_threads",
    "zero": "parallel.zero",
    "reshard_after_forward": "parallel.reshard_after_forward",
    "bucket_mb": "parallel.bucket_mb",
    "dp_reduce": "parallel.dp_reduce",
    "averaging": "parallel.averaging",
    "average_every": "parallel.average_every",
    "sync_steps": "parallel.sync_steps",
    "outer_lr": "parallel.outer_lr",
    "outer_momentum": "parallel.outer_momentum",
    "shares": "parallel.shares",
    "batch_shares": "parallel.batch_shares",
    "steps": "train.steps",
    "lr": "train.lr",
    "seed": "train.seed",
    "run_dir": "train.run_dir",
    "save_interval": "train.save_interval",
    "keep": "train.keep_checkpoints",
    "async_save": "train.async_save",
    "checkpoint_io": "train.checkpoint_io",
    "checkpoint_read": "train.checkpoint_read",
    "stall_timeout": "train.stall_timeout",
    "max_skipped_steps": "train.max_skipped_steps",
    "recompute": "train.recompute",
    "recompute_pieces": "train.recompute_pieces",
    "memory_report": "train.memory_report",
    "precision": "train.precision",
    "loss_scale": "train.loss_scale",
    "grad_comm_dtype": "parallel.grad_comm_dtype",
    "eval_split": "data.eval_split",
    "fold": "data.fold",
}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hpctrain")
def main() -> None:
    """MPI-parallel training of NumPy models.

    \b
    Examples:
      hpctrain train --config configs/gpt-shakespeare.toml
      mpiexec -n 4 hpctrain train --config configs/gpt-shakespeare.toml --tp 2
      hpctrain ckpt verify runs/gpt-shakespeare
      hpctrain bench
    """


def _int_list(value: str, name: str) -> list[int]:
    try:
        return [int(v) for v in value.split(",")]
    except ValueError:
        raise click.BadParameter(f"{value!r} must be integers separated by commas",
                                 param_hint=name) from None


@main.command()
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="TOML file with [model], [parallel], [train] and [data] sections.")
@click.option("--dp", type=int, help="Data-parallel size (default: ranks // (tp * sp * pp)).")
@click.option("--tp", type=int, help="Tensor-parallel size.")
@click.option("--sp", type=int,
              help="Spatial-parallel size: each sample split in slabs over this many ranks "
                   "(convolutional models).")
@click.option("--pp", type=int, help="Pipeline-parallel size (stages).")
@click.option("--microbatches", type=int, help="Microbatches per step and data-parallel rank.")
@click.option("--schedule", type=click.Choice(["gpipe", "1f1b", "interleaved"]),
              help="Pipeline schedule.")
@click.option("--virtual-stages", type=int,
              help="Model chunks per pipeline rank (interleaved schedule).")
@click.option("--pipeline-training", type=click.Choice(["backprop", "local"]),
              help="How pipeline stages learn (pp > 1): backprop end to end (--schedule), or "
                   "local, each stage on its own auxiliary head's loss, activations sent "
                   "forward only.")
@click.option("--sequence-parallel/--no-sequence-parallel", default=None,
              help="Shard LayerNorm and residual activations along the sequence (tp > 1).")
@click.option("--batch-threads", type=int, metavar="N",
              help="Split each microbatch's rows over N threads a rank, each on one BLAS "
                   "thread (1: off, BLAS splits each product; 0: the rank's BLAS threads "
                   "where the layout allows it). Faster where the products are small; one "
                   "gradient copy more a thread. Ranks that run the whole model only (tp = "
                   "pp = sp = 1, ZeRO below 3, fp32, no recompute): N > 1 elsewhere is "
                   "refused.")
@click.option("--zero", type=int,
              help="ZeRO stage: 0 plain data parallelism, 1 shard the optimizer state over "
                   "the data group, 2 shard the gradients too, 3 the parameters too "
                   "(gathered a pipeline piece at a time).")
@click.option("--reshard-after-forward/--no-reshard-after-forward", default=None,
              help="ZeRO-3: free a piece's gathered parameters after its forward and gather "
                   "them again for backward (default), or keep them until the backward.")
@click.option("--bucket-mb", type=float,
              help="Gradient bucket size in MiB: each bucket is reduced as soon as backward "
                   "has finished it.")
@click.option("--dp-reduce", type=click.Choice(["flat", "hierarchical"]),
              help="Gradient sum over the data group: one all-reduce per bucket (flat), or "
                   "reduce in each node, all-reduce among node leaders, broadcast in the "
                   "node (hierarchical; with ZeRO a reduce-scatter and a scatter). Default: "
                   "the config's, flat.")
@click.option("--averaging",
              type=click.Choice(["sync", "periodic", "post_local", "diloco", "hierarchical"]),
              help="How data-parallel replicas meet: sync (all-reduce gradients every step), "
                   "periodic (average parameters every --average-every steps), post_local "
                   "(sync for --sync-steps, then periodic), diloco (an outer Nesterov step "
                   "on the averaged change), hierarchical (sync in a node, periodic across "
                   "nodes).")
@click.option("--average-every", type=int, metavar="H", help="Steps between meetings.")
@click.option("--sync-steps", type=int, metavar="S",
              help="post_local: synchronous steps before the local ones.")
@click.option("--outer-lr", type=float, help="diloco: the outer learning rate.")
@click.option("--outer-momentum", type=float, help="diloco: the outer Nesterov momentum.")
@click.option("--shares", type=click.Choice(["equal", "fixed", "measured"]),
              help="Each data-parallel rank's part of the global batch: equal, fixed "
                   "(--batch-shares) or proportional to its measured speed.")
@click.option("--batch-shares", callback=lambda ctx, param, value: None if value is None
              else _int_list(value, "--batch-shares"), metavar="N,N,...",
              help="Samples of the global batch per data-parallel rank (with --shares fixed).")
@click.option("--steps", type=int, help="Optimizer steps to run.")
@click.option("--lr", type=float, help="Peak learning rate (after warm-up).")
@click.option("--seed", type=int, help="Seed for initialisation and data order.")
@click.option("--run-dir", type=click.Path(file_okay=False),
              help="Folder for metrics.jsonl and config.json.")
@click.option("--save-interval", type=int,
              help="Save a checkpoint every N steps and at the last one (0: never).")
@click.option("--keep", type=int, help="Complete checkpoints to keep (the newest).")
@click.option("--async-save/--no-async-save", default=None,
              help="Copy the state in memory and write the checkpoint from a background "
                   "thread while training goes on (one write in flight).")
@click.option("--checkpoint-io", type=click.Choice(["auto", "mpio", "files"]),
              help="Checkpoint data as one file per rank (files), one shared file written "
                   "through MPI-IO (mpio: needs h5py built with MPI), or mpio when h5py has "
                   "MPI and the job several ranks (auto, the default).")
@click.option("--checkpoint-read", type=click.Choice(["each", "shared"]),
              help="On resume, every rank reads all the checkpoint data it holds (each, the "
                   "default), or data-parallel replicas read 1/n of what they hold alike "
                   "and exchange the rest over MPI (shared: n times fewer bytes from a "
                   "parallel file system).")
@click.option("--stall-timeout", type=float, metavar="SECONDS",
              help="Abort the job, naming the late ranks and what the others wait in, when a "
                   "step, a start-up phase (data, model, checkpoint load) or the work "
                   "between takes longer than this (0: never; default 300).")
@click.option("--recompute", type=click.Choice(["none", "full", "selective", "attention"]),
              help="Activation recomputation: keep each piece's input and run its forward "
                   "again in backward (full), recompute attention's probabilities only "
                   "(selective), or those and q, k, v from qkv's input (attention).")
@click.option("--recompute-pieces", metavar="NAMES",
              callback=lambda ctx, param, value: None if value is None
              else tuple(v.strip() for v in value.split(",") if v.strip()),
              help="Pieces to recompute, by commas: first, middle.K, middle, last "
                   "(default: every middle piece, the GPT's blocks).")
@click.option("--precision", type=click.Choice(["fp32", "bf16", "fp16"]),
              help="Where parameters and activations rest: the model's dtype (fp32), "
                   "bfloat16 or float16, with float32 arithmetic, master weights and "
                   "optimizer state (bf16 needs the ml_dtypes package).")
@click.option("--loss-scale", type=float, metavar="S",
              help="fp16's loss scale: a fixed S, or 0 for the dynamic one (from 2^16, "
                   "halved on an overflow, doubled after 1000 finite steps).")
@click.option("--grad-comm-dtype", type=click.Choice(["fp32", "bf16"]),
              help="Data-parallel gradient sums sent in bfloat16 with float32 sums (half "
                   "the bytes on a slow link), or in float32.")
@click.option("--memory-report/--no-memory-report", default=None,
              help="Trace allocations and print each rank's peak memory by term next to "
                   "the planner's prediction (slows the traced steps).")
@click.option("--max-skipped-steps", type=int,
              help="Stop the run after this many consecutive steps with a non-finite loss "
                   "or gradient norm (each is skipped: no update).")
@click.option("--eval-split", metavar="SPLIT",
              help="The dataset split to evaluate on: 'val' (token streams; ratings: the "
                   "--fold), 'test' "
                   "(images), 'whole' or 'heldout' (volumes). With --resume of a finished "
                   "run, evaluates its checkpoint.")
@click.option("--fold", type=int,
              help="Ratings data: the cross-validation fold to validate on; training reads "
                   "the other folds (default 0).")
@click.option("--resume", metavar="auto|PATH",
              help="Continue from a checkpoint: 'auto' is RUN_DIR/checkpoints/latest (or a "
                   "fresh start if there is none); PATH a run, checkpoints or step folder, "
                   "or a consolidated file. Any parallel layout loads it (a run with "
                   "--averaging other than sync: only the same averaging and dp, shares "
                   "equal or not as saved, and post_local no --sync-steps beyond the "
                   "saved step once local).")
@click.option("--reset-schedule", is_flag=True,
              help="With --resume: follow the config's learning-rate schedule (lr, min_lr, "
                   "warmup_steps, steps) instead of the one saved in the checkpoint, e.g. a "
                   "lower lr after the run diverged.")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False),
              help="Write every rank's timeline of the training steps to this file: Chrome "
                   "trace JSON, one track per rank (open it in ui.perfetto.dev).")
@click.option("--table-plan", type=click.Path(dir_okay=False),
              help="Embedding tables: a plan file (TOML: group, default, [[tables]] name, "
                   "sharding, ranks; hpctrain.parallel.tables) placing each table table-, "
                   "row-, column-wise or replicated, instead of the config's [parallel] "
                   "table_group, table_default and table_sharding.")
@click.option("--quiet", is_flag=True, help="Print nothing but errors.")
def train(config_path: str, quiet: bool, resume: str | None, reset_schedule: bool,
          trace_path: str | None, table_plan: str | None, **options) -> None:
    """Train a model on every rank of the MPI job.

    On SIGUSR1 or SIGTERM every rank finishes its step, a checkpoint is saved and the
    command exits with status 3 (the SLURM template then requeues the job); on Ctrl-C
    the same, with status 130 (a second Ctrl-C stops at once, without saving). A step
    whose loss or gradient norm is nan or inf is skipped on every rank; after
    --max-skipped-steps of them in a row the run stops with status 4, its last
    checkpoint (never written from non-finite state) intact.

    \b
    Examples:
      hpctrain train --config configs/gpt-shakespeare.toml --steps 50
      mpiexec -n 2 hpctrain train --config configs/mlp-fashion-mnist.toml
      mpiexec -n 8 hpctrain train --config configs/gpt-shakespeare.toml --tp 2 --pp 2
      mpiexec -n 4 hpctrain train --config configs/gpt-shakespeare.toml --zero 1
      hpctrain train --config configs/gpt-shakespeare.toml --save-interval 50 --keep 2
      mpiexec -n 4 hpctrain train --config configs/gpt-shakespeare.toml --resume auto
      mpiexec -n 4 hpctrain train --config configs/gpt-shakespeare.toml --tp 2 --pp 2 \\
          --microbatches 4 --steps 5 --trace runs/trace.json
    """
    from hpctrain import preempt

    preempt.install()  # first: SLURM may signal a job that is still starting
    if resume is not None and not resume.strip():  # every rank alike, before MPI starts
        raise click.BadParameter("empty: give 'auto' or a checkpoint's path (omit the "
                                 "option for a fresh run)", param_hint="--resume")
    from mpi4py import MPI

    from hpctrain import config as config_mod
    from hpctrain.runtime import EXIT_INTERRUPTED, abort_on_error, startup_check

    comm = MPI.COMM_WORLD
    preempt.speak(comm.Get_rank() == 0)  # one line for a Ctrl-C, not one a rank
    with abort_on_error(comm):
        cfg = startup_check(
            comm, lambda: config_mod.load(config_path, config_overrides(options, table_plan))
            .validate(comm.Get_size()))
        from hpctrain.train import train as run_training

        summary = run_training(cfg, comm, quiet=quiet, resume=resume,
                               reset_schedule=reset_schedule, trace_path=trace_path)
    preempt.ignore()  # the run is over, saved or finished: a late signal changes nothing
    if summary.interrupted:
        sys.exit(EXIT_INTERRUPTED)  # a Ctrl-C: stopped and saved, not requeued
    if summary.preempted:
        sys.exit(preempt.EXIT_PREEMPTED)  # the batch script requeues the job


def train_params(args: list[str], where: str = "",
                 on_help: str = "holds no training run's options") -> dict:
    """``hpctrain train``'s option words ``args`` parsed by its own parser (the config
    path aside): its parameters, or a ConfigError prefixed by ``where`` (``on_help``
    for a ``--help`` among them)."""
    return command_params(train, "train", args, where, on_help)


def command_params(command: click.Command, name: str, args: list[str], where: str,
                   on_help: str) -> dict:
    """``hpctrain NAME``'s option words ``args`` parsed by ``command``'s own parser (the
    config path aside), as ``train_params`` does for ``train``."""
    prefix = f"{where}: " if where else ""
    try:
        return command.make_context(name, ["--config", "-", *args]).params
    except click.ClickException as err:
        raise ConfigError(f"{prefix}{err.format_message()} (hpctrain {name} --help lists "
                          f"the options)") from None
    except click.exceptions.Exit:  # --help
        raise ConfigError(f"{prefix}{on_help}") from None


def config_overrides(options: dict, table_plan: str | None) -> dict:
    """``hpctrain train``'s options (``OVERRIDES``' names; None: not given) and
    ``--table-plan``'s file as config overrides, dotted field -> value."""
    overrides = {OVERRIDES[k]: v for k, v in options.items()
                 if k in OVERRIDES and v is not None}
    if table_plan is not None:
        from hpctrain.parallel.tables import read_plan

        overrides |= read_plan(table_plan)
    return overrides


main.add_command(bench_command)
main.add_command(calibrate_command)
main.add_command(calibrate_tables_command)
main.add_command(check_command)
main.add_command(ckpt)
main.add_command(cv_command)
main.add_command(doctor_command)
main.add_command(cluster)
main.add_command(plan_command)
main.add_command(plan_tables_command)
main.add_command(plot)
main.add_command(slurm)


def run() -> None:
    """The ``hpctrain`` program: a command, then MPI ended within a time bound if the
    command started it (``runtime.finalize_on_exit``). In-process callers (tests with
    click's ``CliRunner``) call ``main`` and leave MPI as they found it."""
    from hpctrain.runtime import finalize_on_exit

    with finalize_on_exit():
        main()


if __name__ == "__main__":
    run()
