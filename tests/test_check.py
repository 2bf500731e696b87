"""``hpctrain check``: a layout of the user's config against one rank, through the CLI
under ``mpiexec`` on a tiny byte-level corpus. A correct layout is equal to one rank;
a data-parallel sum broken on purpose (MPI.MAX for MPI.SUM) is caught and the job
exits 1; what differs from one rank by design is refused by name."""

import subprocess
import sys
import textwrap

import pytest

from hpctrain.check import FOLDER_PREFIX, Comparison, remove_abandoned
from hpctrain.testing import run_mpi, tiny_corpus_config

CONFIG = textwrap.dedent("""
    [model]
    vocab_size = 256
    seq_len = 16
    n_layer = 2
    n_head = 2
    d_model = 16

    [train]
    steps = 100
    batch_size = 4
    warmup_steps = 1
    eval_interval = 10
    save_interval = 0

    [data]
    path = "{data}"
""")

# the check with the data-parallel gradient sum broken: MAX where the sum belongs
BROKEN = textwrap.dedent("""
    import sys
    from mpi4py import MPI
    from hpctrain.cli import main
    from hpctrain.parallel import data

    data.allreduce_launcher = lambda comm: (
        lambda bucket, view: comm.Iallreduce(MPI.IN_PLACE, view, op=MPI.MAX))
    main(["check", *sys.argv[1:]])
""")


# the check whose one-rank run fails on rank 0 alone (a fault put in: the layout's
# run is on both ranks, the serial one on rank 0's MPI.COMM_SELF)
SERIAL_FAILS = textwrap.dedent("""
    import sys
    from mpi4py import MPI
    from hpctrain import train as training
    from hpctrain.cli import main
    from hpctrain.data import DataError
    from hpctrain.guard import DivergenceError

    KIND = {kind!r}
    layout_run = training.train

    def train(cfg, comm, **kw):
        if comm.Get_size() == 1 and MPI.COMM_WORLD.Get_size() > 1:
            raise (DataError if KIND == "data" else DivergenceError)(
                "the one-rank run failed (a fault put in by the test)")
        return layout_run(cfg, comm, **kw)

    training.train = train
    main(["check", *sys.argv[1:]])
""")


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    return tiny_corpus_config(tmp_path_factory.mktemp("check"), CONFIG,
                              "to be, or not to be, that is the question.", 400)


def check(config_file, *args, script=None):
    command = [sys.executable, "-m", "hpctrain.cli", "check"] if script is None \
        else [sys.executable, str(script)]
    return run_mpi(2, [*command, "--config", str(config_file), *args], timeout=120)


@pytest.mark.parametrize("layout", [[], ["--tp", "2", "--sequence-parallel"],
                                    ["--pp", "2", "--microbatches", "2", "--zero", "1"]])
def test_a_correct_layout_equals_one_rank(config_file, layout):
    result = check(config_file, "--steps", "3", *layout)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"hpctrain check: {config_file} at ") and "(2 ranks)" in lines[0]
    assert "3 steps in float64 (model dtype float32 -> float64)" in lines[0]
    assert lines[1].startswith("the layout: 3 steps in ") and lines[1].endswith("now one rank")
    assert lines[2].startswith("one rank: 3 steps in ")
    assert [line.split()[0] for line in lines[4:7]] == ["1", "2", "3"]
    assert lines[-1].startswith("equal to one rank: largest relative difference ")
    assert float(lines[-1].split()[7]) <= 1e-12


def test_a_broken_gradient_sum_is_caught(config_file, tmp_path):
    script = tmp_path / "broken.py"
    script.write_text(BROKEN)
    result = check(config_file, "--steps", "2", script=script)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "DIFFERS from one rank from step 1 on" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--averaging", "periodic"], "averaging ('periodic') trains each replica on its own"),
    (["--pp", "2", "--microbatches", "2", "--pipeline-training", "local"],
     "pipeline_training ('local') trains each stage on a loss of its own"),
    (["--resume", "auto"], "--resume: check trains from scratch"),
    (["--tpp", "2"], "No such option '--tpp'"),
    (["--tp", "3"], "tp (3) must divide n_head (2)"),
    (["--rtol", "nan"], "nan is not a finite number"),  # nan passed every comparison
])
def test_what_cannot_equal_one_rank_is_refused(config_file, args, message):
    result = check(config_file, *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_a_zero_3_layout_without_resharding_is_compared_with_one_rank():
    # the one-rank reference (zero 0) kept reshard_after_forward false, which only
    # zero 3 takes: every such config failed before its check began
    from hpctrain.check import prepare
    from hpctrain.config import from_dict

    cfg = from_dict({"model": {"n_layer": 2, "d_model": 16, "n_head": 2, "seq_len": 8},
                     "parallel": {"zero": 3, "reshard_after_forward": False},
                     "train": {"batch_size": 4}}).validate(2)
    layout, serial, _ = prepare(cfg, 2, "float64")
    assert serial.validate(1).parallel.zero == 0
    assert not layout.parallel.reshard_after_forward


def test_a_layout_of_measured_shares_is_compared_with_one_rank_of_the_whole_batch():
    # one rank takes the whole batch (shares 'equal'); the re-measuring period, which
    # only shares 'measured' reads, goes back to its default with it
    from hpctrain.check import prepare
    from hpctrain.config import from_dict

    cfg = from_dict({"model": {"n_layer": 2, "d_model": 16, "n_head": 2, "seq_len": 8},
                     "parallel": {"shares": "measured", "remeasure_every": 5},
                     "train": {"batch_size": 4}}).validate(2)
    layout, serial, _ = prepare(cfg, 2, "float64")
    assert serial.validate(1).parallel.shares == "equal"
    assert layout.parallel.remeasure_every == 5


def test_batchnorm_models_are_compared_at_one_microbatch():
    # BatchNorm's statistics are per microbatch: at pp 2 and 2 microbatches a correct
    # layout "DIFFERS" from one rank's whole batch (8e-3), which the check refuses instead
    from dataclasses import replace

    from hpctrain.check import prepare
    from hpctrain.config import ConfigError, from_dict

    cfg = from_dict({"model": {"kind": "cnn", "input_dim": 64, "channels": [2, 3],
                               "n_classes": 10},
                     "parallel": {"microbatches": 2}, "train": {"batch_size": 8}}).validate(2)
    with pytest.raises(ConfigError, match=r"the CNN classifier takes BatchNorm's statistics "
                                          r"per microbatch, so 2 microbatches"):
        prepare(cfg, 2, "float64")
    one = replace(cfg, parallel=replace(cfg.parallel, microbatches=1))
    assert prepare(one, 2, "float64")[1].parallel.dp == 1


@pytest.mark.parametrize("kind, status", [("data", 2), ("divergence", 4)])
def test_the_one_rank_run_failing_on_rank_0_ends_every_rank(config_file, tmp_path, kind,
                                                            status):
    """Rank 0's one-rank run raised alone (a user error, or a divergence, which the
    ranks of a run agree on: here a run of one rank) and the other ranks waited for it
    until the finalize timeout: 30 s and a report blaming them for being stuck."""
    script = tmp_path / "serial_fails.py"
    script.write_text(SERIAL_FAILS.format(kind=kind))
    result = check(config_file, "--steps", "2", script=script)
    assert result.returncode == status, (result.returncode, result.stderr)
    assert result.stderr.count("the one-rank run failed (a fault put in by the test)") == 1, \
        result.stderr
    assert "have not come" not in result.stderr and "Traceback" not in result.stderr, \
        result.stderr


def test_the_verdict_names_the_first_step_beyond_the_tolerance():
    c = Comparison([(2.0, 1.0), (1.5, 0.5), (1.2, 0.4)],
                   [(2.0, 1.0), (1.5, 0.5 * (1 + 1e-6)), (1.3, 0.4)], rtol=1e-8)
    assert c.first_beyond == 2 and c.largest == pytest.approx(0.1 / 1.2)
    assert Comparison([(1.0, 1.0)], [(1.0, 1.0 + 1e-12)], rtol=1e-8).first_beyond is None
    assert Comparison([(1.0, 1.0)], [(float("nan"), 1.0)], rtol=1e-8).first_beyond == 1
    nan = float("nan")  # a step both runs skipped (non-finite) agrees
    assert Comparison([(nan, nan)], [(nan, nan)], rtol=1e-8).first_beyond is None


def test_float32_is_checked_at_its_own_tolerance(config_file):
    result = check(config_file, "--steps", "2", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    first, last = result.stdout.splitlines()[0], result.stdout.splitlines()[-1]
    assert first.endswith("2 steps in float32") and "(--rtol 0.0001)" in last


def test_folders_of_stopped_checks_are_removed_and_live_ones_kept(tmp_path):
    """A check ended by Ctrl-C (another rank's MPI_Abort kills rank 0 before its own
    cleanup) left its folder behind for good; the next check removes it."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = tmp_path / f"{FOLDER_PREFIX}{gone}-abc123"
    (stale / "layout").mkdir(parents=True)
    (stale / "layout" / "metrics.jsonl").write_text("{}\n")
    live = tmp_path / f"{FOLDER_PREFIX}1-def456"  # pid 1 runs
    live.mkdir()
    other = tmp_path / f"{FOLDER_PREFIX}xyz"  # not of this form: left alone
    other.mkdir()
    assert remove_abandoned(tmp_path) == [stale]
    assert not stale.exists() and live.is_dir() and other.is_dir()
