"""``hpctrain plan``: every layout ``train`` would accept, costed, pruned by memory, ranked.

``enumerate_layouts(cfg, cluster, world)`` walks dp, tp, pp (divisors of the world),
microbatches (divisors of the batch per data-parallel rank), the schedules (gpipe,
1f1b, interleaved with each virtual_stages that fits, 1 included), zero 0/1/2, sequence
parallelism, and, where a rank has several cores and runs the whole model, its batch
split over them (``batch_threads``); each candidate goes through
``Config.validate(world)``, so a plan never proposes a layout ``train`` refuses. Left
out as the same as another: gpipe without a pipeline (1f1b), ZeRO without data
parallelism (zero 0), sequence parallelism without tp. Two passes: every valid layout
is costed with the pipeline's closed-form bubble (``cost.estimate(replay=False)``), then
the best ``refine`` that fit in memory are costed again with the schedule replayed, and
re-ranked. A layout fits when every rank's memory is at most its node's memory
divided by the ranks per node. The cost model prices the GPT only (``cost.check_model``).

A rank has the cores of the smallest node over the ranks a node (``rank_cores``): the
search splits a batch over that many threads or none, ``--explain`` refuses a layout
that splits over more (``check_threads``), and ``--emit``'s job asks for that many
CPUs a task.

Layout names: ``dp2-tp2-pp2-mb4-1f1b-z1`` (``-sp``: sequence parallelism; ``-v2``:
interleaved with 2 virtual stages; ``-bt2``: the batch split over 2 threads a rank).
"""

from __future__ import annotations

import math
import re
import shlex
import time
from dataclasses import dataclass, replace
from pathlib import Path

import click

from hpctrain import config as config_mod
from hpctrain.config import Config, ConfigError, toml_string
from hpctrain.data.format import atomic_output
from hpctrain.plan import cost
from hpctrain.plan.cluster import Cluster, load_cluster

GiB = 2**30


def layout_name(par) -> str:
    name = f"dp{par.dp}-tp{par.tp}-pp{par.pp}-mb{par.microbatches}-{par.schedule}-z{par.zero}"
    if par.virtual_stages > 1:
        name += f"-v{par.virtual_stages}"
    name += "-sp" if par.sequence_parallel else ""
    return name + (f"-bt{par.batch_threads}" if par.batch_threads != 1 else "")


LAYOUT = re.compile(r"dp(\d+)-tp(\d+)-pp(\d+)-mb(\d+)-(gpipe|1f1b|interleaved)-z(\d)"
                    r"(?:-v(\d+))?(-sp)?(?:-bt(\d+))?$")


def parse_layout(text: str) -> dict:
    """``dp2-tp2-pp2-mb4-1f1b-z1[-v2][-sp][-bt2]`` -> [parallel] overrides."""
    got = LAYOUT.match(text)
    if not got:
        raise click.BadParameter(f"layout {text!r} must look like dp2-tp2-pp2-mb4-1f1b-z1 "
                                 f"(optionally -v2 for virtual stages, -sp, -bt2 for the "
                                 f"batch split over 2 threads)")
    dp, tp, pp, mb, schedule, zero, v, sp, bt = got.groups()
    return {"dp": int(dp), "tp": int(tp), "pp": int(pp), "microbatches": int(mb),
            "schedule": schedule, "zero": int(zero), "virtual_stages": int(v or 1),
            "sequence_parallel": bool(sp), "batch_threads": int(bt or 1)}


def size(nbytes: float) -> str:
    """Bytes in the largest binary unit that leaves at least 1, to 3 significant
    digits: ``1.50 GiB``, ``213 MiB``, ``12.0 KiB``, ``512 B``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            v = nbytes / scale
            return f"{v:.{max(0, 2 - int(math.log10(abs(v))))}f} {unit}"
    return f"{nbytes:.0f} B"


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending: trial division up to sqrt(n), each small
    divisor d giving its partner n // d."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


# the search records the pipeline schedule of every microbatch count dividing a data
# rank's batch, so its time grows with the batch (a 48-layer GPT on 64 ranks: 44 s at
# a batch of 1,024, 125 s at 4,096); 2**16 sequences is many times the batch of
# published GPT runs (GPT-3: 1,536 sequences of 2,048 tokens)
MAX_BATCH = 2**16


def check_batch(cfg: Config) -> None:
    """Raise a ConfigError when the global batch is past what the plan can search."""
    if cfg.train.batch_size > MAX_BATCH:
        raise ConfigError(
            f"the global batch ({cfg.train.batch_size}) must be at most {MAX_BATCH} for "
            f"hpctrain plan: its search records the pipeline schedule of every "
            f"microbatch count, and its time grows with the batch (--batch, or [train] "
            f"batch_size)")


def fits(e: cost.Estimate) -> bool:
    return all(r.memory.total <= r.memory_limit for r in e.ranks)


def miss(e: cost.Estimate) -> int:
    """Bytes by which the fullest rank (relative to its limit) exceeds its limit."""
    return max(r.memory.total - r.memory_limit for r in e.ranks)


def rank_splits(cfg: Config, world: int):
    """Every (tp, pp, dp) split of ``world`` ranks, with why the search skips it (None:
    it does not): more tensor ranks than heads, more stages than layers, or a data
    group that does not divide the global batch."""
    m, batch = cfg.model, cfg.train.batch_size
    for tp in divisors(world):
        for pp in divisors(world // tp):
            dp = world // (tp * pp)
            why = None
            if tp > m.n_head:
                why = f"tp {tp} exceeds the {m.n_head} heads"
            elif pp > m.n_layer:
                why = f"pp {pp} exceeds the {m.n_layer} layers"
            elif batch % dp:
                why = f"dp {dp} (tp {tp}, pp {pp}) does not divide the batch of {batch}"
            yield tp, pp, dp, why


def candidates(cfg: Config, world: int, threads: int = 1):
    """Every [parallel] combination to try (not yet validated); ``threads``: the cores a
    rank has, over which a rank running the whole model may split its batch."""
    par, n_layer = cfg.parallel, cfg.model.n_layer
    batch = cfg.train.batch_size
    for tp, pp, dp, why in rank_splits(cfg, world):
        if why is not None:
            continue
        for mb in divisors(batch // dp):
            if pp == 1:
                schedules = [("1f1b", 1)]
            else:
                schedules = [("gpipe", 1), ("1f1b", 1)] + [
                    ("interleaved", v) for v in range(1, n_layer // pp + 1)
                    if mb % pp == 0]
            rows = batch // (dp * mb)
            splits = (1, threads) if tp == pp == 1 and min(threads, rows) > 1 else (1,)
            for schedule, v in schedules:
                for zero in ((0, 1, 2, 3) if dp > 1 and par.averaging == "sync" else (0,)):
                    # the config's resharding is ZeRO-3's; the other stages take the default
                    reshard = par.reshard_after_forward if zero == 3 else True
                    for seq in ((False, True) if tp > 1 else (False,)):
                        for split in splits:
                            yield replace(par, dp=dp, tp=tp, pp=pp, microbatches=mb,
                                          schedule=schedule, virtual_stages=v,
                                          zero=zero, sequence_parallel=seq, sp=1,
                                          batch_threads=split, reshard_after_forward=reshard)


def node_cores(cluster: Cluster) -> int:
    """The cores of the cluster's smallest node: what a block placement can use."""
    return min(cluster.kinds[name].cores for name, _ in cluster.nodes)


def rank_cores(cluster: Cluster, rpn: int) -> int:
    """A rank's cores with ``rpn`` ranks on each node: the smallest node's share."""
    return max(1, node_cores(cluster) // rpn)


def check_ranks(cluster: Cluster, world: int) -> None:
    """Raise a ConfigError when ``world`` ranks put more ranks on a node than its
    cores (block placement over every node): the cost model prices a rank's products
    at a core's rates at least, so such a layout would be predicted as if the cores
    were there (the search without --ranks never reaches it)."""
    rpn = cost.ranks_per_node(cluster, world)
    if rpn > node_cores(cluster):
        raise ConfigError(
            f"{world} ranks on the {cluster.num_nodes} node(s) of {cluster.name} put {rpn} "
            f"on a node, whose smallest has {node_cores(cluster)} cores: the plan prices "
            f"at most one rank a core; give at most "
            f"{cluster.num_nodes * node_cores(cluster)} ranks (--ranks, or a layout whose "
            f"dp * tp * pp is no more)")


def check_threads(par, cluster: Cluster, rpn: int) -> None:
    """Raise a ConfigError when ``par`` splits a rank's batch over more threads than
    the rank has cores with ``rpn`` ranks a node (the search never proposes it: each
    thread would share a core, and the cost model would price cores that are not
    there)."""
    cores = rank_cores(cluster, rpn)
    if par.batch_threads > cores:
        raise ConfigError(
            f"batch_threads (bt {par.batch_threads}) must be at most the cores a rank "
            f"has ({cores}: {node_cores(cluster)} cores on the smallest node over "
            f"{rpn} rank{'s' if rpn > 1 else ''} a node)")


@dataclass
class Search:
    ranked: list[cost.Estimate]  # layouts that fit, fastest first
    tried: int  # combinations generated
    valid: int  # of them, accepted by Config.validate
    closest_miss: cost.Estimate | None  # the layout needing the least memory, if none fit
    seconds: float


def enumerate_layouts(cfg: Config, cluster: Cluster, world: int, *,
                      refine: int = 20, practice: cost.Practice = cost.HPCTRAIN) -> Search:
    """Every valid layout of ``cfg`` on ``world`` ranks of ``cluster``, ranked (module
    docstring), each priced as ``practice`` runs it. Raises ConfigError if no layout is
    valid for the global batch."""
    t0 = time.perf_counter()
    cost.check_model(cfg)
    check_batch(cfg)
    if world < 1:
        raise ConfigError(f"the number of ranks ({world}) must be positive")
    rpn = cost.ranks_per_node(cluster, world)  # the placement's rule, by name
    threads = rank_cores(cluster, rpn)
    memo: dict = {}
    tried, valid, estimates = 0, [], []
    first_error = None
    for par in candidates(cfg, world, threads):
        tried += 1
        try:
            checked = replace(cfg, parallel=par).validate(world)
        except ConfigError as err:
            first_error = first_error or str(err)
            continue
        valid.append(checked)
        estimates.append(cost.estimate(checked, cluster, replay=False, memo=memo,
                                       practice=practice))
    if not valid:
        raise ConfigError(f"no layout of {world} ranks can run a global batch of "
                          f"{cfg.train.batch_size} (the batch must be a multiple of dp * "
                          f"microbatches, and the model must accept tp and pp); "
                          + (f"e.g. {first_error}" if first_error else "; ".join(
                              dict.fromkeys(why for *_, why in rank_splits(cfg, world)
                                            if why is not None))))
    ok = sorted((e for e in estimates if fits(e)), key=lambda e: e.step_s)
    closest = None if ok else min(estimates, key=miss)
    top = [cost.estimate(e.cfg, cluster, replay=True, memo=memo, practice=practice)
           for e in ok[:refine]]
    ranked = sorted(top, key=lambda e: e.step_s) + ok[refine:]
    return Search(ranked, tried, len(valid), closest, time.perf_counter() - t0)


def per_node_counts(cluster: Cluster) -> list[int]:
    """The ranks-per-node counts a plan searches when not given the ranks: one rank
    per core of the smallest node, and every smaller count dividing its cores at
    which each kind's GEMM rates were measured (a calibrated CPU node: fewer ranks,
    each with more BLAS threads or its batch split over them). Devices described by
    their published peak run one rank each."""
    kinds = [cluster.kinds[name] for name, _ in cluster.nodes]
    cores = node_cores(cluster)
    counts = {cores}
    if not any(k.peak_flops for k in kinds):
        measured = set.intersection(*(set(k.gemm) for k in kinds))
        counts |= {r for r in measured if r < cores and cores % r == 0}
    return sorted(counts)


def enumerate_over(cfg: Config, cluster: Cluster, worlds: list[int], *, refine: int = 20,
                   practice: cost.Practice = cost.HPCTRAIN) -> Search:
    """``enumerate_layouts`` at each rank count of ``worlds``, merged into one ranking:
    the layouts costed with the schedule replayed first, fastest first, then the rest.
    Raises the last count's ConfigError only if no count has a valid layout."""
    searches, error = [], None
    for world in worlds:
        try:
            searches.append(enumerate_layouts(cfg, cluster, world, refine=refine,
                                              practice=practice))
        except ConfigError as err:
            error = err
    if not searches:
        raise error
    if len(searches) == 1:
        return searches[0]
    replayed = sorted((e for s in searches for e in s.ranked[:refine]), key=lambda e: e.step_s)
    rest = sorted((e for s in searches for e in s.ranked[refine:]), key=lambda e: e.step_s)
    misses = [s.closest_miss for s in searches if s.closest_miss is not None]
    return Search(replayed + rest, sum(s.tried for s in searches),
                  sum(s.valid for s in searches),
                  None if replayed or not misses else min(misses, key=miss),
                  sum(s.seconds for s in searches))


# ---------------------------------------------------------------------------------
# printing


def table(estimates: list[cost.Estimate]) -> str:
    head = (f"{'layout':<32} {'ms/step':>8} {'tok/s':>9} {'MFU':>6} {'GiB/rank':>8} | "
            f"{'compute':>7} {'tp':>6} {'bubble':>6} {'p2p':>6} {'dp':>6} {'optim':>6}")
    lines = [head, "-" * len(head)]
    for e in estimates:
        sh = e.shares
        lines.append(f"{layout_name(e.cfg.parallel):<32} {1e3 * e.step_s:>8.1f} "
                     f"{e.tokens_per_s:>9.0f} {100 * e.mfu:>5.1f}% "
                     f"{e.max_memory / GiB:>8.3f} | {100 * sh['compute']:>6.1f}% "
                     f"{100 * sh['tp']:>5.1f}% {100 * sh['pp_bubble']:>5.1f}% "
                     f"{100 * sh['p2p']:>5.1f}% {100 * sh['dp']:>5.1f}% "
                     f"{100 * sh['optimizer']:>5.1f}%")
    return "\n".join(lines)


def explain(e: cost.Estimate) -> str:
    """Every rank's terms, in ms and MiB."""
    lines = [f"{layout_name(e.cfg.parallel)}: {1e3 * e.step_s:.1f} ms/step, "
             f"{e.tokens_per_s:.0f} tokens/s, MFU {100 * e.mfu:.1f}%, "
             f"{e.ranks_per_node} ranks per node", e.bottleneck()]
    for r in e.ranks:
        times = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in r.time.items())
        mems = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in r.memory.terms().items())
        lines += [f"  {r.describe()}", f"    time ms: {times} (total {1e3 * r.step_s:.1f})",
                  f"    memory MiB: {mems} (total {r.memory.total / 2**20:.1f} of "
                  f"{r.memory_limit / 2**20:.0f})"]
    return "\n".join(lines + [f"  note: {n}" for n in e.notes])


def config_toml(cfg: Config) -> str:
    """``cfg`` as a config TOML (every field, so the file stands alone)."""
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return toml_string(v)
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return repr(v)

    out = []
    for section, values in cfg.to_dict().items():
        out.append(f"[{section}]")
        out += [f"{k} = {value(v)}" for k, v in values.items()]
        out.append("")
    return "\n".join(out)


@click.command("plan")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="The run's config TOML (its [parallel] is what the plan replaces).")
@click.option("--cluster", "cluster_path", required=True, type=click.Path(dir_okay=False),
              help="The cluster description (hpctrain calibrate writes one).")
@click.option("--ranks", type=click.IntRange(min=1),
              help="Ranks in all (default: one per core of every node, and every smaller "
                   "count a node the description measured at, e.g. one rank of 2 threads "
                   "against two of 1; with --explain, the layout's dp * tp * pp).")
@click.option("--nodes", type=click.IntRange(min=1),
              help="Use the first N nodes of the cluster (their ranks as without --ranks).")
@click.option("--batch", type=click.IntRange(min=1),
              help="Global batch size (default: the config's).")
@click.option("--top", type=click.IntRange(min=1), default=5, show_default=True,
              help="Layouts to print.")
@click.option("--explain", "explain_layout", metavar="LAYOUT",
              help="Print every rank's terms for one layout, e.g. dp2-tp2-pp2-mb4-1f1b-z1.")
@click.option("--emit", type=click.Path(dir_okay=False),
              help="Write the best layout (or --explain's) as a config TOML here, and "
                   "print the `hpctrain slurm render` command that makes its job script "
                   "(its folder is made; never the --config or --cluster file).")
@click.option("--force", is_flag=True, help="Let --emit replace an existing file.")
@click.option("--kernels", type=click.Choice(["numpy", "numba"]),
              help="The element-wise kernels the cluster's hpctrain runs (default: the "
                   "ones this one runs: numba's when numba is installed and "
                   "HPCTRAIN_FUSED is not 0).")
def plan(config_path, cluster_path, ranks, nodes, batch, top, explain_layout, emit, force,
         kernels):
    """Rank the layouts of a config on a cluster by predicted step time."""
    practice = replace(cost.HPCTRAIN, kernels=kernels)
    try:
        cfg = config_mod.load(config_path)
        cost.check_model(cfg)
        if batch is not None:
            cfg = replace(cfg, train=replace(cfg.train, batch_size=batch))
        check_batch(cfg)  # --explain's microbatches too: at most the batch
        cluster = load_cluster(cluster_path)
        cluster, worlds = _scope(cluster, ranks, nodes)
        if emit:
            check_emit(Path(emit), force, config_path, cluster_path)
        if explain_layout:
            par = replace(cfg.parallel, **parse_layout(explain_layout))
            if par.zero != 3:  # the config's resharding is ZeRO-3's (as the search's)
                par = replace(par, reshard_after_forward=True)
            # the layout's ranks, unless --ranks names others (validate says why not)
            world = ranks if ranks is not None else par.dp * par.tp * par.pp
            check_ranks(cluster, world)
            checked = replace(cfg, parallel=par).validate(world)
            check_threads(par, cluster, cost.ranks_per_node(cluster, world))
            chosen = cost.estimate(checked, cluster, practice=practice)
            click.echo(explain(chosen))
            if not fits(chosen):
                worst = max(chosen.ranks, key=lambda r: r.memory.total - r.memory_limit)
                over = (f"{explain_layout} does not fit in memory: pp rank {worst.pp_rank} "
                        f"needs {size(worst.memory.total)}, {size(miss(chosen))} over its "
                        f"limit of {size(worst.memory_limit)}")
                if emit:  # a config train would run out of memory with
                    raise click.ClickException(f"{over}; --emit writes no config of it")
                click.echo(over)
        else:
            for world in worlds:
                check_ranks(cluster, world)
            found = enumerate_over(cfg, cluster, worlds, practice=practice)
            priced = kernels or cost.running_kernels(cfg.model)
            on = " or ".join(str(w) for w in worlds)
            click.echo(f"{found.valid} valid layouts of {found.tried} tried on {on} ranks "
                       f"({cluster.name}), {len(found.ranked)} fit in memory; "
                       f"{found.seconds:.2f} s; {priced} element-wise kernels")
            if not found.ranked:
                e = found.closest_miss
                worst = max(e.ranks, key=lambda r: r.memory.total - r.memory_limit)
                raise click.ClickException(
                    f"the model fits in no layout: the closest, "
                    f"{layout_name(e.cfg.parallel)}, needs {size(worst.memory.total)} on "
                    f"its fullest rank, {size(miss(e))} over the limit of "
                    f"{size(worst.memory_limit)} a rank (a node's memory over its ranks)")
            click.echo(table(found.ranked[:top]))
            chosen = found.ranked[0]
            click.echo(chosen.bottleneck())
            for note in dict.fromkeys(n for e in found.ranked[:top] for n in e.notes):
                click.echo(f"note: {note}")  # each once, for every layout printed
    except ConfigError as err:
        raise click.ClickException(str(err)) from None
    if emit:
        # whole or not at all: a file --force replaces is never left half written
        # (check_emit refused an existing file without --force before the search)
        try:
            with atomic_output(emit, force=True) as tmp:
                tmp.write_text(config_toml(chosen.cfg))
        except OSError as err:
            raise click.ClickException(f"{emit}: cannot be written ({err.strerror or err})"
                                       ) from None
        click.echo(f"wrote {emit} ({layout_name(chosen.cfg.parallel)})")
        click.echo(slurm_line(chosen, cluster, emit))


def check_emit(out: Path, force: bool, config_path: str, cluster_path: str) -> None:
    """Before the search: --emit's file is neither input (``check_new_output``)."""
    from hpctrain.plan.calibrate import check_new_output

    check_new_output(out, "--emit", force, {"--config": config_path,
                                            "--cluster": cluster_path})


def slurm_line(chosen: cost.Estimate, cluster: Cluster, config_path: str) -> str:
    """The ``hpctrain slurm render`` command of ``chosen`` written to ``config_path``
    (its nodes, ranks per node, a rank's cores and layout), checked by render's own
    rules; or why render would refuse it (a tensor group across nodes)."""
    from hpctrain.slurm.render import JobRequest, check_fit

    par = chosen.cfg.parallel
    rpn = chosen.ranks_per_node
    req = JobRequest(chosen.world // rpn, rpn, rank_cores(cluster, rpn), dp=par.dp,
                     tp=par.tp, pp=par.pp, config=config_path)
    try:
        check_fit(req)
    except ConfigError as err:
        return f"as a SLURM job: not with `hpctrain slurm render` ({err})"
    return "as a SLURM job: " + shlex.join([
        "hpctrain", "slurm", "render", "--nodes", str(req.nodes), "--ranks-per-node",
        str(rpn), "--cpus-per-task", str(req.cpus_per_task), "--dp", str(par.dp), "--tp",
        str(par.tp), "--pp", str(par.pp), "--config", config_path, "-o", "job.sbatch"])


def _scope(cluster: Cluster, ranks: int | None, nodes: int | None
           ) -> tuple[Cluster, list[int]]:
    """The cluster cut to ``nodes`` nodes, and the rank counts to search (``ranks``, or
    the nodes times each of ``per_node_counts``)."""
    if ranks is not None and nodes is not None:
        raise click.BadParameter("give --ranks or --nodes, not both")
    if nodes is not None:
        if not 1 <= nodes <= cluster.num_nodes:
            raise click.BadParameter(f"--nodes ({nodes}) must be between 1 and the "
                                     f"cluster's {cluster.num_nodes}")
        kept, left = [], nodes
        for kind, count in cluster.nodes:
            if left:
                kept.append((kind, min(count, left)))
                left -= kept[-1][1]
        cluster = replace(cluster, nodes=tuple(kept))
    if ranks is not None:
        return cluster, [ranks]
    return cluster, [cluster.num_nodes * r for r in per_node_counts(cluster)]
