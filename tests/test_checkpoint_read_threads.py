"""A load's runs of pieces read and checked by several threads keep every guarantee of
one: a bad piece is caught and named whichever thread checks it; a piece larger than
a run is a run of its own and read whole; a file that ends inside a run names the
piece it ends in, not a later run that found nothing at all; and the shares of the
checks (``share``, ``read_all``) read and check what they did with one thread."""

import os
import threading
import time

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.checkpoint import Checkpoint, CheckpointError, reader, save_training
from hpctrain.checkpoint.reshard import box_name
from hpctrain.checkpoint.state import held_tensors
from hpctrain.config import Config, ModelConfig, TrainConfig
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.topology import Topology
from hpctrain.train import make_data_parallel

MODEL = ModelConfig(n_layer=2, d_model=16, n_head=2, seq_len=8, vocab_size=32, dtype="float64")


def build(tmp_path):
    """A serial engine with random values in every held array: (cfg, topo, engine, dp)."""
    cfg = Config(model=MODEL, train=TrainConfig(batch_size=4,
                                                run_dir=str(tmp_path / "run"))).validate(1)
    topo = Topology.build(MPI.COMM_SELF, cfg.parallel)
    engine = build_engine(cfg, topo)
    dp = make_data_parallel(cfg, engine, topo)
    rng = np.random.default_rng(0)
    for h in held_tensors(engine, dp, 0, 1):
        h.array[...] = rng.standard_normal(h.array.shape)
    return cfg, topo, engine, dp


@pytest.fixture
def saved(tmp_path):
    """A saved checkpoint and a second engine, zeroed, to load it into:
    (path, the saved values by name, the zeroed engine's held arrays)."""
    cfg, topo, engine, dp = build(tmp_path)
    want = {h.name: h.array.copy() for h in held_tensors(engine, dp, 0, 1)}
    path = save_training(cfg, topo, engine, dp, step=1, loader_state=None)
    _, _, engine2, dp2 = build(tmp_path / "fresh")
    held = held_tensors(engine2, dp2, 0, 1)
    for h in held:
        h.array[...] = 0
    return path, want, held


def in_file_order(path) -> list[tuple[int, int, str, str]]:
    """(offset, bytes, tensor, piece) of every piece of the rank file, by offset."""
    pieces = []
    with Checkpoint(path) as ck:
        entries = list(ck.tensors.values())
    with h5py.File(path / entries[0].pieces[0].file) as f:
        for e in entries:
            itemsize = np.dtype(e.dtype).itemsize
            for p in e.pieces:
                base = f[p.dataset].id.get_offset()
                nbytes = int(np.prod(np.subtract(p.stop, p.start))) * itemsize
                pieces.append((base + p.at * itemsize, nbytes, e.name, box_name(p.box)))
    return sorted(pieces)


def flip_byte(path, offset: int) -> None:
    with open(path / "rank-00000.h5", "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x10]))


def loaded(held, want, names=None) -> bool:
    return all(np.array_equal(h.array, want[h.name]) for h in held
               if names is None or h.name in names)


def test_a_bad_piece_checked_by_a_helper_thread_fails_the_load_by_name(saved, monkeypatch):
    path, want, held = saved
    offset, nbytes, tensor, piece = in_file_order(path)[-1]  # the last run in the file
    flip_byte(path, offset + nbytes // 2)
    monkeypatch.setattr(reader, "RUN_BYTES", 1)  # a run a piece: many runs to share out
    main = threading.main_thread()
    slow = [True]
    checked_by: dict[str, threading.Thread] = {}
    read_run, check_run = reader.Checkpoint._read_run, reader.Checkpoint._check_run

    def read_slowly(self, run):  # the main thread's first run keeps it away from the rest
        if threading.current_thread() is main and slow[0]:
            slow[0] = False
            time.sleep(0.3)
        read_run(self, run)

    def check(self, run):
        for r in run:
            checked_by[r[2].name] = threading.current_thread()
        check_run(self, run)

    monkeypatch.setattr(reader.Checkpoint, "_read_run", read_slowly)
    monkeypatch.setattr(reader.Checkpoint, "_check_run", check)
    with Checkpoint(path) as ck, pytest.raises(CheckpointError) as err:
        ck.read_held(held, threads=2)
    assert checked_by[tensor] is not main  # found by the helper, raised here
    assert str(err.value).startswith(f"{path / 'rank-00000.h5'}: tensor {tensor}, piece "
                                     f"{piece}: checksum mismatch (blocksum64: stored ")


def test_pieces_larger_than_a_run_are_each_read_whole_once(saved, monkeypatch):
    path, want, held = saved
    pieces = in_file_order(path)
    smallest = min(n for _, n, _, _ in pieces)
    monkeypatch.setattr(reader, "RUN_BYTES", smallest - 8)  # every piece is larger
    reads = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, views, offset: reads.append(
        (offset, sum(v.nbytes for v in views))) or real(fd, views, offset))
    with Checkpoint(path) as ck:
        ck.read_held(held, threads=2)
        assert ck.bytes_read == sum(n for _, n, _, _ in pieces)
    assert sorted(reads) == [(o, n) for o, n, _, _ in pieces]  # whole, once, one call each
    assert loaded(held, want)
    offset, nbytes, tensor, piece = max(pieces, key=lambda p: p[1])
    flip_byte(path, offset + nbytes - 1)  # the last byte of the largest piece
    with Checkpoint(path) as ck, pytest.raises(CheckpointError,
                                               match=rf"tensor {tensor}, piece {piece}: "
                                                     r"checksum mismatch"):
        ck.read_held(held, threads=2)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_a_file_that_ends_inside_a_run_names_the_piece_it_ends_in(saved, monkeypatch,
                                                                   threads):
    path, want, held = saved
    pieces = in_file_order(path)
    offset, nbytes, tensor, piece = pieces[len(pieces) // 2]
    monkeypatch.setattr(reader, "RUN_BYTES", 1)  # the runs after it find no byte at all
    read_run = reader.Checkpoint._read_run

    def read_late(self, run):  # the runs after it fail first, on the other threads
        if run[0][2].name == tensor:
            time.sleep(0.2)
        read_run(self, run)

    monkeypatch.setattr(reader.Checkpoint, "_read_run", read_late)
    with Checkpoint(path) as ck:
        ck.read_full(pieces[0][2])  # the file opened (HDF5 checks its length) ...
        os.truncate(path / "rank-00000.h5", offset + nbytes // 2)  # ... then cut short
        with pytest.raises(CheckpointError) as err:
            ck.read_held(held, threads=threads)
    assert str(err.value).startswith(f"{path / 'rank-00000.h5'}: tensor {tensor}, piece "
                                     f"{piece}: the file ends inside the piece (it is "
                                     f"truncated)")


@pytest.mark.parametrize("threads", [1, 2])
def test_the_shares_read_and_check_what_they_did_on_one_thread(saved, monkeypatch,
                                                               threads):
    path, want, held = saved
    monkeypatch.setattr(reader, "RUN_BYTES", 4096)  # several runs to share out
    with Checkpoint(path) as ck:  # checkpoint_read "shared": rank 0 of 2 reads its share
        runs = ck.read_held(held, share=(0, 2), read_all=False, threads=threads)
        read = ck.bytes_read
    assert {owner for _, owner in runs} == {0, 1}
    assert read == sum(a.nbytes for arrays, owner in runs if owner == 0 for a in arrays)

    def share_of(h):  # the run (of views of the held arrays) that holds h's bytes
        (owner,) = {owner for arrays, owner in runs for a in arrays
                    if np.shares_memory(a, h.array)}
        return owner

    for h in held:  # its share loaded, the other share's arrays untouched
        assert np.array_equal(h.array, want[h.name] if share_of(h) == 0 else 0 * h.array)
    name = next(h.name for h in held if share_of(h) == 1)
    offset, nbytes, _, _ = next(p for p in in_file_order(path) if p[2] == name)
    flip_byte(path, offset)
    for h in held:
        h.array[...] = 0
    with Checkpoint(path) as ck:  # the replica that does not check it reads it all
        ck.read_held(held, share=(0, 2), threads=threads)
    assert not loaded(held, want, {name}) and loaded(held, want, set(want) - {name})
    with Checkpoint(path) as ck, pytest.raises(CheckpointError,
                                               match=rf"tensor {name}, .*checksum mismatch"):
        ck.read_held(held, share=(1, 2), threads=threads)  # the one that checks it


def test_read_threads_are_the_ranks_share_of_the_cores_at_most_four(monkeypatch):
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert reader.read_threads(1) == min(reader.MAX_READ_THREADS, cores)
    assert reader.read_threads(cores) == 1
    assert reader.read_threads(10 * cores) == 1
