"""Rank arithmetic of the 3-D grid, without MPI, over every factorisation of 1..16."""

import pytest

from hpctrain.parallel.topology import GridShape, group_by_node


def factorisations(n):
    return [(dp, tp, n // (dp * tp)) for dp in range(1, n + 1) for tp in range(1, n + 1)
            if n % (dp * tp) == 0]


ALL_SHAPES = [GridShape(dp, tp, pp) for n in range(1, 17) for dp, tp, pp in factorisations(n)]


@pytest.mark.parametrize("shape", ALL_SHAPES, ids=lambda s: f"dp{s.dp}-tp{s.tp}-pp{s.pp}")
def test_coords_round_trip_and_groups_partition_the_world(shape):
    n = shape.world_size
    assert sorted(shape.rank_of(*shape.coords(r)) for r in range(n)) == list(range(n))
    for axis, size in (("tp", shape.tp), ("dp", shape.dp), ("pp", shape.pp),
                       ("model", shape.tp * shape.pp)):
        groups = {tuple(shape.group_ranks(r, axis)) for r in range(n)}
        members = sorted(r for g in groups for r in g)
        assert members == list(range(n)), f"{axis} groups must partition the ranks"
        assert all(len(g) == size for g in groups)
        for r in range(n):
            assert r in shape.group_ranks(r, axis)


@pytest.mark.parametrize("shape", ALL_SHAPES, ids=lambda s: f"dp{s.dp}-tp{s.tp}-pp{s.pp}")
def test_tensor_innermost_then_data_then_pipeline(shape):
    for r in range(shape.world_size):
        pp, dp, tp = shape.coords(r)
        assert r == pp * shape.dp * shape.tp + dp * shape.tp + tp
        # a tensor group is a run of consecutive ranks: it fits inside one node
        group = shape.group_ranks(r, "tp")
        assert group == list(range(group[0], group[0] + shape.tp))
        # ranks in one group differ only along that group's axis
        for axis, index in (("tp", 2), ("dp", 1), ("pp", 0)):
            for i, other in enumerate(shape.group_ranks(r, axis)):
                c = shape.coords(other)
                assert c[index] == i
                assert [v for k, v in enumerate(c) if k != index] == \
                       [v for k, v in enumerate((pp, dp, tp)) if k != index]


def test_eight_rank_table_of_the_docstring():
    shape = GridShape(dp=2, tp=2, pp=2)
    assert [tuple(shape.coords(r)) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert shape.group_ranks(5, "tp") == [4, 5]
    assert shape.group_ranks(5, "dp") == [5, 7]
    assert shape.group_ranks(5, "pp") == [1, 5]
    assert shape.group_ranks(5, "model") == [0, 1, 4, 5]
    # the table drawn in the module docstring is the one the arithmetic gives
    import re

    import hpctrain.parallel.topology as topology

    rows = re.findall(r"^\s+(\d)\s+\|\s+(\d)\s+(\d)\s+(\d) \|\s+(\[.*?\])\s+(\[.*?\])\s+(\[.*?\])",
                      topology.__doc__, flags=re.M)
    assert len(rows) == 8
    for r, pp, dp, tp, tpg, dpg, ppg in rows:
        r = int(r)
        assert shape.coords(r) == (int(pp), int(dp), int(tp))
        assert [str(shape.group_ranks(r, a)) for a in ("tp", "dp", "pp")] == [tpg, dpg, ppg]


@pytest.mark.parametrize("bad", [(-1, "rank"), (8, "rank")])
def test_out_of_range_rank_is_refused(bad):
    with pytest.raises(ValueError, match=r"rank \((-1|8)\) must be in \[0, 8\)"):
        GridShape(2, 2, 2).coords(bad[0])


def test_unknown_axis_is_refused():
    with pytest.raises(ValueError, match="axis"):
        GridShape(1, 1, 1).group_ranks(0, "xx")


@pytest.mark.parametrize("node_ids, want", [
    ([0, 0, 2, 2, 4, 4, 6, 6], ((0, 1), (2, 3), (4, 5), (6, 7))),  # blocks of 2
    ([0, 1, 0, 1, 0, 1], ((0, 2, 4), (1, 3, 5))),  # cyclic over 2 nodes
    ([5, 5, 5, 3], ((0, 1, 2), (3,))),  # uneven; ids need not be in order
    ([0, 1, 2], ((0,), (1,), (2,))),  # one per node
    ([7, 7, 7, 7], ((0, 1, 2, 3),)),  # one node
    ([0], ((0,),)),
])
def test_a_group_by_node_in_the_leaders_order(node_ids, want):
    assert group_by_node(node_ids) == want


@pytest.mark.parametrize("seed", range(10))
def test_group_by_node_partitions_the_group(seed):
    import numpy as np

    ids = np.random.default_rng(seed).integers(0, 4, 12).tolist()
    nodes = group_by_node(ids)
    assert sorted(d for node in nodes for d in node) == list(range(12))
    assert [node[0] for node in nodes] == sorted(node[0] for node in nodes)
    for node in nodes:
        assert list(node) == sorted(node) and len({ids[d] for d in node}) == 1
