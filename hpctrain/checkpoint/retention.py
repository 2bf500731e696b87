"""Which checkpoints a run keeps: the newest ``keep`` *confirmed* ones.

A checkpoint holds finite numbers (``training.save_training`` refuses anything else),
but finite is not healthy: one update with a learning rate far too large leaves
huge, finite weights that make the next loss explode and every later step nan. So a
new checkpoint is only *pending* until the step after it, computed from exactly its
state, updates with a finite loss and gradient norm (``hpctrain.guard`` says so on
every rank alike) and a loss no more than ``SPIKE`` times that of the step it was
saved at (or 1 above it, for losses near 0); then it is *confirmed*, and only then
are older checkpoints pruned down to ``keep`` (never the confirmed or the pending one,
whatever their step). A spike withholds confirmation only:
training goes on, and the next checkpoint is judged by its own next step. A run
that diverges right after a save therefore still has the confirmed checkpoint
before it, whatever ``--keep`` is, and ``diverged()`` points ``latest`` back at it,
so that ``--resume auto`` (with a lower learning rate and ``--reset-schedule``)
continues from a healthy state. The checkpoint a run resumed from may lie outside its
folder (another run's, or a consolidated file): ``latest`` cannot name it, and is left
as it is (the caller names the path to resume from).

Only rank 0 touches the folder. A checkpoint written in the background is confirmed
only once it is complete (its index exists), so pruning never runs ahead of it.
"""

from __future__ import annotations

from pathlib import Path

from hpctrain.checkpoint.format import INDEX_NAME, LATEST_NAME, latest_name
from hpctrain.checkpoint.writer import prune
from hpctrain.data.format import atomic_output

NO_PRUNING = 2**31 - 1  # the ``keep`` a save passes to the writer: pruning happens here
SPIKE = 10.0  # a next-step loss this many times the saved step's is not a healthy state


class Retention:
    """Rank 0's record of the run's newest confirmed and pending checkpoints."""

    def __init__(self, root: str | Path, keep: int, *, writes: bool):
        if keep < 1:
            raise ValueError(f"keep ({keep}) must be at least 1")
        self.root, self.keep, self.writes = Path(root), keep, writes
        self.pending: Path | None = None
        self.pending_loss: float | None = None
        self.confirmed: Path | None = None

    def saved(self, path: Path | None, loss: float | None = None) -> None:
        """A checkpoint was written (or started in the background) at ``path`` after a
        step of loss ``loss``; also the checkpoint a run resumed from (``loss``
        unknown: its first finite step confirms it), a step folder or a consolidated
        file, in this run's folder or not."""
        if path is not None:
            self.pending, self.pending_loss = Path(path), loss

    def finite_step(self, loss: float) -> list[Path]:
        """A step updated with finite values and loss ``loss``: confirm the pending
        checkpoint (once complete, and if ``loss`` is no spike) and prune to
        ``keep``; returns the folders removed."""
        if self.pending is None or not _complete(self.pending):
            return []
        ref = self.pending_loss
        if ref is not None and loss > max(SPIKE * ref, ref + 1.0):
            self.pending = None  # its state made the loss explode: never trusted
            return []
        self.confirmed, self.pending = self.pending, None
        return self._prune()

    def finished(self) -> list[Path]:
        """The run ended normally: its last checkpoint stands (``latest``), prune to
        ``keep``, the confirmed one before it too."""
        self.pending = None
        return self._prune(spare=False)

    def _prune(self, spare: bool = True) -> list[Path]:
        # a run resumed from another run's checkpoint may not have its own folder yet.
        # The confirmed and the pending checkpoint are never pruned, whatever their
        # step: a run resumed from an older step folder (``latest`` naming a newer
        # one) confirmed it and, at ``keep`` 1, deleted it at once; a background
        # write's folder, renamed into place but ``latest`` not yet rewritten, is the
        # confirmed one while ``latest`` still names the previous one
        keep = [p.name for p in (self.confirmed, self.pending)
                if spare and p is not None and self.holds(p)]
        return (prune(self.root, self.keep, protect=keep)
                if self.writes and self.root.is_dir() else [])

    def diverged(self) -> Path | None:
        """The run stopped diverged: point ``latest`` at the newest confirmed
        checkpoint if a newer, unconfirmed one took it; return the confirmed one
        (None: no checkpoint of this run was followed by a finite step)."""
        if self.confirmed is None or not _complete(self.confirmed):
            return None
        if self.writes and self.holds(self.confirmed) \
                and latest_name(self.root) != self.confirmed.name:
            # a newer checkpoint took ``latest``: pending, or one a loss spike after it
            # showed unhealthy (no longer pending, still named by ``latest``)
            with atomic_output(self.root / LATEST_NAME, force=True) as pointer:
                pointer.write_text(self.confirmed.name + "\n")
        return self.confirmed

    def holds(self, path: Path) -> bool:
        """Whether ``path`` is a step folder of this run's folder (``latest`` can name
        it)."""
        return path.parent.resolve() == self.root.resolve()


def _complete(path: Path) -> bool:
    """A step folder whose index is written, or a consolidated file."""
    return (path / INDEX_NAME).is_file() or path.is_file()
