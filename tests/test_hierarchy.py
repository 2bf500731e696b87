"""The ordering rules of the hierarchical reduction (``hierarchy.PhaseQueue``), without MPI.

Fake requests complete when the test says so (``finish``) or when waited for, as an
MPI request does. Whatever the order of completions, tests and waits, every phase
(every communicator) must see its buckets posted in bucket order, and a bucket's phase
must be posted only after its previous phase completed.
"""

import numpy as np
import pytest

from hpctrain.parallel.hierarchy import ALLREDUCE, BCAST, REDUCE, PhaseQueue

PHASES = (REDUCE, ALLREDUCE, BCAST)


class FakeRequest:
    def __init__(self):
        self.complete = False

    def Test(self):  # noqa: N802 - the name MPI requests have
        return self.complete

    def Wait(self):  # noqa: N802
        self.complete = True


class Rank:
    """One rank's queue, with a log of every post: (phase, bucket)."""

    def __init__(self, phases=PHASES):
        self.queue, self.phases = PhaseQueue(), phases
        self.log, self.requests = [], {}  # (bucket, phase) -> FakeRequest
        self.buckets = []

    def launch(self):
        k = len(self.buckets)
        self.buckets.append(self.queue.add(self.phases, lambda phase: self.post(k, phase)))
        return self.buckets[-1]

    def post(self, k, phase):
        i = self.phases.index(phase)
        assert i == 0 or self.requests[k, self.phases[i - 1]].complete, \
            f"bucket {k} posted {phase} before its previous phase completed"
        self.log.append((phase, k))
        self.requests[k, phase] = FakeRequest()
        return self.requests[k, phase]

    def finish(self, k, phase):
        self.requests[k, phase].complete = True

    def posted(self, phase):
        return [k for p, k in self.log if p == phase]


def test_a_phase_waits_for_the_earlier_bucket_to_post_it():
    rank = Rank()
    b0, b1 = rank.launch(), rank.launch()
    assert rank.log == [(REDUCE, 0), (REDUCE, 1)]  # the first phase goes out at once
    rank.finish(1, REDUCE)  # bucket 1's reduce completes first
    assert not b1.Test()
    assert rank.posted(ALLREDUCE) == []  # bucket 0 has not posted its all-reduce yet
    rank.finish(0, REDUCE)
    assert not b1.Test()
    assert rank.log[2:] == [(ALLREDUCE, 0), (ALLREDUCE, 1)]
    rank.finish(1, ALLREDUCE)
    assert not b1.Test() and rank.posted(BCAST) == []
    rank.finish(0, ALLREDUCE)
    b0.Test()
    assert rank.posted(BCAST) == [0, 1]
    rank.finish(0, BCAST)
    assert b0.Test() and not b1.Test()
    rank.finish(1, BCAST)
    assert b1.Test() and not rank.queue.in_flight


def test_waiting_for_the_last_bucket_drives_the_earlier_ones_in_order():
    rank = Rank()
    buckets = [rank.launch() for _ in range(5)]
    buckets[-1].Wait()
    assert all(b.done for b in buckets) and not rank.queue.in_flight
    for phase in PHASES:
        assert rank.posted(phase) == list(range(5))


@pytest.mark.parametrize("phases", [PHASES, (REDUCE, BCAST), (ALLREDUCE,), ()],
                         ids=["leader", "non-leader", "one-per-node", "alone"])
@pytest.mark.parametrize("seed", range(20))
def test_any_order_of_completions_tests_and_waits_keeps_bucket_order(phases, seed):
    rng = np.random.default_rng(seed)
    rank = Rank(phases)
    while len(rank.buckets) < 8 or rank.queue.in_flight:
        event = rng.integers(4)
        if event == 0 and len(rank.buckets) < 8:
            rank.launch()
        elif event == 1:  # the network completes some posted phase
            pending = [key for key, r in rank.requests.items() if not r.complete]
            if pending:
                rank.finish(*pending[rng.integers(len(pending))])
        elif event == 2 and rank.buckets:
            rank.buckets[rng.integers(len(rank.buckets))].Test()
        elif event == 3 and rank.buckets and rng.random() < 0.2:
            rank.buckets[rng.integers(len(rank.buckets))].Wait()
    assert all(b.done for b in rank.buckets)
    for phase in phases:
        assert rank.posted(phase) == list(range(8)), f"{phase} posted out of bucket order"
    assert len(rank.log) == 8 * len(phases)


def test_one_rank_is_the_degenerate_case():
    """dp = 1 (no mpiexec): nothing to post; the reduce-scatter's shard is the bucket."""
    from mpi4py import MPI

    from hpctrain.config import ParallelConfig
    from hpctrain.parallel.hierarchy import hierarchical_launcher, hierarchical_reduce_scatter
    from hpctrain.parallel.topology import Topology

    topo = Topology.build(MPI.COMM_SELF, ParallelConfig(dp=1))
    assert topo.dp_nodes == ((0,),) and topo.dp_leader_comm.Get_size() == 1
    view = np.arange(6.0)
    assert hierarchical_launcher(topo)(None, view) is None
    out = np.zeros(6)
    assert hierarchical_reduce_scatter(topo)(view, out) is None
    assert np.array_equal(out, np.arange(6.0)) and np.array_equal(view, np.arange(6.0))
    topo.free()


class SelfCompleting(FakeRequest):
    """Complete after a few tests, as a real request completes in the background."""

    def __init__(self):
        super().__init__()
        self.tests = 0

    def Test(self):  # noqa: N802
        self.tests += 1
        self.complete = self.complete or self.tests >= 3
        return self.complete


class BusyRank(Rank):
    def post(self, k, phase):
        super().post(k, phase)
        self.requests[k, phase] = SelfCompleting()
        return self.requests[k, phase]


def test_buckets_posted_while_zero_3s_helper_thread_tests_them_keep_their_order(monkeypatch):
    # ZeRO 3 posts a bucket's reduce-scatter from the main thread while its helper thread
    # (zero3.Progress) tests the buckets in flight, which moves their shared queue on:
    # posted outside the helper's lock, a deque changed while the other thread walked it
    # (a crash, or phases posted out of order or never: a hang)
    import threading

    from hpctrain.parallel.zero3 import Progress

    errors = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    progress = Progress(1e-5)
    assert progress.poll_interval > 0, "no helper thread: MPI without THREAD_MULTIPLE"
    rank = BusyRank()
    buckets = [progress.post(rank.launch) for _ in range(3000)]
    for bucket in buckets:
        progress.wait(bucket)
    progress.stop()
    assert errors == []
    for phase in PHASES:
        assert rank.posted(phase) == list(range(len(buckets)))
    assert all(b.done for b in buckets)
