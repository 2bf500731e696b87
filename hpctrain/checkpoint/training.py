"""Saving and resuming a training run: the engine, its optimizer, the data position.

``save_training`` and ``load_training`` are what ``hpctrain.train`` calls; both are
collective over ``topo.world_comm``. A checkpoint saved at one (dp, tp, pp, zero)
layout loads at any other: each rank reads the part of every global tensor its own
layout gives it (``reshard``). ``load_training`` checks, on every rank, that each
tensor of the model is in the checkpoint with the same global shape and dtype, and
then, together, that the checkpoint holds nothing the model lacks.

A state with nan or inf is never committed: ``save_training`` has the writer check
every piece it writes in the same pass as its checksum, while the fsync runs (each
value once, by the rank that writes it; a background save checks its snapshot in its
thread), and ``NonFiniteState`` is raised on every rank, the unfinished folder
removed (by the next ``save`` or ``wait`` of a background save).

A load checks every piece it reads; the data-parallel replicas of one node, which read
the same pieces, share that work (``check_share``, ``reader.Checkpoint.read_held``),
and a failure on one fails every rank. With ``checkpoint_read = "shared"`` the
replicas of the whole job (the ranks that hold the same arrays) also share the
reading: each reads and checks 1/n of the runs they hold alike, and after every rank
has read its share without error, each run is broadcast from its reader to the
others (``read_plan``, ``exchange_runs``): a parallel file system serves the data
once instead of dp times.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain.checkpoint import writer
from hpctrain.checkpoint.format import (
    INDEX_NAME,
    CheckpointError,
    latest_checkpoint,
    resolve,
)
from hpctrain.checkpoint.reader import Checkpoint, read_threads
from hpctrain.checkpoint.state import (
    Held,
    held_tensors,
    layout_of,
    optimizer_step,
    restore_rng,
    rng_states,
    schedule_of,
    set_optimizer_step,
)
from hpctrain.checkpoint.writer import NonFiniteState as NonFiniteState  # raised by save
from hpctrain.config import AVERAGING_USES

CHECKPOINTS = "checkpoints"  # the folder under the run folder


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def find_resume(resume: str, run_dir: str | Path) -> Path | None:
    """The index to resume from: ``"auto"`` is the run's ``latest`` (None: there is
    none yet, start afresh); anything else a checkpoint path (``format.resolve``)."""
    if resume == "auto":
        latest = latest_checkpoint(checkpoint_root(run_dir))
        return None if latest is None else resolve(latest)
    return resolve(resume)


@dataclass(frozen=True)
class Resumed:
    """What a run continues from."""

    path: Path
    step: int
    schedule: dict  # optim.schedule.lr_at's keyword arguments
    meta: dict
    bytes_read: int = 0  # tensor bytes this rank read from the files
    bytes_held: int = 0  # tensor bytes this rank loaded


def save_training(cfg: Any, topo: Any, engine: Any, dp: Any, *, step: int,
                  loader_state: dict | None, schedule: dict | None = None,
                  generators: dict | None = None, root: str | Path | None = None,
                  on_event=None, background: Any = None, say=print,
                  keep: int | None = None, extra: dict | None = None) -> Path:
    """Checkpoint the run after ``step`` optimizer steps (collective over the world).

    ``background``: a ``background.BackgroundWriter``; the state is then copied and
    written while training goes on (the engine's buffers, which the next forward
    moves, copied at once), and the folder it will have is returned (its
    errors, ``NonFiniteState`` included, are raised by the writer's next ``save`` or
    ``wait``). A state with nan or inf raises ``NonFiniteState`` on every rank and
    leaves no checkpoint (see the module docstring). ``say``: rank 0's
    one-line notices (stale folders removed). ``keep``: the complete checkpoints
    to keep, instead of the config's (``retention.NO_PRUNING``: prune nothing).
    ``extra``: more JSON metadata (the batch shares), returned in ``Resumed.meta``."""
    comm = topo.world_comm
    held = held_tensors(engine, dp, topo.tp_rank, topo.tp_size)
    if background is not None:
        held = _still(held, engine)
    t = optimizer_step(dp)
    if comm.Get_size() > 1:
        from mpi4py import MPI

        t = comm.allreduce(t, op=MPI.MAX)  # a ZeRO rank owning only padding has none
    meta = {"config": cfg.to_dict(), "layout": layout_of(cfg, comm.Get_size()),
            "loader": loader_state, "schedule": schedule or schedule_of(cfg),
            "rng": {"init_seed": cfg.train.seed, "generators": rng_states(generators or {})},
            "optimizer": {"kind": cfg.train.optimizer, "t": t}, **(extra or {})}
    if hasattr(dp, "meta"):  # an averaging strategy's position in its period
        meta["averaging"] = dp.meta()
    root = checkpoint_root(cfg.train.run_dir) if root is None else Path(root)
    save = writer.save if background is None else background.save
    return save(root, step, held, meta, comm, stage=topo.pp_rank,
                keep=cfg.train.keep_checkpoints if keep is None else keep,
                on_event=on_event, say=say, finite=True, io=cfg.train.checkpoint_io)


def _still(held: list, engine: Any) -> list:
    """``held`` with the engine's buffers copied: a background snapshot may be taken
    while the next step's forward runs, which reads the parameters and optimizer state
    but moves the buffers (BatchNorm's running statistics, a few numbers a channel)."""
    moving = {f"model/{name}" for name, _ in getattr(engine, "named_buffers", ())}
    return [Held(h.name, h.array.copy(), h.sharding) if h.name in moving else h
            for h in held]


def config_hint(saved: dict, cfg: Any) -> str:
    """``"; the model config differs: n_layer 2 (checkpoint) vs 4 (config)"``, or ''; and
    whether ``pipeline_training`` differs (local training adds auxiliary heads)."""
    mine = cfg.to_dict()["model"]
    diff = [f"{k} {saved.get('model', {}).get(k)!r} (checkpoint) vs {v!r} (config)"
            for k, v in mine.items() if saved.get("model", {}).get(k) != v]
    hint = f"; the model config differs: {', '.join(diff)}" if diff else ""
    was = saved.get("parallel", {}).get("pipeline_training")
    now = cfg.parallel.pipeline_training
    if was is not None and was != now:
        hint += (f"; pipeline_training {was!r} (checkpoint) vs {now!r} (config): local "
                 f"training's auxiliary heads (aux_heads.*) are parameters of their own")
    return hint


# the averaging settings a resume may change: (config field, key in the checkpoint's
# averaging metadata or None: read from its config, the strategies that use it)
AVERAGING_SETTINGS = tuple(
    (name, {"average_every": "every", "sync_steps": "sync_steps"}.get(name), users)
    for name, users in AVERAGING_USES.items())


def averaging_changes(meta: dict, cfg: Any) -> list[tuple[str, Any, Any]]:
    """``(setting, checkpoint's value, this run's)`` for each averaging hyperparameter
    of the run's strategy that a resume changes. A change the strategy cannot go on
    with (another strategy or dp, a post_local step made synchronous again) is refused
    by its ``load_meta``; these it goes on with, from the resumed step: the period
    counts from the last meeting, whose parameters the checkpoint holds (``model/``),
    so DiLoCo's first outer step after a new ``average_every`` spans the steps since
    that meeting, whatever their number."""
    saved = meta.get("averaging")
    if saved is None:
        return []
    par = cfg.parallel
    config = (meta.get("config") or {}).get("parallel", {})
    changes = []
    for name, key, strategies in AVERAGING_SETTINGS:
        if par.averaging not in strategies:
            continue
        old = saved.get(key) if key is not None else None
        old = config.get(name) if old is None else old
        new = getattr(par, name)
        if old is not None and old != new:
            changes.append((name, old, new))
    return changes


def check_share(topo: Any, held: list) -> tuple[int, int]:
    """``(k, n)``: this rank is the k-th of the n ranks of its node that hold the same
    arrays (names, dtypes, shardings), which read the same pieces from one page cache
    and share their checking (``Checkpoint.read_held``). Collective over the node's
    ranks (``topo.node_comm``; none: (0, 1))."""
    node_comm = getattr(topo, "node_comm", None)
    if node_comm is None or node_comm.Get_size() == 1:
        return 0, 1
    key = _holding_key(held)
    keys = node_comm.allgather(key)
    same = [r for r, other in enumerate(keys) if other == key]
    return same.index(node_comm.Get_rank()), len(same)


@dataclass
class ReadPlan:
    """How a rank reads its held arrays: ``own`` alone (the node's replicas that hold
    the same arrays share only the checks: ``own_share``), and ``shared``, the arrays
    every rank of ``group`` holds alike, of which it reads and checks ``share`` and
    receives the rest (``checkpoint_read = "shared"``; group None: nothing shared)."""

    own: list
    own_share: tuple[int, int]
    shared: list
    share: tuple[int, int]
    group: Any
    threads: int | None = None  # read_held's threads (None: as read_held counts them)


def read_plan(topo: Any, held: list, mode: str) -> ReadPlan:
    """The plan of a load (collective over the node's ranks; "shared": over
    ``topo.dp_comm`` too). "each": every rank reads all it holds; "shared": the arrays
    every data-parallel replica holds alike (same name, dtype and sharding: with ZeRO
    0 all of them, with ZeRO 1 or 2 the parameters) are read once across the replicas,
    1/dp by each, and broadcast (``exchange_runs``)."""
    if mode not in ("each", "shared"):
        raise ValueError(f"checkpoint_read ({mode!r}) must be each or shared")
    nodes = getattr(topo, "nodes", None)  # the cores are shared by every rank of a node
    threads = None if nodes is None else read_threads(nodes.ranks_on_node)
    group = getattr(topo, "dp_comm", None)
    if mode == "each" or group is None or group.Get_size() == 1:
        return ReadPlan(held, check_share(topo, held), [], (0, 1), None, threads)
    keys = [_holding_key([h]) for h in held]
    everywhere = set.intersection(*(set(k) for k in group.allgather(keys)))
    # in one order on every replica: each broadcast pairs the same arrays
    shared = [h for k, h in sorted(((k, h) for k, h in zip(keys, held, strict=True)
                                    if k in everywhere), key=lambda kh: kh[0])]
    own = [h for h, k in zip(held, keys, strict=True) if k not in everywhere]
    if not shared:
        return ReadPlan(held, (0, 1), [], (0, 1), None, threads)
    return ReadPlan(own, (0, 1), shared, (group.Get_rank(), group.Get_size()), group,
                    threads)


def exchange_runs(group: Any, runs: list) -> None:
    """Every run broadcast from the replica that read it into the others' arrays
    (``Checkpoint.read_held``'s (arrays, reader) list, the same on every rank of
    ``group``: each holds the same runs). Call only once every rank has read its share
    without error (checked by the caller), so that no rank waits for one that failed."""
    for arrays, owner in runs:
        for array in arrays:
            group.Bcast(array, root=owner)


def _holding_key(held: list) -> str:
    return hashlib.sha256(repr([(h.name, h.array.dtype.str, h.sharding)
                                for h in held]).encode()).hexdigest()


def index_image(comm: Any, path: Path) -> bytes | None:
    """The bytes of the checkpoint's index file ``path`` (``index.h5``), read by rank 0
    alone and broadcast, so that a job of N ranks reads it once from the shared file
    system instead of N times (the benchmark GPT's 231 tensors in pieces of 1,024 ranks:
    an index of 22.6 MB, 1.3 s to parse); rank 0 alone then checks that the files it
    names exist (``load_training``: 1,024 stats, not 1,024 on every rank).
    None for a single rank or a consolidated file (index and data in one, read as
    before). Collective over ``comm``; a failed read fails every rank alike."""
    if comm.Get_size() == 1 or path.name != INDEX_NAME:
        return None
    image = writer.all_ranks(comm, lambda: path.read_bytes() if comm.Get_rank() == 0
                             else None, f"reading {path}")
    return comm.bcast(image, root=0)


@dataclass
class _Read:
    """What a rank's reading of a checkpoint left for the rest of the load."""

    step: int
    meta: dict
    stored: list[str]  # the checkpoint's tensor names
    index: str  # its index file, for messages
    runs: list  # the shared runs and their readers (checkpoint_read "shared")
    bytes_read: int


def _read_local(path: Path, cfg: Any, plan: ReadPlan, dp: Any, image: bytes | None,
                check_files: bool) -> _Read:
    with Checkpoint(path, image, check_files) as ckpt:
        meta = ckpt.meta
        saved = (meta.get("optimizer") or {}).get("kind")
        if saved != cfg.train.optimizer:
            raise CheckpointError(f"{ckpt.index.path}: holds {saved} state, the config "
                                  f"trains with {cfg.train.optimizer}")
        hint = config_hint(meta.get("config") or {}, cfg)
        if hasattr(dp, "load_meta"):
            dp.load_meta(meta.get("averaging"), str(ckpt.index.path))
        elif meta.get("averaging") is not None:
            raise CheckpointError(f"{ckpt.index.path}: was saved with averaging "
                                  f"{meta['averaging']['strategy']!r}, whose ranks hold "
                                  f"their own state: resume it with the same averaging "
                                  f"and dp")
        missing = [h.name for h in plan.own + plan.shared if h.name not in ckpt.tensors]
        if missing:  # with the hint: what in the config makes the model hold it
            raise CheckpointError(f"{ckpt.index.path}: has no tensor {missing[0]} "
                                  f"({len(ckpt.tensors)} tensors){hint}")
        ckpt.read_held(plan.own, hint, plan.own_share, threads=plan.threads)
        runs = ckpt.read_held(plan.shared, hint, plan.share, read_all=False,
                              threads=plan.threads)
        return _Read(ckpt.step, meta, sorted(ckpt.tensors), str(ckpt.index.path), runs,
                     ckpt.bytes_read)


def _restore_local(read: _Read, dp: Any, loader: Any, generators: dict) -> None:
    """The rest of a load, once every held array is filled."""
    meta = read.meta
    set_optimizer_step(dp, meta["optimizer"]["t"])
    if hasattr(dp, "after_load"):  # state of its own, beyond the tensors
        dp.after_load()
    restore_rng(generators, meta["rng"]["generators"])
    if loader is not None:
        if meta.get("loader") is None:
            raise CheckpointError(f"{read.index}: holds no data loader position")
        loader.load_state_dict(meta["loader"])


def load_training(path: str | Path, cfg: Any, topo: Any, engine: Any, dp: Any, *,
                  loader: Any = None, generators: dict | None = None,
                  root: str | Path | None = None, say=print) -> Resumed:
    """Load a checkpoint into this rank's engine, optimizer and loader, whatever layout
    saved it (collective over the world); every rank fails alike. Rank 0 first removes
    the unfinished saves in the run's checkpoints folder (``root``, default
    ``RUN_DIR/checkpoints``: where the run saves next), saying so through ``say``."""
    comm = topo.world_comm
    path = resolve(path)
    root = checkpoint_root(cfg.train.run_dir) if root is None else Path(root)
    writer.all_ranks(comm, lambda: writer.remove_stale(root, say) if comm.Get_rank() == 0
                     else None, f"removing unfinished saves in {root}")
    held = held_tensors(engine, dp, topo.tp_rank, topo.tp_size)
    plan = read_plan(topo, held, cfg.train.checkpoint_read)  # a bad piece fails all
    image = index_image(comm, path)
    check_files = image is None or comm.Get_rank() == 0  # one rank stats the files
    read = writer.all_ranks(comm, lambda: _read_local(path, cfg, plan, dp, image,
                                                      check_files), f"loading {path}")
    if plan.group is not None:  # every rank read its share: none is missing from these
        exchange_runs(plan.group, read.runs)
    writer.all_ranks(comm, lambda: _restore_local(read, dp, loader, generators or {}),
                     f"loading {path}")
    step, meta, stored = read.step, read.meta, read.stored
    names = {h.name for h in held}
    if comm.Get_size() > 1:
        names = set().union(*comm.allgather(sorted(names)))
    extra = [name for name in stored if name not in names]
    if extra:
        raise CheckpointError(f"{path}: holds {len(extra)} tensor(s) the model built from "
                              f"the config lacks, e.g. {extra[0]}"
                              f"{config_hint(meta.get('config') or {}, cfg)}")
    return Resumed(path, step, dict(meta["schedule"]), meta, read.bytes_read,
                   sum(h.array.nbytes for h in held))
