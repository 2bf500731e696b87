"""Averaging strategies and unequal batch shares under MPI, in float64 on the tiny GPT
at dp = the world size (and dp x tp = 2 inside each replica from 4 ranks):

* periodic averaging every step (H = 1) of SGD with momentum equals synchronous data
  parallelism, losses and weights;
* every strategy is deterministic, really trains apart (the ranks' weights differ
  inside a period and agree after a meeting) and resumes from a checkpoint saved in
  the middle of a period bitwise as if never stopped;
* unequal fixed shares of the global batch give the serial losses;
* hierarchical averaging on one node is refused on every rank alike.
"""

import re
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.checkpoint import load_training, save_training
from hpctrain.checkpoint.format import CheckpointError
from hpctrain.config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.optim import schedule
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.shares import offsets
from hpctrain.parallel.topology import Topology
from hpctrain.testing import assert_all, assert_close_all
from hpctrain.train import make_data_parallel, train_step

WORLD = MPI.COMM_WORLD
SIZE = WORLD.Get_size()
MODEL = ModelConfig(n_layer=2, d_model=16, n_head=4, seq_len=8, vocab_size=32,
                    dtype="float64", init_std=0.3)
STEPS = 6

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]


def config(tp: int = 1, optimizer: str = "sgd", clip: float = 0.0, ranks: int = SIZE,
           pp: int = 1, **par) -> Config:
    train = TrainConfig(batch_size=4 * SIZE, lr=5e-2, warmup_steps=1, weight_decay=0.1,
                        grad_clip=clip, steps=STEPS, optimizer=optimizer, momentum=0.9)
    return Config(model=MODEL, parallel=ParallelConfig(tp=tp, pp=pp, **par),
                  train=train).validate(ranks)


def batches():
    r = np.random.default_rng(0)
    shape = (4 * SIZE, MODEL.seq_len)
    return [(r.integers(0, MODEL.vocab_size, shape), r.integers(0, MODEL.vocab_size, shape))
            for _ in range(STEPS)]


class Run:
    """One run of ``cfg``, a step at a time, each rank on its share of global batches."""

    def __init__(self, cfg: Config, comm=WORLD, node_key: int | None = None):
        self.cfg = cfg
        self.topo = Topology.build(comm, cfg.parallel, node_key=node_key)
        self.engine = build_engine(cfg, self.topo)
        self.dp = make_data_parallel(cfg, self.engine, self.topo)
        self.done = 0
        par, batch = cfg.parallel, cfg.train.batch_size
        shares = (tuple(par.batch_shares) if par.shares == "fixed"
                  else (batch // self.topo.dp_size,) * self.topo.dp_size)
        r = self.topo.dp_rank
        self.rows = slice(offsets(shares)[r], offsets(shares)[r] + shares[r])
        self.share = shares[r] / batch if par.shares == "fixed" else None

    def steps(self, data, until: int) -> list[float]:
        t, losses = self.cfg.train, []
        while self.done < until:
            x, y = data[self.done]
            lr = schedule.lr_at(self.done, lr=t.lr, min_lr=t.min_lr,
                                warmup_steps=t.warmup_steps, total_steps=t.steps)
            losses.append(train_step(self.engine, self.dp, x[self.rows], y[self.rows], lr=lr,
                                     grad_clip=t.grad_clip, share=self.share)[0])
            self.done += 1
        return losses

    def weights(self) -> np.ndarray:
        return np.concatenate([p.data.ravel() for p in self.engine.params])

    def free(self) -> None:
        self.topo.free()


def test_periodic_every_step_of_sgd_equals_synchronous():
    # (tp, pp) inside each replica: none, then tensor and pipeline parallel from 4 ranks
    layouts = [(1, 1)] + ([(2, 1), (1, 2)] if SIZE >= 4 else [])
    for tp, pp in layouts:
        data = batches()
        sync = Run(config(tp, pp=pp))
        want = sync.steps(data, STEPS), sync.weights()
        sync.free()
        local = Run(config(tp, pp=pp, averaging="periodic", average_every=1))
        got = local.steps(data, STEPS), local.weights()
        local.free()
        for what, a, b in zip(["losses", "weights"], got, want, strict=True):
            assert_close_all(WORLD, a, b, rtol=1e-10, atol=1e-13,
                             what=f"H = 1 periodic vs synchronous, {what}, tp={tp} pp={pp}")


STRATEGIES = {
    "periodic": dict(averaging="periodic", average_every=3),
    "post_local": dict(averaging="post_local", sync_steps=2, average_every=3),
    "diloco": dict(averaging="diloco", average_every=3, outer_lr=0.7, outer_momentum=0.9),
    "hierarchical": dict(averaging="hierarchical", average_every=3),
}


def node_key(name: str) -> int | None:
    """Hierarchical averaging needs nodes: emulate two ranks per node."""
    return WORLD.Get_rank() // 2 if name == "hierarchical" else None


def spread(run: Run) -> float:
    """How far the data-parallel ranks' weights are apart (0: they agree)."""
    w = run.weights()
    mean = w.copy()
    run.topo.dp_comm.Allreduce(MPI.IN_PLACE, mean, op=MPI.SUM)
    mean /= run.topo.dp_size
    return WORLD.allreduce(float(np.abs(w - mean).max()), op=MPI.MAX)


@pytest.fixture(scope="module")
def shared_dir():
    path = WORLD.bcast(tempfile.mkdtemp(prefix="hpctrain-avg-") if WORLD.Get_rank() == 0
                       else None)
    yield Path(path)
    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_each_strategy_trains_apart_meets_and_resumes_mid_period_bitwise(name, shared_dir):
    if SIZE < 4 and name == "hierarchical":
        pytest.skip("hierarchical averaging needs two nodes of two ranks")
    cfg = config(optimizer="adamw", clip=1.0, **STRATEGIES[name])
    data = batches()
    first = Run(cfg, node_key=node_key(name))
    losses = first.steps(data, 2)
    apart = spread(first)  # steps 1, 2: local (post_local: synchronous)
    losses += first.steps(data, 3)
    met = spread(first)  # step 3 ends a period (post_local: still mid-period)
    losses += first.steps(data, 4)  # mid-period
    cfg_save = replace(cfg, train=replace(cfg.train, run_dir=str(shared_dir / name)))
    path = save_training(cfg_save, first.topo, first.engine, first.dp, step=4,
                         loader_state=None, root=shared_dir / name)
    want = first.steps(data, STEPS), first.weights()
    losses += want[0]
    first.free()

    again = Run(cfg, node_key=node_key(name))
    same = again.steps(data, STEPS)
    again.free()
    assert_all(WORLD, same == losses, f"{name}: the same seed gives the same losses")
    if name == "post_local":
        assert_all(WORLD, apart == 0.0, f"{name}: synchronous first ({apart})")
    else:
        assert_all(WORLD, apart > 1e-6 and met < 1e-12,
                   f"{name}: apart inside a period ({apart}), equal after it ({met})")

    resumed = Run(cfg, node_key=node_key(name))
    load_training(path, cfg_save, resumed.topo, resumed.engine, resumed.dp)
    resumed.done = 4
    got = resumed.steps(data, STEPS), resumed.weights()
    resumed.free()
    assert_all(WORLD, got[0] == want[0] and np.array_equal(got[1], want[1]),
               f"{name}: resumed mid-period {got[0]} vs {want[0]}")


def test_weighted_local_sgd_with_equal_shares_is_periodic_averaging():
    if SIZE < 2:
        pytest.skip("needs a data group")
    data = batches()
    plain = Run(config(optimizer="adamw", averaging="periodic", average_every=2))
    want = plain.steps(data, STEPS), plain.weights()
    plain.free()
    equal = (4,) * SIZE
    weighted = Run(config(optimizer="adamw", averaging="periodic", average_every=2,
                          shares="fixed", batch_shares=equal))
    got = weighted.steps(data, STEPS), weighted.weights()
    weighted.free()
    assert_all(WORLD, got[0] == want[0] and np.array_equal(got[1], want[1]),
               f"weighted local SGD at equal shares {got[0]} vs periodic {want[0]}")


def test_weighted_local_sgd_takes_more_steps_on_the_faster_rank_and_resumes(shared_dir):
    if SIZE < 2:
        pytest.skip("needs a data group")
    batch = 4 * SIZE  # microbatches 2: units of 2 samples, 2 local steps at equal shares
    shares = (4 + 2 * (SIZE - 1),) + (2,) * (SIZE - 1)  # rank 0: SIZE + 1 steps, others 1
    cfg = config(optimizer="adamw", averaging="periodic", average_every=3, microbatches=2,
                 shares="fixed", batch_shares=shares)
    assert sum(shares) == batch
    data = batches()
    first = Run(cfg)
    first.steps(data, 2)
    taken = first.dp.metrics()["local_steps"]
    apart = spread(first)
    first.steps(data, 3)
    met = spread(first)
    first.steps(data, 4)
    path = save_training(replace(cfg, train=replace(cfg.train, run_dir=str(shared_dir))),
                         first.topo, first.engine, first.dp, step=4, loader_state=None,
                         root=shared_dir / "weighted")
    want = first.steps(data, STEPS), first.weights()
    first.free()
    assert_all(WORLD, taken == shares[first.topo.dp_rank] // 2,
               f"rank took {taken} local steps for a share of {shares[first.topo.dp_rank]}")
    assert_all(WORLD, apart > 1e-6 and met < 1e-12, f"apart {apart}, met {met}")
    resumed = Run(cfg)
    load_training(path, cfg, resumed.topo, resumed.engine, resumed.dp)
    resumed.done = 4
    got = resumed.steps(data, STEPS), resumed.weights()
    resumed.free()
    assert_all(WORLD, got[0] == want[0] and np.array_equal(got[1], want[1]),
               f"weighted: resumed mid-period {got[0]} vs {want[0]}")


def test_a_resume_that_cannot_continue_the_saved_averaging_is_refused(shared_dir):
    """post_local saved after its local steps began resumes with no synchronous step
    after them (those would sum gradients over replicas that differ); a checkpoint of
    weighted local SGD and one of equal shares do not resume as each other. Every rank
    refuses alike, naming the values; a sync_steps the saved step has passed loads."""
    if SIZE < 2:
        pytest.skip("needs a data group")
    post = dict(optimizer="adamw", averaging="post_local", average_every=3)
    first = Run(config(sync_steps=2, **post))
    first.steps(batches(), 4)
    cfg = config(sync_steps=2, **post)
    cfg = replace(cfg, train=replace(cfg.train, run_dir=str(shared_dir)))
    path = save_training(cfg, first.topo, first.engine, first.dp, step=4, loader_state=None,
                         root=shared_dir / "post_local")
    first.free()
    weighted = dict(optimizer="adamw", averaging="periodic", average_every=3)
    tried = [(dict(sync_steps=6, **post), path, "sync_steps 6 would make step 5 "
              r"synchronous again .* at most 4"),
             (dict(sync_steps=4, **post), path, None)]
    for shares in ("fixed", "equal"):
        kept = (dict(shares="fixed", batch_shares=(4,) * SIZE) if shares == "fixed"
                else {})
        run = Run(config(**weighted, **kept))
        run.steps(batches(), 1)
        saved = save_training(cfg, run.topo, run.engine, run.dp, step=1, loader_state=None,
                              root=shared_dir / f"weighted-{shares}")
        run.free()
        other = {} if shares == "fixed" else dict(shares="fixed", batch_shares=(4,) * SIZE)
        tried.append((dict(**weighted, **other), saved,
                      f"was saved with averaging 'periodic' and shares '{shares}'"))
    for par, saved, message in tried:
        run = Run(config(**par))
        try:
            load_training(saved, cfg, run.topo, run.engine, run.dp)
            error = None
        except CheckpointError as err:
            error = str(err)
        run.free()
        ok = error is None if message is None else bool(error and re.search(message, error))
        assert_all(WORLD, ok, f"{par}: {error}")


def test_unequal_fixed_shares_give_the_serial_losses():
    if SIZE < 2:
        pytest.skip("one rank holds the whole batch")
    batch = 4 * SIZE
    # rank 0 takes 3 parts of 4, the others share the rest unequally, each at least 1
    rest = batch - 3 * batch // 4
    shares = [3 * batch // 4] + [1] * (SIZE - 2) + [rest - (SIZE - 2)]
    data = batches()
    serial = Run(config(ranks=1), comm=MPI.COMM_SELF)
    want = serial.steps(data, STEPS)
    serial.free()
    uneven = Run(config(shares="fixed", batch_shares=tuple(shares)))
    got = uneven.steps(data, STEPS)
    uneven.free()
    assert_close_all(WORLD, got, want, rtol=1e-10, what=f"losses with shares {shares}")


def test_hierarchical_averaging_on_one_node_is_refused_everywhere():
    if SIZE < 2:
        pytest.skip("needs a data group")
    cfg = config(averaging="hierarchical", average_every=2)
    topo = Topology.build(WORLD, cfg.parallel, node_key=0)  # every rank on one node
    engine = build_engine(cfg, topo)
    try:
        make_data_parallel(cfg, engine, topo)
        refused = ""
    except ConfigError as err:
        refused = str(err)
    topo.free()
    assert_all(WORLD, "needs the data group on two or more nodes" in refused, refused)


def test_measured_shares_are_one_per_replica_whatever_its_shards_measured():
    """tp 2: each tensor rank measures its own compute time, and each of the replica's
    data groups (one per tensor rank) chooses shares; the replica's shards must read
    the same rows, or the next tensor all-reduce mixes microbatches of two sizes (it
    failed with MPI's "message truncated"). Here the second tensor rank of replica 0
    is slow: the replica runs at that speed, in both data groups."""
    if SIZE < 4 or SIZE % 2:
        pytest.skip("needs tp 2 and a data group of two or more")
    from hpctrain.parallel.shares import FIRST, ShareBalancer

    par = ParallelConfig(dp=SIZE // 2, tp=2, shares="measured")
    topo = Topology.build(WORLD, par)
    balancer = ShareBalancer(par, 8 * SIZE, topo.dp_comm, model_comm=topo.model_comm)
    slow = topo.dp_rank == 0 and topo.tp_rank == 1
    for step in range(1, FIRST + 1):
        balancer.after_step(step, 3.0 if slow else 1.0)
    mine = balancer.shares
    replica = topo.model_comm.allgather(mine)
    everyone = WORLD.allgather(mine)
    topo.free()
    assert_all(WORLD, all(s == mine for s in replica),
               f"the shards of replica {topo.dp_rank} chose {replica}")
    assert_all(WORLD, all(s == everyone[0] for s in everyone), f"shares {everyone}")
    assert_all(WORLD, mine[0] < mine[-1], f"the slow replica 0 kept {mine}")


class SkipAt:
    """The real non-finite guard, shown a nan loss at one step (fault injection)."""

    def __init__(self, bad_step: int):
        from hpctrain.guard import NonFiniteGuard

        self.guard, self.bad_step = NonFiniteGuard(WORLD, max_skipped=3), bad_step

    def check(self, step: int, loss: float, norm: float) -> bool:
        return self.guard.check(step, float("nan") if step == self.bad_step else loss, norm)


@pytest.mark.parametrize("weighted", [False, True])
def test_a_skipped_step_still_counts_in_the_averaging_period(weighted):
    """Periodic averaging every 2 steps, step 3 skipped by the guard: the replicas meet
    at steps 2, 4 and 6 as the schedule names them (they met at 5 and ended step 6
    apart, the skipped step reported as a meeting). The same for throughput-weighted
    local SGD, whose skipped round is undone."""
    if SIZE < 2:
        pytest.skip("needs a data group")
    par = dict(averaging="periodic", average_every=2)
    if weighted:
        par.update(shares="fixed", batch_shares=(4 + 2 * (SIZE - 1),) + (2,) * (SIZE - 1),
                   microbatches=2)
    run = Run(config(**par))
    guard, data, t = SkipAt(3), batches(), run.cfg.train
    met, apart = [], []
    for i in range(STEPS):
        x, y = data[i]
        train_step(run.engine, run.dp, x[run.rows], y[run.rows], lr=t.lr, grad_clip=0.0,
                   share=run.share, guard=guard, step=i + 1)
        met.append(run.dp.metrics()["averaged"])
        apart.append(spread(run))
    run.free()
    assert_all(WORLD, met == [False, True, False, True, False, True], f"meetings {met}")
    assert_all(WORLD, apart[1] == apart[3] == apart[5] == 0.0 and apart[2] == 0.0
               and apart[4] > 0, f"the replicas' spread after each step {apart}")
