"""The stall watchdog without mpiexec: the tracer's position, the phase arithmetic,
rank 0's message from hand-made reports (``diagnose``), and the thread itself on a
one-rank communicator with an ``abort`` that records instead of ending the process.
``test_watchdog_jobs.py`` runs real stalled jobs under mpiexec."""

import io
import re
import threading
import time
from dataclasses import replace

import pytest
from mpi4py import MPI

from hpctrain import trace, watchdog
from hpctrain.watchdog import EXIT_STALLED, Report, diagnose, phase_of

# ---- the tracer's position ---------------------------------------------------------------


def test_position_lists_the_open_spans_of_the_main_thread_outermost_first():
    tracer = trace.Tracer(keep_events=False)
    assert tracer.position().spans == () and tracer.position().closed is None
    seen = {}
    with trace.recording(tracer):
        tracer.step = 3
        with trace.span("step", "other"), trace.span("F", "compute", mb=1, chunk=0):
            with trace.span("all_reduce", "tp_comm", bytes=8):
                reader = threading.Thread(target=lambda: seen.update(p=tracer.position()))
                reader.start()
                reader.join()
        tracer.step = None
    position = seen["p"]
    assert [(n, c, a) for n, c, a, _ in position.spans] == [
        ("step", "other", {}), ("F", "compute", {"mb": 1, "chunk": 0}),
        ("all_reduce", "tp_comm", {"bytes": 8})]
    assert position.step == 3
    starts = [s for *_, s in position.spans]
    assert starts == sorted(starts)
    after = tracer.position()
    assert after.spans == () and after.closed[0] == 3 and after.closed[1] >= starts[-1]


def test_spans_of_helper_threads_are_not_the_main_threads_position():
    tracer = trace.Tracer(keep_events=False)
    inside = threading.Event()
    leave = threading.Event()

    def helper():
        with tracer.span("bucket", "dp_comm"):
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=helper)
    with tracer.span("step", "other"):
        thread.start()
        inside.wait(10)
        assert [s[0] for s in tracer.position().spans] == ["step"]
        leave.set()
        thread.join()
    assert tracer.position().spans == ()


def test_phase_is_the_step_while_it_is_open_then_the_time_since_it_closed():
    tracer = trace.Tracer(keep_events=False)
    assert phase_of(tracer.position(), time.perf_counter()) is None
    tracer.step = 7
    with tracer.span("step", "other"):
        step, in_step, seconds = phase_of(tracer.position(), time.perf_counter() + 2.0)
        assert (step, in_step) == (7, True) and 2.0 <= seconds < 3.0
    tracer.step = None
    step, in_step, seconds = phase_of(tracer.position(), time.perf_counter() + 1.0)
    assert (step, in_step) == (7, False) and 1.0 <= seconds < 2.0


# ---- rank 0's message ----------------------------------------------------------------


def report(rank, *spans, step=3, in_step=True, seconds=5.0, shape=(4, 1, 1), frames=None):
    """A report of rank ``rank`` in a (dp, tp, pp) = ``shape`` grid; ``spans`` as
    (name, cat, args), "step" added outermost when in a step."""
    dp, tp, pp = shape
    coords = (rank // (dp * tp), (rank // tp) % dp, rank % tp)  # (pp, dp, tp)
    opened = ((("step", "other", {}),) if in_step else ()) + tuple(spans)
    return Report(rank, step, in_step, seconds, opened,
                  frames if frames is not None else (f"f.py:{rank} in fn",), coords, shape)


DP_WAIT = ("dp_wait", "dp_comm", {})


def lines_of(message):
    return message.splitlines()


def test_dp4_names_the_rank_reading_its_batch_and_the_reduction_the_others_wait_in():
    reports = {r: report(r, DP_WAIT) for r in (0, 1, 3)}
    reports[2] = report(2, ("data", "data", {}), frames=("loader.py:9 in read",))
    lines = lines_of(diagnose(reports, 4, timeout=5.0))
    assert lines[0] == ("stall: step 3 has not completed after 5.0 s (stall timeout 5 s); "
                        "ending the job")
    assert lines[1] == ("  ranks 0, 1, 3 wait in dp_wait (gradient reduction over the "
                        "data group) for rank 2")
    assert lines[2] == ("  rank 2 has not arrived: it is in data (step 3), not in a "
                        "communication, at loader.py:9 in read")
    assert lines[3].startswith("where each rank is")
    assert lines[4].startswith("  rank 0 (pp 0 dp 0 tp 0): step 3, 5.0 s: step > dp_wait")
    assert lines[6] == "  rank 2 (pp 0 dp 2 tp 0): step 3, 5.0 s: step > data | loader.py:9 in read"
    assert lines[-1] == watchdog.HINT and len(lines) == 9


def test_dp2_tp2_each_group_waits_for_its_missing_members():
    shape = (2, 2, 1)  # rank = dp * 2 + tp: tensor groups [0, 1] [2, 3], data [0, 2] [1, 3]
    f = ("F", "compute", {"mb": 0, "chunk": 0})
    reports = {0: report(0, DP_WAIT, shape=shape), 1: report(1, DP_WAIT, shape=shape),
               2: report(2, f, shape=shape),
               3: report(3, f, ("all_reduce", "tp_comm", {"bytes": 64}), shape=shape)}
    lines = lines_of(diagnose(reports, 4, timeout=3))
    assert lines[1:4] == [
        "  ranks 0, 1 wait in dp_wait (gradient reduction over the data group) for ranks 2, 3",
        "  rank 3 waits in all_reduce (all-reduce over the tensor group) during "
        "F (mb 0, chunk 0) for rank 2",
        "  rank 2 has not arrived: it is in F (mb 0, chunk 0) (step 3), not in a "
        "communication, at f.py:2 in fn"]


def test_pipeline_receive_waits_for_its_peer_stage():
    shape = (1, 1, 2)  # rank = pp
    recv = ("recv_forward", "pp_wait", {"mb": 1, "chunk": 1, "peer": 0})
    reports = {0: report(0, ("F", "compute", {"mb": 1, "chunk": 0}), shape=shape),
               1: report(1, recv, shape=shape)}
    lines = lines_of(diagnose(reports, 2, timeout=3))
    assert lines[1] == ("  rank 1 waits in recv_forward (receive of an activation over the "
                        "pipeline group) for rank 0")
    assert lines[2].startswith("  rank 0 has not arrived: it is in F (mb 1, chunk 0)")


def test_a_rank_at_an_earlier_step_and_a_silent_rank_have_not_arrived():
    reports = {0: report(0, DP_WAIT), 1: report(1, DP_WAIT),
               2: report(2, step=2, in_step=False, seconds=9.0,
                         frames=("writer.py:40 in write",))}
    lines = lines_of(diagnose(reports, 4, timeout=5))
    assert lines[1] == ("  ranks 0, 1 wait in dp_wait (gradient reduction over the data "
                        "group) for ranks 2, 3")
    assert lines[2] == ("  rank 2 has not arrived: it is still after step 2, at "
                        "writer.py:40 in write")
    assert lines[3].startswith("  rank 3 did not answer")
    assert "  rank 3: no answer" in lines


def test_untraced_waits_after_a_step_the_largest_group_at_one_place_waits():
    mean = ("train.py:128 in mean_over",)
    reports = {r: report(r, step=2, in_step=False, frames=mean) for r in (0, 2, 3)}
    reports[1] = report(1, step=2, in_step=False, frames=("job.py:32 in slow",))
    lines = lines_of(diagnose(reports, 4, timeout=2))
    assert lines[0].startswith("stall: the work after step 2 (metrics, evaluation, "
                               "checkpoint, preemption check, the end of the run) has "
                               "not completed")
    assert lines[1] == "  ranks 0, 2, 3 are after step 2, at train.py:128 in mean_over"
    assert lines[2] == ("  rank 1 has not arrived: it is after step 2, not in a traced "
                        "communication, at job.py:32 in slow")


def test_two_ranks_at_two_places_without_spans_are_listed_not_blamed():
    reports = {0: report(0, step=2, in_step=False, frames=("job.py:32 in slow",)),
               1: report(1, step=2, in_step=False, frames=("train.py:128 in mean_over",))}
    lines = lines_of(diagnose(reports, 2, timeout=2))
    assert lines[1].startswith("  no rank waits in a traced communication")
    assert lines[2:4] == ["    rank 0: after step 2, at job.py:32 in slow",
                          "    rank 1: after step 2, at train.py:128 in mean_over"]
    assert not any("has not arrived" in line for line in lines)


def test_every_rank_in_a_different_communication_is_a_mismatch():
    two = (2, 1, 1)
    reports = {0: report(0, DP_WAIT, shape=two),
               1: report(1, ("grad_norm", "optimizer", {"comm": "world_comm"}), shape=two)}
    lines = lines_of(diagnose(reports, 2, timeout=2))
    assert "  rank 1 waits in grad_norm (gradient-norm all-reduce over every rank) " \
           "for rank 0" in lines
    assert any("the ranks called different operations" in line for line in lines)


def in_startup(rank, *spans, seconds=5.0, frames=None):
    """A report of ``rank`` in the start-up: ``spans`` open, no step."""
    return replace(report(rank, *spans, step=None, in_step=False, seconds=seconds,
                          frames=frames), in_step=True)


def test_a_rank_behind_in_the_start_up_is_named_with_its_phase():
    # rank 0 still loads its kernels; the others have gone on to open the data and wait
    # in its agreement: the hold-up is rank 0's phase, not theirs
    reports = {0: in_startup(0, ("load_kernels", "other", {}),
                             frames=("kernels.py:9 in load",))}
    reports |= {r: in_startup(r, ("open_data", "other", {}),
                              ("startup_check", "other", {"comm": "world_comm"}), seconds=4.0)
                for r in (1, 2, 3)}
    lines = lines_of(diagnose(reports, 4, timeout=5))
    assert lines[0] == ("stall: the start-up (loading the compiled kernels) has not "
                        "completed after 5.0 s (stall timeout 5 s); ending the job")
    assert lines[1] == ("  ranks 1, 2, 3 wait in startup_check (agreement on the start-up's "
                        "errors over every rank) during open_data for rank 0")
    assert lines[2] == ("  rank 0 has not arrived: it is still in load_kernels (start-up), "
                        "at kernels.py:9 in load")


def exited(rank, status, *, step=3, in_step=True, shape=(4, 1, 1)):
    """The report a rank sends when its run ended by ``SystemExit(status)``."""
    return replace(report(rank, step=step, in_step=False, seconds=0.0, shape=shape,
                          frames=("job.py:7 in leave", "train.py:667 in step")),
                   in_step=in_step, exited=status)


def test_a_rank_that_exited_alone_is_named_with_its_status_not_as_silent():
    reports = {r: report(r, DP_WAIT) for r in (0, 2, 3)}
    reports[1] = exited(1, 7)
    lines = lines_of(diagnose(reports, 4, timeout=300))
    assert lines[0] == ("exit: rank 1 left the run alone (a SystemExit) while the other "
                        "ranks are still in it; ending the job")
    assert lines[1] == ("  ranks 0, 2, 3 wait in dp_wait (gradient reduction over the "
                        "data group) for rank 1")
    assert lines[2] == ("  rank 1 has left the run: it exited with status 7 (SystemExit) "
                        "in step 3, at job.py:7 in leave")
    assert not any("did not answer" in line or "has not arrived" in line for line in lines)
    assert ("  rank 1 (pp 0 dp 1 tp 0): exited with status 7 in step 3 | job.py:7 in leave "
            "< train.py:667 in step") in lines
    assert lines[-1] == watchdog.EXIT_HINT
    assert watchdog.abort_status(reports) == 7


def test_an_exit_with_status_0_after_a_step_still_ends_the_job_with_an_error():
    reports = {0: report(0, ("loss_mean", "other", {"comm": "world_comm"}), step=2,
                         in_step=False, shape=(2, 1, 1)),
               1: exited(1, 0, step=2, in_step=False, shape=(2, 1, 1))}
    lines = lines_of(diagnose(reports, 2, timeout=300))
    assert "  rank 1 has left the run: it exited with status 0 (SystemExit) after step 2, " \
           "at job.py:7 in leave" in lines
    assert watchdog.abort_status(reports) == EXIT_STALLED  # the job did not finish


# ---- the thread, on one rank -----------------------------------------------------------


class Recorder:
    """An ``abort`` that records the code instead of ending the process."""

    def __init__(self):
        self.codes = []
        self.called = threading.Event()

    def __call__(self, code):
        self.codes.append(code)
        self.called.set()


def watch(tracer, timeout=0.3, **kw):
    abort, out = Recorder(), io.StringIO()
    dog = watchdog.Watchdog(MPI.COMM_SELF, tracer, timeout, poll=0.02, grace=0.1,
                            abort=abort, out=out, coords=(0, 0, 0), shape=(1, 1, 1), **kw)
    return dog, abort, out


def test_a_step_longer_than_the_timeout_is_reported_and_aborted():
    tracer = trace.Tracer(keep_events=False)
    dog, abort, out = watch(tracer)
    dog.start()
    try:
        with trace.recording(tracer):
            tracer.step = 4
            with trace.span("step", "other"), trace.span("data", "data"):
                assert abort.called.wait(10)
    finally:
        dog.stop()
    assert abort.codes == [EXIT_STALLED]
    text = out.getvalue()
    assert re.match(r"stall: step 4 has not completed on rank 0 after \d+\.\d s \(stall "
                    r"timeout 0.3 s\)", text)
    assert re.search(r"step 4, \d+\.\d s: step > data \| threading.py:", text)  # innermost
    assert "in test_a_step_longer_than_the_timeout_is_reported_and_aborted" in text


def test_steps_that_complete_never_trigger_it_even_past_the_timeout_in_total():
    tracer = trace.Tracer(keep_events=False)
    dog, abort, _ = watch(tracer)
    dog.start()
    try:
        for step in range(1, 21):  # 20 steps of 0.05 s: 1 s in all, 0.3 s allowed each
            tracer.step = step
            with tracer.span("step", "other"):
                time.sleep(0.05)
            tracer.step = None
    finally:
        dog.stop()
    assert not abort.called.is_set()
    assert not dog._thread.is_alive()


def test_the_gap_after_a_step_is_timed_too():
    tracer = trace.Tracer(keep_events=False)
    dog, abort, out = watch(tracer)
    dog.start()
    try:
        tracer.step = 2
        with tracer.span("step", "other"):
            pass
        tracer.step = None
        assert abort.called.wait(10)  # e.g. a checkpoint write that never returns
    finally:
        dog.stop()
    assert out.getvalue().startswith("stall: after step 2 has not completed on rank 0")


def test_a_watchdog_whose_starter_raised_stops_by_itself():
    tracer = trace.Tracer(keep_events=False)
    dog, abort, _ = watch(tracer)

    def train_that_raises():
        dog.start()  # watches while this frame runs, as train() does
        tracer.step = 1
        with tracer.span("step", "other"):
            pass
        raise RuntimeError("diverged")

    with pytest.raises(RuntimeError):
        train_that_raises()
    dog._thread.join(10)
    assert not dog._thread.is_alive() and not abort.called.is_set()


def test_timeout_zero_is_no_watchdog_and_a_negative_one_is_refused():
    assert isinstance(watchdog.start(None, trace.Tracer(), 0), watchdog.NullWatchdog)
    with pytest.raises(ValueError, match=r"timeout \(-1\) must be positive"):
        watchdog.Watchdog(MPI.COMM_SELF, trace.Tracer(), -1)


class Unwritable(io.StringIO):
    """A stream whose writes fail, as stderr on a closed pipe does."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")


def test_an_error_of_the_thread_while_ending_a_stall_still_ends_the_job(capfd):
    """The report of a stall could not be written (EPIPE): the thread died with Python's
    traceback naming no rank, and the job, its ranks waiting, was never ended."""
    tracer = trace.Tracer(keep_events=False)
    abort = Recorder()
    dog = watchdog.Watchdog(MPI.COMM_SELF, tracer, 0.3, poll=0.02, grace=0.1, abort=abort,
                            out=Unwritable(), coords=(0, 0, 0), shape=(1, 1, 1))
    dog.start()
    try:
        with trace.recording(tracer):
            tracer.step = 2
            with trace.span("step", "other"):
                assert abort.called.wait(10)
    finally:
        dog.stop()
    assert abort.codes == [EXIT_STALLED]
    err = capfd.readouterr().err
    assert err.startswith("[rank 0] the stall watchdog stopped on an error; ending the "
                          "job:\n"), err
    assert "[rank 0]   BrokenPipeError: [Errno 32] Broken pipe" in err
