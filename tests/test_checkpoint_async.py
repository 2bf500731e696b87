"""Asynchronous checkpoints (``checkpoint.background``): the state is copied when the
save is called, or, with ``overlap``, while the next step's forward and backward run
(the update waits for the copy), and written while training goes on; at most one
write is in flight; its errors, a non-finite state among them, surface at the next
save or wait; ``train`` waits for it at the end and warns of a refused one; and a
job killed during a background write (2 and 4 ranks) leaves ``latest`` on the
previous complete checkpoint, which loads, while a resumed run removes the unfinished
folder and says so."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.checkpoint import (
    CheckpointError,
    background,
    load_training,
    save_training,
    verify,
    writer,
)
from hpctrain.checkpoint import format as fmt
from hpctrain.checkpoint.background import BackgroundWriter
from hpctrain.checkpoint.state import held_tensors
from hpctrain.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.topology import Topology
from hpctrain.testing import mpiexec, run_train, tiny_corpus_config
from hpctrain.train import make_data_parallel, train_step

MODEL = ModelConfig(n_layer=2, d_model=16, n_head=2, seq_len=8, vocab_size=32, dtype="float64")


class Run:
    """A serial engine with a background writer, trained on random batches."""

    def __init__(self, tmp_path, overlap: bool = False, model: ModelConfig = MODEL,
                 parallel: ParallelConfig | None = None):
        self.cfg = Config(model=model, parallel=parallel or ParallelConfig(),
                          train=TrainConfig(batch_size=4, keep_checkpoints=5,
                                            run_dir=str(tmp_path))).validate(1)
        self.topo = Topology.build(MPI.COMM_SELF, self.cfg.parallel)
        self.engine = build_engine(self.cfg, self.topo)
        self.dp = make_data_parallel(self.cfg, self.engine, self.topo)
        self.background = BackgroundWriter(self.topo.ckpt_comm, overlap=overlap)
        self.rng = np.random.default_rng(0)

    def step(self) -> None:
        if self.cfg.model.kind == "cnn":  # (B, pixels) in [0, 1], classes
            x, y = self.rng.random((4, self.cfg.model.input_dim)), self.rng.integers(0, 3, 4)
        else:
            x, y = (self.rng.integers(0, 32, (4, 8)) for _ in range(2))
        train_step(self.engine, self.dp, x, y, lr=1e-2, grad_clip=1.0,
                   before_update=self.background.captured)

    def held(self) -> dict[str, np.ndarray]:
        return {h.name: h.array.copy() for h in held_tensors(self.engine, self.dp, 0, 1)}

    def save(self, step: int, **kw):
        return save_training(self.cfg, self.topo, self.engine, self.dp, step=step,
                             loader_state={"step": step}, background=self.background, **kw)

    def loaded(self, path) -> dict[str, np.ndarray]:
        fresh = Run(Path(self.cfg.train.run_dir) / "fresh", model=self.cfg.model,
                    parallel=self.cfg.parallel)
        load_training(path, fresh.cfg, fresh.topo, fresh.engine, fresh.dp)
        return fresh.held()


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_the_write_holds_the_state_of_the_save_call_while_training_goes_on(tmp_path):
    run = Run(tmp_path)
    run.step()
    at_save = run.held()
    release = threading.Event()
    path = run.save(1, on_event=lambda kind, _: kind == "file" and release.wait(60))
    assert run.background.in_flight
    run.step()  # trains while the write waits after its rank file
    run.step()
    assert not same(run.held(), at_save)
    assert not (path / fmt.INDEX_NAME).exists()  # not committed yet
    release.set()
    assert run.background.wait() == path
    assert (Path(path).parent / fmt.LATEST_NAME).read_text().strip() == path.name
    assert same(run.loaded(path), at_save)  # the copy, not what training did since
    writer.wait_for_pruning()


def test_at_most_one_write_in_flight(tmp_path):
    run = Run(tmp_path)
    writing, most = set(), []
    gate = threading.Event()

    def watch(kind, path):
        if kind == "dataset":
            writing.add(path.parent.name)
            most.append(len(writing))
            gate.wait(60)  # the first write stalls until released
        elif kind == "latest":
            writing.clear()

    run.save(1, on_event=watch)
    threading.Timer(0.3, gate.set).start()
    t0 = time.perf_counter()
    second = run.save(2, on_event=watch)  # must wait for the first
    assert time.perf_counter() - t0 >= 0.25
    run.background.wait()
    assert max(most) == 1
    assert (second / fmt.INDEX_NAME).is_file() and (second.parent / "step-000001").is_dir()
    writer.wait_for_pruning()


def test_the_gil_changes_hands_sooner_while_a_write_is_in_flight(tmp_path):
    """The training thread waits at most ``SWITCH_S`` for the GIL the writer's Python
    holds, during the write only: the interval before and after is the caller's."""
    run = Run(tmp_path)
    seen, gate = [], threading.Event()

    def watch(kind, path):
        if kind == "dataset":
            seen.append(sys.getswitchinterval())
            gate.wait(60)

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.004)
        run.save(1, on_event=watch)
        during = sys.getswitchinterval()
        gate.set()
        run.background.wait()
        after = sys.getswitchinterval()
    finally:
        gate.set()
        sys.setswitchinterval(before)
    assert during == pytest.approx(background.SWITCH_S) and seen == [during]
    assert after == pytest.approx(0.004)
    writer.wait_for_pruning()


def test_an_error_in_the_background_surfaces_at_wait_and_at_the_next_save(tmp_path):
    run = Run(tmp_path)
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the checkpoints folder should be")
    run.save(1, root=blocked)  # returns: the error is the thread's
    with pytest.raises(CheckpointError, match="preparing .*not-a-folder"):
        run.background.wait()
    assert run.background.wait() is None  # raised once
    run.save(2, root=blocked)
    with pytest.raises(CheckpointError, match="preparing"):
        run.save(3)  # the next save raises the last one's error before starting
    assert not run.background.in_flight


class SlowSnapshot(BackgroundWriter):
    """A snapshot that takes 0.3 s, so the step after the save reaches its update
    before the copy is done."""

    def _snapshot(self, *args):
        time.sleep(0.3)
        return super()._snapshot(*args)


@pytest.mark.parametrize("overlap", [True, False])
def test_the_update_waits_for_the_snapshot_taken_beside_forward_and_backward(tmp_path,
                                                                               overlap):
    run = Run(tmp_path, overlap=overlap)
    run.background = SlowSnapshot(run.topo.ckpt_comm, overlap=overlap)
    run.step()
    at_save = run.held()
    t0 = time.perf_counter()
    path = run.save(1)
    returned = time.perf_counter() - t0
    assert (returned < 0.2) == overlap  # overlap: save returns before the copy
    before = run.background.capture_wait_s
    run.step()  # with overlap its update waits in before_update
    assert (run.background.capture_wait_s - before > 0.1) == overlap
    assert not same(run.held(), at_save)
    assert run.background.wait() == path
    assert same(run.loaded(path), at_save)
    writer.wait_for_pruning()


@pytest.mark.parametrize("what", ["weighted local SGD", "BatchNorm"])
def test_what_the_next_step_changes_before_its_update_is_saved_as_it_was(tmp_path, what):
    """Weighted local SGD updates inside its round (a local step a unit), and the CNN's
    forward moves BatchNorm's running statistics: with a snapshot slower than either,
    the checkpoint still holds the state of the save call."""
    if what == "BatchNorm":
        run = Run(tmp_path, overlap=True, model=ModelConfig(kind="cnn", input_dim=64,
                                                            channels=(4,), n_classes=3,
                                                            dtype="float64"))
    else:
        run = Run(tmp_path, overlap=True, parallel=ParallelConfig(
            averaging="periodic", average_every=2, shares="fixed", batch_shares=(4,),
            microbatches=2))
    run.background = SlowSnapshot(run.topo.ckpt_comm, overlap=True)
    run.step()
    at_save = run.held()
    path = run.save(1)
    run.step()
    assert not same(run.held(), at_save)
    assert run.background.wait() == path
    assert same(run.loaded(path), at_save)
    writer.wait_for_pruning()


def test_a_non_finite_snapshot_is_refused_at_wait_and_train_warns(tmp_path):
    from hpctrain.train import _wait_for_save

    run = Run(tmp_path, overlap=True)
    run.step()
    first = run.save(1)
    run.background.wait()
    name = "model/blocks.1.mlp.fc.weight"
    held = {h.name: h.array for h in held_tensors(run.engine, run.dp, 0, 1)}
    held[name][0, 0] = np.nan
    path = run.save(2)  # returns: the check is the thread's
    said = []

    class Say:
        say = staticmethod(said.append)

    assert _wait_for_save(run.background, Say) is False
    assert said == [f"warning: the state after step 2 is not finite: {name} holds nan or "
                    f"inf; no checkpoint written"]
    assert not path.exists() and not path.with_name(path.name + ".tmp").exists()
    assert (first.parent / fmt.LATEST_NAME).read_text().strip() == first.name
    held[name][0, 0] = 0.0
    run.save(3)
    assert run.background.wait() == path.with_name("step-000003")  # saves again
    writer.wait_for_pruning()


CONFIG = """
[model]
seq_len = 16
n_layer = 2
n_head = 2
d_model = 32
dtype = "float64"
[train]
steps = 6
batch_size = 8
lr = 3e-3
eval_interval = 0
save_interval = 2
seed = 3
[data]
path = "{data}"
"""


@pytest.mark.slow
def test_train_with_async_save_matches_sync_and_waits_for_the_last_write(tmp_path):
    cfg = tiny_corpus_config(tmp_path, CONFIG, "to be, or not to be, that is the question.",
                             200)
    runs = {}
    for mode in ("sync", "async"):
        flags = ["--async-save"] if mode == "async" else []
        result = run_train(2, cfg, tmp_path / mode, *flags, timeout=120)
        assert result.returncode == 0, result.stderr
        runs[mode] = result.stdout
    assert "writing it in the background" in runs["async"]
    assert "checkpoint" in runs["async"] and "s in the background)" in runs["async"]
    for step in (2, 4, 6):
        paths = [tmp_path / m / "checkpoints" / f"step-{step:06d}" for m in ("sync", "async")]
        with_sync, with_async = (verify(p) for p in paths)
        assert not with_sync[1] and not with_async[1]
        for name, entry in with_sync[0].tensors.items():
            assert [p.checksum for p in entry.pieces] == \
                [p.checksum for p in with_async[0].tensors[name].pieces], name
    latest = tmp_path / "async" / "checkpoints" / fmt.LATEST_NAME
    assert latest.read_text().strip() == "step-000006"  # the run waited for it


KILLED_IN_FLIGHT = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    import numpy as np
    from mpi4py import MPI
    from hpctrain.checkpoint import save_training
    from hpctrain.checkpoint.background import BackgroundWriter
    from hpctrain.config import from_dict
    from hpctrain.parallel.engine import build_engine
    from hpctrain.parallel.topology import Topology
    from hpctrain.train import make_data_parallel, train_step

    root, marker = Path(sys.argv[1]), Path(sys.argv[2])
    comm = MPI.COMM_WORLD
    cfg = from_dict(json.loads(sys.argv[3])).validate(comm.Get_size())
    topo = Topology.build(comm, cfg.parallel)
    engine = build_engine(cfg, topo)
    dp = make_data_parallel(cfg, engine, topo)
    background = BackgroundWriter(topo.ckpt_comm)
    rng = np.random.default_rng(topo.dp_rank)

    def step():
        x, y = (rng.integers(0, 32, (2, 8)) for _ in range(2))
        train_step(engine, dp, x, y, lr=1e-2, grad_clip=1.0)

    def stall(kind, path):  # rank 0's write of step 2 stops after its rank file
        if kind == "file" and comm.Get_rank() == 0 and "step-000002" in str(path):
            marker.write_text("writing")
            time.sleep(600)

    def save(n, **kw):
        save_training(cfg, topo, engine, dp, step=n, loader_state={"step": n}, root=root,
                      background=background, **kw)

    step()
    save(1)
    background.wait()
    step()
    save(2, on_event=stall)
    for _ in range(3):
        step()  # training goes on, its collectives beside the writer's
    if comm.Get_rank() == 0:
        print("trained 3 steps while writing", flush=True)
    background.wait()
    print("the write finished: nobody was killed", flush=True)
""")


def mapped_anywhere(name: str) -> bool:
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            if name in maps.read_text():
                return True
        except OSError:  # the process ended, or is not ours to read
            continue
    return False


def remove_orphan_segments(before: set[str]) -> None:
    """A killed MPICH job leaves its /dev/shm segment, which a later job of the same
    name would join (DEVELOPERS.md): remove the new ones no process maps."""
    shm = Path("/dev/shm")
    for name in {p.name for p in shm.glob("mpich_shm_*")} - before:
        deadline = time.monotonic() + 10  # killed ranks take a moment to go
        while mapped_anywhere(name) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not mapped_anywhere(name):
            (shm / name).unlink(missing_ok=True)


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_job_killed_during_a_background_write_keeps_latest_on_the_previous(tmp_path,
                                                                             ranks):
    script = tmp_path / "killed_in_flight.py"
    script.write_text(KILLED_IN_FLIGHT)
    root, marker, out = tmp_path / "checkpoints", tmp_path / "writing", tmp_path / "out.txt"
    cfg = Config(model=MODEL, parallel=ParallelConfig(zero=1, bucket_mb=0.001),
                 train=TrainConfig(batch_size=4, steps=2))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    segments = {p.name for p in Path("/dev/shm").glob("mpich_shm_*")}
    with out.open("w") as stdout:
        job = subprocess.Popen([mpiexec(), "-n", str(ranks), sys.executable, str(script),
                                str(root), str(marker), json.dumps(cfg.to_dict())],
                               stdout=stdout, stderr=subprocess.STDOUT, env=env,
                               start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while not (marker.exists() and "trained 3 steps" in out.read_text()):
                assert job.poll() is None and time.monotonic() < deadline, out.read_text()
                time.sleep(0.05)
        finally:
            os.killpg(job.pid, signal.SIGKILL)  # the whole job: launcher and ranks
            job.wait(timeout=60)
            remove_orphan_segments(segments)
    assert "nobody was killed" not in out.read_text()
    assert (root / fmt.LATEST_NAME).read_text().strip() == "step-000001"
    assert (root / "step-000002.tmp").is_dir() and not (root / "step-000002").exists()
    ckpt, problems = verify(root)
    assert ckpt.step == 1 and not problems

    serial = replace(cfg, parallel=ParallelConfig()).validate(1)  # resumed on one rank
    topo = Topology.build(MPI.COMM_SELF, serial.parallel)
    engine = build_engine(serial, topo)
    dp = make_data_parallel(serial, engine, topo)
    said = []
    assert load_training(root, serial, topo, engine, dp, root=root, say=said.append).step == 1
    assert len(said) == 1 and "step-000002.tmp" in said[0]
    assert not list(root.glob("*.tmp"))


@pytest.mark.slow
def test_preemption_waits_for_the_write_before_stopping(tmp_path):
    from hpctrain.metrics import read_metrics

    cfg = tiny_corpus_config(tmp_path, CONFIG.replace("steps = 6", "steps = 300"),
                             "to be, or not to be, that is the question.", 400)
    run_dir = tmp_path / "run"
    job = subprocess.Popen([mpiexec(), "-n", "2", sys.executable, "-m", "hpctrain.cli",
                            "train", "--config", str(cfg), "--run-dir", str(run_dir),
                            "--async-save"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while not (metrics.exists() and len(read_metrics(metrics)) >= 5):
        assert time.monotonic() < deadline and job.poll() is None, job.communicate()
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 3, err
    stopped = read_metrics(metrics)[-1]["step"]
    name = f"step-{stopped:06d}"
    written = out.index(f"checkpoint {run_dir / 'checkpoints' / name} written")
    assert written < out.index("preempted (SIGUSR1)")  # landed before the job said so
    assert (run_dir / "checkpoints" / fmt.LATEST_NAME).read_text().strip() == name
