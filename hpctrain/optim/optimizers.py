"""AdamW and SGD with momentum, updating ``Parameter.data`` in place from ``.grad``.

Both take ``named_params`` (a list of ``(name, Parameter)``, as ``Module.named_parameters``
gives), keep their state as lists of arrays aligned with it, and expose that state as
``state_arrays() -> {key: ndarray}`` for checkpoints. Weight decay applies only to
parameters with ``ndim >= 2`` (matrices and embeddings), never to biases or LayerNorm
gains; a caller holding flat slices of parameters (ZeRO) passes ``decay``, one flag per
entry, instead. Updates reuse one scratch buffer, so a step allocates no parameter-sized
arrays.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from hpctrain.nn.kernels import NUMPY_KERNELS, kernels
from hpctrain.nn.module import Parameter, aligned_empty, is_sparse
from hpctrain.nn.threads import over_rows

PARALLEL_MIN_SIZE = 1 << 16  # elements: smaller parameters update on one thread


def _elementwise(update, *arrays: np.ndarray) -> None:
    """``update`` over flat views of same-shaped ``arrays``, split over the rank's
    threads when they are large (``hpctrain.nn.threads``); each element is computed
    alike either way, so the result is bitwise the same."""
    flat = [np.reshape(a, -1, copy=False) for a in arrays]  # views: raises rather than copy
    if flat[0].size >= PARALLEL_MIN_SIZE:
        over_rows(update, *flat)
    else:
        update(*flat)


class StateLists:
    """State save and load for an optimizer keeping ``names``, a step counter ``t`` and,
    per name in ``_state_lists``, a list of arrays aligned with ``names`` (the dense
    optimizers here, the sparse ones of ``hpctrain.optim.sparse``)."""

    _state_lists: tuple[str, ...] = ()
    names: list[str]
    t: int

    def state_arrays(self) -> dict[str, np.ndarray]:
        """``{"t": counter, "<list>.<param name>": array, ...}``; the arrays are live views."""
        state = {"t": np.array(self.t, dtype=np.int64)}
        for key in self._state_lists:
            for name, array in zip(self.names, getattr(self, key), strict=True):
                state[f"{key}.{name}"] = array
        return state

    def load_state_arrays(self, state: dict[str, np.ndarray]) -> None:
        """Copy a ``state_arrays()`` dictionary back in; keys and shapes must match."""
        mine = self.state_arrays()
        missing, extra = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
        if missing or extra:
            raise ValueError(f"optimizer state keys do not match: missing {missing}, "
                             f"unexpected {extra}")
        for key, array in mine.items():
            if key != "t" and np.shape(state[key]) != array.shape:
                raise ValueError(f"optimizer state {key!r}: saved shape "
                                 f"{np.shape(state[key])} vs parameter shape {array.shape}")
        self.t = int(state["t"])
        for key, array in mine.items():
            if key != "t":
                array[...] = state[key]


class Optimizer(StateLists):
    """Shared plumbing: parameter lists, the scratch buffer, state save and load.

    Subclasses name their per-parameter state lists in ``_state_lists`` and implement
    ``step``; the step counter is ``t``.
    """

    def __init__(self, named_params: Iterable[tuple[str, Parameter]], weight_decay: float,
                 decay: Iterable[bool] | None = None):
        named = list(named_params)
        if not named:
            raise ValueError("the optimizer got no parameters")
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        sparse = [name for name, p in named if is_sparse(p)]
        if sparse:
            raise ValueError(f"{type(self).__name__} updates dense gradients; {sparse} have "
                             f"sparse ones (embedding tables): give them to an optimizer of "
                             f"hpctrain.optim.sparse")
        self.weight_decay = weight_decay
        self.decay = [p.ndim >= 2 for p in self.params] if decay is None else list(decay)
        if len(self.decay) != len(self.params):
            raise ValueError(f"decay has {len(self.decay)} flags for {len(self.params)} "
                             f"parameters")
        self.t = 0
        dtype = np.result_type(*(p.data.dtype for p in self.params))
        self._scratch = np.empty(max(p.size for p in self.params), dtype)

    def _tmp(self, p: Parameter) -> np.ndarray:
        """A scratch view with the shape of ``p``; its contents are garbage."""
        return self._scratch[:p.size].reshape(p.shape)

    def zero_grad(self) -> None:
        for p in self.params:
            p.zero_grad()

class AdamW(Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter), as in torch.optim.AdamW.

        t += 1
        p -= lr * wd * p                                   (ndim >= 2 only)
        m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
        p -= lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps)
    """

    _state_lists = ("m", "v")

    def __init__(self, named_params: Iterable[tuple[str, Parameter]], *, lr: float,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, decay: Iterable[bool] | None = None):
        super().__init__(named_params, weight_decay, decay)
        self.lr = lr
        self.beta1, self.beta2 = betas
        self.eps = eps
        # aligned as the parameters are (nn.module.aligned_empty): a checkpoint's load
        # copies into them at full speed
        self.m = [aligned_empty(p.shape, p.data.dtype, zeros=True) for p in self.params]
        self.v = [aligned_empty(p.shape, p.data.dtype, zeros=True) for p in self.params]

    def step(self, lr: float | None = None, grad_scale: float = 1.0) -> None:
        """One update from the current ``.grad`` times ``grad_scale`` (a clipping
        factor, applied as each gradient is read: ``.grad`` keeps its values);
        ``lr`` defaults to the constructor's."""
        lr = self.lr if lr is None else float(lr)
        b1, b2 = self.beta1, self.beta2
        self.t += 1
        step_size = lr / (1.0 - b1 ** self.t)
        rsqrt_bc2 = 1.0 / math.sqrt(1.0 - b2 ** self.t)
        for p, m, v, decay in zip(self.params, self.m, self.v, self.decay, strict=True):
            shrink = 1.0 - lr * self.weight_decay if decay and self.weight_decay else 1.0
            # numba's kernel where all four share a dtype it is built for, else NumPy's
            same = p.grad.dtype == m.dtype == v.dtype == p.data.dtype
            update = (kernels(p.data.dtype) if same else NUMPY_KERNELS).adamw_update
            scalars = (shrink, b1, b2, rsqrt_bc2, self.eps, step_size, grad_scale)
            # one block of elements: every array a flat slice of the same range
            _elementwise(lambda *block, update=update, scalars=scalars: update(*block, *scalars),
                         p.data, p.grad, m, v, self._tmp(p))


class SGD(Optimizer):
    """SGD with heavy-ball momentum and L2 weight decay, as in torch.optim.SGD.

        d = g + wd * p                                     (wd for ndim >= 2 only)
        buf = momentum * buf + d                           (buf starts at zero)
        p -= lr * buf
    """

    _state_lists = ("momentum_buf",)

    def __init__(self, named_params: Iterable[tuple[str, Parameter]], *, lr: float,
                 momentum: float = 0.9, weight_decay: float = 0.0,
                 decay: Iterable[bool] | None = None):
        super().__init__(named_params, weight_decay, decay)
        self.lr = lr
        self.momentum = momentum
        self.momentum_buf = [aligned_empty(p.shape, p.data.dtype, zeros=True)
                             for p in self.params]

    def step(self, lr: float | None = None) -> None:
        """One update from the current ``.grad``; ``lr`` defaults to the constructor's."""
        lr = self.lr if lr is None else float(lr)
        self.t += 1
        for p, buf, decay in zip(self.params, self.momentum_buf, self.decay, strict=True):
            tmp = self._tmp(p)
            buf *= self.momentum
            buf += p.grad
            if decay and self.weight_decay:
                np.multiply(p.data, self.weight_decay, out=tmp)
                buf += tmp
            np.multiply(buf, lr, out=tmp)
            p.data -= tmp
