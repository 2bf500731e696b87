"""``hpctrain ckpt`` on what it must refuse or report once: ``convert`` onto outputs it
would destroy or move back (nothing is written when it refuses), ``verify`` of a
checkpoint with a file HDF5 cannot open, ``inspect`` of a file that is no checkpoint.
Serial, without mpiexec."""

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_checkpoint import Serial, flip_byte_of, make_cfg

from hpctrain.checkpoint import Checkpoint, verify
from hpctrain.checkpoint import format as fmt
from hpctrain.checkpoint.consolidate import consolidate, expand
from hpctrain.cli import main


@pytest.fixture
def checkpoints(tmp_path):
    """A serial run's checkpoints folder holding steps 2 and 4 (``latest``: step 4)."""
    run = Serial(make_cfg(tmp_path)).train(2)
    run.save(2)
    return run.train(2).save(4).parent


def ckpt(*args) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["ckpt", *map(str, args)])
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        result.output  # an error message, never a traceback
    return result.exit_code, result.output


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` and its bytes (folders as None)."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None
            for p in sorted(folder.rglob("*"))}


def test_convert_of_a_file_refuses_a_file_as_its_folder_even_with_force(checkpoints,
                                                                          tmp_path):
    single = consolidate(checkpoints, tmp_path / "four.h5")
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint\n")
    before = single.read_bytes()
    for force in ([], ["--force"]):
        code, out = ckpt("convert", single, "-o", single, *force)
        assert code == 2 and out.count("\n") == 1, out
        assert f"error: {single}: is the file being converted; refusing to write over it " \
            "even with --force" in out
        code, out = ckpt("convert", single, "-o", text, *force)
        assert code == 2 and out.count("\n") == 1, out
        assert f"error: {text}: exists and is not a folder" in out
    assert single.read_bytes() == before and text.read_text() == "not a checkpoint\n"


def test_convert_into_a_checkpoints_folder_needs_force_to_replace_a_step_or_move_latest_back(
        checkpoints, tmp_path):
    two = consolidate(checkpoints / "step-000002", tmp_path / "two.h5")
    before = snapshot(checkpoints)
    code, out = ckpt("convert", two, "-o", checkpoints)
    assert code == 2 and out.count("\n") == 1, out
    assert f"{checkpoints / 'step-000002'}: already exists; " in out
    assert f"{checkpoints / 'latest'}: names step-000004, a later step than 2" in out
    assert "pass --force to replace step-000002/ and move latest back to step-000002" in out
    assert snapshot(checkpoints) == before

    shutil.rmtree(checkpoints / "step-000002")  # only latest is in the way now
    before = snapshot(checkpoints)
    code, out = ckpt("convert", two, "-o", checkpoints)
    assert code == 2 and "already exists" not in out, out
    assert out.endswith("; pass --force to move latest back to step-000002\n")
    assert snapshot(checkpoints) == before

    code, out = ckpt("convert", two, "-o", checkpoints, "--force")
    assert code == 0, out
    assert (checkpoints / "latest").read_text().strip() == "step-000002"
    assert {k: v for k, v in snapshot(checkpoints).items() if "step-000004" in k} == \
        {k: v for k, v in before.items() if "step-000004" in k}
    assert not verify(checkpoints)[1]


def test_convert_into_a_checkpoints_folder_adds_a_later_step_without_force(checkpoints,
                                                                           tmp_path):
    four = consolidate(checkpoints, tmp_path / "four.h5")
    older = tmp_path / "older"
    expand(checkpoints / "step-000002", older)
    code, out = ckpt("convert", four, "-o", older)
    assert code == 0, out
    assert (older / "latest").read_text().strip() == "step-000004"
    assert (older / "step-000002" / fmt.INDEX_NAME).is_file()


def test_convert_of_a_file_refuses_a_folder_that_holds_no_checkpoints(checkpoints, tmp_path):
    """A run folder (its checkpoints under checkpoints/): a latest written beside them
    would change what ``--resume RUN`` loads."""
    four = consolidate(checkpoints, tmp_path / "four.h5")
    run = checkpoints.parent
    before = snapshot(run)
    code, out = ckpt("convert", four, "-o", run)
    assert code == 2 and f"{run}: already exists and is not a checkpoints folder (it has " \
        "no 'latest' pointer); pass --force" in out
    assert snapshot(run) == before


def test_convert_to_a_file_refuses_an_empty_folder_without_force_and_its_own_files(
        checkpoints, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out = ckpt("convert", checkpoints, "-o", empty)
    assert code == 2 and f"error: {empty}: already exists (a folder); pass --force" in out
    assert empty.is_dir() and not any(empty.iterdir())
    step = checkpoints / "step-000004"
    before = snapshot(step)
    for own in (step / fmt.INDEX_NAME, step / fmt.data_filename(0)):
        code, out = ckpt("convert", checkpoints, "-o", own, "--force")
        assert code == 2 and f"{own}: is a file of the checkpoint being converted" in out
    assert snapshot(step) == before
    full = tmp_path / "parts"  # a dataset's partitions: --force replaced the folder
    full.mkdir()
    (full / "manifest.h5").write_bytes(b"")
    code, out = ckpt("convert", checkpoints, "-o", full, "--force")
    assert code == 2 and f"{full}: is a folder that holds files; the converted " in out, out
    assert (full / "manifest.h5").is_file()
    code, out = ckpt("convert", checkpoints, "-o", empty, "--force")
    assert code == 0 and empty.is_file(), out


def test_verify_names_a_file_hdf5_cannot_open_once_and_checks_the_others(checkpoints,
                                                                        tmp_path):
    folder = expand(checkpoints, tmp_path / "two-files", files=2)
    broken = folder / fmt.data_filename(1)
    broken.write_bytes(broken.read_bytes()[:4096])
    flip_byte_of(folder, "model/embed.wte.weight")  # in rank-00000.h5: still read
    with Checkpoint(folder) as ck:
        held = [e.name for e in ck.tensors.values() for p in e.pieces
                if p.file == broken.name]
    _, problems = verify(folder)
    assert len(problems) == 2, problems
    assert str(broken) in problems[0] and "cannot be read as HDF5" in problems[0]
    assert f"which holds {len(held)} piece(s) of {len(set(held))} tensor(s), none of them " \
        "verified" in problems[0] and len(held) > 40
    assert str(folder / fmt.data_filename(0)) in problems[1]
    assert "model/embed.wte.weight" in problems[1] and "checksum mismatch" in problems[1]
    code, out = ckpt("verify", folder)
    assert code == 2 and out.count("\n") == 2, out


def test_inspect_of_a_file_that_is_not_hdf5_says_so_without_the_remedy(checkpoints,
                                                                      tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 4.2}\n')
    for command in ("inspect", "verify"):
        code, out = ckpt(command, metrics)
        assert code == 2 and out == f"error: {metrics}: not an hpctrain checkpoint (not an " \
            "HDF5 file); give a run folder, a checkpoints folder, a step folder or a " \
            "consolidated .h5 file\n"
    single = consolidate(checkpoints, tmp_path / "four.h5")  # damaged, not foreign
    single.write_bytes(single.read_bytes()[:4096])
    code, out = ckpt("inspect", single)
    assert code == 2 and "cannot be read as HDF5" in out and fmt.REMEDY in out


def test_inspect_shows_the_averaging_and_the_shares_a_resume_needs(tmp_path):
    """A run with averaging other than sync resumes only with the same strategy and
    dp, at its position in the period; measured shares come back: inspect shows both."""
    cfg = make_cfg(tmp_path)
    cfg = replace(cfg, parallel=replace(cfg.parallel, averaging="diloco", average_every=3))
    run = Serial(cfg.validate(1)).train(2)
    path = run.save(2, extra={"shares": {"shares": [4]}})
    code, out = ckpt("inspect", path, "--no-tensors")
    assert code == 0, out
    assert ('  averaging {"dp": 1, "every": 3, "strategy": "diloco", "sync_steps": 0, '
            '"t": 2, "weighted": false}') in out.splitlines()
    assert '  shares {"shares": [4]}' in out.splitlines()
    assert "  saved at world_size=1 dp=1 tp=1 pp=1 zero=0" in out.splitlines()  # sp 1: unsaid


def test_the_saved_layout_names_the_spatial_split():
    from hpctrain.checkpoint.state import layout_of
    from hpctrain.config import Config, ModelConfig, ParallelConfig, TrainConfig

    cfg = Config(model=ModelConfig(kind="cnn", input_dim=64, channels=(2, 3)),
                 parallel=ParallelConfig(sp=2), train=TrainConfig(batch_size=4)).validate(4)
    assert {"world_size": 4, "dp": 2, "sp": 2, "tp": 1}.items() <= layout_of(cfg, 4).items()


def test_convert_never_replaces_the_step_folder_that_holds_its_input(checkpoints):
    """A consolidated file kept inside a step folder, converted back into that folder
    with --force: the step folder is the one the write replaces, so the input would be
    deleted with it; refused, the file intact."""
    inside = consolidate(checkpoints / "step-000004", checkpoints / "step-000004" / "all.h5")
    before = snapshot(checkpoints)
    for force in ([], ["--force"]):
        code, out = ckpt("convert", inside, "-o", checkpoints, *force)
        assert code == 2 and out.count("\n") == 1, out
        assert f"error: {inside}: the file being converted is inside " \
            f"{checkpoints / 'step-000004'}, which writing step-000004/" in out
        assert "refusing even with --force" in out
    assert snapshot(checkpoints) == before


def test_convert_never_writes_over_the_latest_pointer_and_a_broken_pointer_is_named(
        checkpoints):
    pointer = checkpoints / fmt.LATEST_NAME
    for force in ([], ["--force"]):
        code, out = ckpt("convert", checkpoints / "step-000002", "-o", pointer, *force)
        assert code == 2 and out.count("\n") == 1, out
        assert f"error: {pointer}: is (or would be) the 'latest' pointer" in out
    assert pointer.read_text().strip() == "step-000004"
    # a pointer written over by another program: named, no traceback
    consolidate(checkpoints / "step-000002", checkpoints.parent / "two.h5")
    shutil.copyfile(checkpoints.parent / "two.h5", pointer)
    for command in ("inspect", "verify"):
        code, out = ckpt(command, checkpoints)
        assert code == 2, out
        assert f"{pointer}: names no step (" in out and "not a step name" in out, out


def test_a_convert_refused_by_a_bad_piece_leaves_no_folder_behind(checkpoints, tmp_path):
    import h5py

    single = consolidate(checkpoints, tmp_path / "four.h5")
    with h5py.File(single, "r+") as f:
        found = []
        f["data"].visititems(lambda _, obj: found.append(obj)
                             if isinstance(obj, h5py.Dataset) else None)
        found[0][...] = found[0][...] + 1  # its checksum no longer matches
    code, out = ckpt("convert", single, "-o", tmp_path / "new" / "checkpoints")
    assert code == 2 and "checksum" in out, out
    assert not (tmp_path / "new").exists()
    # into an existing folder: the conversion's own folder is removed, the folder kept
    (tmp_path / "kept").mkdir()
    code, out = ckpt("convert", single, "-o", tmp_path / "kept")
    assert code == 2 and list((tmp_path / "kept").iterdir()) == [], out
    # the folders it made for the output are removed too
    code, out = ckpt("convert", single, "-o", tmp_path / "a" / "b" / "checkpoints")
    assert code == 2 and not (tmp_path / "a").exists(), out


def test_convert_leaves_another_saves_unfinished_folder_alone(checkpoints, tmp_path):
    """A run saving into the folder while a file is converted there: its unfinished
    step-N.tmp/ is its own (the conversion writes a folder of its own), and a folder
    the conversion made for itself is removed when it is refused."""
    single = consolidate(checkpoints / "step-000002", tmp_path / "two.h5")
    saving = checkpoints / "step-000006.tmp"
    saving.mkdir()
    (saving / "rank-00000.h5").write_bytes(b"being written")
    code, out = ckpt("convert", single, "-o", checkpoints, "--force")
    assert code == 0, out
    assert (saving / "rank-00000.h5").read_bytes() == b"being written"
    assert (checkpoints / fmt.LATEST_NAME).read_text().strip() == "step-000002"
    assert not list(checkpoints.glob("*.convert-*"))
