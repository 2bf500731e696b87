"""The peer benchmark's pure parts (benchmarks/bench_peer.py, gemm_shapes.py): no torch."""

import importlib.util
import sys
from pathlib import Path

import pytest

from hpctrain.bench import BENCH_MODELS, layout_config
from hpctrain.models.gpt import GPT

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # bench_peer imports gemm_shapes by name
    spec.loader.exec_module(module)
    return module


gemm_shapes = _load("gemm_shapes")
bench_peer = _load("bench_peer")


def test_the_large_benchmark_gpt_is_the_twelve_layer_one():
    assert BENCH_MODELS["gpt-large"].layouts == ("serial", "serial-split", "dp2")
    m = layout_config("dp2", model="gpt-large", data="x.h5", steps=3, run_dir="run").model
    assert (m.kind, m.n_layer, m.n_head, m.d_model, m.seq_len, m.vocab_size) == (
        "gpt", 12, 12, 768, 256, 256)
    params = sum(GPT.piece_costs(m).middle) + GPT.piece_costs(m).first + GPT.piece_costs(m).last
    assert 85e6 < params < 86e6


@pytest.mark.parametrize("model", ["gpt", "gpt-large"])
@pytest.mark.parametrize("batch", [8, 4, 1])
def test_the_probed_products_are_the_model_flops(model, batch):
    # every product of a step, 2 m k n each: together the FLOPs MFU counts
    shape = bench_peer.model_shape(model)
    del shape["batch_size"]
    gemms = gemm_shapes.gpt_gemms(batch=batch, **shape)
    m = layout_config("serial", model=model, data="x.h5", steps=3, run_dir="run").model
    assert sum(g.flops for g in gemms) == GPT.model_flops(m, batch)


def test_the_step_rate_is_the_flops_over_the_summed_best_times():
    gemms = [gemm_shapes.Gemm("a", 2, 1, 4, 4, 4), gemm_shapes.Gemm("b", 1, 3, 2, 2, 2)]
    total, rate = gemm_shapes.step_rate(gemms, [1.0, 0.5])
    assert total == 2.5
    assert rate == (2 * 2 * 64 + 2 * 3 * 8) / 2.5


def test_the_probe_times_each_shape_with_transposed_operands():
    gemms = gemm_shapes.gpt_gemms(batch=1, seq_len=8, n_layer=1, n_head=2, d_model=8,
                                  vocab_size=16)
    seconds = gemm_shapes.probe(gemms, threads=2, repeats=1)
    assert len(seconds) == len(gemms) and all(s > 0 for s in seconds)


def test_the_table_has_medians_and_the_ratio_range():
    def run(rep, hp, pt):
        return {"model": "gpt", "layout": "serial", "rep": rep, "ranks": 1, "threads": 2,
                "hpctrain": {"tokens_per_s": hp}, "pytorch": {"tokens_per_s": pt},
                "ratio": hp / pt, "mfu": 0.5, "mfu_vs_step_probe": 0.6,
                "gemm_probe_flops_per_s": {"numpy": 80e9, "torch": 90e9},
                "pytorch_mfu_vs_step_probe": 0.7}

    lines = bench_peer.table([run(1, 1000, 1000), run(2, 1100, 1000), run(3, 900, 1000)])
    row = lines.splitlines()[-1].split()
    assert row[:8] == ["gpt", "serial", "1", "2", "|", "1000", "1000", "1.00x"]
    assert row[8] == "0.90-1.10x"
    assert row[10:] == ["50.0%", "60.0%", "80.0", "90.0", "70.0%"]
