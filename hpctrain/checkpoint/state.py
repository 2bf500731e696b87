"""What a rank holds of the training state, as named global tensors and metadata.

``held_tensors(engine, dp, tp_rank, tp_size)`` lists the arrays the checkpoint saves
and loads on this rank, each with its ``Sharding``:

* ``model/<name>``: every parameter of the engine (only this pipeline stage's, named
  as in the full model), whole or this tensor-parallel rank's shard
  (``ShardedParameter``'s ``tp_split``, ``tp_blocks``, ``global_shape``); then, whole,
  the engine's ``named_buffers`` if it has them (BatchNorm's running statistics,
  the same on every data-parallel rank: they are synchronised);
* ``optim/<state>/<name>``: the optimizer's per-parameter state (AdamW ``m`` and
  ``v``, SGD ``momentum_buf``) for the same shard; under ZeRO (``dp.stage`` 1 or 2)
  only the flat slice ``[lo, hi)`` of the shard this data-parallel rank owns, as the
  optimizer names it (``blocks.0.mlp.fc.weight[0:96]``).

The arrays are the live buffers (ZeRO's parameters are views of its flat buffer), so
loading writes into them in place. Metadata (step counter, learning-rate schedule,
random generators, layout) are plain JSON values: no pickle.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpctrain.checkpoint.format import CheckpointError
from hpctrain.checkpoint.reshard import Sharding

_SLICE = re.compile(r"^(?P<name>.+)\[(?P<lo>\d+):(?P<hi>\d+)\]$")


@dataclass(frozen=True)
class Held:
    """One array this rank saves and loads: the global tensor ``name``, which part."""

    name: str
    array: np.ndarray
    sharding: Sharding


def param_sharding(p: Any, tp_rank: int, tp_size: int,
                   flat: tuple[int, int] | None = None) -> Sharding:
    """A (possibly ``ShardedParameter``) parameter's place in its global tensor."""
    split = getattr(p, "tp_split", None)
    return Sharding(tuple(getattr(p, "global_shape", p.shape)), split,
                    getattr(p, "tp_blocks", 1), tp_rank if split is not None else 0,
                    tp_size if split is not None else 1, flat)


def optimizer_entries(optimizer: Any, sliced: bool) -> list[tuple[str, str, tuple | None,
                                                                  np.ndarray]]:
    """``(state, parameter name, flat range or None, live array)`` per state array."""
    if optimizer is None:
        return []
    out = []
    for key, array in optimizer.state_arrays().items():
        if key == "t":
            continue
        state, name = key.split(".", 1)
        flat = None
        if sliced:
            m = _SLICE.match(name)
            if m is None:
                raise ValueError(f"ZeRO optimizer entry {name!r} is not 'name[lo:hi]'")
            name, flat = m["name"], (int(m["lo"]), int(m["hi"]))
        out.append((state, name, flat, array))
    return out


def held_tensors(engine: Any, dp: Any, tp_rank: int, tp_size: int) -> list[Held]:
    """Every array this rank saves and loads (see the module docstring); a data-parallel
    wrapper holding more, or other, state lists it itself (``dp.held_tensors``: the
    averaging strategies, ``hpctrain.parallel.averaging``)."""
    if hasattr(dp, "held_tensors"):
        return dp.held_tensors(engine, tp_rank, tp_size)
    params = dict(engine.named_params)
    held = [Held(f"model/{name}", p.data, param_sharding(p, tp_rank, tp_size))
            for name, p in engine.named_params]
    held += [Held(f"model/{name}", array, param_sharding(array, tp_rank, tp_size))
             for name, array in getattr(engine, "named_buffers", ())]
    sliced = getattr(dp, "stage", 0) > 0
    for state, name, flat, array in optimizer_entries(dp.optimizer, sliced):
        held.append(Held(f"optim/{state}/{name}", array,
                         param_sharding(params[name], tp_rank, tp_size, flat)))
    return held


def optimizer_step(dp: Any) -> int:
    """The optimizer's step counter ``t`` on this rank (-1: it holds no optimizer)."""
    return -1 if dp.optimizer is None else int(dp.optimizer.t)


def set_optimizer_step(dp: Any, t: int) -> None:
    if dp.optimizer is not None:
        dp.optimizer.t = int(t)


def rng_states(generators: dict[str, np.random.Generator]) -> dict[str, dict]:
    """Each generator's ``bit_generator.state``: a dict of ints and strings (JSON)."""
    return {name: g.bit_generator.state for name, g in generators.items()}


def restore_rng(generators: dict[str, np.random.Generator], states: dict[str, dict]) -> None:
    """Put saved states back; a generator the checkpoint lacks is an error."""
    for name, g in generators.items():
        if name not in states:
            raise CheckpointError(f"the checkpoint holds no state for random generator "
                                  f"{name!r} (it has {sorted(states)})")
        g.bit_generator.state = states[name]


def layout_of(cfg: Any, world_size: int) -> dict:
    par = cfg.parallel
    return {"world_size": world_size, "dp": par.dp, "tp": par.tp, "pp": par.pp,
            "sp": par.sp, "zero": par.zero, "schedule": par.schedule,
            "virtual_stages": par.virtual_stages, "sequence_parallel": par.sequence_parallel}


def schedule_of(cfg: Any) -> dict:
    """The learning-rate schedule (``optim.schedule.lr_at``'s keyword arguments)."""
    t = cfg.train
    return {"lr": t.lr, "min_lr": t.min_lr, "warmup_steps": t.warmup_steps,
            "total_steps": t.steps}
