"""``hpctrain calibrate``: the alpha-beta fit against synthetic times, option checks,
and one quick run of the real thing (mpiexec -n 1 and -n cores) read back."""

import math

import numpy as np
import pytest
from click.testing import CliRunner

from hpctrain.plan import cluster as cl
from hpctrain.plan.calibrate import (
    DEFAULT_MESSAGES,
    Sample,
    calibrate_command,
    core_count,
    cpu_list,
    fit_link,
    fit_pieces,
    last_cache_bytes,
)


def synthetic(op, link, ps=(2, 4), messages=DEFAULT_MESSAGES, noise=0.0, seed=0):
    """Times the ring model gives for ``link``, times (1 + noise * N(0, 1))."""
    rng = np.random.default_rng(seed)
    ps = (2,) if op == "p2p" else ps
    return [Sample(op, p, n, link.time(op, p, n) * (1 + noise * rng.standard_normal()))
            for p in ps for n in messages]


@pytest.mark.parametrize("op", cl.OPS)
def test_the_fit_recovers_latency_and_bandwidth_from_exact_times(op):
    true = cl.Link(latency_s=6e-6, bandwidth_Bps=3e9)
    got = fit_link(op, synthetic(op, true))
    assert got.latency_s == pytest.approx(true.latency_s, rel=1e-9)
    assert got.bandwidth_Bps == pytest.approx(true.bandwidth_Bps, rel=1e-9)


@pytest.mark.parametrize("op", cl.OPS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_fit_recovers_them_within_noise(op, seed):
    # 5% noise on every time: latency rests on the few latency-bound sizes (1-16 KiB),
    # bandwidth on the many bandwidth-bound ones
    true = cl.Link(latency_s=6e-6, bandwidth_Bps=3e9)
    got = fit_link(op, synthetic(op, true, noise=0.05, seed=seed))
    assert got.latency_s == pytest.approx(true.latency_s, rel=0.15)
    assert got.bandwidth_Bps == pytest.approx(true.bandwidth_Bps, rel=0.05)


def test_the_fit_weighs_small_and_large_messages_alike():
    # a least-squares fit in absolute time would follow the 64 MiB point and miss the
    # 1 KiB one by far; in relative error both stay close
    true = cl.Link(latency_s=20e-6, bandwidth_Bps=1e9)
    samples = synthetic("all_reduce", true, noise=0.02, seed=3)
    got = fit_link("all_reduce", samples)
    worst = max(abs(got.time(s.op, s.p, s.nbytes) / s.seconds - 1) for s in samples)
    assert worst < 0.1


def test_a_negative_latency_is_clamped_to_zero():
    # times below the bandwidth line at small sizes would need a < 0
    samples = [Sample("p2p", 2, n, n / 2e9 * (0.5 if n < 10_000 else 1.0))
               for n in DEFAULT_MESSAGES]
    got = fit_link("p2p", samples)
    assert got.latency_s == 0.0
    assert 2e9 < got.bandwidth_Bps < 4e9  # between the two slopes the points lie on


def test_the_fit_refuses_one_size_and_flat_times():
    with pytest.raises(ValueError, match="two or more message sizes"):
        fit_link("p2p", [Sample("p2p", 2, 1024, 1e-5)])
    flat = [Sample("p2p", 2, n, 1e-5 * (1 + 1e-3 * (n == 1024))) for n in DEFAULT_MESSAGES]
    with pytest.raises(ValueError, match="do not grow with the message size"):
        fit_link("p2p", flat)


@pytest.mark.parametrize(("args", "message"), [
    (["--sizes", ""], "'' lists no sizes"),
    (["--sizes", ","], "',' lists no sizes"),
    (["--sizes", "64,0"], "size (0) must be positive"),
    (["--sizes", "64,-128"], "size (-128) must be positive"),
    (["--sizes", "64,big"], "'big' is not a size"),
    (["--messages", "1KiB,0"], "message (0) must be positive"),
    (["--messages", "4KiB"], "needs two or more sizes"),
    (["--ranks-per-node", "0"], "count (0) must be positive"),
    # 64 ranks on a machine of a few cores ran until killed, 0 BLAS threads each
    (["--ranks-per-node", "1,4096"], "4096: at most this machine's"),
    (["--repeats", "0"], "0"),
])
def test_bad_options_are_refused_naming_the_value(tmp_path, args, message):
    out = tmp_path / "c.toml"
    result = CliRunner().invoke(calibrate_command, ["--out", str(out), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not out.exists()


def test_an_output_that_cannot_be_written_is_refused_before_measuring(tmp_path):
    (tmp_path / "file").write_text("")
    result = CliRunner().invoke(calibrate_command, ["--out", str(tmp_path / "file" / "c.toml"),
                                                    "--quick"])
    assert result.exit_code == 2, result.output  # a traceback after the measurement before
    assert "file/c.toml: cannot be written (File exists)" in result.output
    assert "calibrating" not in result.output


def test_a_quick_run_writes_a_description_that_reads_back(tmp_path):
    out = tmp_path / "clusters" / "here.toml"
    result = CliRunner().invoke(calibrate_command, ["--out", str(out), "--quick",
                                                    "--name", "test-box", "--timeout", "60"])
    assert result.exit_code == 0, result.output
    c = cl.load_cluster(out)
    assert c.name == "test-box" and c.num_nodes == 1
    kind = c.kinds["cpu"]
    cores = core_count()
    assert kind.cores == cores and kind.memory_bytes > 2**28
    assert sorted(kind.gemm) == sorted({1, cores})
    for table in kind.gemm.values():
        assert [n for n, _ in table] == [64, 128, 256]
        # positive and finite: how fast is the machine's business (another job may
        # hold its cores), not this test's
        assert all(math.isfinite(r) and r > 0 for _, r in table)
    # (about 2 s: two MPI jobs, -n 1 and -n cores)
    # increasing-ish: with one BLAS thread a rank is never slower on bigger products by
    # much (multi-threaded tables are not checked: a busy core stalls them)
    single = kind.gemm[cores]
    assert single[-1][1] > 0.5 * single[0][1], single
    # the element-wise rate of each ranks-per-node count, which the plan prices
    # LayerNorm, GELU, softmax and the optimizer with
    assert sorted(kind.stream) == sorted({1, cores})
    assert all(math.isfinite(r) and r > 1e8 for r in kind.stream.values()), kind.stream
    assert "element-wise, GB/s per rank" in result.output
    for level in cl.LEVELS:
        for op in cl.OPS:
            link = c.links[level][op]
            lines = [line for _, line in link.ranges] if isinstance(link, cl.Pieces) else [link]
            assert lines[0].latency_s >= 0  # only later ranges may have a negative one
            assert all(line.bandwidth_Bps > 1e6 for line in lines)
    assert c.links["inter"] == c.links["intra"]
    text = out.read_text()
    assert "hpctrain calibrate --out" in text and "one node was measured" in text
    assert "measured" in result.output and "fitted" in result.output


def test_a_failing_mpi_job_is_reported_with_its_command(tmp_path):
    result = CliRunner().invoke(calibrate_command, ["--out", str(tmp_path / "c.toml"),
                                                    "--quick", "--mpiexec", "false"])
    assert result.exit_code == 1
    assert "the MPI job failed (exit status 1): false -n 1" in result.output


def test_a_hung_mpi_job_is_killed_at_the_timeout(tmp_path):
    launcher = tmp_path / "mpiexec"
    launcher.write_text("#!/bin/sh\nsleep 60 &\nwait\n")  # a child that would outlive it
    launcher.chmod(0o755)
    result = CliRunner().invoke(calibrate_command, ["--out", str(tmp_path / "c.toml"),
                                                    "--quick", "--mpiexec", str(launcher),
                                                    "--timeout", "1"])
    assert result.exit_code == 1
    assert "took more than 1 s (--timeout) and was killed" in result.output


def test_pieces_recover_two_lines_and_keep_one_when_it_fits():
    small, large = cl.Link(2e-6, 5e9), cl.Link(0.0, 1.5e9)  # large messages leave caches
    cut = 4 * 1024 * 1024
    samples = [Sample("all_reduce", 2, n, (small if n <= cut else large).time(
        "all_reduce", 2, n)) for n in DEFAULT_MESSAGES]
    one = fit_link("all_reduce", samples)
    big = samples[-1]  # 64 MiB
    assert one.time("all_reduce", 2, big.nbytes) < 0.6 * big.seconds  # one line: far off
    got = fit_pieces("all_reduce", samples)
    assert isinstance(got, cl.Pieces)
    # neighbouring ranges share the size at their cut, so a jump between the lines is
    # fitted within the tolerance, not exactly
    for s in samples:
        assert got.time("all_reduce", 2, s.nbytes) == pytest.approx(s.seconds, rel=0.10)
    assert got.time("all_reduce", 2, big.nbytes) == pytest.approx(big.seconds, rel=0.10)
    # exact times of one line: one line comes back
    plain = synthetic("all_gather", cl.Link(6e-6, 3e9))
    assert isinstance(fit_pieces("all_gather", plain), cl.Link)


def test_pieces_by_hand_three_sizes():
    # 1 KiB in 1 us, 1 MiB in 1 ms (1.05 GB/s through the origin), 64 MiB in 256 ms:
    # the big range grows 4x faster than the small, so two ranges sharing 1 MiB
    kib, mib = 1024, 1024**2
    samples = [Sample("p2p", 2, kib, 1e-6), Sample("p2p", 2, mib, 1e-3),
               Sample("p2p", 2, 64 * mib, 0.256)]
    got = fit_pieces("p2p", samples)
    assert [upto for upto, _ in got.ranges] == [mib, float("inf")]
    second = got.ranges[1][1]
    # through (1 MiB, 1 ms) and (64 MiB, 256 ms): slope 0.255 s / 63 MiB
    assert 1 / second.bandwidth_Bps == pytest.approx(0.255 / (63 * mib))
    assert second.latency_s == pytest.approx(1e-3 - mib * 0.255 / (63 * mib))


def test_the_last_level_cache_is_read_from_sysfs(tmp_path):
    for index, size, shared in (("index0", "48K", "0"), ("index2", "1024K", "0"),
                                ("index3", "32768K", "0-7,64-71")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
        (tmp_path / index / "shared_cpu_list").write_text(shared + "\n")
    assert last_cache_bytes(tmp_path, cpus=16) == 32 << 20  # one cache for all 16
    assert last_cache_bytes(tmp_path, cpus=128) == 8 * (32 << 20)  # 8 of them, 16 cpus each
    (tmp_path / "index3" / "shared_cpu_list").unlink()
    assert last_cache_bytes(tmp_path, cpus=128) == 32 << 20  # sharing unknown: one
    assert last_cache_bytes(tmp_path / "absent", default=123) == 123
    assert cpu_list("0-3,8-9,12\n") == [0, 1, 2, 3, 8, 9, 12]
