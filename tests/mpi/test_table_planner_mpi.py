"""A plan from the table planner (``hpctrain.plan.tables``), written as a plan file and
read back as ``hpctrain train --table-plan`` reads it, trains like the serial run in
float64 over 10 steps, and each rank holds no more than the memory it was planned for.
At any world size (the memory per rank forbids replicating the largest table (1,200 bytes) when
there are two ranks or more)."""

import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))  # test_tables_mpi
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # test_table_planner
from test_table_planner import RATES  # noqa: E402
from test_tables_mpi import BATCH, STEPS, Run, batch, config, serial  # noqa: E402

from hpctrain.config import TableSharding  # noqa: E402
from hpctrain.parallel.tables import read_plan  # noqa: E402
from hpctrain.plan import tables as tp  # noqa: E402
from hpctrain.testing import assert_all, assert_close_all  # noqa: E402

WORLD = MPI.COMM_WORLD
SIZE = WORLD.Get_size()


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_a_planned_sharding_trains_like_the_serial_run():
    model = config(1, "rowwise_adagrad").model
    work = tp.workload_of(model, BATCH // SIZE, "rowwise_adagrad", 0.6)
    # item (30 x 4 float64 and its AdaGrad state) is 1,200 bytes whole
    limit = 1150 if SIZE > 1 else 10_000
    plan = tp.plan_tables(work, SIZE, limit, RATES)
    with tempfile.TemporaryDirectory() as tmp:  # each rank its own copy of the file
        path = Path(tmp) / "plan.toml"
        path.write_text(plan.toml())
        over = read_plan(str(path))
    par = dict(table_group=over["parallel.table_group"],
               table_default=over["parallel.table_default"],
               table_sharding=tuple(TableSharding(t["name"], t["sharding"],
                                                  tuple(t.get("ranks", ())))
                                    for t in over["parallel.table_sharding"]))
    batches = [batch(BATCH, seed=s) for s in range(STEPS)]
    want_losses, _ = serial("rowwise_adagrad", batches)
    run = Run(config(SIZE, "rowwise_adagrad", **par), WORLD)
    got_losses = run.steps(batches)
    held = sum(p.data.nbytes for n, p in run.engine.named_params if n.startswith("tables."))
    state = sum(a.nbytes for k, a in run.dp.optimizer.sparse.state_arrays().items()
                if ".tables." in k)
    run.free()
    what = f"planned {[(s.name, s.sharding) for s in plan.choices.values()]} at {SIZE} ranks"
    assert_all(WORLD, SIZE == 1 or plan.choices["item"].sharding != "replicated",
               f"{what}: item not replicated under {limit} bytes a rank")
    assert_all(WORLD, held + state <= limit,
               f"{what}: tables and state held {held + state} bytes, planned at most {limit}")
    assert_close_all(WORLD, np.array(got_losses), np.array(want_losses), rtol=1e-10,
                     atol=1e-12, what=f"{what}: losses")
