"""The largest GPT that trains in a memory budget: ZeRO 0, 1, 3, 3 with full
recomputation, and bf16 (issue 22, deliverable 5).

    .venv/bin/python benchmarks/bench_largest.py                       20 GiB, 8 ranks, C 1024
    .venv/bin/python benchmarks/bench_largest.py --budget-gib 3 --ranks 4 --d-model 256

For each row, the largest depth (``n_layer``) at ``d_model`` C, ``n_head`` H, ``seq_len``
T and vocabulary V, every rank one data-parallel rank (dp = ranks) with one sequence a
rank (``--batch``), AdamW, float32 unless the row says bf16. The rows add one lever
each::

    zero0        dp = ranks, everything replicated
    zero1        + the optimizer state 1/dp
    zero3        + parameters and gradients 1/dp (gathered a piece at a time)
    zero3-full   + full activation recomputation (each block keeps its input only)
    bf16         parameters and activations in bfloat16 ([train] precision), with
                 full recomputation and the highest ZeRO stage the option combines
                 with (printed); without the option the row says "not available"

The search, per row:

1. The planner's model (``plan.cost.predict_memory``, the terms of ``plan/memory.py``)
   gives each depth's per-rank step peak of traced memory; the engine's build
   (``build_bytes``) holds the whole model's parameters twice at ZeRO 0-2, and at
   ZeRO 3, which shards each piece as it is built, the rank's shards and one piece;
   the larger of the two plus the process overhead neither counts (interpreter,
   libraries, MPI: RSS minus that peak, the most measured so far, ``--overhead-mib``
   before the first trial) is the predicted RSS. The deepest model predicted within
   ``budget / ranks`` is the first candidate; a depth predicted above it is never run.
2. Each candidate trains ``--steps`` steps as its own MPI job (``hpctrain.train`` with
   ``[train] memory_report``): each rank's traced peak and peak RSS. A trial fits when
   the job succeeds and every rank's peak RSS is within ``budget / ranks``.
3. A fit raises the lower bound, and the candidate becomes the deepest depth predicted
   to fit with the overhead measured; a miss lowers the upper bound and the next
   candidate is the midpoint (binary search) between the two.

A miss fails the trial, not the machine: a watcher polls every rank's RSS
(``/proc/PID/statm``, every 0.1 s) and kills the job's process group the moment one
exceeds its share, and each rank caps its own data segment (``RLIMIT_DATA``: what it
had mapped beyond its resident memory at start, plus its share, plus 256 MiB for thread
stacks), so an allocation past that raises MemoryError in the rank that makes it.

Printed per row: layers, parameters, the planner's per-rank peak against the measured
traced peak, the predicted and measured per-rank peak RSS, the median step time (steps
after the first; the load average is printed, figures taken beside other jobs are
slower), and the trials run. ``--out`` keeps each trial's run directory and
``largest.json``.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
PY = str(ROOT / ".venv/bin/python")
MPIEXEC = str(ROOT / ".venv/bin/mpiexec")
MiB = 1 << 20
GiB = 1 << 30

# row -> its layouts, ([parallel] zero, [train] recompute, [train] precision), the
# first that this hpctrain's Config.validate accepts (bf16: the most the precision
# option combines with)
ROWS = {
    "zero0": [(0, "none", "fp32")],
    "zero1": [(1, "none", "fp32")],
    "zero3": [(3, "none", "fp32")],
    "zero3-full": [(3, "full", "fp32")],
    "bf16": [(3, "full", "bf16"), (2, "full", "bf16"), (1, "full", "bf16"),
             (0, "full", "bf16")],
}


@dataclass(frozen=True)
class Shape:
    """What every row shares: the model's width and the layout."""

    ranks: int
    d_model: int
    n_head: int
    seq_len: int
    vocab: int
    batch: int
    steps: int


def raw_config(shape: Shape, layout: tuple, layers: int, run_dir: str) -> dict:
    """The config of one trial, as ``config.from_dict`` reads it."""
    zero, rc, precision = layout
    train = {"batch_size": shape.batch, "steps": shape.steps, "optimizer": "adamw",
             "lr": 3e-4, "warmup_steps": 1, "eval_interval": 0, "log_interval": 1,
             "seed": 1234, "recompute": rc, "memory_report": True, "run_dir": run_dir,
             "blas_threads": 1, "row_threads": 1, "stall_timeout": 0.0}
    if precision != "fp32":
        train["precision"] = precision
    return {"model": {"kind": "gpt", "vocab_size": shape.vocab, "seq_len": shape.seq_len,
                      "n_layer": layers, "n_head": shape.n_head, "d_model": shape.d_model,
                      "dtype": "float32"},
            "parallel": {"dp": shape.ranks, "zero": zero},
            "train": train,
            "data": {"path": str(ROOT / "data/shakespeare.h5")}}


def validated(raw: dict, ranks: int):
    from hpctrain import config

    return config.from_dict(raw, source="bench_largest").validate(ranks)


def choose_layout(shape: Shape, row: str) -> tuple[tuple | None, str]:
    """The row's first layout this hpctrain accepts, or None and why not."""
    from hpctrain import config

    if ROWS[row][0][2] != "fp32" and "precision" not in {
            f.name for f in fields(config.TrainConfig)}:
        return None, "not available: this hpctrain has no [train] precision"
    why = ""
    for layout in ROWS[row]:
        try:
            validated(raw_config(shape, layout, 1, "unused"), shape.ranks)
            return layout, ""
        except config.ConfigError as err:
            why = f"not available: {err}"
    return None, why


def describe(layout: tuple) -> str:
    zero, rc, precision = layout
    return f"zero {zero}, recompute {rc}, {precision}"


def practice(cfg):
    """The planner's Practice for a trial's config (element sizes; the recomputation is
    the config's, as the default practice takes it)."""
    from hpctrain.plan import cost

    reduced = getattr(cfg.train, "precision", "fp32") != "fp32"
    return cost.Practice(element_bytes=2 if reduced else None,
                         master_bytes=4 if reduced else 0)


def predicted_traced(shape: Shape, layout: tuple, layers: int) -> int:
    """The planner's per-rank peak (the largest over pipeline ranks) of a depth."""
    from hpctrain.plan import cost

    cfg = validated(raw_config(shape, layout, layers, "unused"), shape.ranks)
    return max(m.total for m in cost.predict_memory(cfg, practice(cfg)))


BUILD_COPIES = 2  # ZeRO 0-2: the whole model's parameters held at once while built
PIECE_COPIES = 2  # ZeRO 3: the piece being drawn, in its float32 parameters' bytes


def build_bytes(shape: Shape, layout: tuple, layers: int) -> int:
    """Each rank's peak while the engine is built, before the first step.

    ZeRO 0-2: the serial model's float32 parameters whole, twice (not measured again:
    their step peaks are far above it). ZeRO 3 builds a piece at a time and shards
    each piece at once (``parallel/zero3_build.py``): the rank's 1/dp shards of the
    parameters and of their gradients, and the piece being drawn, whose float32
    arrays and the float64 draw of its largest weight stay under two of its float32
    size (a GPT block: 5/3). The old ZeRO-3 build held the whole model twice and the
    shard (703 MiB RSS for a 274 MiB model at dp 4, 100 MiB of it the process); now
    its step peak, which holds the optimizer state and a gathered piece as well, is
    the larger. The planner does not count the build. glibc keeps freed arrays
    (``runtime.keep_freed_memory``), so RSS never falls back below it."""
    whole = 4 * parameters(shape, layers)
    if layout[0] == 3:
        return 2 * whole // shape.ranks + PIECE_COPIES * 4 * largest_piece(shape, layers)
    return whole * BUILD_COPIES


def predicted_peak(shape: Shape, layout: tuple, layers: int) -> int:
    """The most traced-like bytes a rank holds: its step (the planner) or its build."""
    return max(predicted_traced(shape, layout, layers), build_bytes(shape, layout, layers))


def parameters(shape: Shape, layers: int) -> int:
    from hpctrain.plan import memory as mem

    cfg = validated(raw_config(shape, ROWS["zero0"][0], layers, "unused"), shape.ranks)
    return sum(mem.rank_param_sizes(cfg.model, 1, 1, 1, "layers", 0))


def largest_piece(shape: Shape, layers: int) -> int:
    """Parameters of the GPT's largest pipeline piece (a block, or embedding or head)."""
    from hpctrain.parallel.stages import costs_of

    cfg = validated(raw_config(shape, ROWS["zero0"][0], layers, "unused"), shape.ranks)
    costs = costs_of(cfg.model)
    return int(max(costs.first, *costs.middle, costs.last))


def deepest_predicted(shape: Shape, layout: tuple, per_rank: int, overhead: int,
                      cap: int) -> int:
    """The deepest depth in [0, cap] whose predicted RSS is within ``per_rank`` (the
    prediction grows with depth: a binary search)."""
    lo, hi = 0, cap + 1  # lo fits (0: nothing), hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if predicted_peak(shape, layout, mid) + overhead <= per_rank:
            lo = mid
        else:
            hi = mid
    return lo


# ---------------------------------------------------------------------------------
# one trial: an MPI job, watched


@dataclass
class Trial:
    layers: int
    ok: bool
    why: str = ""
    rss_peak: int = 0  # the most any rank held resident (ru_maxrss, or the watcher's)
    traced_peak: int = 0  # the most any rank's tracemalloc peak
    step_s: float = 0.0
    seconds: float = 0.0
    per_rank: list = field(default_factory=list)


def _descendants(root: int) -> list[int]:
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, todo = [], [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found += kids
        todo += kids
    return found


def _rss(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf(
            "SC_PAGE_SIZE")
    except OSError:
        return 0


class Watcher(threading.Thread):
    """Polls the RSS of every process under ``proc``; kills its process group when
    one exceeds ``limit`` bytes."""

    def __init__(self, proc: subprocess.Popen, limit: int):
        super().__init__(daemon=True)
        self.proc, self.limit = proc, limit
        self.most, self.killed = 0, False

    def run(self):
        while self.proc.poll() is None:
            rss = max((_rss(p) for p in _descendants(self.proc.pid)), default=0)
            self.most = max(self.most, rss)
            if rss > self.limit:
                self.killed = True
                kill_job(self.proc)
                return
            time.sleep(0.1)


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL the MPI job this bench started: every process under its mpiexec (the
    ranks run in process groups of their own), then mpiexec's group."""
    for pid in _descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def trial(shape: Shape, row: str, layout: tuple, layers: int, per_rank: int, out: Path,
          timeout: float) -> Trial:
    run_dir = out / f"{row}-L{layers}"
    raw = raw_config(shape, layout, layers, str(run_dir))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "BENCH_LARGEST_PER_RANK": str(per_rank)}
    cmd = [MPIEXEC, "-n", str(shape.ranks), PY, "-m", "mpi4py", __file__, "worker",
           json.dumps(raw)]
    t0 = time.perf_counter()
    log = (out / f"{row}-L{layers}.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    watcher = Watcher(proc, per_rank)
    watcher.start()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(proc)
        proc.wait()
        code = "timeout"
    watcher.join()
    log.close()
    result = Trial(layers, False, seconds=time.perf_counter() - t0, rss_peak=watcher.most)
    if watcher.killed:
        result.why = f"killed: a rank's RSS reached {watcher.most / MiB:.0f} MiB"
        return result
    if code != 0:
        tail = (out / f"{row}-L{layers}.log").read_text().strip().splitlines()[-3:]
        result.why = f"exit {code}: " + " / ".join(tail)[-300:]
        return result
    from hpctrain.metrics import read_metrics

    records = read_metrics(run_dir / "metrics.jsonl")
    memory = [r for r in records if "memory_per_rank" in r][-1]["memory_per_rank"]
    result.per_rank = memory
    result.rss_peak = max(m["rss_peak"] for m in memory)
    result.traced_peak = max(m["peak"] for m in memory)
    times = [r["step_time_s"] for r in records if r.get("step", 0) >= 2 and "step_time_s" in r]
    result.step_s = statistics.median(times) if times else float("nan")
    result.ok = result.rss_peak <= per_rank
    if not result.ok:
        result.why = f"RSS {result.rss_peak / MiB:.0f} MiB over {per_rank / MiB:.0f} MiB"
    return result


def worker(raw_json: str) -> None:
    """One rank of a trial: cap the data segment, train with the memory report."""
    from mpi4py import MPI

    import hpctrain  # noqa: F401  (before NumPy: OpenBLAS's thread timeout)
    from hpctrain.runtime import abort_on_error
    from hpctrain.train import train

    per_rank = int(os.environ["BENCH_LARGEST_PER_RANK"])
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text()
                  .splitlines() if ":" in line)
    kib = {k: int(status[k].split()[0]) * 1024 for k in ("VmData", "VmRSS")}
    cap = kib["VmData"] - kib["VmRSS"] + per_rank + 256 * MiB
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 0:
        print(f"rank 0: VmData {kib['VmData'] / MiB:.0f} MiB, VmRSS {kib['VmRSS'] / MiB:.0f} "
              f"MiB at start; RLIMIT_DATA {cap / MiB:.0f} MiB", flush=True)
    with abort_on_error(comm):
        cfg = validated(json.loads(raw_json), comm.Get_size())
        train(cfg, comm, quiet=True)


# ---------------------------------------------------------------------------------
# the search


def search(shape: Shape, row: str, layout: tuple, per_rank: int, overhead: list[int],
           cap: int, out: Path, timeout: float, say) -> dict:
    lo, hi = 0, cap + 1  # lo trained within the budget (0: none yet); hi did not
    best, trials = None, []
    cand = cap
    while True:
        # never a depth predicted above the budget (the overhead may have grown)
        cand = min(cand, deepest_predicted(shape, layout, per_rank, overhead[0], cap))
        if not lo < cand < hi:
            break
        pred = predicted_traced(shape, layout, cand)
        say(f"  {row}: L = {cand}, predicted step {pred / MiB:.0f} MiB traced, build "
            f"{build_bytes(shape, layout, cand) / MiB:.0f} MiB, + {overhead[0] / MiB:.0f} "
            f"MiB overhead")
        t = trial(shape, row, layout, cand, per_rank, out, timeout)
        trials.append(t)
        say(f"    {'fits' if t.ok else 'misses'}: RSS {t.rss_peak / MiB:.0f} MiB, traced "
            f"{t.traced_peak / MiB:.0f} MiB, step {t.step_s:.2f} s, {t.seconds:.0f} s "
            f"{t.why}")
        if t.per_rank:  # what neither counts (the process itself): the most measured
            seen = max(m["rss_peak"] - max(m["peak"], build_bytes(shape, layout, cand))
                       for m in t.per_rank)
            overhead[:] = [seen if len(overhead) == 1 else max(overhead[0], seen), True]
        if t.ok:  # the deepest predicted to fit next, below any miss
            lo, best = cand, t
            cand = hi - 1
        else:  # binary search between the deepest fit and this miss
            hi = cand
            cand = (lo + hi) // 2
    row_out = {"row": row, "layout": describe(layout), "layers": lo,
               "trials": [vars(t) | {"per_rank": None} for t in trials]}
    if best is not None:
        row_out |= {"parameters": parameters(shape, lo),
                    "predicted_traced": predicted_traced(shape, layout, lo),
                    "build": build_bytes(shape, layout, lo),
                    "predicted_rss": predicted_peak(shape, layout, lo) + overhead[0],
                    "measured_traced": best.traced_peak, "measured_rss": best.rss_peak,
                    "step_s": best.step_s,
                    "next_predicted_rss": predicted_peak(shape, layout, lo + 1)
                    + overhead[0]
                    if lo < cap else None}
    return row_out


def table(rows: list[dict]) -> str:
    lines = ["row | layout | layers | parameters | predicted traced (MiB/rank) | measured traced | "
             "error | predicted RSS | measured RSS | step (s) | trials (L: fit/miss)"]
    for r in rows:
        if "note" in r:
            lines.append(f"{r['row']} | {r['note']}")
            continue
        trials = ", ".join(f"{t['layers']}:{'fit' if t['ok'] else 'miss'}"
                           for t in r["trials"])
        if "parameters" not in r:
            lines.append(f"{r['row']} | {r['layout']} | none fits | | | | | | | | {trials}")
            continue
        err = r["predicted_traced"] / r["measured_traced"] - 1
        lines.append(
            f"{r['row']} | {r['layout']} | {r['layers']} | {r['parameters'] / 1e6:.1f} M | "
            f"{r['predicted_traced'] / MiB:.0f} | {r['measured_traced'] / MiB:.0f} | "
            f"{100 * err:+.1f}% | {r['predicted_rss'] / MiB:.0f} | "
            f"{r['measured_rss'] / MiB:.0f} | {r['step_s']:.2f} | {trials}")
    return "\n".join(lines)


@click.group(invoke_without_command=True,
             context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--budget-gib", default=20.0, show_default=True,
              help="Memory budget of the whole job; each rank may hold budget / ranks.")
@click.option("--ranks", default=8, show_default=True, help="MPI ranks (dp = ranks).")
@click.option("--d-model", default=1024, show_default=True, help="Model width C.")
@click.option("--n-head", default=16, show_default=True, help="Attention heads H.")
@click.option("--seq-len", default=256, show_default=True, help="Sequence length T.")
@click.option("--vocab", default=256, show_default=True, help="Vocabulary V (byte-level).")
@click.option("--batch", default=0, help="Global batch in sequences (default: one a rank).")
@click.option("--steps", default=3, show_default=True,
              help="Steps a trial trains (the first is not timed).")
@click.option("--rows", default=",".join(ROWS), show_default=True,
              help="Rows to search, by commas.")
@click.option("--max-layers", default=1024, show_default=True,
              help="The deepest model the search considers.")
@click.option("--overhead-mib", default=160, show_default=True,
              help="RSS above the traced peak assumed until a trial measures it (then "
                   "the most measured).")
@click.option("--trial-timeout", default=3600.0, show_default=True,
              help="Seconds before a trial's MPI job is killed (and counted a miss).")
@click.option("--out", default="runs/bench-largest", show_default=True,
              help="Where the trials' run directories and largest.json go.")
@click.pass_context
def main(ctx, budget_gib, ranks, d_model, n_head, seq_len, vocab, batch, steps, rows,
         max_layers, overhead_mib, trial_timeout, out):
    """The deepest GPT that trains within a memory budget, per ZeRO stage,
    recomputation and precision."""
    if ctx.invoked_subcommand is not None:
        return
    if steps < 2:
        raise click.BadParameter(f"steps ({steps}) must be at least 2: the first is not "
                                 "timed", param_hint="--steps")
    names = [n for n in rows.split(",") if n]
    for n in names:
        if n not in ROWS:
            raise click.BadParameter(f"row {n!r} is not one of {', '.join(ROWS)}",
                                     param_hint="--rows")
    shape = Shape(ranks, d_model, n_head, seq_len, vocab, batch or ranks, steps)
    budget = int(budget_gib * GiB)
    from hpctrain.plan.calibrate import meminfo_bytes

    free = meminfo_bytes("MemAvailable")
    if free is not None and budget > free:
        raise click.BadParameter(
            f"budget ({budget_gib:g} GiB) is more than this machine has available "
            f"({free / GiB:.1f} GiB, MemAvailable in /proc/meminfo): trials up to it "
            f"would take memory from every process here; give at most "
            f"{int(free / GiB)}", param_hint="--budget-gib")
    per_rank = budget // ranks
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    overhead = [overhead_mib * MiB]  # [bytes]: assumed; [bytes, True]: measured

    def say(text):
        print(text, flush=True)

    say(f"budget {budget_gib:g} GiB over {ranks} ranks: {per_rank / MiB:.0f} MiB a rank; "
        f"GPT C {d_model}, H {n_head}, T {seq_len}, V {vocab}, batch {shape.batch}, "
        f"{steps} steps a trial; load average {os.getloadavg()[0]:.2f}")
    results = []
    for name in names:
        layout, why = choose_layout(shape, name)
        if layout is None:
            say(f"  {name}: {why}")
            results.append({"row": name, "note": why})
            continue
        say(f"  {name}: {describe(layout)}")
        results.append(search(shape, name, layout, per_rank, overhead, max_layers, out_dir,
                              trial_timeout, say))
    say(f"load average {os.getloadavg()[0]:.2f} at the end")
    (out_dir / "largest.json").write_text(json.dumps(
        {"budget_gib": budget_gib, "shape": vars(shape), "rows": results}, indent=1))
    say(table(results))


@main.command("worker", hidden=True)
@click.argument("raw_json")
def worker_command(raw_json):
    """One rank of a trial (run by the search under mpiexec)."""
    worker(raw_json)


if __name__ == "__main__":
    sys.exit(main())
