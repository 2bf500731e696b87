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
