"""Checkpoints under MPI: round trips, bit-exact resume and resharding.

What runs follows from the world size N (2, 4 and 8 in ``make test``):

* round trip at every (dp, tp, pp) layout of N the tiny GPT allows up to N = 4 (at
  8, at 2x2x2), with ZeRO 0, 1 and 2 at the richest layout and one stage in turn at
  the others, plus the interleaved schedule and the tied embedding: train 3 steps,
  save, load into a fresh engine at the same layout, and every held array
  (parameters, optimizer state, ZeRO slices) is bitwise the saved one; 3 more steps
  give bitwise the losses of the run that never stopped;
* resharding: a checkpoint saved at the richest layout of N (2x2x2 at 8) with ZeRO 1
  loads at the other layouts of N (at 8: 1x4x2, 4x1x2, 8x1x1, 1x2x4), on half the
  ranks (sub-communicators), and serially on MPI.COMM_SELF, with other ZeRO stages;
  the next 3 losses match the run that saved it to 1e-8 relative (float64).

Assertions are collective (``hpctrain.testing``): every rank fails together.
"""

import itertools
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.checkpoint import load_training, save_training
from hpctrain.checkpoint.state import held_tensors
from hpctrain.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.optim import schedule
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.topology import Topology
from hpctrain.testing import assert_all, assert_close_all
from hpctrain.train import make_data_parallel, train_step

WORLD = MPI.COMM_WORLD
SIZE = WORLD.Get_size()
MODEL = ModelConfig(n_layer=4, d_model=16, n_head=4, seq_len=8, vocab_size=32,
                    dtype="float64", init_std=0.3)
TRAIN = TrainConfig(batch_size=16, lr=1e-2, warmup_steps=2, weight_decay=0.1, grad_clip=1.0,
                    steps=6)
SAVE_AT = 3
RTOL = 1e-8

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]


def layouts(n: int) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) with dp * tp * pp = n that the tiny model allows."""
    return [(dp, tp, n // (dp * tp)) for dp, tp in itertools.product(range(1, n + 1), repeat=2)
            if n % (dp * tp) == 0 and MODEL.n_head % tp == 0 and n // (dp * tp) <= MODEL.n_layer]


def richest(n: int) -> tuple[int, int, int]:
    """The layout using the most kinds of parallelism, data parallelism first (ZeRO
    needs it), then tensor parallelism: 2x2x2 at 8."""
    return max(layouts(n), key=lambda lay: (sum(s > 1 for s in lay), lay[0] > 1, lay[1] > 1))


def config(layout, zero: int, *, schedule_name="1f1b", sp=False, tie=False) -> Config:
    dp, tp, pp = layout
    v = 2 if schedule_name == "interleaved" else 1
    m = 2 * pp if TRAIN.batch_size % (dp * 2 * pp) == 0 else pp
    par = ParallelConfig(dp=dp, tp=tp, pp=pp, microbatches=max(m, 2), zero=zero,
                         schedule=schedule_name, virtual_stages=v, sequence_parallel=sp,
                         bucket_mb=0.002)
    return Config(model=replace(MODEL, tie_embeddings=tie), parallel=par,
                  train=TRAIN).validate(dp * tp * pp)


def round_trips(n: int) -> list[tuple]:
    """(layout, zero, schedule, sequence parallel, tied) of the round-trip test: up to
    4 ranks every layout (one ZeRO stage each, in turn), at 8 the richest only; there
    every ZeRO stage, the interleaved schedule with sequence parallelism (where pp
    allows) and the tied table on two stages."""
    rich = richest(n)
    out = [(rich, z, "1f1b", False, False) for z in (0, 1, 2)]
    if n <= 4:
        out += [(lay, k % 3, "1f1b", False, False)
                for k, lay in enumerate(layouts(n)) if lay != rich]
    dp, tp, pp = rich
    if pp > 1 and 2 * pp <= MODEL.n_layer:
        out.append((rich, 1, "interleaved", tp > 1, False))
    out.append((rich, 2, "1f1b", False, True))
    return out


@pytest.fixture(scope="module")
def batches():
    r = np.random.default_rng(0)
    shape = (TRAIN.batch_size, MODEL.seq_len)
    return [(r.integers(0, MODEL.vocab_size, shape), r.integers(0, MODEL.vocab_size, shape))
            for _ in range(TRAIN.steps)]


@pytest.fixture(scope="module")
def shared_dir():
    """One temporary folder, the same on every rank."""
    path = WORLD.bcast(tempfile.mkdtemp(prefix="hpctrain-ckpt-") if WORLD.Get_rank() == 0
                       else None)
    yield Path(path)
    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


class Run:
    """One training run of ``cfg`` on ``comm``, a step at a time, on global batches."""

    def __init__(self, cfg: Config, comm):
        self.cfg = replace(cfg, train=replace(cfg.train, keep_checkpoints=2))
        self.topo = Topology.build(comm, cfg.parallel)
        self.engine = build_engine(cfg, self.topo)
        self.dp = make_data_parallel(cfg, self.engine, self.topo)
        self.done = 0

    def steps(self, batches, until: int) -> list[float]:
        t, losses = self.cfg.train, []
        while self.done < until:
            x, y = batches[self.done]
            b = len(x) // self.topo.dp_size
            rows = slice(self.topo.dp_rank * b, (self.topo.dp_rank + 1) * b)
            lr = schedule.lr_at(self.done, lr=t.lr, min_lr=t.min_lr,
                                warmup_steps=t.warmup_steps, total_steps=t.steps)
            loss, _ = train_step(self.engine, self.dp, x[rows], y[rows], lr=lr,
                                 grad_clip=t.grad_clip)
            losses.append(loss)
            self.done += 1
        return losses

    def held(self) -> dict[str, np.ndarray]:
        return {h.name: h.array.copy() for h in held_tensors(self.engine, self.dp,
                                                              self.topo.tp_rank,
                                                              self.topo.tp_size)}

    def save(self, root: Path) -> Path:
        return save_training(self.cfg, self.topo, self.engine, self.dp, step=self.done,
                             loader_state=None, root=root)

    def load(self, path: Path) -> None:
        resumed = load_training(path, self.cfg, self.topo, self.engine, self.dp)
        self.done = resumed.step

    def free(self) -> None:
        self.topo.free()


def run_id(case):
    (dp, tp, pp), zero, sched, sp, tie = case
    return f"{dp}x{tp}x{pp}-zero{zero}-{sched}" + ("-sp" if sp else "") + ("-tied" if tie
                                                                           else "")


def flip_byte_of_piece(path: Path, entry, at: int) -> tuple[int, bytes]:
    """Flip a bit of the first byte of the piece at element ``at`` of ``entry``'s flat
    dataset in rank 0's file (on rank 0, then every rank waits): (its offset, its old
    byte) on rank 0."""
    import h5py

    from hpctrain.checkpoint import format as fmt

    file = path / fmt.data_filename(0)
    with h5py.File(file) as f:
        offset = f[fmt.flat_name(entry.dtype)].id.get_offset()
    offset += at * np.dtype(entry.dtype).itemsize
    byte = b""
    if WORLD.Get_rank() == 0:
        with open(file, "r+b") as fh:
            fh.seek(offset)
            byte = fh.read(1)
            fh.seek(offset)
            fh.write(bytes([byte[0] ^ 0x10]))
    WORLD.Barrier()
    return offset if WORLD.Get_rank() == 0 else -1, byte


def restore_byte(path: Path, offset: int, byte: bytes) -> None:
    from hpctrain.checkpoint import format as fmt

    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        with open(path / fmt.data_filename(0), "r+b") as fh:
            fh.seek(offset)
            fh.write(byte)
    WORLD.Barrier()


@pytest.mark.parametrize("case", round_trips(SIZE), ids=run_id)
def test_round_trip_is_bitwise_and_resume_is_bit_exact(case, batches, shared_dir):
    layout, zero, sched, sp, tie = case
    cfg = config(layout, zero, schedule_name=sched, sp=sp, tie=tie)
    first = Run(cfg, WORLD)
    first.steps(batches, SAVE_AT)
    path = first.save(shared_dir / run_id(case))
    saved = first.held()
    want = first.steps(batches, TRAIN.steps)
    first.free()

    second = Run(cfg, WORLD)
    second.load(path)
    loaded = second.held()
    same = saved.keys() == loaded.keys() and all(
        saved[k].dtype == loaded[k].dtype and np.array_equal(saved[k], loaded[k])
        for k in saved)
    assert_all(WORLD, same, f"{run_id(case)}: every held array bitwise after loading")
    assert_all(WORLD, second.done == SAVE_AT, "the step counter resumes")
    got = second.steps(batches, TRAIN.steps)
    second.free()
    assert_all(WORLD, got == want, f"{run_id(case)}: losses after resuming {got} vs {want}")


@pytest.fixture(scope="module")
def source(batches, shared_dir):
    """The checkpoint at the richest layout with ZeRO 1 after SAVE_AT steps, and the
    losses of the steps after it."""
    cfg = config(richest(SIZE), 1)
    run = Run(cfg, WORLD)
    run.steps(batches, SAVE_AT)
    path = run.save(shared_dir / "source")
    after = run.steps(batches, TRAIN.steps)
    run.free()
    return path, after


def continued(path, layout, zero, comm, batches) -> list[float]:
    run = Run(config(layout, zero), comm)
    run.load(path)
    losses = run.steps(batches, TRAIN.steps)
    run.free()
    return losses


def targets(n: int) -> list[tuple[tuple[int, int, int], int]]:
    """Other layouts of n, each with a ZeRO stage in turn: every one up to 4 ranks; at
    8, 1x4x2 and 4x1x2, and the widest tp, dp and pp (1x4x2, 8x1x1, 1x2x4)."""
    others = [lay for lay in layouts(n) if lay != richest(n)]
    if n > 4:
        wanted = {(1, 4, 2), (4, 1, 2), (n, 1, 1), (1, 2, 4)}
        others = [lay for lay in others if lay in wanted]
    return [(lay, (k + 2) % 3) for k, lay in enumerate(others)]


@pytest.mark.parametrize("target", targets(SIZE), ids=lambda t: f"{'x'.join(map(str, t[0]))}"
                         f"-zero{t[1]}")
def test_reshard_to_every_other_layout_continues(target, source, batches):
    path, want = source
    got = continued(path, *target, WORLD, batches)
    assert_close_all(WORLD, got, want, rtol=RTOL,
                     what=f"losses at {target} from {richest(SIZE)} (ZeRO 1)")


def test_reshard_onto_half_the_ranks(source, batches):
    """Half the world per sub-communicator, at the richest layout of that size."""
    path, want = source
    half = WORLD.Split(color=int(WORLD.Get_rank() < SIZE // 2), key=WORLD.Get_rank())
    try:
        layout = richest(half.Get_size())
        got = continued(path, layout, 2 if layout[0] > 1 else 0, half, batches)
    finally:
        half.Free()
    assert_close_all(WORLD, got, want, rtol=RTOL, what="losses on half the ranks")


def test_reshard_to_serial_on_comm_self(source, batches):
    path, want = source
    got = continued(path, (1, 1, 1), 0, MPI.COMM_SELF, batches)
    assert_close_all(WORLD, got, want, rtol=RTOL, what="serial losses on every rank")


def test_replicas_share_the_checks_and_a_flipped_byte_fails_every_rank(batches, shared_dir,
                                                                       monkeypatch):
    """At dp = N the ranks of a node read the same pieces and each checks its share of
    the runs (``reader.share_owners``); a byte flipped in the run the first rank
    checks, then in the run the second checks, fails the load on every rank."""

    from hpctrain.checkpoint import CheckpointError, reader
    from hpctrain.checkpoint import format as fmt
    from hpctrain.checkpoint.training import check_share

    monkeypatch.setattr(reader, "RUN_BYTES", 1)  # a run per piece: the checks spread
    run = Run(config((SIZE, 1, 1), 0), WORLD)
    # rank files (under a system MPI "auto" writes one shared data.h5, and the bytes
    # flipped below would be looked for in a file that is not there)
    run.cfg = replace(run.cfg, train=replace(run.cfg.train, checkpoint_io="files"))
    run.steps(batches, SAVE_AT)
    path = run.save(shared_dir / "shared-checks")
    held = held_tensors(run.engine, run.dp, 0, 1)
    assert_all(WORLD, check_share(run.topo, held) == (WORLD.Get_rank(), SIZE),
               "every replica of the one node takes a share")
    index = fmt.read_index(path / fmt.INDEX_NAME)
    first = sorted(((p.at, e) for e in index.tensors.values() for p in e.pieces
                    if p.file == fmt.data_filename(0)), key=lambda x: x[0])[:2]
    assert len(first) == 2, index.files
    for at, entry in first:  # the first run goes to rank 0, the second to rank 1
        offset, byte = flip_byte_of_piece(path, entry, at)
        try:
            run.load(path)
            message = ""
        except CheckpointError as err:
            message = str(err)
        assert_all(WORLD, "checksum mismatch" in message and entry.name in message,
                   f"a byte flipped in {entry.name} fails the load on every rank: {message!r}")
        restore_byte(path, offset, byte)
    run.load(path)  # intact again
    run.free()


def test_the_index_is_read_by_one_rank_and_broadcast(batches, shared_dir):
    """``training.index_image``: rank 0 alone reads the index file and every rank gets
    its bytes (shown by giving the other ranks a path that does not exist: they never
    open it); a load through ``load_training`` uses them; an index rank 0 cannot read
    fails every rank."""
    from hpctrain.checkpoint import CheckpointError
    from hpctrain.checkpoint import format as fmt
    from hpctrain.checkpoint.training import index_image

    run = Run(config((SIZE, 1, 1), 0), WORLD)
    run.steps(batches, SAVE_AT)
    path = run.save(shared_dir / "one-reader") / fmt.INDEX_NAME
    elsewhere = shared_dir / "nowhere" / fmt.INDEX_NAME
    image = index_image(WORLD, path if WORLD.Get_rank() == 0 else elsewhere)
    assert_all(WORLD, image == path.read_bytes(), "every rank holds the index's bytes")
    run.load(path.parent)  # through load_training, with the broadcast bytes
    try:
        index_image(WORLD, elsewhere)
        message = ""
    except CheckpointError as err:
        message = str(err)
    assert_all(WORLD, "on rank(s) [0]" in message and "nowhere" in message,
               f"an index rank 0 cannot read fails every rank: {message!r}")
    # rank 0 alone checks that the data files exist: a missing one fails every rank
    gone = fmt.read_index(path).files[-1]  # a rank's file, or the one shared data.h5
    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        (path.parent / gone).unlink()
    WORLD.Barrier()
    try:
        run.load(path.parent)
        message = ""
    except CheckpointError as err:
        message = str(err)
    assert_all(WORLD, f"{gone}: missing" in message,
               f"a missing data file fails every rank: {message!r}")
    run.free()


def shared_read_cases(n: int) -> list[tuple]:
    """(layout, zero): data parallel alone at ZeRO 0 and 1, and beside tensor (and
    pipeline) parallelism where the ranks allow, where the replicas are the ranks of
    one tensor and stage position."""
    cases = [((n, 1, 1), 0), ((n, 1, 1), 1)]
    if n >= 4:
        cases.append(((n // 2, 2, 1), 1))
    if n >= 8:
        cases.append(((n // 4, 2, 2), 0))
    return cases


@pytest.mark.parametrize("layout,zero", shared_read_cases(SIZE),
                         ids=lambda c: "x".join(map(str, c)) if isinstance(c, tuple)
                         else f"zero{c}")
def test_shared_reads_load_what_each_reads_from_a_share_of_the_files(batches, shared_dir,
                                                                     layout, zero):
    """``checkpoint_read = "shared"`` (``training.read_plan``, ``exchange_runs``): the
    data-parallel replicas read the arrays they hold alike once between them, 1/dp each,
    and broadcast the rest; the state loaded is bitwise the one every rank reads whole
    (into arrays first filled with nan, so a run no rank sent would show). At ZeRO 0
    every array is shared and the ranks' reads add up to one copy; at ZeRO 1 the
    parameters are, the optimizer state is each rank's own."""
    if SIZE == 1:
        pytest.skip("needs data-parallel replicas")
    run = Run(config(layout, zero), WORLD)
    run.steps(batches, SAVE_AT)
    path = run.save(shared_dir / f"shared-read-{'x'.join(map(str, layout))}-{zero}")
    held = held_tensors(run.engine, run.dp, run.topo.tp_rank, run.topo.tp_size)
    each = load_training(path, run.cfg, run.topo, run.engine, run.dp)
    want = run.held()
    for h in held:
        h.array[...] = np.nan
    cfg = replace(run.cfg, train=replace(run.cfg.train, checkpoint_read="shared"))
    shared = load_training(path, cfg, run.topo, run.engine, run.dp)
    got = run.held()
    assert_all(WORLD, all(np.array_equal(got[k], want[k]) for k in want),
               "the shared read loads bitwise what each rank reads whole")
    assert_all(WORLD, each.bytes_read == each.bytes_held == shared.bytes_held,
               f"read whole: every held byte ({each.bytes_read} of {each.bytes_held})")
    own = sum(h.array.nbytes for h in held if h.name.startswith("optim/")) if zero else 0
    replicated = shared.bytes_held - own
    dp_comm = run.topo.dp_comm
    reads = dp_comm.allgather(shared.bytes_read - own)
    assert_all(WORLD, sum(reads) == replicated and max(reads) < replicated,
               f"the replicated {replicated} bytes read once between the replicas: {reads}")
    assert shared.step == SAVE_AT
    run.free()


def test_a_flipped_byte_in_a_share_another_rank_reads_fails_every_rank(batches, shared_dir,
                                                                        monkeypatch):
    """With shared reads a rank receives runs it never read; a byte flipped in the
    second run (read and checked by rank 1 alone) fails the load on every rank, before
    anything is exchanged, and nobody waits for a rank that failed."""

    from hpctrain.checkpoint import CheckpointError, reader
    from hpctrain.checkpoint import format as fmt

    if SIZE == 1:
        pytest.skip("needs data-parallel replicas")
    monkeypatch.setattr(reader, "RUN_BYTES", 1)  # a run per piece: the reads spread
    run = Run(config((SIZE, 1, 1), 0), WORLD)
    run.cfg = replace(run.cfg, train=replace(run.cfg.train, checkpoint_read="shared",
                                             checkpoint_io="files"))  # as above
    run.steps(batches, SAVE_AT)
    path = run.save(shared_dir / "shared-read-flip")
    index = fmt.read_index(path / fmt.INDEX_NAME)
    at, entry = sorted(((p.at, e) for e in index.tensors.values() for p in e.pieces
                        if p.file == fmt.data_filename(0)), key=lambda x: x[0])[1]
    flip_byte_of_piece(path, entry, at)
    try:
        run.load(path)
        message = ""
    except CheckpointError as err:
        message = str(err)
    assert_all(WORLD, "checksum mismatch" in message and entry.name in message
               and "on rank(s) [1]" in message,
               f"rank 1's share holds the bad byte; every rank fails: {message!r}")
    run.free()
