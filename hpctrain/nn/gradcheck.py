"""Central finite differences, to check a hand-written backward pass.

    dL/dx_i  ~  (L(x + eps e_i) - L(x - eps e_i)) / (2 eps)        error O(eps^2)

and the analytic gradient ``a`` is compared with the numerical one ``n`` in norm form,

    rel = |a - n| / max(|a| + |n|, tiny)

over the probed entries. Run in float64: with ``eps = 1e-6`` the rounding error of the
difference quotient is about ``1e-16 |L| / eps``, far below the 1e-6 we ask for,
whereas float32 would drown it.

Usage, for a layer: compute the analytic gradients with one forward and one backward,
then hand a zero-argument function that reruns the forward and returns the scalar:

    loss = lambda: float(np.sum(layer.forward(x)[0] * w))
    y, cache = layer.forward(x); dx = layer.backward(w, cache)
    check_array(loss, x, dx)                        # the input
    check_parameters(loss, layer.named_parameters())  # every parameter, via .grad
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from hpctrain.nn.module import Parameter, is_sparse

TINY = 1e-30


def rel_error(a: np.ndarray, n: np.ndarray) -> float:
    """|a - n| / max(|a| + |n|, tiny), in the 2-norm over all entries."""
    a, n = np.asarray(a, np.float64), np.asarray(n, np.float64)
    return float(np.linalg.norm(a - n) / max(np.linalg.norm(a) + np.linalg.norm(n), TINY))


def numerical_grad(f: Callable[[], float], x: np.ndarray, index: np.ndarray, *,
                   eps: float = 1e-6) -> np.ndarray:
    """Central differences of ``f()`` at the flat positions ``index`` of ``x``.

    ``x`` is perturbed in place (so ``f`` must read it) and restored exactly.
    """
    if x.dtype != np.float64:
        raise TypeError(f"gradient checks need float64 arrays, got {x.dtype}")
    flat = x.reshape(-1)  # a view: x is perturbed through it
    if not np.shares_memory(flat, x):
        raise ValueError("x must be contiguous so that it can be perturbed in place")
    grad = np.empty(len(index))
    for j, i in enumerate(index):
        saved = flat[i]
        flat[i] = saved + eps
        up = f()
        flat[i] = saved - eps
        down = f()
        flat[i] = saved
        grad[j] = (up - down) / (2.0 * eps)
    return grad


def probe(size: int, max_probes: int | None, rng: np.random.Generator) -> np.ndarray:
    """All flat indices, or ``max_probes`` of them drawn at random without repetition."""
    if max_probes is None or size <= max_probes:
        return np.arange(size)
    return np.sort(rng.choice(size, size=max_probes, replace=False))


def check_array(f: Callable[[], float], x: np.ndarray, analytic: np.ndarray, *,
                eps: float = 1e-6, max_probes: int | None = None,
                rng: np.random.Generator | None = None) -> float:
    """Relative error between ``analytic`` (shape of ``x``) and finite differences of f."""
    if analytic.shape != x.shape:
        raise ValueError(f"gradient shape {analytic.shape} vs array shape {x.shape}")
    rng = np.random.default_rng(0) if rng is None else rng
    index = probe(x.size, max_probes, rng)
    numeric = numerical_grad(f, x, index, eps=eps)
    return rel_error(analytic.reshape(-1)[index], numeric)


def check_parameters(f: Callable[[], float], named_params: Iterable[tuple[str, Parameter]],
                     *, eps: float = 1e-6, max_probes: int | None = None,
                     rng: np.random.Generator | None = None) -> dict[str, float]:
    """Relative error of every parameter's ``.grad`` against finite differences of f.

    ``.grad`` must already hold the analytic gradient of ``f`` (one forward and backward
    from zeroed gradients). Returns ``{name: relative error}``. A sparse gradient is
    compared as the dense array it stands for.
    """
    rng = np.random.default_rng(0) if rng is None else rng
    return {name: check_array(f, p.data, p.grad.to_dense() if is_sparse(p) else p.grad,
                              eps=eps, max_probes=max_probes, rng=rng)
            for name, p in named_params}
