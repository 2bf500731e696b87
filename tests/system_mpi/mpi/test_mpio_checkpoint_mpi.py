"""Checkpoints through parallel HDF5 (``checkpoint_io = "mpio"``: one ``data.h5``
written collectively by every rank) against per-rank files, at any world size N.

* the same state saved both ways holds the same pieces with the same checksums, and
  every tensor read back is bitwise the same;
* an mpio checkpoint loads into an engine that then saves per-rank files equal to it,
  and the reverse (files -> load -> mpio), at another layout (ZeRO 0 against 1) and
  serially on ``MPI.COMM_SELF``;
* a background (``--async-save``) mpio write from its thread, over ``ckpt_comm``,
  holds the state of the save call;
* one rank's checkpoint through mpio on ``MPI.COMM_SELF`` (the 1-rank case).

Every test fails when h5py has no MPI: this leg runs the mpio path or nothing.
"""

import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.checkpoint import Checkpoint, load_training, save_training, writer
from hpctrain.checkpoint import format as fmt
from hpctrain.checkpoint.background import BackgroundWriter
from hpctrain.checkpoint.state import held_tensors
from hpctrain.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.topology import Topology
from hpctrain.testing import assert_all
from hpctrain.train import make_data_parallel, train_step

WORLD = MPI.COMM_WORLD
SIZE = WORLD.Get_size()
MODEL = ModelConfig(n_layer=2, d_model=16, n_head=2, seq_len=8, vocab_size=32, dtype="float64")

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]


def config(io: str, *, zero: int = 1, tp: int = 1, size: int = SIZE) -> Config:
    return Config(model=MODEL, parallel=ParallelConfig(tp=tp, zero=zero, bucket_mb=0.001),
                  train=TrainConfig(batch_size=2 * size, keep_checkpoints=2,
                                    checkpoint_io=io)).validate(size)


class Run:
    def __init__(self, cfg: Config, comm=WORLD):
        self.cfg = cfg
        self.topo = Topology.build(comm, cfg.parallel)
        self.engine = build_engine(cfg, self.topo)
        self.dp = make_data_parallel(cfg, self.engine, self.topo)

    def train(self, steps: int) -> None:
        rng = np.random.default_rng(self.topo.dp_rank)
        for _ in range(steps):
            x, y = (rng.integers(0, MODEL.vocab_size, (2, MODEL.seq_len)) for _ in range(2))
            train_step(self.engine, self.dp, x, y, lr=1e-2, grad_clip=1.0)

    def save(self, root: Path, io: str, step: int = 2, background=None) -> Path:
        cfg = replace(self.cfg, train=replace(self.cfg.train, checkpoint_io=io))
        return save_training(cfg, self.topo, self.engine, self.dp, step=step,
                             loader_state={"step": step}, root=root, background=background)

    def load(self, path: Path) -> None:
        load_training(path, self.cfg, self.topo, self.engine, self.dp)

    def held(self) -> dict[str, np.ndarray]:
        return {h.name: h.array.copy() for h in held_tensors(self.engine, self.dp,
                                                              self.topo.tp_rank,
                                                              self.topo.tp_size)}


@pytest.fixture
def shared_dir():
    path = WORLD.bcast(tempfile.mkdtemp(prefix="hpctrain-mpio-") if WORLD.Get_rank() == 0
                       else None)
    yield Path(path)
    writer.wait_for_pruning()
    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def pieces(path: Path) -> dict[tuple, str]:
    """``(tensor, start, stop) -> checksum`` of every stored piece."""
    with Checkpoint(path) as ckpt:
        return {(e.name, p.start, p.stop): p.checksum
                for e in ckpt.tensors.values() for p in e.pieces}


def same_tensors(a: Path, b: Path) -> bool:
    """Every tensor of ``a`` and ``b`` read whole: the same dtype, shape and bytes."""
    with Checkpoint(a) as x, Checkpoint(b) as y:
        if sorted(x.tensors) != sorted(y.tensors):
            return False
        for name in x.tensors:
            u, v = x.read_full(name), y.read_full(name)
            if u.dtype != v.dtype or u.shape != v.shape or u.tobytes() != v.tobytes():
                return False
    return True


def files_of(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name != fmt.INDEX_NAME)


def test_h5py_has_mpi():
    missing = writer.mpio_missing()
    assert missing is None, f"this leg needs h5py built with MPI: {missing}"
    assert writer.shared_file("mpio", SIZE) and writer.shared_file("auto", SIZE) == (SIZE > 1)


def test_mpio_and_files_hold_the_same_pieces_and_bytes(shared_dir):
    run = Run(config("mpio"))
    run.train(2)
    shared = run.save(shared_dir / "mpio", "mpio")
    files = run.save(shared_dir / "files", "files")
    assert_all(WORLD, files_of(shared) == [fmt.SHARED_NAME], "one shared data.h5")
    assert_all(WORLD, all(f.startswith("rank-") for f in files_of(files)), "rank files")
    assert_all(WORLD, pieces(shared) == pieces(files), "the same pieces and checksums")
    assert_all(WORLD, same_tensors(shared, files), "the same bytes read back")
    state = run.held()
    for path in (shared, files):  # the same layout: each piece read straight into place
        back = Run(config("auto"))
        back.load(path)
        assert_all(WORLD, all(np.array_equal(back.held()[k], v) for k, v in state.items()),
                   f"{path.parent.name}: the state loaded at the same layout")


@pytest.mark.parametrize("first, then", [("mpio", "files"), ("files", "mpio")])
def test_saved_one_way_loads_and_saves_the_other_way(shared_dir, first, then):
    run = Run(config("auto"))
    run.train(2)
    saved = run.save(shared_dir / first, first)
    state = run.held()
    other = Run(config("auto", zero=0))  # another layout: replicated optimizer state
    other.load(saved)
    again = other.save(shared_dir / then, then)
    assert_all(WORLD, same_tensors(saved, again), f"{first} -> load -> {then}: same bytes")
    back = Run(config("auto"))
    back.load(again)
    assert_all(WORLD, all(np.array_equal(back.held()[k], v) for k, v in state.items()),
               "the state loaded back is bitwise the saved one")
    if WORLD.Get_rank() == 0:  # serially, on one rank: a shared file read without MPI-IO
        serial = Run(config("files", zero=0, size=1), MPI.COMM_SELF)
        serial.load(saved)
        with Checkpoint(saved) as ckpt:
            ok = all(v.tobytes() == ckpt.read_full(k).tobytes()
                     for k, v in serial.held().items())
    else:
        ok = True
    assert_all(WORLD, ok, "serial load of the first checkpoint")


@pytest.mark.skipif(SIZE % 2, reason="tp = 2 needs an even world size")
def test_tensor_parallel_pieces_through_mpio(shared_dir):
    run = Run(config("mpio", tp=2))
    run.train(1)
    shared = run.save(shared_dir / "mpio", "mpio")
    files = run.save(shared_dir / "files", "files")
    assert_all(WORLD, pieces(shared) == pieces(files), "the same pieces and checksums")
    assert_all(WORLD, same_tensors(shared, files), "the same bytes read back")


def test_background_mpio_write_from_its_thread(shared_dir):
    run = Run(config("mpio"))
    assert_all(WORLD, MPI.Query_thread() == MPI.THREAD_MULTIPLE,
               f"MPI grants MPI_THREAD_MULTIPLE (level {MPI.Query_thread()})")
    run.train(1)
    state = run.held()
    bg = BackgroundWriter(run.topo.ckpt_comm)
    folder = run.save(shared_dir / "bg", "mpio", step=1, background=bg)
    run.train(1)  # training goes on beside the write
    assert_all(WORLD, bg.wait() == folder, "the background write committed its folder")
    assert_all(WORLD, files_of(folder) == [fmt.SHARED_NAME], "one shared data.h5")
    check = Run(config("auto"))
    check.load(folder)
    assert_all(WORLD, all(np.array_equal(check.held()[k], v) for k, v in state.items()),
               "the checkpoint holds the state of the save call")


def test_one_rank_mpio_on_comm_self(shared_dir):
    ok = True
    if WORLD.Get_rank() == 0:
        run = Run(config("mpio", zero=0, size=1), MPI.COMM_SELF)
        run.train(1)
        shared = run.save(shared_dir / "self-mpio", "mpio")
        files = run.save(shared_dir / "self-files", "files")
        ok = (files_of(shared) == [fmt.SHARED_NAME] and pieces(shared) == pieces(files)
              and same_tensors(shared, files))
    assert_all(WORLD, ok, "one rank through mpio equals its rank file")


def test_a_piece_failing_on_one_rank_ends_the_save_on_every_rank(shared_dir, monkeypatch):
    """A rank-local failure while taking a piece's copy (here a fault put into the last
    rank's ``extract``): that rank keeps taking part in every collective write with
    empty parts, and the save fails on every rank naming it; before, it left the
    collective writes and the other ranks waited in the next one until the job's end."""
    run = Run(config("mpio"))
    run.train(1)
    first = run.save(shared_dir / "ok", "mpio", step=1)
    last = SIZE - 1
    if WORLD.Get_rank() == last:
        taken, calls = writer.extract, []

        def failing(array, seg):  # the second piece this rank writes
            calls.append(seg)
            if len(calls) == 2:
                raise OSError(28, "No space left on device (a fault put in by the test)")
            return taken(array, seg)

        monkeypatch.setattr(writer, "extract", failing)
    with pytest.raises(writer.CheckpointError) as err:
        run.save(shared_dir / "ok", "mpio", step=2)
    where = f"rank(s) [{last}]" if SIZE > 1 else "failed: "
    assert_all(WORLD, where in str(err.value) and "No space left" in str(err.value),
               f"every rank's error names the failing rank: {err.value}")
    assert_all(WORLD, fmt.latest_checkpoint(shared_dir / "ok") == first,
               "latest stays on the previous checkpoint")
