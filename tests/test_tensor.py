"""Tensor parallelism without mpiexec: the plan at tp = 1 (bitwise the serial model),
the sharding maths with the tp ranks simulated in one process, the communication
tally and formula, and the errors."""

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.models.build import build_model
from hpctrain.nn import CausalSelfAttention, Linear
from hpctrain.nn.gradcheck import check_parameters
from hpctrain.parallel.collectives import CountingComm
from hpctrain.parallel.engine import LocalEngine, build_engine
from hpctrain.parallel.shards import ShardedParameter, join_shards, take_shard
from hpctrain.parallel.tensor import (
    ColumnParallelLinear,
    NoCommunication,
    RowParallelLinear,
    TensorParallelEngine,
    activation_nbytes,
    apply_tensor_parallel,
    find_modules,
)
from hpctrain.parallel.tensor_gpt import (
    SEQUENCE_PLAN,
    TENSOR_PLAN,
    SequenceParallelAttention,
    SequenceParallelLayerNorm,
    VocabParallelHead,
    check_divisible,
    sequence_parallel_saving,
    tp_comm_bytes,
)
from hpctrain.parallel.topology import Topology
from hpctrain.testing import train_losses

MODEL = ModelConfig(dtype="float64", vocab_size=64, seq_len=8, n_layer=2, n_head=4,
                    d_model=16)


def cfg_for(tp=1, sp=False, tied=False, dtype="float64"):
    return Config(model=replace(MODEL, tie_embeddings=tied, dtype=dtype),
                  parallel=ParallelConfig(tp=tp, sequence_parallel=sp, microbatches=2),
                  train=TrainConfig(steps=6, batch_size=4, lr=1e-2, warmup_steps=1,
                                    grad_clip=0.5))


def batch(seed=0, b=4):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, MODEL.vocab_size, (b, MODEL.seq_len))
    return x, (x + 1) % MODEL.vocab_size


def rank_of(rank, size):
    """Stands in for a communicator where only the layout is read (no collective)."""
    return SimpleNamespace(Get_rank=lambda: rank, Get_size=lambda: size)


# ---------------------------------------------------------------------------------
# shard maths


@pytest.mark.parametrize("axis, blocks", [(None, 1), (0, 1), (1, 1), (1, 3), (0, 3)])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_join_inverts_take(axis, blocks, size):
    full = np.arange(24 * 12, dtype=float).reshape(24, 12)
    shards = [take_shard(full, axis, r, size, blocks) for r in range(size)]
    assert not any(np.shares_memory(s, full) for s in shards)
    np.testing.assert_array_equal(join_shards(shards, axis, blocks), full)


def test_qkv_shard_holds_the_same_heads_of_q_k_and_v():
    H, D, tp = 4, 3, 2
    C = H * D
    qkv = Linear(C, 3 * C, rng=np.random.default_rng(0), dtype=np.float64)
    qkv.bias.data[:] = np.arange(3 * C)
    for r in range(tp):
        col = ColumnParallelLinear.from_serial(qkv, rank_of(r, tp), NoCommunication(), blocks=3)
        heads = range(r * H // tp, (r + 1) * H // tp)
        # columns of head h in part j (0 q, 1 k, 2 v): j C + h D ... j C + (h + 1) D
        want = [j * C + h * D + d for j in range(3) for h in heads for d in range(D)]
        np.testing.assert_array_equal(col.weight.data, qkv.weight.data[:, want])
        np.testing.assert_array_equal(col.bias.data, want)
        assert (col.weight.tp_split, col.weight.tp_blocks) == (1, 3)
        assert col.weight.global_shape == (C, 3 * C)


@pytest.mark.parametrize("tp", [2, 4])
def test_split_attention_summed_over_simulated_ranks_is_the_serial_attention(tp):
    """Per rank: its heads, qkv column- and proj row-parallel without communication;
    the sum of the outputs (what g computes) and of the input gradients (what f's
    backward computes) are the serial ones, and the shards join to the serial grads."""
    rng = np.random.default_rng(1)
    attn = CausalSelfAttention(16, 4, rng=rng, dtype=np.float64)
    attn.proj.bias.data[:] = rng.standard_normal(16)
    x = rng.standard_normal((2, 5, 16))
    dout = rng.standard_normal((2, 5, 16))
    out, cache = attn.forward(x)
    dx = attn.backward(dout, cache)
    outs, dxs, shards = [], [], []
    for r in range(tp):
        comm = rank_of(r, tp)
        part = CausalSelfAttention(16, 4, rng=rng, dtype=np.float64)
        part.n_head = 4 // tp
        part.qkv = ColumnParallelLinear.from_serial(attn.qkv, comm, NoCommunication(), 3)
        part.proj = RowParallelLinear.from_serial(attn.proj, comm, NoCommunication())
        o, c = part.forward(x)
        outs.append(o)
        dxs.append(part.backward(dout, c))
        shards.append(part)
    np.testing.assert_allclose(sum(outs), out, rtol=0, atol=1e-14)
    np.testing.assert_allclose(sum(dxs), dx, rtol=0, atol=1e-14)
    for name, p in attn.named_parameters():
        parts = [dict(s.named_parameters())[name] for s in shards]
        full = join_shards([q.grad for q in parts], parts[0].tp_split, parts[0].tp_blocks)
        np.testing.assert_allclose(full, p.grad, rtol=0, atol=1e-13, err_msg=name)


# ---------------------------------------------------------------------------------
# the plan at tp = 1: the same model, bit for bit


def test_every_plan_entry_names_modules_of_the_gpt():
    model = build_model(replace(MODEL, tie_embeddings=True), 0)
    for pattern, _ in TENSOR_PLAN + SEQUENCE_PLAN:
        assert find_modules(model, pattern), pattern
    assert len(find_modules(model, "blocks.*.attn.qkv")) == MODEL.n_layer


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_plan_at_tp_1_is_bitwise_the_serial_model(sp, tied):
    cfg = cfg_for(sp=sp, tied=tied).validate(1)
    serial = build_model(cfg.model, 0)
    model = apply_tensor_parallel(build_model(cfg.model, 0), cfg, MPI.COMM_SELF)
    assert isinstance(model.head, VocabParallelHead)
    assert isinstance(model.blocks[0].mlp.fc, ColumnParallelLinear)
    assert isinstance(model.blocks[1].attn.proj, RowParallelLinear)
    assert isinstance(model.blocks[0].attn, SequenceParallelAttention) == sp
    assert isinstance(model.blocks[0].ln1, SequenceParallelLayerNorm) == sp
    names = [n for n, _ in serial.named_parameters()]
    assert [n for n, _ in model.named_parameters()] == names
    for _, p in model.named_parameters():
        assert isinstance(p, ShardedParameter) and p.global_shape == p.shape
    x, y = batch()
    np.testing.assert_array_equal(model.logits(x), serial.logits(x))
    loss, cache = model.forward(x, y)
    serial_loss, serial_cache = serial.forward(x, y)
    assert loss == serial_loss
    model.backward(cache, 0.5)
    serial.backward(serial_cache, 0.5)
    pairs = zip(model.named_parameters(), serial.named_parameters(), strict=True)
    for (name, p), (_, q) in pairs:
        np.testing.assert_array_equal(p.grad, q.grad, err_msg=name)


def test_sharded_gpt_passes_the_finite_difference_check():
    cfg = cfg_for(sp=True, tied=True).validate(1)
    model = apply_tensor_parallel(build_model(cfg.model, 0), cfg, MPI.COMM_SELF)
    x, y = batch(b=2)
    model.backward(model.forward(x, y)[1])
    errors = check_parameters(lambda: model.forward(x, y)[0], model.named_parameters(),
                              max_probes=6)
    assert max(errors.values()) < 1e-6, errors


def test_tp_1_engine_trains_like_the_serial_engine():
    cfg = cfg_for().validate(1)
    data = [batch(s) for s in range(3)]
    topo = Topology.build(MPI.COMM_SELF, cfg.parallel)
    assert type(build_engine(cfg, topo)) is LocalEngine  # tp = 1: the serial path
    serial = train_losses(cfg, MPI.COMM_SELF, data)
    model = apply_tensor_parallel(build_model(cfg.model, cfg.train.seed), cfg, MPI.COMM_SELF)
    engine = TensorParallelEngine(model, cfg, topo)
    x, y = data[0]
    engine.zero_grad()
    assert engine.forward_backward(x, y) == pytest.approx(serial[0], rel=1e-15)
    assert engine.metrics()["tp_comm_bytes"] == 0 == tp_comm_bytes(cfg.model, 4, 2, 1, False)
    assert engine.grad_norm() > 0
    topo.free()


# ---------------------------------------------------------------------------------
# communication and memory accounting


class SilentComm:
    """A communicator of ``size`` ranks whose collectives do nothing."""

    def __init__(self, size):
        self.size = size

    def Get_size(self):
        return self.size

    def Get_rank(self):
        return 0

    def Allreduce(self, sendbuf, recvbuf, op):
        pass

    def Allgather(self, sendbuf, recvbuf):
        pass

    def Reduce_scatter_block(self, sendbuf, recvbuf, op):
        pass


def test_counting_comm_tallies_the_ring_algorithms():
    from hpctrain.parallel.collectives import all_gather, all_reduce, reduce_scatter

    comm = CountingComm(SilentComm(4))
    x = np.zeros((2, 8, 5))  # 640 bytes
    all_reduce(x, comm)
    assert comm.bytes_sent == 2 * 3 / 4 * 640
    comm.reset()
    assert all_gather(x, comm, axis=1).shape == (2, 32, 5)
    assert comm.bytes_sent == 3 * 640  # (p - 1)/p of the gathered 4 * 640
    comm.reset()
    assert reduce_scatter(x, comm, axis=1).shape == (2, 2, 5)
    assert (comm.bytes_sent, comm.calls) == (3 / 4 * 640, 1)


def test_comm_formula_by_hand():
    m = replace(MODEL, dtype="float32")  # s = 4, L = 2, C = 16, T = 8
    # tp = 2: u = 1/2; batch 4, mb 2: N = 16 tokens per microbatch
    per_mb = (4 * 2 + 2) * 16 * 16 + 3 * 16  # 2608 elements all-reduced
    assert tp_comm_bytes(m, 4, 2, 2, False) == 2 * 0.5 * 4 * 2 * per_mb + 2 * 0.5 * 8
    sp_extra = 2 * 0.5 * 4 * 2 * (4 * 2 + 2) * 16  # the LayerNorm gradient sums
    assert tp_comm_bytes(m, 4, 2, 2, True) - tp_comm_bytes(m, 4, 2, 2, False) == sp_extra
    assert tp_comm_bytes(m, 4, 2, 1, True) == 0


def test_sequence_parallel_saving_formula():
    # 2L + 1 = 5 norms, each (B, T, C + 1) floats, of which 1 - 1/tp are no longer held
    assert sequence_parallel_saving(MODEL, 2, 8, 4) == 5 * 2 * 6 * 17 * 8
    assert sequence_parallel_saving(MODEL, 2, 8, 1) == 0


def test_activation_bytes_count_each_memory_block_once():
    a = np.zeros((4, 8))
    cache = (a, a[1:], (a.T, np.zeros(3, np.float32)), [np.arange(5)])
    assert activation_nbytes(cache) == a.nbytes + 12


# ---------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("field, value, what", [
    ("n_head", 6, r"tp \(4\) must divide n_head \(6\)"),
    ("d_model", 30, r"tp \(4\) must divide d_model \(30\)"),
    ("d_ff", 66, r"tp \(4\) must divide the MLP width d_ff \(66\)"),
    ("vocab_size", 65, r"tp \(4\) must divide vocab_size \(65\)"),
    ("seq_len", 6, r"tp \(4\) must divide seq_len under sequence parallelism \(6\)"),
])
def test_indivisible_sizes_are_refused_with_both_values(field, value, what):
    with pytest.raises(ConfigError, match=what):
        check_divisible(replace(MODEL, **{field: value}), 4, sequence_parallel=True)


def test_seq_len_need_not_divide_without_sequence_parallelism():
    check_divisible(replace(MODEL, seq_len=6), 4, sequence_parallel=False)


def test_tp_must_match_the_communicator():
    cfg = cfg_for(tp=2).validate(2)
    with pytest.raises(ValueError, match=r"tp \(2\) must equal the size of the tensor "
                                         r"communicator \(1\)"):
        apply_tensor_parallel(build_model(cfg.model, 0), cfg, MPI.COMM_SELF)


def test_the_mlp_classifier_is_refused():
    cfg = Config(model=ModelConfig(kind="mlp", input_dim=4, hidden=(4,)))
    with pytest.raises(ConfigError, match=r"splits the GPT only \(model kind is 'mlp'\)"):
        apply_tensor_parallel(build_model(cfg.model, 0), cfg, MPI.COMM_SELF)
