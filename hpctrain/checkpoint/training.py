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
and a failure on one fails every rank.
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
from hpctrain.checkpoint.reader import Checkpoint
from hpctrain.checkpoint.state import (
    held_tensors,
    layout_of,
    optimizer_step,
    restore_rng,
    rng_states,
    schedule_of,
    set_optimizer_step,
)
from hpctrain.checkpoint.writer import NonFiniteState as NonFiniteState  # raised by save

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


def save_training(cfg: Any, topo: Any, engine: Any, dp: Any, *, step: int,
                  loader_state: dict | None, schedule: dict | None = None,
                  generators: dict | None = None, root: str | Path | None = None,
                  on_event=None, background: Any = None, say=print,
                  keep: int | None = None, extra: dict | None = None) -> Path:
    """Checkpoint the run after ``step`` optimizer steps (collective over the world).

    ``background``: a ``background.BackgroundWriter``; the state is then copied and
    written while training goes on, and the folder it will have is returned (its
    errors, ``NonFiniteState`` included, are raised by the writer's next ``save`` or
    ``wait``). A state with nan or inf raises ``NonFiniteState`` on every rank and
    leaves no checkpoint (see the module docstring). ``say``: rank 0's
    one-line notices (stale folders removed). ``keep``: the complete checkpoints
    to keep, instead of the config's (``retention.NO_PRUNING``: prune nothing).
    ``extra``: more JSON metadata (the batch shares), returned in ``Resumed.meta``."""
    comm = topo.world_comm
    held = held_tensors(engine, dp, topo.tp_rank, topo.tp_size)
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


def config_hint(saved: dict, cfg: Any) -> str:
    """``"; the model config differs: n_layer 2 (checkpoint) vs 4 (config)"``, or ''."""
    mine = cfg.to_dict()["model"]
    diff = [f"{k} {saved.get('model', {}).get(k)!r} (checkpoint) vs {v!r} (config)"
            for k, v in mine.items() if saved.get("model", {}).get(k) != v]
    return f"; the model config differs: {', '.join(diff)}" if diff else ""


def check_share(topo: Any, held: list) -> tuple[int, int]:
    """``(k, n)``: this rank is the k-th of the n ranks of its node that hold the same
    arrays (names, dtypes, shardings), which read the same pieces from one page cache
    and share their checking (``Checkpoint.read_held``). Collective over the node's
    ranks (``topo.node_comm``; none: (0, 1))."""
    node_comm = getattr(topo, "node_comm", None)
    if node_comm is None or node_comm.Get_size() == 1:
        return 0, 1
    key = hashlib.sha256(repr([(h.name, h.array.dtype.str, h.sharding)
                               for h in held]).encode()).hexdigest()
    keys = node_comm.allgather(key)
    same = [r for r, other in enumerate(keys) if other == key]
    return same.index(node_comm.Get_rank()), len(same)


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


def _load_local(path: Path, cfg: Any, held: list, dp: Any, loader: Any,
                generators: dict, share: tuple[int, int] = (0, 1),
                image: bytes | None = None, check_files: bool = True
                ) -> tuple[int, dict, dict, list[str]]:
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
        ckpt.read_held(held, hint, share)
        set_optimizer_step(dp, meta["optimizer"]["t"])
        if hasattr(dp, "after_load"):  # state of its own, beyond the tensors
            dp.after_load()
        restore_rng(generators, meta["rng"]["generators"])
        if loader is not None:
            if meta.get("loader") is None:
                raise CheckpointError(f"{ckpt.index.path}: holds no data loader position")
            loader.load_state_dict(meta["loader"])
        return ckpt.step, meta, dict(meta["schedule"]), sorted(ckpt.tensors)


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
    share = check_share(topo, held)  # a bad piece found by one fails all (all_ranks)
    image = index_image(comm, path)
    check_files = image is None or comm.Get_rank() == 0  # one rank stats the files
    step, meta, sched, stored = writer.all_ranks(
        comm, lambda: _load_local(path, cfg, held, dp, loader, generators or {}, share,
                                  image, check_files), f"loading {path}")
    names = {h.name for h in held}
    if comm.Get_size() > 1:
        names = set().union(*comm.allgather(sorted(names)))
    extra = [name for name in stored if name not in names]
    if extra:
        raise CheckpointError(f"{path}: holds {len(extra)} tensor(s) the model built from "
                              f"the config lacks, e.g. {extra[0]}"
                              f"{config_hint(meta.get('config') or {}, cfg)}")
    return Resumed(path, step, sched, meta)
