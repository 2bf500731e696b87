"""The ``hpctrain`` program: catch a preemption signal before anything heavy loads.

Importing the command line (``hpctrain.cli``: click, NumPy, every command's module)
takes about half a second, longer when many ranks start on few cores. A SIGUSR1 or
SIGTERM in that time, before ``hpctrain train`` installs its handlers, kills the rank
(the default action of both), and the batch script sees a failed run instead of a
preempted one. So for ``train`` and ``cv`` the handlers (``preempt.install``, standard library
only) go in first, within milliseconds of the start; the run then stops before its
first step, with nothing to save, and exits with ``preempt.EXIT_PREEMPTED`` for the
script to requeue. The other commands keep the default actions: a SIGTERM ends them.
"""

from __future__ import annotations

import sys


def run() -> None:
    """The console script ``hpctrain`` (``hpctrain.cli.run`` after the early handlers)."""
    if sys.argv[1:2] in (["train"], ["cv"]):
        from hpctrain import preempt

        preempt.install()
    from hpctrain.cli import run as cli_run

    cli_run()
