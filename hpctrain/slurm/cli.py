"""``hpctrain slurm``: job templates filled for a layout, checked before submission."""

from __future__ import annotations

import os
from pathlib import Path

import click

from hpctrain.config import ConfigError
from hpctrain.slurm.render import (
    COMMANDS,
    TEMPLATES,
    JobRequest,
    check_config,
    check_fit,
    render,
)

# the config a job runs when --config is not given
DEFAULT_CONFIGS = {"train": "configs/gpt-shakespeare.toml", "cv": "configs/dlrm-movielens.toml"}


@click.group("slurm")
def slurm() -> None:
    """SLURM job scripts for hpctrain runs."""


@slurm.command("render")
@click.option("--command", type=click.Choice(COMMANDS), default="train", show_default=True,
              help="What the job runs: hpctrain train, or hpctrain cv (k-fold cross-"
                   "validation of a ratings model; its layout is the config's [parallel] "
                   "table, so no --dp/--tp/--pp, and --train-args holds cv's options).")
@click.option("--nodes", type=int, default=1, show_default=True, help="Nodes to allocate.")
@click.option("--ranks-per-node", type=int, required=True, help="MPI ranks on each node.")
@click.option("--cpus-per-task", type=int, default=1, show_default=True,
              help="Cores per rank (its BLAS threads).")
@click.option("--time", "time_limit", default="00:30:00", show_default=True,
              help="Wall-clock limit, HH:MM:SS.")
@click.option("--dp", type=int, help="Data-parallel size [default: ranks // (tp * pp)].")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel size.")
@click.option("--pp", type=int, default=1, show_default=True, help="Pipeline stages.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help="The run's TOML config (validated for this layout) [default: "
                   f"{DEFAULT_CONFIGS['train']}, for cv {DEFAULT_CONFIGS['cv']}].")
@click.option("--job-name", help="Name shown by squeue [default: hpctrain-train, or "
                                 "hpctrain-cv].")
@click.option("--partition", help="SLURM partition (queue) to run in.")
@click.option("--account", help="SLURM account to charge.")
@click.option("--train-args", default="",
              help='Further options of the command, read by its own parser: train\'s (e.g. '
                   '"--microbatches 4") or cv\'s (e.g. "--folds 5 --steps 200").')
@click.option("--hpctrain", "hpctrain_cmd", default="hpctrain", show_default=True,
              help="The hpctrain command on the compute nodes.")
@click.option("--launcher", type=click.Choice(["auto", "srun", "mpiexec"]), default="auto",
              show_default=True,
              help="Launch with srun (PMI-2), or with mpiexec inside the allocation; auto: "
                   "srun, except mpiexec for a multi-node job of the pip MPICH wheel, whose "
                   "start through srun's pmi2 plugin is unreliable (DEVELOPERS.md).")
@click.option("--template", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=TEMPLATES / "train.sbatch", show_default=True, help="Template to fill.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the script here [default: standard output]; never the --config "
                   "or --template file.")
@click.option("--force", is_flag=True, help="Let -o replace an existing file.")
def render_cmd(template, output, force, command, config_path, job_name, time_limit,
               hpctrain_cmd, **options) -> None:
    """Fill the training template for a layout, refusing one that does not fit.

    \b
    Examples:
      hpctrain slurm render --nodes 2 --ranks-per-node 4 --tp 2 --pp 2 -o job.sbatch
      hpctrain slurm render --ranks-per-node 8 --tp 4 --partition compute --time 02:00:00
      hpctrain slurm render --command cv --ranks-per-node 2 \\
          --config configs/dlrm-movielens.toml --train-args "--folds 5" -o cv.sbatch
    """
    req = JobRequest(command=command, config=config_path or DEFAULT_CONFIGS[command],
                     job_name=job_name or f"hpctrain-{command}", time=time_limit,
                     hpctrain=hpctrain_cmd, **options)
    from hpctrain.data.format import DataError
    from hpctrain.plan.calibrate import check_replaceable

    try:
        text = template.read_text()
    except UnicodeDecodeError:
        raise click.BadParameter(f"{template}: is not a text file (a job script template "
                                 f"with {{placeholders}})", param_hint="'--template'") from None
    try:
        dp = check_fit(req)
        check_config(req, dp)
        script = render(text, req, dp)
    except (ConfigError, DataError) as err:  # bad input: a usage error, exit 2
        raise click.UsageError(str(err)) from None
    if output is None:
        click.echo(script, nl=False)
    else:
        # as plan --emit's output, but in a folder that exists (none is made for it)
        check_replaceable(output, "-o", force, {"--template": template,
                                                "--config": req.config})
        tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
        try:  # whole or not at all: a new file renamed over the old one
            tmp.write_text(script)
            tmp.chmod(0o755)
            os.replace(tmp, output)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            raise click.BadParameter(f"cannot write {output}: {err.strerror or err}",
                                     param_hint="'-o' / '--output'") from None
        layout = (f"dp={dp} tp={req.tp} pp={req.pp}" if command == "train"
                  else f"hpctrain cv at {req.config}'s layout")
        click.echo(f"wrote {output}: {req.nodes} node(s) x {req.ranks_per_node} ranks, "
                   f"{layout}; submit with: sbatch {output}", err=True)
