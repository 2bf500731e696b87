"""The description of an emulated cluster (``hpctrain.plan.emulated``) from synthetic
measurements, the link check, and the cost model on one-core nodes: every group of
two or more ranks crosses the inter-node link."""

import click
import pytest

from hpctrain import config
from hpctrain.plan import cluster as cl
from hpctrain.plan import cost, emulated
from hpctrain.plan.calibrate import Sample

TINY = dict(kind="gpt", n_layer=2, d_model=16, n_head=4, seq_len=8, vocab_size=32)


@pytest.mark.parametrize("text, want", [("2:1gbit", (2, "1gbit")), ("4:100mbit", (4, "100mbit")),
                                        (" 3 :1gbit", (3, "1gbit"))])
def test_nodes_and_link_are_parsed(text, want):
    assert emulated.parse(text) == want


@pytest.mark.parametrize("text, message", [
    ("2", "must be NODES:LINK"), ("two:1gbit", "must be NODES:LINK"),
    ("1:1gbit", "nodes (1) must be between 2 and 16"),
    ("2:fast", "link ('fast') must be a positive rate")])
def test_bad_nodes_and_links_are_refused_by_name(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        emulated.parse(text)


def measured(nodes=4):
    """Exact ring-model times of a 1 ms, 100 MB/s link over p = 2 and 4."""
    link = cl.Link(1e-3, 1e8)
    samples = [Sample(op, 2 if op == "p2p" else p, n, link.time(op, 2 if op == "p2p" else p, n))
               for op in cl.OPS for p in (2, nodes) for n in (1 << 10, 1 << 16, 1 << 20)]
    return emulated.Measured(nodes, "1gbit", {64: [1e10, 3e10, 2e10, 5e10], 512: [4e10] * 4},
                             [1e9, 4e9, 2e9, 3e9], samples, [(4, 1e6, 1_100_000)], 8 * 2**30)


def test_the_description_has_one_core_nodes_and_the_fitted_inter_links():
    c, report = emulated.describe(measured())
    kind = c.kinds["node"]
    assert (kind.cores, c.num_nodes, c.name) == (1, 4, "emulated-4x1gbit")
    assert kind.memory_bytes == 2 * 2**30  # the machine's 8 GiB over 4 nodes
    assert kind.gemm == {1: ((64, 2.5e10), (512, 4e10))}  # the median rank of each n
    assert kind.stream == {1: 2.5e9}
    for op in cl.OPS:
        line = c.links["inter"][op]
        assert line.latency_s == pytest.approx(1e-3) and line.bandwidth_Bps == pytest.approx(1e8)
        assert c.links["intra"][op] == line
    assert len(report) == 4 + len(measured().samples)  # a head line per op, a line per sample
    back = cl.from_dict(__import__("tomllib").loads(cl.to_toml(c)))
    assert back.kinds["node"].gemm == kind.gemm and back.nodes == (("node", 4),)
    assert kind.gemm_cached is None  # none measured: none described
    cached = emulated.Measured(**{**measured().__dict__,
                                  "gemm_cached": {64: [3e10, 1e10, 2e10, 6e10]}})
    kind = emulated.describe(cached)[0].kinds["node"]
    assert kind.gemm_cached == {1: ((64, 2.5e10),)}


def test_traffic_that_missed_the_link_is_an_error():
    lines = emulated.check_on_link([(2, 1e6, 1_040_000), (4, 2e6, 1_800_000)])
    assert "1.04x" in lines[0] and "0.90x" in lines[1]
    with pytest.raises(click.ClickException, match="did not cross the shaped link"):
        emulated.check_on_link([(2, 1e6, 1_040_000), (4, 2e6, 1_000_000)])


def one_core_nodes(nodes, inter_bandwidth=1.0, intra_bandwidth=1e12, **extra):
    """``nodes`` one-core nodes: the inter link 1 B/s, no latency (times are bytes)."""
    kind = {"name": "node", "cores": 1, "memory_gib": 4.0,
            "gemm": {"1": [[64, 1e10], [2048, 5e10]]}, "stream": {"1": 5e9}, **extra}
    ops = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
    links = {lvl: dict.fromkeys(ops, {"latency_s": 0.0, "bandwidth_Bps": bw})
             for lvl, bw in (("intra", intra_bandwidth), ("inter", inter_bandwidth))}
    return cl.from_dict({"kinds": [kind], "nodes": [{"kind": "node", "count": nodes}],
                         "links": links})


def make(world, **parallel):
    return config.from_dict({"model": TINY, "parallel": parallel,
                             "train": {"batch_size": 4}}).validate(world)


def test_tensor_parallel_across_one_core_nodes_is_priced_on_the_inter_link():
    # b = 4 sequences of T = 8, C = 16, float32: a 2 KiB activation; per step 2 all-reduces
    # a block forward and 2 backward, 1 at the embedding and 1 at the head: 4 L + 2 = 10
    e = cost.estimate(make(2, tp=2), one_core_nodes(2))
    activation = 4 * 4 * 8 * 16
    assert e.ranks_per_node == 1
    assert e.ranks[0].time["tp"] == pytest.approx(10 * activation)  # 2 (p-1)/p = 1 at p = 2


def test_data_and_pipeline_groups_of_one_core_nodes_cross_the_link():
    # tp2 x dp2 on 4 nodes: the gradient ring over the data group is inter-node; pp2 x dp2:
    # the stage-to-stage message is too (b = 2 sequences: 1 KiB)
    e = cost.estimate(make(4, tp=2, dp=2, bucket_mb=64.0), one_core_nodes(4))
    grads = e.ranks[0].memory.grads
    assert e.ranks[0].time["dp"] == pytest.approx(grads)  # 2 (2-1)/2 x grads at 1 B/s
    p = cost.estimate(make(4, pp=2, dp=2, microbatches=1), one_core_nodes(4))
    assert p.ranks[0].time["p2p"] == pytest.approx(2 * 8 * 16 * 4)


def test_the_search_runs_on_one_core_nodes_one_rank_each():
    from hpctrain.plan.search import _scope, enumerate_layouts

    cfg = make(1)
    c, worlds = _scope(one_core_nodes(4, inter_bandwidth=1e8), None, 4)
    assert worlds == [4]
    found = enumerate_layouts(cfg, c, worlds[0])
    assert found.ranked and all(e.ranks_per_node == 1 for e in found.ranked)


def test_the_slowdowns_of_a_sum_beside_compute_are_described_and_priced():
    """comm_slowdown and compute_slowdown: read, TOML round-trips them, and the cost
    model uses them for a sum across nodes: 1 and 1 (the default) price the sum as if
    the node had an adapter of its own; slower sums and slower compute expose more, and
    the sum after the backward (no overlap) bounds a sum that is only slowed."""
    from dataclasses import replace

    c, _ = emulated.describe(measured())
    kind = c.kinds["node"]
    assert (kind.comm_slowdown, kind.compute_slowdown) == (1.0, 1.0)  # none measured
    c = replace(c, kinds={"node": replace(kind, comm_slowdown=2.5, compute_slowdown=1.3)})
    back = cl.from_dict(__import__("tomllib").loads(cl.to_toml(c)))
    assert (back.kinds["node"].comm_slowdown, back.kinds["node"].compute_slowdown) == (2.5, 1.3)

    cfg = make(2, dp=2, bucket_mb=0.001)  # tiny buckets, ready through the backward;
    # at 100 MB/s their sum alone about as long as the compute

    def dp(**slow):
        e = cost.estimate(cfg, one_core_nodes(2, inter_bandwidth=1e8, **slow))
        return e.ranks[0].time["dp"]

    free = dp()
    assert dp(comm_slowdown=2.0) > free and dp(compute_slowdown=1.5) > free
    assert dp(comm_slowdown=3.0) > dp(comm_slowdown=2.0)
    after = cost.estimate(cfg, one_core_nodes(2, inter_bandwidth=1e8),
                          practice=cost.Practice(dp_overlap=False)).ranks[0].time["dp"]
    assert free < dp(comm_slowdown=1e6) <= after * (1 + 1e-9)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("comm_slowdown", 0.5, "comm_slowdown (0.5) must be 1 or more"),
    ("compute_slowdown", -1, "compute_slowdown (-1) must be positive"),
    ("comm_slowdown", "fast", "comm_slowdown ('fast') must be a number"),
    ("compute_slowdown", True, "compute_slowdown (true) must be a number"),
    ("comm_slowdown", {"2": 0.9}, "comm_slowdown.2 (0.9) must be 1 or more"),
    ("comm_slowdown", {"1": 2.0}, "comm_slowdown key '1' must be the nodes a data group "
                                  "spans"),
    ("comm_slowdown", {"02": 2.0}, "comm_slowdown key '02' must be"),
    ("compute_slowdown", {}, "compute_slowdown ({}) must be a number or a table"),
    ("comm_slowdown", [4.5, 2.9], "comm_slowdown ([4.5, 2.9]) must be a number or a table"),
    ("comm_slowdown", {"\u00b2": 2.0}, "comm_slowdown key '\u00b2' must be the nodes")])
def test_a_bad_slowdown_is_named(field, value, message):
    with pytest.raises(cl.ClusterError) as err:
        one_core_nodes(2, **{field: value})
    assert f"kinds[0].{message}" in str(err.value)


def test_the_slowdowns_are_read_off_the_sum_beside_the_products():
    """A sum of 0.4 s alone that ends 1.0 s into the loop beside it (2.5 x), the loop
    taking 2.2 s against 2.0 alone: 0.2 s lost in the 1.0 s the sum ran, so the compute
    ran at 0.8 of its rate (1.25 x). Never below 1; a sum that did not end inside the
    loop, or a loss longer than the sum, is an error naming the values. describe puts
    both on the node kind, the report says so, or why it could not."""
    from hpctrain.plan import overlap

    base = {"compute_s": 2.0, "comm_s": 0.4, "nbytes": 4e6, "buckets": 4.0, "ranks": 4.0}
    assert overlap.slowdowns({**base, "done_s": 1.0, "both_s": 2.2}) == \
        pytest.approx((2.5, 1.25))
    assert overlap.slowdowns({**base, "done_s": 0.3, "both_s": 1.9}) == (1.0, 1.0)
    with pytest.raises(ValueError, match=r"did not end inside it \(done_s inf"):
        overlap.slowdowns({**base, "done_s": float("inf"), "both_s": 2.2})
    with pytest.raises(ValueError, match=r"lost 1.500 s beside a sum that ran 1.000 s"):
        overlap.slowdowns({**base, "done_s": 1.0, "both_s": 3.5})
    m = emulated.Measured(**{**measured().__dict__,
                             "overlap": {4: {**base, "done_s": 1.0, "both_s": 2.2}}})
    c, report = emulated.describe(m)
    kind = c.kinds["node"]
    assert (kind.comm_slowdown, kind.compute_slowdown) == pytest.approx((2.5, 1.25))
    assert any("groups of 4 nodes" in line and "(comm_slowdown)" in line
               and "(compute_slowdown)" in line for line in report)
    # two group sizes: a table by the nodes a group spans, read back from the TOML
    m = emulated.Measured(**{**measured().__dict__, "overlap": {
        4: {**base, "done_s": 1.0, "both_s": 2.2},
        2: {**base, "comm_s": 0.2, "done_s": 0.8, "both_s": 2.4}}})
    c, report = emulated.describe(m)
    back = cl.from_dict(__import__("tomllib").loads(cl.to_toml(c))).kinds["node"]
    assert back.comm_slowdown == pytest.approx({2: 4.0, 4: 2.5}, abs=1e-3)
    assert back.compute_slowdown == pytest.approx({2: 2.0, 4: 1.25}, abs=1e-3)
    assert back.slowdowns(2) == pytest.approx((4.0, 2.0), abs=1e-3)
    # a sum that never ended inside the loop: the rest of the description stands, the
    # slowdowns at 1, and the report says why
    never = {**base, "done_s": float("inf"), "both_s": 2.2}
    m = emulated.Measured(**{**measured().__dict__, "overlap": {4: never}})
    c, report = emulated.describe(m)
    assert (c.kinds["node"].comm_slowdown, c.kinds["node"].compute_slowdown) == (1.0, 1.0)
    assert any("were not measured (groups of 4: the sum beside the compute did not end "
               "inside it" in line and "(1 and 1)" in line for line in report)
    # one size of two unread: the other prices every group, and the report says so
    m = emulated.Measured(**{**measured().__dict__, "overlap": {
        4: never, 2: {**base, "done_s": 1.0, "both_s": 2.2}}})
    c, report = emulated.describe(m)
    assert (c.kinds["node"].comm_slowdown, c.kinds["node"].compute_slowdown) == \
        pytest.approx((2.5, 1.25))
    assert any("not measured (groups of 4:" in line and "at the sizes measured (2)" in line
               for line in report)


def test_a_slowdown_table_is_read_at_the_nodes_a_data_group_spans():
    """A table by group size: the nearest measured size in ratio (the larger on a tie);
    the cost model reads it at the nodes the rank's data group spans, so on four nodes
    dp 4 and tp 2 x dp 2 (data groups of 2 nodes) take different factors."""
    kind = one_core_nodes(4, comm_slowdown={"2": 4.0, "8": 2.0},
                          compute_slowdown=1.5).kinds["node"]
    assert [kind.slowdowns(n)[0] for n in (2, 3, 4, 5, 8, 64)] == [4.0, 4.0, 2.0, 2.0, 2.0, 2.0]
    assert kind.slowdowns(2)[1] == kind.slowdowns(8)[1] == 1.5
    assert cost.data_group_nodes(4, 1, 1, 1) == (4,)
    assert cost.data_group_nodes(2, 2, 1, 1) == (2,)  # tensor rank t: t, t + 2
    assert cost.data_group_nodes(2, 1, 2, 1) == (2, 2)
    assert cost.data_group_nodes(4, 1, 1, 2) == (2,)  # two ranks a node
    assert cost.data_group_nodes(4, 2, 1, 4) == (2,)

    def dp_s(layout, slow):
        cfg = make(4, **layout, bucket_mb=0.001)
        c = one_core_nodes(4, inter_bandwidth=1e8, comm_slowdown=slow)
        return cost.estimate(cfg, c).ranks[0].time["dp"]

    table = {"2": 4.0, "4": 1.0}
    assert dp_s({"dp": 4}, table) == dp_s({"dp": 4}, 1.0)  # read at 4
    assert dp_s({"dp": 2, "tp": 2}, table) == dp_s({"dp": 2, "tp": 2}, 4.0)  # at 2
    assert dp_s({"dp": 2, "tp": 2}, table) > dp_s({"dp": 2, "tp": 2}, 1.0)
