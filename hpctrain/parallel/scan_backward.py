"""Exact backpropagation across pipeline stages as a parallel scan (DeepPCR).

A network split into pp stages, stage ``s`` mapping its input ``h_s`` to ``h_{s+1}``,
has per sample the stage Jacobians ``J_s = dh_{s+1}/dh_s`` (out, in). With gradients
as row vectors, backpropagation is the linear recurrence

    g_s = g_{s+1} @ J_s,        g_pp = dloss/dh_pp

so the gradient stage ``s`` needs at its output is a product of the Jacobians after it,

    g_{s+1} = g_{pp-1} @ J_{pp-2} @ ... @ J_{s+1}        (g_{pp-1}: the last stage's dx)

an *exclusive prefix product*, counted from the last stage. Ordinary pipelined
backprop computes it as a chain: pp - 1 messages one after another, each waiting for
a whole stage's backward. Here each stage forms its ``J_s`` from its cached
activations (the product of its layers' Jacobians: ``W^T`` for a Linear, the
diagonal of its derivative for an elementwise activation), and the stages combine
them by recursive doubling over ``pp_comm`` in ``ceil(log2 pp)`` rounds; then each
stage runs its ordinary local backward from its exact output gradient, which
accumulates its parameter gradients as serial backprop would (float64: to rounding).

Positions ``j = pp - 1 - s`` count stages from the last one. Position 0 holds the
vector ``g_{pp-1}`` (its stage's ordinary backward gives it), positions 1..pp-2 their
``J``; stage 0's Jacobian is never needed (nobody wants the input's gradient). In
round ``d = 1, 2, 4, ...`` position ``j`` sends the product of its window ``[j-d+1, j]``
to ``j + d`` and receives ``[j-2d+1, j-d]`` from ``j - d``. pp = 8 (stages s7..s0;
``a..b`` is the product of positions a to b, a vector when it starts at 0)::

    position j     0     1     2     3     4     5     6     7
    stage s        7     6     5     4     3     2     1     0
    element        g7    J6    J5    J4    J3    J2    J1    -      (J0: never needed)
    d=1 receives   -     0     1     2     3     4     5     6      from j - 1
        excl       -     0     1     2     3     4     5     6
    d=2 receives   -     -     0     0..1  1..2  2..3  3..4  4..5   from j - 2
        excl       -     0     0..1  0..2  1..3  2..4  3..5  4..6
    d=4 receives   -     -     -     -     0     0..1  0..2  0..3   from j - 4
        excl       -     0     0..1  0..2  0..3  0..4  0..5  0..6
                   = the output gradient g_{s+1} of stage s, after 3 rounds, not 7

pp = 4 runs the same pattern on positions 0..3 (stages 3..0, elements g3, J2, J1,
-) in rounds d = 1, 2: stage 3 takes g4 from the loss, stage 2 gets g3, stage 1
g3 J2, stage 0 g3 J2 J1.

Every message whose window starts at position 0 is a vector per sample (B, 1, w);
the others are matrices (B, w, w). A position updates its running product only if it sends it
again, so stage 0 multiplies vectors only. At pp = 2 there are no Jacobians at all:
the one round is the chain's one message.

When it pays. Matrix-multiply FLOPs per sample, L Linear layers of width w over pp
stages (``flop_counts``): the ordinary backward is ``4 w^2`` a layer (``dx`` and
``dW``), and for one microbatch all of it is on the critical path: ``4 L w^2``. The
scan's critical path is the slower of the last stage's backward and the Jacobian
products (``2 w^3`` a layer, ``L / pp`` layers, on the other stages at the same
time), then the combines (vector products ``2 w^2``, matrix products ``2 w^3`` from
pp = 8 on) and a local backward: about ``(2 w^3 + 4 w^2) L / pp``. By arithmetic it
beats the chain only when ``w < 2 (pp - 1)``: deep networks of very narrow layers on
many stages. For wide layers the ``w^3`` Jacobian products lose. At the narrow
widths where it can win, NumPy's cost per call (about 20 us a block here, the same
for a block's backward and its Jacobian) counts more than the FLOPs, which moves
the crossover up (pp = 4: between w = 24 and 32 here, ``benchmarks/README.md``);
and the scan does more total work than the chain, so it needs a core per stage.
Forming ``J_s`` starts as soon as stage ``s`` has sent its activation on, so in
``step`` it overlaps the forward of the stages after it.

Everything is checked before the first message on every rank (the whole chain is
built from one seed on each rank, as the engine builds the serial model): pp >= 2,
the layers split evenly into pp stages, the widths chain, and every layer has a
Jacobian rule (``JACOBIAN_RULES``); integer-indexed lookups (``Embedding``) have no
input gradient, so a chain holding one is not differentiable end to end.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np

from hpctrain.nn import (
    GELU,
    Embedding,
    EmbeddingBag,
    Linear,
    Module,
    ReLU,
    cross_entropy,
    cross_entropy_backward,
)

# ---------------------------------------------------------------------------------
# Jacobian rules: a layer and its forward cache -> its per-sample Jacobian factor


class Factor(NamedTuple):
    """One layer's Jacobian: ``dense`` (out, in), the same for every sample, or
    ``diag`` (B, w), the diagonal of each sample's Jacobian."""

    kind: str  # "dense" or "diag"
    value: np.ndarray


def _linear_jacobian(layer: Linear, cache: Any, shape: tuple[int, int]) -> Factor:
    # y = x W + b: dy_o/dx_i = W[i, o], so J = W^T (out, in)
    return Factor("dense", layer.weight.data.T)


def _elementwise_jacobian(layer: Module, cache: Any, shape: tuple[int, int]) -> Factor:
    # y_i = f(x_i): J = diag(f'(x)), which is the layer's own backward of ones
    return Factor("diag", layer.backward(np.ones(shape), cache))


JACOBIAN_RULES: dict[type, Callable[[Any, Any, tuple[int, int]], Factor]] = {
    Linear: _linear_jacobian,
    GELU: _elementwise_jacobian,
    ReLU: _elementwise_jacobian,  # the subgradient 0 at x = 0, as its backward uses
}
NOT_DIFFERENTIABLE = (Embedding, EmbeddingBag)  # integer inputs: no input gradient


# ---------------------------------------------------------------------------------
# the chain and its stages


def build_chain(depth: int, width: int, *, seed: int, activation: str = "gelu",
                dtype=np.float64) -> list[Module]:
    """``depth`` blocks of Linear(width, width) + activation, He-initialised from one
    ``default_rng(seed)``: a deep narrow MLP whose output is ``width`` logits."""
    if depth < 1 or width < 1:
        raise ValueError(f"depth ({depth}) and width ({width}) must be >= 1")
    acts = {"gelu": GELU, "relu": ReLU}
    if activation not in acts:
        raise ValueError(f"activation ({activation!r}) must be one of {sorted(acts)}")
    rng = np.random.default_rng(seed)
    layers: list[Module] = []
    for _ in range(depth):
        layers += [Linear(width, width, rng=rng, dtype=dtype, std=math.sqrt(2.0 / width)),
                   acts[activation]()]
    return layers


class StageCache(NamedTuple):
    x_shape: tuple[int, int]  # (B, in) of the stage's input
    caches: list  # one forward cache per layer


class Stage(Module):
    """A run of layers held by one pipeline stage, with widths ``in_width -> out_width``."""

    def __init__(self, layers: Sequence[Module], in_width: int, out_width: int):
        self.layers = list(layers)
        self.in_width, self.out_width = in_width, out_width

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, StageCache]:
        # x (B, in) -> y (B, out)
        caches = []
        shape = x.shape
        for layer in self.layers:
            x, c = layer.forward(x)
            caches.append(c)
        return x, StageCache(shape, caches)

    def backward(self, dy: np.ndarray, cache: StageCache, need_dx: bool = True):
        # dy (B, out) -> dx (B, in), or None; adds into every parameter's .grad
        for i in reversed(range(len(self.layers))):
            layer, c = self.layers[i], cache.caches[i]
            if isinstance(layer, Linear):
                dy = layer.backward(dy, c, need_dx=need_dx or i > 0)
            else:
                dy = layer.backward(dy, c)
        return dy

    def jacobian(self, cache: StageCache) -> np.ndarray:
        """Per-sample ``dy/dx`` of the whole stage, (B, out, in): the product of its
        layers' Jacobians, last layer on the left."""
        b, w = cache.x_shape
        # kept as (w, B, in), so that a Linear's factor is one GEMM over all samples:
        # (out, w) @ (w, B * in), 2 w^3 a sample
        jac = None  # the product so far; the first factor costs nothing
        for layer, c in zip(self.layers, cache.caches, strict=True):
            kind, value = JACOBIAN_RULES[type(layer)](layer, c, (b, w))
            if jac is None:
                jac = np.broadcast_to(value[:, None, :], (value.shape[0], b, w)) \
                    if kind == "dense" else np.eye(w)[:, None, :] * value.T[:, :, None]
            elif kind == "dense":
                jac = (value @ jac.reshape(w, -1)).reshape(value.shape[0], b, -1)
            else:  # scale row i of each sample's product by f'(x_i)
                jac = jac * value.T[:, :, None]
            w = jac.shape[0]
        return np.ascontiguousarray(jac.transpose(1, 0, 2))  # (B, out, in)


def split_stages(layers: Sequence[Module], pp: int, in_width: int) -> list[Stage]:
    """The chain's layers as pp equal stages, after checking (no communication) that
    each layer has a Jacobian rule and its widths chain; every rank gets the same
    verdict because every rank checks the whole chain."""
    if pp < 2:
        raise ValueError(f"pp ({pp}) must be >= 2: the scan combines the Jacobians of "
                         f"pipeline stages; with one stage use the ordinary backward")
    n = len(layers)
    if n == 0 or n % pp:
        raise ValueError(f"the chain's {n} layers must split into pp ({pp}) equal stages "
                         f"(a positive multiple of pp)")
    widths, w = [], in_width
    for i, layer in enumerate(layers):
        name = type(layer).__name__
        if isinstance(layer, NOT_DIFFERENTIABLE):
            raise ValueError(f"layer {i} ({name}) takes integer indices and has no input "
                             f"gradient: stage {i // (n // pp)} is not differentiable end "
                             f"to end, so it has no Jacobian")
        if type(layer) not in JACOBIAN_RULES:
            known = ", ".join(sorted(t.__name__ for t in JACOBIAN_RULES))
            raise ValueError(f"layer {i} ({name}) in stage {i // (n // pp)} has no Jacobian "
                             f"rule (rules exist for {known})")
        if isinstance(layer, Linear):
            if layer.in_features != w:
                raise ValueError(f"layer {i} (Linear {layer.in_features}->"
                                 f"{layer.out_features}) receives width {w}")
            w = layer.out_features
        widths.append(w)
    per = n // pp
    return [Stage(layers[s * per:(s + 1) * per], in_width if s == 0 else widths[s * per - 1],
                  widths[(s + 1) * per - 1]) for s in range(pp)]


class _Clock:
    """``with clock(name):`` adds the block's thread CPU time to ``phases[name]``."""

    def __init__(self, phases: dict[str, float] | None):
        self.phases = phases

    @contextmanager
    def __call__(self, name: str):
        if self.phases is None:
            yield
            return
        t0 = time.thread_time()
        yield
        self.phases[name] = self.phases.get(name, 0.0) + time.thread_time() - t0


# ---------------------------------------------------------------------------------
# the scan: recursive doubling, pure (simulated serially in the tests)


def scan_rounds(pp: int) -> list[int]:
    """The distances d = 1, 2, 4, ... < pp: ceil(log2 pp) rounds."""
    return [1 << k for k in range(max(pp - 1, 0).bit_length())]


def message_shape(j: int, d: int, batch: int, stages: Sequence[Stage]) -> tuple[int, ...]:
    """Shape of what position ``j`` receives in round ``d``: the product over the window
    ``[max(0, j - 2d + 1), j - d]``, a (B, 1, w) vector if it starts at position 0."""
    pp = len(stages)
    start, end = max(0, j - 2 * d + 1), j - d
    rows = 1 if start == 0 else stages[pp - 1 - start].out_width
    return (batch, rows, stages[pp - 1 - end].in_width)


class ScanPosition:
    """Position ``j`` of the exclusive scan: ``incl`` is the product over the window
    ending at ``j`` (sent on), ``excl`` over the one ending at ``j - 1`` (the result)."""

    def __init__(self, j: int, pp: int, element: np.ndarray | None):
        self.j, self.pp = j, pp
        self.incl = element  # (B, rows, in); None where it is never sent (j = pp - 1)
        self.excl: np.ndarray | None = None

    def send_to(self, d: int) -> int | None:
        return self.j + d if self.j + d < self.pp else None

    def recv_from(self, d: int) -> int | None:
        return self.j - d if self.j >= d else None

    def receive(self, d: int, r: np.ndarray) -> None:
        # r: the product over [j-2d+1, j-d], which goes on the left of what j holds
        self.excl = r if self.excl is None else np.matmul(r, self.excl)
        self.incl = np.matmul(r, self.incl) if self.j + 2 * d < self.pp else None


def simulate_scan(elements: Sequence[np.ndarray | None]) -> list[np.ndarray | None]:
    """The scan of ``scan_exclusive`` over pp positions, serially: position j's
    ``excl`` = elements[0] @ ... @ elements[j-1] (None at j = 0)."""
    pp = len(elements)
    pos = [ScanPosition(j, pp, e) for j, e in enumerate(elements)]
    for d in scan_rounds(pp):
        sent = {p.send_to(d): p.incl for p in pos if p.send_to(d) is not None}
        for j, r in sent.items():
            pos[j].receive(d, r)
    return [p.excl for p in pos]


def scan_exclusive(pos: ScanPosition, stages: Sequence[Stage], batch: int,
                   pp_comm: Any, clock: _Clock | None = None) -> np.ndarray | None:
    """Run position ``pos`` of the scan over ``pp_comm`` (rank = pp - 1 - j): one
    ``Isend`` and one ``Recv`` at most per round. Returns ``pos.excl``. ``clock``
    times the combines ("combine"), not the waits."""
    pp, clock = pos.pp, clock or _Clock(None)
    for d in scan_rounds(pp):
        dest, src = pos.send_to(d), pos.recv_from(d)
        req = None
        if dest is not None:
            out = np.ascontiguousarray(pos.incl)  # alive until the Wait
            req = pp_comm.Isend(out, dest=pp - 1 - dest, tag=d)
        if src is not None:
            buf = np.empty(message_shape(pos.j, d, batch, stages), dtype=np.float64)
            pp_comm.Recv(buf, source=pp - 1 - src, tag=d)
            with clock("combine"):
                pos.receive(d, buf)
        if req is not None:
            req.Wait()
    return pos.excl


# ---------------------------------------------------------------------------------
# one step at a stage: forward, then the scan or the chain, then the local backward

_FORWARD_TAG, _BACKWARD_TAG = 1 << 20, (1 << 20) + 1


def pipeline_forward(stage: Stage, s: int, pp: int, x: np.ndarray, pp_comm: Any):
    """Stage ``s``'s forward: receive its input from ``s - 1`` (stage 0 takes ``x``),
    send its output to ``s + 1`` (non-blocking). Returns (y, cache, send request)."""
    b = x.shape[0]
    if s > 0:
        x = np.empty((b, stage.in_width))
        pp_comm.Recv(x, source=s - 1, tag=_FORWARD_TAG)
    y, cache = stage.forward(x)
    req = pp_comm.Isend(np.ascontiguousarray(y), dest=s + 1, tag=_FORWARD_TAG) \
        if s < pp - 1 else None
    return y, cache, req


def check_batch(stages: Sequence[Stage], x: np.ndarray, targets: np.ndarray) -> None:
    """Every rank passes the same (x, targets); checked before any message."""
    if x.ndim != 2 or x.shape[1] != stages[0].in_width or targets.shape != (x.shape[0],):
        raise ValueError(f"x {x.shape} must be (B, {stages[0].in_width}) and targets "
                         f"{targets.shape} (B,)")


class Forwarded(NamedTuple):
    """What a stage's forward leaves for its backward."""

    cache: StageCache
    dy: np.ndarray | None  # the loss's gradient (B, out) on the last stage, else None
    loss: float | None  # on the last stage, else None
    batch: int


def forward(stages: Sequence[Stage], x: np.ndarray, targets: np.ndarray,
            pp_comm: Any) -> Forwarded:
    """This rank's stage (``stages[pp_comm rank]``) forward, and the loss on the last
    stage. Every rank passes the same (x, targets), checked before any message; only
    stage 0 reads x and the last stage targets. Point-to-point over ``pp_comm``."""
    pp, s = len(stages), pp_comm.Get_rank()
    if pp_comm.Get_size() != pp:
        raise ValueError(f"pp_comm has {pp_comm.Get_size()} ranks but the chain {pp} stages")
    check_batch(stages, x, targets)
    y, cache, req = pipeline_forward(stages[s], s, pp, x, pp_comm)
    loss = dy = None
    if s == pp - 1:
        loss, ce = cross_entropy(y, targets)
        dy = cross_entropy_backward(1.0, ce)  # (B, out)
    if req is not None:
        req.Wait()
    return Forwarded(cache, dy, loss, x.shape[0])


def backward(stages: Sequence[Stage], fwd: Forwarded, pp_comm: Any, method: str = "scan",
             phases: dict[str, float] | None = None) -> None:
    """This rank's stage backward, its output gradient found by ``method``: "scan"
    (Jacobians, recursive doubling) or "chain" (the ordinary pipelined backward: stage
    s waits for s + 1's input gradient). Gradients accumulate into the stage's
    ``.grad``. ``phases``, if given, receives this thread's CPU seconds per phase
    ("jacobian", "combine", "backward"; the benchmark replays them). Point-to-point over
    ``pp_comm``, one microbatch."""
    if method not in ("scan", "chain"):
        raise ValueError(f"method ({method!r}) must be 'scan' or 'chain'")
    pp, s = len(stages), pp_comm.Get_rank()
    stage, cache, b = stages[s], fwd.cache, fwd.batch
    clock = _Clock(phases)
    if method == "chain":
        dy = fwd.dy
        if s < pp - 1:
            dy = np.empty((b, stage.out_width))
            pp_comm.Recv(dy, source=s + 1, tag=_BACKWARD_TAG)
        with clock("backward"):
            dx = stage.backward(dy, cache, need_dx=s > 0)
        if s > 0:
            pp_comm.Send(np.ascontiguousarray(dx), dest=s - 1, tag=_BACKWARD_TAG)
        return
    if s == pp - 1:  # position 0: its ordinary backward gives the vector g_{pp-1}
        with clock("backward"):
            element = stage.backward(fwd.dy, cache)[:, None, :]  # (B, 1, in)
    else:  # J_s; in ``step`` formed while the later stages still run their forward
        with clock("jacobian"):
            element = stage.jacobian(cache) if s > 0 else None
    excl = scan_exclusive(ScanPosition(pp - 1 - s, pp, element), stages, b, pp_comm, clock)
    if s < pp - 1:
        with clock("backward"):
            stage.backward(excl[:, 0, :], cache, need_dx=False)


def step(stages: Sequence[Stage], x: np.ndarray, targets: np.ndarray, pp_comm: Any,
         method: str = "scan") -> float | None:
    """``forward`` then ``backward``: returns the loss on the last stage, else None."""
    if method not in ("scan", "chain"):
        raise ValueError(f"method ({method!r}) must be 'scan' or 'chain'")
    fwd = forward(stages, x, targets, pp_comm)
    backward(stages, fwd, pp_comm, method)
    return fwd.loss


def serial_step(layers: Sequence[Module], x: np.ndarray, targets: np.ndarray) -> float:
    """The reference: forward and ordinary backprop through the whole chain."""
    whole = Stage(layers, x.shape[1], 0)
    y, cache = whole.forward(x)
    loss, ce = cross_entropy(y, targets)
    whole.backward(cross_entropy_backward(1.0, ce), cache, need_dx=False)
    return loss


def flop_counts(depth: int, width: int, pp: int, batch: int) -> dict[str, float]:
    """Matrix-multiply FLOPs of one backward (``depth`` Linear layers of ``width``, as
    many on each of the pp stages; ``batch`` samples): the total work and the
    critical path of each method. The scan's path starts after the forward: the
    Jacobians beside the last stage's backward, then the combines, then a local
    backward (in ``step`` the Jacobians also overlap the later stages' forward)."""
    w, per, b = width, depth // pp, batch
    layer_bwd = 4 * w * w * b  # dx = dy W^T and dW = x^T dy
    jac = 2 * w ** 3 * b * (per - 1) if pp > 2 else 0  # the first factor is free
    # the combines, walked along the schedule: a window starting at position 0 is
    # a vector per sample (2 w^2 to extend), any other a matrix (2 w^3)
    start = list(range(pp))  # start of each position's incl window
    has_excl = [False] * pp
    work, path = 0, 0
    for d in scan_rounds(pp):
        costs = [0] * pp
        for j in range(d, pp):
            rows = 1 if start[j - d] == 0 else w
            cost = 2 * rows * w * w * b * (has_excl[j] + (j + 2 * d < pp))
            costs[j], has_excl[j] = cost, True
        for j in reversed(range(d, pp)):
            start[j] = start[j - d]
        work, path = work + sum(costs), path + max(costs)
    return {"chain_work": layer_bwd * depth, "chain_path": layer_bwd * depth,
            "scan_work": layer_bwd * depth + jac * max(pp - 2, 0) + work,
            "scan_path": max(layer_bwd * per, jac) + path + layer_bwd * per}
