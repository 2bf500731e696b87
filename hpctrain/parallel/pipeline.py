"""Pipeline parallelism: GPipe, 1F1B and interleaved 1F1B over the stages of ``pp_comm``.

Each pipeline rank holds one model chunk (or ``v`` of them, interleaved; ``stages``
says which) and runs a *schedule*: the order in which it pushes the ``m`` microbatches
of its batch forward and their gradients backward. A schedule is a plain function of
a stage and ``m``, calling six verbs; the stage does the rest:

    x  = stage.recv_forward(i, c)       activation of microbatch i into local chunk c
    y  = stage.forward_step(i, x, c)    run the chunk, keep its cache
         stage.send_forward(i, y, c)    to the next chunk
    dy = stage.recv_backward(i, c)      gradient of the chunk's output
    dx = stage.backward_step(i, dy, c)  run the chunk backward, drop its cache
         stage.send_backward(i, dx, c)  to the previous chunk

The verbs are ``p2p``'s non-blocking transfers; at the model's ends they do nothing
(the first chunk reads tokens, the last one computes the loss). ``timeline`` records
the calls of every rank without MPI, replays them to prove there is no deadlock, and
drew the diagrams below (forward 1 unit, backward 2, ``F3`` = forward of microbatch 3,
``B3==`` its backward, ``..`` idle; lower case is a rank's second chunk).

``PipelineEngine`` is the Engine (see ``engine.py``) for ``pp > 1``: collective over
``pp_comm`` in every call, over ``model_comm`` in ``grad_norm``.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hpctrain import trace
from hpctrain.optim import clip
from hpctrain.parallel import stages
from hpctrain.parallel.p2p import P2P
from hpctrain.parallel.timeline import bubble_theory

# ---------------------------------------------------------------------------------
# the schedules


def gpipe(stage, m: int) -> None:
    """All forwards, then all backwards: every stage holds all ``m`` caches at once.

    pp = 4, m = 4; bubble (p - 1) / (m + p - 1) = 3/7::

        rank 0 |F1F2F3F4..................B1==B2==B3==B4==
        rank 1 |..F1F2F3F4............B1==B2==B3==B4==....
        rank 2 |....F1F2F3F4......B1==B2==B3==B4==........
        rank 3 |......F1F2F3F4B1==B2==B3==B4==............
    """
    # forwards: fill the pipeline with every microbatch
    for i in range(m):
        x = stage.recv_forward(i)
        y = stage.forward_step(i, x)
        stage.send_forward(i, y)
    # backwards: drain it, in the same order
    for i in range(m):
        dy = stage.recv_backward(i)
        dx = stage.backward_step(i, dy)
        stage.send_backward(i, dx)


def one_f_one_b(stage, m: int) -> None:
    """1F1B (PipeDream-flush): warm-up, steady one-forward-one-backward, cool-down.

    Stage r runs ``p - r - 1`` forwards ahead, then alternates, so it never holds
    more than ``p - r`` caches (GPipe: m). Same bubble as GPipe. pp = 4, m = 8; bubble
    3/11::

        rank 0 |F1F2F3F4............B1==F5B2==F6B3==F7B4==F8B5==..B6==..B7==..B8==
        rank 1 |..F1F2F3........B1==F4B2==F5B3==F6B4==F7B5==F8B6==..B7==..B8==....
        rank 2 |....F1F2....B1==F3B2==F4B3==F5B4==F6B5==F7B6==F8B7==..B8==........
        rank 3 |......F1B1==F2B2==F3B3==F4B4==F5B5==F6B6==F7B7==F8B8==............
    """
    warmup = min(stage.pp_size - stage.pp_rank - 1, m)
    steady = m - warmup
    # warm-up: forwards only, until the first gradient can come back
    for i in range(warmup):
        x = stage.recv_forward(i)
        y = stage.forward_step(i, x)
        stage.send_forward(i, y)
    # steady state: the forward of microbatch warmup + j, then the backward of j
    for j in range(steady):
        i = warmup + j
        x = stage.recv_forward(i)
        y = stage.forward_step(i, x)
        stage.send_forward(i, y)
        dy = stage.recv_backward(j)
        dx = stage.backward_step(j, dy)
        stage.send_backward(j, dx)
    # cool-down: the backwards still owed
    for j in range(steady, m):
        dy = stage.recv_backward(j)
        dx = stage.backward_step(j, dy)
        stage.send_backward(j, dx)


def interleaved(stage, m: int) -> None:
    """Megatron's interleaved 1F1B: ``v`` chunks per rank, microbatches in groups of p.

    Forward slot ``s`` is microbatch ``(s // (p v)) p + s % p`` through local chunk
    ``(s % (p v)) // p``; backward slots run the chunks in reverse. Stage r warms up
    with ``2 (p - r - 1) + (v - 1) p`` forwards. Needs ``m % p == 0``. The bubble shrinks
    by about v: pp = 4, v = 2, m = 4 (a unit is now half a stage), bubble 3/11::

        rank 0 |F1F2F3F4f1f2f3f4............b1==..b2==..b3==..b4==B1==B2==B3==B4==
        rank 1 |..F1F2F3F4f1f2f3f4......b1==..b2==..b3==..b4==B1==B2==B3==B4==....
        rank 2 |....F1F2F3F4f1f2f3..b1==f4b2==..b3==..b4==B1==B2==B3==B4==........
        rank 3 |......F1F2F3F4f1b1==f2b2==f3b3==f4b4==B1==B2==B3==B4==............
    """
    p, r, v = stage.pp_size, stage.pp_rank, stage.virtual_stages
    total = m * v
    warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
    steady = total - warmup
    # warm-up: forwards only, through every chunk of the first groups
    for s in range(warmup):
        c, i = forward_slot(s, p, v)
        x = stage.recv_forward(i, c)
        y = stage.forward_step(i, x, c)
        stage.send_forward(i, y, c)
    # steady state: forward slot warmup + s, then backward slot s
    for s in range(steady):
        c, i = forward_slot(warmup + s, p, v)
        x = stage.recv_forward(i, c)
        y = stage.forward_step(i, x, c)
        stage.send_forward(i, y, c)
        c, i = backward_slot(s, p, v)
        dy = stage.recv_backward(i, c)
        dx = stage.backward_step(i, dy, c)
        stage.send_backward(i, dx, c)
    # cool-down: the backward slots still owed
    for s in range(steady, total):
        c, i = backward_slot(s, p, v)
        dy = stage.recv_backward(i, c)
        dx = stage.backward_step(i, dy, c)
        stage.send_backward(i, dx, c)


def forward_only(stage, m: int) -> None:
    """Evaluation: every forward slot in order, no caches kept (any schedule's order)."""
    p, v = stage.pp_size, stage.virtual_stages
    for s in range(m * v):
        c, i = forward_slot(s, p, v)
        x = stage.recv_forward(i, c)
        y = stage.forward_step(i, x, c)
        stage.send_forward(i, y, c)


def forward_slot(s: int, p: int, v: int) -> tuple[int, int]:
    """Forward slot ``s`` -> (local chunk, microbatch)."""
    group, within = divmod(s, p * v)
    return within // p, group * p + within % p


def backward_slot(s: int, p: int, v: int) -> tuple[int, int]:
    """Backward slot ``s`` -> (local chunk, microbatch): chunks last to first."""
    c, i = forward_slot(s, p, v)
    return v - 1 - c, i


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved}


def peak_caches(schedule: str, p: int, m: int, v: int = 1) -> tuple[int, ...]:
    """Per pipeline rank, the most microbatch caches a schedule holds at once (what
    ``timeline.peak_live`` counts on its recorded order), without recording it: GPipe
    holds all ``m``; 1F1B and interleaved hold their warm-up's forwards plus the one
    forward of the steady state before its first backward (all of them if there is no
    steady state)."""
    if schedule == "gpipe":
        return (m,) * p
    if schedule == "1f1b":
        return tuple(min(p - r, m) for r in range(p))
    if schedule == "interleaved":
        total = m * v
        return tuple(min(2 * (p - r - 1) + (v - 1) * p + 1, total) for r in range(p))
    raise ValueError(f"schedule ({schedule!r}) must be one of {', '.join(SCHEDULES)}")


# ---------------------------------------------------------------------------------
# the stage: this rank's chunks, the caches in flight, the verbs


class Stage:
    """What the schedules drive on one rank: the local chunks and their caches.

    Per step, ``begin`` splits the batch into microbatches. ``forward_step`` keeps the
    cache of (chunk, microbatch) until its ``backward_step``: ``live`` counts them,
    ``peak`` is the most at once during the step. The last chunk adds its loss / m to
    ``loss_sum`` and starts its backward from ``dloss`` = scale / m.
    ``trace`` lists ('F' or 'B', model chunk, microbatch, CPU seconds) per operation.
    ``on_chunk_done(c)``, if set, runs after local chunk c's last backward of a step.
    """

    def __init__(self, chunks: list[stages.ModelChunk], p2p: P2P,
                 act_shape: Callable[[tuple[int, int], int], tuple[int, ...]],
                 seq_divisor: int = 1):
        self.parts = chunks
        self.p2p = p2p
        self.pp_size, self.pp_rank = p2p.pp_size, p2p.pp_rank
        self.virtual_stages = len(chunks)
        # the model's: ((mb, T), j) -> the activation leaving middle piece j, (mb, T, C)
        self.activation_shape = act_shape
        self.seq_divisor = seq_divisor  # tp with sequence parallelism: T is split
        self.on_chunk_done = None
        self.begin(np.zeros((1, 1), np.int64), np.zeros((1, 1), np.int64), 1)  # no step yet

    def begin(self, x: np.ndarray, y: np.ndarray, m: int, *, dloss: float = 0.0,
              training: bool = False) -> None:
        """Split this rank's batch x, y (b, T) into m microbatches (b/m, T)."""
        self.xs, self.ys = np.split(x, m), np.split(y, m)
        b, t = x.shape[:2]
        mb = (b // m, t // self.seq_divisor)
        # each local chunk's input and output activation (mb, T, C): the shapes of the
        # boundaries before and after its middle pieces (one shape for most models)
        self.in_shapes = [self.boundary_shape(mb, part.spec.start - 1) for part in self.parts]
        self.out_shapes = [self.boundary_shape(mb, part.spec.stop - 1) for part in self.parts]
        self.dloss, self.training = dloss, training
        self.caches: dict[tuple[int, int], tuple[list, np.ndarray | None]] = {}
        self.live = self.peak = 0
        self.loss_sum = 0.0
        self.trace: list[tuple[str, int, int, float]] = []

    def chunk_index(self, c: int) -> int:
        return stages.model_chunk(c, self.pp_rank, self.pp_size)

    def boundary_shape(self, mb: tuple[int, int], j: int) -> tuple[int, ...] | None:
        """The activation leaving middle piece j (None before the first: data)."""
        return self.activation_shape(mb, j) if j >= 0 else None

    def forward_step(self, i: int, x: np.ndarray | None, c: int = 0) -> np.ndarray | None:
        t0 = time.thread_time()
        chunk = self.parts[c]
        with trace.span("F", "compute", mb=i, chunk=self.chunk_index(c)):
            out, cache = chunk.forward(self.xs[i] if x is None else x, self.ys[i],
                                       train=self.training)
        if chunk.last is not None:
            self.loss_sum += out / len(self.xs)
            out = None
        if self.training:
            self.caches[(c, i)] = (cache, x)
            self.live += 1
            self.peak = max(self.peak, self.live)
            self.trace.append(("F", self.chunk_index(c), i, time.thread_time() - t0))
        else:
            self.p2p.release(x)
        return out

    def backward_step(self, i: int, dy: np.ndarray | None, c: int = 0) -> np.ndarray | None:
        t0 = time.thread_time()
        chunk = self.parts[c]
        cache, x = self.caches.pop((c, i))
        self.live -= 1
        with trace.span("B", "compute", mb=i, chunk=self.chunk_index(c)):
            dx = chunk.backward(self.dloss if chunk.last is not None else dy, cache)
        self.p2p.release(x)
        self.p2p.release(dy)
        self.trace.append(("B", self.chunk_index(c), i, time.thread_time() - t0))
        if i == len(self.xs) - 1 and self.on_chunk_done is not None:
            self.on_chunk_done(c)  # every schedule runs a chunk's microbatches in order
        return dx

    def recv_forward(self, i: int, c: int = 0) -> np.ndarray | None:
        return self.p2p.recv_forward(self.in_shapes[c], self.chunk_index(c), i)

    def send_forward(self, i: int, y: np.ndarray | None, c: int = 0) -> None:
        self.p2p.send_forward(y, self.chunk_index(c), i)

    def recv_backward(self, i: int, c: int = 0) -> np.ndarray | None:
        return self.p2p.recv_backward(self.out_shapes[c], self.chunk_index(c), i)

    def send_backward(self, i: int, dx: np.ndarray | None, c: int = 0) -> None:
        self.p2p.send_backward(dx, self.chunk_index(c), i)


# ---------------------------------------------------------------------------------
# the engine


class PipelineEngine:
    """This rank's pipeline stage of ``model`` (tensor-parallel already, or not).

    Keeps only the chunks of the model's pipeline pieces ``stages.plan`` gives this
    rank; ``named_params`` carry the full model's names. A parameter the first and the
    last piece share (the GPT's tied token table) is held by the first and last stage,
    and their gradients are summed at the end of ``forward_backward``.
    """

    def __init__(self, model: Any, cfg: Any, topo: Any):
        par = cfg.parallel
        cfg.validate(topo.shape.world_size)  # the rules, by name, if not checked yet
        self.pp_comm, self.model_comm = topo.pp_comm, topo.model_comm
        self.pp_size, self.pp_rank = topo.pp_size, topo.pp_rank
        self.microbatches, self.virtual_stages = par.microbatches, par.virtual_stages
        self.schedule = SCHEDULES[par.schedule]
        specs = stages.plan(model.piece_costs(cfg.model), self.pp_size, par.virtual_stages,
                            par.balance)
        chunks = [stages.ModelChunk(s, model) for s in stages.rank_chunks(specs, self.pp_rank,
                                                                         self.pp_size)]
        self.p2p = P2P(self.pp_comm, len(specs), self.microbatches, cfg.model.dtype)
        seq_divisor = topo.tp_size if par.sequence_parallel else 1
        # the class's method, not the model's: a closure over the model would keep the
        # other stages' parameters and gradients alive on every rank
        act_shape = functools.partial(_activation_shape_after, type(model), cfg.model)
        self.stage = Stage(chunks, self.p2p, act_shape, seq_divisor)
        mine = {id(p) for chunk in chunks for p in chunk.parameters()}
        self.named_params = [(n, p) for n, p in model.named_parameters() if id(p) in mine]
        # this stage's state that is not trained (BatchNorm's running statistics)
        held = {id(a) for chunk in chunks for part in chunk.parts for _, a in part.named_buffers()}
        self.named_buffers = [(n, a) for n, a in model.named_buffers() if id(a) in held]
        self.params = [p for _, p in self.named_params]
        self.tied = _tied_parameters(model) if self.pp_size > 1 else []
        # whether the last piece gives evaluation figures (the same on every stage)
        self._has_metrics = hasattr(model.pipeline_pieces().last, "eval_metrics")
        self._norm_params = self._counted_once(topo)
        # the data-parallel wrapper's hook: a chunk's gradients are final after its
        # last backward, except the tied table's, which waits for the other stage's
        self.on_grads_ready = None
        tied = {id(p) for p in self.tied}
        self._final = [[p for p in chunk.parameters() if id(p) not in tied] for chunk in chunks]
        self.stage.on_chunk_done = self._chunk_done
        self._step = {"idle_s": 0.0, "wall_s": 0.0, "peak": 0, "bytes": 0}

    def _counted_once(self, topo: Any) -> list:
        """Parameters whose squared gradients this rank adds to the global norm: the
        tied copy only on the first stage; tp-replicated ones only on tp rank 0."""
        tied = {id(p) for p in self.tied} if self.pp_rank == self.pp_size - 1 else set()
        return [p for p in self.params if id(p) not in tied and
                (topo.tp_rank == 0 or getattr(p, "tp_split", None) is not None)]

    @property
    def peak_live_caches(self) -> int:
        """Most microbatch caches this rank held at once in the last training step."""
        return self._step["peak"]

    def zero_grad(self) -> None:
        for p in self.params:
            p.zero_grad()

    def _chunk_done(self, c: int) -> None:
        if self.on_grads_ready is not None:
            self.on_grads_ready(self._final[c])

    def forward_backward(self, x: np.ndarray, y: np.ndarray, scale: float = 1.0) -> float:
        """Run the schedule over this rank's batch x, y (b, T); return the mean loss.

        Accumulates the gradients of ``scale * mean loss`` into this stage's
        parameters. Collective over ``pp_comm`` (one Bcast; p2p in between).
        """
        m = self._check_batch(x, self.microbatches)
        t0 = time.perf_counter()
        self.p2p.idle_s, self.p2p.bytes_sent = 0.0, 0
        self.stage.begin(x, y, m, dloss=scale / m, training=True)
        self.schedule(self.stage, m)
        loss = self._finish()
        self._step = {"idle_s": self.p2p.idle_s, "wall_s": time.perf_counter() - t0,
                      "peak": self.stage.peak, "bytes": self.p2p.bytes_sent}
        self._sum_tied_grads()
        return loss

    def loss(self, x: np.ndarray, y: np.ndarray) -> float:
        """Mean loss over x, y (b, T), forward only; the same on every stage. Rows
        that do not split into the microbatches run as one, where the schedule allows
        it: the interleaved order needs whole rounds of pp microbatches."""
        m = self.microbatches if len(x) % self.microbatches == 0 else 1
        if m % self.pp_size and self.virtual_stages > 1:
            raise ValueError(f"the batch ({len(x)} rows) must split into the microbatches "
                             f"({self.microbatches}) under the interleaved schedule")
        self.stage.begin(x, y, m)
        forward_only(self.stage, m)
        return self._finish()

    def eval_metrics(self, x: np.ndarray, y: np.ndarray) -> dict[str, tuple[float, int]]:
        """The figures the model's last piece gives (``eval_metrics(act, targets)``, the
        MLP's accuracy) over x, y as one microbatch, on every stage; none if it gives
        none or the rank holds several chunks. Collective over ``pp_comm`` (p2p
        forward, one bcast of the small dict from the last stage)."""
        if self.virtual_stages != 1 or not self._has_metrics:
            return {}
        chunk, p2p = self.stage.parts[0], self.p2p
        k = self.stage.chunk_index(0)
        b, t = x.shape[:2]
        inp = p2p.recv_forward(self.stage.boundary_shape((b, t), chunk.spec.start - 1), k, 0)
        act = x if inp is None else inp
        for piece in chunk.parts[:-1] if chunk.last is not None else chunk.parts:
            act = stages.forward_eval(piece, act)
        figures = None
        if chunk.last is None:
            p2p.send_forward(act, k, 0)
            p2p.wait_sends()
        elif hasattr(chunk.last, "eval_metrics"):
            figures = chunk.last.eval_metrics(act, y)
        p2p.release(inp)
        if self.pp_size == 1:
            return figures or {}
        return self.pp_comm.bcast(figures, root=self.pp_size - 1) or {}

    def _check_batch(self, x: np.ndarray, m: int) -> int:
        if x.ndim != 2 or len(x) % m:
            raise ValueError(f"the batch ({x.shape[0]} sequences) must be (b, T) with b "
                             f"divisible by microbatches ({m})")
        return m

    def _finish(self) -> float:
        """Complete the sends; broadcast the loss from the last stage (waits are idle)."""
        self.p2p.wait_sends()
        buf = np.array([self.stage.loss_sum], np.float64)
        t0 = time.perf_counter()
        if self.pp_size > 1:
            with trace.span("loss_bcast", "pp_wait"):
                self.pp_comm.Bcast(buf, root=self.pp_size - 1)
        self.p2p.idle_s += time.perf_counter() - t0
        return float(buf[0])

    def _sum_tied_grads(self) -> None:
        """First and last stage: grad of the tied table = embedding's + head's (p2p)."""
        if not self.tied or self.pp_rank not in (0, self.pp_size - 1):
            return
        other = self.pp_size - 1 - self.pp_rank
        for p in self.tied:
            theirs = np.empty_like(p.grad)
            with trace.span("tied_grads", "pp_wait", bytes=theirs.nbytes, peer=other):
                self.pp_comm.Sendrecv(p.grad, dest=other, recvbuf=theirs, source=other)
            p.grad += theirs  # a + b on one rank, b + a on the other: the same bits

    def grad_norm(self) -> float:
        """Global gradient norm of the model replica (collective over ``model_comm``)."""
        buf = np.array([clip.grad_sq_sum(self._norm_params)])
        if self.model_comm.Get_size() > 1:
            from mpi4py import MPI

            with trace.span("grad_norm", "optimizer", comm="model_comm"):
                self.model_comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        return math.sqrt(buf[0])

    def metrics(self) -> dict[str, float]:
        """The last step's bubble, caches and p2p volume over the pipeline.

        Collective over ``pp_comm`` (one Allgather): call it on every stage.
        """
        s = self._step
        mine = np.array([s["idle_s"] / max(s["wall_s"], 1e-12), s["peak"], s["bytes"]])
        every = np.empty((self.pp_size, 3))
        self.pp_comm.Allgather(mine, every)
        return {"bubble_fraction": float(every[:, 0].mean()),
                "bubble_theory": bubble_theory(self.pp_size, self.microbatches,
                                               self.virtual_stages),
                "peak_live_caches": int(every[:, 1].max()),
                "p2p_bytes": int(every[:, 2].sum())}


def _activation_shape_after(cls: Any, m: Any, mb: tuple[int, int], j: int) -> tuple[int, ...]:
    """The model's activation leaving middle piece j, for a microbatch of shape mb (a
    model whose boundaries differ declares ``activation_shape_after``)."""
    after = getattr(cls, "activation_shape_after", None)
    return after(m, mb, j) if after is not None else cls.activation_shape(m, mb)


def _tied_parameters(model: Any) -> list:
    """Parameters the first and the last pipeline piece share (the tied token table)."""
    pieces = model.pipeline_pieces()
    last = {id(p) for p in pieces.last.parameters()}
    return [p for p in pieces.first.parameters() if id(p) in last]
