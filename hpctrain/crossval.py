"""``hpctrain cv``: k-fold cross-validation of a ratings model, one training run per fold.

Fold k trains a fresh model (the config's seed) on every fold but k and is evaluated
on fold k after its last step; the figure is the validation RMSE, the square root of
the model's ``val_mse`` over the whole fold (its ``eval_metrics``: the prediction
clipped when the model clips). The runs go one after another on every rank of the
job, each in ``<run_dir>/fold<k>``; rank 0 prints each fold's RMSE, their mean and
standard deviation, and the wall time, and writes them to ``<run_dir>/cv.json``.
Nothing is chosen on the validation folds: every fold runs the config as it is.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import click


def fold_rmse(run_dir: str | Path) -> float:
    """The validation RMSE of a finished run: the last ``val_mse`` in its metrics."""
    from hpctrain.runtime import UserError

    path = Path(run_dir) / "metrics.jsonl"
    mse = [rec["val_mse"] for rec in map(json.loads, path.read_text().splitlines())
           if "val_mse" in rec]
    if not mse:
        raise UserError(f"{path} holds no val_mse: the model reports no mse in "
                        f"eval_metrics, or the run did not evaluate")
    return math.sqrt(mse[-1])


def write_result(run_dir: str | Path, result: dict[str, Any]) -> Path | None:
    """Write ``run_dir/cv.json``; an earlier run's is kept as ``cv.<k>.json`` (the first
    free k), which is returned (None: there was none)."""
    from hpctrain.runtime import UserError

    root = Path(run_dir)
    path, kept = root / "cv.json", None
    try:
        root.mkdir(parents=True, exist_ok=True)
        if path.is_file():
            kept = next(root / f"cv.{k}.json" for k in itertools.count(1)
                        if not (root / f"cv.{k}.json").exists())
            path.rename(kept)
        path.write_text(json.dumps(result, indent=2))
    except OSError as err:
        raise UserError(f"{path}: the result cannot be written ({err.strerror or err}); "
                        f"the folds' runs are in {root}") from None
    return kept


def check_result_path(run_dir: str | Path) -> None:
    """Refuse before any fold trains a ``cv.json`` that could not be written."""
    from hpctrain.runtime import UserError

    path = Path(run_dir) / "cv.json"
    if path.exists() and not path.is_file():
        raise UserError(f"{path} exists and is not a file: cv writes its result there "
                        f"(give another --run-dir, or move it)")


def cross_validate(cfg: Any, comm: Any, folds: list[int], say=print) -> dict[str, Any]:
    """Train ``cfg`` once per fold of ``folds`` (collective over ``comm``); rank 0 returns
    ``{"rmse": [...], "mean", "std", "seconds"}`` (other ranks: the seconds only)."""
    from hpctrain.train import train

    root, rank0 = Path(cfg.train.run_dir), comm.Get_rank() == 0
    rmse, start = [], time.perf_counter()
    for k in folds:
        run = replace(cfg, data=replace(cfg.data, fold=k),
                      train=replace(cfg.train, run_dir=str(root / f"fold{k}")))
        t0 = time.perf_counter()
        train(run, comm, quiet=True)
        if rank0:
            rmse.append(fold_rmse(run.train.run_dir))
            say(f"fold {k}: RMSE {rmse[-1]:.4f} ({time.perf_counter() - t0:.1f} s)")
    seconds = time.perf_counter() - start
    if not rank0:
        return {"seconds": seconds}
    mean = sum(rmse) / len(rmse)
    std = math.sqrt(sum((r - mean) ** 2 for r in rmse) / max(len(rmse) - 1, 1))
    return {"folds": folds, "rmse": rmse, "mean": mean, "std": std, "seconds": seconds,
            "ranks": comm.Get_size()}


@click.command("cv")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="A ratings model's TOML config (e.g. configs/dlrm-movielens.toml).")
@click.option("--folds", type=int, default=None,
              help="Validate on folds 0..N-1 (default: every fold the data file holds).")
@click.option("--steps", type=int, help="Optimizer steps per fold (default: the config's).")
@click.option("--run-dir", type=click.Path(file_okay=False),
              help="Where the folds' runs go, one folder each (default: the config's).")
def cv_command(config_path: str, folds: int | None, steps: int | None,
               run_dir: str | None) -> None:
    """K-fold cross-validation: train on all folds but k, report the RMSE on fold k.

    Every rank runs every fold in turn; rank 0 prints each fold's validation RMSE (the
    square root of val_mse), the mean and the wall time, and writes <run-dir>/cv.json.

    \b
    Examples:
      hpctrain cv --config configs/dlrm-movielens.toml
      mpiexec -n 2 hpctrain cv --config configs/dlrm-movielens.toml --folds 5
    """
    from mpi4py import MPI

    from hpctrain import config as config_mod
    from hpctrain.data.format import RATINGS
    from hpctrain.data.ratings import read_ratings
    from hpctrain.models.registry import model_class
    from hpctrain.runtime import abort_on_error, startup_check

    comm = MPI.COMM_WORLD
    overrides = {k: v for k, v in (("train.steps", steps), ("train.run_dir", run_dir))
                 if v is not None}

    def setup():
        cfg = config_mod.load(config_path, overrides).validate(comm.Get_size())
        reads = model_class(cfg.model.kind).data_format
        if reads != RATINGS:
            raise config_mod.ConfigError(
                f"{config_path}: its model ({cfg.model.kind}) reads {reads} data; hpctrain "
                f"cv validates models of {RATINGS} data on their folds (e.g. "
                f"configs/dlrm-movielens.toml)")
        if cfg.train.eval_interval <= 0:
            raise config_mod.ConfigError(
                f"{config_path}: eval_interval ({cfg.train.eval_interval}) must be > 0: "
                f"cv reads each fold's RMSE from its evaluation after the last step")
        if comm.Get_rank() == 0:
            check_result_path(cfg.train.run_dir)
        held = read_ratings(cfg.data.path).folds
        n = held if folds is None else folds
        if not 1 <= n <= held:
            raise config_mod.ConfigError(f"--folds ({n}) must be between 1 and the {held} "
                                         f"folds {cfg.data.path} holds")
        return cfg, list(range(n))

    with abort_on_error(comm):
        cfg, fold_list = startup_check(comm, setup)
        say = click.echo if comm.Get_rank() == 0 else (lambda _line: None)
        say(f"{len(fold_list)}-fold cross-validation of {config_path} on {comm.Get_size()} "
            f"rank(s), {cfg.train.steps} steps per fold; load {_load()}")
        result = cross_validate(cfg, comm, fold_list, say)
        if comm.Get_rank() == 0:
            result["load_after"] = _load()
            kept = write_result(cfg.train.run_dir, result)
            if kept is not None:
                click.echo(f"an earlier cv.json in {cfg.train.run_dir}: kept as {kept.name}")
            click.echo(f"RMSE per fold: {' '.join(f'{r:.4f}' for r in result['rmse'])}")
            click.echo(f"mean RMSE {result['mean']:.4f} (std {result['std']:.4f}) over "
                       f"{len(fold_list)} folds in {result['seconds']:.1f} s on "
                       f"{comm.Get_size()} rank(s); load {result['load_after']}")

def _load() -> str:
    """The 1, 5 and 15 minute load averages (the machine may be shared)."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"
