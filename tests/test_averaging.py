"""Averaging strategies and batch shares without MPI: when each strategy meets, the
shares' arithmetic, the loader's exactness under unequal and changing shares, and
every configuration refusal (before any collective)."""

import numpy as np
import pytest

from hpctrain.config import Config, ConfigError, ParallelConfig, TrainConfig
from hpctrain.data import DataError, open_loader
from hpctrain.parallel.averaging import Schedule, ring_bytes
from hpctrain.parallel.shares import ShareBalancer, misfit, offsets, proportional


def test_when_each_strategy_meets():
    steps = range(1, 13)
    assert [s for s in steps if Schedule("periodic", 4).averages(s)] == [4, 8, 12]
    assert not any(Schedule("periodic", 4).synchronous(s) for s in steps)
    post = Schedule("post_local", 4, sync_steps=3)
    assert [s for s in steps if post.synchronous(s)] == [1, 2, 3]
    assert [s for s in steps if post.averages(s)] == [7, 11]
    assert [s for s in steps if Schedule("diloco", 5).averages(s)] == [5, 10]
    assert all(Schedule("periodic", 1).averages(s) for s in steps)
    assert all(Schedule("sync").synchronous(s) and not Schedule("sync").averages(s)
               for s in steps)


def test_ring_bytes():
    assert ring_bytes(1000, 1) == 0 and ring_bytes(1000, 2) == 1000
    assert ring_bytes(1000, 4) == 1500


@pytest.mark.parametrize("speeds,total,multiple,want", [
    ([1, 1], 12, 1, (6, 6)),
    ([2, 1], 12, 1, (8, 4)),
    ([1.0, 0.5], 12, 2, (8, 4)),
    ([1, 0], 8, 1, (7, 1)),  # a stalled rank keeps one sample
    ([3, 1, 1, 1], 12, 1, (6, 2, 2, 2)),
    ([1, 1, 1], 10, 1, (4, 3, 3)),  # remainders to the first ranks
])
def test_proportional_shares(speeds, total, multiple, want):
    got = proportional(speeds, total, multiple)
    assert got == want and sum(got) == total and all(g % multiple == 0 for g in got)


def test_proportional_shares_refuse_what_cannot_be_split():
    with pytest.raises(ValueError, match=r"total \(3\) must be a multiple of 2"):
        proportional([1, 1], 3, 2)
    with pytest.raises(ValueError, match="at least one unit"):
        proportional([1, 1, 1], 2, 1)


def test_offsets():
    assert offsets((8, 4)) == (0, 8) and offsets((2, 3, 5)) == (0, 2, 5)


@pytest.mark.parametrize("kind", ["tokens", "images"])
def test_unequal_and_changed_shares_read_each_global_batch_exactly(tmp_path, datasets, kind):
    path = (datasets.make_tokens if kind == "tokens" else datasets.make_images)(
        tmp_path / f"{kind}.h5")
    kw = dict(batch_size=12, seed=3, seq_len=8 if kind == "tokens" else None)
    with open_loader(path, dp_rank=0, dp_size=1, **kw) as whole:
        want = [whole.next_batch() for _ in range(6)]
    # two ranks: shares (8, 4) for 3 steps, then (2, 10), set between steps
    loaders = [open_loader(path, dp_rank=r, dp_size=2, prefetch=r == 0, **kw) for r in (0, 1)]
    got = []
    for step in range(6):
        if step in (0, 3):
            shares = (8, 4) if step == 0 else (2, 10)
            for r, loader in enumerate(loaders):
                loader.set_share(offsets(shares)[r], shares[r])
        parts = [loader.next_batch() for loader in loaders]
        got.append(tuple(np.concatenate([p[i] for p in parts]) for i in range(2)))
    for loader in loaders:
        loader.close()
    for (gx, gy), (wx, wy) in zip(got, want, strict=True):
        np.testing.assert_array_equal(gx, wx)
        np.testing.assert_array_equal(gy, wy)


def test_a_share_outside_the_global_batch_is_refused(tmp_path, datasets):
    path = datasets.make_images(tmp_path / "images.h5")
    with open_loader(path, batch_size=12, dp_rank=0, dp_size=2, seed=0) as loader:
        with pytest.raises(DataError, match=r"samples \[10, 14\) must lie in the global "
                                            r"batch of 12"):
            loader.set_share(10, 4)


class Group:
    """Rank ``rank`` of a data group of ``size`` (what ``ShareBalancer`` asks before a
    step)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def Get_rank(self) -> int:  # noqa: N802 (mpi4py's name)
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size


class Reader:
    """A loader that keeps the samples ``set_share`` gave it."""

    samples = None

    def set_share(self, offset: int, count: int) -> None:
        self.samples = range(offset, offset + count)


@pytest.mark.parametrize("dp,microbatches,fits", [
    (2, 1, True),
    (1, 1, False),  # the checkpoint of 2 ranks resumed on one: 66 of the 128 samples
    (4, 1, False),  # on 4: ranks 2 and 3 had no share
    (2, 4, False),  # 4 microbatches do not split 66 samples
])
def test_measured_shares_resume_only_where_they_fit(dp, microbatches, fits):
    """A checkpoint loads at any dp and microbatches; its measured shares are taken back
    only where they fit, else every rank starts from equal shares: either way the ranks
    read the whole global batch, each sample once."""
    par = ParallelConfig(shares="measured", microbatches=microbatches)
    saved = {"shares": [66, 62]}
    read, taken = [], []
    for rank in range(dp):
        reader = Reader()
        balancer = ShareBalancer(par, 128, Group(rank, dp), reader)
        why = balancer.load_state(saved)
        taken.append(why is None)
        read += list(reader.samples)
    assert sorted(read) == list(range(128))
    assert taken == [fits] * dp
    assert misfit((66, 62), 2, 128, 1) is None
    assert misfit((66, 62), 1, 128, 1) == "2 shares for dp 1"
    assert misfit((66, 62), 2, 120, 1) == "they sum to 128, not batch_size 120"
    assert misfit((66, 62), 2, 128, 4) == "not each a positive multiple of 4"


def cfg(**par) -> Config:
    return Config(parallel=ParallelConfig(**par), train=TrainConfig(batch_size=12))


@pytest.mark.parametrize("par,message", [
    (dict(averaging="periodic", average_every=0), r"average_every \(0\) must be at least 1"),
    (dict(averaging="diloco", outer_lr=0.0), r"outer_lr \(0.0\) must be positive"),
    (dict(averaging="diloco", outer_momentum=1.0), r"outer_momentum \(1.0\) must be in"),
    (dict(averaging="gossip"), "averaging .'gossip'. must be one of"),
    (dict(averaging="periodic", zero=1), r"zero \(1\) must be 0"),
    (dict(shares="fixed", batch_shares=(8, 3)), r"must sum to batch_size \(12\), not 11"),
    (dict(shares="fixed", batch_shares=(12, 0)), r"positive multiple of microbatches"),
    (dict(shares="fixed", batch_shares=(4, 4, 4)), "one entry per data-parallel rank"),
    (dict(shares="fixed"), "go with shares 'fixed'"),
    (dict(shares="equal", batch_shares=(6, 6)), "go with shares 'fixed'"),
    (dict(shares="measured", averaging="diloco"), "needs averaging 'sync', or 'periodic'"),
    (dict(shares="fixed", batch_shares=(8, 4), averaging="periodic", microbatches=2),
     r"multiple of a local step's samples \(3\): \[8, 4\] are not"),
    (dict(shares="measured", remeasure_every=0), r"remeasure_every \(0\) must be at least"),
    # a setting the run's strategy ignores is refused, not dropped without a word
    (dict(average_every=8), r"average_every \(8\) is read only by averaging 'periodic', "
     r"'post_local', 'diloco' or 'hierarchical' \(averaging is 'sync'\): use one of them, "
     r"or leave average_every at its default \(1\)"),
    (dict(averaging="periodic", average_every=4, sync_steps=10),
     r"sync_steps \(10\) is read only by averaging 'post_local' \(averaging is 'periodic'\): "
     r"use it, or leave sync_steps at its default \(0\)"),
    (dict(averaging="post_local", average_every=4, outer_lr=0.3),
     r"outer_lr \(0.3\) is read only by averaging 'diloco'"),
    (dict(averaging="hierarchical", outer_momentum=0.5), r"outer_momentum \(0.5\) is read"),
    (dict(shares="fixed", batch_shares=(6, 6), remeasure_every=10),
     r"remeasure_every \(10\) is read only by shares 'measured' \(shares is 'fixed'\)"),
])
def test_bad_averaging_and_shares_are_refused(par, message):
    with pytest.raises(ConfigError, match=message):
        cfg(**par).validate(2)


def test_good_settings_validate():
    assert cfg(averaging="diloco", average_every=8).validate(2).parallel.outer_lr == 0.7
    # each strategy's own settings, and the others at their defaults
    assert cfg(averaging="post_local", average_every=4, sync_steps=10).validate(2)
    assert cfg(averaging="diloco", outer_lr=0.3, outer_momentum=0.5).validate(2)
    assert cfg(shares="measured", remeasure_every=10).validate(2)
    assert cfg(shares="fixed", batch_shares=(8, 4)).validate(2).parallel.dp == 2
    weighted = cfg(shares="fixed", batch_shares=(9, 3), averaging="periodic", microbatches=2)
    assert weighted.validate(2).parallel.batch_shares == (9, 3)  # units of 12 / 4 = 3


@pytest.mark.parametrize("kind, model", [
    ("cnn", {"input_dim": 784, "channels": [4, 4], "n_classes": 10}),
    ("seg3d", {}),
])
def test_models_with_batch_statistics_refuse_weighted_local_sgd(kind, model):
    """BatchNorm sums its statistics over the data group in every forward and backward;
    weighted local SGD runs more passes on a rank with a larger share, and the ranks
    waited in different collectives until the stall watchdog ended the job."""
    from hpctrain.config import from_dict

    def layout(**par):
        return from_dict({"model": {"kind": kind, **model},
                          "parallel": {"microbatches": 1, **par},
                          "train": {"batch_size": 16}}).validate(2)

    weighted = dict(averaging="periodic", average_every=2, shares="fixed",
                    batch_shares=[12, 4])
    with pytest.raises(ConfigError, match=r"BatchNorm's statistics .*\(shares 'fixed', "
                                          r"averaging 'periodic'"):
        layout(**weighted)
    layout(averaging="sync", shares="fixed", batch_shares=[12, 4])  # one pass each
    layout(averaging="periodic", average_every=2)  # equal shares
