"""The planner's search and the ``plan`` command: validity as ``Config.validate`` says,
pruning by memory, the 4,096-rank enumeration time, clear errors, --emit."""

import itertools
import shlex
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpctrain import config
from hpctrain.config import ConfigError
from hpctrain.plan import search
from hpctrain.plan.cluster import from_dict, to_toml
from hpctrain.plan.search import (
    divisors,
    enumerate_layouts,
    enumerate_over,
    layout_name,
    parse_layout,
    per_node_counts,
    plan,
    size,
)
from hpctrain.slurm.cli import render_cmd

TINY = dict(kind="gpt", n_layer=4, d_model=16, n_head=4, seq_len=8, vocab_size=32)


def hand_cluster(nodes=(("cpu", 1),), memory_gib=16.0, cores=8):
    link = {"latency_s": 1e-5, "bandwidth_Bps": 4e9}
    ops = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
    kinds = [{"name": name, "cores": cores, "memory_gib": memory_gib,
              "gemm": {str(cores): [[64, 1e10 * (1 + i)], [1024, 5e10 * (1 + i)]]},
              "stream": {str(cores): 5e9}}
             for i, name in enumerate(sorted({k for k, _ in nodes}))]
    return from_dict({"name": "hand", "kinds": kinds,
                      "nodes": [{"kind": k, "count": n} for k, n in nodes],
                      "links": {lvl: dict.fromkeys(ops, link) for lvl in ("intra", "inter")}})


def tiny_config(batch=8):
    return config.from_dict({"model": TINY, "train": {"batch_size": batch}})


def test_plan_proposes_exactly_the_layouts_validate_accepts():
    cfg, world = tiny_config(), 8
    found = enumerate_layouts(cfg, hand_cluster(), world)
    planned = {layout_name(e.cfg.parallel) for e in found.ranked}
    accepted = set()
    grid = itertools.product([1, 2, 4, 8], [1, 2, 4, 8], [1, 2, 4, 8], [1, 2, 4, 8],
                             ["gpipe", "1f1b", "interleaved"], [1, 2, 3], [0, 1, 2, 3],
                             [False, True])
    for dp, tp, pp, mb, schedule, v, zero, seq in grid:
        par = replace(cfg.parallel, dp=dp, tp=tp, pp=pp, microbatches=mb, schedule=schedule,
                      virtual_stages=v, zero=zero, sequence_parallel=seq)
        try:
            checked = replace(cfg, parallel=par).validate(world)
        except ConfigError:
            continue
        # the planner leaves out what changes nothing: sequence parallelism without tp,
        # gpipe without a pipeline (1f1b is the same), ZeRO without data parallelism
        if not (seq and tp == 1) and not (schedule == "gpipe" and pp == 1) \
                and not (zero and dp == 1):
            accepted.add(layout_name(checked.parallel))
    assert planned == accepted
    assert found.valid == len(found.ranked)  # 16 GiB: everything fits
    times = [e.step_s for e in found.ranked]
    assert times == sorted(times[:20]) + times[20:] and len(times) > 20


def test_plan_offers_the_batch_split_exactly_where_validate_accepts_it():
    # two ranks on one 8-core node: 4 threads a rank, over which a rank running the
    # whole model may split its batch (tp = pp = 1, at least 2 rows a microbatch)
    cfg, world = tiny_config(), 2
    found = enumerate_layouts(cfg, hand_cluster(), world)
    planned = {layout_name(e.cfg.parallel) for e in found.ranked if e.cfg.parallel.tp
               == e.cfg.parallel.pp == 1}
    accepted = set()
    for dp, mb, zero, bt in itertools.product([1, 2], [1, 2, 4, 8], [0, 1, 2, 3], [1, 4]):
        par = replace(cfg.parallel, dp=dp, microbatches=mb, zero=zero, batch_threads=bt)
        try:
            checked = replace(cfg, parallel=par).validate(world)
        except ConfigError:
            continue
        rows = cfg.train.batch_size // (dp * mb)
        if not (zero and dp == 1) and not (bt > 1 and rows < 2):
            accepted.add(layout_name(checked.parallel))
    assert planned == accepted
    assert "dp2-tp1-pp1-mb1-1f1b-z0-bt4" in planned and "dp2-tp1-pp1-mb4-1f1b-z0-bt4" \
        not in planned  # one row a microbatch: nothing to split
    assert not any("-bt" in layout_name(e.cfg.parallel) for e in found.ranked
                   if e.cfg.parallel.tp > 1 or e.cfg.parallel.pp > 1)
    # one core a rank: no split offered
    eight = enumerate_layouts(cfg, hand_cluster(), 8)
    assert not any("-bt" in layout_name(e.cfg.parallel) for e in eight.ranked)


def test_a_zero_3_config_without_resharding_is_planned_at_every_stage(tmp_path):
    # the config's reshard_after_forward = false is ZeRO-3's: the other stages take
    # the default (the plan said no layout could run the batch)
    cfg = tiny_config()
    cfg = replace(cfg, parallel=replace(cfg.parallel, zero=3, reshard_after_forward=False))
    found = enumerate_layouts(cfg, hand_cluster(), 2)
    zeros = {e.cfg.parallel.zero for e in found.ranked if e.cfg.parallel.dp == 2}
    assert zeros == {0, 1, 2, 3}
    assert all(e.cfg.parallel.reshard_after_forward == (e.cfg.parallel.zero != 3)
               for e in found.ranked if e.cfg.parallel.dp == 2)
    # and --explain of a layout at another stage, as the search ranks it
    files = tmp_path
    (files / "c.toml").write_text(search.config_toml(cfg))
    (files / "k.toml").write_text(to_toml(hand_cluster()))
    got = CliRunner().invoke(plan, ["--config", str(files / "c.toml"), "--cluster",
                                    str(files / "k.toml"), "--explain",
                                    "dp2-tp1-pp1-mb1-1f1b-z1"])
    assert got.exit_code == 0, got.output


def test_layout_names_round_trip():
    cfg = tiny_config()
    for text in ("dp2-tp2-pp2-mb4-1f1b-z1", "dp1-tp2-pp2-mb2-interleaved-z0-v2-sp",
                 "dp2-tp1-pp1-mb2-1f1b-z1-bt4"):
        par = replace(cfg.parallel, **parse_layout(text))
        assert layout_name(par) == text


def test_enumerating_4096_ranks_on_two_kinds_ranks_the_layouts_that_fit():
    # its speed is a benchmark's (bench_plan.py scale), not a timed unit test's
    cfg = config.from_dict({"model": {"kind": "gpt", "n_layer": 48, "n_head": 32,
                                      "d_model": 4096, "seq_len": 2048, "vocab_size": 51200},
                            "train": {"batch_size": 1024}})
    cl = hand_cluster((("fat", 32), ("thin", 32)), memory_gib=512.0, cores=64)
    found = enumerate_layouts(cfg, cl, 4096)
    assert found.ranked and found.valid <= found.tried
    steps = [e.step_s for e in found.ranked[:20]]
    assert steps == sorted(steps)


def test_memory_prunes_and_the_closest_miss_is_the_smallest():
    found = enumerate_layouts(tiny_config(), hand_cluster(memory_gib=1e-9), 8)
    assert not found.ranked
    assert found.closest_miss is not None


def test_ranks_no_split_can_use_are_named_split_by_split():
    # 5 ranks of a 4-head, 4-layer GPT with a batch of 8: tp 5 and pp 5 are too many,
    # and dp 5 does not divide the batch, so no combination is even generated
    with pytest.raises(ConfigError) as err:
        enumerate_layouts(tiny_config(), hand_cluster((("cpu", 5),), cores=1), 5)
    text = str(err.value)
    assert "dp 5 (tp 1, pp 1) does not divide the batch of 8" in text
    assert "pp 5 exceeds the 4 layers" in text and "tp 5 exceeds the 4 heads" in text
    assert "None" not in text


def test_a_batch_no_layout_can_run_is_an_error():
    # tp <= 4 heads and pp <= 4 layers: 64 ranks need dp >= 4
    with pytest.raises(ConfigError, match="no layout of 64 ranks can run a global batch of 1"):
        enumerate_layouts(tiny_config(batch=1), hand_cluster(), 64)


@pytest.fixture
def files(tmp_path):
    (tmp_path / "c.toml").write_text(
        '[model]\nkind = "gpt"\nn_layer = 4\nd_model = 16\nn_head = 4\nseq_len = 8\n'
        'vocab_size = 32\n[train]\nbatch_size = 8\n')
    (tmp_path / "wide.toml").write_text(
        '[model]\nkind = "gpt"\nn_layer = 4\nd_model = 64\nn_head = 4\nseq_len = 8\n'
        'vocab_size = 32\n[train]\nbatch_size = 8\n')
    (tmp_path / "k.toml").write_text(to_toml(hand_cluster()))
    (tmp_path / "small.toml").write_text(to_toml(hand_cluster(memory_gib=0.001)))
    return tmp_path


def test_plan_command_prints_a_table_and_emits_a_config(files):
    out = files / "best.toml"
    got = CliRunner().invoke(plan, ["--config", str(files / "c.toml"), "--cluster",
                                    str(files / "k.toml"), "--ranks", "8", "--top", "3",
                                    "--emit", str(out)])
    assert got.exit_code == 0, got.output
    assert "ms/step" in got.output and "slowest: pp rank" in got.output
    emitted = config.load(out)
    assert emitted.model == config.load(files / "c.toml").model
    emitted.validate(8)
    # and the job that runs it: the printed render command renders a script of the layout
    line, = [x for x in got.output.splitlines() if x.startswith("as a SLURM job: ")]
    words = shlex.split(line.removeprefix("as a SLURM job: "))
    assert words[:3] == ["hpctrain", "slurm", "render"] and str(out) in words
    job = files / "job.sbatch"
    words[words.index("-o") + 1] = str(job)
    rendered = CliRunner().invoke(render_cmd, words[3:])
    assert rendered.exit_code == 0, rendered.output
    par = emitted.parallel
    assert f"--dp {par.dp} --tp {par.tp} --pp {par.pp}" in job.read_text()


def test_explain_says_when_the_layout_does_not_fit_and_emits_no_config_of_it(files):
    # the only sign was "total 120.3 of 51" in the rank's line, and --emit wrote it
    args = ["--config", str(files / "wide.toml"), "--cluster", str(files / "small.toml"),
            "--explain", "dp1-tp1-pp1-mb1-1f1b-z0"]
    got = CliRunner().invoke(plan, args)
    assert got.exit_code == 0, got.output
    assert "dp1-tp1-pp1-mb1-1f1b-z0 does not fit in memory: pp rank 0 needs" in got.output
    got = CliRunner().invoke(plan, [*args, "--emit", str(files / "x.toml")])
    assert got.exit_code == 1 and "--emit writes no config of it" in got.output
    assert not (files / "x.toml").exists()


def test_plan_says_when_slurm_render_cannot_run_the_layout(files):
    # 4 nodes of 2 cores: a tensor group of 4 spans two nodes, which render refuses
    (files / "four.toml").write_text(to_toml(hand_cluster((("cpu", 4),), cores=2)))
    got = CliRunner().invoke(plan, ["--config", str(files / "c.toml"), "--cluster",
                                    str(files / "four.toml"), "--explain",
                                    "dp1-tp4-pp2-mb2-1f1b-z0", "--emit",
                                    str(files / "x.toml")])
    assert got.exit_code == 0, got.output
    assert "not with `hpctrain slurm render` (tp (4) must divide ranks per node (2)" \
        in got.output


def test_without_ranks_the_plan_searches_every_measured_count_of_ranks_a_node(files):
    """A node measured with 1 and 2 ranks (calibrate's tables): one rank of 2 threads
    is searched beside two of 1, and ranked with them; counts that do not divide the
    cores, and devices given by their peak, are not."""
    two = hand_cluster(cores=2)
    kind = two.kinds["cpu"]
    two = replace(two, kinds={"cpu": replace(kind, gemm={1: ((64, 4e10), (1024, 9e10)),
                                                         **kind.gemm})})
    assert per_node_counts(two) == [1, 2]
    assert per_node_counts(hand_cluster(cores=8)) == [8]  # measured at 8 only
    odd = replace(kind, cores=4, gemm={3: kind.gemm[2], 1: kind.gemm[2], 4: kind.gemm[2]})
    assert per_node_counts(replace(two, kinds={"cpu": odd})) == [1, 4]
    peak = replace(kind, gemm={}, peak_flops=1e12, gemm_efficiency=0.5)
    assert per_node_counts(replace(two, kinds={"cpu": peak})) == [2]

    cfg = tiny_config()
    merged = enumerate_over(cfg, two, [1, 2])
    alone = [enumerate_layouts(cfg, two, w) for w in (1, 2)]
    assert merged.valid == sum(s.valid for s in alone)
    assert {layout_name(e.cfg.parallel) for e in merged.ranked} == {
        layout_name(e.cfg.parallel) for s in alone for e in s.ranked}
    # the layouts costed with the schedule replayed (each search's best 20) first
    replayed = sum(min(20, len(s.ranked)) for s in alone)
    times = [e.step_s for e in merged.ranked]
    assert times[:replayed] == sorted(times[:replayed])
    assert times[replayed:] == sorted(times[replayed:])
    assert {e.world for e in merged.ranked[:replayed]} == {1, 2}

    (files / "two.toml").write_text(to_toml(two))
    got = CliRunner().invoke(plan, ["--config", str(files / "c.toml"), "--cluster",
                                    str(files / "two.toml"), "--top", "40"])
    assert got.exit_code == 0, got.output
    assert f"{merged.valid} valid layouts of {merged.tried} tried on 1 or 2 ranks" in got.output
    assert "-bt2 " in got.output and "dp2-" in got.output
    got = CliRunner().invoke(plan, ["--config", str(files / "c.toml"), "--cluster",
                                    str(files / "two.toml"), "--explain",
                                    "dp1-tp1-pp1-mb1-1f1b-z0-bt2"])  # the layout's 1 rank
    assert got.exit_code == 0 and "1 ranks per node" in got.output, got.output


def test_plan_command_explains_one_layout(files):
    got = CliRunner().invoke(plan, ["--config", str(files / "c.toml"), "--cluster",
                                    str(files / "k.toml"), "--ranks", "8", "--explain",
                                    "dp2-tp2-pp2-mb2-1f1b-z1"])
    assert got.exit_code == 0, got.output
    assert "pp rank 1" in got.output and "memory MiB" in got.output


def test_plan_command_errors_name_the_problem(files):
    base = ["--config", str(files / "c.toml"), "--ranks", "8"]
    # 1 MiB for 8 ranks; 64 KiB of parameters take 256 KiB with AdamW's state at best
    got = CliRunner().invoke(plan, ["--config", str(files / "wide.toml"), "--ranks", "8",
                                    "--cluster", str(files / "small.toml")])
    assert got.exit_code != 0 and "fits in no layout: the closest" in got.output
    (files / "eight.toml").write_text(to_toml(hand_cluster((("cpu", 8),))))
    got = CliRunner().invoke(plan, ["--config", str(files / "c.toml"), "--ranks", "64",
                                    "--cluster", str(files / "eight.toml"), "--batch", "1"])
    assert got.exit_code != 0 and "global batch of 1" in got.output
    # more ranks a node than its cores: priced as if the cores were there (a 4-rank
    # layout on one 2-core node was "MFU 64.5%"); the search alone never goes there
    (files / "two.toml").write_text(to_toml(hand_cluster(cores=2)))
    for extra in (["--explain", "dp4-tp1-pp1-mb1-1f1b-z0"], ["--ranks", "3"]):
        text = one_line_error(CliRunner().invoke(plan, [
            "--config", str(files / "c.toml"), "--cluster", str(files / "two.toml"), *extra]))
        assert "on a node, whose smallest has 2 cores: the plan prices at most one rank a " \
            "core; give at most 2 ranks" in text, text
    got = CliRunner().invoke(plan, base + ["--cluster", str(files / "k.toml"), "--explain",
                                           "dp3-tp1-pp1-mb1-1f1b-z0"])
    assert got.exit_code != 0 and "dp * tp * pp" in got.output


ROOT = Path(__file__).resolve().parents[1]


def one_line_error(got, status=1) -> str:
    """The message of a command that failed as the project's rule says: the status,
    no traceback (a ClickException or a usage error, not an exception let through)."""
    assert got.exit_code == status, got.output
    assert isinstance(got.exception, SystemExit) and "Traceback" not in got.output
    return got.output


@pytest.mark.parametrize("name", ["dlrm-movielens", "cnn-fashion-mnist", "mlp-fashion-mnist",
                                  "mlp-fashion-mnist-local", "seg3d-mni152"])
def test_a_model_the_cost_model_does_not_price_is_one_line(files, name):
    got = CliRunner().invoke(plan, ["--config", str(ROOT / "configs" / f"{name}.toml"),
                                    "--cluster", str(files / "k.toml"), "--ranks", "2"])
    text = one_line_error(got)
    kind = config.load(ROOT / "configs" / f"{name}.toml").model.kind
    assert f"prices the GPT's layouts only ([model] kind is {kind!r}" in text
    assert ("hpctrain plan-tables" in text) == (kind == "dlrm")
    with pytest.raises(ConfigError, match="the GPT's layouts only"):
        enumerate_layouts(config.load(ROOT / "configs" / f"{name}.toml"), hand_cluster(), 2)


def test_explain_refuses_more_batch_threads_than_a_rank_has_cores(files):
    """What the search never proposes --explain and --emit refuse: a batch split over
    more threads than the rank's cores (the smallest node's over the ranks a node);
    what they accept runs on the CPUs the printed job asks for."""
    (files / "two.toml").write_text(to_toml(hand_cluster(cores=2)))
    base = ["--config", str(files / "c.toml"), "--cluster", str(files / "two.toml")]
    text = one_line_error(CliRunner().invoke(plan, base + [
        "--explain", "dp1-tp1-pp1-mb1-1f1b-z0-bt5"]))
    assert "batch_threads (bt 5) must be at most the cores a rank has (2: 2 cores on " \
           "the smallest node over 1 rank a node)" in text
    emitted = files / "bt.toml"
    text = one_line_error(CliRunner().invoke(plan, base + [
        "--ranks", "2", "--explain", "dp2-tp1-pp1-mb1-1f1b-z1-bt2", "--emit", str(emitted)]))
    assert "(bt 2) must be at most the cores a rank has (1: 2 cores" in text
    assert not emitted.exists()
    for ranks, layout in (("1", "dp1-tp1-pp1-mb1-1f1b-z1-bt2"), ("2", "dp2-tp1-pp1-mb1-1f1b-z1")):
        got = CliRunner().invoke(plan, base + ["--ranks", ranks, "--explain", layout,
                                               "--emit", str(emitted), "--force"])
        assert got.exit_code == 0, got.output
        line, = [x for x in got.output.splitlines() if x.startswith("as a SLURM job: ")]
        words = shlex.split(line.removeprefix("as a SLURM job: "))
        cpus = int(words[words.index("--cpus-per-task") + 1])
        assert config.load(emitted).parallel.batch_threads <= cpus == 2 // int(ranks)


def test_explain_without_ranks_takes_the_layouts(files):
    # a 4-core node: without --ranks the search covers 4 ranks; the layout names 2
    (files / "four.toml").write_text(to_toml(hand_cluster(cores=4)))
    got = CliRunner().invoke(plan, ["--config", str(files / "c.toml"), "--cluster",
                                    str(files / "four.toml"), "--explain",
                                    "dp1-tp2-pp1-mb2-1f1b-z0"])
    assert got.exit_code == 0, got.output
    assert "2 ranks per node" in got.output
    # --ranks given: the layout must match it, as train would say
    text = one_line_error(CliRunner().invoke(plan, [
        "--config", str(files / "c.toml"), "--cluster", str(files / "four.toml"),
        "--ranks", "4", "--explain", "dp1-tp2-pp1-mb2-1f1b-z0"]))
    assert "must equal the number of ranks (4)" in text


@pytest.mark.parametrize(("option", "value"), [
    ("--ranks", "0"), ("--ranks", "-1"), ("--top", "-1"), ("--top", "0"), ("--nodes", "0"),
    ("--batch", "0")])
def test_counts_below_one_are_usage_errors(files, option, value):
    got = CliRunner().invoke(plan, ["--config", str(files / "c.toml"), "--cluster",
                                    str(files / "k.toml"), option, value])
    text = one_line_error(got, status=2)
    assert f"Invalid value for '{option}': {value} is not in the range x>=1" in text


def test_zero_ranks_is_a_config_error_not_a_division_by_zero():
    with pytest.raises(ConfigError, match=r"the number of ranks \(0\) must be positive"):
        enumerate_layouts(tiny_config(), hand_cluster(), 0)


@pytest.mark.timeout(30)  # one trial a number up to n: 10^14 of them
def test_divisors_are_every_divisor_ascending():
    for n in range(1, 300):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    got = divisors(10**14)  # 2^14 5^14: 15 * 15 divisors
    assert len(got) == 225 and got == sorted(got) and got[-1] == 10**14
    assert divisors(2**31 - 1) == [1, 2**31 - 1]  # a prime


@pytest.mark.timeout(60)  # the divisors of the batch, found one trial a number, hung
def test_a_batch_past_what_the_search_can_enumerate_is_refused_at_once(files):
    for extra in ([], ["--explain", "dp1-tp1-pp1-mb1-1f1b-z0"]):
        text = one_line_error(CliRunner().invoke(plan, [
            "--config", str(files / "c.toml"), "--cluster", str(files / "k.toml"),
            "--batch", "100000000000000", *extra]))
        assert "the global batch (100000000000000) must be at most 65536 for hpctrain " \
               "plan" in text, text
    limit = search.MAX_BATCH
    search.check_batch(tiny_config(limit))
    with pytest.raises(ConfigError, match=rf"global batch \({limit + 1}\) must be at most "
                                          rf"{limit} for hpctrain plan"):
        enumerate_layouts(tiny_config(limit + 1), hand_cluster(), 8)


def test_emit_is_checked_before_the_search(files):
    """--emit never writes over the --config or --cluster file, replaces another file
    only with --force, makes its folder, and names one it cannot write, all before
    the search."""
    config_text = (files / "c.toml").read_text()
    cluster_text = (files / "k.toml").read_text()
    base = ["--config", str(files / "c.toml"), "--cluster", str(files / "k.toml"),
            "--ranks", "8"]
    for option, path in (("--config", files / "c.toml"), ("--cluster", files / "./k.toml")):
        for force in ([], ["--force"]):
            text = one_line_error(CliRunner().invoke(plan, base + ["--emit", str(path),
                                                                   *force]), status=2)
            assert f"is the {option} file, which --emit never replaces" in text, text
            assert "valid layouts" not in text
    assert (files / "c.toml").read_text() == config_text
    assert (files / "k.toml").read_text() == cluster_text
    kept = files / "kept.toml"
    kept.write_text("mine")
    text = one_line_error(CliRunner().invoke(plan, base + ["--emit", str(kept)]), status=2)
    assert f"{kept}: already exists; pass --force to replace it" in text
    assert "valid layouts" not in text and kept.read_text() == "mine"
    got = CliRunner().invoke(plan, base + ["--emit", str(kept), "--force"])
    assert got.exit_code == 0, got.output
    config.load(kept).validate(8)
    deep = files / "new" / "folder" / "best.toml"
    got = CliRunner().invoke(plan, base + ["--emit", str(deep)])
    assert got.exit_code == 0, got.output
    config.load(deep).validate(8)
    text = one_line_error(CliRunner().invoke(plan, base + [
        "--emit", str(kept / "x.toml")]), status=2)
    assert f"{kept / 'x.toml'}: cannot be written" in text
    assert "valid layouts" not in text and sorted(p.name for p in files.iterdir()) == [
        "c.toml", "k.toml", "kept.toml", "new", "small.toml", "wide.toml"]


def test_a_description_measured_at_fewer_ranks_a_node_is_said(files):
    """Tables of 1 rank a node priced 2 ranks (or 1 rank of 2 threads) on a 2-core
    node with the rates of 1, each rank a whole node's: the plan says so."""
    one = hand_cluster(cores=2)
    kind = one.kinds["cpu"]
    one = replace(one, kinds={"cpu": replace(kind, gemm={1: kind.gemm[2]},
                                             stream={1: kind.stream[2]})})
    (files / "one.toml").write_text(to_toml(one))
    got = CliRunner().invoke(plan, ["--config", str(files / "c.toml"), "--cluster",
                                    str(files / "one.toml"), "--top", "40"])
    assert got.exit_code == 0, got.output
    assert "note: node kind 'cpu': rates measured at fewer ranks a node (gemm at 1; stream " \
           "at 1) stand in for the 2 this layout computes at once" in got.output
    got = CliRunner().invoke(plan, ["--config", str(files / "c.toml"), "--cluster",
                                    str(files / "k.toml"), "--ranks", "8"])
    assert got.exit_code == 0 and "rates measured at fewer" not in got.output


def test_sizes_read_in_the_unit_that_fits():
    assert [size(n) for n in (512, 1536, 10.5 * 2**20, 213.4 * 2**20, 2**30, 1234 * 2**30)] \
        == ["512 B", "1.50 KiB", "10.5 MiB", "213 MiB", "1.00 GiB", "1234 GiB"]


def test_a_small_memory_miss_is_readable(files):
    got = CliRunner().invoke(plan, ["--config", str(files / "wide.toml"), "--ranks", "8",
                                    "--cluster", str(files / "small.toml")])
    text = one_line_error(got)
    assert "0.00 GiB" not in text
    # 0.001 GiB a node over 8 ranks: 131 KiB a rank
    assert "over the limit of 131 KiB a rank" in text and " KiB on its fullest rank" in text
