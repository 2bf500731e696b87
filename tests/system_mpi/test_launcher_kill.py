"""Whether ``hpctrain train`` warns that its launcher would kill a stop before the
checkpoint is written (``preempt.stop_time_note``): under Open MPI's ``mpirun`` with
``odls_base_sigkill_timeout`` 0 (SIGTERM and SIGKILL at once) rank 0 says so, naming the
parameter and the value to give it; under Open MPI 5's (PRRTE), whose sequence has fixed
steps of 0.25 s, a run whose step and save take longer is told to stop with SIGUSR1;
under MPICH's ``mpiexec``, which passes signals on, nothing is said."""

import os

from hpctrain import preempt
from hpctrain.testing import run_train, tiny_corpus_config

CONFIG = """
[model]
seq_len = 16
n_layer = 2
n_head = 2
d_model = 32
[train]
steps = 3
batch_size = 8
save_interval = 1
eval_interval = 0
[data]
path = "{data}"
"""
# steps of about 0.5 s at 2 ranks: longer than Open MPI 5's fixed quarter of a second
SLOWER = CONFIG.replace("seq_len = 16", "seq_len = 128").replace(
    "d_model = 32", "d_model = 256").replace("batch_size = 8", "batch_size = 32")


def test_rank_0_names_a_kill_delay_too_short_for_a_stop(tmp_path):
    mpi = os.environ["HPCTRAIN_EXPECT_MPI"]
    cfg = tiny_corpus_config(tmp_path, SLOWER if mpi == "openmpi5" else CONFIG,
                             "to be, or not to be, that is the question.", 400)
    job = run_train(2, cfg, tmp_path / "run", env={preempt.ORTE_KILL_DELAY: "0"})
    assert job.returncode == 0, job.stderr
    notes = [line for line in job.stdout.splitlines() if "mpirun stops a job" in line]
    if mpi == "openmpi":
        assert len(notes) == 1, job.stdout  # once, after the first checkpoint
        assert "SIGTERM after 0 s and SIGKILL 0 s later" in notes[0], notes
        assert "--mca odls_base_sigkill_timeout 5 " in notes[0], notes
    elif mpi == "openmpi5":  # PRRTE: no such parameter; the variable above is not read
        assert len(notes) == 1, job.stdout
        assert "SIGTERM after 0.25 s and SIGKILL 0.25 s later" in notes[0], notes
        assert "stop it with SIGUSR1 to mpirun" in notes[0], notes
    else:
        assert notes == [], job.stdout
