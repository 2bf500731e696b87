"""A job killed in the middle of a save: the previous checkpoint still loads and
``latest`` still names it.

A real two-rank mpiexec job (dp = 2, ZeRO 1) saves step 1, trains a step and starts
saving step 2; one rank SIGKILLs itself from the writer's event callback at a chosen
point: after its first dataset, after its whole file, after the index (the folder
complete but not yet renamed), after the rename (``latest`` not yet moved). Whatever
the point, ``latest`` names step 1, which verifies and loads (here, serially); the
next save removes the debris.
"""

import json
import sys

import pytest
from mpi4py import MPI

from hpctrain.checkpoint import Checkpoint, load_training, save_training, verify
from hpctrain.checkpoint import format as fmt
from hpctrain.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.topology import Topology
from hpctrain.testing import SAVE_AND_DIE, run_mpi
from hpctrain.train import make_data_parallel

MODEL = ModelConfig(n_layer=2, d_model=16, n_head=2, seq_len=8, vocab_size=32, dtype="float64")


def config(zero: int) -> Config:
    """Not yet validated: dp follows from the world size."""
    return Config(model=MODEL, parallel=ParallelConfig(zero=zero, bucket_mb=0.001),
                  train=TrainConfig(batch_size=4, steps=2))



KILL_POINTS = [("dataset", 1), ("file", 0), ("index", 0), ("renamed", 0)]


def serial_run():
    cfg = config(0).validate(1)
    topo = Topology.build(MPI.COMM_SELF, cfg.parallel)
    engine = build_engine(cfg, topo)
    return cfg, topo, engine, make_data_parallel(cfg, engine, topo)


@pytest.mark.parametrize("event, victim", KILL_POINTS, ids=[e for e, _ in KILL_POINTS])
def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path, event,
                                                                      victim):
    script = tmp_path / "save_and_die.py"
    script.write_text(SAVE_AND_DIE)
    root = tmp_path / "checkpoints"
    result = run_mpi(2, [sys.executable, str(script), str(root), event, str(victim),
                         json.dumps(config(1).to_dict())], timeout=90)
    assert result.returncode != 0, result.stdout + result.stderr
    assert "nobody was killed" not in result.stdout
    assert (root / fmt.LATEST_NAME).read_text().strip() == "step-000001"
    renamed = (root / "step-000002" / fmt.INDEX_NAME).is_file()
    assert renamed == (event == "renamed")
    assert (root / "step-000002.tmp").is_dir() == (event != "renamed")

    ckpt, problems = verify(root)
    assert ckpt.step == 1 and not problems
    cfg, topo, engine, dp = serial_run()
    assert load_training(root, cfg, topo, engine, dp).step == 1  # dp 2, ZeRO 1 -> serial

    save_training(cfg, topo, engine, dp, step=3, loader_state={"step": 1}, root=root)
    assert not list(root.glob("*.tmp"))
    with Checkpoint(root) as again:
        assert again.step == 3
