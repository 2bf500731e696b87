"""Failure behaviour of a whole job: one rank's error ends every rank, never a hang;
user errors are one clean message."""

import sys
import textwrap
import time

from hpctrain.testing import run_mpi

RAISE_ON_ONE_RANK = textwrap.dedent("""
    import time
    from mpi4py import MPI
    from hpctrain.runtime import abort_on_error

    comm = MPI.COMM_WORLD
    with abort_on_error(comm):
        if comm.Get_rank() == 2:
            time.sleep(0.5)
            raise RuntimeError("rank 2 fails on purpose")
        comm.Barrier()  # the other ranks wait here for a rank that never comes
""")


def test_one_rank_raising_ends_the_job_within_30_s(tmp_path):
    script = tmp_path / "raise_on_one_rank.py"
    script.write_text(RAISE_ON_ONE_RANK)
    start = time.monotonic()
    result = run_mpi(4, [sys.executable, str(script)], timeout=30)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert "[rank 2]" in result.stderr and "rank 2 fails on purpose" in result.stderr
    assert elapsed < 30


def test_unhandled_exception_under_python_m_mpi4py_aborts(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("from mpi4py import MPI\nc = MPI.COMM_WORLD\n"
                      "if c.rank == 1:\n    raise ValueError('boom')\nc.Barrier()\n")
    result = run_mpi(4, [sys.executable, "-m", "mpi4py", str(script)], timeout=30)
    assert result.returncode != 0 and "boom" in result.stderr


def write_config(tmp_path, **model):
    lines = ["[model]"] + [f"{k} = {v}" for k, v in model.items()]
    path = tmp_path / "bad.toml"
    path.write_text("\n".join(lines) + "\n[train]\nsteps = 1\n")
    return path


def test_tp_not_dividing_heads_is_one_message_on_every_rank(tmp_path):
    cfg = write_config(tmp_path, n_head=8, d_model=64)
    result = run_mpi(3, [sys.executable, "-m", "hpctrain.cli", "train", "--config", str(cfg),
                         "--tp", "3"], timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("tp (3) must divide n_head (8)") == 1, result.stderr
    assert "Traceback" not in result.stderr


def test_serial_config_error_exits_2_without_traceback(tmp_path):
    import subprocess

    cfg = write_config(tmp_path, n_head=8, d_model=64)
    result = subprocess.run([sys.executable, "-m", "hpctrain.cli", "train", "--config",
                             str(cfg), "--tp", "3"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "error: tp (3) must divide n_head (8)" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_model_too_large_for_memory_is_one_line_naming_the_size(tmp_path):
    """A config far too large (d_model 2**20: a 24 TiB weight) printed NumPy's frames
    and `_ArrayMemoryError`; now one line with the size and where to predict memory."""
    import subprocess

    from hpctrain.testing import tiny_corpus_config

    template = ("[model]\ndtype = \"float64\"\nvocab_size = 256\nseq_len = 16\nn_layer = 1\n"
                "n_head = 1\nd_model = 1048576\n\n[train]\nsteps = 1\nbatch_size = 2\n\n"
                "[data]\npath = \"{data}\"\n")
    cfg = tiny_corpus_config(tmp_path, template, "abc def", 50)
    result = subprocess.run([sys.executable, "-m", "hpctrain.cli", "train", "--config",
                             str(cfg), "--run-dir", str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("error: out of memory (Unable to allocate 24.0 TiB"), \
        result.stderr
    assert "--explain LAYOUT` predicts each rank's memory" in result.stderr
    assert "Traceback" not in result.stderr
