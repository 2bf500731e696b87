"""The loader under mpiexec: each rank opens only its shards, the ranks' partitions are
disjoint and cover the dataset, and unpartitioned reads rebuild the serial batches.

Passes at any world size: the data and every expectation are computed from ``size``
and ``rank``; assertions are collective (``hpctrain.testing.assert_all``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest

from data_prep.partition import partition
from hpctrain.data import open_loader
from hpctrain.testing import assert_all


@pytest.fixture
def shared_dir(comm):
    """A folder every rank sees, made by rank 0 and removed after the test."""
    path = tempfile.mkdtemp(prefix="hpctrain-loader-mpi-") if comm.Get_rank() == 0 else None
    path = Path(comm.bcast(path, root=0))
    yield path
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def on_root(comm, make):
    """Run ``make()`` on rank 0 only; every rank fails alike if it raised (collective)."""
    error = None
    if comm.Get_rank() == 0:
        try:
            make()
        except Exception as err:  # handed to every rank below
            error = repr(err)
    error = comm.bcast(error, root=0)
    if error is not None:
        raise AssertionError(f"rank 0 could not make the test data: {error}")


class OpenRecorder:
    """Records every file opened through h5py.File while installed."""

    def __init__(self, monkeypatch):
        self.names: list[str] = []
        real = h5py.File
        names = self.names

        class Recording(real):
            def __init__(self, name, *args, **kwargs):
                names.append(os.path.basename(os.fspath(name)))
                super().__init__(name, *args, **kwargs)

        monkeypatch.setattr(h5py, "File", Recording)


def open_fds_in(folder: Path) -> set[str]:
    names = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(folder)):
            names.add(os.path.basename(target))
    return names


@pytest.mark.mpi
@pytest.mark.parametrize("shards_per_rank", [1, 2])
def test_ranks_read_disjoint_partitions_of_only_their_shards(comm, shared_dir, datasets,
                                                             monkeypatch, shards_per_rank):
    rank, size = comm.Get_rank(), comm.Get_size()
    n_rows, num_shards = 23 * size + 5, shards_per_rank * size
    source, parts = shared_dir / "images.h5", shared_dir / "parts"

    def make():
        datasets.make_images(source, n_train=n_rows, n_test=num_shards + 3)
        partition(source, parts, num_shards=num_shards, strategy="shuffled", seed=3)

    on_root(comm, make)
    mine = [f"shard-{k:05d}.h5" for k in range(rank * shards_per_rank,
                                                 (rank + 1) * shards_per_rank)]
    recorder = OpenRecorder(monkeypatch)
    b = 4
    with open_loader(parts, batch_size=b * size, dp_rank=rank, dp_size=size, seed=5) as ld:
        n = ld.num_samples
        ids = np.concatenate([datasets.image_ids(ld.next_batch()[0])
                              for _ in range(-(-n // b))])[:n]  # one epoch of this rank
        fds = open_fds_in(parts)
    monkeypatch.undo()
    opened_data = sorted(set(recorder.names) - {"manifest.h5"})
    assert_all(comm, opened_data == mine, f"rank opened only {mine} (it opened {opened_data})")
    assert_all(comm, fds == set(mine), f"rank holds open only {mine} (it holds {sorted(fds)})")
    own = np.concatenate([datasets.image_ids(h5py.File(parts / s)["train/images"][...])
                          for s in mine])
    assert_all(comm, sorted(ids.tolist()) == sorted(own.tolist()),
               "one epoch of a rank is each row of its shards once")
    every = comm.allgather(ids)
    union = np.concatenate(every)
    assert_all(comm, len(union) == len(set(union.tolist())), "ranks' partitions are disjoint")
    assert_all(comm, sorted(union.tolist()) == list(range(n_rows)),
               "ranks' partitions cover the dataset")


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["tokens", "images"])
def test_unpartitioned_ranks_rebuild_the_serial_batches(comm, shared_dir, datasets, kind):
    rank, size = comm.Get_rank(), comm.Get_size()
    path = shared_dir / f"{kind}.h5"
    on_root(comm, lambda: getattr(datasets, f"make_{kind}")(path))
    b, steps = 3, 12
    kw = {"batch_size": b * size, "seed": 8, "seq_len": 16 if kind == "tokens" else None}
    with open_loader(path, dp_rank=rank, dp_size=size, **kw) as ld:
        parallel = [ld.next_batch() for _ in range(steps)]
        opened = [p.name for p in ld.paths]
    with open_loader(path, **kw) as ld:  # the serial run, on every rank
        serial = [ld.next_batch() for _ in range(steps)]
    rows = slice(rank * b, (rank + 1) * b)
    same = all(np.array_equal(p[i], s[i][rows]) for p, s in zip(parallel, serial, strict=True)
               for i in range(2))
    assert_all(comm, same, "rank's rows equal its slice of the serial global batch")
    assert_all(comm, opened == [path.name], "rank opened only the dataset file")
    whole = comm.allgather(parallel[0][0])
    assert_all(comm, np.array_equal(np.concatenate(whole), serial[0][0]),
               "ranks' parts concatenate to the global batch")
