"""Click parameter types and checks the commands share."""

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


def launcher(given: str | None) -> str:
    """The ``mpiexec`` a command runs its jobs with: ``--mpiexec`` if it names a program,
    else ``runtime.find_mpiexec``'s; a usage error on ``--mpiexec`` otherwise."""
    from hpctrain.runtime import UserError, find_mpiexec

    try:
        return find_mpiexec(given)
    except UserError as err:
        raise click.BadParameter(str(err), param_hint="--mpiexec") from None
