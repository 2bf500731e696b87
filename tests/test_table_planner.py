"""The embedding-table planner without MPI (``hpctrain.plan.tables``): the cost model
on hand-computed cases, the greedy's choices on toy tables, memory limits and their
errors, the plan file read back by ``parallel.tables.read_plan``, and the command."""

from __future__ import annotations

import math
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpctrain import config as config_mod
from hpctrain.cli import main
from hpctrain.config import TableSharding
from hpctrain.parallel.tables import place_tables, read_plan
from hpctrain.plan import tables as tp
from hpctrain.plan.tables_calibrate import to_toml

# round numbers, so that every expectation below is arithmetic by hand
RATES = tp.Rates(
    ranks=2, a2a=tp.Line(1e-4, 1e9), gather=tp.Line(2e-4, 1e9), route_s=0.0,
    pool={"cached": tp.RowRate(1e-8, 0.0), "uncached": tp.RowRate(1e-7, 0.0)},
    grad={"cached": tp.RowRate(2e-8, 0.0)},
    update={"rowwise_adagrad/cached": tp.RowRate(3e-8, 0.0),
            "rowwise_adagrad/uncached": tp.RowRate(3e-7, 0.0),
            "adam/cached": tp.RowRate(5e-8, 0.0), "adam/uncached": tp.RowRate(5e-7, 0.0)},
    cache_bytes=2**20, dense={"fwd": 1e-3, "bwd": 2e-3, "sync": 0.0, "update": 0.0},
    dense_batch=100)


def work(*tables, batch=100, optimizer="rowwise_adagrad"):
    return tp.Workload(tuple(tp.TableLoad(n, r, 4, ids) for n, r, ids in tables), batch, 4,
                       optimizer)


def test_distinct_rows_of_uniform_draws():
    assert tp.distinct(1, 50) == 1.0
    assert tp.distinct(10, 1) == pytest.approx(1.0)
    assert tp.distinct(10, 10) == pytest.approx(10 * (1 - 0.9**10))
    assert tp.distinct(10**7, 1000) == pytest.approx(1000, rel=1e-3)
    assert tp.distinct(5, 0) == 0.0


def test_a_replicated_table_by_hand():
    w = work(("t", 1000, 1.0))  # 1000 x 4 float32: 16 KB, cached
    pred = tp.rank_costs(w, tp.place(w, 2, {}), RATES, 2, dense=False)
    r = pred.ranks[0]
    assert r.time["fwd"] == pytest.approx(100 * 1e-8)  # 100 ids pooled
    assert r.time["bwd"] == pytest.approx(100 * 2e-8)  # added to the SparseGrad
    u = 1000 * (1 - (1 - 1 / 1000) ** 200)  # the global batch's distinct rows
    assert r.time["update"] == pytest.approx(u * 3e-8)
    u1 = 1000 * (1 - (1 - 1 / 1000) ** 100)  # one rank's, gathered from both
    gathered = 2 * u1 * (8 + 16)
    assert r.time["sync"] == pytest.approx(3 * 2e-4 + gathered / 1e9 + 2 * u1 * 2e-8)
    assert r.memory == (4000 + 1000) * 4  # the table and AdaGrad's value per row
    assert pred.step_s == pytest.approx(r.own_s)


def test_a_row_wise_table_by_hand():
    w = work(("t", 10**6, 1.0))  # 16 MB: the shards of 8 MB are past the 1 MiB cache
    pred = tp.rank_costs(w, tp.place(w, 2, {"t": TableSharding("t", "row")}), RATES, 2,
                         dense=False)
    r = pred.ranks[1]
    # owner of half the rows: half of both ranks' 100 ids each
    assert r.time["fwd"] - r.comm_s * 0 == pytest.approx(
        100 * 1e-7 + 1e-4 + (1e-4 + 2 * (1 + 100 + 50) * 8 / 1e9)
        + (1e-4 + 2 * 100 * 16 / 1e9))
    assert r.time["bwd"] == pytest.approx(100 * 2e-8 + 1e-4 + 2 * 100 * 16 / 1e9)
    assert r.time["update"] == pytest.approx(tp.distinct(500_000, 100) * 3e-7)
    assert r.time["sync"] == 0.0
    assert r.memory == (500_000 * 4 + 500_000) * 4
    assert r.comm_s == pytest.approx(4e-4 + (2 * 151 * 8 + 2 * 2 * 100 * 16) / 1e9)


def test_a_sharded_tables_own_work_is_split_between_forward_and_backward():
    w = work(("t", 10**6, 1.0), ("u", 10, 1.0))
    choices = {"t": TableSharding("t", "row")}
    bare = tp.rank_costs(w, tp.place(w, 2, choices), RATES, 2, dense=False).ranks[0]
    with_own = tp.rank_costs(w, tp.place(w, 2, choices), replace(RATES, shard_s=6e-4), 2,
                             dense=False).ranks[0]
    # one sharded table: 3e-4 more each way; the replicated one pays nothing
    assert with_own.time["fwd"] - bare.time["fwd"] == pytest.approx(3e-4)
    assert with_own.time["bwd"] - bare.time["bwd"] == pytest.approx(3e-4)
    assert with_own.time["sync"] == bare.time["sync"]
    assert with_own.comm_s == bare.comm_s  # not an exchange


def test_the_dense_part_scales_with_the_batch():
    w = work(("t", 10, 1.0), batch=200)
    r = tp.rank_costs(w, tp.place(w, 2, {}), RATES, 2).ranks[0]
    bare = tp.rank_costs(w, tp.place(w, 2, {}), RATES, 2, dense=False).ranks[0]
    assert r.time["fwd"] - bare.time["fwd"] == pytest.approx(2e-3)
    assert r.time["bwd"] - bare.time["bwd"] == pytest.approx(4e-3)


def test_adam_state_is_two_values_per_element():
    w = work(("t", 1000, 1.0), optimizer="adam")
    p = tp.place(w, 2, {"t": TableSharding("t", "table", (1,))})["t"]
    assert tp.memory_bytes(p, 1, 4, "adam") == 3 * 4000 * 4
    assert tp.memory_bytes(p, 0, 4, "adam") == 0


def test_the_greedy_shards_the_huge_table_and_replicates_the_tiny_ones():
    w = work(("huge", 10**7, 1.0), ("small", 8, 1.0), ("bag", 20, 2.4), ("mid", 2000, 1.0))
    # the huge table replicated needs 200 MB a rank: 150 MB forbids it, row-wise fits
    plan = tp.plan_tables(w, 2, 150e6, RATES)
    assert plan.choices["huge"].sharding == "row"
    assert plan.choices["small"].sharding == "replicated"
    assert plan.choices["bag"].sharding == "replicated"
    assert plan.prediction.max_memory <= 150e6
    assert list(plan.choices) == ["huge", "small", "bag", "mid"]  # the model's order
    # with memory to spare the huge table is still not replicated: its update of the
    # global batch's rows, uncached, and the gather cost more than the exchanges
    roomy = tp.plan_tables(w, 2, 10e9, RATES)
    assert roomy.choices["small"].sharding == "replicated"


def test_the_greedy_balances_table_wise_tables_over_the_ranks():
    slow = tp.Rates(**{**RATES.__dict__, "a2a": tp.Line(1e-9, 1e12),
                       "update": {k: tp.RowRate(1e-6, 0.0) for k in RATES.update}})
    w = work(("a", 10**5, 1.0), ("b", 10**5, 1.0), batch=1000)
    plan = tp.plan_tables(w, 2, 1e9, slow)
    kinds = {n: (s.sharding, s.ranks) for n, s in plan.choices.items()}
    # the costly replicated update pushes both to shards; two tables, two ranks
    assert {k for k, _ in kinds.values()} <= {"table", "row", "column"}
    own = [r.own_s for r in plan.prediction.ranks]
    assert max(own) - min(own) <= 0.2 * max(own)


def test_a_table_that_fits_nowhere_is_named_with_its_bytes_and_the_closest_miss():
    w = work(("huge", 10**7, 1.0), ("small", 8, 1.0))
    with pytest.raises(tp.PlanError) as e:
        tp.plan_tables(w, 2, 50e6, RATES)  # row-wise would need 100 MB a rank
    text = str(e.value)
    assert "table 'huge'" in text and "10,000,000 x 4" in text
    assert "190.73 MiB" in text  # 10^7 x (4 + 1) x 4 bytes
    assert "47.68 MiB each" in text and "row-wise" in text and "95.37 MiB" in text


def test_a_hand_written_plan_over_the_memory_names_the_rank_and_the_tables():
    w = work(("huge", 10**7, 1.0), ("small", 8, 1.0))
    placed = tp.place(w, 2, {"huge": TableSharding("huge", "table", (1,))})
    tp.check_plan(w, 2, 300e6, placed)
    with pytest.raises(tp.PlanError, match=r"group rank 1 holds 190.74 MiB .* table 'huge' "
                                           r"\(table-wise\)"):
        tp.check_plan(w, 2, 100e6, placed)


def test_the_plan_file_reads_back_as_the_same_placement(tmp_path):
    cfg = config_mod.load("configs/dlrm-movielens.toml")
    w = tp.workload_of(cfg.model, 256, "adam", 0.3)
    plan = tp.plan_tables(w, 2, 2**30, RATES)
    path = tmp_path / "plan.toml"
    path.write_text(plan.toml())
    again = config_mod.load("configs/dlrm-movielens.toml", read_plan(str(path))).validate(2)
    assert place_tables(again.model, again.parallel) == plan.placements


def test_workload_of_a_config_counts_a_bags_filled_slots():
    cfg = config_mod.load("configs/dlrm-movielens.toml")
    w = tp.workload_of(cfg.model, 64, "adam", 0.5)
    genres = {t.name: t for t in w.tables}["genres"]
    assert genres.ids == 3.0 and genres.dim == 32 and w.itemsize == 4


def test_the_rates_file_reads_back():
    text = to_toml([RATES], "a note")
    back = tp.rates_from_dict(tomllib.loads(text), 2)
    assert back.a2a == RATES.a2a and back.update == RATES.update
    assert math.isclose(back.dense["bwd"], 2e-3)
    with pytest.raises(config_mod.ConfigError, match="no rates measured at 4 ranks"):
        tp.rates_from_dict(tomllib.loads(text), 4)


def test_plan_tables_command_prints_writes_and_refuses(tmp_path):
    rates = tmp_path / "rates.toml"
    rates.write_text(to_toml([RATES], "test"))
    out = tmp_path / "plan.toml"
    args = ["plan-tables", "--config", "configs/dlrm-movielens.toml", "--hashed-rows",
            "10000000", "--ranks", "2", "--rates", str(rates), "--optimizer",
            "rowwise_adagrad"]
    got = CliRunner().invoke(main, [*args, "--memory-gib", "1", "--out", str(out)])
    assert got.exit_code == 0, got.output
    assert "hashed       row" in got.output and "predicted step" in got.output
    assert 'name = "hashed"\nsharding = "row"' in out.read_text()
    # 1 GiB forbids replicating the 1.2 GiB table; the plan checked, then at too little
    got = CliRunner().invoke(main, [*args, "--memory-gib", "1", "--check", str(out)])
    assert got.exit_code == 0, got.output
    got = CliRunner().invoke(main, [*args, "--memory-gib", "0.5", "--check", str(out)])
    assert got.exit_code != 0 and "table 'hashed' (row-wise)" in got.output
    got = CliRunner().invoke(main, [*args, "--memory-gib", "0.2"])
    assert got.exit_code != 0 and "table 'hashed' (10,000,000 x 32" in got.output


def test_plan_tables_out_never_replaces_an_input_and_checks_its_folder_first(tmp_path):
    # --out over the --config replaced it with the plan; a missing folder failed with a
    # traceback after the planning; an existing file was replaced without a word
    rates = tmp_path / "rates.toml"
    rates.write_text(to_toml([RATES], "test"))
    config = tmp_path / "dlrm.toml"
    config.write_text(Path("configs/dlrm-movielens.toml").read_text())
    args = ["plan-tables", "--config", str(config), "--hashed-rows", "10000000", "--ranks",
            "2", "--rates", str(rates), "--memory-gib", "1", "--optimizer", "rowwise_adagrad"]
    before = config.read_text()
    for out, force in ((config, True), (rates, True)):
        got = CliRunner().invoke(main, [*args, "--out", str(out)] + ["--force"] * force)
        assert got.exit_code == 2 and "never replaces (not even with --force)" in got.output
    assert config.read_text() == before
    deep = tmp_path / "new" / "plan.toml"
    assert CliRunner().invoke(main, [*args, "--out", str(deep)]).exit_code == 0
    got = CliRunner().invoke(main, [*args, "--out", str(deep)])
    assert got.exit_code == 2 and "already exists; pass --force" in got.output
    assert CliRunner().invoke(main, [*args, "--out", str(deep), "--force"]).exit_code == 0
    got = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "x.toml"), "--check",
                                    str(deep)])
    assert got.exit_code == 2 and "plans nothing" in got.output


def test_shared_time_runs_each_call_with_inputs_of_its_own_for_the_span_asked():
    import time

    from mpi4py import MPI

    from hpctrain.plan.tables_calibrate import _shared_time

    made = []

    def make(i):
        made.append(i)
        return lambda: time.sleep(0.002)

    per_call = _shared_time(MPI.COMM_SELF, make, min_s=0.03)
    # 0 is the warm-up call; then enough calls for the 30 ms span, each made afresh
    assert made[0] == 0 and made[1:] == list(range(1, len(made)))
    assert len(made) - 1 >= 3 and (len(made) - 1) * 0.002 >= 0.03 * 0.5
    assert 0.002 <= per_call < 0.02


# ---------------------------------------------------------------------------------
# bad input: one line naming the value and the rule, never a traceback

CONFIG = "configs/dlrm-movielens.toml"


def _plan_tables(tmp_path, *args, note="test"):
    rates = tmp_path / "rates.toml"
    rates.write_text(to_toml([RATES], note))
    return CliRunner().invoke(main, ["plan-tables", "--config", CONFIG, "--rates", str(rates),
                                     "--optimizer", "rowwise_adagrad", *args])


def _refused(got) -> str:
    """The command's one-line refusal (click's, not a traceback)."""
    assert got.exit_code != 0, got.output
    assert isinstance(got.exception, SystemExit), repr(got.exception)
    lines = got.output.strip().splitlines()
    assert lines[-1].startswith("Error: ") and "Traceback" not in got.output, got.output
    return lines[-1]


@pytest.mark.parametrize("text", [
    '[[tables]]\nname = "nosuch"\nsharding = "row"\n',
    '[[tables]]\nname = "user"\nsharding = "row"\n'
    '[[tables]]\nname = "user"\nsharding = "table"\n',
    '[[tables]]\nname = "user"\nsharding = "row"\nextra = 1\n',
    '[[tables]]\nsharding = "row"\n',
    '[[tables]]\nname = "user"\n',
    'tables = 5\n',
    'tables = [5]\n',
    'default = 5\n',
    'default = "diagonal"\n',
    'group = "two"\n',
    '[[tables]]\nname = "user"\nsharding = "table"\nranks = [0, 5]\n',
    '[[tables]]\nname = "user"\nsharding = "column"\nranks = [0, 1, 1]\n',
    'colour = "red"\n',
], ids=["unknown-table", "twice", "extra-key", "no-name", "no-sharding", "tables-int",
        "entry-int", "default-int", "default-unknown", "group-str", "rank-outside",
        "rank-repeated", "unknown-key"])
def test_check_refuses_a_plan_file_as_train_does_in_one_line(tmp_path, text):
    plan = tmp_path / "plan.toml"
    plan.write_text(text)
    # what `mpiexec -n 2 hpctrain train --config CONFIG --table-plan plan.toml` says
    with pytest.raises(config_mod.ConfigError) as train:
        config_mod.load(CONFIG, read_plan(str(plan))).validate(2)
    line = _refused(_plan_tables(tmp_path, "--ranks", "2", "--memory-gib", "1",
                                 "--check", str(plan)))
    assert str(train.value) in line and f"table plan {str(plan)!r}" in line


def test_check_refuses_a_plan_for_another_group_size(tmp_path):
    plan = tmp_path / "plan.toml"
    plan.write_text("group = 1\n")
    line = _refused(_plan_tables(tmp_path, "--ranks", "2", "--memory-gib", "1",
                                 "--check", str(plan)))
    assert "group (1) must be --ranks (2)" in line


def test_a_rank_count_not_measured_says_which_command_measures_it(tmp_path):
    got = _plan_tables(tmp_path, "--ranks", "3", "--memory-gib", "1",
                       note=f"Written by: hpctrain calibrate-tables --config {CONFIG} "
                            f"--hashed-rows 10 --ranks 2 --out elsewhere.toml --timeout 60")
    line = _refused(got)
    assert "--calibrate" not in line
    assert (f"no rates measured at 3 ranks (measured: [2]); run hpctrain calibrate-tables "
            f"--config {CONFIG} --hashed-rows 10 --timeout 60 --ranks 2,3 --out "
            f"{tmp_path / 'rates.toml'}") in line
    with pytest.raises(config_mod.ConfigError, match=r"run hpctrain calibrate-tables "
                                                     r"--config CONFIG --ranks 2,4 --out"):
        tp.rates_from_dict(tomllib.loads(to_toml([RATES], "no command")), 4)


@pytest.mark.parametrize("option, value, rule", [
    ("--ranks", "0", "x>=1"), ("--ranks", "-2", "x>=1"),
    ("--batch", "-5", "x>=1"), ("--batch", "0", "x>=1"),
    ("--bag-fill", "1.5", "0<x<=1"), ("--bag-fill", "-0.1", "0<x<=1"),
    ("--bag-fill", "0", "0<x<=1"), ("--bag-fill", "nan", "not a finite number"),
    ("--hashed-rows", "-5", "x>=0"),
    ("--memory-gib", "nan", "not a finite number"), ("--memory-gib", "inf", "finite"),
    ("--memory-gib", "-1", "x>0"), ("--memory-gib", "0", "x>0"),
])
def test_plan_tables_refuses_a_bad_option_by_name(tmp_path, option, value, rule):
    args = {"--ranks": "2", "--memory-gib": "1", option: value}
    got = _plan_tables(tmp_path, *[w for kv in args.items() for w in kv])
    line = _refused(got)
    assert got.exit_code == 2 and f"'{option}': {value}" in line and rule in line


@pytest.mark.parametrize("value", ["-1", "0", "nan"])
def test_calibrate_tables_refuses_a_bad_timeout_before_any_job(value):
    got = CliRunner().invoke(main, ["calibrate-tables", "--config", CONFIG, "--ranks", "2",
                                    "--mpiexec", "false", "--timeout", value])
    assert got.exit_code == 2 and "'--timeout'" in _refused(got)


def test_calibrate_tables_refuses_a_launcher_or_an_output_that_cannot_work(tmp_path):
    got = CliRunner().invoke(main, ["calibrate-tables", "--config", CONFIG, "--ranks", "2",
                                    "--mpiexec", str(tmp_path / "none")])
    assert got.exit_code == 2 and "none: no such program" in got.output, got.output
    (tmp_path / "file").write_text("")
    got = CliRunner().invoke(main, ["calibrate-tables", "--config", CONFIG, "--ranks", "2",
                                    "--mpiexec", "false", "--out", str(tmp_path / "file/r")])
    assert got.exit_code == 2 and "file/r: cannot be written" in got.output, got.output
    assert "measuring" not in got.output  # before any job


def test_calibrate_tables_measures_a_repeated_rank_count_once():
    from hpctrain.plan.tables_calibrate import _ranks

    assert _ranks(None, None, "4,2,4") == [2, 4]  # one [ranks.N] section each


def test_hashed_rows_refuses_a_config_with_a_table_named_hashed(tmp_path):
    from hpctrain.plan.tables_calibrate import model_of

    cfg = tmp_path / "dlrm.toml"
    cfg.write_text(open(CONFIG).read().replace('name = "zip_prefix"', 'name = "hashed"'))
    assert [t.name for t in model_of(str(cfg), 0).tables].count("hashed") == 1
    with pytest.raises(config_mod.ConfigError, match="adds a table 'hashed', and the "
                                                     "config has one already"):
        model_of(str(cfg), 10)
