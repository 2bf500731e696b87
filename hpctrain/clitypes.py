"""Click parameter types the commands share."""

from __future__ import annotations

import math

import click


class FiniteRange(click.FloatRange):
    """``click.FloatRange`` refusing nan and inf as well (nan passes any bound: it
    compares false with everything)."""

    def convert(self, value, param, ctx):
        got = super().convert(value, param, ctx)
        if not math.isfinite(got):
            self.fail(f"{got} is not a finite number.", param, ctx)
        return got
