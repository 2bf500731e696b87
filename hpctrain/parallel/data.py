"""Data parallelism: gradients summed over ``dp_comm`` in buckets, overlapped with backward.

Every parameter's ``.grad`` is a view into one flat buffer per dtype. The buffer holds
the parameters in *backward order* (the reverse of ``named_parameters``), so it fills
from the front while backward runs, and it is cut at parameter boundaries into
buckets of about ``bucket_mb``. A bucket is reduced by one non-blocking collective as
soon as the engine reports all its parameters final (``mark_ready``, the engine's
``on_grads_ready`` hook, called on the last microbatch only), while backward goes on
with earlier layers. GPT, 2 layers, dp = 2::

    flat gradient  | lm_head ln_f | blocks.1.*     | blocks.0.*     | wpe wte | pad |
    bucket         |<-- 0 ------->|<-- 1 --------->|<-- 2 --------->|<-- 3 ------>|

    backward       | head | block 1 | block 0 | embed | wait | norm, clip, step
    bucket 0              [Iallreduce..]
    bucket 1                        [Iallreduce....]
    bucket 2                                  [Iall...]
    bucket 3                                          [Ia.]

MPICH moves a non-blocking collective only inside MPI calls, and one all-reduce
takes about five rounds of them on both ranks (handshake, copy, reduce, ...): the
hooks between layer backwards are too few. So during backward a helper thread,
woken by the hooks, launches the buckets reported complete and tests the outstanding
ones every millisecond until they are done (the GIL is free while BLAS runs); the
hook itself only counts. Without ``MPI_THREAD_MULTIPLE`` the hooks launch and test.
``wait`` stops the helper, then
launches, one at a time, whatever the engine never reported (an engine without hooks
is still correct, only not overlapped) and waits for the rest. Buckets launch
strictly in index order, the same on every rank of the data group, as MPI requires
of collectives on one communicator; only one thread makes MPI calls at a time.

Averaging by the global batch: each rank's loss is the mean over its ``B / dp``
samples, so the global mean loss is ``(1 / dp) sum_r loss_r``. The training loop
asks the engine for the gradient of ``loss_r / dp`` (``scale``) and the buckets are
*summed*: no extra pass over the gradients.

How a bucket is summed is the ``launch`` function's business: one ``Iallreduce``
over ``dp_comm`` (``allreduce_launcher``), or three phases through one leader per
node (``hierarchy.HierarchicalReduce``, ``parallel.dp_reduce = "hierarchical"``).

``DataParallel`` is ZeRO stage 0: whole gradients and optimizer state on every rank,
the serial optimizer after the sum. ``zero.py`` builds stages 1 and 2 on the same
buckets, reduce-scattered instead of all-reduced.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpctrain import trace
from hpctrain.nn.module import is_sparse
from hpctrain.optim import clip
from hpctrain.optim.optimizers import AdamW

MiB = 1 << 20
POLL_INTERVAL = 1e-3  # seconds between the helper thread's launches and tests


def plan_buckets(sizes: list[int], itemsize: int, bucket_mb: float,
                 align: int = 1) -> list[tuple[int, int, int, int]]:
    """Cut parameters of ``sizes`` elements (in backward order) into buckets.

    A bucket takes parameters until it holds at least ``bucket_mb`` MiB, so only the
    last bucket may be smaller, and a parameter larger than a bucket is a bucket of
    its own; parameters are never split. Each bucket is padded with zeros to a
    multiple of ``align`` elements (ZeRO: ``dp``, so every rank owns an equal shard).
    Returns ``(first, stop, start, size)`` per bucket: parameters ``[first, stop)``,
    at element ``start`` of the flat buffer, ``size`` elements including the padding.
    """
    if bucket_mb <= 0 or align < 1:
        raise ValueError(f"bucket_mb ({bucket_mb}) must be positive and align ({align}) "
                         f"at least 1")
    limit = bucket_mb * MiB / itemsize  # elements
    buckets, first, filled, start = [], 0, 0, 0
    for i, n in enumerate(sizes):
        filled += n
        if filled >= limit or i == len(sizes) - 1:
            size = -(-filled // align) * align
            buckets.append((first, i + 1, start, size))
            first, filled, start = i + 1, 0, start + size
    return buckets


class HelperError(RuntimeError):
    """A helper thread that moves non-blocking sums while the training thread computes
    (``GradBuckets``, ZeRO 3's ``Progress``) failed; its error is the ``__cause__``,
    raised on the training thread so the run ends as for any other error."""


@dataclass
class Bucket:
    """Parameters ``params`` (backward order) at ``[start, start + size)`` of the flat
    buffer ``dtype``; ``offsets[i]`` is where ``params[i]`` begins in that buffer."""

    index: int
    dtype: np.dtype
    params: list
    offsets: list[int]
    start: int
    size: int

    @property
    def stop(self) -> int:
        return self.start + self.size


def _layout(backward: list, bucket_mb: float,
            align: int) -> tuple[list[Bucket], dict[np.dtype, int]]:
    """The buckets of parameters in backward order, one flat buffer per dtype, in
    launch order (by the backward position of each bucket's first parameter); and
    each buffer's size."""
    sparse = [p for p in backward if is_sparse(p)]
    if sparse:
        raise ValueError(f"the bucketed all-reduce sums dense gradients; {sparse} have sparse "
                         f"ones (embedding tables): hpctrain.parallel.sparse_data exchanges "
                         f"those")
    by_dtype: dict[np.dtype, list] = {}
    for p in backward:
        by_dtype.setdefault(p.data.dtype, []).append(p)
    buckets, sizes = [], {}
    for dtype, group in by_dtype.items():
        plan = plan_buckets([p.size for p in group], dtype.itemsize, bucket_mb, align)
        for first, stop, start, size in plan:
            members = group[first:stop]
            offsets = start + np.cumsum([0] + [p.size for p in members[:-1]])
            buckets.append(Bucket(0, dtype, members, [int(o) for o in offsets], start, size))
        sizes[dtype] = plan[-1][2] + plan[-1][3]
    position = {id(p): i for i, p in enumerate(backward)}
    buckets.sort(key=lambda b: position[id(b.params[0])])
    for i, b in enumerate(buckets):
        b.index = i
    return buckets, sizes


class GradBuckets:
    """The flat gradient buffers behind every ``param.grad``, and their bucketed reduction.

    ``launch(bucket, view) -> request | None`` starts the bucket's collective over the
    data group (None: nothing to wait for, e.g. one rank); a request is an MPI request
    or an object with ``Test()`` and ``Wait()`` (``hierarchy.Pending``).
    ``poll_interval`` is the helper thread's period in seconds (0: no thread, the hooks
    launch and test).
    Per step: ``zero`` (fresh zero gradients), backward with ``mark_ready`` calls,
    then ``wait``. ``release`` drops the buffers (ZeRO-2 keeps only its shard);
    ``zero`` allocates them again.
    """

    def __init__(self, params: list, launch, *, bucket_mb: float, align: int = 1,
                 poll_interval: float = 0.0):
        self.launch = launch
        if poll_interval > 0:
            from mpi4py import MPI

            if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
                poll_interval = 0.0
        self.poll_interval = poll_interval
        self._lock = threading.Lock()  # the bookkeeping the hook and the helper share
        self._wake = threading.Event()
        self._error: BaseException | None = None  # the helper's, for the training thread
        self._stopping = False
        self.buckets, self.sizes = _layout(list(reversed(params)), bucket_mb, align)
        self.bucket_of = {id(p): b.index for b in self.buckets for p in b.params}
        self.flat: dict[np.dtype, np.ndarray | None] = {}
        self.wait_s = self.hook_s = self.wait_start = 0.0
        self._allocate(keep=True)
        self._reset()

    # ---- buffers ------------------------------------------------------------------

    def _allocate(self, keep: bool = False) -> None:
        """Fresh zero buffers; every ``p.grad`` becomes its view (``keep``: copy the
        current gradients in first)."""
        for dtype, n in self.sizes.items():
            self.flat[dtype] = np.zeros(n, dtype)
        self.views = []
        for b in self.buckets:
            flat = self.flat[b.dtype]
            for p, off in zip(b.params, b.offsets, strict=True):
                view = flat[off:off + p.size].reshape(p.shape)
                if keep:
                    view[...] = p.grad
                p.grad = view
                self.views.append((p, view))

    def release(self) -> None:
        """Drop the flat buffers; until ``zero``, each ``p.grad`` reads as read-only zeros."""
        for b in self.buckets:
            zero = np.zeros((), b.dtype)
            for p in b.params:
                p.grad = np.broadcast_to(zero, p.shape)
        self.flat = dict.fromkeys(self.sizes)
        self.views = []

    def nbytes(self) -> int:
        """Bytes of the flat buffers currently held."""
        return sum(f.nbytes for f in self.flat.values() if f is not None)

    def layout_nbytes(self) -> int:
        """Bytes of the flat buffers of the layout, held or released (ZeRO 2 releases
        them after each step's sums)."""
        return sum(n * np.dtype(dtype).itemsize for dtype, n in self.sizes.items())

    def bucket_view(self, b: Bucket) -> np.ndarray:
        return self.flat[b.dtype][b.start:b.stop]

    # ---- one step -----------------------------------------------------------------

    def _reset(self) -> None:
        self._helper: threading.Thread | None = None
        self._missing = [len(b.params) for b in self.buckets]
        self._reported: set[int] = set()
        self._next = 0  # the next bucket to launch
        self._requests: list = []  # touched by the helper while it runs, else by wait
        self._launched: list[tuple[int, float]] = []  # (bucket, launch time) in flight
        self.early = 0
        self.reduced = 0  # buckets seen reduced this step (read by overlap.py while it runs)

    def zero(self) -> None:
        """Zero every gradient (allocating the buffers if released); a step begins."""
        self._stop_helper()  # left running only if the last step raised
        if any(f is None for f in self.flat.values()):
            self._allocate()
        else:
            for f in self.flat.values():
                f.fill(0)
        for p, view in self.views:  # the engine's zero_grad then fills nothing again
            p.mark_zero(view)
        self._reset()

    def mark_ready(self, params) -> None:
        """The engine's hook: ``params``' gradients are final for this step. Complete
        buckets are launched in order, by the helper thread (started here) or here."""
        t0 = time.perf_counter()
        self._raise_helper_error()
        with self._lock:
            for p in params:
                if id(p) in self._reported:
                    raise RuntimeError(f"{p!r} was reported final twice in one step")
                self._reported.add(id(p))
                self._missing[self.bucket_of[id(p)]] -= 1
        if self.poll_interval > 0:
            if self._helper is None:
                self._stopping = False
                self._helper = threading.Thread(target=self._drive, daemon=True,
                                                name="hpctrain-grad-buckets")
                self._helper.start()
            self._wake.set()
        else:
            self._launch_ready()
            self._test()
        self.hook_s += time.perf_counter() - t0

    def _drive(self) -> None:
        """The helper thread: launch what is complete, test what is out. It sleeps
        until the next hook while nothing is out, and ``poll_interval`` while
        something is, so it costs a few wake-ups per bucket, not one per interval."""
        done = True
        try:
            while True:
                self._wake.wait(None if done else self.poll_interval)
                self._wake.clear()  # before reading the counts: no report is missed
                if self._stopping:
                    return
                self._launch_ready()
                done = self._test()
        except BaseException as err:  # noqa: BLE001 - the training thread raises it
            # unhandled here, Python would print it without the rank and training would
            # go on: the bucket it was launching never summed, the replicas apart
            self._error = err

    def _stop_helper(self) -> None:
        if self._helper is not None:
            self._stopping = True
            self._wake.set()
            self._helper.join()
            self._helper = None
        self._raise_helper_error()

    def _raise_helper_error(self) -> None:
        """The helper's error, raised on the training thread (once): at the next hook,
        the wait for the sums or the next step's zeroing, whichever comes first."""
        err, self._error = self._error, None
        if err is not None:
            raise HelperError(f"the data-parallel reduction's helper thread, which "
                              f"launches and moves the gradient buckets' sums, failed: "
                              f"{type(err).__name__}: {err}") from err

    def _launch_ready(self) -> None:
        while True:
            with self._lock:
                if self._next == len(self.buckets) or self._missing[self._next]:
                    return
                b = self.buckets[self._next]
                self._next += 1
            request = self.launch(b, self.bucket_view(b))
            if request is not None:
                self._requests.append(request)
                self._launched.append((b.index, time.perf_counter()))

    def _test(self) -> bool:
        """Whether every request launched so far is complete (testing moves them)."""
        if not self._requests:
            return True
        done = _test_all(self._requests)
        if done:
            self._trace_completed()
        return done

    def _trace_completed(self) -> None:
        """A span per bucket in flight, from its launch to now (seen complete)."""
        now = time.perf_counter()
        self.reduced += len(self._launched)
        for index, start in self._launched:
            trace.active().add(f"bucket {index}", "dp_comm", start, now, bucket=index,
                               track="dp buckets")  # beside the backward, not in it
        self._launched = []

    def test(self) -> bool:
        """Whether every bucket launched so far is reduced (moves them on; no thread may
        be driving them: call after ``wait`` stopped it, or with ``poll_interval`` 0)."""
        return self._test()

    def wait(self) -> None:
        """Launch the buckets not yet launched, wait for all: the gradients are reduced.

        The buckets launched here go one at a time: a bucket of a few MiB stays in
        cache through its reduction, and several at once would evict each other.
        """
        t0 = self.wait_start = time.perf_counter()
        for p, view in self.views:
            if p.grad is not view:
                raise RuntimeError(f"a gradient {p!r} was replaced during backward: engines "
                                   f"must accumulate into param.grad in place")
        self._stop_helper()
        self.early = self._next
        in_flight = self._requests
        for b in self.buckets[self._next:]:
            _wait_all(in_flight)
            self._trace_completed()
            request = self.launch(b, self.bucket_view(b))
            in_flight = [] if request is None else [request]
            if request is not None:
                self._launched.append((b.index, time.perf_counter()))
        self._next = len(self.buckets)
        _wait_all(in_flight)
        self._trace_completed()
        self._requests = []
        self.wait_s += time.perf_counter() - t0

    def take_times(self) -> dict[str, float]:
        """Seconds spent in ``wait`` and in the hooks since the last call; resets them."""
        times = {"dp_wait_s": self.wait_s, "dp_hook_s": self.hook_s,
                 "dp_buckets_early": self.early}
        self.wait_s = self.hook_s = 0.0
        return times


def _test_all(requests: list) -> bool:
    """Whether every request is complete: MPI requests, or objects with ``Test()`` and
    ``Wait()`` (``hierarchy.Pending``: a bucket of several phases). Testing moves them."""
    from mpi4py import MPI

    if all(isinstance(r, MPI.Request) for r in requests):
        return MPI.Request.Testall(requests)
    return all([r.Test() for r in requests])


def _wait_all(requests: list) -> None:
    if not requests:
        return
    from mpi4py import MPI

    if all(isinstance(r, MPI.Request) for r in requests):
        MPI.Request.Waitall(requests)
    else:
        for r in requests:
            r.Wait()


def allreduce_launcher(dp_comm: Any):
    """``launch`` for GradBuckets: an in-place non-blocking sum over ``dp_comm``."""
    if dp_comm.Get_size() == 1:
        return lambda bucket, view: None
    from mpi4py import MPI

    return lambda bucket, view: dp_comm.Iallreduce(MPI.IN_PLACE, view, op=MPI.SUM)


class DataParallel:
    """ZeRO stage 0: bucketed all-reduce, then the serial optimizer on whole gradients.

    Per step, collective over ``dp_comm``: ``zero_grad``, the engine's
    ``forward_backward(scale=1 / dp)``, ``finish_grads``, ``grad_norm``, ``clip``,
    ``step``. Registers itself as the engine's ``on_grads_ready`` hook. With AdamW
    (dense gradients) ``clip`` only records its factor and the update applies it as it
    reads each gradient (one pass over the gradients fewer; the gradients keep their
    unclipped values, the update is the same bits).
    """

    stage = 0

    def __init__(self, engine: Any, optimizer: Any, dp_comm: Any, *, bucket_mb: float,
                 launch=None):
        """``launch``: how a bucket is summed over the data group (default
        ``allreduce_launcher(dp_comm)``; ``hierarchy.hierarchical_launcher`` for nodes)."""
        self.engine, self.optimizer, self.dp_comm = engine, optimizer, dp_comm
        self.dp_size = dp_comm.Get_size()
        self.grads = GradBuckets(engine.params, launch or allreduce_launcher(dp_comm),
                                 bucket_mb=bucket_mb,
                                 poll_interval=POLL_INTERVAL if self.dp_size > 1 else 0.0)
        engine.on_grads_ready = self.grads.mark_ready
        self._grad_scale = 1.0  # clip's factor, for the next step's update
        self._scale_in_update = (isinstance(optimizer, AdamW)
                                 and not any(is_sparse(p) for p in engine.params))

    def zero_grad(self) -> None:
        """Zero the buffers, then the engine's own ``zero_grad`` (its per-step counters)."""
        self.grads.zero()
        self.engine.zero_grad()

    def finish_grads(self) -> None:
        """Wait for every bucket: ``param.grad`` holds the gradient of the global mean."""
        self.grads.wait()

    def grad_norm(self) -> float:
        """The global gradient norm (the engine's: collective over the model group)."""
        return self.engine.grad_norm()

    def clip(self, max_norm: float, norm: float) -> float:
        if not self._scale_in_update:
            return clip.clip_grads(self.engine.params, max_norm, norm)
        self._grad_scale = clip.clip_scale(max_norm, norm)  # applied by step's update
        return self._grad_scale

    def step(self, lr: float) -> None:
        scale, self._grad_scale = self._grad_scale, 1.0
        if scale != 1.0:
            self.optimizer.step(lr, grad_scale=scale)
        else:
            self.optimizer.step(lr)

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state."""
        return {"param_bytes": sum(p.data.nbytes for p in self.engine.params),
                "grad_bytes": self.grads.nbytes(),
                "optim_bytes": state_nbytes(self.optimizer)}

    def metrics(self) -> dict[str, float]:
        """The bucket timings, and ``dp_bytes``: what this rank sent for the step's
        all-reduce of the gradients by the ring model (``averaging.ring_bytes``), to
        compare with the averaging strategies."""
        from hpctrain.parallel.averaging import ring_bytes

        wire = getattr(self.grads.launch, "wire_fraction", 1)  # bf16 on the wire: 0.5
        return {**self.grads.take_times(),
                "dp_bytes": ring_bytes(self.grads.nbytes() * wire, self.dp_size)}


def state_nbytes(optimizer: Any) -> int:
    """Bytes of an optimizer's state arrays (the step counter aside)."""
    if optimizer is None:
        return 0
    return sum(a.nbytes for k, a in optimizer.state_arrays().items() if k != "t")
