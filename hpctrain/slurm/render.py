"""Fill a job template for one layout, after checking that the layout fits.

A template is a real batch script (``jobscripts/train.sbatch``): it can be submitted
as it is. Rendering rewrites two kinds of lines and leaves every other line alone:

* ``#SBATCH --key=value`` lines (and commented-out ``# #SBATCH`` ones, which are
  switched on when the key is given), and
* default lines of the form ``: "${NAME:=value}"``.

``check_fit`` runs first and refuses a layout that does not match the allocation:
``dp * tp * pp`` must equal ``nodes * ranks_per_node``, and a tensor group must sit on
one node. The run's config, with the options of ``--train-args`` read by ``hpctrain
train``'s own parser, is validated for that rank count too, so a model rule (``tp (3)
must divide n_head (8)``), a misspelt option or a bad value fails here, before anything
is submitted. ``render`` refuses a time limit no longer than the template's preemption
warning (``--signal=B:USR1@120``), which would signal and requeue every attempt as it
starts.

A cross-validation job (``command = "cv"``, the template's ``COMMAND=cv``) runs ``hpctrain
cv``, which takes no layout options: its layout is the config's ``[parallel]`` table,
checked against the allocation as above, and ``--train-args`` holds cv's own options
(``--folds``, ``--steps``), read by cv's parser and checked by cv's rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from hpctrain.config import ConfigError

TEMPLATES = Path(__file__).resolve().parents[2] / "jobscripts"


LAUNCHERS = ("auto", "srun", "mpiexec")
COMMANDS = ("train", "cv")  # what the template's COMMAND runs


@dataclass(frozen=True)
class JobRequest:
    nodes: int
    ranks_per_node: int
    cpus_per_task: int = 1
    time: str = "00:30:00"
    dp: int | None = None
    tp: int = 1
    pp: int = 1
    config: str = "configs/gpt-shakespeare.toml"
    job_name: str = "hpctrain-train"
    partition: str | None = None
    account: str | None = None
    train_args: str = ""  # further options of the command (train's, or cv's)
    hpctrain: str = "hpctrain"
    launcher: str = "auto"  # srun, mpiexec, or auto (train.sbatch says how it chooses)
    command: str = "train"  # or "cv": k-fold cross-validation, the config's layout

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node


def check_fit(req: JobRequest) -> int:
    """Refuse a layout that does not fit the allocation; return the resolved dp."""
    if req.nodes < 1 or req.ranks_per_node < 1 or req.cpus_per_task < 1:
        raise ConfigError(f"nodes ({req.nodes}), ranks per node ({req.ranks_per_node}) and "
                          f"cpus per task ({req.cpus_per_task}) must be at least 1")
    if not _is_time_limit(req.time):
        raise ConfigError(f"time ({req.time!r}) must look like MM, MM:SS, HH:MM:SS, D-HH, "
                          f"D-HH:MM or D-HH:MM:SS, with minutes and seconds 0-59 and hours "
                          f"0-23 after a day count")
    if req.launcher not in LAUNCHERS:
        raise ConfigError(f"launcher ({req.launcher!r}) must be one of {', '.join(LAUNCHERS)}")
    if req.command not in COMMANDS:
        raise ConfigError(f"command ({req.command!r}) must be one of {', '.join(COMMANDS)}")
    given = [f"--{name} {size}" for name, size, unset in
             (("dp", req.dp, None), ("tp", req.tp, 1), ("pp", req.pp, 1)) if size != unset]
    if req.command == "cv" and given:
        raise ConfigError(f"hpctrain cv takes no --dp, --tp or --pp ({', '.join(given)}): it "
                          f"runs the layout of its config's [parallel] table; set them there")
    for name, size in (("dp", req.dp), ("tp", req.tp), ("pp", req.pp)):
        if size is not None and size < 1:  # before dividing by tp * pp
            raise ConfigError(f"{name} ({size}) must be at least 1")
    mp = req.tp * req.pp
    dp = req.dp if req.dp is not None else req.ranks // mp
    if dp * mp != req.ranks:
        raise ConfigError(
            f"dp * tp * pp ({dp} * {req.tp} * {req.pp} = {dp * mp}) must equal the tasks "
            f"allocated, nodes * ranks per node ({req.nodes} * {req.ranks_per_node} = "
            f"{req.ranks})")
    if req.ranks_per_node % req.tp != 0:
        raise ConfigError(
            f"tp ({req.tp}) must divide ranks per node ({req.ranks_per_node}): a tensor "
            f"group must sit on one node")
    return dp


def time_seconds(text: str) -> int:
    """Seconds of a time limit in one of SLURM's forms (``_is_time_limit``): a lone
    field is minutes, two are minutes and seconds, three hours, minutes and seconds;
    after ``D-`` they are hours, minutes and seconds."""
    days, _, clock = text.rpartition("-")
    fields = [int(f) for f in clock.split(":")]
    if days:
        units = (3600, 60, 1)
    else:
        units = {1: (60,), 2: (60, 1), 3: (3600, 60, 1)}[len(fields)]
    return int(days or 0) * 86400 + sum(f * u for f, u in zip(fields, units, strict=False))


def _is_time_limit(text: str) -> bool:
    """SLURM's forms MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS. The leading field
    is unbounded (``90`` is 90 minutes) but for a day's hours; the fields below it are
    minutes or seconds."""
    if not re.fullmatch(r"(\d+-)?\d{1,2}(:\d{2}){0,2}", text):
        return False
    days, _, clock = text.rpartition("-")
    fields = [int(f) for f in clock.split(":")]
    return (not days or fields[0] <= 23) and all(f <= 59 for f in fields[1:])


def check_config(req: JobRequest, dp: int) -> None:
    """Validate the run's config file for this layout and ``--train-args``, as every
    rank would; for cv, its own rules too, and the config's layout for the allocation."""
    from hpctrain import config as config_mod

    if req.command == "cv":
        check_cv(req)
        return
    overrides = {**train_overrides(req.train_args),
                 "parallel.dp": dp, "parallel.tp": req.tp, "parallel.pp": req.pp}
    config_mod.load(req.config, overrides).validate(req.ranks)


# set by the template's cv line (cv --config "$CONFIG" --run-dir "$RUN_DIR" --resume)
CV_OWN_OPTIONS = ("--config", "--run-dir", "--resume")


def check_cv(req: JobRequest) -> None:
    """What ``hpctrain cv`` checks before its first fold, for the job's rank count:
    ``--train-args`` read by cv's own parser, the config with cv's ``--steps`` valid
    at ``req.ranks``, its model one of ratings data that evaluates, its tensor group on
    one node; and ``--folds`` against the data file when it can be read from here (the
    job's folder may differ)."""
    from hpctrain import config as config_mod
    from hpctrain.crossval import check_config as check_cv_config
    from hpctrain.crossval import check_folds

    params = cv_params(req.train_args)
    overrides = {} if params["steps"] is None else {"train.steps": params["steps"]}
    cfg = config_mod.load(req.config, overrides).validate(req.ranks)
    check_cv_config(cfg, req.config)
    if req.ranks_per_node % cfg.parallel.tp != 0:
        raise ConfigError(f"tp ({cfg.parallel.tp}, {req.config}) must divide ranks per node "
                          f"({req.ranks_per_node}): a tensor group must sit on one node")
    if params["folds"] is not None and Path(cfg.data.path).is_file():
        from hpctrain.data.ratings import read_ratings

        check_folds(params["folds"], read_ratings(cfg.data.path).folds, cfg.data.path)
    elif params["folds"] is not None and params["folds"] < 1:
        raise ConfigError(f"--folds ({params['folds']}) must be at least 1")


def cv_params(cv_args: str) -> dict:
    """``hpctrain cv``'s parameters from ``--train-args``, read by its own parser (the
    job's own options refused)."""
    from hpctrain.cli import command_params
    from hpctrain.crossval import cv_command

    args = cv_args.split()
    where = f"--train-args ({cv_args!r})"
    own = next((a for a in args if a.split("=")[0] in CV_OWN_OPTIONS), None)
    if own is not None:
        raise ConfigError(f"{where}: {own.split('=')[0]} is the job's own option: the "
                          f"template runs cv --config CONFIG --run-dir RUN_DIR --resume "
                          f"(give --config to render, RUN_DIR to sbatch)")
    return command_params(cv_command, "cv", args, where,
                          "holds no cross-validation's options")


# set by the job itself, not accepted in --train-args: what to do instead
OWN_OPTIONS = {"--dp": "give it to render (--dp, --tp, --pp, --config)",
               "--tp": "give it to render (--dp, --tp, --pp, --config)",
               "--pp": "give it to render (--dp, --tp, --pp, --config)",
               "--config": "give it to render (--dp, --tp, --pp, --config)",
               # the template's own, after TRAIN_ARGS would win: RUN_DIR silently ignored
               "--run-dir": "the job's folder is RUN_DIR, given to sbatch (RUN_DIR=DIR "
                            "sbatch JOB; default runs/slurm-JOBID)",
               "--resume": "every attempt runs --resume auto in RUN_DIR"}


def train_overrides(train_args: str) -> dict:
    """The config overrides of ``--train-args``, read by ``hpctrain train``'s own option
    parser and split into words as the job script's shell splits them, so that a
    misspelt option or a bad value fails now rather than when the job starts."""
    from hpctrain.cli import config_overrides, train_params

    args = train_args.split()
    where = f"--train-args ({train_args!r})"
    own = next((a.split("=")[0] for a in args if a.split("=")[0] in OWN_OPTIONS), None)
    if own is not None:
        raise ConfigError(f"{where}: {own} is the job's own option: {OWN_OPTIONS[own]}, "
                          f"not in --train-args")
    params = train_params(args, where)
    return config_overrides(params, params.get("table_plan"))


_WARNING = re.compile(r"^#SBATCH --signal=(?:B:)?\w+@(\d+)", re.MULTILINE)


def check_warning(template: str, time: str) -> None:
    """Refuse a time limit no longer than the template's warning (``--signal=...@N``):
    SLURM would signal every attempt as it starts, and the job would requeue, again and
    again, without training."""
    m = _WARNING.search(template)
    if m and time_seconds(time) <= int(m.group(1)):
        raise ConfigError(
            f"time ({time} = {time_seconds(time)} s) must be longer than the template's "
            f"warning ({m.group(0).split()[1]}: the preemption signal {m.group(1)} s before "
            f"the limit), or every attempt is signalled as it starts and requeued")


def render(template: str, req: JobRequest, dp: int) -> str:
    """The template with this request's resources and defaults filled in."""
    check_warning(template, req.time)
    sbatch = {"job-name": req.job_name, "nodes": req.nodes,
              "ntasks-per-node": req.ranks_per_node, "cpus-per-task": req.cpus_per_task,
              "time": req.time, "partition": req.partition, "account": req.account}
    layout = f"--dp {dp} --tp {req.tp} --pp {req.pp}" if req.command == "train" else ""
    defaults = {"CONFIG": req.config, "HPCTRAIN": req.hpctrain, "LAUNCHER": req.launcher,
                "TRAIN_ARGS": f"{layout} {req.train_args}".strip(), "COMMAND": req.command}
    lines, filled = [], set()
    for line in template.splitlines():
        lines.append(_render_line(line, sbatch, defaults, filled))
    needed = ["#SBATCH --nodes", "#SBATCH --ntasks-per-node", "CONFIG", "TRAIN_ARGS",
              *(["COMMAND"] if req.command != "train" else [])]
    if missing := [n for n in needed if n not in filled]:
        shown = [n if n.startswith("#") else f': "${{{n}:=...}}"' for n in missing]
        raise ConfigError(f"the template has no {' or '.join(f'`{x}`' for x in shown)} "
                          f"line: its job would not run the resources, config and layout "
                          f"given here; start from jobscripts/train.sbatch, whose lines "
                          f"render fills")
    return "\n".join(lines) + "\n"


_SBATCH = re.compile(r"^(# )?#SBATCH --([a-z-]+)=(\S+)(.*)$")
_DEFAULT = re.compile(r'^: "\$\{([A-Z_]+):=(.*?)\}"(.*)$')


def _render_line(line: str, sbatch: dict, defaults: dict, filled: set) -> str:
    """``line`` with its value filled in, if it is a line render fills (its name added
    to ``filled``: ``#SBATCH --key`` or the variable's)."""
    m = _SBATCH.match(line)
    if m and sbatch.get(m.group(2)) is not None:
        key, value = m.group(2), str(sbatch[m.group(2)])
        filled.add(f"#SBATCH --{key}")
        # sbatch ends the value at whitespace; a newline would start a line of its own
        if not value or any(c.isspace() or not c.isprintable() for c in value):
            raise ConfigError(f"--{key} ({value!r}) must be non-empty, without whitespace "
                              f"or control characters")
        return _keep_comment_column(line, f"#SBATCH --{key}={value}", m.group(4))
    m = _DEFAULT.match(line)
    if m and m.group(1) in defaults:
        name, value = m.group(1), str(defaults[m.group(1)])
        filled.add(name)
        # the value sits inside double quotes in the script
        if any(c in value for c in '"$`\\'):
            raise ConfigError(f"{name} ({value!r}) must not contain \" $ ` or \\")
        return _keep_comment_column(line, f': "${{{name}:={value}}}"', m.group(3))
    return line


def _keep_comment_column(old: str, code: str, rest: str) -> str:
    """``code`` followed by the old line's trailing comment, in its old column if it fits."""
    comment = rest.lstrip()
    if not comment:
        return code
    column = len(old) - len(comment)
    return f"{code:<{column}}{comment}" if len(code) < column else f"{code}  {comment}"
