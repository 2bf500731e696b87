"""``hpctrain cv``: k-fold cross-validation of a ratings model, one training run per fold.

Fold k trains a fresh model (the config's seed) on every fold but k and is evaluated
on fold k after its last step; the figure is the validation RMSE, the square root of
the model's ``val_mse`` over the whole fold (its ``eval_metrics``: the prediction
clipped when the model clips). The runs go one after another on every rank of the
job, each in ``<run_dir>/fold<k>``; rank 0 prints each fold's RMSE, their mean and
standard deviation, and the wall time, and writes them to ``<run_dir>/cv.json``.
Nothing is chosen on the validation folds: every fold runs the config as it is.

Preemption works as for ``hpctrain train`` (``hpctrain.preempt``): on SIGUSR1 or
SIGTERM the fold in training saves a checkpoint after its step and the command exits
with ``preempt.EXIT_PREEMPTED`` (Ctrl-C: ``runtime.EXIT_INTERRUPTED``). The same
command with ``--resume`` then continues: a fold whose run finished with this config
(its ``config.json`` equal to the fold's, an evaluation at its last step) is read,
not trained again; the fold that was stopped resumes from its latest checkpoint, its
loss curve that of an uninterrupted run; the rest train. A fold's earlier run made
with another config is refused before any fold trains, as is a fresh cross-validation
(no ``--resume``) whose folds would overwrite an earlier one's checkpoints.

Two cross-validations in one folder are not: the command holds ``<run_dir>`` by its
lock file (``hpctrain.runlock``) from before it reads the folds' folders until it
ends, and each fold's run holds its own folder, as ``train`` does.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
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


def fold_config(cfg: Any, k: int) -> Any:
    """The config of fold k's run: validated on fold k, in ``<run_dir>/fold<k>``."""
    return replace(cfg, data=replace(cfg.data, fold=k),
                   train=replace(cfg.train, run_dir=str(Path(cfg.train.run_dir) / f"fold{k}")))


def finished_rmse(run_dir: str | Path, steps: int) -> float | None:
    """A fold's validation RMSE if its run evaluated after step ``steps`` (its last),
    else None (not started, or stopped before its end)."""
    from hpctrain.metrics import read_metrics

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    last = [r for r in read_metrics(path) if "val_mse" in r]
    if not last or last[-1].get("step") != steps:
        return None
    return math.sqrt(last[-1]["val_mse"])


def differences(saved: Any, wanted: Any, where: str = "") -> list[str]:
    """The dotted keys at which two configs as JSON differ: ``train.steps (3, not 5)``."""
    if isinstance(saved, dict) and isinstance(wanted, dict):
        return [d for key in sorted(set(saved) | set(wanted))
                for d in differences(saved.get(key), wanted.get(key),
                                     f"{where}.{key}" if where else key)]
    return [] if saved == wanted else [f"{where} ({saved!r}, not {wanted!r})"]


def earlier_folds(cfg: Any, folds: list[int], resume: bool) -> dict[int, float]:
    """What the folds' run folders already hold, checked before any fold trains (rank
    0): with ``resume``, the RMSE of each fold whose run finished with this config; a
    fold's run made with another config is refused. Without it, a fold whose
    checkpoints a fresh run would overwrite is refused (``train`` refuses that too,
    but only when that fold's turn comes, after the folds before it trained)."""
    from hpctrain.checkpoint.format import latest_checkpoint
    from hpctrain.checkpoint.training import checkpoint_root
    from hpctrain.metrics import MetricsError
    from hpctrain.runtime import UserError

    done = {}
    for k in folds:
        run = fold_config(cfg, k)
        folder = Path(run.train.run_dir)
        if not resume:
            latest = latest_checkpoint(checkpoint_root(folder))
            if latest is not None and run.train.save_interval:
                raise UserError(f"{folder} holds fold {k}'s checkpoints from an earlier "
                                f"cross-validation (latest: {latest.name}): continue it with "
                                f"--resume, or give another --run-dir")
            continue
        saved = folder / "config.json"
        if not saved.is_file():
            continue  # not started
        try:
            found = json.loads(saved.read_text())
        except (OSError, ValueError) as err:
            raise UserError(f"{saved}: fold {k}'s earlier config cannot be read ({err}); "
                            f"move the folder away or give another --run-dir") from None
        wanted = json.loads(json.dumps(run.to_dict()))
        if changed := differences(found, wanted):
            raise UserError(f"{folder}: fold {k}'s earlier run had another config "
                            f"({'; '.join(changed[:3])}{'; ...' if len(changed) > 3 else ''})"
                            f": --resume continues the same cross-validation; run without "
                            f"it in another --run-dir")
        try:
            rmse = finished_rmse(folder, run.train.steps)
        except MetricsError as err:
            raise UserError(str(err)) from None
        if rmse is not None:
            done[k] = rmse
    return done


def cross_validate(cfg: Any, comm: Any, folds: list[int], say=print,
                   done: dict[int, float] | None = None) -> dict[str, Any]:
    """Train ``cfg`` once per fold of ``folds`` (collective over ``comm``), each run
    resumed from its latest checkpoint if it has one when ``done`` is given (the RMSE of
    the folds finished earlier, which are not trained again: ``earlier_folds``). Rank 0
    returns ``{"rmse": [...], "mean", "std", "seconds", "earlier"}`` (other ranks: the
    seconds only); a run stopped by a signal ends the loop: ``"stopped"`` holds its
    fold and ``"stop"`` the ``train.Summary`` (every rank)."""
    from hpctrain.train import train

    rank0 = comm.Get_rank() == 0
    rmse, start = [], time.perf_counter()
    for k in folds:
        if done is not None and k in done:
            rmse.append(done[k])
            say(f"fold {k}: RMSE {rmse[-1]:.4f} (finished earlier)")
            continue
        run = fold_config(cfg, k)
        t0 = time.perf_counter()
        summary = train(run, comm, quiet=True, resume=None if done is None else "auto",
                        resume_hint="--resume")
        if summary.preempted:
            return {"stopped": k, "stop": summary, "seconds": time.perf_counter() - start}
        if rank0:
            rmse.append(fold_rmse(run.train.run_dir))
            say(f"fold {k}: RMSE {rmse[-1]:.4f} ({time.perf_counter() - t0:.1f} s)")
    seconds = time.perf_counter() - start
    if not rank0:
        return {"seconds": seconds}
    mean = sum(rmse) / len(rmse)
    std = math.sqrt(sum((r - mean) ** 2 for r in rmse) / max(len(rmse) - 1, 1))
    return {"folds": folds, "rmse": rmse, "mean": mean, "std": std, "seconds": seconds,
            "ranks": comm.Get_size(), "earlier": sorted(done or {})}


@click.command("cv")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="A ratings model's TOML config (e.g. configs/dlrm-movielens.toml).")
@click.option("--folds", type=int, default=None,
              help="Validate on folds 0..N-1 (default: every fold the data file holds).")
@click.option("--steps", type=int, help="Optimizer steps per fold (default: the config's).")
@click.option("--run-dir", type=click.Path(file_okay=False),
              help="Where the folds' runs go, one folder each (default: the config's).")
@click.option("--resume", is_flag=True,
              help="Continue a cross-validation stopped by a signal in --run-dir: folds "
                   "finished with this config are read, not trained again; the stopped "
                   "fold resumes from its latest checkpoint.")
def cv_command(config_path: str, folds: int | None, steps: int | None,
               run_dir: str | None, resume: bool) -> None:
    """K-fold cross-validation: train on all folds but k, report the RMSE on fold k.

    Every rank runs every fold in turn; rank 0 prints each fold's validation RMSE (the
    square root of val_mse), the mean and the wall time, and writes <run-dir>/cv.json.
    On SIGUSR1 or SIGTERM the fold in training saves a checkpoint after its step and
    the command exits with status 3 (Ctrl-C: 130); the same command with --resume
    continues where it stopped.

    \b
    Examples:
      hpctrain cv --config configs/dlrm-movielens.toml
      mpiexec -n 2 hpctrain cv --config configs/dlrm-movielens.toml --folds 5
      mpiexec -n 2 hpctrain cv --config configs/dlrm-movielens.toml --resume
    """
    from hpctrain import preempt

    preempt.install()  # first: SLURM may signal a job that is still starting
    from mpi4py import MPI

    from hpctrain import config as config_mod
    from hpctrain import runlock
    from hpctrain.data.ratings import read_ratings
    from hpctrain.runtime import EXIT_INTERRUPTED, abort_on_error, startup_check

    comm = MPI.COMM_WORLD
    preempt.speak(comm.Get_rank() == 0)
    overrides = {k: v for k, v in (("train.steps", steps), ("train.run_dir", run_dir))
                 if v is not None}

    def setup():
        cfg = config_mod.load(config_path, overrides).validate(comm.Get_size())
        check_config(cfg, config_path)
        held = read_ratings(cfg.data.path).folds
        n = held if folds is None else folds
        check_folds(n, held, cfg.data.path)
        return cfg, list(range(n))

    def earlier(cfg, fold_list):
        check_result_path(cfg.train.run_dir)
        return earlier_folds(cfg, fold_list, resume)

    rank0 = comm.Get_rank() == 0
    say = click.echo if rank0 else (lambda _line: None)
    with abort_on_error(comm):
        cfg, fold_list = startup_check(comm, setup)
        # the folder first (each fold's run then holds its own): a live cross-validation's
        # folds are no earlier one's
        with runlock.held(comm, cfg.train.run_dir, "cv", say):
            done = startup_check(comm, lambda: earlier(cfg, fold_list) if rank0 else None)
            done = comm.bcast(done, root=0) if resume else None
            result = _cross_validate_and_report(cfg, comm, fold_list, done, config_path, say)
    preempt.ignore()  # the folds are over, saved or finished: a late signal changes nothing
    if "stopped" in result:
        sys.exit(EXIT_INTERRUPTED if result["stop"].interrupted else preempt.EXIT_PREEMPTED)


def check_config(cfg: Any, config_path: str) -> None:
    """cv's rules for a config already validated: a model of ratings data (the folds
    are a ratings file's), evaluated (each fold's RMSE is its last evaluation's)."""
    from hpctrain.config import ConfigError
    from hpctrain.data.format import RATINGS
    from hpctrain.models.registry import model_class

    reads = model_class(cfg.model.kind).data_format
    if reads != RATINGS:
        raise ConfigError(f"{config_path}: its model ({cfg.model.kind}) reads {reads} data; "
                          f"hpctrain cv validates models of {RATINGS} data on their folds "
                          f"(e.g. configs/dlrm-movielens.toml)")
    if cfg.train.eval_interval <= 0:
        raise ConfigError(f"{config_path}: eval_interval ({cfg.train.eval_interval}) must be "
                          f"> 0: cv reads each fold's RMSE from its evaluation after the last "
                          f"step")


def check_folds(n: int, held: int, data_path: str) -> None:
    """``--folds`` against the folds the ratings file holds."""
    from hpctrain.config import ConfigError

    if not 1 <= n <= held:
        raise ConfigError(f"--folds ({n}) must be between 1 and the {held} folds {data_path} "
                          f"holds")


def _cross_validate_and_report(cfg: Any, comm: Any, fold_list: list[int],
                               done: dict[int, float] | None, config_path: str,
                               say) -> dict[str, Any]:
    """``cross_validate`` with rank 0's lines around it and ``cv.json`` written."""
    say(f"{len(fold_list)}-fold cross-validation of {config_path} on {comm.Get_size()} "
        f"rank(s), {cfg.train.steps} steps per fold; load {_load()}")
    if done is not None:
        say(f"--resume: {len(done)} fold(s) finished earlier in {cfg.train.run_dir}"
            + (f" ({', '.join(map(str, sorted(done)))})" if done else ""))
    result = cross_validate(cfg, comm, fold_list, say, done)
    if "stopped" in result:
        say(f"cross-validation stopped in fold {result['stopped']}; its run and the "
            f"finished folds are kept in {cfg.train.run_dir}: run the same command "
            f"with --resume to continue")
    elif comm.Get_rank() == 0:
        result["load_after"] = _load()
        kept = write_result(cfg.train.run_dir, result)
        if kept is not None:
            say(f"an earlier cv.json in {cfg.train.run_dir}: kept as {kept.name}")
        say(f"RMSE per fold: {' '.join(f'{r:.4f}' for r in result['rmse'])}")
        earlier = (f" ({len(result['earlier'])} of them finished earlier)"
                   if result["earlier"] else "")
        say(f"mean RMSE {result['mean']:.4f} (std {result['std']:.4f}) over "
            f"{len(fold_list)} folds{earlier} in {result['seconds']:.1f} s on "
            f"{comm.Get_size()} rank(s); load {result['load_after']}")
    return result


def _load() -> str:
    """The 1, 5 and 15 minute load averages (the machine may be shared)."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"
