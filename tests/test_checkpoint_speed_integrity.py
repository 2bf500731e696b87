"""The fast checkpoint path keeps its guarantees: the blocksum64 checksum against a
plain-Python reference and against every flipped byte, format version 3 (one flat
dataset per dtype, each piece at a recorded position, the checksum named in the
index) readable by plain h5py, version 2 (a dataset per piece at a recorded offset)
and version 1 (sha256) checkpoints still loading, an unknown version refused by name,
and unfinished saves removed with a line saying so, at the next save and at resume."""

import json
import os
from pathlib import Path

import h5py
import numpy as np
import pytest
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
from hpctrain.checkpoint.reshard import box_name
from hpctrain.checkpoint.state import held_tensors
from hpctrain.checkpoint.training import NonFiniteState
from hpctrain.config import Config, ModelConfig, TrainConfig
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.topology import Topology
from hpctrain.train import make_data_parallel

MODEL = ModelConfig(n_layer=2, d_model=16, n_head=2, seq_len=8, vocab_size=32, dtype="float64")


def reference_blocksum64(a: np.ndarray) -> str:
    """The definition, word by word in Python integers."""
    data = np.ascontiguousarray(a).tobytes()
    data += bytes(-len(data) % 8)
    words = [int.from_bytes(data[i:i + 8], "little") for i in range(0, len(data), 8)]
    total = sum(words) % 2**64
    weighted = sum((i // 512 + 1) * w for i, w in enumerate(words)) % 2**64
    return f"{total:016x}{weighted:016x}"


@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 4095, 4096, 4096 * 3 + 13, 50_000])
def test_blocksum64_is_its_definition(nbytes):
    a = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    assert fmt.blocksum64(a) == reference_blocksum64(a)
    f = np.random.default_rng(1).standard_normal((nbytes // 8 + 1, 3)).astype(np.float32)
    assert fmt.blocksum64(f) == reference_blocksum64(f)
    assert fmt.blocksum64(f.T) == reference_blocksum64(f.T)  # C order of the values


def test_blocksum64_catches_every_flipped_byte_and_a_swapped_block():
    data = np.random.default_rng(0).integers(0, 256, 3 * 4096 + 21, dtype=np.uint8)
    good = fmt.blocksum64(data)
    flips = np.random.default_rng(1).integers(1, 256, data.size, dtype=np.uint8)
    for i in range(data.size):  # every position, each with some nonzero xor
        bad = data.copy()
        bad[i] ^= flips[i]
        assert fmt.blocksum64(bad) != good, i
    swapped = data.copy()
    swapped[:4096], swapped[4096:8192] = data[4096:8192], data[:4096]
    assert fmt.blocksum64(swapped) != good  # the same words, in other blocks


def serial(tmp_path, **train):
    cfg = Config(model=MODEL, train=TrainConfig(batch_size=4, run_dir=str(tmp_path / "run"),
                                                **train)).validate(1)
    topo = Topology.build(MPI.COMM_SELF, cfg.parallel)
    engine = build_engine(cfg, topo)
    dp = make_data_parallel(cfg, engine, topo)
    rng = np.random.default_rng(0)
    for h in held_tensors(engine, dp, 0, 1):  # optimizer state too, not zeros
        h.array[...] = rng.standard_normal(h.array.shape)
    return cfg, topo, engine, dp


def held_copy(engine, dp) -> dict[str, np.ndarray]:
    return {h.name: h.array.copy() for h in held_tensors(engine, dp, 0, 1)}


def test_version_4_is_one_flat_dataset_per_dtype_and_plain_hdf5(tmp_path):
    cfg, topo, engine, dp = serial(tmp_path)
    want = held_copy(engine, dp)
    path = save_training(cfg, topo, engine, dp, step=1, loader_state=None)
    with h5py.File(path / fmt.INDEX_NAME) as f:
        assert f.attrs["version"] == 4 and f.attrs["checksum"] == "blocksum64"
        # the piece table as arrays: one row, box and checksum per piece
        n = len(want)
        assert f["pieces"].shape == (n, 3) and f["checksums"].shape == (n,)
        assert json.loads(f.attrs["datasets"]) == ["float64"]
    with Checkpoint(path) as ck:
        entries = list(ck.tensors.values())
    assert all(p.at is not None and p.dataset == "float64" for e in entries for p in e.pieces)
    with h5py.File(path / fmt.data_filename(0)) as f:  # any HDF5 reader sees the values
        assert list(f) == ["float64"]  # one dataset, whatever the number of tensors
        flat = f["float64"]
        assert flat.shape == (sum(a.size for a in want.values()),) and flat.chunks is None
        for e in entries:
            (piece,) = e.pieces
            n = int(np.prod(e.global_shape))
            np.testing.assert_array_equal(flat[piece.at:piece.at + n].reshape(e.global_shape),
                                          want[e.name])
            assert fmt.blocksum64(want[e.name]) == piece.checksum


def piece_offset(path: Path, tensor: str) -> tuple[Path, int, int]:
    """The file, byte offset and byte length of a tensor's only piece (version 3)."""
    with Checkpoint(path) as ck:
        entry = ck.tensors[tensor]
    (piece,) = entry.pieces
    with h5py.File(path / piece.file) as f:
        base = f[piece.dataset].id.get_offset()
    itemsize = np.dtype(entry.dtype).itemsize
    return (path / piece.file, base + piece.at * itemsize,
            int(np.prod(entry.global_shape)) * itemsize)


def test_a_flipped_last_byte_is_caught_by_the_raw_read(tmp_path):
    cfg, topo, engine, dp = serial(tmp_path)
    path = save_training(cfg, topo, engine, dp, step=1, loader_state=None)
    file, offset, nbytes = piece_offset(path, "model/blocks.0.attn.qkv.weight")
    with open(file, "r+b") as fh:  # the piece's last byte: the padded tail
        fh.seek(offset + nbytes - 1)
        byte = fh.read(1)
        fh.seek(offset + nbytes - 1)
        fh.write(bytes([byte[0] ^ 0x01]))
    _, problems = verify(path)
    assert len(problems) == 1 and "checksum mismatch (blocksum64" in problems[0]
    assert "model/blocks.0.attn.qkv.weight" in problems[0]
    with pytest.raises(CheckpointError, match="rank-00000.h5: tensor model/blocks.0.attn.qkv"):
        load_training(path, cfg, topo, engine, dp)


def as_old_version(path: Path, version: int) -> None:
    """Rewrite a serial checkpoint as an older version wrote it: a dataset
    ``/<tensor>/<box>`` per piece; version 2 with blocksum64 checksums and each
    dataset's file offset as the sixth field, version 1 with sha256 checksums, no
    offsets and no ``checksum`` attribute."""
    index = fmt.read_index(path / fmt.INDEX_NAME)
    with Checkpoint(path) as ck:
        values = {e.name: ck.read_full(e.name) for e in index.tensors.values()}
    data = path / fmt.data_filename(0)
    data.unlink()
    entries, algorithm = [], "sha256" if version == 1 else "blocksum64"
    with h5py.File(data, "w-") as f:
        f.attrs.update({"format": fmt.DATA, "version": version, "step": index.step,
                        "rank": 0})
        for e in index.tensors.values():
            (piece,) = e.pieces
            name = f"{e.name}/{box_name(piece.box)}"
            dset = f.create_dataset(name, data=values[e.name])
            offset = dset.id.get_offset() if version == 2 else None
            old = fmt.Piece(data.name, name, piece.start, piece.stop,
                            fmt.checksum_of(algorithm, values[e.name]), offset)
            entries.append(fmt.TensorEntry(e.name, e.dtype, e.global_shape, e.tp_split,
                                           e.tp_blocks, (old,)))
    (path / fmt.INDEX_NAME).unlink()
    with h5py.File(path / fmt.INDEX_NAME, "w-") as f:
        fmt.write_index(f, step=index.step, meta=index.meta, files=index.files,
                        tensors=entries, version=3)  # the JSON table
        f.attrs["version"] = version
        if version == 1:
            del f.attrs["checksum"]
        text = f["tensors"][...].tobytes()
    # what the writer stores as the sixth field is version 3's ``at``: put the offset
    with h5py.File(path / fmt.INDEX_NAME, "r+") as f:
        table = json.loads(text)
        for t, e in zip(table, entries, strict=True):
            t["pieces"] = [[*row[:5], e.pieces[0].offset] for row in t["pieces"]]
        del f["tensors"]
        raw = np.frombuffer(json.dumps(table).encode(), np.uint8)
        f.create_dataset("tensors", data=raw).attrs["sha256"] = fmt.sha256_array(raw)


def _rewritten_loads(tmp_path, rewrite):
    """Save, ``rewrite(path)`` the checkpoint as an older version wrote it, load it into
    a zeroed engine and compare with what was saved; (path, cfg, topo, that engine, its
    data-parallel wrapper)."""
    cfg, topo, engine, dp = serial(tmp_path)
    want = held_copy(engine, dp)
    path = save_training(cfg, topo, engine, dp, step=1, loader_state={"step": 1})
    rewrite(path)
    _, _, engine2, dp2 = serial(tmp_path / "fresh")
    for h in held_tensors(engine2, dp2, 0, 1):
        h.array[...] = 0
    assert load_training(path, cfg, topo, engine2, dp2).step == 1
    got = held_copy(engine2, dp2)
    assert all(np.array_equal(got[k], want[k]) for k in want)
    return path, cfg, topo, engine2, dp2


def _old_version_loads_and_is_checked(tmp_path, version: int):
    """Save, rewrite as ``version``, load into a zeroed engine, then flip a value:
    the checkpoint as the reader of ``version`` sees it."""
    path, *_ = _rewritten_loads(tmp_path, lambda p: as_old_version(p, version))
    with h5py.File(path / fmt.data_filename(0), "r+") as f:
        f["model/head.lm_head.weight/0:16,0:32"][0, 0] += 1.0
    return path, verify(path)


def test_a_version_2_checkpoint_still_loads_raw_and_is_checked(tmp_path):
    path, (_, problems) = _old_version_loads_and_is_checked(tmp_path, 2)
    with Checkpoint(path) as ck:
        assert all(p.offset is not None and p.at is None for e in ck.tensors.values()
                   for p in e.pieces)
    assert len(problems) == 1 and "checksum mismatch (blocksum64" in problems[0]


def test_an_unknown_version_is_refused_by_name(tmp_path):
    cfg, topo, engine, dp = serial(tmp_path)
    path = save_training(cfg, topo, engine, dp, step=1, loader_state=None)
    with h5py.File(path / fmt.INDEX_NAME, "r+") as f:
        f.attrs["version"] = 5
    with pytest.raises(CheckpointError, match=r"hpctrain.checkpoint version 5 is not "
                                              r"supported \(this hpctrain reads versions "
                                              r"1, 2, 3, 4\); a newer hpctrain wrote it"):
        Checkpoint(path)


def test_a_version_3_checkpoint_its_table_in_json_still_loads_and_is_checked(tmp_path):
    """Version 3: the data files as now, the piece table one JSON text."""
    def as_version_3(path):
        index = fmt.read_index(path / fmt.INDEX_NAME)
        (path / fmt.INDEX_NAME).unlink()
        with h5py.File(path / fmt.INDEX_NAME, "w-") as f:
            fmt.write_index(f, step=index.step, meta=index.meta, files=index.files,
                            tensors=list(index.tensors.values()), version=3)
            assert list(f) == ["tensors"]
        with h5py.File(path / fmt.data_filename(0), "r+") as f:
            f.attrs["version"] = 3

    path, cfg, topo, engine2, dp2 = _rewritten_loads(tmp_path, as_version_3)
    with Checkpoint(path) as ck:
        assert ck.index.tensors["model/head.lm_head.weight"].table is None  # from JSON
    file, offset, _ = piece_offset(path, "model/head.lm_head.weight")
    with open(file, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CheckpointError, match=r"tensor model/head.lm_head.weight, piece "
                                              r"0:16,0:32: checksum mismatch"):
        load_training(path, cfg, topo, engine2, dp2)


@pytest.mark.parametrize("damage", ["flipped", "resized", "pointed"])
def test_a_damaged_piece_table_is_refused(tmp_path, damage):
    """Version 4's arrays: a changed byte fails the table's sha256; parts that disagree,
    or a piece naming a file that is not in the index, are refused even with fresh
    checksums; nothing is read either way."""
    cfg, topo, engine, dp = serial(tmp_path)
    path = save_training(cfg, topo, engine, dp, step=1, loader_state=None)
    with h5py.File(path / fmt.INDEX_NAME, "r+") as f:
        if damage == "flipped":
            boxes = f["boxes"]
            boxes[3] = boxes[3] + 1  # its sha256 now disagrees
        else:
            name = "boxes" if damage == "resized" else "pieces"
            data = f[name][...]
            if damage == "resized":
                data = data[:-1]
            else:
                data[0, 0] = 7  # file 7 of 1
            del f[name]
            f.create_dataset(name, data=data)
            sums = json.loads(f.attrs["table_sha256"])
            f.attrs["table_sha256"] = json.dumps({**sums, name: fmt.sha256_array(data)})
    problem = {"flipped": "dataset boxes fails its sha256 check",
               "resized": "the piece table's parts disagree",
               "pointed": "a piece names a file, a dataset or a position out of range"}
    with pytest.raises(CheckpointError, match=r"index.h5: the piece table is incomplete or "
                                              rf"corrupt \({problem[damage]}"):
        load_training(path, cfg, topo, engine, dp)


def test_the_piece_table_makes_pieces_only_when_asked(tmp_path):
    """A version 4 index opens without making a Piece per piece (a large job's index
    holds a quarter of a million); the pieces made on demand are the written ones."""
    cfg, topo, engine, dp = serial(tmp_path)
    path = save_training(cfg, topo, engine, dp, step=1, loader_state=None)
    entries = [fmt.TensorEntry(f"t{k}", "float32", (8 * 64, 3), None, 1, tuple(
        fmt.Piece(f"f{r % 3}", ("float32", "other")[r % 2], (8 * r, 0), (8 * r + 8, 3),
                  f"{r:032x}", None, None if r == 5 else 24 * r) for r in range(64)))
        for k in range(3)]
    entries.append(fmt.TensorEntry("scalar", "float64", (), None, 1,
                                   (fmt.Piece("f1", "float64", (), (), "0" * 32, None, 0),)))
    with h5py.File(path / "big.h5", "w-") as f:
        fmt.write_index(f, step=1, meta={}, files=["f0", "f1", "f2"], tensors=entries)
    index = fmt.read_index(path / "big.h5")
    assert all(e._pieces is None for e in index.tensors.values())
    for e in entries:
        got = index.tensors[e.name]
        assert (got.global_shape, got.dtype, len(got)) == (e.global_shape, e.dtype, len(e))
        assert got.pieces == e.pieces
        start, stop = got.bounds()
        assert start.shape == stop.shape == (len(e), len(e.global_shape))


def test_a_version_1_sha256_checkpoint_still_loads_and_is_checked(tmp_path):
    _, (ck, problems) = _old_version_loads_and_is_checked(tmp_path, 1)
    assert ck.index.checksum == "sha256"
    assert len(problems) == 1 and "checksum mismatch (sha256" in problems[0]


def test_an_unknown_checksum_algorithm_is_refused_by_name(tmp_path):
    cfg, topo, engine, dp = serial(tmp_path)
    path = save_training(cfg, topo, engine, dp, step=1, loader_state=None)
    with h5py.File(path / fmt.INDEX_NAME, "r+") as f:
        f.attrs["checksum"] = "crc64"
    with pytest.raises(CheckpointError, match=r"'crc64' checksums, which this hpctrain "
                                              r"cannot check \(it knows blocksum64, sha256\)"):
        Checkpoint(path)


def test_unfinished_saves_are_removed_at_the_next_save_and_at_resume_saying_so(tmp_path,
                                                                               capsys):
    cfg, topo, engine, dp = serial(tmp_path, keep_checkpoints=5)
    root = Path(cfg.train.run_dir) / "checkpoints"
    save_training(cfg, topo, engine, dp, step=1, loader_state=None)
    (root / "step-000002.tmp").mkdir()  # a save that ran out of disk, or was killed
    (root / "step-000002.tmp" / "rank-00000.h5").write_bytes(b"half")
    capsys.readouterr()
    path = save_training(cfg, topo, engine, dp, step=3, loader_state=None)
    out = capsys.readouterr().out
    assert "removed 1 unfinished checkpoint folder(s)" in out and "step-000002.tmp" in out
    assert not (root / "step-000002.tmp").exists()

    (root / "step-000004.tmp").mkdir()  # killed again; this time the run resumes
    lines = []
    load_training(path, cfg, topo, engine, dp, say=lines.append)
    assert len(lines) == 1 and "step-000004.tmp" in lines[0]
    assert not (root / "step-000004.tmp").exists()
    load_training(path, cfg, topo, engine, dp, say=lines.append)
    assert len(lines) == 1  # nothing stale: nothing said
    writer.wait_for_pruning()


def test_a_checkpoint_cut_off_while_a_save_of_its_step_replaced_it_is_restored(tmp_path):
    """A save of a step that already had a checkpoint renames the old one
    step-N.old.tmp, then its own in; killed between the two, the next save or resume
    removed both as unfinished (every step-*.tmp) and 'latest' named nothing."""
    cfg, topo, engine, dp = serial(tmp_path)
    root = Path(cfg.train.run_dir) / "checkpoints"
    path = save_training(cfg, topo, engine, dp, step=1, loader_state=None)
    path.rename(root / "step-000001.old.tmp")  # the moment between the two renames
    (root / "step-000001.tmp").mkdir()
    lines = []
    assert writer.remove_stale(root, lines.append) == ["step-000001.tmp"]
    assert lines[0] == f"restored {path} (a save of the same step was cut off while " \
                       f"replacing it)"
    assert fmt.latest_checkpoint(root) == path and (path / fmt.INDEX_NAME).is_file()
    load_training(path, cfg, topo, engine, dp)  # whole: every checksum holds


def test_a_load_reads_the_pieces_of_a_file_in_one_preadv(tmp_path, monkeypatch):
    cfg, topo, engine, dp = serial(tmp_path)
    want = held_copy(engine, dp)
    path = save_training(cfg, topo, engine, dp, step=1, loader_state=None)
    calls = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, views, offset: calls.append(len(views))
                        or real(fd, views, offset))
    _, _, engine2, dp2 = serial(tmp_path / "fresh")
    load_training(path, cfg, topo, engine2, dp2)
    with Checkpoint(path) as ck:
        pieces = sum(len(e.pieces) for e in ck.tensors.values())
    assert calls == [pieces]  # every piece lies next to the last one: one read of all
    got = held_copy(engine2, dp2)
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_the_finite_check_runs_in_the_write_and_leaves_nothing(tmp_path):
    cfg, topo, engine, dp = serial(tmp_path)
    root = Path(cfg.train.run_dir) / "checkpoints"
    save_training(cfg, topo, engine, dp, step=1, loader_state=None)
    m = next(h for h in held_tensors(engine, dp, 0, 1) if h.name.startswith("optim/v/"))
    m.array.reshape(-1)[-1] = np.inf  # the optimizer state, the last value of a tensor
    events = []
    with pytest.raises(NonFiniteState, match=rf"after step 2 is not finite: {m.name} holds "
                                             r"nan or inf; no checkpoint written"):
        save_training(cfg, topo, engine, dp, step=2, loader_state=None,
                      on_event=lambda kind, _: events.append(kind))
    assert "file" in events  # checked beside the write, not before it
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]
    assert (root / fmt.LATEST_NAME).read_text().strip() == "step-000001"


def test_blocksum64_packed_is_blocksum64_of_each_piece():
    from hpctrain.checkpoint.direct import aligned_empty

    rng = np.random.default_rng(0)
    for trial in range(50):
        sizes = [8 * int(n) for n in rng.integers(0, 1200, rng.integers(1, 9))]
        sizes += [0, 4096, 8 * 513] if trial % 2 else []
        buf = aligned_empty(sum(sizes) + 8)
        buf[:] = rng.integers(0, 256, buf.size, dtype=np.uint8)
        want, at = [], 0
        for n in sizes:
            want.append(fmt.blocksum64(buf[at:at + n]))
            at += n
        assert fmt.blocksum64_packed(buf, sizes) == want, sizes
    assert fmt.blocksum64_packed(buf, [4, 12]) is None  # not on 64-bit words: per piece


def test_the_shares_of_the_checks_cover_every_run_once(tmp_path):
    from hpctrain.checkpoint.reader import share_owners

    sizes = [5, 1, 9, 3, 3, 7]
    for n in (1, 2, 3, 4):
        owners = share_owners(sizes, n)
        shares = [[who == k for who in owners] for k in range(n)]
        assert [sum(col) for col in zip(*shares, strict=True)] == [1] * len(sizes)
    cfg, topo, engine, dp = serial(tmp_path)
    path = save_training(cfg, topo, engine, dp, step=1, loader_state=None)
    with Checkpoint(path) as ck, pytest.raises(ValueError, match="share"):
        ck.read_held(held_tensors(engine, dp, 0, 1), share=(2, 2))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_the_held_arrays_are_64_byte_aligned_where_they_are_made(tmp_path, optimizer):
    """Parameters and optimizer state start on 64-byte boundaries, as the pieces lie in
    a data file (the kernel's copy out of the page cache is fastest so): made so by
    ``Parameter`` and the optimizers, not copied at load; NumPy's own are 16-aligned."""
    from hpctrain.nn.module import ALIGN, Parameter, aligned, aligned_empty

    cfg, topo, engine, dp = serial(tmp_path, optimizer=optimizer)
    held = held_tensors(engine, dp, 0, 1)
    assert {h.name.split("/")[0] for h in held} == {"model", "optim"}
    assert [h.name for h in held if h.array.ctypes.data % ALIGN] == []
    odd = np.arange(17, dtype=np.float32)[1:]  # 4 bytes past an aligned start at best
    assert odd.ctypes.data % ALIGN and aligned(odd).ctypes.data % ALIGN == 0
    np.testing.assert_array_equal(aligned(odd), odd)
    p = Parameter(odd.reshape(4, 4))
    assert p.data.ctypes.data % ALIGN == 0 and p.data.flags.c_contiguous
    same = aligned_empty((3, 5), np.float64, zeros=True)
    assert aligned(same) is same and not same.any() and same.shape == (3, 5)
    assert aligned_empty((), np.float32).shape == () and aligned_empty((0, 4), "f8").size == 0
