"""Checkpoints without mpiexec: the slice maths, the format, checksums and corruption
(every error names the file and the tensor), pruning, the CLI, and resuming through
``hpctrain train --resume`` (those run small mpiexec jobs)."""

import itertools
import json
import pickle
import shutil
from dataclasses import replace
from pathlib import Path

import h5py
import numpy as np
import pytest
from click.testing import CliRunner
from mpi4py import MPI

from hpctrain.checkpoint import (
    Checkpoint,
    CheckpointError,
    load_training,
    save_training,
    verify,
    writer,
)
from hpctrain.checkpoint import format as fmt
from hpctrain.checkpoint.consolidate import consolidate, expand
from hpctrain.checkpoint.reshard import (
    Sharding,
    box_volume,
    extract,
    flat_runs,
    full_box,
    place,
    segments,
    slices,
    tiles,
)
from hpctrain.checkpoint.state import held_tensors, restore_rng, rng_states
from hpctrain.checkpoint.training import config_hint
from hpctrain.cli import main
from hpctrain.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.shards import take_shard
from hpctrain.parallel.topology import Topology
from hpctrain.testing import (
    hdf5_held_for_writing,
    run_train,
    tiny_corpus_config,
    tiny_gpt_template,
)
from hpctrain.train import make_data_parallel, train_step

MODEL = ModelConfig(n_layer=2, d_model=16, n_head=2, seq_len=8, vocab_size=32, dtype="float64")

# ---------------------------------------------------------------------------------
# the slice maths


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), ()])
def test_flat_runs_cover_the_range_in_order(shape):
    n = int(np.prod(shape))
    full = np.arange(n).reshape(shape)
    for lo, hi in itertools.combinations(range(n + 1), 2):
        runs = flat_runs(shape, lo, hi)
        got = np.concatenate([full[slices(box)].reshape(-1) for _, box in runs])
        assert got.tolist() == list(range(lo, hi))
        assert [off for off, _ in runs] == list(np.cumsum([0] + [box_volume(b) for _, b
                                                                 in runs])[:-1])
        assert len(runs) <= max(1, 2 * len(shape) - 1)


@pytest.mark.parametrize("shape, axis, blocks, tp", [
    ((4, 12), 1, 3, 2),  # qkv: [q | k | v] split head by head
    ((4, 12), 1, 1, 4),  # column parallel
    ((8, 4), 0, 1, 2),  # row parallel, vocabulary embedding
    ((6,), 0, 3, 2),  # the qkv bias
    ((4, 6), None, 1, 2),  # replicated
])
def test_segments_are_the_global_boxes_of_every_shard_and_zero_slice(shape, axis, blocks, tp):
    full = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
    for rank in range(tp):
        local = take_shard(full, axis, rank, tp if axis is not None else 1, blocks)
        size = local.size
        for cuts in ([0, size], [0, size // 2, size], [0, 1, size - 1, size]):  # ZeRO
            boxes = []
            for lo, hi in itertools.pairwise(cuts):
                sh = Sharding(shape, axis, blocks, rank, tp if axis is not None else 1,
                              None if cuts == [0, size] else (lo, hi))
                held = local.copy() if sh.flat is None else local.reshape(-1)[lo:hi].copy()
                assert held.shape == sh.shape
                back = np.zeros_like(held)
                for seg in segments(sh):
                    np.testing.assert_array_equal(extract(held, seg), full[slices(seg.box)])
                    place(back, seg, full[slices(seg.box)])
                    boxes.append(seg.box)
                np.testing.assert_array_equal(back, held)
            mine = take_shard(np.ones(shape), axis, rank, tp if axis is not None else 1,
                              blocks)
            assert sum(box_volume(b) for b in boxes) == mine.size


def test_every_rank_together_tiles_the_tensor_once():
    shape = (4, 12)
    boxes = [seg.box for r in range(2) for seg in segments(Sharding(shape, 1, 3, r, 2))]
    assert tiles(boxes, shape) is None
    assert "overlap" in tiles(boxes + boxes[:1], shape)
    assert "missing" in tiles(boxes[1:], shape)
    assert "outside" in tiles([((0, 5), (0, 12))], shape)


def _covered_once(boxes, shape):
    """The definition, element by element: every box inside, every element once."""
    count = np.zeros(shape, dtype=int)
    for box in boxes:
        if any(a < 0 or b > n or a >= b for (a, b), n in zip(box, shape, strict=True)):
            return False
        count[tuple(slice(a, b) for a, b in box)] += 1
    return bool((count == 1).all())


def test_tiles_agrees_with_counting_every_element():
    # grids of pieces as layouts cut tensors, then one piece lost, doubled, grown or
    # stray, in random order: the verdict equals the element count's
    rng = np.random.default_rng(5)
    for _ in range(600):
        shape = tuple(int(n) for n in rng.integers(1, 7, size=rng.integers(1, 4)))
        cuts = [sorted({0, n, *rng.integers(0, n + 1, size=2).tolist()}) for n in shape]
        boxes = list(itertools.product(*[list(itertools.pairwise(c)) for c in cuts]))
        change = rng.integers(5)
        if change == 0 and len(boxes) > 1:
            boxes.pop(int(rng.integers(len(boxes))))
        elif change == 1:
            boxes.append(boxes[int(rng.integers(len(boxes)))])
        elif change == 2:
            grown = [list(ab) for ab in boxes[int(rng.integers(len(boxes)))]]
            grown[int(rng.integers(len(shape)))][1] += 1
            boxes.append(tuple(map(tuple, grown)))
        elif change == 3:
            boxes.append(tuple((int(a), int(a + rng.integers(1, 3))) for a in
                               rng.integers(0, max(shape), size=len(shape))))
        order = rng.permutation(len(boxes))
        boxes = [tuple(boxes[i]) for i in order]
        assert (tiles(boxes, shape) is None) == _covered_once(boxes, shape), (shape, boxes)


def test_tiles_of_many_column_pieces_finds_the_one_overlap():
    # 4,096 pieces cut along columns only (every piece spans all rows): sorted by row
    # they all meet, which a pairwise sweep takes quadratic time over
    shape = (8, 4096)
    boxes = [((0, 8), (c, c + 1)) for c in range(4096)]
    assert tiles(boxes, shape) is None
    assert tiles(boxes + [((3, 5), (2000, 2001))], shape) == \
        "pieces 0:8,2000:2001 and 3:5,2000:2001 overlap"
    assert "cover 32760 of 32768 elements" in tiles(boxes[:511] + boxes[512:], shape)


def test_a_piece_held_by_replicas_is_written_once_spread_over_them():
    box, other = ((0, 4),), ((4, 8),)
    everyone = [(0, [("a", box, 100), ("b", box, 10)]),  # dp replicas of one stage
                (0, [("a", box, 100), ("b", box, 10)]),
                (1, [("b", other, 10), ("b", box, 10)])]  # a later stage's copy of b
    mine = writer.plan_writers(everyone)
    assert mine[0] | mine[1] == {("a", box), ("b", box)} and not mine[0] & mine[1]
    assert mine[0] and mine[1]  # both replicas write
    assert mine[2] == set()  # tensor b comes from its first stage only


# ---------------------------------------------------------------------------------
# a serial run to save


def make_cfg(tmp_path, **model) -> Config:
    return Config(model=replace(MODEL, **model),
                  train=TrainConfig(batch_size=4, steps=4, warmup_steps=1,
                                    run_dir=str(tmp_path / "run"))).validate(1)


class Serial:
    def __init__(self, cfg):
        self.cfg = cfg
        self.topo = Topology.build(MPI.COMM_SELF, cfg.parallel)
        self.engine = build_engine(cfg, self.topo)
        self.dp = make_data_parallel(cfg, self.engine, self.topo)

    def train(self, steps):
        r = np.random.default_rng(1)
        for _ in range(steps):
            x, y = (r.integers(0, MODEL.vocab_size, (4, MODEL.seq_len)) for _ in range(2))
            train_step(self.engine, self.dp, x, y, lr=1e-2, grad_clip=1.0)
        return self

    def held(self):
        return {h.name: h.array.copy() for h in held_tensors(self.engine, self.dp, 0, 1)}

    def save(self, step, **kw):
        return save_training(self.cfg, self.topo, self.engine, self.dp, step=step,
                             loader_state={"step": step}, **kw)

    def load(self, path, **kw):
        return load_training(path, self.cfg, self.topo, self.engine, self.dp, **kw)


@pytest.fixture
def saved(tmp_path):
    """A serial run saved after 2 steps: (config, folder, held arrays)."""
    cfg = make_cfg(tmp_path)
    run = Serial(cfg).train(2)
    return cfg, run.save(2), run.held()


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_files_carry_format_and_version_and_load_bitwise(saved):
    cfg, path, held = saved
    with h5py.File(path / fmt.INDEX_NAME) as f:
        assert (f.attrs["format"], f.attrs["version"]) == (fmt.CHECKPOINT, fmt.VERSION)
        assert json.loads(f.attrs["config"]) == cfg.to_dict()
    with Checkpoint(path) as ck:
        (piece,) = ck.tensors["model/embed.wte.weight"].pieces
    with h5py.File(path / fmt.data_filename(0)) as f:
        assert (f.attrs["format"], f.attrs["version"]) == (fmt.DATA, fmt.VERSION)
        flat = f[piece.dataset]  # every float64 piece, back to back
        assert piece.dataset == "float64" and list(f) == ["float64"]
        np.testing.assert_array_equal(flat[piece.at:piece.at + 32 * 16].reshape(32, 16),
                                      held["model/embed.wte.weight"])
    fresh = Serial(cfg)
    resumed = fresh.load(path.parent)  # the checkpoints folder: its latest
    assert resumed.step == 2 and fresh.dp.optimizer.t == 2 and same(fresh.held(), held)
    assert (path.parent / fmt.LATEST_NAME).read_text().strip() == path.name


def test_keep_prunes_old_checkpoints_and_interrupted_saves(tmp_path):
    cfg = make_cfg(tmp_path)
    cfg = replace(cfg, train=replace(cfg.train, keep_checkpoints=2))
    run = Serial(cfg)
    root = Path(cfg.train.run_dir) / "checkpoints"
    for step in (1, 2):
        run.save(step)
    (root / "step-000009.tmp").mkdir()  # a save that was killed
    run.save(3)
    writer.wait_for_pruning()  # old checkpoints are deleted by a background thread
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000002", "step-000003"]


def test_random_generator_states_round_trip_as_json(tmp_path):
    cfg = make_cfg(tmp_path)
    run = Serial(cfg)
    g = np.random.default_rng(7)
    g.standard_normal(3)
    assert json.loads(json.dumps(rng_states({"g": g}))) == rng_states({"g": g})
    path = run.save(1, generators={"dropout": g})
    want = g.standard_normal(4)
    h = np.random.default_rng(0)
    Serial(cfg).load(path, generators={"dropout": h})
    np.testing.assert_array_equal(h.standard_normal(4), want)
    with pytest.raises(CheckpointError, match="no state for random generator 'other'"):
        restore_rng({"other": h}, rng_states({"g": g}))


def flip_byte_of(folder: Path, tensor: str, at: int = 3) -> None:
    """Corrupt one byte inside the first stored piece of a tensor."""
    with Checkpoint(folder) as ck:
        entry = ck.tensors[tensor]
    piece, path = entry.pieces[0], folder / entry.pieces[0].file
    with h5py.File(path) as f:
        offset = f[piece.dataset].id.get_offset() + piece.at * np.dtype(entry.dtype).itemsize
    with path.open("r+b") as fh:
        fh.seek(offset + at)
        byte = fh.read(1)
        fh.seek(offset + at)
        fh.write(bytes([byte[0] ^ 0xFF]))


def test_one_corrupt_byte_names_the_file_and_the_tensor(saved):
    cfg, path, _ = saved
    data = path / fmt.data_filename(0)
    flip_byte_of(path, "optim/v/blocks.1.mlp.fc.weight")
    _, problems = verify(path)
    assert len(problems) == 1
    assert str(data) in problems[0] and "optim/v/blocks.1.mlp.fc.weight" in problems[0]
    assert "checksum mismatch (blocksum64" in problems[0]
    with pytest.raises(CheckpointError, match=r"rank-00000.h5: tensor optim/v/blocks.1.mlp"):
        Serial(cfg).load(path)
    result = CliRunner().invoke(main, ["ckpt", "verify", str(path)])
    assert result.exit_code == 2 and "optim/v/blocks.1.mlp.fc.weight" in result.output


def test_a_missing_file_or_piece_is_an_error_never_zeros(saved):
    cfg, path, _ = saved
    index = fmt.read_index(path / fmt.INDEX_NAME)
    entries = list(index.tensors.values())
    e = entries[3]  # the index lost a piece
    entries[3] = fmt.TensorEntry(e.name, e.dtype, e.global_shape, e.tp_split, e.tp_blocks, ())
    broken = path.parent / "broken"
    shutil.copytree(path, broken)
    (broken / fmt.INDEX_NAME).unlink()
    with h5py.File(broken / fmt.INDEX_NAME, "w-") as f:
        fmt.write_index(f, step=2, meta=index.meta, files=index.files, tensors=entries)
    with pytest.raises(CheckpointError, match=rf"tensor {entries[3].name}: .*a piece is missing"):
        Checkpoint(broken)
    (path / fmt.data_filename(0)).unlink()
    with pytest.raises(CheckpointError, match=r"rank-00000.h5: missing; .* tensor model/embed"):
        Serial(cfg).load(path)


def test_a_truncated_file_is_named(saved):
    cfg, path, _ = saved
    data = path / fmt.data_filename(0)
    data.write_bytes(data.read_bytes()[:4096])
    with pytest.raises(CheckpointError, match=r"rank-00000.h5: cannot be read as HDF5"):
        Serial(cfg).load(path)


@pytest.mark.parametrize("name", [fmt.INDEX_NAME, fmt.data_filename(0)])
def test_a_checkpoint_file_another_process_writes_is_named_as_locked_not_corrupt(saved,
                                                                               name):
    """The index or a data file held open for writing by another process (HDF5's
    exclusive lock): the load names the lock, not a corrupt file, and loads after."""
    cfg, path, held = saved
    with hdf5_held_for_writing(path / name), pytest.raises(CheckpointError) as err:
        Serial(cfg).load(path)
    assert f"{name}: HDF5 could not lock it: another process has it open for writing " \
        "(errno 11)" in str(err.value) and fmt.REMEDY not in str(err.value)
    fresh = Serial(cfg)
    fresh.load(path)
    assert same(fresh.held(), held)


@pytest.mark.parametrize("change, message", [
    ({"d_ff": 32}, r"tensor model/blocks.0.mlp.fc.weight has global shape \(16, 64\), the "
                   r"model built from the config has \(16, 32\).*d_ff 0 \(checkpoint\) vs 32"),
    ({"n_layer": 1}, r"holds 36 tensor\(s\) the model built from the config lacks, e.g. "
                     r"model/blocks.1"),
    ({"n_layer": 3}, r"has no tensor model/blocks.2.ln1.weight \(\d+ tensors\); the model "
                     r"config differs: n_layer 2 \(checkpoint\) vs 3 \(config\)"),
    ({"dtype": "float32"}, r"tensor model/embed.wte.weight is float64, the model is float32"),
])
def test_a_model_that_does_not_fit_names_the_tensor(saved, tmp_path, change, message):
    _, path, _ = saved
    with pytest.raises(CheckpointError, match=message):
        Serial(make_cfg(tmp_path, **change)).load(path)


def test_the_hint_names_a_change_of_pipeline_training():
    """Local pipeline training adds auxiliary heads: a checkpoint of one resumed with
    the other lacks or holds their tensors, and the message says why."""
    local = Config(model=ModelConfig(kind="mlp"),
                   parallel=ParallelConfig(pp=2, pipeline_training="local"))
    saved = replace(local, parallel=replace(local.parallel, pipeline_training="backprop"))
    assert config_hint(saved.to_dict(), local) == (
        "; pipeline_training 'backprop' (checkpoint) vs 'local' (config): local training's "
        "auxiliary heads (aux_heads.*) are parameters of their own")
    assert config_hint(local.to_dict(), local) == ""


def test_another_optimizer_is_refused(saved, tmp_path):
    _, path, _ = saved
    cfg = make_cfg(tmp_path)
    cfg = replace(cfg, train=replace(cfg.train, optimizer="sgd"))
    with pytest.raises(CheckpointError, match="holds adamw state, the config trains with sgd"):
        Serial(cfg).load(path)


def test_consolidated_file_and_back_load_bitwise(saved, tmp_path):
    cfg, path, held = saved
    single = consolidate(path, tmp_path / "one.h5")
    with h5py.File(single) as f:
        assert f["data/model/blocks.0.attn.qkv.weight"].shape == (16, 48)
    folder = expand(single, tmp_path / "again", files=3)
    assert len(list(folder.glob("rank-*.h5"))) == 3
    for source in (single, tmp_path / "again"):
        run = Serial(cfg)
        run.load(source)
        assert same(run.held(), held), source


def test_reading_never_unpickles(saved, monkeypatch, tokens_h5):
    def refuse(*args, **kwargs):
        raise AssertionError("pickle used while reading")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    cfg, path, _ = saved
    Serial(cfg).load(path)
    assert not verify(path)[1]
    from hpctrain.data import open_loader

    with open_loader(tokens_h5, batch_size=2, seed=0, seq_len=8) as loader:
        loader.next_batch()
    root = Path(__file__).parent.parent / "hpctrain"
    for source in list((root / "checkpoint").glob("*.py")) + list((root / "data").glob("*.py")):
        text = source.read_text()
        for call in ("import pickle", "pickle.load", "allow_pickle=True", "np.load("):
            assert call not in text, f"{source}: {call}"


def test_resolve_follows_the_latest_pointer_given_itself(saved):
    _, path, _ = saved
    pointer = path.parent / fmt.LATEST_NAME
    assert pointer.is_file()
    assert fmt.resolve(pointer) == fmt.resolve(path.parent) == fmt.resolve(path)


def test_resolve_refuses_an_unfinished_save(saved):
    _, path, _ = saved
    unfinished = path.parent / "step-000003.tmp"
    unfinished.mkdir()
    with pytest.raises(CheckpointError, match="an unfinished save"):
        Checkpoint(unfinished)
    (path.parent / fmt.LATEST_NAME).write_text("step-000007\n")
    with pytest.raises(CheckpointError, match="names 'step-000007', which is not a complete"):
        Checkpoint(path.parent)


# ---------------------------------------------------------------------------------
# the CLI


def test_ckpt_commands_inspect_verify_convert(saved, tmp_path):
    _, path, _ = saved
    runner = CliRunner()
    result = runner.invoke(main, ["ckpt", "inspect", str(path)])
    assert result.exit_code == 0, result.output
    assert "step 2, 87 tensors" in result.output and "model/blocks.1.attn.qkv.weight" in \
        result.output
    result = runner.invoke(main, ["ckpt", "inspect", str(path), "--json"])
    assert json.loads(result.output)["optimizer"] == {"kind": "adamw", "t": 2}
    result = runner.invoke(main, ["ckpt", "verify", str(path)])
    assert result.exit_code == 0 and result.output.startswith("ok:")
    single = tmp_path / "single.h5"
    assert runner.invoke(main, ["ckpt", "convert", str(path), "-o", str(single)]).exit_code == 0
    result = runner.invoke(main, ["ckpt", "convert", str(single), "-o", str(tmp_path / "back"),
                                  "--files", "2"])
    assert result.exit_code == 0, result.output
    assert runner.invoke(main, ["ckpt", "verify", str(tmp_path / "back")]).exit_code == 0
    result = runner.invoke(main, ["ckpt", "verify", str(tmp_path)])
    assert result.exit_code == 2 and "holds no checkpoint" in result.output
    lost = tmp_path / "lost"  # step folders whose 'latest' is gone: they are named
    shutil.copytree(path, lost / path.name)
    result = runner.invoke(main, ["ckpt", "verify", str(lost)])
    assert result.exit_code == 2 and (f"it has 1 complete step folder(s), the newest "
                                      f"{lost / path.name}: give one of them") in result.output


@pytest.mark.parametrize("command", ["ckpt", "ckpt inspect", "ckpt verify", "ckpt convert",
                                     "train"])
def test_every_command_documents_itself_with_examples(command):
    result = CliRunner().invoke(main, [*command.split(), "--help"])
    assert result.exit_code == 0 and "Examples:" in result.output
    if command == "train":
        for option in ("--resume", "--save-interval", "--keep"):
            assert option in result.output


# ---------------------------------------------------------------------------------
# hpctrain train --resume, through mpiexec

CONFIG = tiny_gpt_template(train="steps = 6\nbatch_size = 4\nsave_interval = 3",
                           parallel="bucket_mb = 0.01")


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    return tiny_corpus_config(tmp_path_factory.mktemp("ckpt_cli"), CONFIG,
                              "the quality of mercy is not strained.", 300)


def train_cli(config_file, ranks, run_dir, *flags):
    result = run_train(ranks, config_file, run_dir, *flags)
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").open()] \
        if (run_dir / "metrics.jsonl").exists() else []
    return result, losses


@pytest.fixture(scope="module")
def uninterrupted(config_file):
    """Six steps at dp = 2, saving after steps 3 and 6."""
    run_dir = config_file.parent / "whole"
    result, losses = train_cli(config_file, 2, run_dir)
    assert result.returncode == 0, result.stderr
    return run_dir, losses


def stopped_after_3(uninterrupted, run_dir) -> Path:
    """A run folder as if its job had ended after the save of step 3."""
    source = uninterrupted[0] / "checkpoints" / "step-000003"
    shutil.copytree(source, run_dir / "checkpoints" / source.name)
    (run_dir / "checkpoints" / "latest").write_text(source.name + "\n")
    return run_dir


@pytest.mark.slow
def test_resume_auto_gives_the_bitwise_losses_of_an_uninterrupted_run(config_file,
                                                                      uninterrupted):
    run_dir = stopped_after_3(uninterrupted, config_file.parent / "resumed")
    result, losses = train_cli(config_file, 2, run_dir, "--resume", "auto")
    assert result.returncode == 0, result.stderr
    assert "resumed from" in result.stdout
    assert losses == uninterrupted[1][3:]  # bitwise
    result, losses = train_cli(config_file, 1, config_file.parent / "fresh", "--resume",
                               "auto", "--steps", "6")
    assert result.returncode == 0 and len(losses) == 6  # nothing to resume: from scratch


def test_a_fresh_run_does_not_overwrite_an_earlier_runs_checkpoints(config_file,
                                                                     uninterrupted):
    """Without --resume, a run saving into a folder that holds checkpoints is refused
    before anything is written; the folder, its latest and its metrics stay as they were."""
    run_dir = stopped_after_3(uninterrupted, config_file.parent / "again")
    (run_dir / "metrics.jsonl").write_text('{"step": 3, "loss": 1.0}\n')
    before = {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
    result, _ = train_cli(config_file, 1, run_dir, "--steps", "6")
    assert result.returncode != 0
    assert "already holds an earlier run's checkpoints (latest: step-000003)" in \
        result.stderr and "--resume auto" in result.stderr
    assert {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()} == before


def test_a_second_fresh_run_keeps_the_first_runs_metrics_and_config(config_file):
    """Two runs into one folder, without checkpoints: the first run's records and
    config are renamed, not replaced, and the second run says so."""
    run_dir = config_file.parent / "twice"
    first, losses = train_cli(config_file, 1, run_dir, "--steps", "2", "--save-interval", "0")
    assert first.returncode == 0, first.stderr
    records, config = ((run_dir / name).read_bytes() for name in ("metrics.jsonl",
                                                                   "config.json"))
    second, again = train_cli(config_file, 1, run_dir, "--steps", "3", "--save-interval",
                              "0", "--lr", "1e-4")
    assert second.returncode == 0, second.stderr
    assert "held an earlier run's records: kept as metrics.1.jsonl and config.1.json" in \
        second.stdout
    assert (run_dir / "metrics.1.jsonl").read_bytes() == records and len(losses) == 2
    assert (run_dir / "config.1.json").read_bytes() == config
    assert len(again) == 3 and json.loads((run_dir / "config.json").read_text())[
        "train"]["lr"] == 1e-4


@pytest.mark.slow
def test_resume_at_another_layout_matches_to_float_tolerance(config_file, uninterrupted):
    run_dir = stopped_after_3(uninterrupted, config_file.parent / "resharded")
    result, losses = train_cli(config_file, 2, run_dir, "--resume", "auto", "--tp", "2",
                               "--zero", "0")
    assert result.returncode == 0, result.stderr
    np.testing.assert_allclose(losses, uninterrupted[1][3:], rtol=1e-10)


@pytest.mark.slow
def test_resume_from_a_corrupt_checkpoint_names_the_file_and_tensor(config_file,
                                                                    uninterrupted):
    run_dir = stopped_after_3(uninterrupted, config_file.parent / "corrupt")
    folder = run_dir / "checkpoints" / "step-000003"
    with Checkpoint(folder) as ck:
        piece = ck.tensors["model/blocks.0.attn.proj.weight"].pieces[0]
    flip_byte_of(folder, "model/blocks.0.attn.proj.weight")
    result, _ = train_cli(config_file, 2, run_dir, "--resume", "auto")
    assert result.returncode == 2
    assert piece.file in result.stderr and "model/blocks.0.attn.proj.weight" in result.stderr
    assert "checksum mismatch" in result.stderr and "Traceback" not in result.stderr


def test_full_box_of_a_scalar_is_empty():
    assert full_box(()) == () and box_volume(()) == 1
