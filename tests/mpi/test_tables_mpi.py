"""Sharded embedding tables (``hpctrain.parallel.tables``) follow the serial run in
float64 over 10 steps: table-, row- and column-wise alone, mixed, and two-dimensional
(tables sharded within groups, the groups replicated), with both sparse optimizers;
each rank holds only its shards; a checkpoint saved row-wise loads bitwise at the other
shardings and serially. At any world size (the matrix adapts: the table group is at
most 4 ranks, the DLRM's embed_dim)."""

import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/test_dlrm.py
from test_dlrm import batch, model_cfg  # noqa: E402

from hpctrain.checkpoint import load_training, save_training  # noqa: E402
from hpctrain.checkpoint.reshard import extract, segments, slices  # noqa: E402
from hpctrain.checkpoint.state import held_tensors  # noqa: E402
from hpctrain.config import Config, ParallelConfig, TableSharding, TrainConfig  # noqa: E402
from hpctrain.optim import schedule  # noqa: E402
from hpctrain.parallel.engine import build_engine  # noqa: E402
from hpctrain.parallel.tables import ShardParameter, place_tables  # noqa: E402
from hpctrain.parallel.topology import Topology  # noqa: E402
from hpctrain.testing import assert_all, assert_close_all  # noqa: E402
from hpctrain.train import make_data_parallel, train_step  # noqa: E402

WORLD = MPI.COMM_WORLD
SIZE = WORLD.Get_size()
BATCH = 32
STEPS = 10
GROUP = min(SIZE, 4)  # embed_dim 4: column-wise over at most 4 ranks
MIXED = (TableSharding("user", "row"), TableSharding("item", "table"),
         TableSharding("genres", "column"))
LAYOUTS = {
    "table": dict(table_default="table", table_group=GROUP),
    "row": dict(table_default="row", table_group=GROUP),
    "column": dict(table_default="column", table_group=GROUP),
    "mixed": dict(table_sharding=MIXED, table_group=GROUP),
    # two-dimensional: groups of half the world (one rank at 2: whole tables, reduced
    # over the replicas), the other tables placed on chosen ranks
    "2d": dict(table_group=max(SIZE // 2, 1),
               table_sharding=(TableSharding("user", "row"), TableSharding("item", "table",
                                                                          (SIZE // 2 - 1,)),
                               TableSharding("genres", "column", (0,)))),
}


def config(size, sparse_optimizer, microbatches=1, **par):
    return Config(model=model_cfg(),
                  parallel=ParallelConfig(microbatches=microbatches, **par),
                  train=TrainConfig(steps=STEPS, batch_size=BATCH, lr=1e-2, warmup_steps=1,
                                    grad_clip=0.5, sparse_lr=0.05,
                                    sparse_optimizer=sparse_optimizer)).validate(size)


class Run:
    """One training run's topology, engine and wrapper on ``comm``."""

    def __init__(self, cfg, comm):
        self.cfg, self.comm = cfg, comm
        self.topo = Topology.build(comm, cfg.parallel)
        self.engine = build_engine(cfg, self.topo)
        self.dp = make_data_parallel(cfg, self.engine, self.topo)
        self.done = 0

    def steps(self, batches):
        t, losses = self.cfg.train, []
        for x, y in batches:
            b = len(x) // self.topo.dp_size
            rows = slice(self.topo.dp_rank * b, (self.topo.dp_rank + 1) * b)
            lr = schedule.lr_at(self.done, lr=t.lr, min_lr=t.min_lr,
                                warmup_steps=t.warmup_steps, total_steps=STEPS)
            losses.append(train_step(self.engine, self.dp, x[rows], y[rows], lr=lr,
                                     grad_clip=t.grad_clip)[0])
            self.done += 1
        return losses

    def params(self):
        """name -> (array, box of the global tensor or None: whole)."""
        return {n: (p.data.copy(), p.box if isinstance(p, ShardParameter) else None)
                for n, p in self.engine.named_params}

    def held(self):
        return held_tensors(self.engine, self.dp, 0, 1)

    def free(self):
        self.topo.free()


def global_state(run):
    """Every held tensor assembled whole from the ranks' pieces (collective)."""
    pieces = [(h.name, h.sharding.global_shape, seg.box, extract(h.array, seg))
              for h in run.held() for seg in segments(h.sharding)]
    out = {}
    for rank_pieces in run.comm.allgather(pieces):
        for name, shape, box, values in rank_pieces:
            whole = out.setdefault(name, np.full(shape, np.nan))
            whole[slices(box)] = values
    return out


_SERIAL = {}


def serial(sparse_optimizer, batches):
    if sparse_optimizer not in _SERIAL:
        run = Run(config(1, sparse_optimizer), MPI.COMM_SELF)
        _SERIAL[sparse_optimizer] = run.steps(batches), run.params()
        run.free()
    return _SERIAL[sparse_optimizer]


@pytest.mark.mpi
@pytest.mark.parametrize("sparse_optimizer", ["rowwise_adagrad", "adam"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_tables_follow_the_serial_run(layout, sparse_optimizer):
    batches = [batch(BATCH, seed=s) for s in range(STEPS)]
    want_losses, want = serial(sparse_optimizer, batches)
    mb = 2 if (layout, sparse_optimizer) == ("mixed", "adam") else 1
    cfg = config(SIZE, sparse_optimizer, microbatches=mb, **LAYOUTS[layout])
    run = Run(cfg, WORLD)
    got_losses = run.steps(batches)
    what = f"{layout} at {SIZE} ranks, {sparse_optimizer}, microbatches {mb}"
    assert_close_all(WORLD, np.array(got_losses), np.array(want_losses), rtol=1e-10,
                     atol=1e-12, what=f"{what}: losses")
    got = run.params()
    names = WORLD.allgather(sorted(got))
    assert_all(WORLD, set().union(*map(set, names)) == set(want), f"{what}: every table held")
    for name in sorted(want):
        array, box = got.get(name, (np.zeros(0), None))
        ref = want[name][0] if box is None else want[name][0][slices(box)]
        if name not in got:
            array = ref  # this rank holds no shard of that table
        assert_close_all(WORLD, array, ref, rtol=1e-10, atol=1e-12, what=f"{what}: {name}")
    run.free()


@pytest.mark.mpi
@pytest.mark.parametrize("sparse_optimizer", ["rowwise_adagrad", "adam"])
def test_each_rank_allocates_only_its_shards(sparse_optimizer):
    cfg = config(SIZE, sparse_optimizer, **LAYOUTS["mixed"])
    run = Run(cfg, WORLD)
    place = place_tables(cfg.model, cfg.parallel)
    me = run.topo.table_comm.Get_rank()
    expected = sum((p.rows * p.dim if p.kind == "replicated"
                    else (s.elements if (s := p.shard_of(me)) else 0)) * 8
                   for p in place.values())
    held = sum(p.data.nbytes for n, p in run.engine.named_params if n.startswith("tables."))
    state = {k: a for k, a in run.dp.optimizer.sparse.state_arrays().items() if k != "t"
             and ".tables." in k}
    per = 1 if sparse_optimizer == "rowwise_adagrad" else 2  # acc per row; m and v
    rows = sum((s.rows[1] - s.rows[0]) if (s := p.shard_of(me)) else 0
               for p in place.values())
    want_state = rows * 8 if per == 1 else 2 * expected
    full = sum(p.rows * p.dim * 8 for p in place.values())
    assert_all(WORLD, held == expected and sum(a.nbytes for a in state.values()) ==
               want_state and (held < full or SIZE == 1),
               f"table bytes held {held} (want {expected}, whole {full}), optimizer state "
               f"{sum(a.nbytes for a in state.values())} (want {want_state})")
    run.free()


@pytest.fixture(scope="module")
def shared_dir():
    path = WORLD.bcast(tempfile.mkdtemp(prefix="hpctrain-tables-") if WORLD.Get_rank() == 0
                       else None)
    yield Path(path)
    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.mpi
@pytest.mark.parametrize("sparse_optimizer", ["rowwise_adagrad", "adam"])
def test_a_row_wise_checkpoint_loads_at_every_sharding_and_serially(sparse_optimizer,
                                                                     shared_dir):
    if SIZE < 2:
        pytest.skip("row-wise over one rank is the serial case")
    batches = [batch(BATCH, seed=s) for s in range(8)]
    root = shared_dir / sparse_optimizer
    cfg = config(SIZE, sparse_optimizer, **LAYOUTS["row"])
    cfg = replace(cfg, train=replace(cfg.train, run_dir=str(root)))
    first = Run(cfg, WORLD)
    first.steps(batches[:4])
    path = save_training(cfg, first.topo, first.engine, first.dp, step=4, loader_state=None,
                         root=root)
    saved = global_state(first)
    first.steps(batches[4:])
    after = global_state(first)
    first.free()
    for layout in ("column", "table", "mixed", "2d"):
        other = config(SIZE, sparse_optimizer, **LAYOUTS[layout])
        other = replace(other, train=replace(other.train, run_dir=str(root)))
        run = Run(other, WORLD)
        load_training(path, other, run.topo, run.engine, run.dp, root=root)
        same = all(np.array_equal(extract(h.array, seg), saved[h.name][slices(seg.box)])
                   for h in run.held() for seg in segments(h.sharding))
        assert_all(WORLD, same and run.dp.optimizer.t == 4,
                   f"row-wise checkpoint loaded {layout}-wise: bitwise")
        run.done = 4
        run.steps(batches[4:])
        got = global_state(run)
        for name in sorted(after):
            assert_close_all(WORLD, got[name], after[name], rtol=1e-10, atol=1e-12,
                             what=f"{layout}-wise after resuming: {name}")
        run.free()
    # serially, on every rank alone
    mine = Path(tempfile.mkdtemp(prefix="hpctrain-serial-"))
    alone = config(1, sparse_optimizer)
    alone = replace(alone, train=replace(alone.train, run_dir=str(mine)))
    run = Run(alone, MPI.COMM_SELF)
    load_training(path, alone, run.topo, run.engine, run.dp, root=mine, say=lambda _: None)
    same = all(np.array_equal(h.array, saved[h.name]) for h in run.held())
    run.done = 4
    run.steps(batches[4:])
    close = all(np.allclose(h.array, after[h.name], rtol=1e-10, atol=1e-12)
                for h in run.held())
    run.free()
    shutil.rmtree(mine, ignore_errors=True)
    assert_all(WORLD, same, "row-wise checkpoint loaded serially: bitwise")
    assert_all(WORLD, close, "serial after resuming follows the row-wise run")
