"""A model the engine never heard of, registered here, trains at every (dp, tp, pp)
layout the world size allows with the serial loss curve: the protocol is all the
engine needs. Every rank also trains serially (COMM_SELF) for the reference."""

import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/toy_model.py
from toy_model import TOY, register  # noqa: E402

from hpctrain.config import Config, ParallelConfig, TrainConfig  # noqa: E402
from hpctrain.testing import assert_close_all, train_losses  # noqa: E402

BATCH = 16  # global, in sequences
# (tp, pp, extra parallel settings); dp is what remains of the world size
LAYOUTS = [(1, 1, {}), (2, 1, {}), (1, 2, {"schedule": "1f1b"}), (2, 2, {"schedule": "gpipe"}),
           (1, 2, {"schedule": "interleaved", "virtual_stages": 2})]


def config(size, tp=1, pp=1, **extra):
    par = ParallelConfig(tp=tp, pp=pp, microbatches=2, **extra)
    return Config(model=TOY, parallel=par,
                  train=TrainConfig(steps=6, batch_size=BATCH, lr=1e-2, warmup_steps=1,
                                    grad_clip=0.5)).validate(size)


def batches():
    rng = np.random.default_rng(5)
    return [(x, (x * 3 + 1) % TOY.vocab_size)
            for x in (rng.integers(0, TOY.vocab_size, (BATCH, TOY.seq_len)) for _ in range(3))]


@pytest.mark.mpi
@pytest.mark.parametrize("tp, pp, extra", LAYOUTS, ids=lambda v: str(v))
def test_the_toy_model_at_every_layout_follows_the_serial_curve(comm, monkeypatch, tp, pp,
                                                                 extra):
    size = comm.Get_size()
    if size % (tp * pp):
        pytest.skip(f"tp * pp ({tp * pp}) does not divide {size} ranks")
    register(monkeypatch)
    serial = train_losses(config(1), MPI.COMM_SELF, batches())
    got = train_losses(config(size, tp, pp, **extra), comm, batches())
    assert_close_all(comm, np.array(got), np.array(serial), rtol=1e-10, atol=1e-12,
                     what=f"toy at dp={size // (tp * pp)} tp={tp} pp={pp} {extra}")
