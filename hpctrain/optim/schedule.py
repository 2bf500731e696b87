"""Learning rate: linear warm-up, then cosine decay to ``min_lr``.

    step <  warmup_steps:  lr * (step + 1) / warmup_steps      (the first step is not 0)
    step <  total_steps:   min_lr + (lr - min_lr) * (1 + cos(pi * s)) / 2,
                           s = (step - warmup_steps) / (total_steps - warmup_steps)
    step >= total_steps:   min_lr

The warm-up ends at ``lr`` exactly (step ``warmup_steps - 1``), the cosine starts there
at ``lr``, passes ``(lr + min_lr) / 2`` half-way and reaches ``min_lr`` at ``total_steps``.
"""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int,
          total_steps: int) -> float:
    """The learning rate for optimizer step ``step`` (counted from 0)."""
    if step < 0:
        raise ValueError(f"step ({step}) must not be negative")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    s = (step - warmup_steps) / (total_steps - warmup_steps)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * s))
