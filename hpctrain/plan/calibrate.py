"""``hpctrain calibrate``: measure this machine and write its cluster description.

Three measurements, each in its own MPI job that this command launches
(``mpiexec -n R python -m mpi4py -m hpctrain.plan.calibrate --worker ...``; under
``-m mpi4py`` an exception on one rank aborts the job, and every job has a timeout):

* **GEMM**, for each ranks-per-node count r: r ranks at once, each with ``cores // r``
  BLAS threads, time float32 ``(n, n) @ (n, n)`` products (a warm-up, then the best
  of ``repeats`` batches, all ranks starting together), twice: cycling through
  operands that fill twice the last-level cache, so that they come from memory as a
  layer's weights do in a training step (``gemm``), and one product repeated, its
  operands in the caches (``gemm_cached``: attention's per-head products). A rank's
  rate is ``2 n^3 / t``; the table keeps the median over ranks for each n.
* **Collectives inside the node**, over p = 2 ranks (and p = cores if larger):
  ``Allreduce``, ``Allgather``, ``Reduce_scatter_block`` and a ``Send``/``Recv``
  ping-pong between ranks 0 and 1 (one way: half the round trip), on float32 buffers.
  n bytes is the all-reduce's buffer, the all-gather's result, the reduce-scatter's
  input (the whole, as ``cluster.volume`` counts it) and the one-way message. Each
  sample is a batch of calls after a barrier, timed on every rank; a size's time is
  the median over ``repeats`` samples of the slowest rank's.
* **Fit**, per op, over every (p, n) measured: ``t = steps(p) a + volume(p, n) / b``
  (``cluster.steps``, ``cluster.volume``), least squares in *relative* error so the
  latency-bound small messages count as much as the bandwidth-bound large ones;
  ``a >= 0``. When one line misses a measured time by more than ``PIECE_TOLERANCE``
  (here: large messages leave the caches, point-to-point changes protocol), the sizes
  are cut in ranges, each with its own line: the fewest ranges that bring every miss
  within the tolerance (``fit_pieces``; ``cluster.Pieces``). Both are pure and tested
  on synthetic times.

One node is measured, so ``links.inter`` is a copy of ``links.intra`` (the file says
so in a comment): edit it, or measure a real network, before planning across nodes.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import click
import numpy as np

from hpctrain.plan import cluster as cl

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_SIZES = (64, 128, 256, 512, 1024, 2048)
DEFAULT_MESSAGES = tuple(KiB * 4**i for i in range(9))  # 1 KiB .. 64 MiB
QUICK_SIZES = (64, 128, 256)
QUICK_MESSAGES = (KiB, 16 * KiB, 256 * KiB)
GEMM_BATCH_FLOP = 2e8  # a timed GEMM sample runs products until about this many FLOPs
COMM_BATCH_BYTES = MiB  # a timed collective sample runs calls until about this many bytes
SUSTAINED_FLOP = 2e10  # a sustained GEMM sample (about 0.2 s of a core)
SUSTAINED_PASSES = 40  # a sustained stream sample (about 0.2 s of a core)
OVERLAP_BUCKET_MB = 4.0  # the data-parallel default ([parallel] bucket_mb)
STREAM_ELEMENTS = 16 << 20  # float32 elements per array of the stream probe (64 MiB)
RESULT_TAG = "CALIBRATE-RESULT "  # rank 0's stdout line carrying the measurements
PIECE_TOLERANCE = 0.10  # one line is kept when it misses no measured time by more


# ---------------------------------------------------------------------------------
# the fit (pure)


@dataclass(frozen=True)
class Sample:
    """One measured collective: ``op`` over ``p`` ranks on ``nbytes``, ``seconds``."""

    op: str
    p: int
    nbytes: int
    seconds: float


def fit_link(op: str, samples: list[Sample], *, negative_latency: bool = False) -> cl.Link:
    """The alpha-beta ``Link`` of ``op`` from its samples, by least squares in relative
    error: minimise ``sum_i ((s_i a + v_i x) / t_i - 1)^2`` over ``a >= 0``, ``x > 0``,
    with ``s_i = steps(op, p_i)``, ``v_i = volume(op, p_i, n_i)``; ``b = 1 / x``.

    Dividing each row by its time weights a 2 us latency-bound point like a 20 ms
    bandwidth-bound one. If the unconstrained optimum has ``a < 0`` (bandwidth alone
    explains the times), ``a = 0`` and ``x`` is refitted alone, unless
    ``negative_latency`` (a range of large messages whose time grows faster than their
    size: the intercept of its line is below zero, ``cluster.Pieces`` bounds it).
    """
    if len(samples) < 2 or len({(s.p, s.nbytes) for s in samples}) < 2:
        raise ValueError(f"{op}: fitting latency and bandwidth needs two or more message "
                         f"sizes (got {len(samples)} sample(s))")
    t = np.array([s.seconds for s in samples])
    if not np.all(t > 0):
        raise ValueError(f"{op}: every measured time must be positive (got {t.min()})")
    design = np.array([[cl.steps(op, s.p), cl.volume(op, s.p, s.nbytes)] for s in samples])
    rows = design / t[:, None]  # (N, 2): relative-error rows
    ones = np.ones(len(samples))
    a, x = np.linalg.lstsq(rows, ones, rcond=None)[0]
    if a < 0 and not negative_latency:
        v = rows[:, 1]
        a, x = 0.0, float(v @ ones / (v @ v))
    if not x > 0:
        raise ValueError(f"{op}: the measured times do not grow with the message size, "
                         f"so no bandwidth fits; measure larger messages (--messages)")
    return cl.Link(latency_s=float(a), bandwidth_Bps=float(1.0 / x))


def worst_miss(op: str, link: cl.Link | cl.Pieces, samples: list[Sample]) -> float:
    """The largest relative error of ``link`` over ``samples``."""
    return max(abs(link.time(op, s.p, s.nbytes) / s.seconds - 1) for s in samples)


def fit_pieces(op: str, samples: list[Sample],
               tolerance: float = PIECE_TOLERANCE) -> cl.Link | cl.Pieces:
    """One alpha-beta line (``fit_link``) if it misses no sample by more than
    ``tolerance``; else a line per range of the measured sizes: ranges of two or more
    consecutive sizes, each fitted alone, neighbours sharing the size at their cut (its
    samples count in both), the fewest ranges whose every miss is within ``tolerance``
    (if none are, the ranges whose largest miss is smallest). A dynamic programme over
    the cuts: a handful of sizes, so every range is tried."""
    sizes = sorted({s.nbytes for s in samples})
    line = fit_link(op, samples)
    if worst_miss(op, line, samples) <= tolerance or len(sizes) < 3:
        return line

    def fit(i: int, j: int):
        """(line, worst miss) of sizes[i..j]; only the first range keeps latency >= 0."""
        mine = [s for s in samples if sizes[i] <= s.nbytes <= sizes[j]]
        try:
            link = fit_link(op, mine, negative_latency=i > 0)
        except ValueError:  # flat times: no bandwidth fits this range
            return None, float("inf")
        return link, worst_miss(op, link, mine)

    # best[j]: (excess over tolerance, ranges, cuts) of sizes[0..j] ending at a cut at j
    best = {0: (0.0, 0, [])}
    for j in range(1, len(sizes)):
        options = []
        for i in range(j):
            link, miss = fit(i, j)
            if link is None or i not in best:
                continue
            excess, count, cuts = best[i]
            options.append((max(excess, miss - tolerance, 0.0), count + 1, cuts + [(j, link)]))
        if options:
            best[j] = min(options, key=lambda o: (o[0], o[1]))
    last = len(sizes) - 1
    if last not in best:
        return line
    cuts = best[last][2]
    ranges = [(float(sizes[j]), link) for j, link in cuts[:-1]] + [(float("inf"), cuts[-1][1])]
    return line if len(ranges) == 1 else cl.Pieces(tuple(ranges))


# ---------------------------------------------------------------------------------
# the MPI worker: `python -m mpi4py -m hpctrain.plan.calibrate --worker ...`


def _progress(comm, text: str) -> None:
    if comm.Get_rank() == 0:
        print(text, file=sys.stderr, flush=True)


CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")


def last_cache_bytes(root: Path = CACHE_DIR, default: int = 32 * MiB,
                     cpus: int | None = None) -> int:
    """The bytes of last-level cache this machine has in all: the largest cache of
    cpu0 (sysfs ``index*/size``) times how many of it there are (its
    ``shared_cpu_list`` against ``cpus``, default all of them); ``default`` where
    sysfs does not say."""
    best = None
    for path in root.glob("index*/size"):
        text = path.read_text().strip().upper()
        scale = {"K": KiB, "M": MiB, "G": 1 << 30}.get(text[-1:], 1)
        try:
            size = int(text.rstrip("KMG")) * scale
        except ValueError:
            continue
        if best is None or size > best[0]:
            best = (size, path.parent / "shared_cpu_list")
    if best is None:
        return default
    size, shared = best
    sharing = len(cpu_list(shared.read_text())) if shared.exists() else 0
    cpus = cpus or os.cpu_count() or 1
    return size * max(1, cpus // sharing) if sharing else size


def cpu_list(text: str) -> list[int]:
    """The CPUs of a sysfs list such as ``0-3,8-11`` or ``5``."""
    out = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out += range(int(lo), int(hi or lo) + 1)
    return out


def median_table(rates: dict) -> tuple[tuple[int, float], ...]:
    """A GEMM table, ``((n, FLOP/s), ...)`` ascending, from ``gemm_rates``' result (n
    -> every rank's rate, n perhaps a JSON string): each n's median rank."""
    return tuple(sorted((int(n), statistics.median(r)) for n, r in rates.items()))


def gemm_row(table, cached: dict | None = None) -> str:
    """``n: GFLOP/s`` for every n of a table, each followed by the cached table's rate
    in parentheses where it has one."""
    cached = dict(cached or ())
    return ", ".join(f"{n}: {r / 1e9:.1f}"
                     + (f" ({cached[n] / 1e9:.1f})" if n in cached else "")
                     for n, r in table)


def gemm_rates(comm, sizes: list[int], repeats: int, sustained: bool = False,
               pool_bytes: int | None = None) -> dict[int, list[float]]:
    """Each rank's float32 ``n x n x n`` FLOP/s for every n, all ranks at once; a dict
    n -> [rate of rank 0, rank 1, ...] on every rank. Collective over ``comm``.

    A sample is a batch of about ``GEMM_BATCH_FLOP`` and a rank's rate its best sample;
    ``sustained``: batches of ``SUSTAINED_FLOP`` and the median sample, the rate of a
    rank that shares its core (a CPU quota or another node on the core lets one short
    batch run at full speed, ``DEVELOPERS.md``).

    The operands come from memory, as a layer's weights do in a training step (last
    touched a whole pass before): a batch cycles through as many operand sets as fill
    ``pool_bytes`` (default: twice the node's last-level caches, over its ranks);
    ``pool_bytes=0``: one set, repeated in the caches. Small products run slower from
    memory (n = 128: 69 against 96 GFLOP/s on one core here), large ones alike
    (``DEVELOPERS.md``)."""
    if pool_bytes is None:
        from mpi4py import MPI

        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        pool_bytes = 2 * last_cache_bytes() // local.Get_size()
        local.Free()
    out = {}
    for n in sizes:
        rng = np.random.default_rng(comm.Get_rank())
        sets = max(1, -(-pool_bytes // (3 * 4 * n * n)))
        operands = [(rng.standard_normal((n, n), dtype=np.float32),
                     rng.standard_normal((n, n), dtype=np.float32),
                     np.empty((n, n), np.float32)) for _ in range(sets)]
        flop = SUSTAINED_FLOP if sustained else GEMM_BATCH_FLOP
        batch = max(1, int(flop / (2.0 * n**3)))
        for a, b, c in operands:  # warm-up: BLAS threads started, pages touched
            np.matmul(a, b, out=c)
        times, i = [], 0
        for _ in range(repeats):
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(batch):  # on through the sets: a sample starts where one ended
                a, b, c = operands[i]
                np.matmul(a, b, out=c)
                i = (i + 1) % sets
            times.append((time.perf_counter() - t0) / batch)
        best = statistics.median(times) if sustained else min(times)
        rates = np.empty(comm.Get_size())
        comm.Allgather(np.array([2.0 * n**3 / best]), rates)
        out[n] = rates.tolist()
        _progress(comm, f"  gemm  {comm.Get_size()} rank(s)  n = {n:5d}: "
                        + ", ".join(f"{r / 1e9:.1f}" for r in rates) + " GFLOP/s per rank")
        del operands
    comm.Barrier()
    return out


def _collective(comm, op: str, nbytes: int):
    """A zero-argument call of ``op`` on float32 buffers of ``nbytes`` (the whole, as
    ``cluster.volume`` counts it; rounded down to a multiple of 4 p bytes), and the
    bytes it actually moves."""
    from mpi4py import MPI

    p, rank = comm.Get_size(), comm.Get_rank()
    count = max(p, nbytes // 4 // p * p)
    if op == "all_reduce":
        x, y = np.ones(count, np.float32), np.empty(count, np.float32)
        return (lambda: comm.Allreduce(x, y, op=MPI.SUM)), 4 * count
    if op == "all_gather":
        x, y = np.ones(count // p, np.float32), np.empty(count, np.float32)
        return (lambda: comm.Allgather(x, y)), 4 * count
    if op == "reduce_scatter":
        x, y = np.ones(count, np.float32), np.empty(count // p, np.float32)
        return (lambda: comm.Reduce_scatter_block(x, y, op=MPI.SUM)), 4 * count
    count = max(1, nbytes // 4)  # p2p: ranks 0 and 1 ping-pong, the others wait
    buf = np.ones(count, np.float32)

    def ping_pong():
        if rank == 0:
            comm.Send(buf, dest=1, tag=7)
            comm.Recv(buf, source=1, tag=7)
        elif rank == 1:
            comm.Recv(buf, source=0, tag=7)
            comm.Send(buf, dest=0, tag=7)
    return ping_pong, 4 * count


def collective_times(comm, messages: list[int], repeats: int,
                     sent: list[float] | None = None, quiet: bool = False,
                     ops: tuple[str, ...] = cl.OPS) -> list[Sample]:
    """Seconds of each of ``ops`` on each message size over ``comm`` (see the module):
    the median over ``repeats`` of the slowest rank's mean over a batch; no ping-pong
    on one rank. ``sent``: a list this rank's bytes sent by the ring model
    (``cluster.volume``) over every call made is appended to (what the link must have
    carried at least). ``quiet``: no progress lines (another group prints them).
    Collective."""
    from mpi4py import MPI

    p = comm.Get_size()
    samples = []
    for op in [op for op in ops if p > 1 or op != "p2p"]:
        for nbytes in messages:
            call, moved = _collective(comm, op, nbytes)
            batch = max(1, min(1000, COMM_BATCH_BYTES // moved))
            call()  # warm-up: connections made, pages touched
            local = np.empty(repeats)
            for i in range(repeats):
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(batch):
                    call()
                local[i] = (time.perf_counter() - t0) / batch
            if op == "p2p":
                local /= 2  # one way: half the round trip
                if comm.Get_rank() > 1:
                    local[:] = 0.0
            slowest = np.empty(repeats)
            comm.Allreduce(local, slowest, op=MPI.MAX)
            seconds = float(np.median(slowest))
            samples.append(Sample(op, 2 if op == "p2p" else p, moved, seconds))
            if sent is not None and (op != "p2p" or comm.Get_rank() < 2):
                sent.append(cl.volume(op, p, moved) * (1 + repeats * batch))
            if not quiet:
                _progress(comm, f"  {op:14s} p = {p}  {_bytes(moved):>9s}: "
                                f"{seconds * 1e6:10.1f} us")
    return samples


def pair_times(comm, messages: list[int], repeats: int,
               sent: list[float] | None = None) -> list[Sample]:
    """``collective_times`` over pairs of ranks (0-1, 2-3, ...), every pair at once, as
    the groups of two inside a layout run beside each other (the tensor groups of tp 2 x
    dp 2, the stages of a pipeline); rank 0's pair's samples, on every rank of it.
    ``comm`` has an even number of ranks, 4 or more. Collective."""
    p, rank = comm.Get_size(), comm.Get_rank()
    if p < 4 or p % 2:
        raise ValueError(f"pairs need an even number of ranks, 4 or more (got {p})")
    pair = comm.Split(rank // 2, rank)
    try:
        _progress(comm, f"  the same over {p // 2} pairs at once:")
        return collective_times(pair, messages, repeats, sent, quiet=rank > 1)
    finally:
        pair.Free()


def stream_rates(comm, n: int = STREAM_ELEMENTS, repeats: int = 8,
                 sustained: bool = False) -> list[float]:
    """Each rank's element-wise bytes/s (``a + b -> c`` on float32 arrays of ``n``,
    3 x 4 n bytes read and written), every rank at once; the list on every rank. A
    sample is one pass and a rank's rate its best; ``sustained``: a sample is
    ``SUSTAINED_PASSES`` passes and the rate the median sample. Collective."""
    a, b, c = (np.ones(n, np.float32) for _ in range(3))
    passes = SUSTAINED_PASSES if sustained else 1
    times = []
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(passes):
            np.add(a, b, out=c)
        times.append((time.perf_counter() - t0) / passes)
    best = statistics.median(times) if sustained else min(times)
    rates = comm.allgather(3 * 4 * n / best)
    _progress(comm, "  stream " + ", ".join(f"{r / 1e9:.1f}" for r in rates) + " GB/s per rank")
    return rates


def worker(argv: list[str]) -> None:
    """Rank 0 prints one ``RESULT_TAG`` line of JSON: GEMM rates and collective samples."""
    parser = argparse.ArgumentParser(prog="hpctrain.plan.calibrate --worker")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--sizes", default="")
    parser.add_argument("--messages", default="")
    parser.add_argument("--gemm-repeats", type=int, default=1)
    parser.add_argument("--comm-repeats", type=int, default=1)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--sustained", action="store_true")
    parser.add_argument("--overlap", type=int, default=0,
                        help="bytes of gradient buckets summed beside compute (overlap.py)")
    parser.add_argument("--pairs", action="store_true",
                        help="also the collectives over pairs of ranks, all pairs at once")
    args = parser.parse_args(argv)
    from mpi4py import MPI

    from hpctrain.runtime import set_blas_threads

    comm = MPI.COMM_WORLD
    set_blas_threads(args.threads)
    ints = [int(v) for v in args.sizes.split(",") if v]
    messages = [int(v) for v in args.messages.split(",") if v]
    result = {"ranks": comm.Get_size(), "threads": args.threads, "gemm": {}, "samples": []}
    if ints:
        result["gemm"] = gemm_rates(comm, ints, args.gemm_repeats, args.sustained)
        result["gemm_cached"] = gemm_rates(comm, ints, args.gemm_repeats, args.sustained,
                                           pool_bytes=0)
    if args.stream:
        result["stream"] = stream_rates(comm, sustained=args.sustained)
    if messages:
        if comm.Get_size() < 2:
            raise SystemExit("collectives need two or more ranks")
        sent: list[float] = []
        # with pairs, the ping-pong is timed in the pairs, every pair at it
        ops = tuple(op for op in cl.OPS if op != "p2p") if args.pairs else cl.OPS
        samples = collective_times(comm, messages, args.comm_repeats, sent, ops=ops)
        if args.pairs:
            samples += pair_times(comm, messages, args.comm_repeats, sent)
        result["samples"] = [s.__dict__ for s in samples]
        result["sent_bytes"] = sum(sent)
    if args.overlap:
        from hpctrain.plan.overlap import group_times

        result["overlap"] = group_times(comm, args.overlap, OVERLAP_BUCKET_MB,
                                        max(1, args.comm_repeats))
        for p, times in result["overlap"].items():
            _progress(comm, f"  overlap, groups of {p}: " + ", ".join(
                f"{k} {v:.4g}" for k, v in times.items()))
    if comm.Get_rank() == 0:
        print(RESULT_TAG + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------
# the command: launch the workers, fit, write, read back


def _bytes(n: float) -> str:
    for unit, size in (("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n:g} B"


def _parse_bytes(text: str) -> int:
    t = text.strip()
    for suffix, mult in (("KiB", KiB), ("MiB", MiB), ("GiB", 1 << 30), ("K", KiB),
                         ("M", MiB), ("G", 1 << 30), ("B", 1)):
        if t.endswith(suffix):
            return int(t[: -len(suffix)].strip()) * mult
    return int(t)


def _int_list(what: str, parse=int):
    """A click callback: a comma-separated list of positive integers, or a BadParameter
    naming the value."""

    def callback(ctx, param, value):
        if value is None:
            return None
        items = [v for v in value.split(",") if v.strip()]
        if not items:
            raise click.BadParameter(f"{value!r} lists no {what}")
        out = []
        for item in items:
            try:
                n = parse(item)
            except ValueError:
                raise click.BadParameter(f"{item.strip()!r} is not a {what[:-1]}") from None
            if n <= 0:
                raise click.BadParameter(f"{what[:-1]} ({item.strip()}) must be positive")
            out.append(n)
        return tuple(sorted(set(out)))
    return callback


def core_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def meminfo_bytes(field: str) -> int | None:
    """``field`` of /proc/meminfo (MemTotal, MemAvailable, ...) in bytes; None where
    the file or the field is missing."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * KiB
    return None


def memory_gib() -> float:
    """MemTotal of /proc/meminfo, in GiB."""
    total = meminfo_bytes("MemTotal")
    if total is None:
        raise click.ClickException("no MemTotal in /proc/meminfo")
    return total / 2**30


def run_worker(launcher: str, ranks: int, threads: int, sizes, messages,
               repeats: tuple[int, int], timeout: float, *, stream: bool = False,
               sustained: bool = False, command=None, overlap: int = 0,
               pairs: bool = False) -> dict:
    """One MPI job of ``ranks`` ranks; its progress goes to stderr as it runs, its
    result comes back. A failure or a timeout is a ClickException with the command.
    ``command(ranks, argv)``: the launch command of ``argv`` (default ``launcher -n
    ranks argv``; the emulated cluster's mpiexec over its nodes)."""
    argv = [sys.executable, "-m", "mpi4py", "-m",
            "hpctrain.plan.calibrate", "--worker", "--threads", str(threads),
            "--sizes", ",".join(map(str, sizes)), "--messages", ",".join(map(str, messages)),
            "--gemm-repeats", str(repeats[0]), "--comm-repeats", str(repeats[1])]
    argv += (["--stream"] if stream else []) + (["--sustained"] if sustained else [])
    argv += ["--overlap", str(overlap)] if overlap else []
    argv += ["--pairs"] if pairs else []
    cmd = command(ranks, argv) if command else [launcher, "-n", str(ranks), *argv]
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    return job_result(cmd, RESULT_TAG, timeout, env=env, timeout_hint=" (--timeout)")


def job_result(cmd: list[str], tag: str, timeout: float, *, env: dict | None = None,
               timeout_hint: str = "") -> dict:
    """Run the MPI job ``cmd`` and return the JSON of the stdout line its rank 0 starts
    with ``tag``; a failure, a timeout (the job's whole session killed) or a missing
    line is a ClickException naming the command."""
    # a session of its own, so that a timeout ends mpiexec and every rank it started
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise click.ClickException(f"the MPI job took more than {timeout:g} s{timeout_hint} "
                                   f"and was killed: {shlex.join(cmd)}") from None
    if proc.returncode != 0:
        raise click.ClickException(f"the MPI job failed (exit status {proc.returncode}): "
                                   f"{shlex.join(cmd)}")
    for line in stdout.splitlines():
        if line.startswith(tag):
            return json.loads(line[len(tag):])
    raise click.ClickException(f"the MPI job printed no result: {shlex.join(cmd)}")


def describe_link(link: cl.Link | cl.Pieces) -> str:
    lines = link.ranges if isinstance(link, cl.Pieces) else ((float("inf"), link),)
    return "; ".join(("" if upto == float("inf") else f"up to {_bytes(upto)}: ")
                     + f"latency {line.latency_s * 1e6:.2f} us, "
                       f"bandwidth {line.bandwidth_Bps / 1e9:.2f} GB/s"
                     for upto, line in lines)


def fit_report(op: str, link: cl.Link | cl.Pieces, samples: list[Sample]) -> list[str]:
    """Lines: measured against fitted time for each sample, relative error."""
    lines = [f"{op}: {describe_link(link)}"]
    for s in samples:
        fitted = link.time(op, s.p, s.nbytes)
        lines.append(f"  p = {s.p}  {_bytes(s.nbytes):>9s}  measured {s.seconds * 1e6:10.1f} us"
                     f"  fitted {fitted * 1e6:10.1f} us  {fitted / s.seconds - 1:+7.1%}")
    return lines


def header(command: str, how: str, load: str) -> str:
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join([
        f"# Written by `hpctrain calibrate` on {socket.gethostname()}, {when}:",
        f"#   {command}",
        f"#   ({how})",
        f"# /proc/loadavg before measuring: {load}",
        "# GEMM: float32 n x n x n, each rank's FLOP/s (median over ranks, best of repeats); "
        "gemm: operands\n# from memory (cycled through twice the last-level cache), "
        "gemm_cached: one product repeated",
        "# stream: element-wise bytes/s of one rank (a + b -> c over 64 MiB float32 arrays, "
        "read and\n# written), every rank at once, by ranks per node",
        "# links: least-squares alpha-beta fits (relative error) of MPI collectives", "", ""])


INTER_NOTE = ("# inter: one node was measured, so these are the intra-node fits copied: "
              "replace them\n# with a real network's before planning across nodes\n")


@dataclass(frozen=True)
class Settings:
    """What to measure: GEMM tables at ``ranks_per_node``, collectives over ``comm_ranks``."""

    cores: int
    ranks_per_node: tuple[int, ...]
    sizes: tuple[int, ...]
    messages: tuple[int, ...]
    gemm_repeats: int
    comm_repeats: int

    @property
    def comm_ranks(self) -> tuple[int, ...]:
        return tuple(sorted({2, self.cores}))

    def describe(self) -> str:
        return (f"ranks per node {','.join(map(str, self.ranks_per_node))}; GEMM n "
                f"{','.join(map(str, self.sizes))}, best of {self.gemm_repeats}; collectives "
                f"over p = {','.join(map(str, self.comm_ranks))}, {_bytes(self.messages[0])} "
                f"to {_bytes(self.messages[-1])}, median of {self.comm_repeats}")


def measure(plan: Settings, launcher: str, timeout: float, sustained: bool = True):
    """Run the MPI jobs: one per rank count (GEMM and collectives share a job when both
    use it). Returns the GEMM tables ``{ranks: ((n, median FLOP/s), ...)}`` with the
    operands from memory and in the caches, the element-wise rate ``{ranks: median
    bytes/s}`` of each ranks-per-node count (``stream_rates``, all ranks at once;
    ``sustained``: samples of ``SUSTAINED_PASSES`` passes, as ``--emulated`` times
    them) and the collective samples."""
    gemm, cached, stream, samples = {}, {}, {}, []
    for ranks in sorted(set(plan.ranks_per_node) | set(plan.comm_ranks)):
        do_gemm, do_comm = ranks in plan.ranks_per_node, ranks in plan.comm_ranks
        threads = max(1, plan.cores // ranks)
        what = " and ".join(w for w, on in (("GEMM", do_gemm), ("collectives", do_comm)) if on)
        click.echo(f"== {ranks} rank(s), {threads} BLAS thread(s) each: {what}", err=True)
        t0 = time.perf_counter()
        result = run_worker(launcher, ranks, threads, plan.sizes if do_gemm else (),
                            plan.messages if do_comm else (),
                            (plan.gemm_repeats, plan.comm_repeats), timeout,
                            stream=do_gemm, sustained=sustained)
        if do_gemm:
            gemm[ranks] = median_table(result["gemm"])
            cached[ranks] = median_table(result["gemm_cached"])
            stream[ranks] = statistics.median(result["stream"])
        samples += [Sample(**s) for s in result["samples"]]
        click.echo(f"   {time.perf_counter() - t0:.0f} s", err=True)
    return gemm, cached, stream, samples


def summary(c: cl.Cluster, path: str) -> str:
    kind = next(iter(c.kinds.values()))
    lines = ["", "GEMM, GFLOP/s per rank (median over ranks), by n, operands from memory "
             "(operands in the caches):"]
    for ranks, table in sorted(kind.gemm.items()):
        lines.append(f"  {ranks} rank(s)/node: "
                     + gemm_row(table, (kind.gemm_cached or {}).get(ranks)))
    if kind.stream:
        rates = sorted(kind.stream.items())
        lines.append("element-wise, GB/s per rank (median over ranks): " + ", ".join(
            f"{ranks} rank(s)/node {rate / 1e9:.1f}" for ranks, rate in rates))
    lines.append("links (intra; inter = intra, one node measured):")
    for op, link in c.links["intra"].items():
        lines.append(f"  {op:14s} {describe_link(link)}")
    lines.append(f"wrote {path} (read back: {c.num_nodes} node, {kind.cores} cores, "
                 f"{kind.memory_bytes / 2**30:.1f} GiB)")
    return "\n".join(lines)


def _command_line(ctx: click.Context) -> str:
    """The command as the user gave it (options they left out, left out)."""
    words = ["hpctrain", "calibrate"]
    for param in ctx.command.params:
        if ctx.get_parameter_source(param.name) != click.core.ParameterSource.COMMANDLINE:
            continue
        flag = param.opts[0]
        value = ctx.params[param.name]
        if param.is_flag:
            words.append(flag)
        else:
            words += [flag, ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]
    return shlex.join(words)


@click.command(name="calibrate")
@click.option("--out", required=True, type=click.Path(dir_okay=False),
              help="The cluster description to write (TOML, as `hpctrain plan` reads it).")
@click.option("--ranks-per-node", callback=_int_list("counts"),
              help="Ranks-per-node counts to measure GEMM tables for, comma-separated "
                   "[default: 1 and the core count].")
@click.option("--sizes", callback=_int_list("sizes"),
              help="GEMM sides n (n x n x n float32 products), comma-separated "
                   f"[default: {','.join(map(str, DEFAULT_SIZES))}; --quick: "
                   f"{','.join(map(str, QUICK_SIZES))}].")
@click.option("--messages", callback=_int_list("messages", _parse_bytes),
              help="Collective message sizes in bytes (suffixes KiB, MiB allowed), "
                   "comma-separated [default: 1KiB to 64MiB by x4; --quick: 1KiB,16KiB,256KiB].")
@click.option("--repeats", type=click.IntRange(min=1),
              help="Timed samples per measurement [default: 5 for GEMM and 15 for "
                   "collectives; --quick: 2].")
@click.option("--name", help="The cluster's name in the file [default: the host name].")
@click.option("--mpiexec", help="MPI launcher (default: the one beside this Python).")
@click.option("--timeout", default=600, show_default=True, type=click.IntRange(min=1),
              help="Seconds one MPI job may take before it is killed.")
@click.option("--quick", is_flag=True,
              help="Few sizes and repeats (seconds, for tests): the figures are rough.")
@click.option("--emulated", metavar="NODES:LINK",
              help="Measure an emulated cluster instead of this machine (root): NODES "
                   "one-core nodes whose links are shaped at LINK, e.g. 2:1gbit or "
                   "4:100mbit; the links between nodes are measured over the shaped link "
                   "(hpctrain/plan/emulated.py).")
def calibrate_command(out: str, ranks_per_node, sizes, messages, repeats, name, mpiexec,
                      timeout: int, quick: bool, emulated: str | None) -> None:
    """Measure this machine (GEMM rates, element-wise rate, MPI collectives) and write
    its cluster file.

    GEMM: for each ranks-per-node count r, r ranks at once, each with cores // r BLAS
    threads, time float32 n x n x n products twice, the operands cycled through twice
    the last-level cache (gemm: a layer's weights, from memory) and one product
    repeated (gemm_cached: attention's products, in the caches); each n keeps the
    median rank's rate. Element-wise (stream): the same r ranks at once, a + b -> c over
    64 MiB arrays, the median of 8 samples of 40 passes (--quick: the best single
    pass), the median rank's bytes/s; the plan prices LayerNorm, GELU, softmax and the
    optimizer with it. Collectives: over 2 ranks (and over the core count if larger)
    all-reduce, all-gather, reduce-scatter and a ping-pong, fitted per op to t = steps(p) latency
    + volume(p, n) / bandwidth (hpctrain/plan/cluster.py). One node is measured: the
    inter-node links are copies of the intra-node ones, and the file says so.
    With --emulated, an emulated cluster of one-core nodes is built, measured across
    its shaped links (with how much a data-parallel sum and the compute beside it
    slow each other: comm_slowdown, compute_slowdown) and removed (root).

    \b
    Examples:
      hpctrain calibrate --out configs/clusters/this-machine.toml
      hpctrain calibrate --out /tmp/c.toml --quick
      hpctrain calibrate --out c.toml --ranks-per-node 1,2,4 --messages 4KiB,1MiB,16MiB
      sudo hpctrain calibrate --out configs/clusters/emulated-2x1gbit.toml --emulated 2:1gbit
    """
    from hpctrain.clitypes import launcher as launcher_of

    if messages is not None and len(messages) < 2:
        raise click.BadParameter(f"{','.join(map(str, messages))}: fitting latency and "
                                 f"bandwidth needs two or more sizes", param_hint="--messages")
    launcher = launcher_of(mpiexec)
    check_output(Path(out))  # before minutes of measurement
    if emulated:
        from hpctrain.plan import emulated as emu

        if ranks_per_node:
            raise click.BadParameter("an emulated node has one core and one rank",
                                     param_hint="--ranks-per-node")
        emu.calibrate(emulated, out, sizes, messages, repeats, name, launcher, timeout, quick,
                      _command_line(click.get_current_context()))
        return
    cores = core_count()
    over = [r for r in ranks_per_node or () if r > cores]
    if over:  # a rank would get no core of its own, and cores // r no BLAS thread
        raise click.BadParameter(f"{','.join(map(str, over))}: at most this machine's "
                                 f"{cores} cores", param_hint="--ranks-per-node")
    plan = Settings(cores, ranks_per_node or tuple(sorted({1, cores})),
                    sizes or (QUICK_SIZES if quick else DEFAULT_SIZES),
                    messages or (QUICK_MESSAGES if quick else DEFAULT_MESSAGES),
                    repeats or (2 if quick else 5), repeats or (2 if quick else 15))
    load = Path("/proc/loadavg").read_text().strip()
    click.echo(f"calibrating {socket.gethostname()}: {cores} cores, {memory_gib():.1f} GiB; "
               f"load {load}", err=True)
    gemm, cached, stream, samples = measure(plan, launcher, timeout, sustained=not quick)

    click.echo("\ncollectives inside the node, measured against fitted:")
    links = {}
    for op in cl.OPS:
        mine = [s for s in samples if s.op == op]
        try:
            links[op] = fit_pieces(op, mine)
        except ValueError as err:
            raise click.ClickException(str(err)) from None
        click.echo("\n".join(fit_report(op, links[op], mine)))
    kind = cl.NodeKind("cpu", cores, memory_gib() * 2**30, gemm, stream, gemm_cached=cached)
    cluster = cl.Cluster(name or socket.gethostname(), "mpiexec", {"cpu": kind},
                         (("cpu", 1),), {"intra": links, "inter": dict(links)})
    text = header(_command_line(click.get_current_context()), plan.describe(), load)
    text += cl.to_toml(cluster).replace("[links.inter]", INTER_NOTE + "[links.inter]")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text.rstrip("\n") + "\n")
    try:
        back = cl.load_cluster(out)
    except cl.ClusterError as err:
        raise click.ClickException(f"{out} was written but does not read back: {err}") from None
    click.echo(summary(back, out))


def check_new_output(out: Path, option: str, force: bool, inputs: dict[str, str | None]
                     ) -> None:
    """Before the work: ``check_replaceable``, and the output's folder can be made and
    written into (``check_output``)."""
    check_replaceable(out, option, force, inputs)
    check_output(out, option)


def check_replaceable(out: Path, option: str, force: bool,
                      inputs: dict[str, str | Path | None]) -> None:
    """``out`` (``option``'s file) is none of ``inputs`` (option -> path; not even
    with --force), and replaces an existing file only with ``force``; else a usage
    error naming the path."""
    from hpctrain.data.format import same_file

    for name, given in inputs.items():
        if given and same_file(out, given):
            raise click.BadParameter(f"{out}: is the {name} file, which {option} never "
                                     f"replaces (not even with --force)", param_hint=option)
    if not force and (out.exists() or out.is_symlink()):
        raise click.BadParameter(f"{out}: already exists; pass --force to replace it",
                                 param_hint=option)


def check_output(out: Path, option: str = "--out") -> None:
    """The output's folder can be made and written into (a file is made and removed
    there), or a usage error naming the path and ``option``."""
    import tempfile

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=".calibrate-"):
            pass
    except OSError as err:
        raise click.BadParameter(f"{out}: cannot be written ({err.strerror or err})",
                                 param_hint=option) from None


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
    else:
        calibrate_command()
