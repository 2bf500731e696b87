"""Which checkpoints a run keeps: pruning waits for confirmation, a loss spike or a
divergence never costs the last healthy checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpctrain.checkpoint.format import INDEX_NAME, LATEST_NAME, step_dirname, step_of
from hpctrain.checkpoint.retention import Retention
from hpctrain.checkpoint.writer import wait_for_pruning


def checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    """A step folder as the writer leaves it (the index last), and ``latest`` to it."""
    folder = root / step_dirname(step)
    folder.mkdir(parents=True)
    if complete:
        (folder / INDEX_NAME).write_bytes(b"")
        (root / LATEST_NAME).write_text(folder.name + "\n")
    return folder


def steps(root: Path) -> list[int]:
    wait_for_pruning()
    return sorted(step_of(p) for p in root.iterdir() if step_of(p) is not None)


def test_older_checkpoints_go_only_once_a_newer_one_is_confirmed(tmp_path):
    r = Retention(tmp_path, keep=1, writes=True)
    for s in (2, 4):
        r.saved(checkpoint(tmp_path, s), loss=3.0)
    assert steps(tmp_path) == [2, 4]  # step 4 pending: nothing pruned yet
    r.finite_step(2.9)
    assert steps(tmp_path) == [4] and r.confirmed == tmp_path / "step-000004"


def test_a_loss_spike_or_a_background_write_in_flight_withholds_confirmation(tmp_path):
    r = Retention(tmp_path, keep=1, writes=True)
    r.saved(checkpoint(tmp_path, 2), loss=3.0)
    r.finite_step(3.1)
    r.saved(checkpoint(tmp_path, 4), loss=3.0)
    r.finite_step(31.0)  # more than 10x: the state of step 4 made the loss explode
    assert steps(tmp_path) == [2, 4] and r.confirmed == tmp_path / "step-000002"
    r.saved(checkpoint(tmp_path, 6, complete=False), loss=1e12)
    r.finite_step(1e12)  # not complete yet: judged at a later step
    assert r.pending == tmp_path / "step-000006" and steps(tmp_path) == [2, 4, 6]
    # near 0 a rise of up to 1 is no spike
    r2 = Retention(tmp_path / "b", keep=1, writes=True)
    r2.saved(checkpoint(tmp_path / "b", 1), loss=0.01)
    r2.finite_step(0.9)
    assert r2.confirmed == tmp_path / "b" / "step-000001"


def test_divergence_points_latest_back_at_the_confirmed_checkpoint(tmp_path):
    r = Retention(tmp_path, keep=1, writes=True)
    r.saved(checkpoint(tmp_path, 2), loss=3.0)
    r.finite_step(3.0)
    r.saved(checkpoint(tmp_path, 4), loss=4e11)
    assert (tmp_path / LATEST_NAME).read_text().strip() == "step-000004"
    assert r.diverged() == tmp_path / "step-000002"
    assert (tmp_path / LATEST_NAME).read_text().strip() == "step-000002"
    assert steps(tmp_path) == [2, 4]  # the unconfirmed one stays, for inspection
    assert Retention(tmp_path / "none", keep=1, writes=True).diverged() is None


@pytest.mark.parametrize("kind", ["step folder", "consolidated file"])
def test_divergence_after_a_resume_from_outside_the_run_leaves_latest_alone(tmp_path, kind):
    """A run resumed from another run's checkpoint (or a consolidated file) diverges
    before its own first checkpoint is confirmed: the healthy one is outside its folder,
    which 'latest' cannot name; pointing it there broke --resume auto."""
    if kind == "step folder":
        elsewhere = checkpoint(tmp_path / "other" / "checkpoints", 5)
    else:
        elsewhere = tmp_path / "other.h5"
        elsewhere.write_bytes(b"")
    root = tmp_path / "run" / "checkpoints"
    r = Retention(root, keep=1, writes=True)
    r.saved(elsewhere)  # what the run resumed from
    r.finite_step(2.0)
    r.saved(checkpoint(root, 6), loss=2.0)
    assert r.diverged() == elsewhere and not r.holds(elsewhere)
    assert (root / LATEST_NAME).read_text().strip() == "step-000006"
    assert r.holds(root / "step-000006")


def test_only_the_writing_rank_touches_the_folder_and_keep_is_checked(tmp_path):
    r = Retention(tmp_path, keep=1, writes=False)
    for s in (1, 2, 3):
        r.saved(checkpoint(tmp_path, s), loss=1.0)
        r.finite_step(1.0)
    r.finished()
    assert steps(tmp_path) == [1, 2, 3]
    with pytest.raises(ValueError, match=r"keep \(0\) must be at least 1"):
        Retention(tmp_path, keep=0, writes=True)


def test_a_spike_then_divergence_points_latest_back_past_the_spiked_checkpoint(tmp_path):
    """A loss spike after a save (the checkpoint never trusted), then nan: 'latest',
    which the spiked checkpoint took, goes back to the confirmed one (it stayed on the
    spiked one while the divergence message said it named the confirmed)."""
    r = Retention(tmp_path, keep=3, writes=True)
    r.saved(checkpoint(tmp_path, 2), loss=3.0)
    r.finite_step(3.0)
    r.saved(checkpoint(tmp_path, 4), loss=3.0)
    r.finite_step(1e3)  # the spike: step 4 is not trusted, and no longer pending
    assert r.pending is None
    assert r.diverged() == tmp_path / "step-000002"
    assert (tmp_path / LATEST_NAME).read_text().strip() == "step-000002"


def test_the_checkpoint_resumed_from_is_kept_though_latest_names_a_newer_one(tmp_path):
    """--resume of an older step folder of the run (latest naming a newer one), keep 1:
    its first finite step confirmed it and pruned it at once, so a divergence after
    the next save had nothing to go back to."""
    old = checkpoint(tmp_path, 100)
    checkpoint(tmp_path, 200)  # latest
    r = Retention(tmp_path, keep=1, writes=True)
    r.saved(old)
    r.finite_step(2.0)
    assert steps(tmp_path) == [100, 200] and r.confirmed == old
    r.saved(checkpoint(tmp_path, 110), loss=2.0)
    assert r.diverged() == old
    assert (tmp_path / LATEST_NAME).read_text().strip() == "step-000100"


def test_a_checkpoint_confirmed_before_latest_names_it_is_not_pruned(tmp_path):
    """A background write renames its folder into place, then rewrites 'latest': a
    finite step between the two confirms the folder while 'latest' still names the
    one before, and a newer step folder (left by a run rolled back after a divergence)
    made it the oldest beyond keep 1: it was deleted, and 'latest' then named nothing."""
    r = Retention(tmp_path, keep=1, writes=True)
    r.saved(checkpoint(tmp_path, 2), loss=3.0)
    r.finite_step(3.0)
    stale = checkpoint(tmp_path, 300)
    (tmp_path / LATEST_NAME).write_text("step-000002\n")  # 300: not this run's latest
    new = tmp_path / "step-000004"
    new.mkdir()
    (new / INDEX_NAME).write_bytes(b"")  # renamed into place; latest not yet rewritten
    r.saved(new, loss=3.0)
    removed = r.finite_step(3.0)
    assert r.confirmed == new and new not in removed
    assert steps(tmp_path) == [2, 4, 300] and stale.is_dir()
