"""``bench_plan.py measure --rounds``: where each round's run goes, and how ``compare``
reads a layout's step time back from the rounds there are."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench_plan():
    spec = importlib.util.spec_from_file_location("bench_plan",
                                                  ROOT / "benchmarks" / "bench_plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_run(folder: Path, records: list[dict]) -> None:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def timed(times: list[float]) -> list[dict]:
    return [{"step": k + 1, "loss": 1.0, "step_time_s": t} for k, t in enumerate(times)]


def test_each_round_has_its_own_run_folder(bench_plan, tmp_path):
    out = str(tmp_path)
    assert bench_plan.run_dir_of(out, "dp2", "time") == tmp_path / "dp2-time"
    assert bench_plan.run_dir_of(out, "dp2", "time", 1) == tmp_path / "dp2-time"
    assert bench_plan.run_dir_of(out, "dp2", "time", 3) == tmp_path / "dp2-time-r3"
    assert bench_plan.run_dir_of(out, "dp2", "memory") == tmp_path / "dp2-memory"


def test_the_step_time_is_the_median_of_the_rounds_medians(bench_plan, tmp_path):
    # warm-up steps (1, 2) left out of each round; round 2 is an outlier
    write_run(tmp_path / "dp2-time", timed([9.0, 9.0, 1.0, 1.2, 1.1]))
    write_run(tmp_path / "dp2-time-r2", timed([9.0, 9.0, 5.0, 5.0, 5.0]))
    write_run(tmp_path / "dp2-time-r3", timed([9.0, 9.0, 1.3, 1.3, 1.4]))
    write_run(tmp_path / "dp2-memory", [
        {"step": s, "loss": 1.0, "peak_bytes_per_rank": [10 * s, 20 * s]} for s in (1, 2, 3)])
    step, peak, rounds = bench_plan.measured(str(tmp_path), "dp2", warmup=2)
    assert rounds == [1.1, 5.0, 1.3]
    assert step == 1.3
    assert peak == 60  # the largest rank's peak after the first step


def test_one_round_reads_as_before(bench_plan, tmp_path):
    write_run(tmp_path / "serial-time", timed([3.0, 3.0, 2.0, 4.0, 3.0]))
    write_run(tmp_path / "serial-memory", [{"step": 2, "loss": 1.0,
                                            "peak_bytes_per_rank": [7]}])
    assert bench_plan.measured(str(tmp_path), "serial", warmup=2) == (3.0, 7, [3.0])


def test_a_layout_never_timed_is_named(bench_plan, tmp_path):
    with pytest.raises(FileNotFoundError, match="no timed run of tp2"):
        bench_plan.measured(str(tmp_path), "tp2", warmup=2)


def test_rounds_below_one_are_refused_by_name(bench_plan, capsys):
    with pytest.raises(SystemExit):
        bench_plan.main(["measure", "--rounds", "0"])
    assert "--rounds (0) must be at least 1" in capsys.readouterr().err


def test_the_rounds_own_order_is_their_rank_correlation(bench_plan):
    """Three layouts in three rounds: rounds 1 and 2 order them alike (1), round 3 swaps
    the first two (0.5 against each); one round gives no line."""
    by_round = [[1.0, 1.1, 2.1], [2.0, 2.1, 1.9], [3.0, 3.1, 3.2]]
    line, = bench_plan.rounds_agreement(by_round)
    assert "between rounds 0.500 to 1.000 (3 pairs of 3 rounds)" in line
    two, = bench_plan.rounds_agreement([r[:2] for r in by_round])
    assert "between rounds 1.000 (1 pair of 2 rounds)" in two
    assert bench_plan.rounds_agreement([[1.0], [2.0], [3.0]]) == []


def test_compare_names_the_planners_own_choice_and_where_it_measured(bench_plan):
    """The planner ranks every valid layout; compare says which one it would choose and,
    if that layout was measured, its place among the measured ones."""
    from hpctrain.plan.cluster import load_cluster
    from hpctrain.plan.search import enumerate_layouts, layout_name

    cluster = load_cluster(ROOT / "configs" / "clusters" / "emulated-2x1gbit.toml")
    names = bench_plan.ON_NODES[2]
    chosen = layout_name(enumerate_layouts(bench_plan.layout_config("serial", 1, "/tmp/x"),
                                           cluster, 2).ranked[0].cfg.parallel)
    mine = [n for n in names
            if layout_name(bench_plan.layout_config(n, 1, "/tmp/x").parallel) == chosen]
    assert len(mine) == 1, (chosen, names)  # the set measured holds the planner's choice
    meas = [1.0 + i / 10 for i in range(len(names))]  # the first name measures fastest
    line = bench_plan.planner_choice(cluster, names, meas)
    place = names.index(mine[0]) + 1
    assert line.startswith("the planner's choice among all 37 valid layouts on 2 rank(s): "
                           f"{chosen} (")
    assert line.endswith(f" = {mine[0]}, measured {1e3 * meas[place - 1]:.0f} ms, {place} "
                         f"of {len(names)} measured, {10 * (place - 1):.1f}% slower than "
                         f"the measured best")
    others = [n for n in names if n != mine[0]]
    assert bench_plan.planner_choice(cluster, others, meas[:-1]).endswith("; not measured")


def test_drift_is_the_probed_rates_over_the_described_ones(bench_plan):
    """The probes of the layouts compared (one per layout and round) against the
    description's one-rank-a-node tables: per probe the GEMM factor is the geometric
    mean over the probed sizes, and the run's factors the medians over its probes; the
    scaled description predicts a compute-bound layout that much slower."""
    from dataclasses import replace

    from hpctrain.plan.cluster import load_cluster
    from hpctrain.plan.cost import estimate

    cluster = load_cluster(str(ROOT / "configs/clusters/emulated-2x1gbit.toml"))
    kind = next(iter(cluster.kinds.values()))
    table = dict(kind.gemm[1])
    sizes = bench_plan.PROBE_SIZES

    def probe(g: tuple[float, float], s: float) -> dict:
        return {"gemm": {str(n): f * table[n] for n, f in zip(sizes, g, strict=True)},
                "stream": s * kind.stream[1]}
    probes = {bench_plan.probe_tag("dp2", 1): probe((0.5, 0.8), 0.9),
              bench_plan.probe_tag("dp2", 2): probe((0.8, 0.8), 0.7),
              bench_plan.probe_tag("tp2", 1): probe((1.0, 1.0), 0.8),
              bench_plan.probe_tag("pp2-mb2-1f1b", 1): probe((3.0, 3.0), 3.0)}
    gemm, stream, count = bench_plan.drift(cluster, probes, ["dp2", "tp2"])
    assert count == 3  # pp2-mb2-1f1b's probe is not of the layouts compared
    assert gemm == pytest.approx(0.8)  # probes: sqrt(0.4) = 0.632, 0.8, 1.0
    assert stream == pytest.approx(0.8)
    assert bench_plan.drift(cluster, probes, ["pp2-mb2-1f1b"]) == pytest.approx((3, 3, 1))
    assert bench_plan.drift(cluster, probes, ["serial"]) is None  # never probed
    kinds = {n: replace(k, gemm={1: k.gemm[1][:3]}) for n, k in cluster.kinds.items()}
    assert bench_plan.drift(replace(cluster, kinds=kinds), probes, ["dp2"]) is None  # n <= 256

    slow = bench_plan.scaled(cluster, 0.5, 0.5)
    assert dict(next(iter(slow.kinds.values())).gemm[1])[1024] == table[1024] / 2
    cfg = bench_plan.layout_config("serial", 1, "/tmp/unused")
    one = bench_plan.first_nodes
    base, half = (estimate(cfg, one(c, 1)).step_s for c in (cluster, slow))
    assert half == pytest.approx(2 * base, rel=0.05)  # serial: compute and element-wise


def test_a_new_measurement_drops_the_probes_of_its_layouts(bench_plan, tmp_path):
    """Probes of an earlier run (other nodes, more rounds) of the layouts measured again
    are dropped; the other layouts' stay."""
    import json

    path = tmp_path / "probe.json"
    path.write_text(json.dumps({"dp2-r1": {}, "dp2-r3": {}, "tp2-r1": {}}))
    bench_plan.drop_probes(str(tmp_path), ["dp2"])
    assert json.loads(path.read_text()) == {"tp2-r1": {}}
    bench_plan.drop_probes(str(tmp_path / "none"), ["dp2"])  # no file: nothing to do
