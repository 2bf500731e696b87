"""Data parallelism for slow links: replicas that train apart and average now and then.

Synchronous data parallelism (``data.py``) all-reduces every gradient every step. The
strategies here (``[parallel] averaging``) let each data-parallel rank step its own
optimizer on its own gradient and meet less often, trading staleness for bytes:

    periodic      every H steps the parameters are averaged over the data group
                  (model averaging, Su and Chen 2015; local SGD, Stich 2019)
    post_local    synchronous for the first S steps (gradients all-reduced, so the
                  optimizer states stay equal), then periodic (Lin et al. 2020)
    diloco        periodic's local steps with the inner optimizer; every H steps an
                  outer step on the averaged change (Douillard et al. 2023):
                      delta = anchor - mean_r(params_r)
                      v = mu v + delta
                      anchor -= outer_lr (delta + mu v)            (Nesterov)
                      params_r = anchor
    hierarchical  gradients all-reduced inside each node every step, parameters
                  averaged across nodes every H steps (``Topology.dp_node_comm``)

``anchor`` is the last synchronised parameters: the same on every rank, and what a
checkpoint names ``model/<name>`` (what ``hpctrain ckpt`` inspects and converts: the
model of the last meeting). Each rank's own parameters and optimizer state (they differ between
meetings, and the optimizer states differ for good) are saved as
``local/dp<r>/model/<name>`` and ``local/dp<r>/optim/<state>/<name>``, with the outer
momentum (``averaging/momentum/<name>``) and the position in the period (metadata):
resuming at the same dp and strategy continues bitwise as if never stopped.

Gradients: with a local step, ``train_step`` scales the loss by ``grad_scale`` = 1 (this
rank's mean), with a synchronous one by 1 / (the ranks summed): 1 / dp, or 1 / (ranks
in the node) for hierarchical. The gradient norm and clipping are this rank's. With H
= 1, periodic averaging of SGD with momentum equals synchronous data parallelism (the
average of the ranks' updates is the update of the averaged gradient, momentum being
linear); with AdamW it does not (the update is not linear in the gradient).

Evaluation: each rank evaluates its own parameters, so between meetings the validation
loss is the mean of the replicas' losses, not the loss of their average; evaluate at
meeting steps (an ``eval_interval`` that H divides) to compare with synchronous runs.

Bytes: ``metrics()`` reports ``dp_bytes``, what this rank sent in the step's data-group
collectives by the ring model (an all-reduce of n bytes over p ranks sends 2 (p - 1) /
p n), so strategies compare by the bytes the link carries.

Collective over the data group (and its node groups): every rank calls ``step`` (or,
for a step the non-finite guard skipped on every rank, ``skip_step``) once a step, so
every rank averages at the same steps, and the steps H divides are the meetings
whatever was skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hpctrain import trace
from hpctrain.optim import clip

STRATEGIES = ("sync", "periodic", "post_local", "diloco", "hierarchical")


def ring_bytes(nbytes: int, p: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``nbytes`` over ``p`` ranks."""
    return 2.0 * (p - 1) / p * nbytes if p > 1 else 0.0


@dataclass(frozen=True)
class Schedule:
    """When a strategy communicates (pure: tested without MPI). ``step`` counts from 1."""

    strategy: str
    every: int = 1  # H
    sync_steps: int = 0  # S, post_local only

    def synchronous(self, step: int) -> bool:
        """Whether step ``step`` all-reduces its gradients over the whole data group."""
        return self.strategy == "sync" or (self.strategy == "post_local"
                                           and step <= self.sync_steps)

    def averages(self, step: int) -> bool:
        """Whether the parameters are averaged (or the outer step taken) after ``step``."""
        if self.synchronous(step):
            return False
        start = self.sync_steps if self.strategy == "post_local" else 0
        return (step - start) % self.every == 0


def _pack(arrays: list[np.ndarray], out: np.ndarray) -> np.ndarray:
    start = 0
    for a in arrays:
        out[start:start + a.size] = a.ravel()
        start += a.size
    return out


def _unpack(flat: np.ndarray, arrays: list[np.ndarray]) -> None:
    start = 0
    for a in arrays:
        a[...] = flat[start:start + a.size].reshape(a.shape)
        start += a.size


class LocalDataParallel:
    """The data-parallel wrapper for the local strategies: the interface of
    ``data.DataParallel`` (``zero_grad``, ``finish_grads``, ``grad_norm``, ``clip``,
    ``step``, ``memory``, ``metrics``) plus ``grad_scale`` and the checkpoint hooks
    ``held_tensors``, ``meta`` and ``load_meta`` (module docstring)."""

    stage = 0

    def __init__(self, engine: Any, optimizer: Any, topo: Any, par: Any):
        self.engine, self.optimizer = engine, optimizer
        self.dp_comm, self.node_comm = topo.dp_comm, topo.dp_node_comm
        self.dp_size, self.dp_rank = self.dp_comm.Get_size(), topo.dp_rank
        self.schedule = Schedule(par.averaging, par.average_every, par.sync_steps)
        self.outer_lr, self.outer_momentum = par.outer_lr, par.outer_momentum
        self.params = engine.params
        self.anchor = [p.data.copy() for p in self.params]  # the last synchronised
        self.momentum = ([np.zeros_like(p.data) for p in self.params]
                         if par.averaging == "diloco" else [])
        dtype = np.result_type(*[p.data.dtype for p in self.params])
        self._flat = np.empty(sum(p.size for p in self.params), dtype)
        self.t = 0  # steps taken
        self._bytes = 0.0

    # -----------------------------------------------------------------------------
    # the step, as train_step drives it

    @property
    def grad_scale(self) -> float:
        """The loss scale of the coming step's gradient (module docstring)."""
        step = self.t + 1
        if self.schedule.synchronous(step):
            return 1.0 / self.dp_size
        if self.schedule.strategy == "hierarchical":
            return 1.0 / self.node_comm.Get_size()
        return 1.0

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def finish_grads(self) -> None:
        """Sum the gradients over the data group (a synchronous step) or the node
        (hierarchical), or nothing (a local step)."""
        step = self.t + 1
        if self.schedule.synchronous(step):
            self._sum_into([p.grad for p in self.params], self.dp_comm, "dp_grad_all_reduce")
        elif self.schedule.strategy == "hierarchical":
            self._sum_into([p.grad for p in self.params], self.node_comm,
                           "node_grad_all_reduce")

    def grad_norm(self) -> float:
        return self.engine.grad_norm()

    def clip(self, max_norm: float, norm: float) -> float:
        return clip.clip_grads(self.params, max_norm, norm)

    def step(self, lr: float) -> None:
        """The inner optimizer's step; then, when the period ends, the meeting."""
        self.optimizer.step(lr)
        self._advance()

    def skip_step(self) -> None:
        """A step the non-finite guard skipped (no update) is still a step of the
        period: the meetings fall on the steps the schedule names (and the run's last
        step ends one when ``average_every`` divides the steps), post_local's
        synchronous phase lasts ``sync_steps`` steps. The parameters are those of the
        last step, finite, so a meeting due now takes place."""
        self._advance()

    def _advance(self) -> None:
        self.t += 1
        if self.schedule.averages(self.t):
            if self.schedule.strategy == "diloco":
                self._outer_step()
            else:
                self._average()
            for a, p in zip(self.anchor, self.params, strict=True):
                a[...] = p.data
        elif self.schedule.synchronous(self.t):
            for a, p in zip(self.anchor, self.params, strict=True):
                a[...] = p.data  # the ranks are equal: every step is a meeting

    def _average(self) -> None:
        """params = the mean of every rank's params (collective over the data group)."""
        data = [p.data for p in self.params]
        self._sum_into(data, self.dp_comm, "param_all_reduce")
        for a in data:
            a /= self.dp_size

    def _outer_step(self) -> None:
        """DiLoCo's outer Nesterov step on the averaged change (module docstring)."""
        self._average()
        mu, lr = self.outer_momentum, self.outer_lr
        for anchor, v, p in zip(self.anchor, self.momentum, self.params, strict=True):
            delta = anchor - p.data  # anchor - mean(params)
            v *= mu
            v += delta
            anchor -= lr * (delta + mu * v)
            p.data[...] = anchor

    def _sum_into(self, arrays: list[np.ndarray], comm: Any, name: str) -> None:
        if comm.Get_size() == 1:
            return
        from mpi4py import MPI

        flat = _pack(arrays, self._flat)
        with trace.span(name, "dp_comm", bytes=flat.nbytes):
            comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
        _unpack(flat, arrays)
        self._bytes += ring_bytes(flat.nbytes, comm.Get_size())

    # -----------------------------------------------------------------------------
    # reports

    def memory(self) -> dict[str, int]:
        from hpctrain.parallel.data import state_nbytes

        extra = sum(a.nbytes for a in self.anchor + self.momentum)
        return {"param_bytes": sum(p.data.nbytes for p in self.params),
                "grad_bytes": sum(p.grad.nbytes for p in self.params),
                "optim_bytes": state_nbytes(self.optimizer) + extra}

    def metrics(self) -> dict[str, float]:
        out = {"dp_bytes": self._bytes, "averaged": bool(self.schedule.averages(self.t))}
        self._bytes = 0.0
        return out

    # -----------------------------------------------------------------------------
    # checkpoints (hpctrain.checkpoint.state)

    def held_tensors(self, engine: Any, tp_rank: int, tp_size: int) -> list:
        """``model/`` the anchor, ``local/dp<r>/`` this rank's own parameters and
        optimizer state, ``averaging/momentum/`` DiLoCo's outer momentum."""
        from hpctrain.checkpoint.state import Held, optimizer_entries, param_sharding

        named = engine.named_params
        mine = f"local/dp{self.dp_rank}"
        held = [Held(f"model/{name}", a, param_sharding(p, tp_rank, tp_size))
                for (name, p), a in zip(named, self.anchor, strict=True)]
        held += [Held(f"model/{name}", array, param_sharding(array, tp_rank, tp_size))
                 for name, array in getattr(engine, "named_buffers", ())]
        held += [Held(f"{mine}/model/{name}", p.data, param_sharding(p, tp_rank, tp_size))
                 for name, p in named]
        params = dict(named)
        for state, name, flat, array in optimizer_entries(self.optimizer, False):
            held.append(Held(f"{mine}/optim/{state}/{name}", array,
                             param_sharding(params[name], tp_rank, tp_size, flat)))
        if self.momentum:  # DiLoCo's outer momentum, the same on every rank
            held += [Held(f"averaging/momentum/{name}", v,
                          param_sharding(p, tp_rank, tp_size))
                     for (name, p), v in zip(named, self.momentum, strict=True)]
        return held

    def meta(self) -> dict:
        s = self.schedule
        return {"strategy": s.strategy, "every": s.every, "sync_steps": s.sync_steps,
                "dp": self.dp_size, "t": self.t, "weighted": False}

    def load_meta(self, saved: dict | None, where: str) -> None:
        """Check that the checkpoint's strategy is this one, at this dp, with shares of
        the same kind, and that its step can go on under this schedule (a post_local
        step taken apart is never followed by a synchronous one); take its step."""
        from hpctrain.checkpoint.format import CheckpointError

        mine = self.meta()
        if saved is None:
            raise CheckpointError(f"{where}: was saved by synchronous data parallelism; "
                                  f"averaging {mine['strategy']!r} resumes only its own "
                                  f"checkpoints: resume it with averaging 'sync', or "
                                  f"start afresh (post_local runs synchronously for its "
                                  f"first sync_steps steps, then apart)")
        for key in ("strategy", "dp"):
            if saved[key] != mine[key]:
                raise CheckpointError(f"{where}: was saved with averaging "
                                      f"{saved['strategy']!r} at dp {saved['dp']}; this run "
                                      f"has {mine['strategy']!r} at dp {mine['dp']}: each "
                                      f"rank saved its own state, which resumes only with "
                                      f"the same averaging at the same dp")
        if saved.get("weighted", mine["weighted"]) != mine["weighted"]:  # (older: no key)
            kinds = {False: "shares 'equal'",
                     True: "shares 'fixed' or 'measured' (weighted local SGD)"}
            raise CheckpointError(f"{where}: was saved with averaging {saved['strategy']!r} "
                                  f"and {kinds[saved['weighted']]}; this run has "
                                  f"{kinds[mine['weighted']]}, whose ranks keep other "
                                  f"state: resume it with {kinds[saved['weighted']]}")
        t = int(saved["t"])
        before = Schedule(saved["strategy"], saved["every"], saved["sync_steps"])
        if t > 0 and not before.synchronous(t) and self.schedule.synchronous(t + 1):
            raise CheckpointError(f"{where}: was saved after step {t} of post_local "
                                  f"averaging with sync_steps {before.sync_steps}, when its "
                                  f"replicas had trained apart since step "
                                  f"{before.sync_steps + 1}; sync_steps "
                                  f"{self.schedule.sync_steps} would make step {t + 1} "
                                  f"synchronous again on unequal replicas and optimizer "
                                  f"states: resume with sync_steps at most {t}")
        self.t = t


def check_nodes(par: Any, topo: Any) -> None:
    """Hierarchical averaging needs a data group spread over more than one node, each
    node's part holding the same number of ranks. Every rank sees the same node table,
    so all raise alike, before any collective of training."""
    from hpctrain.config import ConfigError

    if par.averaging != "hierarchical":
        return
    nodes = topo.dp_nodes
    if len(nodes) < 2:
        raise ConfigError(f"averaging 'hierarchical' needs the data group on two or more "
                          f"nodes; its {topo.dp_size} rank(s) share one node (use "
                          f"'periodic', or emulate nodes: hpctrain cluster)")
    sizes = sorted({len(n) for n in nodes})
    if len(sizes) > 1:
        raise ConfigError(f"averaging 'hierarchical' needs as many data-parallel ranks on "
                          f"every node; the nodes hold {[len(n) for n in nodes]}")
