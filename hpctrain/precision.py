"""Reduced precision: parameters and activations stored in bfloat16 or float16,
arithmetic in float32, float32 master weights and optimizer state.

``[train] precision`` chooses the storage of the model's working values::

    "fp32"   everything in the model's dtype (the reference; nothing here runs)
    "bf16"   bfloat16 (8 exponent bits, as float32's, 7 mantissa bits): NumPy has no
             such dtype, the ``ml_dtypes`` package gives it one
    "fp16"   IEEE half (5 exponent bits, 10 mantissa bits): small gradients underflow
             and large ones overflow, so the loss is scaled (``LossScaler``)

NumPy's matmul on bfloat16 or float16 arrays has no BLAS (a C loop, hundreds of times
slower), so nothing is *computed* in them: the low-precision dtype is where values
rest, float32 is where they are combined, as on hardware whose tensor cores read
bf16 and accumulate in fp32. ``apply`` wraps each pipeline piece of the model
(``Model.pipeline_pieces``: the GPT's embedding, blocks and head), on the instance,
like ``parallel.recompute`` does, so every engine and schedule runs it::

    forward    the piece's parameters rounded to the low dtype (the working copy,
               ``W16 = low(W32)``, upcast for BLAS) while it runs; its output rounded
               (the activation handed to the next piece); its cache stored in the low
               dtype (every float32 array in it: the activations backward reads)
    backward   the cache upcast, the parameters rounded again, the piece's backward;
               the input gradient it returns rounded (gradients flow between pieces
               in the low dtype: where fp16 overflows, and why it needs loss scaling)

The master weights are ``Parameter.data`` itself, float32: the optimizer, its state,
the gradients (accumulated in float32, ``.grad``), clipping, ZeRO's shards and the
checkpoints see the same arrays as in an fp32 run. So a checkpoint of a bf16 run
holds float32 masters and loads into an fp32 run and back, exactly; the precision is
recorded in its metadata (``state``). The low-precision working copy exists for the
duration of a piece's forward or backward, like ZeRO-3's gathered parameters: a
persistent copy would add 2 bytes a parameter and change no number.

fp16 loss scaling (``LossScaler``): the backward starts from ``S * dloss``; after the
data-parallel sum the gradients are divided by ``S``. A non-finite gradient norm is an
overflow: the step is skipped by the non-finite guard (``hpctrain.guard``) on every
rank alike, and ``S`` halves. After ``GROWTH_INTERVAL`` finite steps in a row ``S``
doubles. A run whose scale keeps overflowing stops as any diverging run does, after
``[train] max_skipped_steps`` skipped steps in a row.

Gradient communication in bfloat16 with float32 sums is ``parallel/bf16_reduce.py``
(``[parallel] grad_comm_dtype``), independent of the storage precision.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from hpctrain.config import PRECISIONS

ML_DTYPES_REMEDY = ("install it: `pip install ml_dtypes` (a dependency of hpctrain: "
                    "`make install` or `pip install -e .` puts it in the venv)")
INITIAL_SCALE = 2.0 ** 16
GROWTH_INTERVAL = 1000  # finite steps in a row before the loss scale doubles


class PrecisionError(ValueError):
    """A precision that cannot run here (unknown name, ``ml_dtypes`` missing)."""


def ml_dtypes_missing() -> str | None:
    """Why the bfloat16 dtype is unavailable, or None when ``ml_dtypes`` imports."""
    try:
        import ml_dtypes  # noqa: F401
    except ImportError as err:
        return f"the ml_dtypes package is not installed ({err})"
    return None


def bfloat16() -> np.dtype:
    """NumPy's bfloat16 dtype (``ml_dtypes``); a clear error naming the fix without it."""
    missing = ml_dtypes_missing()
    if missing is not None:
        raise PrecisionError(f"bfloat16 needs the ml_dtypes package, but {missing}: "
                             f"{ML_DTYPES_REMEDY}")
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def storage_dtype(name: str) -> np.dtype | None:
    """The dtype ``precision`` ``name`` stores in (None: "fp32", the model's own)."""
    if name not in PRECISIONS:
        raise PrecisionError(f"precision ({name!r}) must be one of {', '.join(PRECISIONS)}")
    if name == "fp32":
        return None
    return np.dtype(np.float16) if name == "fp16" else bfloat16()


def round_to(a: np.ndarray, low: np.dtype) -> np.ndarray:
    """float32 ``a`` rounded to the nearest value of ``low`` (overflow: inf), as float32."""
    with np.errstate(over="ignore"):  # fp16 overflow is inf on purpose: loss scaling sees it
        return a.astype(low).astype(a.dtype)


def _is_compute(a: Any) -> bool:
    return isinstance(a, np.ndarray) and a.dtype == np.float32


def compress(tree: Any, low: np.dtype) -> Any:
    """Every float32 array in a cache (nested tuples, NamedTuples, lists) as ``low``;
    integer arrays (token ids, targets) and everything else unchanged."""
    if _is_compute(tree):
        with np.errstate(over="ignore"):
            return tree.astype(low)
    return _map(tree, lambda t: compress(t, low))


def expand(tree: Any, low: np.dtype) -> Any:
    """``compress`` undone: every ``low`` array in the cache as float32 (exactly)."""
    if isinstance(tree, np.ndarray) and tree.dtype == low:
        return tree.astype(np.float32)
    return _map(tree, lambda t: expand(t, low))


def _map(tree: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(tree, tuple):
        items = [fn(t) for t in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else tuple(items)
    if isinstance(tree, list):
        return [fn(t) for t in tree]
    return tree


def nbytes(tree: Any) -> int:
    """Bytes of the arrays in a cache (tests and the benchmark compare precisions)."""
    if isinstance(tree, np.ndarray):
        return tree.nbytes
    if isinstance(tree, (tuple, list)):
        return sum(nbytes(t) for t in tree)
    return 0


# ---------------------------------------------------------------------------------
# the pieces


def apply(model: Any, name: str) -> int:
    """Make every pipeline piece of ``model`` store in precision ``name`` (in place);
    return how many pieces were wrapped (0 for "fp32": the model is left as it is)."""
    low = storage_dtype(name)
    if low is None:
        return 0
    pieces = model.pipeline_pieces()
    if pieces is None:
        raise PrecisionError(f"precision ({name!r}) stores the activations of pipeline "
                             f"pieces, and the {model.name} declares none")
    wrapped = [pieces.first, *pieces.middle, pieces.last]
    for piece in wrapped:
        store_in(piece, low)
    return len(wrapped)


def store_in(piece: Any, low: np.dtype) -> None:
    """``piece.forward`` and ``piece.backward`` (replaced on the instance) run on
    parameters rounded to ``low``; the cache between them, the output and the input
    gradient are stored in ``low`` (see the module docstring). Extra arguments (the
    head's targets, a block's ``after_half`` hook) pass through."""
    forward: Callable = piece.forward  # the bound originals (or recompute's)
    backward: Callable = piece.backward
    params = piece.parameters()  # a tied table the piece reads is among them

    def rounded(fn: Callable, *args, **kwargs):
        masters = [p.data for p in params]  # float32, or ZeRO's views: put back as found
        for p in params:
            p.data = round_to(p.data, low)
        try:
            return fn(*args, **kwargs)
        finally:
            for p, master in zip(params, masters, strict=True):
                p.data = master

    def forward_stored(x, *args, **kwargs):
        y, cache = rounded(forward, x, *args, **kwargs)
        if _is_compute(y):  # an activation; the head returns the loss, a float
            y = round_to(y, low)
        return y, compress(cache, low)

    def backward_stored(dy, cache, *args, **kwargs):
        dx = rounded(backward, dy, expand(cache, low), *args, **kwargs)
        return round_to(dx, low) if _is_compute(dx) else dx

    piece.forward = forward_stored
    piece.backward = backward_stored


# ---------------------------------------------------------------------------------
# loss scaling (fp16)


class LossScaler:
    """Dynamic loss scaling: backward from ``scale * loss``, gradients divided by it.

    ``unscale(params, norm)`` after the data-parallel sum: divides every gradient by
    the scale and returns the true norm; a non-finite norm (an overflow, the same
    verdict on every rank: the norm is global) halves the scale, and the caller's
    guard skips the step. ``GROWTH_INTERVAL`` finite steps in a row double it.
    ``static``: a fixed scale (``[train] loss_scale`` > 0), never changed.
    """

    def __init__(self, scale: float = INITIAL_SCALE, static: bool = False,
                 growth_interval: int = GROWTH_INTERVAL, min_scale: float = 1.0):
        self.scale, self.static = float(scale), static
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.good_steps = 0
        self.overflows = 0

    def unscale(self, params: list, norm: float) -> float:
        """Gradients of ``params`` divided by the scale; the unscaled ``norm``."""
        if not math.isfinite(norm):
            self.overflows += 1
            self.good_steps = 0
            if not self.static:
                self.scale = max(self.scale / 2, self.min_scale)
            return norm
        inv = 1.0 / self.scale
        for p in params:
            p.grad *= inv
        self.good_steps += 1
        if not self.static and self.good_steps >= self.growth_interval:
            self.scale *= 2
            self.good_steps = 0
        return norm * inv

    def state(self) -> dict:
        return {"loss_scale": self.scale, "good_steps": self.good_steps,
                "overflows": self.overflows}

    def load_state(self, state: dict | None) -> None:
        """A checkpoint's ``state()`` (None: saved without scaling; keep the start)."""
        if state and "loss_scale" in state and not self.static:
            self.scale = float(state["loss_scale"])
            self.good_steps = int(state.get("good_steps", 0))
            self.overflows = int(state.get("overflows", 0))


class Precision:
    """A run's precision: its name, storage dtype and (fp16) loss scaler; what the
    training loop records per step and in checkpoints."""

    def __init__(self, name: str = "fp32", loss_scale: float = 0.0):
        self.name = name
        self.low = storage_dtype(name)
        self.scaler = None
        if name == "fp16":
            self.scaler = (LossScaler(loss_scale, static=True) if loss_scale > 0
                           else LossScaler())

    @classmethod
    def from_config(cls, cfg: Any) -> Precision:
        return cls(cfg.train.precision, cfg.train.loss_scale)

    def state(self) -> dict:
        """JSON for checkpoint metadata: the name, where values rest, the scaler."""
        out = {"name": self.name, "storage": "model dtype" if self.low is None
               else self.low.name, "master": "model dtype" if self.low is None
               else "float32"}
        if self.scaler is not None:
            out |= self.scaler.state()
        return out

    def load_state(self, state: dict | None) -> None:
        if self.scaler is not None:
            self.scaler.load_state(state)

    def metrics(self) -> dict[str, float]:
        return {} if self.scaler is None else {"loss_scale": self.scaler.scale}
