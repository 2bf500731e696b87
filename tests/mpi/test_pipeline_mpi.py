"""Pipeline parallelism under MPI against the serial computation, at any world size.

For every pipeline size pp in {2, 4} dividing the world size (the other factor is
data parallelism), every schedule and microbatch count: ten training steps give the
serial loss curve, which every rank computes for itself on ``COMM_SELF`` with gradient
accumulation over the same microbatches (``dp * m`` of them per global batch).
"""

from dataclasses import replace

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.models.gpt import GPT
from hpctrain.parallel import pipeline, timeline
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.topology import Topology
from hpctrain.testing import assert_all, assert_close_all, train_losses

STEPS, ROWS, V, T = 10, 8, 32, 8  # ROWS: sequences per data-parallel rank and step
MODEL = ModelConfig(dtype="float64", vocab_size=V, seq_len=T, n_layer=8, n_head=2,
                    d_model=16)


def pipeline_sizes(n):
    return [pp for pp in (2, 4) if n % pp == 0]


def cases(pp):
    """(schedule, m, v, tie_embeddings, balance): every schedule, m in {1, 2, 4, 8}."""
    out = []
    for n, (schedule, m) in enumerate([(s, m) for s in ("gpipe", "1f1b") for m in (1, 2, 4, 8)]):
        out.append((schedule, m, 1, n % 2 == 1, "layers" if n % 3 else "params"))
    out += [("interleaved", m, 2, m == pp, "layers") for m in (2, 4, 8) if m % pp == 0]
    return out


def config(dp, pp, m, schedule="1f1b", v=1, tie=False, balance="layers", tp=1, sp=False):
    par = ParallelConfig(dp=dp, tp=tp, pp=pp, microbatches=m, schedule=schedule,
                         virtual_stages=v, balance=balance, sequence_parallel=sp)
    return Config(model=replace(MODEL, tie_embeddings=tie), parallel=par,
                  train=TrainConfig(steps=STEPS, batch_size=dp * ROWS, lr=1e-2,
                                    warmup_steps=2, grad_clip=0.5))


def global_batches(dp, steps=STEPS, seed=0):
    """The same batches on every rank: a learnable map, so the loss curve moves."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        x = rng.integers(0, V, (dp * ROWS, T))
        out.append((x, (3 * x + 1) % V))
    return out


def serial_key(cfg):
    par = cfg.parallel
    return (par.dp, par.dp * par.microbatches, cfg.model.tie_embeddings)


def serial_curves(comm, cfgs):
    """The serial curve of each config: one rank, all dp * m microbatches accumulated.

    Every distinct curve is computed by one rank (round-robin) and shared with an
    allgather, rather than by every rank: the ranks share few cores.
    """
    keys = sorted({serial_key(cfg) for cfg in cfgs})
    mine = {}
    for j, (dp, total, tie) in enumerate(keys):
        if j % comm.Get_size() == comm.Get_rank():
            cfg = config(dp, 1, total, tie=tie)
            serial = replace(cfg, parallel=ParallelConfig(microbatches=total)).validate(1)
            mine[(dp, total, tie)] = train_losses(serial, MPI.COMM_SELF, global_batches(dp))
    curves = {k: v for part in comm.allgather(mine) for k, v in part.items()}
    return [curves[serial_key(cfg)] for cfg in cfgs]


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_every_schedule_trains_like_serial(comm):
    n = comm.Get_size()
    cfgs = [config(n // pp, pp, m, schedule, v, tie, balance).validate(n)
            for pp in pipeline_sizes(n) for schedule, m, v, tie, balance in cases(pp)]
    worst = 0.0
    for cfg, ref in zip(cfgs, serial_curves(comm, cfgs), strict=True):
        par = cfg.parallel
        got = train_losses(cfg, comm, global_batches(par.dp))
        assert_close_all(comm, got, ref, rtol=1e-8,
                         what=f"losses at pp={par.pp} dp={par.dp} {par.schedule} "
                              f"m={par.microbatches} v={par.virtual_stages} "
                              f"tie={cfg.model.tie_embeddings} balance={par.balance}")
        worst = max(worst, float(np.max(np.abs(np.subtract(got, ref)) / np.abs(ref))))
    if comm.Get_rank() == 0:
        print(f"\nworst relative loss difference from serial: {worst:.2e}")


def one_step(comm, cfg):
    topo = Topology.build(comm, cfg.parallel)
    engine = build_engine(cfg, topo)
    (x, y), = global_batches(cfg.parallel.dp, steps=1)
    rows = slice(topo.dp_rank * ROWS, (topo.dp_rank + 1) * ROWS)
    engine.zero_grad()
    engine.forward_backward(x[rows], y[rows])
    return topo, engine


@pytest.mark.mpi
def test_live_caches_peak_at_pp_for_1f1b_and_m_for_gpipe(comm):
    n, m = comm.Get_size(), 8
    for pp in pipeline_sizes(n):
        for schedule, v in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2)):
            cfg = config(n // pp, pp, m, schedule, v).validate(n)
            topo, engine = one_step(comm, cfg)
            r = topo.pp_rank
            expected = {"1f1b": min(pp - r, m), "gpipe": m,
                        "interleaved": 2 * (pp - r - 1) + (v - 1) * pp + 1}[schedule]
            metrics = engine.metrics()
            ok = engine.peak_live_caches == expected and engine.stage.live == 0
            ok &= metrics["peak_live_caches"] == {"1f1b": pp, "gpipe": m}.get(
                schedule, metrics["peak_live_caches"])
            ok &= metrics["bubble_theory"] == timeline.bubble_theory(pp, m, v)
            ok &= 0.0 <= metrics["bubble_fraction"] < 1.0
            assert_all(comm, ok, f"peak live caches at pp={pp} {schedule} (rank {r} "
                                 f"held {engine.peak_live_caches}, expected {expected})")
            topo.free()


@pytest.mark.mpi
def test_forward_only_loss_equals_serial_on_every_stage(comm):
    n = comm.Get_size()
    for pp in pipeline_sizes(n):
        cfg = config(n // pp, pp, 4, "interleaved" if pp == 2 else "1f1b",
                     2 if pp == 2 else 1, tie=True).validate(n)
        topo = Topology.build(comm, cfg.parallel)
        engine = build_engine(cfg, topo)
        self_topo = Topology.build(MPI.COMM_SELF, ParallelConfig(dp=1))
        serial = build_engine(replace(cfg, parallel=ParallelConfig()).validate(1), self_topo)
        (x, y), = global_batches(1, steps=1, seed=5)
        assert_close_all(comm, engine.loss(x, y), serial.loss(x, y), rtol=1e-12,
                         what=f"forward-only loss at pp={pp}")
        topo.free()
        self_topo.free()


@pytest.mark.mpi
def test_pipeline_composes_with_tensor_parallelism(comm):
    n = comm.Get_size()
    if n % 4:
        pytest.skip("pp = 2 x tp = 2 needs a multiple of 4 ranks")
    pytest.importorskip("hpctrain.parallel.tensor")
    dp = n // 4
    cfgs = [config(dp, 2, m, schedule, v, tie, tp=2, sp=sp).validate(n)
            for schedule, m, v, tie, sp in (("1f1b", 4, 1, True, False),
                                            ("interleaved", 2, 2, False, False),
                                            ("gpipe", 2, 1, False, False),
                                            ("1f1b", 2, 1, True, True))]
    for cfg, ref in zip(cfgs, serial_curves(comm, cfgs), strict=True):
        par = cfg.parallel
        assert_close_all(comm, train_losses(cfg, comm, global_batches(dp)), ref, rtol=1e-8,
                         what=f"losses at pp=2 tp=2 dp={dp} {par.schedule} "
                              f"m={par.microbatches} sequence_parallel={par.sequence_parallel}")


@pytest.mark.mpi
def test_interleaved_needs_microbatches_divisible_by_pp_on_every_rank(comm):
    n = comm.Get_size()
    pp = pipeline_sizes(n)[0]
    good = config(n // pp, pp, pp, "interleaved", 2).validate(n)
    bad = replace(good, parallel=replace(good.parallel, microbatches=pp + 1,
                                         dp=n // pp))
    topo = Topology.build(comm, good.parallel)
    with pytest.raises(ConfigError, match=r"microbatches \(\d+\) divisible by pp"):
        pipeline.PipelineEngine(GPT(bad.model, seed=0), bad, topo)
    topo.free()
