"""The cluster description: every rule refused by name, and to_toml read back."""

import copy
import tomllib

import pytest

from hpctrain.plan import cluster as cl


def valid() -> dict:
    link = {"latency_s": 2e-5, "bandwidth_Bps": 4e9}
    return {
        "name": "box", "launcher": "mpiexec",
        "kinds": [{"name": "cpu", "cores": 2, "memory_gib": 24.0,
                   "gemm": {"1": [[128, 6e10], [512, 1.4e11]], "2": [[128, 3.5e10]]}}],
        "nodes": [{"kind": "cpu", "count": 2}],
        "links": {level: {op: dict(link) for op in cl.OPS} for level in cl.LEVELS},
    }


def broken(edit) -> dict:
    raw = copy.deepcopy(valid())
    edit(raw)
    return raw


def test_a_valid_description_reads_and_round_trips_through_toml():
    c = cl.from_dict(valid())
    assert c.num_nodes == 2 and c.kinds["cpu"].gemm[1] == ((128, 6e10), (512, 1.4e11))
    again = cl.from_dict(tomllib.loads(cl.to_toml(c)))
    assert again == c


def test_names_with_quotes_round_trip_through_toml():
    # name = "Bob"s lab" was written, which TOML cannot read
    raw = valid()
    raw["name"], raw["launcher"] = "Bob's \"lab\"", "srun --mpi=pmix"
    raw["kinds"][0]["name"] = raw["nodes"][0]["kind"] = 'cpu "fast"'
    c = cl.from_dict(raw)
    assert cl.from_dict(tomllib.loads(cl.to_toml(c))) == c


@pytest.mark.parametrize(("edit", "message"), [
    (lambda r: r["kinds"][0].pop("cores"), "kinds[0]: missing field 'cores'"),
    (lambda r: r["links"]["inter"].pop("p2p"), "links.inter: missing field 'p2p'"),
    (lambda r: r["links"]["intra"]["all_gather"].pop("latency_s"),
     "links.intra.all_gather: missing field 'latency_s'"),
    (lambda r: r.pop("links"), "missing field 'links'"),
])
def test_a_missing_field_is_named(edit, message):
    with pytest.raises(cl.ClusterError, match=message.replace("[", r"\[").replace("]", r"\]")):
        cl.from_dict(broken(edit))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda r: r["links"]["intra"]["all_reduce"].update(bandwidth_Bps=-1e9),
     "links.intra.all_reduce.bandwidth_Bps (-1000000000.0) must be positive"),
    (lambda r: r["links"]["inter"]["p2p"].update(latency_s=-1e-6),
     "links.inter.p2p.latency_s (-1e-06) must not be negative"),
    (lambda r: r["kinds"][0].update(memory_gib=0), "kinds[0].memory_gib (0) must be positive"),
])
def test_a_negative_number_is_named(edit, message):
    with pytest.raises(cl.ClusterError) as err:
        cl.from_dict(broken(edit))
    assert message in str(err.value)


def test_an_unknown_kind_or_field_is_named():
    with pytest.raises(cl.ClusterError,
                       match=r"nodes\[0\].kind \('gpu'\) must be one of \['cpu'\]"):
        cl.from_dict(broken(lambda r: r["nodes"][0].update(kind="gpu")))
    with pytest.raises(cl.ClusterError, match=r"unknown field\(s\) \['broadcast'\]"):
        cl.from_dict(broken(lambda r: r["links"]["intra"].update(broadcast={})))


def test_the_source_prefixes_every_message():
    with pytest.raises(cl.ClusterError, match=r"^here.toml: kinds\[0\]: missing field 'gemm'"):
        cl.from_dict(broken(lambda r: r["kinds"][0].pop("gemm")), source="here.toml")


def test_the_gemm_rate_interpolates_in_log_size_and_picks_the_ranks_table():
    kind = cl.from_dict(valid()).kinds["cpu"]
    assert kind.gemm_rate(1, 128, 128, 128) == pytest.approx(6e10)
    assert kind.gemm_rate(1, 256, 256, 256) == pytest.approx(1e11)  # halfway in log n
    assert kind.gemm_rate(1, 4096, 4096, 4096) == pytest.approx(1.4e11)  # flat beyond
    assert kind.gemm_rate(1, 64, 64, 64) == pytest.approx(3e10)  # latency-bound below
    assert kind.gemm_rate(2, 512, 512, 512) == pytest.approx(3.5e10)  # the 2-rank table
    assert kind.gemm_rate(3, 512, 512, 512) == pytest.approx(3.5e10)  # none at 3: the last


def test_pieces_pick_the_range_of_the_message_and_read_back():
    raw = valid()
    raw["links"]["intra"]["all_reduce"] = [
        {"upto_bytes": 1024, "latency_s": 1e-6, "bandwidth_Bps": 1e9},
        {"latency_s": -1e-5, "bandwidth_Bps": 5e8}]
    c = cl.from_dict(raw)
    link = c.links["intra"]["all_reduce"]
    # p = 2: 2 steps of latency, 2 (p - 1) / p n = n bytes sent
    assert link.time("all_reduce", 2, 1024) == pytest.approx(2e-6 + 1024 / 1e9)
    assert link.time("all_reduce", 2, 2**20) == pytest.approx(-2e-5 + 2**20 / 5e8)
    # just above the cut the second line would give less than the first's last time:
    # the time never falls below the largest message of the range before
    assert link.time("all_reduce", 2, 1025) == pytest.approx(2e-6 + 1024 / 1e9)
    again = cl.from_dict(tomllib.loads(cl.to_toml(c)))
    assert again.links["intra"]["all_reduce"] == link
    assert again == c


@pytest.mark.parametrize(("ranges", "message"), [
    ([{"latency_s": -1e-6, "bandwidth_Bps": 1e9, "upto_bytes": 10},
      {"latency_s": 0.0, "bandwidth_Bps": 1e9}],
     "all_reduce[0].latency_s (-1e-06) must not be negative"),
    ([{"upto_bytes": 10, "latency_s": 0.0, "bandwidth_Bps": 1e9},
      {"upto_bytes": 5, "latency_s": 0.0, "bandwidth_Bps": 1e9},
      {"latency_s": 0.0, "bandwidth_Bps": 1e9}],
     "all_reduce[1].upto_bytes (5) must be larger than the range before's (10)"),
    ([{"upto_bytes": 10, "latency_s": 0.0, "bandwidth_Bps": 1e9}],
     "all_reduce[0]: the last range must have no upto_bytes"),
    ([{"latency_s": 0.0, "bandwidth_Bps": 1e9}, {"latency_s": 0.0, "bandwidth_Bps": 1e9}],
     "all_reduce[0]: missing field 'upto_bytes'"),
])
def test_bad_ranges_are_named(ranges, message):
    with pytest.raises(cl.ClusterError) as err:
        cl.from_dict(broken(lambda r: r["links"]["intra"].update(all_reduce=ranges)))
    assert message in str(err.value)


def test_the_roofline_kind_reads_and_bounds_small_products():
    raw = valid()
    raw["kinds"][0] = {"name": "gpu", "cores": 8, "memory_gib": 80.0, "peak_flops": 1e14,
                       "gemm_efficiency": 0.5, "stream": {"8": 1e12}}
    raw["nodes"][0]["kind"] = "gpu"
    kind = cl.from_dict(raw).kinds["gpu"]
    assert kind.peak_rate(8) == 1e14  # MFU's denominator: the published peak
    assert kind.gemm_rate(8, 4096, 4096, 4096) == pytest.approx(5e13)
    # 64^3: 2 * 64^3 FLOPs against 3 * 64^2 * 2 bytes at 1e12 B/s: memory-bound
    assert kind.gemm_rate(8, 64, 64, 64) == pytest.approx(2 * 64**3 / (6 * 64**2 / 1e12))
    assert cl.from_dict(tomllib.loads(cl.to_toml(cl.from_dict(raw)))).kinds["gpu"] == kind
    raw["kinds"][0]["gemm_efficiency"] = 1.5
    with pytest.raises(cl.ClusterError, match=r"gemm_efficiency \(1.5\) must be at most 1"):
        cl.from_dict(raw)
    raw["kinds"][0].pop("gemm_efficiency")
    with pytest.raises(cl.ClusterError, match="missing field 'gemm_efficiency'"):
        cl.from_dict(raw)


def test_the_cached_table_reads_round_trips_and_rates_only_cached_products():
    raw = broken(lambda r: r["kinds"][0].update(gemm_cached={"1": [[128, 9e10], [512, 1.6e11]]}))
    c = cl.from_dict(raw)
    kind = c.kinds["cpu"]
    assert kind.gemm_cached == {1: ((128, 9e10), (512, 1.6e11))}
    assert kind.gemm_rate(1, 128, 128, 128, cached=True) == pytest.approx(9e10)
    assert kind.gemm_rate(1, 128, 128, 128) == pytest.approx(6e10)  # from memory: gemm
    assert cl.from_dict(tomllib.loads(cl.to_toml(c))) == c
    plain = cl.from_dict(valid()).kinds["cpu"]  # no cached table: gemm for both
    assert plain.gemm_cached is None
    assert plain.gemm_rate(1, 128, 128, 128, cached=True) == pytest.approx(6e10)
    assert "gemm_cached" not in cl.to_toml(cl.from_dict(valid()))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda r: r["kinds"][0].update(gemm_cached=[]),
     "kinds[0].gemm_cached ([]) must be a table: ranks per node -> [[n, FLOP/s], ...]"),
    (lambda r: r["kinds"][0].update(gemm_cached={"1": [[128, -5e10]]}),
     "kinds[0].gemm_cached.1[0][1] (-50000000000.0) must be positive"),
    (lambda r: r["kinds"][0].update(gemm_cached={"x": [[128, 5e10]]}),
     "kinds[0].gemm_cached key 'x' must be a ranks-per-node count"),
    (lambda r: (r["kinds"][0].pop("gemm"),
                r["kinds"][0].update(peak_flops=1e12, gemm_efficiency=0.8,
                                     gemm_cached={"1": [[128, 5e10]]})),
     "kinds[0]: gemm_cached goes with a gemm table, not with peak_flops"),
])
def test_a_bad_cached_table_is_named(edit, message):
    with pytest.raises(cl.ClusterError) as err:
        cl.from_dict(broken(edit))
    assert message in str(err.value)


def _set(path, value):
    """An edit setting raw[path[0]][path[1]]... = value."""
    def edit(raw):
        at = raw
        for key in path[:-1]:
            at = at[key]
        at[path[-1]] = value
    return edit


@pytest.mark.parametrize(("edit", "message"), [
    # tables that are not tables
    (_set(["links"], 5), "links (5) must be a table with the fields ['inter', 'intra']"),
    (_set(["links", "intra"], 5), "links.intra (5) must be a table with the fields"),
    (_set(["nodes"], [1]), "nodes[0] (1) must be a table with the fields ['count', 'kind']"),
    (_set(["kinds"], [1]), "kinds[0] (1) must be a table with the fields"),
    (_set(["kinds"], 5), "kinds (5) must list one or more node kinds"),
    (_set(["nodes"], []), "nodes ([]) must list one or more groups of nodes"),
    # ranks-per-node keys and GEMM sizes
    (_set(["kinds", 0, "stream"], {"eight": 4e9}),
     "kinds[0].stream key 'eight' must be a ranks-per-node count (a positive integer"),
    (_set(["kinds", 0, "stream"], {"0": 4e9}), "kinds[0].stream key '0' must be a ranks"),
    # "01" stood beside "1" and the last one read won, unseen
    (_set(["kinds", 0, "stream"], {"1": 4e9, "01": 5e9}),
     "kinds[0].stream key '01' must be a ranks-per-node count (a positive integer written "
     "plainly"),
    (_set(["kinds", 0, "gemm"], {" 1": [[128, 6e10]]}), "kinds[0].gemm key ' 1' must be"),
    (_set(["kinds", 0, "gemm"], {"1": [[0.5, 2e10], [512, 4e10]]}),
     "kinds[0].gemm.1[0][0] (0.5) must be a positive integer (n of an n x n x n product)"),
    (_set(["kinds", 0, "gemm"], {"1": [[0, 2e10]]}), "kinds[0].gemm.1[0][0] (0) must be a"),
    (_set(["kinds", 0, "gemm"], {"1": [[128, 2e10], [128, 3e10]]}),
     "kinds[0].gemm.1[1]: n (128) is listed twice"),
    (_set(["kinds", 0, "gemm"], {"-1": [[128, 2e10]]}), "kinds[0].gemm key '-1' must be a"),
    # numbers: finite, and a bool is no number or count
    (_set(["links", "intra", "all_reduce", "latency_s"], float("nan")),
     "links.intra.all_reduce.latency_s (nan) must be a finite number"),
    (_set(["links", "inter", "p2p", "bandwidth_Bps"], float("inf")),
     "links.inter.p2p.bandwidth_Bps (inf) must be a finite number"),
    (_set(["kinds", 0, "memory_gib"], float("nan")), "kinds[0].memory_gib (nan) must be a finite"),
    (_set(["kinds", 0, "gemm"], {"1": [[128, float("inf")]]}),
     "kinds[0].gemm.1[0][1] (inf) must be a finite number"),
    (_set(["kinds", 0, "cores"], True), "kinds[0].cores (true) must be a positive integer"),
    (_set(["kinds", 0, "cores"], 2.0), "kinds[0].cores (2.0) must be a positive integer"),
    (_set(["nodes", 0, "count"], True), "nodes[0].count (true) must be a positive integer"),
    (_set(["kinds", 0, "memory_gib"], True), "kinds[0].memory_gib (true) must be a number"),
    (_set(["kinds", 0, "comm_slowdown"], float("nan")),
     "kinds[0].comm_slowdown (nan) must be a finite number"),
    (_set(["kinds", 0, "compute_slowdown"], 0.5),
     "kinds[0].compute_slowdown (0.5) must be 1 or more"),
    # a field of an older description, named with what replaced it
    (_set(["kinds", 0, "comm_overlap"], 0.9),
     "kinds[0]: comm_overlap was replaced by comm_slowdown and compute_slowdown"),
    # names
    (_set(["kinds", 0, "name"], 5), "kinds[0].name (5) must be a non-empty string"),
    (_set(["nodes", 0, "kind"], ["cpu"]),
     "nodes[0].kind (['cpu']) must be a string naming a kind, one of ['cpu']"),
    (_set(["name"], 3), "name (3) must be a non-empty string"),
])
def test_a_malformed_field_is_named_with_its_value_and_rule(edit, message):
    with pytest.raises(cl.ClusterError) as err:
        cl.from_dict(broken(edit), source="x.toml")
    assert str(err.value).startswith(f"x.toml: {message}")


def test_a_malformed_roofline_gemm_bytes_is_named():
    raw = valid()
    raw["kinds"][0] = {"name": "cpu", "cores": 8, "memory_gib": 80.0, "peak_flops": 1e14,
                       "gemm_efficiency": 0.5, "gemm_bytes": 0.5}
    with pytest.raises(cl.ClusterError, match=r"gemm_bytes \(0.5\) must be a positive integer"):
        cl.from_dict(raw)


def test_the_source_is_named_once():
    with pytest.raises(cl.ClusterError) as err:
        cl.from_dict({}, source="empty.toml")
    assert str(err.value) == "empty.toml: missing field 'kinds'"
    with pytest.raises(cl.ClusterError) as err:
        cl.from_dict(broken(lambda r: r.update(extra=1)), source="x.toml")
    assert str(err.value).startswith("x.toml: unknown field(s) ['extra']")
