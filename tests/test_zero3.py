"""ZeRO-3 without MPI: its rules in ``Config.validate``, a model without pipeline pieces
as one unit, the placeholders between uses, and the planner's memory terms."""

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.plan import cost
from hpctrain.plan import memory as mem
from hpctrain.testing import train_losses

sys.path.insert(0, str(Path(__file__).parent))
from test_plan_cost import cluster, make  # noqa: E402

GPT = ModelConfig(n_layer=2, d_model=16, n_head=4, seq_len=8, vocab_size=32, dtype="float64",
                  init_std=0.3)
TRAIN = TrainConfig(batch_size=8, lr=1e-2, warmup_steps=1, weight_decay=0.1, grad_clip=1.0,
                    steps=4)


@pytest.mark.parametrize("parallel, model, message", [
    (dict(zero=4), GPT, "zero (4) must be 0, 1, 2 or 3"),
    (dict(zero=3, sp=2), ModelConfig(kind="cnn", channels=(2, 3), input_dim=64),
     "sp (2) must be 1"),
    (dict(zero=3, pp=2, pipeline_training="local"), GPT,
     "zero 3 needs pipeline_training 'backprop'"),
    (dict(zero=3, averaging="periodic", average_every=2), GPT, "zero (3) must be 0"),
    (dict(zero=2, reshard_after_forward=False), GPT,
     "reshard_after_forward false keeps ZeRO-3's gathered parameters from the forward to "
     "the backward: it needs zero 3 (zero is 2)"),
])
def test_zero_3_where_it_cannot_run_is_refused_by_name(parallel, model, message):
    cfg = Config(model=model, parallel=ParallelConfig(**parallel), train=TRAIN)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cfg.validate(2)


def test_an_engine_that_cannot_use_zero_3_is_refused():
    from hpctrain.parallel.zero3 import engine_pieces

    class Other:
        params = named_params = []

    with pytest.raises(ValueError, match="Other cannot use it"):
        engine_pieces(Other())


def batches(cfg, n=4, seed=0):
    r = np.random.default_rng(seed)
    m = cfg.model
    if m.kind == "cnn":
        return [(r.random((TRAIN.batch_size, m.input_dim)),
                 r.integers(0, m.n_classes, TRAIN.batch_size)) for _ in range(n)]
    shape = (TRAIN.batch_size, m.seq_len)
    return [(r.integers(0, m.vocab_size, shape), r.integers(0, m.vocab_size, shape))
            for _ in range(n)]


@pytest.mark.parametrize("model", [GPT, replace(GPT, tie_embeddings=True),
                                   ModelConfig(kind="cnn", channels=(2, 3), input_dim=36,
                                               n_classes=4, dtype="float64")],
                         ids=["gpt", "gpt-tied", "cnn-whole-model"])
@pytest.mark.parametrize("reshard", [True, False])
def test_zero_3_on_one_rank_gives_the_zero_0_curve(model, reshard):
    """The CNN declares no pipeline pieces: it is one unit, gathered whole."""
    par = ParallelConfig(zero=3, microbatches=2, reshard_after_forward=reshard)
    cfg = Config(model=model, parallel=par, train=TRAIN).validate(1)
    data = batches(cfg)
    want = train_losses(replace(cfg, parallel=replace(cfg.parallel, zero=0)), MPI.COMM_SELF,
                        data)
    got = train_losses(cfg, MPI.COMM_SELF, data)
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_parameters_are_placeholders_between_uses_and_nan_if_read():
    from hpctrain.parallel.engine import build_engine
    from hpctrain.parallel.topology import Topology
    from hpctrain.train import make_data_parallel, train_step

    cfg = Config(model=GPT, parallel=ParallelConfig(zero=3), train=TRAIN).validate(1)
    topo = Topology.build(MPI.COMM_SELF, cfg.parallel)
    engine = build_engine(cfg, topo)
    dp = make_data_parallel(cfg, engine, topo)
    x, y = batches(cfg)[0]
    train_step(engine, dp, x, y, lr=1e-2, grad_clip=1.0)
    for p in engine.params:
        assert not any(p.data.strides) and np.isnan(p.data).all()
        assert p.grad.size == 0
    # a read that bypasses the pieces' gathers (the head's logits alone) shows as NaN
    assert np.isnan(engine.model.head.logits(np.zeros((1, 1, GPT.d_model)))).all()
    assert np.isfinite(engine.model.forward(x, y)[0])  # the pieces gather themselves
    assert np.isfinite(engine.loss(x, y))  # evaluation gathers every unit
    assert all(not any(p.data.strides) for p in engine.params)  # and frees them again
    assert dp.memory()["param_bytes"] == dp.padded_numel() * 8
    topo.free()


def test_planner_state_bytes_at_zero_3_are_one_dp_th():
    sizes = [100, 7, 33]
    assert mem.state_bytes(sizes, 4, 4, 3, 2, 4.0) == (35 * 4, 35 * 4, 2 * 35 * 4)
    assert mem.state_bytes(sizes, 4, 1, 3, 2, 4.0) == mem.state_bytes(sizes, 4, 1, 0, 2, 4.0)


def test_planner_estimate_at_zero_3_shards_parameters_and_adds_the_gathered_piece():
    zero0 = cost.estimate(make(world=2, dp=2, zero=0), cluster()).ranks[0].memory
    zero3 = cost.estimate(make(world=2, dp=2, zero=3), cluster()).ranks[0].memory
    assert zero3.params * 2 == pytest.approx(zero0.params, abs=8)
    assert zero3.optimizer * 2 == pytest.approx(zero0.optimizer, abs=16)
    assert zero3.buckets == mem.zero3_transient_bytes(make().model, 1, 4) > 0


def test_planner_zero3_transient_memory_by_hand():
    """What zero3.py holds during a step, per tp rank: with resharding two pieces
    gathered (the one in use, the next prefetched), without it every piece of the
    stage. Whole gradients: with one microbatch two pieces' (the one in backward, and
    the one before it, whose reduce-scatter is reaped when the next piece ends), one
    without resharding (the piece before has freed its gathered parameters) or at dp 1
    (nothing gathered, a gradient copied to its shard at once); every piece's with
    more microbatches (each lives from its first backward to the last microbatch's)
    or in a pipeline (a chunk's gradients are reported when its whole backward ends);
    a tied token table's through the whole backward. Measured at dp 2 on a 12-layer
    GPT (d_model 128) with --memory-report, the prediction of 4 microbatches went from
    -35% to -8% of the traced peak, without resharding from -23% to -3% (ZeRO-1 on the
    same model: -8%); the second gradient took the benchmark GPT at dp 4 from -7.8% to
    -4.3% (1 microbatch, 4 emulated nodes)."""
    m = make().model
    from hpctrain.models.registry import model_class

    costs = model_class("gpt").piece_costs(m)
    big = max([costs.first, *costs.middle, costs.last])
    stage = 10 * big

    def held(tp=1, mb=1, reshard=True, dp=2, pipelined=False, model=m):
        return mem.zero3_transient_bytes(model, tp, 4, stage / tp, mb, reshard, dp, pipelined)
    assert held() == 4 * 4 * big
    assert held(mb=4) == 4 * (2 * big + stage)
    assert held(pipelined=True) == held(mb=4) == held(mb=4, pipelined=True)
    assert held(reshard=False) == 4 * (stage + big)
    assert held(mb=4, reshard=False) == 4 * 2 * stage
    assert held(dp=1) == held(dp=1, reshard=False) == 4 * big
    assert held(tp=2, mb=4) == 4 * (2 * big + stage) / 2
    tied = replace(m, tie_embeddings=True)
    assert held(model=tied) == held() + 4 * costs.first
    assert held(model=tied, mb=4) == held(mb=4)  # every piece's already


class Group:
    """A data group of ``size`` ranks seen from ``rank``, without MPI."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank

    def Get_size(self) -> int:
        return self.size

    def Get_rank(self) -> int:
        return self.rank


@pytest.mark.parametrize("pp, pp_rank, schedule, v", [
    (1, 0, "1f1b", 1), (2, 0, "1f1b", 1), (2, 1, "1f1b", 1), (2, 1, "interleaved", 2)])
def test_the_build_shards_each_piece_this_rank_runs_and_drops_the_others(pp, pp_rank,
                                                                         schedule, v):
    """``zero3_build`` at dp = 2 without MPI: the units are the engine's (parameters
    first met in this pipeline rank's pieces, in order), the two dp ranks' shards
    make the serial weights bitwise, every other parameter is a placeholder; the tied
    token table is the head's on the last stage."""
    from hpctrain.models.build import build_model
    from hpctrain.models.registry import model_class
    from hpctrain.parallel.zero3_build import PieceSharder, held_pieces

    m = replace(GPT, n_layer=4, tie_embeddings=True, dtype="float32")
    par = ParallelConfig(dp=2, pp=pp, schedule=schedule, virtual_stages=v, microbatches=pp,
                         zero=3)
    cfg = Config(model=m, parallel=par, train=TRAIN).validate(2 * pp)
    serial = dict(build_model(m, 0).named_parameters())
    held = held_pieces(model_class("gpt"), cfg, pp_rank, pp)
    shards = []
    for dp_rank in (0, 1):
        sharder = PieceSharder(held, Group(2, dp_rank))
        model = build_model(m, 0, on_piece=sharder)
        shards.append([u.shard for u in sharder.finish()])
    pieces = [model.embed, *model.blocks, model.head]
    mine = [pieces[k] for k in held]
    seen, want = set(), []
    for piece in mine:  # the units the engine's pieces make (zero3._make_units)
        own = [p for p in piece.parameters() if id(p) not in seen]
        seen.update(map(id, own))
        if own:
            want.append(own)
    assert [[id(p) for p in u.params] for u in sharder.units] == [[id(p) for p in w]
                                                                   for w in want]
    name_of = {id(p): name for name, p in model.named_parameters()}
    for u, (a, b) in zip(sharder.units, zip(*shards, strict=True), strict=True):
        flat = np.concatenate([a, b])
        for p, off in zip(u.params, u.offsets, strict=True):
            assert flat[off:off + p.size].tobytes() == serial[name_of[id(p)]].data.tobytes()
    for p in model.parameters():  # held or not, no parameter keeps an array of its own
        assert not any(p.data.strides)
    if pp > 1 and pp_rank == pp - 1:
        assert model.embed.wte.weight in sharder.units[-1].params  # the head's copy
