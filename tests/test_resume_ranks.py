"""``--resume`` that the ranks of one job resolve differently: a checkpoint path some
nodes cannot see (a copy on one node's local disk), or ``--resume auto`` finding a
``latest`` on one node only. Every rank looks first, and the job ends at once with the
ranks named; before, the ranks that found nothing left the job silently while rank 0
waited in the load's first collective, and the report blamed a lone SystemExit.

The nodes are two working directories of a real two-rank MPMD job (``-wdir``), with
relative paths: what each rank sees differs as it would between nodes' local disks."""

from __future__ import annotations

import shutil
import sys

import pytest

from hpctrain.testing import run_mpi, run_train, tiny_corpus_config, tiny_gpt_template

CONFIG = tiny_gpt_template(train="steps = 4\nbatch_size = 4\nsave_interval = 2")


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """Two node folders; a run of 2 steps saved in node A's ``run``, none in node B."""
    root = tmp_path_factory.mktemp("resume_ranks")
    config = tiny_corpus_config(root, CONFIG, "to be, or not to be, that is the question.",
                                200)
    a, b = root / "nodeA", root / "nodeB"
    b.mkdir()
    done = run_train(1, config, a / "run", "--steps", "2", timeout=120)
    assert done.returncode == 0, done.stderr
    return config, a, b


def two_nodes(config, a, b, run_dir: str, *flags: str, timeout: float = 120):
    """Rank 0 in folder ``a``, rank 1 in ``b``: ``--run-dir run_dir`` relative to each."""
    cmd = [sys.executable, "-m", "hpctrain.cli", "train", "--config", str(config),
           "--run-dir", run_dir, "--stall-timeout", "60", *flags]
    return run_mpi(1, ["-wdir", str(a), *cmd, ":", "-n", "1", "-wdir", str(b), *cmd],
                   timeout=timeout)


def test_a_checkpoint_one_node_cannot_see_is_refused_naming_the_rank(nodes, tmp_path):
    config, a, b = nodes
    done = two_nodes(config, a, b, str(tmp_path / "out"), "--resume",
                     "run/checkpoints/step-000002")
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "error (rank 1): " in done.stderr and "step-000002" in done.stderr, done.stderr
    assert "left the run alone" not in done.stderr, done.stderr


def test_resume_auto_finding_latest_on_one_node_only_is_refused(nodes):
    config, a, b = nodes
    shutil.rmtree(b / "run", ignore_errors=True)
    done = two_nodes(config, a, b, "run", "--resume", "auto", "--steps", "4")
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert ("--resume auto: the ranks found different checkpoints (rank 0: "
            in done.stderr), done.stderr
    assert "rank 1: no checkpoint (start afresh)); the run folder and the checkpoint " \
           "must be one path that every node sees alike" in done.stderr, done.stderr
    assert "left the run alone" not in done.stderr, done.stderr
