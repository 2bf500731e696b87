"""``hpctrain bench --model``: each benchmark model's config and layouts, the refusal of
a layout a model cannot run, and the throughput's unit (no MPI job is launched)."""

import pytest
from click.testing import CliRunner

from hpctrain.bench import BENCH_MODELS, LAYOUTS, layout_config, table, throughput_unit
from hpctrain.cli import main
from hpctrain.config import ConfigError


def _config(model, layout):
    return layout_config(layout, model=model, data="x.h5", steps=3, run_dir="run")


def test_each_model_runs_its_default_layouts_at_the_benchmark_shapes():
    assert BENCH_MODELS["gpt"].layouts == ("serial", "serial-split", "dp2", "tp2", "pp2")
    for model in ("cnn", "seg3d"):
        assert BENCH_MODELS[model].layouts == ("serial", "dp2", "sp2")
    for model, spec in BENCH_MODELS.items():
        for layout in spec.layouts:
            cfg = _config(model, layout)
            ranks, parallel = LAYOUTS[layout]
            assert cfg.parallel.dp * cfg.parallel.model_parallel_size == ranks
            assert cfg.parallel.sp == parallel.get("sp", 1)
            assert cfg.parallel.batch_threads == parallel.get("batch_threads", 1)
            assert cfg.model.kind == model.removesuffix("-large")
            assert cfg.model.dtype == "float32"
            assert cfg.train.eval_interval == 0 and cfg.data.path == "x.h5"
            # the GPT's optimizer settings for every model
            assert (cfg.train.optimizer, cfg.train.lr, cfg.train.warmup_steps) == ("adamw",
                                                                                   3e-4, 2)
    cnn, seg3d = _config("cnn", "sp2").model, _config("seg3d", "sp2").model
    assert (cnn.input_dim, cnn.image_pad, cnn.channels, cnn.n_classes) == (784, 2, (16, 32), 10)
    assert (seg3d.channels, seg3d.n_classes, seg3d.crop) == ((8, 16, 32), 3, (32, 32, 32))
    assert [_config(m, "serial").train.batch_size for m in ("gpt", "cnn", "seg3d")] == [8, 128, 4]
    assert BENCH_MODELS["cnn"].config["data"]["path"] == "data/fashion-mnist.h5"
    assert BENCH_MODELS["seg3d"].config["data"]["path"] == "data/mni152.h5"


def test_the_throughput_is_tokens_for_the_gpt_and_samples_for_the_others():
    assert throughput_unit(_config("gpt", "serial").model) == ("tokens_per_s", "tok/s", 256)
    for model in ("cnn", "seg3d"):
        assert throughput_unit(_config(model, "serial").model) == ("samples_per_s", "samp/s", 1)
    row = {"layout": "sp2", "ranks": 2, "step_time_s": 0.5, "samples_per_s": 8.0,
           "model_flops_per_s": 2e9, "peak_flops_per_s": 1e11, "mfu": 0.02,
           "time_s": {"compute": 0.3, "halo": 0.2}}
    head, _, line = table([row]).splitlines()
    assert "samp/s" in head and "tok/s" not in head
    assert line.split()[:4] == ["sp2", "2", "500", "8"]
    assert line.split()[-6] == "40.0%"  # the halo column: 0.2 of 0.5 s


@pytest.mark.parametrize("model, layout, message", [
    ("cnn", "tp2", "the CNN classifier declares no tensor-parallel plan: tp (2) must be 1"),
    ("seg3d", "pp2", "(tp is 1, pp is 2)"),
    ("gpt", "sp2", "the GPT declares no spatial split: sp (2) must be 1"),
])
def test_a_layout_the_model_cannot_run_is_refused_before_anything_runs(tmp_path, model,
                                                                       layout, message):
    with pytest.raises(ConfigError, match="must be 1|data parallelism only"):
        _config(model, layout)
    # --mpiexec names no launcher: the refusal comes before any layout is launched
    result = CliRunner().invoke(main, ["bench", "--model", model, "--layout", "serial",
                                       "--layout", layout, "--out", str(tmp_path / "out"),
                                       "--mpiexec", str(tmp_path / "no-mpiexec")])
    assert result.exit_code == 2, result.output
    assert f"the {model} benchmark cannot run layout {layout}" in result.output
    assert message in result.output
    assert not (tmp_path / "out").exists()


def test_data_defaults_to_the_models_dataset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no data/ here: the default path is named as missing
    for model, path in [("cnn", "data/fashion-mnist.h5"), ("seg3d", "data/mni152.h5")]:
        result = CliRunner().invoke(main, ["bench", "--model", model])
        assert result.exit_code == 2, result.output
        assert f"{path} does not exist" in result.output


def test_a_launcher_or_an_output_that_cannot_work_is_refused_before_any_layout(tmp_path):
    data = tmp_path / "x.h5"
    data.write_bytes(b"")  # exists: the launcher and --out are checked after the data
    result = CliRunner().invoke(main, ["bench", "--model", "cnn", "--layout", "serial",
                                       "--data", str(data), "--out", str(tmp_path / "out"),
                                       "--mpiexec", str(tmp_path / "no-mpiexec")])
    assert result.exit_code == 2, result.output  # a traceback (FileNotFoundError) before
    assert f"{tmp_path / 'no-mpiexec'}: no such program" in result.output
    assert not (tmp_path / "out").exists()
    (tmp_path / "file").write_text("")
    result = CliRunner().invoke(main, ["bench", "--model", "cnn", "--layout", "serial",
                                       "--data", str(data), "--out", str(tmp_path / "file/x")])
    assert result.exit_code == 2, result.output  # NotADirectoryError's traceback before
    assert "file/x: cannot be made (Not a directory)" in result.output


def test_data_of_another_kind_ends_the_bench_with_the_layouts_refusal(tmp_path):
    """The layout's ranks refuse a token stream for the CNN (status 2); the bench said
    'failed' and exited 1."""
    import subprocess
    import sys

    from hpctrain.testing import tiny_corpus_config

    tokens = tiny_corpus_config(tmp_path, "", "some text", 50).with_name("corpus.h5")
    result = subprocess.run([sys.executable, "-m", "hpctrain.cli", "bench", "--model", "cnn",
                             "--layout", "serial", "--steps", "3", "--warmup", "1",
                             "--data", str(tokens), "--out", str(tmp_path / "out"),
                             "--timeout", "120"], capture_output=True, text=True, timeout=180)
    assert result.returncode == 2, result.stderr
    assert "holds a token stream" in result.stderr
    assert "layout serial refused its input (status 2; its ranks' message is above)" \
        in result.stderr
