"""Sharded embedding tables without MPI: the placement and its rules (errors name the
table and the values), the config and plan forms, the table groups' arithmetic, shards
as boxes of a checkpoint, ids beyond a table refused where the ratings are read, and the
sharded lookup at one rank against EmbeddingBag."""

from __future__ import annotations

import dataclasses

import h5py
import numpy as np
import pytest
from test_dlrm import model_cfg

from hpctrain.checkpoint.reshard import Sharding, extract, place, segments
from hpctrain.config import (
    Config,
    ConfigError,
    ParallelConfig,
    TableSharding,
    TrainConfig,
    from_dict,
)
from hpctrain.data.format import DataError
from hpctrain.data.ratings import read_ratings
from hpctrain.nn import EmbeddingBag
from hpctrain.parallel.tables import (
    Placement,
    Shard,
    ShardedBag,
    format_plan,
    place_tables,
    plan_toml,
    read_plan,
)
from hpctrain.parallel.topology import table_groups


def placed(size=4, **par):
    cfg = Config(model=model_cfg(), parallel=ParallelConfig(**par),
                 train=TrainConfig(batch_size=24)).validate(size)
    return place_tables(cfg.model, cfg.parallel)


def refused(size=4, **par) -> str:
    with pytest.raises(ConfigError) as err:
        Config(model=model_cfg(), parallel=ParallelConfig(**par)).validate(size)
    return str(err.value)


def test_each_sharding_places_boxes_that_tile_the_table():
    # tables user (20 rows), item (30), genres (5); embed_dim 4
    p = placed(4, table_sharding=(TableSharding("user", "row"),
                                  TableSharding("item", "column", (1, 3)),
                                  TableSharding("genres", "table")))
    assert [s.rows for s in p["user"].shards] == [(0, 5), (5, 10), (10, 15), (15, 20)]
    assert [(s.owner, s.cols) for s in p["item"].shards] == [(1, (0, 2)), (3, (2, 4))]
    assert all(s.rows == (0, 30) for s in p["item"].shards)
    # table-wise goes to the least loaded rank: ranks 0 and 2 hold 20 elements of user,
    # 1 and 3 also 60 of item; rank 0 on the tie
    assert p["genres"].shards == (Shard(0, (0, 5), (0, 4)),)
    uneven = placed(3, table_default="row", table_group=3)
    assert [s.rows for s in uneven["item"].shards] == [(0, 10), (10, 20), (20, 30)]
    assert [s.rows for s in uneven["user"].shards] == [(0, 7), (7, 14), (14, 20)]
    assert placed(2)["user"].kind == "replicated"  # the default


def test_table_wise_spreads_whole_tables_over_the_group():
    p = placed(2, table_default="table")
    assert [p[n].shards[0].owner for n in ("user", "item", "genres")] == [0, 1, 0]


@pytest.mark.parametrize("par, message", [
    (dict(table_sharding=(TableSharding("users", "row"),)),
     r"table 'users'.*the model does not have; its tables: \['user', 'item', 'genres'\]"),
    (dict(table_sharding=(TableSharding("item", "diagonal"),)),
     r"table 'item': sharding \('diagonal'\) must be one of table, row, column"),
    (dict(table_group=2, table_sharding=(TableSharding("item", "row", (0, 2)),)),
     r"table 'item': row-wise on ranks \[0, 2\] needs a table group of 3 ranks; it has 2 "
     r".*ranks \[2\] do not exist"),
    (dict(table_group=8), r"table_group \(8\).*dp = 4.*needs more ranks than exist"),
    (dict(table_group=3), r"table_group \(3\) must divide.*dp = 4"),
    (dict(table_sharding=(TableSharding("genres", "column", (0, 1, 2)),)),
     r"table 'genres': column-wise over 3 ranks needs its dimension \(embed_dim 4\) "
     r"divisible by 3"),
    (dict(table_sharding=(TableSharding("user", "table", (0, 1)),)),
     r"table 'user': table-wise .* one rank; ranks \(\[0, 1\]\)"),
    (dict(table_sharding=(TableSharding("user", "row", (1, 1)),)), r"table 'user'.*repeat"),
    (dict(table_sharding=(TableSharding("user", "replicated", (1,)),)),
     r"table 'user': a replicated table.*ranks \(\[1\]\) must be empty"),
    (dict(table_sharding=(TableSharding("user", "row"), TableSharding("user", "table"))),
     r"places table 'user' twice"),
    (dict(table_default="striped"), r"table_default \('striped'\) must be one of"),
])
def test_bad_shardings_name_the_table_and_the_values(par, message):
    import re

    assert re.search(message, refused(4, **par)), refused(4, **par)


def test_row_wise_over_more_ranks_than_rows_and_a_model_without_tables():
    cfg = Config(model=model_cfg(tables=model_cfg().tables[:2] + (
        dataclasses.replace(model_cfg().tables[2], rows=3),)),
        parallel=ParallelConfig(table_default="row"))
    with pytest.raises(ConfigError, match=r"table 'genres': row-wise over 4 ranks needs at "
                                          r"least 4 rows; it has 3"):
        cfg.validate(4)
    with pytest.raises(ConfigError, match=r"model kind 'mlp' has none"):
        Config(model=dataclasses.replace(Config().model, kind="mlp"),
               parallel=ParallelConfig(table_default="row")).validate(2)


def test_the_config_takes_an_inline_table_or_a_list():
    base = {"model": dataclasses.asdict(model_cfg())}
    base["model"]["tables"] = [dataclasses.asdict(t) for t in model_cfg().tables]
    inline = from_dict({**base, "parallel": {"table_sharding": {
        "user": "row", "item": {"sharding": "table", "ranks": [1]}}}})
    listed = from_dict({**base, "parallel": {"table_sharding": [
        {"name": "user", "sharding": "row"}, {"name": "item", "sharding": "table",
                                              "ranks": [1]}]}})
    assert inline.parallel.table_sharding == listed.parallel.table_sharding == (
        TableSharding("user", "row"), TableSharding("item", "table", (1,)))
    again = from_dict(inline.to_dict())  # what a checkpoint's metadata holds, read back
    assert again.parallel.table_sharding == inline.parallel.table_sharding
    with pytest.raises(ConfigError, match=r"table_sharding\[0\].*name, sharding, ranks"):
        from_dict({**base, "parallel": {"table_sharding": [{"name": "user", "shard": 1}]}})


def test_a_plan_file_keeps_a_table_name_with_quotes_and_backslashes(tmp_path):
    path = tmp_path / "plan.toml"
    path.write_text(plan_toml(0, "replicated", [TableSharding('a "b" \\c', "row", (0,))]))
    assert read_plan(str(path))["parallel.table_sharding"] == \
        [{"name": 'a "b" \\c', "sharding": "row", "ranks": [0]}]


def test_a_plan_file_round_trips_and_overrides_the_config(tmp_path):
    specs = [TableSharding("user", "row", (0, 1)), TableSharding("genres", "column")]
    path = tmp_path / "plan.toml"
    path.write_text(plan_toml(2, "table", specs))
    over = read_plan(str(path))
    assert over == {"parallel.table_group": 2, "parallel.table_default": "table",
                    "parallel.table_sharding": [{"name": "user", "sharding": "row",
                                                 "ranks": [0, 1]},
                                                {"name": "genres", "sharding": "column"}]}
    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text('[model]\nkind = "dlrm"\ndtype = "float64"\ntables = ['
                        '{name = "user", rows = 20}, {name = "item", rows = 30}, '
                        '{name = "genres", rows = 5, width = 3, pooling = "mean"}]\n'
                        'embed_dim = 4\nbottom_mlp = [6, 4]\ntop_mlp = [8]\n'
                        'dense_features = ["age", "year"]\n')
    from hpctrain import config

    cfg = config.load(cfg_path, over).validate(4)
    p = place_tables(cfg.model, cfg.parallel)
    assert (p["user"].kind, p["item"].kind, p["genres"].kind) == ("row", "table", "column")
    text = format_plan(p, 2, 8)
    assert "user" in text and "row" in text and f"{10 * 4 * 8:,}" in text
    (tmp_path / "bad.toml").write_text("groups = 2\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['groups'\]"):
        read_plan(str(tmp_path / "bad.toml"))


def test_table_groups_match_the_docstring_table():
    assert table_groups(8, 4, 5) == ([4, 5, 6, 7], [1, 5])
    assert table_groups(8, 4, 2) == ([0, 1, 2, 3], [2, 6])
    assert table_groups(4, 1, 3) == ([3], [0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"table_group \(3\) must divide dp \(8\)"):
        table_groups(8, 3, 0)


def test_a_shard_is_a_box_of_its_table_in_checkpoints():
    table = np.arange(30.0 * 4).reshape(30, 4)
    sh = Sharding((30, 4), box=((10, 20), (2, 4)))
    assert sh.shape == (10, 2)
    (seg,) = segments(sh)
    assert seg.box == ((10, 20), (2, 4))
    held = table[10:20, 2:4].copy()
    assert np.array_equal(extract(held, seg), table[10:20, 2:4])
    back = np.zeros_like(held)
    place(back, seg, table[10:20, 2:4])
    assert np.array_equal(back, held)
    acc = Sharding((30,), box=((5, 9),))
    assert [s.box for s in segments(acc)] == [((5, 9),)]


class _One:
    """A communicator of one rank (the lookup's all-to-alls short-circuit)."""

    def Get_size(self):  # noqa: N802 - mpi4py's name
        return 1

    def Get_rank(self):  # noqa: N802
        return 0


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_a_sharded_bag_on_one_rank_is_the_embedding_bag(pooling):
    rng = np.random.default_rng(0)
    W = rng.standard_normal((12, 4))
    ids = rng.integers(0, 12, (6, 3))
    ids[rng.random(ids.shape) < 0.3] = -1
    ids[1] = -1
    ref = EmbeddingBag(W.copy(), pooling=pooling, name="t")
    bag = ShardedBag(Placement("t", "table", 12, 4, (Shard(0, (0, 12), (0, 4)),)), W,
                     pooling=pooling, comm=_One())
    y, cache = bag.forward(ids)
    want, want_cache = ref.forward(ids)
    np.testing.assert_allclose(y, want, rtol=1e-14, atol=1e-15)
    dy = rng.standard_normal(y.shape)
    bag.backward(dy, cache)
    ref.backward(dy, want_cache)
    assert np.array_equal(bag.weight.grad.rows, ref.weight.grad.rows)
    np.testing.assert_allclose(bag.weight.grad.values, ref.weight.grad.values, rtol=1e-14)
    with pytest.raises(ValueError, match=r"table 't'.*\[0, 12\).*\[12\]"):
        bag.forward(np.array([[3], [12]]))


def test_an_id_beyond_its_table_is_refused_where_the_ratings_are_read(ratings_h5):
    r = read_ratings(ratings_h5)
    name, rows = r.features[0].name, r.features[0].rows
    with h5py.File(ratings_h5, "r+") as f:
        ids = f["ratings/ids"][...]
        ids[7, 0] = rows + 3
        f["ratings/ids"][...] = ids
    with pytest.raises(DataError, match=rf"feature '{name}' \(table of {rows} rows\): ids "
                                        rf"must lie in \[0, {rows}\).*\[{rows + 3}\]"):
        read_ratings(ratings_h5)
