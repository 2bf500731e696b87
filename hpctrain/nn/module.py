"""Parameter and Module: named attributes instead of string-keyed dictionaries.

A ``Parameter`` is an array and its gradient, side by side. A ``Module`` finds its
parameters by walking its own attributes in the order they were assigned, so the
dotted names (``blocks.0.attn.qkv.weight``) follow the constructor and are the same
on every rank. Layers never keep activations on ``self``: ``forward`` returns an
explicit cache that the caller hands back to ``backward``, so one layer can have
several microbatches in flight at once.
"""

from __future__ import annotations

import numpy as np


class Parameter:
    """A trainable array ``data`` and its gradient ``grad`` (same shape and dtype).

    ``backward`` methods accumulate into ``grad`` (``+=``); call ``zero_grad`` once per
    optimizer step, not once per microbatch.
    """

    __slots__ = ("data", "grad")

    def __init__(self, data: np.ndarray):
        self.data = np.ascontiguousarray(data)
        self.grad = np.zeros_like(self.data)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def size(self) -> int:
        return self.data.size

    def zero_grad(self) -> None:
        self.grad.fill(0)

    def __repr__(self) -> str:
        return f"Parameter(shape={self.data.shape}, dtype={self.data.dtype})"


class Module:
    """Base class: parameter discovery by attribute walk; no behaviour of its own.

    Attributes holding a ``Parameter``, a ``Module`` or a list/tuple of Modules are
    walked in definition order. A Parameter reached twice (a tied weight) is listed
    once, under the first name it was reached by.
    """

    def named_parameters(self, prefix: str = "") -> list[tuple[str, Parameter]]:
        named, seen = [], set()
        for name, p in self._walk(prefix):
            if id(p) not in seen:
                seen.add(id(p))
                named.append((name, p))
        return named

    def _walk(self, prefix: str):
        for name, value in vars(self).items():
            if isinstance(value, Parameter):
                yield prefix + name, value
            elif isinstance(value, Module):
                yield from value._walk(f"{prefix}{name}.")
            elif isinstance(value, (list, tuple)):
                for i, item in enumerate(value):
                    if isinstance(item, Module):
                        yield from item._walk(f"{prefix}{name}.{i}.")

    # names of this module's array attributes that are state but not trained (BatchNorm's
    # running statistics): checkpoints save them, optimizers never see them
    buffer_names: tuple[str, ...] = ()

    def named_buffers(self, prefix: str = "") -> list[tuple[str, np.ndarray]]:
        """Every ``buffer_names`` array, walked like the parameters: ``bn.running_mean``."""
        named = [(prefix + name, getattr(self, name)) for name in self.buffer_names]
        for path, child in self._children():
            named += child.named_buffers(f"{prefix}{path}.")
        return named

    def _children(self):
        """(name, module) of each Module attribute, a list's items named ``name.i``."""
        for name, value in vars(self).items():
            if isinstance(value, Module):
                yield name, value
            elif isinstance(value, (list, tuple)):
                for i, item in enumerate(value):
                    if isinstance(item, Module):
                        yield f"{name}.{i}", item

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.zero_grad()

    def num_parameters(self) -> int:
        return sum(p.size for p in self.parameters())
