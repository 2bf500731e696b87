"""Config loading and the validation rules: each message names the values and the rule."""

import math
from dataclasses import fields

import pytest

from hpctrain import config as C


def write(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_defaults_validate_serially_and_dp_is_inferred():
    cfg = C.Config().validate(1)
    assert cfg.parallel.dp == 1
    cfg = C.Config(parallel=C.ParallelConfig(tp=2, pp=2)).validate(8)
    assert (cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp) == (2, 2, 2)


def test_toml_sections_types_and_overrides(tmp_path):
    path = write(tmp_path, """
[model]
n_layer = 2
hidden = [64, 32]
[parallel]
tp = 2
[train]
lr = 3
steps = 7
""")
    cfg = C.load(path, {"parallel.tp": 1, "train.seed": 9})
    assert cfg.model.n_layer == 2 and cfg.model.hidden == (64, 32)
    assert cfg.parallel.tp == 1 and cfg.train.seed == 9 and cfg.train.steps == 7
    assert isinstance(cfg.train.lr, float) and cfg.train.lr == 3.0


@pytest.mark.parametrize("text, message", [
    ("[modle]\nx = 1\n", r"unknown section\(s\) \['modle'\]"),
    ("[model]\nn_layers = 2\n", r"unknown key\(s\) \['n_layers'\] in \[model\]"),
    ("[model]\nn_layer = 'two'\n", r"\[model\] n_layer \('two'\) must be an integer"),
    ("[train]\nlr = true\n", r"\[train\] lr \(True\) must be a number"),
    ("[parallel]\nsequence_parallel = 1\n", r"must be true or false"),
    ("[model\n", r"is not valid TOML"),
])
def test_bad_files_name_the_key_and_the_rule(tmp_path, text, message):
    with pytest.raises(C.ConfigError, match=message):
        C.load(write(tmp_path, text))


def test_missing_file_is_named():
    with pytest.raises(C.ConfigError, match=r"config file 'nope.toml' does not exist"):
        C.load("nope.toml")


def test_a_folder_or_binary_file_is_named_not_a_traceback(tmp_path):
    with pytest.raises(C.ConfigError, match=rf"^config file '{tmp_path}' is a folder, not a "
                                            r"TOML file$"):
        C.load(tmp_path)
    data = tmp_path / "x.h5"
    data.write_bytes(b"\x89HDF\r\n\x1a\n\0\0")  # an HDF5 file's signature
    with pytest.raises(C.ConfigError, match=r"^table plan '.*x.h5' is not a TOML text file "
                                            r"\(binary data: byte 0x89 at offset 0 is not "
                                            r"UTF-8\)$"):
        C.read_toml(data, "table plan")


def test_a_byte_order_mark_is_skipped(tmp_path):
    # some Windows editors start UTF-8 files with one; tomllib reads it as a statement
    path = tmp_path / "run.toml"
    path.write_bytes("\ufeff[model]\nn_layer = 2\n".encode())
    assert C.load(path).model.n_layer == 2


def test_config_options_refuse_a_folder_and_a_binary_file(tmp_path):
    """Every command's --config: a usage error or one line, never a traceback."""
    from click.testing import CliRunner

    from hpctrain.cli import main

    data = tmp_path / "x.h5"
    data.write_bytes(b"\x89HDF\r\n\x1a\n")
    for args in (["train", "--config", str(data)],
                 ["slurm", "render", "--ranks-per-node", "2", "--config", str(data)],
                 ["slurm", "render", "--ranks-per-node", "2", "--config", str(tmp_path)],
                 ["plan-tables", "--config", str(tmp_path), "--ranks", "2",
                  "--memory-gib", "1"]):
        got = CliRunner().invoke(main, args)
        assert isinstance(got.exception, SystemExit) and got.exit_code in (1, 2), got.output
        assert "Traceback" not in got.output
        assert "is not a TOML text file" in got.output or \
            f"File '{tmp_path}' is a directory" in got.output, got.output


def cfg_with(world=1, **kw):
    parts = {"model": {}, "parallel": {}, "train": {}, "data": {}}
    for key, value in kw.items():
        section, field = key.split("__")
        parts[section][field] = value
    return C.Config(model=C.ModelConfig(**parts["model"]),
                    parallel=C.ParallelConfig(**parts["parallel"]),
                    train=C.TrainConfig(**parts["train"]),
                    data=C.DataConfig(**parts["data"])), world


@pytest.mark.parametrize("args, message", [
    (cfg_with(3, parallel__tp=3, model__n_head=8), r"tp \(3\) must divide n_head \(8\)"),
    (cfg_with(1, parallel__tp=3, model__n_head=8), r"tp \(3\) must divide n_head \(8\)"),
    (cfg_with(3, model__n_head=3), r"n_head \(3\) must divide d_model \(128\)"),
    (cfg_with(2, parallel__tp=2, model__d_ff=33, model__n_head=2),
     r"tp \(2\) must divide the MLP width d_ff \(33\)"),
    (cfg_with(2, parallel__tp=2, model__vocab_size=255), r"tp \(2\) must divide vocab_size"),
    # a negative width passed every rule and failed in the model's build, a traceback
    (cfg_with(1, model__d_ff=-5), r"^d_ff \(-5\) must be at least 1, or 0 for 4 \* d_model$"),
    (cfg_with(3, parallel__pp=2), r"tp \* pp \(1 \* 2 = 2\) must divide the number of ranks \(3\)"),
    (cfg_with(4, parallel__dp=3), r"dp \* tp \* pp \(3 \* 1 \* 1 = 3\) must equal .* \(4\)"),
    (cfg_with(2, parallel__pp=2, parallel__schedule="interleaved", parallel__microbatches=3,
              parallel__virtual_stages=2), r"microbatches \(3\) divisible by pp \(2\)"),
    (cfg_with(1, parallel__schedule="zigzag"), r"schedule \('zigzag'\) must be one of"),
    (cfg_with(1, parallel__virtual_stages=2), r"needs schedule 'interleaved'"),
    (cfg_with(8, parallel__pp=8, model__n_layer=4), r"must not exceed n_layer \(4\)"),
    (cfg_with(2, train__batch_size=5, parallel__microbatches=1),
     r"batch_size \(5\) must be a positive multiple of dp \* microbatches \(2 \* 1 = 2\)"),
    (cfg_with(1, parallel__zero=4), r"zero \(4\) must be 0, 1, 2 or 3"),
    (cfg_with(1, train__min_lr=1.0, train__lr=0.1), r"min_lr \(1.0\) must be between 0 and lr"),
    (cfg_with(1, model__dtype="float16"), r"dtype \('float16'\) must be one of"),
    (cfg_with(2, model__kind="cnn", parallel__tp=2),
     r"the CNN classifier declares no tensor-parallel plan: tp \(2\) must be 1"),
    (cfg_with(2, model__kind="mlp", parallel__tp=2),
     r"the MLP classifier declares no tensor-parallel plan: tp \(2\) must be 1"),
    (cfg_with(2, parallel__tp=2, parallel__sequence_parallel=True, model__seq_len=7),
     r"tp \(2\) to divide seq_len \(7\)"),
    (cfg_with(1, train__save_interval=-1), r"save_interval \(-1\) must not be negative"),
    (cfg_with(1, train__keep_checkpoints=0), r"keep_checkpoints \(0\) must be at least 1"),
    (cfg_with(2, parallel__dp_reduce="tree"),
     r"dp_reduce \('tree'\) must be one of flat, hierarchical$"),
])
def test_each_rule_names_its_values(args, message):
    cfg, world = args
    with pytest.raises(C.ConfigError, match=message):
        cfg.validate(world)


def test_to_dict_round_trips():
    cfg = C.Config(model=C.ModelConfig(hidden=(8, 4)))
    assert C.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("zero", [0, 1, 2])
@pytest.mark.parametrize("world", [1, 8])
def test_hierarchical_reduction_is_valid_at_every_zero_stage(zero, world):
    assert C.ParallelConfig().dp_reduce == "flat"
    cfg = C.Config(parallel=C.ParallelConfig(dp_reduce="hierarchical", zero=zero))
    assert cfg.validate(world).parallel.dp_reduce == "hierarchical"


def test_dp_reduce_from_the_file_and_from_the_command_line(tmp_path):
    path = write(tmp_path, '[parallel]\ndp_reduce = "hierarchical"\n')
    assert C.load(path).parallel.dp_reduce == "hierarchical"
    assert C.load(path, {"parallel.dp_reduce": "flat"}).parallel.dp_reduce == "flat"
    with pytest.raises(C.ConfigError, match=r"\[parallel\] dp_reduce \(2\) must be a string"):
        C.load(write(tmp_path, "[parallel]\ndp_reduce = 2\n"))


def test_the_dp_reduce_option_of_hpctrain_train(tmp_path):
    from click.testing import CliRunner

    from hpctrain.cli import OVERRIDES, main

    assert OVERRIDES["dp_reduce"] == "parallel.dp_reduce"
    result = CliRunner().invoke(main, ["train", "--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "--dp-reduce [flat|hierarchical]" in text and "all-reduce among node leaders" in text
    path = write(tmp_path, "")
    result = CliRunner().invoke(main, ["train", "--config", str(path), "--dp-reduce", "tree"])
    assert result.exit_code == 2
    assert "'tree' is not one of 'flat', 'hierarchical'" in result.output


# every float of every section: inf passes range rules such as lr > 0, nan reaches none
FLOAT_KEYS = [f"{s.name}__{f.name}" for s in fields(C.Config)
              for f in fields(s.default_factory()) if f.type == "float"]


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_every_float_must_be_finite(key, value):
    cfg, world = cfg_with(1, **{key: value})
    name = key.split("__")[1]
    with pytest.raises(C.ConfigError, match=rf"^{name} \({value}\) must be a finite number$"):
        cfg.validate(world)


def test_non_finite_values_from_the_file_and_the_command_line(tmp_path):
    with pytest.raises(C.ConfigError, match=r"^eps \(inf\) must be a finite number$"):
        C.load(write(tmp_path, "[train]\neps = inf\n")).validate(1)
    with pytest.raises(C.ConfigError, match=r"^lr \(inf\) must be a finite number$"):
        C.load(write(tmp_path, ""), {"train.lr": float("inf")}).validate(1)  # --lr inf


GPT_EVAL = r"must be at least 1 for the GPT \(0, the whole validation split, is for ratings"


@pytest.mark.parametrize("args, message", [
    (cfg_with(1, train__eps=0.0), r"^eps \(0.0\) must be positive$"),
    (cfg_with(1, train__eps=-1e-8), r"^eps \(-1e-08\) must be positive$"),
    (cfg_with(1, train__beta1=1.5), r"^beta1 \(1.5\) must be in \[0, 1\)$"),
    (cfg_with(1, train__beta1=-0.1), r"^beta1 \(-0.1\) must be in \[0, 1\)$"),
    (cfg_with(1, train__beta2=1.0), r"^beta2 \(1.0\) must be in \[0, 1\)$"),
    (cfg_with(1, train__beta2=-0.5), r"^beta2 \(-0.5\) must be in \[0, 1\)$"),
    (cfg_with(1, train__weight_decay=-0.5), r"^weight_decay \(-0.5\) must not be negative$"),
    (cfg_with(1, train__optimizer="sgd", train__momentum=1.0),
     r"^momentum \(1.0\) must be in \[0, 1\)$"),
    (cfg_with(1, train__momentum=-0.1), r"^momentum \(-0.1\) must be in \[0, 1\)$"),
    (cfg_with(1, train__eval_batches=0), rf"^eval_batches \(0\) {GPT_EVAL}"),
    (cfg_with(1, train__eval_batches=-3), rf"^eval_batches \(-3\) {GPT_EVAL}"),
    (cfg_with(1, train__eval_batches=0, train__eval_interval=0),
     rf"^eval_batches \(0\) {GPT_EVAL}"),  # steps = 0 still evaluates
    (cfg_with(1, model__kind="mlp", train__eval_batches=0),
     r"^eval_batches \(0\) must be at least 1 for the MLP classifier"),
    (cfg_with(1, model__kind="seg3d", train__eval_batches=-1),
     r"^eval_batches \(-1\) must not be negative \(0: the whole validation split\)$"),
    (cfg_with(1, train__run_dir=""), r"^run_dir \(''\) must name a folder: metrics.jsonl"),
    (cfg_with(1, train__run_dir="  "), r"^run_dir \('  '\) must name a folder"),
    (cfg_with(1, data__fold=9), r"^fold \(9\) chooses a validation fold of ratings data; "
                                r"the GPT trains on hpctrain.tokens, which has no folds"),
    (cfg_with(1, data__fold=-1), r"^fold \(-1\) must not be negative"),
])
def test_optimizer_evaluation_and_run_dir_rules(args, message):
    cfg, world = args
    with pytest.raises(C.ConfigError, match=message):
        cfg.validate(world)


@pytest.mark.parametrize("args", [
    cfg_with(1, train__eps=1e-30, train__beta1=0.0, train__beta2=0.0, train__weight_decay=0.0,
             train__momentum=0.0, train__grad_clip=0.0, train__eval_batches=1),
    cfg_with(1, train__eval_interval=0),  # evaluation off, eval_batches at its default
    cfg_with(1, model__kind="seg3d", train__eval_batches=0),  # the whole split
    cfg_with(1, train__run_dir="."),
])
def test_the_edges_of_the_rules_are_accepted(args):
    cfg, world = args
    assert cfg.validate(world).train == cfg.train


def test_the_shipped_dlrm_config_evaluates_the_whole_fold():
    from pathlib import Path

    cfg = C.load(Path(__file__).parent.parent / "configs" / "dlrm-movielens.toml")
    assert cfg.train.eval_batches == 0
    assert cfg.validate(1).train.eval_batches == 0
