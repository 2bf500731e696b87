"""Data parallelism and ZeRO without MPI: bucket assignment and padding, launch order,
the gradient views, the engine's piecewise backward against the model's, ZeRO's
shards and memory formula at dp = 1, and the counted-once rule of the norm."""

from types import SimpleNamespace

import numpy as np
import pytest

from hpctrain.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.models.gpt import GPT
from hpctrain.nn import Parameter
from hpctrain.parallel.data import GradBuckets, MiB, plan_buckets
from hpctrain.parallel.engine import LocalEngine
from hpctrain.parallel.zero import counted_once, expected_memory

TINY = dict(n_layer=2, d_model=16, n_head=2, seq_len=8, vocab_size=32, dtype="float64",
            init_std=0.3)


def batch(cfg, B=4, seed=1):
    r = np.random.default_rng(seed)
    return (r.integers(0, cfg.vocab_size, (B, cfg.seq_len)),
            r.integers(0, cfg.vocab_size, (B, cfg.seq_len)))


# ---- bucket assignment -------------------------------------------------------------


def test_buckets_close_at_the_size_never_split_a_parameter_and_cover_everything():
    sizes = [3, 5, 2, 10, 1, 1, 4]
    plan = plan_buckets(sizes, itemsize=8, bucket_mb=6 * 8 / MiB)  # 6 elements
    assert [(first, stop) for first, stop, _, _ in plan] == [(0, 2), (2, 4), (4, 7)]
    assert [size for *_, size in plan] == [8, 12, 6]  # only the last is below 6
    starts = [start for _, _, start, _ in plan]
    assert starts == [0, 8, 20]


def test_a_parameter_larger_than_a_bucket_is_a_bucket_of_its_own():
    plan = plan_buckets([2, 100, 2], itemsize=4, bucket_mb=10 * 4 / MiB)
    assert [(f, s) for f, s, _, _ in plan] == [(0, 2), (2, 3)]
    plan = plan_buckets([100, 2], itemsize=4, bucket_mb=10 * 4 / MiB)
    assert [(f, s, size) for f, s, _, size in plan] == [(0, 1, 100), (1, 2, 2)]


@pytest.mark.parametrize("align", [1, 2, 3, 8])
def test_padding_rounds_every_bucket_up_to_a_multiple_of_align(align):
    sizes = [7, 1, 9, 3, 5]
    plan = plan_buckets(sizes, itemsize=8, bucket_mb=8 * 8 / MiB, align=align)
    for first, stop, _, size in plan:
        real = sum(sizes[first:stop])
        assert size % align == 0 and real <= size < real + align
    assert all(b[2] == a[2] + a[3] for a, b in zip(plan, plan[1:], strict=False))


def test_bad_bucket_sizes_are_refused():
    with pytest.raises(ValueError, match="bucket_mb"):
        plan_buckets([1], 8, 0.0)


# ---- the flat buffer and the launch order ----------------------------------------------


def toy_params():
    return [Parameter(np.full(n, float(i + 1))) for i, n in enumerate([4, 3, 5, 2])]


def recording():
    launched = []
    return launched, lambda bucket, view: launched.append((bucket.index, view.copy()))


def test_grads_become_views_of_one_buffer_in_backward_order_keeping_their_values():
    params = toy_params()
    for p in params:
        p.grad[...] = p.data
    launched, launch = recording()
    grads = GradBuckets(params, launch, bucket_mb=5 * 8 / MiB)
    flat = grads.flat[np.dtype(np.float64)]
    assert all(np.shares_memory(p.grad, flat) for p in params)
    # backward order: the last parameter first
    np.testing.assert_array_equal(flat, [4] * 2 + [3] * 5 + [2] * 3 + [1] * 4)
    assert [[params.index(p) for p in b.params] for b in grads.buckets] == [[3, 2], [1, 0]]


def test_a_bucket_launches_once_complete_in_order_and_wait_launches_the_rest():
    params = toy_params()
    launched, launch = recording()
    grads = GradBuckets(params, launch, bucket_mb=5 * 8 / MiB)
    grads.zero()
    grads.mark_ready([params[2]])  # bucket 1's parameter first: bucket 0 is not complete
    assert launched == []
    grads.mark_ready([params[3]])  # bucket 0 complete
    assert [i for i, _ in launched] == [0]
    grads.wait()  # params 0, 1 never reported: launched by wait
    assert [i for i, _ in launched] == [0, 1]
    grads.zero()
    grads.wait()  # no hook at all: every bucket, in order
    assert [i for i, _ in launched] == [0, 1, 0, 1]


def test_a_double_report_and_a_replaced_gradient_are_errors():
    params = toy_params()
    grads = GradBuckets(params, recording()[1], bucket_mb=1.0)
    grads.zero()
    grads.mark_ready([params[0]])
    with pytest.raises(RuntimeError, match="twice"):
        grads.mark_ready([params[0]])
    grads.zero()
    params[1].grad = params[1].grad + 1
    with pytest.raises(RuntimeError, match="in place"):
        grads.wait()


def test_release_reads_as_zeros_refuses_writes_and_zero_allocates_again():
    params = toy_params()
    grads = GradBuckets(params, recording()[1], bucket_mb=1.0)
    grads.release()
    assert grads.nbytes() == 0 and not params[0].grad.any()
    with pytest.raises(ValueError, match="read-only"):
        params[0].grad += 1
    grads.zero()
    assert grads.nbytes() == 14 * 8
    params[0].grad += 1  # a view again
    assert grads.flat[np.dtype(np.float64)].sum() == 4


# ---- the engine's hook ---------------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True])
def test_piecewise_backward_is_bitwise_the_models_and_reports_each_param_once(tie):
    cfg = ModelConfig(**TINY, tie_embeddings=tie)
    x, y = batch(cfg)
    plain, hooked = (LocalEngine(GPT(cfg, 0), microbatches=2) for _ in range(2))
    reported = []
    hooked.on_grads_ready = lambda ps: reported.append(list(ps))
    for engine in (plain, hooked):
        engine.zero_grad()
        engine.forward_backward(x, y, scale=0.25)
    for (name, p), (_, q) in zip(plain.named_params, hooked.named_params, strict=True):
        assert np.array_equal(p.grad, q.grad), name
    flat = [id(p) for ps in reported for p in ps]
    assert sorted(flat) == sorted(id(p) for p in hooked.params)  # all, once each
    assert len(reported) == 2 + 2 * cfg.n_layer  # head, two halves per block, embed
    wte = hooked.model.embed.wte.weight
    assert id(wte) in map(id, reported[-1])  # the token table is final only at the end


# ---- ZeRO -------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("dp", [1, 2, 8])
def test_memory_formula_shards_the_optimizer_then_the_gradients(stage, dp):
    numel, padded, s = 1000, 1008, 4
    mem = expected_memory(numel, padded, dp, stage, states=2, itemsize=s)
    if stage == 0:
        assert mem == {"param_bytes": 4000, "grad_bytes": 4000, "optim_bytes": 8000}
        return
    assert mem["param_bytes"] == padded * s
    assert mem["optim_bytes"] * dp == 2 * padded * s
    assert mem["grad_bytes"] * (dp if stage == 2 else 1) == padded * s


def serial_setup(zero, optimizer="adamw"):
    from mpi4py import MPI

    from hpctrain.parallel.engine import build_engine
    from hpctrain.parallel.topology import Topology
    from hpctrain.train import make_data_parallel

    cfg = Config(model=ModelConfig(**TINY), parallel=ParallelConfig(zero=zero, bucket_mb=0.01),
                 train=TrainConfig(batch_size=4, optimizer=optimizer)).validate(1)
    topo = Topology.build(MPI.COMM_SELF, cfg.parallel)
    engine = build_engine(cfg, topo)
    return cfg, engine, make_data_parallel(cfg, engine, topo)


@pytest.mark.parametrize("optimizer, states", [("adamw", 2), ("sgd", 1)])
@pytest.mark.parametrize("zero", [0, 1, 2])
def test_measured_memory_at_dp_1_is_the_formula(zero, optimizer, states):
    from hpctrain.train import train_step

    cfg, engine, dp = serial_setup(zero, optimizer)
    x, y = batch(cfg.model)
    train_step(engine, dp, x, y, lr=1e-3, grad_clip=1.0)
    numel = sum(p.size for p in engine.params)
    padded = sum(dp.grads.sizes.values())
    assert padded == numel  # align 1 at dp = 1: no padding
    assert dp.memory() == expected_memory(numel, padded, 1, zero, states, itemsize=8)


def test_zero_pieces_cover_every_parameter_once_with_the_decay_of_their_parameter():
    _, engine, dp = serial_setup(2)
    assert sum(p.size for p in dp.pieces) == sum(p.size for p in engine.params)
    by_name = dict(engine.named_params)
    assert len(dp.optimizer.names) == len(by_name)  # dp = 1: one piece per parameter
    for name, piece, decay in zip(dp.optimizer.names, dp.pieces, dp.optimizer.decay,
                                  strict=True):
        param = by_name[name.split("[")[0]]
        assert decay == (param.ndim >= 2) and name.endswith(f"[0:{param.size}]")
        assert np.shares_memory(piece.data, param.data)


class FakeModelComm:
    """The model group as ``counted_once`` sees it: each rank's parameter names."""

    def __init__(self, rank, held):
        self.rank, self.held = rank, held

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return len(self.held)

    def allgather(self, _):
        return self.held


def test_norm_counts_replicated_parameters_once_and_every_tp_shard():
    def split(axis):
        return SimpleNamespace(tp_split=axis)

    # tp = 2, pp = 2: model ranks 0, 1 (stage 0) and 2, 3 (stage 1); "wte" is tied
    held = [["wte", "ln"], ["wte", "ln"], ["ln2", "wte"], ["ln2", "wte"]]
    verdicts = {}
    for rank in range(4):
        named = [(name, split(0 if name == "wte" else None)) for name in held[rank]]
        verdicts[rank] = dict(zip(held[rank], counted_once(named, FakeModelComm(rank, held),
                                                           tp_size=2), strict=True))
    assert [verdicts[r]["wte"] for r in range(4)] == [True, True, False, False]
    assert [verdicts[r].get("ln") for r in range(2)] == [True, False]
    assert [verdicts[r]["ln2"] for r in (2, 3)] == [True, False]
