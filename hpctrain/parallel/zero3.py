"""ZeRO stage 3: parameters sharded over ``dp_comm`` too, gathered a piece at a time.

The model's pipeline pieces (``Model.pipeline_pieces``: the GPT's embed, each block,
the head; a model without pieces is one piece, the whole model) each make a *unit*:
the parameters first met in that piece, in forward order, as one flat array padded to
a multiple of ``dp``. Rank ``r`` keeps shard ``r`` of every unit, for the parameters,
the gradient and the optimizer state alike. A piece that also uses a parameter of an
earlier unit (the head and the tied token table) gathers that unit too. dp = 2::

    unit (flat)     | embed: wte wpe |pad| block 0 ... | block 1 ... | head ... |pad|
    rank 0 keeps    |  shard 0       |      shard 0    |  shard 0    |  shard 0     |
    rank 1 keeps    |        shard 1 |         shard 1 |     shard 1 |      shard 1 |

One training step of a 2-piece chain (A, B), collective over ``dp_comm``::

    forward   gather A | run A, gather B started | free A | run B      | free B
    backward  gather B | run B, gather A started | free B | run A      | free A
    grads                reduce-scatter B's  ...            reduce-scatter A's ...
    step      the optimizer over this rank's shards only; nothing gathered after it

* **Build**: the units are made as the model is built, each piece sharded before the
  next is drawn (``zero3_build.py``: the whole model is never held), and handed in as
  ``units``; a model that does not build by piece is built whole and sharded here.
* **Gather** (``Iallgather`` of the unit's shards into a fresh full buffer): just
  before a piece's forward and again before its backward; each parameter's ``data``
  is then a view of that buffer. ``reshard_after_forward = False`` keeps the units
  gathered from the forward to the backward (FSDP's option: less communication, more
  memory). Between uses ``data`` is a read-only array of NaN of the parameter's shape,
  so a read that bypasses the gather shows as a NaN loss, never as a silent zero.
* **Prefetch**: once a piece's units are in, the next piece's gather is posted (the
  one after it in forward, the one before it in backward). MPICH moves a
  non-blocking collective only inside MPI calls, so with ``MPI_THREAD_MULTIPLE`` a
  helper thread tests the outstanding requests every millisecond while the main
  thread computes (``Progress``; requests are only *posted* by the main thread, in
  the same order on every rank, so gathers and reduce-scatters share ``dp_comm``).
  An error in the helper is raised on the main thread where it next posts, tests or
  waits (``HelperError``, the helper's own traceback chained), so that the run ends
  as for any other error, never goes on without the helper.
* **Gradients**: a unit's full gradient buffer exists from its first backward in a
  step until the engine reports all its parameters final (``on_grads_ready``, the
  last microbatch), when it is **reduce-scattered** into the unit's persistent
  ``1/dp`` gradient shard (``Ireduce_scatter_block``, or the hierarchical one) and
  freed. Units never reported (the tied table, an engine without hooks) are reduced
  in ``finish_grads``, after the pipeline summed the tied copies.
* **Optimizer**: ``zero.ShardPiece``s over the shards, named ``name[lo:hi]`` as in
  ZeRO-1/2 (the same optimizer, decay flags, norm counting and checkpoint names).
* **Evaluation** (``engine.loss``, ``eval_metrics``, ``predict``) gathers every unit
  of this rank for the call, then frees them.

Memory per rank between steps, ``N'`` the padded parameters of this rank, ``s`` bytes
per element, ``K`` optimizer arrays per element: parameters, gradients and optimizer
state ``N' s / dp``, ``N' s / dp``, ``K N' s / dp``; during a step, plus the gathered
units (one or two pieces at a time; all of them under ``reshard_after_forward = False``
with several microbatches) and the full gradients of the units in backward.

Works with ``LocalEngine``, ``TensorParallelEngine`` (each tp shard is sharded over
dp) and ``PipelineEngine`` (each stage's pieces; interleaved too). Refused by
``Config.validate``: spatial parallelism, local-loss pipelines, local averaging and
unequal shares, models with embedding tables (their own rule).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hpctrain import trace
from hpctrain.checkpoint.state import Held, optimizer_entries, param_sharding
from hpctrain.optim import clip
from hpctrain.parallel.data import POLL_INTERVAL, HelperError, state_nbytes
from hpctrain.parallel.zero import ShardPiece, counted_once, shard_grad_norm


def _absent(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """What ``p.data`` is between uses: read-only, no memory, NaN if read."""
    fill = np.nan if np.issubdtype(dtype, np.floating) else 0
    return np.broadcast_to(np.array(fill, dtype), shape)


def _no_grad(dtype: np.dtype) -> np.ndarray:
    """What ``p.grad`` is outside backward: ``fill(0)`` works, ``+=`` raises."""
    return np.empty(0, dtype)


class Progress:
    """Non-blocking requests moved on by a helper thread while the main thread computes.

    The main thread posts (``add``) and waits (``wait``); the helper only tests, every
    ``poll_interval`` seconds while anything is outstanding. One lock guards every
    call on a request (MPI forbids two threads touching one request at once). Without
    ``MPI_THREAD_MULTIPLE`` (or ``poll_interval`` 0) there is no thread: requests move
    when the main thread tests or waits. An exception in the helper ends it and is
    raised (as ``HelperError``) by the main thread's next ``post``, ``test``, ``wait``
    or ``stop``: the error ends the run where it would have ended it without a helper.
    """

    def __init__(self, poll_interval: float):
        if poll_interval > 0:
            from mpi4py import MPI

            if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
                poll_interval = 0.0
        self.poll_interval = poll_interval
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._pending: list = []
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: BaseException | None = None  # the helper's, for the main thread

    def add(self, request: Any) -> None:
        self.post(lambda: request)

    def post(self, start: Callable[[], Any]) -> Any:
        """Call ``start`` under the lock and keep the request it returns (None: nothing
        to keep). A request built in Python (the hierarchical reduce-scatter's
        ``Pending``) shares its queue with the requests posted before it, which the
        helper's ``Test`` moves on: posting outside the lock raced it (a deque mutated
        while it was walked, a phase posted twice or never: a crash or a hang)."""
        self._raise_helper_error()
        with self._lock:
            request = start()
            if request is not None:
                self._pending.append(request)
        if request is not None:
            self._wake_helper()
        return request

    def _wake_helper(self) -> None:
        if self.poll_interval > 0:
            if self._thread is None:
                self._stopping = False
                self._thread = threading.Thread(target=self._drive, daemon=True,
                                                name="hpctrain-zero3")
                self._thread.start()
            self._wake.set()

    def test(self, request: Any) -> bool:
        self._raise_helper_error()
        with self._lock:
            return bool(request.Test())

    def wait(self, request: Any) -> None:
        self._raise_helper_error()
        with self._lock:
            request.Wait()

    def _drive(self) -> None:
        busy = False
        try:
            while True:
                self._wake.wait(self.poll_interval if busy else None)
                self._wake.clear()
                if self._stopping:
                    return
                with self._lock:
                    self._pending = [r for r in self._pending if not r.Test()]
                    busy = bool(self._pending)
        except BaseException as err:  # noqa: BLE001 - the main thread raises it
            # unhandled here, Python would print it without the rank and the run would
            # go on, each request then moved only by the main thread's waits
            self._error = err

    def _raise_helper_error(self) -> None:
        err = self._error
        if err is not None:
            self._error = None  # raised once; the helper has ended
            raise HelperError(f"ZeRO 3's helper thread, which moves the parameter "
                              f"gathers and gradient reduce-scatters, failed: "
                              f"{type(err).__name__}: {err}") from err

    def stop(self) -> None:
        if self._thread is not None:
            self._stopping = True
            self._wake.set()
            self._thread.join()
            self._thread = None
        self._pending = []
        self._raise_helper_error()


class Unit:
    """The parameters first met in one piece: their flat layout and this rank's shard.

    ``full`` is the gathered buffer (None: not gathered), ``gathering`` its pending
    request; ``users`` counts the forwards/backwards running on it; ``kept``: gathered
    past a forward (``reshard_after_forward`` False). ``grad_full`` is the whole
    gradient during backward, ``reducing`` its pending reduce-scatter.
    """

    def __init__(self, index: int, params: list, dp: int, dp_rank: int):
        dtypes = {p.data.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"ZeRO-3 unit {index} mixes dtypes {sorted(map(str, dtypes))}: "
                             f"a pipeline piece's parameters must share one dtype")
        self.index, self.params, self.dtype = index, params, dtypes.pop()
        self.shapes = [p.shape for p in params]
        self.offsets = [int(o) for o in np.cumsum([0] + [p.size for p in params[:-1]])]
        self.numel = sum(p.size for p in params)
        self.padded = -(-self.numel // dp) * dp
        n = self.padded // dp
        self.lo = dp_rank * n  # this rank's shard is [lo, lo + n) of the flat unit
        self.shard = np.zeros(n, self.dtype)  # the padding stays zero
        for p, off in zip(params, self.offsets, strict=True):
            lo, hi = max(off, self.lo), min(off + p.size, self.lo + n)
            if lo < hi:  # straight from p: the whole flat unit is never made
                self.shard[lo - self.lo:hi - self.lo] = p.data.reshape(-1)[lo - off:hi - off]
        self.grad_shard = np.zeros(n, self.dtype)
        self.full: np.ndarray | None = None
        self.gathering = None
        self.users, self.kept = 0, False
        self.grad_full: np.ndarray | None = None
        self.reducing = None
        self.missing = len(params)
        for p in params:
            p.data, p.grad = _absent(p.shape, self.dtype), _no_grad(self.dtype)

    def bind(self) -> None:
        for p, off, shape in zip(self.params, self.offsets, self.shapes, strict=True):
            p.data = self.full[off:off + int(np.prod(shape))].reshape(shape)

    def unbind(self) -> None:
        for p, shape in zip(self.params, self.shapes, strict=True):
            p.data = _absent(shape, self.dtype)
        self.full, self.kept = None, False

    def bind_grads(self) -> None:
        self.grad_full = np.zeros(self.padded, self.dtype)
        for p, off, shape in zip(self.params, self.offsets, self.shapes, strict=True):
            p.grad = self.grad_full[off:off + int(np.prod(shape))].reshape(shape)

    def unbind_grads(self) -> None:
        for p in self.params:
            p.grad = _no_grad(self.dtype)
        self.grad_full = None


def engine_pieces(engine: Any) -> list:
    """This rank's pieces in forward order: a pipeline stage's chunks' parts, or the
    model's pipeline pieces, or the whole model when it declares none."""
    from hpctrain.parallel.local import LocalEngine
    from hpctrain.parallel.local_loss import LocalLossEngine
    from hpctrain.parallel.pipeline import PipelineEngine
    from hpctrain.parallel.spatial_engine import SpatialEngine

    if isinstance(engine, (SpatialEngine, LocalLossEngine)) or \
            not isinstance(engine, (LocalEngine, PipelineEngine)):
        raise ValueError(f"ZeRO-3 gathers parameters around the pieces of LocalEngine, "
                         f"TensorParallelEngine and PipelineEngine; {type(engine).__name__} "
                         f"cannot use it: zero (3) must be 0, 1 or 2 with it")
    if isinstance(engine, PipelineEngine):
        return [part for chunk in engine.stage.parts for part in chunk.parts]
    if not getattr(engine.model, "runs_its_pieces", True):
        return [engine.model]  # its forward would pass the pieces' wrappers by
    try:
        pieces = engine.model.pipeline_pieces()
    except NotImplementedError:
        return [engine.model]
    return [pieces.first, *pieces.middle, pieces.last]


class Zero3DataParallel:
    """ZeRO stage 3 over ``topo.dp_comm`` for ``engine``'s parameters.

    The per-step interface of ``data.DataParallel``; ``make_optimizer(named, decay=)``
    builds the serial optimizer over this rank's pieces; ``reduce_scatter(view, out)``
    as in ``zero.ZeroDataParallel`` (default one ``Ireduce_scatter_block``).
    ``units``: the units the engine's build already sharded, a piece at a time
    (``zero3_build.build_sharded``; checked against the engine's pieces), or None:
    made here from the whole parameters.
    Construction is collective over ``topo.model_comm`` (``counted_once``).
    """

    stage = 3

    def __init__(self, engine: Any, topo: Any, *, make_optimizer,
                 reshard_after_forward: bool = True, reduce_scatter=None,
                 poll_interval: float = POLL_INTERVAL, units: list[Unit] | None = None):
        self.engine, self.dp_comm, self.world_comm = engine, topo.dp_comm, topo.world_comm
        self.dp_size, self.dp_rank = self.dp_comm.Get_size(), self.dp_comm.Get_rank()
        self.reshard_after_forward = reshard_after_forward
        self.reduce_scatter = reduce_scatter
        self.progress = Progress(poll_interval if self.dp_size > 1 else 0.0)
        pieces = engine_pieces(engine)
        self.units, self.needs = self._make_units(pieces, engine.params, units)
        self._wrap(pieces)
        self.unit_of = {id(p): u for u in self.units for p in u.params}
        counted = dict(zip(map(id, engine.params),
                           counted_once(engine.named_params, topo.model_comm, topo.tp_size),
                           strict=True))
        named, decay, self.norm_pieces = self._cut_pieces(engine.named_params, counted)
        self.pieces = [piece for _, piece in named]
        self.optimizer = make_optimizer(named, decay=decay) if named else None
        engine.on_grads_ready = self._grads_ready
        self.gather_s, self.peak_gathered = 0.0, 0
        self._sent = 0.0  # bytes this rank sent since the last metrics() (dp_bytes)

    # ---- layout ---------------------------------------------------------------------

    def _make_units(self, pieces: list, params: list,
                    built: list[Unit] | None) -> tuple[list[Unit], list[list[Unit]]]:
        """One unit per piece with parameters of its own (``built``'s, if given);
        which units each piece needs."""
        owner: dict[int, int] = {}
        own: list[list] = []
        for k, piece in enumerate(pieces):
            own.append([p for p in piece.parameters() if owner.setdefault(id(p), k) == k])
        missing = [p for p in params if id(p) not in owner]
        if missing:
            raise ValueError(f"ZeRO-3 shards the parameters of the model's pieces; "
                             f"{len(missing)} parameter(s) belong to no piece: {missing[:3]}")
        mine = [k for k, ps in enumerate(own) if ps]
        unit_of_piece = {k: i for i, k in enumerate(mine)}
        if built is None:
            units = [Unit(i, own[k], self.dp_size, self.dp_rank) for i, k in enumerate(mine)]
        else:
            units = self._check_built(built, [own[k] for k in mine])
        needs = []
        for piece in pieces:
            idx = sorted({unit_of_piece[owner[id(p)]] for p in piece.parameters()})
            needs.append([units[i] for i in idx])
        return units, needs

    def _check_built(self, built: list[Unit], own: list[list]) -> list[Unit]:
        """``built`` if its units are the ones the engine's pieces make here: the same
        parameters in the same order, sharded over this data group."""
        want = [[id(p) for p in ps] for ps in own]
        got = [[id(p) for p in u.params] for u in built]
        layout = all(len(u.shard) * self.dp_size == u.padded
                     and u.lo == self.dp_rank * len(u.shard) for u in built)
        if got != want or not layout:
            raise ValueError(f"ZeRO-3's build sharded {len(built)} unit(s) of "
                             f"{[len(g) for g in got]} parameters, the engine's pieces make "
                             f"{len(want)} of {[len(w) for w in want]}"
                             + ("" if layout else f", over another dp than {self.dp_size}")
                             + ": the build and the engine disagree on this rank's pieces")
        return built

    def _cut_pieces(self, named_params: list, counted: dict[int, bool]):
        """This rank's optimizer pieces ``[(name[lo:hi], ShardPiece)]``, decay flags,
        and the pieces the global norm counts."""
        name_of = {id(p): name for name, p in named_params}
        named, decay, norm = [], [], []
        for u in self.units:
            n = len(u.shard)
            for p, off in zip(u.params, u.offsets, strict=True):
                lo, hi = max(off, u.lo), min(off + p.size, u.lo + n)
                if lo >= hi:
                    continue
                piece = ShardPiece(u.shard[lo - u.lo:hi - u.lo], u.grad_shard[lo - u.lo:hi - u.lo])
                named.append((f"{name_of[id(p)]}[{lo - off}:{hi - off}]", piece))
                decay.append(p.ndim >= 2)
                if counted[id(p)]:
                    norm.append(piece)
        return named, decay, norm

    def _wrap(self, pieces: list) -> None:
        """Gather around each piece's ``forward`` and ``backward`` (instance attributes:
        the model's classes are untouched), and every unit around evaluation."""
        for k, piece in enumerate(pieces):
            piece.forward = self._around(piece.forward, k, backward=False)
            piece.backward = self._around(piece.backward, k, backward=True)
        for name in ("loss", "eval_metrics", "predict"):
            if hasattr(self.engine, name):
                setattr(self.engine, name, self._gathering_all(getattr(self.engine, name)))

    def _around(self, run, k: int, *, backward: bool):
        step = -1 if backward else 1

        def gathered(*args, **kwargs):
            units = self.needs[k]
            self._acquire(units)
            nxt = k + step
            if 0 <= nxt < len(self.needs):
                for u in self.needs[nxt]:
                    self._start_gather(u)  # prefetch: moves while this piece runs
            if backward:
                for u in units:
                    if u.grad_full is None:
                        u.bind_grads()
            try:
                return run(*args, **kwargs)
            finally:
                self._release(units, keep=not backward and not self.reshard_after_forward)
                self._reap()

        return gathered

    def _gathering_all(self, run):
        def gathered(*args, **kwargs):
            self._acquire(self.units)
            try:
                return run(*args, **kwargs)
            finally:
                self._release(self.units, keep=False)
                self._finish_gathers()
                self.progress.stop()
        return gathered

    # ---- gathers ----------------------------------------------------------------------

    def _start_gather(self, u: Unit) -> None:
        if u.full is not None:
            return
        if self.dp_size == 1:
            u.full = u.shard  # the shard is the whole unit
            return
        u.full = np.empty(u.padded, u.dtype)
        u.gathering = self.dp_comm.Iallgather(u.shard, u.full)
        self._sent += u.full.nbytes * (self.dp_size - 1) / self.dp_size  # the ring model
        self.progress.add(u.gathering)
        self._note_peak()

    def _acquire(self, units: list[Unit]) -> None:
        for u in units:
            self._start_gather(u)
        t0 = time.perf_counter()
        for u in units:
            if u.gathering is not None:
                with trace.span("zero3_gather", "dp_comm", unit=u.index):
                    self.progress.wait(u.gathering)
                u.gathering = None
            if u.users == 0:
                u.bind()
            u.users += 1
        self.gather_s += time.perf_counter() - t0

    def _release(self, units: list[Unit], *, keep: bool) -> None:
        for u in units:
            u.users -= 1
            u.kept = keep  # a backward (or an evaluation) always ends the keeping
            if u.users == 0 and not u.kept:
                u.unbind()

    def _finish_gathers(self) -> None:
        """Free every unit not in use: prefetched but unused, or kept since a forward."""
        for u in self.units:
            if u.gathering is not None:
                self.progress.wait(u.gathering)
                u.gathering = None
            if u.users == 0 and u.full is not None:
                u.unbind()

    def _note_peak(self) -> None:
        held = sum(u.full.nbytes for u in self.units
                   if u.full is not None and u.full is not u.shard)
        self.peak_gathered = max(self.peak_gathered, held)

    # ---- gradients ---------------------------------------------------------------------

    def _grads_ready(self, params) -> None:
        """The engine's hook: reduce-scatter each unit whose parameters are all final."""
        for p in params:
            u = self.unit_of[id(p)]
            u.missing -= 1
            if u.missing == 0:
                self._reduce(u)
        self._reap()

    def _reduce(self, u: Unit) -> None:
        if u.grad_full is None:  # no backward touched it: a zero gradient
            u.grad_shard.fill(0)
            return
        if self.dp_size == 1:
            u.grad_shard[...] = u.grad_full
            u.unbind_grads()
            return
        self._sent += u.grad_full.nbytes * (self.dp_size - 1) / self.dp_size
        if self.reduce_scatter is not None:
            u.reducing = self.progress.post(lambda: self.reduce_scatter(u.grad_full,
                                                                        u.grad_shard))
        else:
            from mpi4py import MPI

            u.reducing = self.progress.post(lambda: self.dp_comm.Ireduce_scatter_block(
                u.grad_full, u.grad_shard, op=MPI.SUM))
        if u.reducing is None:
            u.unbind_grads()

    def _reap(self) -> None:
        """Free the gradient buffers whose reduce-scatter has completed."""
        for u in self.units:
            if u.reducing is not None and self.progress.test(u.reducing):
                u.reducing = None
                u.unbind_grads()

    # ---- the step ----------------------------------------------------------------------

    def zero_grad(self) -> None:
        """A step begins: nothing reported, then the engine's own ``zero_grad``."""
        for u in self.units:
            u.missing = len(u.params)
        self.gather_s = 0.0
        self.engine.zero_grad()

    def finish_grads(self) -> None:
        """Reduce-scatter the units never reported (in unit order, the same on every
        rank), wait for every reduction, free what is still gathered."""
        t0 = time.perf_counter()
        for u in self.units:
            if u.missing > 0:
                u.missing = 0
                self._reduce(u)
        for u in self.units:
            if u.reducing is not None:
                self.progress.wait(u.reducing)
                u.reducing = None
                u.unbind_grads()
        self._finish_gathers()
        self.progress.stop()
        self.wait_s = time.perf_counter() - t0

    def grad_norm(self) -> float:
        """The global gradient norm from the owned shards (collective over all ranks)."""
        return shard_grad_norm(self.norm_pieces, self.world_comm)

    def clip(self, max_norm: float, norm: float) -> float:
        return clip.clip_grads(self.pieces, max_norm, norm)

    def step(self, lr: float) -> None:
        """Update the owned shards; they stay sharded (gathered again at the next use)."""
        if self.optimizer is not None:
            self.optimizer.step(lr)

    # ---- memory, metrics, checkpoints ----------------------------------------------------

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds now for parameters (shards and gathered units),
        gradients (shards and whole buffers in backward) and optimizer state."""
        gathered = sum(u.full.nbytes for u in self.units
                       if u.full is not None and u.full is not u.shard)
        grads = sum(u.grad_full.nbytes for u in self.units if u.grad_full is not None)
        return {"param_bytes": sum(u.shard.nbytes for u in self.units) + gathered,
                "grad_bytes": sum(u.grad_shard.nbytes for u in self.units) + grads,
                "optim_bytes": state_nbytes(self.optimizer)}

    def padded_numel(self) -> int:
        """``N'``: this rank's parameters with each unit's padding."""
        return sum(u.padded for u in self.units)

    def metrics(self) -> dict[str, float]:
        """Waits, the gathered peak, and ``dp_bytes``: what this rank sent since the
        last call for every gather it posted (each microbatch's forward, and again its
        backward when resharding; a tied table's unit for the head too) and every
        gradient reduce-scatter, by the ring model: (dp - 1) / dp of the unit's bytes."""
        out = {"zero3_gather_wait_s": self.gather_s,
               "zero3_gathered_peak_bytes": self.peak_gathered,
               "dp_wait_s": getattr(self, "wait_s", 0.0), "dp_bytes": self._sent}
        self._sent = 0.0
        self.peak_gathered = 0
        return out

    def held_tensors(self, engine: Any, tp_rank: int, tp_size: int) -> list[Held]:
        """What this rank saves and loads: its flat slice ``[lo, hi)`` of every parameter
        it owns part of (``model/<name>``, a ``Sharding`` with ``flat``), the engine's
        buffers whole, and the optimizer state of the same slices."""
        name_of = {id(p): name for name, p in engine.named_params}
        params = dict(engine.named_params)
        held = []
        for u in self.units:
            n = len(u.shard)
            for p, off in zip(u.params, u.offsets, strict=True):
                lo, hi = max(off, u.lo), min(off + p.size, u.lo + n)
                if lo < hi:
                    held.append(Held(f"model/{name_of[id(p)]}", u.shard[lo - u.lo:hi - u.lo],
                                     param_sharding(p, tp_rank, tp_size, (lo - off, hi - off))))
        held += [Held(f"model/{name}", array, param_sharding(array, tp_rank, tp_size))
                 for name, array in getattr(engine, "named_buffers", ())]
        for state, name, flat, array in optimizer_entries(self.optimizer, True):
            held.append(Held(f"optim/{state}/{name}", array,
                             param_sharding(params[name], tp_rank, tp_size, flat)))
        return held
