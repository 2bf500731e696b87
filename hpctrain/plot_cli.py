"""``hpctrain plot``: loss curves and the executed pipeline schedule as PNG files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import click


@click.command(name="plot")
@click.argument("run", required=False, type=click.Path(exists=True))
@click.option("--trace", "trace_path", type=click.Path(exists=True, dir_okay=False),
              help="Chrome trace from 'hpctrain train --trace': also draw pipeline.png.")
@click.option("--step", type=int, help="Step of the trace to draw (default: the last).")
@click.option("--out", type=click.Path(file_okay=False),
              help="Folder for the PNG files (default: the run folder, or the trace's).")
def plot(run: str | None, trace_path: str | None, step: int | None, out: str | None) -> None:
    """Write RUN/loss.png from RUN/metrics.jsonl (RUN: a run folder or the file; an
    earlier run's metrics.K.jsonl gives loss.K.png), and with --trace, pipeline.png:
    every rank's forward and backward boxes of one step.

    \b
    Examples:
      hpctrain plot runs/demo
      hpctrain plot runs/trace --trace runs/trace/trace.json --step 3
    """
    from hpctrain import plot as plots

    if run is None and trace_path is None:
        raise click.UsageError("give a run folder or metrics.jsonl, or --trace, or both")
    if run is not None:
        metrics = Path(run) / "metrics.jsonl" if Path(run).is_dir() else Path(run)
        if not metrics.is_file():
            raise click.BadParameter(f"{metrics} does not exist (a run folder holds "
                                     f"metrics.jsonl)", param_hint="RUN")
        from hpctrain.metrics import MetricsError, read_metrics

        try:
            records = read_metrics(metrics)
        except MetricsError as err:
            raise click.ClickException(str(err)) from None
        if not records:
            raise click.BadParameter(f"{metrics} has no records", param_hint="RUN")
        folder = Path(out) if out else metrics.parent
        # an earlier run's metrics.K.jsonl (train keeps them so) plots to loss.K.png, with
        # its config.K.json: the current run's loss.png is not replaced
        match = re.fullmatch(r"metrics\.(\d+\.)jsonl", metrics.name)
        kept = match.group(1) if match else ""
        tokens = _counts_tokens(metrics.parent / f"config.{kept}json")
        try:
            click.echo(plots.plot_losses(records, folder / f"loss.{kept}png",
                                         title=str(metrics.parent), tokens=tokens))
        except (ValueError, RuntimeError) as err:
            raise click.ClickException(f"{metrics}: {err}") from None
        except OSError as err:
            raise _unwritable(folder, err) from None
    if trace_path is not None:
        try:
            trace = json.loads(Path(trace_path).read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise click.BadParameter(f"{trace_path} is not a JSON trace ('hpctrain train "
                                     f"--trace' writes one): {err}",
                                     param_hint="--trace") from None
        folder = Path(out) if out else (Path(run) if run and Path(run).is_dir()
                                        else Path(trace_path).parent)
        try:
            click.echo(plots.plot_pipeline(trace, folder / "pipeline.png", step=step))
        except (ValueError, RuntimeError) as err:
            raise click.ClickException(f"{trace_path}: {err}") from None
        except OSError as err:
            raise _unwritable(folder, err) from None


def _unwritable(folder: Path, err: OSError) -> click.ClickException:
    return click.BadParameter(f"{folder}: the PNG cannot be written there "
                              f"({err.strerror or err}); choose another --out",
                              param_hint="--out")


def _counts_tokens(config_path: Path) -> bool:
    """Whether the run's model reads token sequences (its throughput and loss are per
    token), from the run's config.json; True when there is none to read."""
    try:
        kind = json.loads(config_path.read_text(encoding="utf-8"))["model"].get("kind", "gpt")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return True
    from hpctrain.data.format import TOKENS
    from hpctrain.models.registry import MODELS

    cls = MODELS.get(kind)
    return cls is None or cls.data_format == TOKENS
