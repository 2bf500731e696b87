"""A rank killed during a save through parallel HDF5 (``checkpoint_io = "mpio"``): the
previous checkpoint still loads and ``latest`` still names it.

As ``tests/test_checkpoint_kill.py`` for per-rank files: a real two-rank job, launched
with this MPI's own ``mpiexec``, saves step 1 through mpio, trains a step, starts saving
step 2 and one rank SIGKILLs itself from the writer's event callback: after the first
tensor's collective write (the shared file half written), after the file was closed and
synced, after the index. Whatever the point, ``latest`` names step 1, whose one
``data.h5`` verifies and loads serially; the next save removes the debris.
"""

import json
import sys

import pytest
from mpi4py import MPI

from hpctrain.checkpoint import Checkpoint, load_training, save_training, verify
from hpctrain.checkpoint import format as fmt
from hpctrain.checkpoint.writer import mpio_missing
from hpctrain.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.topology import Topology
from hpctrain.testing import SAVE_AND_DIE, run_mpi
from hpctrain.train import make_data_parallel

MODEL = ModelConfig(n_layer=2, d_model=16, n_head=2, seq_len=8, vocab_size=32, dtype="float64")


KILL_POINTS = [("dataset", 1), ("file", 0), ("index", 0)]


def config(io: str, zero: int) -> Config:
    return Config(model=MODEL, parallel=ParallelConfig(zero=zero, bucket_mb=0.001),
                  train=TrainConfig(batch_size=4, steps=2, checkpoint_io=io))


def test_h5py_has_mpi():
    assert mpio_missing() is None, f"this leg needs h5py built with MPI: {mpio_missing()}"


@pytest.mark.parametrize("event, victim", KILL_POINTS, ids=[e for e, _ in KILL_POINTS])
def test_a_rank_killed_during_an_mpio_save_leaves_latest_on_the_previous(tmp_path, event,
                                                                       victim):
    assert mpio_missing() is None, mpio_missing()
    script = tmp_path / "save_and_die.py"
    script.write_text(SAVE_AND_DIE)
    root = tmp_path / "checkpoints"
    result = run_mpi(2, [sys.executable, str(script), str(root), event, str(victim),
                         json.dumps(config("mpio", 1).to_dict())], timeout=120)
    assert result.returncode != 0, result.stdout + result.stderr
    assert "nobody was killed" not in result.stdout
    assert (root / fmt.LATEST_NAME).read_text().strip() == "step-000001"
    assert sorted(p.name for p in (root / "step-000001").iterdir()) == \
        [fmt.SHARED_NAME, fmt.INDEX_NAME]
    assert (root / "step-000002.tmp").is_dir() and not (root / "step-000002").exists()

    ckpt, problems = verify(root)
    assert ckpt.step == 1 and not problems
    cfg = config("files", 0).validate(1)
    topo = Topology.build(MPI.COMM_SELF, cfg.parallel)
    engine = build_engine(cfg, topo)
    dp = make_data_parallel(cfg, engine, topo)
    assert load_training(root, cfg, topo, engine, dp).step == 1  # dp 2, mpio -> serial

    save_training(cfg, topo, engine, dp, step=3, loader_state={"step": 1}, root=root)
    assert not list(root.glob("*.tmp"))
    with Checkpoint(root) as again:
        assert again.step == 3
