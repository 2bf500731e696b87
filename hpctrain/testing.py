"""Helpers for tests that run on many ranks: assertions that fail on every rank.

A plain ``assert`` that fails on one rank leaves the others waiting in the next
collective. ``assert_all`` gathers every rank's verdict first, so all ranks fail
together and the message names the ranks that disagreed.
"""

from __future__ import annotations

import contextlib
import textwrap
from collections.abc import Iterator
from typing import Any

import numpy as np


def assert_all(comm: Any, ok: bool, what: str = "check") -> None:
    """Fail on every rank of ``comm`` unless ``ok`` holds on every rank (collective)."""
    verdicts = comm.allgather(bool(ok))
    bad = [r for r, v in enumerate(verdicts) if not v]
    if bad:
        raise AssertionError(f"{what} failed on rank(s) {bad} of {comm.Get_size()}")


def assert_close_all(comm: Any, actual, expected, *, rtol: float, atol: float = 0.0,
                     what: str = "values") -> None:
    """``np.allclose`` on every rank, failing everywhere with the worst error (collective)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    same_shape = actual.shape == expected.shape
    err = float(np.max(np.abs(actual - expected) / (atol + rtol * np.abs(expected) + 1e-300))) \
        if same_shape and actual.size else (0.0 if same_shape else np.inf)
    errors = comm.allgather(err)
    bad = [r for r, e in enumerate(errors) if not e <= 1.0]
    if bad:
        raise AssertionError(
            f"{what} differ on rank(s) {bad}: worst |a-b|/(atol+rtol*|b|) = "
            f"{max(errors):.3g} (rtol {rtol}, atol {atol}; inf means a shape mismatch)")


def mpiexec() -> str:
    """The ``mpiexec`` beside this Python (the venv's MPICH), else the one on PATH."""
    from hpctrain.runtime import find_mpiexec

    return find_mpiexec()


def run_mpi(nprocs: int, args: list[str], *, timeout: float, env: dict | None = None,
            cwd=None):
    """Run ``mpiexec -n nprocs ARGS`` to completion; returns the CompletedProcess.

    ``subprocess.TimeoutExpired`` propagates: a hang is a failure, never a wait.
    """
    import os
    import subprocess

    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                **(env or {})}
    return subprocess.run([mpiexec(), "-n", str(nprocs), *args], capture_output=True,
                          text=True, timeout=timeout, env=full_env, cwd=cwd)


def copy_task_batches(sequences: int, seq_len: int, vocab: int, steps: int,
                      seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """``steps`` batches of ``sequences`` random token rows of ``seq_len`` and their
    targets ``(3 x + 1) mod vocab``: a task a tiny GPT learns in a few steps."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        x = rng.integers(0, vocab, (sequences, seq_len))
        out.append((x, (3 * x + 1) % vocab))
    return out


def train_losses(cfg, comm, batches, *, steps: int | None = None,
                 node_key: int | None = None) -> list[float]:
    """Train ``cfg`` (validated for ``comm``'s size) on given *global* batches.

    ``batches``: a list of (x, y) global batches, the same on every rank; each data-
    parallel rank takes its contiguous slice, as the loader does for unpartitioned
    files. Returns the loss of every step (the serial curve when comm has one rank).
    Used by the equivalence tests of every parallel layout. ``node_key``: this rank's
    emulated node (``Topology.build``).
    """
    from hpctrain.optim import schedule
    from hpctrain.parallel.engine import build_engine
    from hpctrain.parallel.topology import Topology
    from hpctrain.train import make_data_parallel, train_step

    topo = Topology.build(comm, cfg.parallel, node_key=node_key)
    engine = build_engine(cfg, topo)
    dp = make_data_parallel(cfg, engine, topo)
    t = cfg.train
    steps = len(batches) if steps is None else steps
    losses = []
    for step in range(steps):
        x, y = batches[step % len(batches)]
        b = len(x) // topo.dp_size
        rows = slice(topo.dp_rank * b, (topo.dp_rank + 1) * b)
        lr = schedule.lr_at(step, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps,
                            total_steps=steps)
        loss, _ = train_step(engine, dp, x[rows], y[rows], lr=lr, grad_clip=t.grad_clip)
        losses.append(loss)
    topo.free()
    return losses


TINY_GPT = """
[model]
dtype = "float64"
vocab_size = 256
seq_len = 16
n_layer = 2
n_head = 2
d_model = 16

[parallel]
{parallel}

[train]
eval_interval = 0
log_interval = 1
warmup_steps = 1
{train}

[data]
path = "{{data}}"
"""


def tiny_gpt_template(train: str = "", parallel: str = "") -> str:
    """A TOML config template of a tiny float64 GPT for ``tiny_corpus_config``, with
    more ``[train]`` and ``[parallel]`` lines."""
    return TINY_GPT.format(train=train, parallel=parallel)


def tiny_corpus_config(folder, config_template: str, line: str, lines: int):
    """A small text corpus prepared with ``hpctrain-prep text`` into ``folder``, and a
    TOML config ``folder/tiny.toml`` from ``config_template`` (its ``{data}`` is the
    prepared file). Returns the config's path."""
    from pathlib import Path

    from click.testing import CliRunner

    from data_prep.cli import main as prep

    folder = Path(folder)
    text = folder / "corpus.txt"
    text.write_text("".join(f"line {i}: {line}\n" for i in range(lines)))
    data = folder / "corpus.h5"
    result = CliRunner().invoke(prep, ["text", str(text), "-o", str(data), "-q"])
    assert result.exit_code == 0, result.output
    cfg = folder / "tiny.toml"
    cfg.write_text(config_template.format(data=data))
    return cfg


def tiny_dlrm_config(path, ratings, train: str):
    """A TOML config ``path`` of a tiny DLRM (embedding width 4) on the ratings file
    ``ratings``, one table per feature the file lists, ``train`` as its ``[train]``
    lines. Returns the path."""
    import json
    from pathlib import Path

    import h5py

    with h5py.File(ratings, "r") as f:
        features = json.loads(f.attrs["features"])
    tables = ", ".join(f'{{name = "{f["name"]}", rows = {f["rows"]}, width = {f["width"]}}}'
                       for f in features)
    path = Path(path)
    path.write_text(f'[model]\nkind = "dlrm"\ntables = [{tables}]\nembed_dim = 4\n'
                    f'bottom_mlp = [4]\ntop_mlp = [4]\ndense_features = ["age", "year"]\n'
                    f'rating_min = 1.0\nrating_max = 5.0\n'
                    f'[train]\n{train}\n[data]\npath = "{ratings}"\n')
    return path


def run_train(ranks: int, config, run_dir, *flags: str, timeout: float = 120,
              env: dict | None = None):
    """``mpiexec -n ranks python -m hpctrain.cli train --config C --run-dir D FLAGS``
    (``env``: variables added to the job's environment, as ``run_mpi``)."""
    import sys

    return run_mpi(ranks, [sys.executable, "-m", "hpctrain.cli", "train", "--config",
                           str(config), "--run-dir", str(run_dir), *flags], timeout=timeout,
                   env=env)

# A training job that saves twice and SIGKILLs one rank at a writer event of the second
# save: argv root, event, victim rank, the config as JSON (the kill tests).
SAVE_AND_DIE = textwrap.dedent("""
    import json, os, signal, sys
    import numpy as np
    from mpi4py import MPI
    from hpctrain.checkpoint import save_training
    from hpctrain.config import from_dict
    from hpctrain.parallel.engine import build_engine
    from hpctrain.parallel.topology import Topology
    from hpctrain.train import make_data_parallel, train_step

    root, event, victim = sys.argv[1], sys.argv[2], int(sys.argv[3])
    comm = MPI.COMM_WORLD
    cfg = from_dict(json.loads(sys.argv[4])).validate(comm.Get_size())
    topo = Topology.build(comm, cfg.parallel)
    engine = build_engine(cfg, topo)
    dp = make_data_parallel(cfg, engine, topo)
    rng = np.random.default_rng(topo.dp_rank)

    def step():
        x, y = (rng.integers(0, 32, (2, 8)) for _ in range(2))
        train_step(engine, dp, x, y, lr=1e-2, grad_clip=1.0)

    def die(kind, path):
        if kind == event and comm.Get_rank() == victim:
            os.kill(os.getpid(), signal.SIGKILL)  # no clean-up, no flush: a dead node

    step()
    save_training(cfg, topo, engine, dp, step=1, loader_state={"step": 1}, root=root)
    step()
    save_training(cfg, topo, engine, dp, step=2, loader_state={"step": 2}, root=root,
                  on_event=die)
    print("the save finished: nobody was killed")
""")


@contextlib.contextmanager
def hdf5_held_for_writing(path) -> Iterator[None]:
    """While inside, another process holds ``path`` open for writing in HDF5, and so
    its exclusive lock (a real second process: locks are per process)."""
    import subprocess
    import sys

    code = ("import sys, time, h5py; f = h5py.File(sys.argv[1], 'a'); "
            "print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        if holder.stdout.readline().strip() != "held":
            raise RuntimeError(f"could not open {path} for writing in a second process")
        yield
    finally:
        holder.kill()
        holder.wait(timeout=30)
