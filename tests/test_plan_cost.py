"""The planner's cost model (``hpctrain.plan.cost``, ``memory``) against the real
model and hand-computed small cases: parameters and optimizer state by ZeRO stage,
activation bytes of a real forward, tensor- and data-parallel bytes, the bubble."""

import dataclasses

import numpy as np
import pytest

from hpctrain import config
from hpctrain.config import ModelConfig
from hpctrain.models import GPT
from hpctrain.models.gpt.model import Block, Head
from hpctrain.models.gpt.tensor_parallel import sequence_parallel_saving, tp_comm_bytes
from hpctrain.nn import CausalSelfAttention, Linear
from hpctrain.parallel import timeline
from hpctrain.parallel.averaging import ring_bytes
from hpctrain.parallel.pipeline import SCHEDULES
from hpctrain.parallel.tensor import activation_nbytes
from hpctrain.plan import cost
from hpctrain.plan import memory as mem
from hpctrain.plan.cluster import from_dict

TINY = dict(kind="gpt", n_layer=2, d_model=16, n_head=4, seq_len=8, vocab_size=32)


def cluster(latency=1e-5, bandwidth=4e9, memory_gib=16.0, stream=True):
    """A hand-made one-node, two-core description (what calibrate writes)."""
    kind = {"name": "cpu", "cores": 2, "memory_gib": memory_gib,
            "gemm": {"1": [[64, 2e10], [512, 1e11], [2048, 1.2e11]],
                     "2": [[64, 1e10], [512, 5e10], [2048, 6e10]]}}
    if stream:
        kind["stream"] = {"1": 8e9, "2": 5e9}
    link = {"latency_s": latency, "bandwidth_Bps": bandwidth}
    ops = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
    return from_dict({"name": "hand", "kinds": [kind], "nodes": [{"kind": "cpu", "count": 1}],
                      "links": {lvl: dict.fromkeys(ops, link) for lvl in ("intra", "inter")}})


def make(world=1, batch=4, **parallel):
    return config.from_dict({"model": TINY, "parallel": parallel,
                             "train": {"batch_size": batch}}).validate(world)


# ---------------------------------------------------------------------------------
# parameters and optimizer state


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_sizes_are_the_models(tied):
    m = ModelConfig(**TINY, tie_embeddings=tied)
    model = GPT(m, seed=0)
    assert mem.rank_param_sizes(m, 1, 1, 1, "layers", 0) == \
        [p.size for _, p in model.named_parameters()]


def test_state_bytes_by_zero_stage_by_hand():
    m = ModelConfig(**TINY)
    sizes = mem.rank_param_sizes(m, 1, 1, 1, "layers", 0)
    n = sum(sizes)  # 32*16 + 8*16 + 2 * (2*16 + 16*48 + 48 + 256 + 16 + 2*16 + 16*64 + 64
    #                 + 64*16 + 16) + 2*16 + 16*32
    assert n == 512 + 128 + 2 * (32 + 768 + 48 + 256 + 16 + 32 + 1024 + 64 + 1024 + 16) \
        + 32 + 512
    assert n % 2 == 0 and n % 3 == 1
    assert mem.state_bytes(sizes, 4, 2, 0, 2, 4.0) == (4 * n, 4 * n, 8 * n)
    # one bucket (4 MiB), padded to a multiple of dp = 3: n + 2 elements
    assert mem.state_bytes(sizes, 4, 3, 1, 2, 4.0) == (4 * (n + 2), 4 * (n + 2),
                                                       8 * (n + 2) // 3)
    assert mem.state_bytes(sizes, 4, 3, 2, 2, 4.0) == (4 * (n + 2), 4 * (n + 2) // 3,
                                                       8 * (n + 2) // 3)


# ---------------------------------------------------------------------------------
# activations: the formula against a real forward's caches


@pytest.mark.parametrize("b, seq, d_model, n_head", [(2, 8, 16, 4), (3, 12, 24, 2)])
def test_block_and_head_activations_equal_a_real_forward(b, seq, d_model, n_head):
    m = ModelConfig(**{**TINY, "seq_len": seq, "d_model": d_model, "n_head": n_head})
    rng = np.random.default_rng(0)
    block = Block(d_model, n_head, m.ffn_dim, rng=rng, dtype=np.float32, std=0.02,
                  proj_std=0.02)
    x = rng.standard_normal((b, seq, d_model)).astype(np.float32)
    _, cache = block.forward(x)
    assert activation_nbytes(cache) == mem.block_activation_bytes(m, b)
    head = Head(d_model, m.vocab_size, rng=rng, dtype=np.float32, std=0.02)
    _, hcache = head.forward(x, rng.integers(0, m.vocab_size, (b, seq)))
    assert activation_nbytes(hcache) == mem.head_activation_bytes(m, b)


def test_tensor_parallel_block_activations_equal_a_sharded_forward():
    """A block as one of tp = 2 ranks holds it: half the heads and MLP columns."""
    m, b, tp = ModelConfig(**TINY), 2, 2
    c, f = m.d_model, m.ffn_dim
    rng = np.random.default_rng(0)
    block = Block(c, m.n_head, f, rng=rng, dtype=np.float32, std=0.02, proj_std=0.02)
    attn = CausalSelfAttention(c, m.n_head, rng=rng, dtype=np.float32)
    attn.n_head //= tp
    attn.qkv = Linear(c, 3 * c // tp, rng=rng, dtype=np.float32)
    attn.proj = Linear(c // tp, c, rng=rng, dtype=np.float32)
    block.attn = attn
    block.mlp.fc = Linear(c, f // tp, rng=rng, dtype=np.float32)
    block.mlp.proj = Linear(f // tp, c, rng=rng, dtype=np.float32)
    _, cache = block.forward(rng.standard_normal((b, m.seq_len, c)).astype(np.float32))
    assert activation_nbytes(cache) == mem.block_activation_bytes(m, b, tp)


def test_sequence_parallel_saves_what_the_plan_says():
    m, b, tp = ModelConfig(**TINY), 3, 2
    saved = (m.n_layer * (mem.block_activation_bytes(m, b, tp) -
                          mem.block_activation_bytes(m, b, tp, sp=True))
             + mem.head_activation_bytes(m, b, tp) - mem.head_activation_bytes(m, b, tp, True))
    assert saved == sequence_parallel_saving(m, b, m.seq_len, tp)


def test_activations_count_the_schedules_peak():
    cfg = make(world=2, pp=2, microbatches=4, schedule="gpipe")
    gpipe = cost.estimate(cfg, cluster())
    one = cost.estimate(make(world=2, pp=2, microbatches=4, schedule="1f1b"), cluster())
    assert [r.live for r in gpipe.ranks] == [4, 4]
    assert [r.live for r in one.ranks] == [2, 1]
    b = 1  # 4 sequences in 4 microbatches
    m = cfg.model
    assert one.ranks[0].memory.activations == 2 * mem.block_activation_bytes(m, b)
    last = mem.block_activation_bytes(m, b) + mem.head_activation_bytes(m, b) \
        + 4 * b * m.seq_len * m.d_model  # and the received input
    assert one.ranks[1].memory.activations == last


# ---------------------------------------------------------------------------------
# communication: bytes through a link of 1 byte/s and no latency


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_bytes_are_tp_comm_bytes(sp):
    cfg = make(world=2, tp=2, microbatches=2, sequence_parallel=sp)
    e = cost.estimate(cfg, cluster(latency=0.0, bandwidth=1.0))
    m, u = cfg.model, 1 / 2
    activations = 2 * u * 4 * 2 * (4 * m.n_layer + 2) * m.d_model * (4 // 2 * m.seq_len)
    assert e.ranks[0].time["tp"] == pytest.approx(activations)
    # tp_comm_bytes adds the loss's and the norm's small all-reduces (and SP's norms)
    extra = tp_comm_bytes(m, 4, 2, 2, sp) - activations
    assert 0 < extra < 0.1 * activations


@pytest.mark.parametrize("zero", [0, 1])
def test_data_parallel_bytes_are_the_ring_all_reduce(zero):
    # buckets of 64 MiB: the first is never full before backward ends, no overlap
    cfg = make(world=2, dp=2, zero=zero, bucket_mb=64.0)
    e = cost.estimate(cfg, cluster(latency=0.0, bandwidth=1.0))
    params = e.ranks[0].memory.params
    # ZeRO: a reduce-scatter and an all-gather move what one all-reduce moves
    assert e.ranks[0].time["dp"] == pytest.approx(ring_bytes(params, 2))


@pytest.mark.parametrize("mb, reshard", [(1, True), (2, True), (2, False)])
def test_zero_3_gathers_every_unit_for_each_microbatch(mb, reshard):
    # zero3.py gathers each unit before every microbatch's forward, and again before
    # its backward when resharding (it was priced as one or two gathers a step); the
    # gradients are reduce-scattered once
    cfg = make(world=2, dp=2, zero=3, microbatches=mb, bucket_mb=64.0,
               reshard_after_forward=reshard)
    e = cost.estimate(cfg, cluster(latency=0.0, bandwidth=1.0))
    whole = 4 * sum(mem.rank_param_sizes(cfg.model, 1, 1, 1, "layers", 0))
    gathers = mb * (2 if reshard else 1)
    assert e.ranks[0].time["dp"] == pytest.approx(ring_bytes(whole, 2) / 2 * (gathers + 1))


def test_no_stream_rate_leaves_element_wise_work_out_and_says_so():
    e = cost.estimate(make(), cluster(stream=False))
    assert e.ranks[0].time["optimizer"] == 0.0
    assert any("stream" in n for n in e.notes)


def test_rates_measured_at_fewer_ranks_a_node_than_priced_are_named():
    """Tables of 1 rank a node on a 2-core node: 2 ranks, or 1 rank of 2 threads, are
    priced with 1's rates, each as if it had both cores; a note says which counts."""
    c = cluster()
    kind = c.kinds["cpu"]
    one = dataclasses.replace(c, kinds={"cpu": dataclasses.replace(
        kind, gemm={1: kind.gemm[1]}, stream={1: kind.stream[1]})})
    note = ("node kind 'cpu': rates measured at fewer ranks a node (gemm at 1; stream at "
            "1) stand in for the 2 this layout computes at once")
    for cfg in (make(world=2, dp=2), make(batch_threads=0)):
        assert any(n.startswith(note) for n in cost.estimate(cfg, one).notes)
        assert not any("measured at fewer" in n for n in cost.estimate(cfg, c).notes)
    assert not any("measured at fewer" in n for n in cost.estimate(make(), one).notes)
    assert kind.unmeasured(2) == {} and kind.unmeasured(3) == {"gemm": (1, 2),
                                                                 "stream": (1, 2)}


# ---------------------------------------------------------------------------------
# the pipeline: the replayed bubble of equal stages is the textbook one


@pytest.mark.parametrize("schedule, pp, m, v", [("gpipe", 2, 4, 1), ("gpipe", 4, 8, 1),
                                                ("1f1b", 4, 8, 1), ("1f1b", 3, 5, 1),
                                                ("interleaved", 2, 4, 2)])
def test_replayed_bubble_equals_theory_with_equal_stages(schedule, pp, m, v):
    orders = timeline.record_compute(SCHEDULES[schedule], pp, m, v)
    chunk = {k: (1.0 / v, 2.0 / v, 0, 0, 0, 0) for k in range(pp * v)}
    times = [{k: chunk[k] for k in range(r, pp * v, pp)} for r in range(pp)]
    makespan, busy, _ = cost._pipeline(orders, times, pp * v, pp, m, v, replay=True)
    assert 1 - busy[0] / makespan == pytest.approx(timeline.bubble_theory(pp, m, v))
    closed, _, _ = cost._pipeline(orders, times, pp * v, pp, m, v, replay=False)
    assert closed == pytest.approx(makespan)


@pytest.mark.parametrize("pp", [2, 3])
def test_a_tied_table_adds_its_gradient_exchange_to_the_first_and_last_stage(pp):
    # PipelineEngine._sum_tied_grads: the first and last stage swap the table's
    # gradient (V x C float32 at tp 1) after the last backward; a middle stage does not
    def cfg(tied):
        return config.from_dict({"model": {**TINY, "n_layer": 3, "tie_embeddings": tied},
                                 "parallel": {"pp": pp, "microbatches": 2},
                                 "train": {"batch_size": 4}}).validate(pp)

    plain, tied = (cost.estimate(cfg(t), cluster()) for t in (False, True))
    table = GPT(cfg(True).model, seed=0).named_parameters()[0][1]
    exchange = cluster().collective_time("p2p", 2, table.data.nbytes, False)
    assert table.size == TINY["vocab_size"] * TINY["d_model"] and exchange > 0
    for r0, r1 in zip(plain.ranks, tied.ranks, strict=True):
        ends = r0.pp_rank in (0, pp - 1)
        assert r1.time["p2p"] - r0.time["p2p"] == pytest.approx(exchange if ends else 0.0)


def test_most_loaded_rank_is_named():
    e = cost.estimate(make(world=2, pp=2, microbatches=4), cluster())
    assert "pp rank 0" in e.bottleneck() and "2 microbatch cache(s)" in e.bottleneck()


def test_full_recomputation_repeats_each_blocks_forward_and_keeps_its_input():
    cfg = make(world=2, pp=2, microbatches=2)
    plain = cost.estimate(cfg, cluster(stream=False))
    full = cost.estimate(cfg, cluster(stream=False), practice=cost.Practice(recompute="full"))
    m, b = cfg.model, 2  # 4 sequences in 2 microbatches
    kind = cluster().kinds["cpu"]
    again = 2 * m.n_layer // 2 * cost.block_forward_s(m, kind, 2, b, 1)  # 2 mb, 1 block each
    for r0, r1 in zip(plain.ranks, full.ranks, strict=True):
        assert r1.time["compute"] - r0.time["compute"] == pytest.approx(again)
    # the first stage keeps one block's input per live microbatch, not its cache
    assert full.ranks[0].memory.activations == \
        full.ranks[0].live * 4 * b * m.seq_len * m.d_model


def test_a_practice_that_keeps_the_whole_model_counts_the_other_stages():
    """A pipeline engine that keeps the serial model alive (hpctrain's did: the pp2 rows
    of benchmarks/README.md) holds the other stages' parameters and gradients; one that
    builds only its stage (hpctrain's now, the default) does not."""
    cfg = make(world=2, pp=2, microbatches=2)
    whole = sum(mem.rank_param_sizes(cfg.model, 1, 1, 1, "layers", 0))
    e = cost.estimate(cfg, cluster(), practice=cost.Practice(keeps_whole_model=True))
    for r in e.ranks:
        mine = sum(mem.rank_param_sizes(cfg.model, 1, 2, 1, "layers", r.pp_rank))
        assert r.memory.retained == 2 * 4 * (whole - mine)
    lean = cost.estimate(cfg, cluster())
    assert all(r.memory.retained == 0 for r in lean.ranks)
    assert cost.estimate(make(), cluster()).ranks[0].memory.retained == 0


def test_a_practice_refuses_unknown_choices_by_name():
    with pytest.raises(ValueError, match=r"recompute \('some'\) must be one of"):
        cost.Practice(recompute="some")
    with pytest.raises(ValueError, match=r"kernels \('cuda'\) must be one of"):
        cost.Practice(kernels="cuda")


def test_the_configs_recomputation_is_priced_unless_the_practice_names_one():
    """The default practice takes [train] recompute from the config (``hpctrain plan`` of a
    config with recompute = "full" prices the extra forward and keeps only the blocks'
    inputs); a practice that names one (Megatron's "full") overrides it."""
    from dataclasses import replace

    plain = make()
    est = {rc: cost.estimate(replace(plain, train=replace(plain.train, recompute=rc)),
                             cluster()) for rc in ("none", "selective", "attention", "full")}
    act = {rc: e.ranks[0].memory.activations for rc, e in est.items()}
    step = {rc: e.step_s for rc, e in est.items()}
    assert act["none"] > act["selective"] > act["attention"] > act["full"]
    assert step["none"] < step["selective"] < step["attention"] < step["full"]
    forced = cost.estimate(plain, cluster(), practice=cost.Practice(recompute="full"))
    assert forced.ranks[0].memory.activations == act["full"] and forced.step_s == step["full"]


def test_the_kernels_that_run_are_priced_unless_the_practice_names_them():
    """hpctrain's numba kernels make fewer passes than its NumPy ones (GELU 3 and 4 of
    19 and 20, ...): cheaper element-wise time; the default practice prices the set
    this process runs (``nn.kernels``), a named one is priced whatever runs."""
    from hpctrain.nn import kernels

    cfg = make()
    numpy_ = cost.estimate(cfg, cluster(), practice=cost.Practice(kernels="numpy"))
    numba_ = cost.estimate(cfg, cluster(), practice=cost.Practice(kernels="numba"))
    assert numba_.step_s < numpy_.step_s
    m = cfg.model
    assert cost.block_stream_bytes(m, 4, 1, False, "numba")[0] < \
        cost.block_stream_bytes(m, 4, 1, False, "numpy")[0]
    try:
        kernels.set_kernels(kernels.NUMPY_KERNELS)
        assert cost.running_kernels(m) == "numpy"
        assert cost.estimate(cfg, cluster()).step_s == numpy_.step_s
        marker = kernels.NUMPY_KERNELS._replace(gelu_forward=lambda *a: None)
        kernels.set_kernels(marker)  # any set other than NumPy's is numba's
        assert cost.running_kernels(m) == "numba"
        assert cost.estimate(cfg, cluster()).step_s == numba_.step_s
    finally:
        kernels.set_kernels(None)


# ---------------------------------------------------------------------------------
# the data-parallel buckets, ready as the backward makes them


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("bucket_mb", [0.001, 0.004, 64.0])
def test_the_buckets_and_when_they_are_ready_are_the_engines(tied, bucket_mb):
    """grad_buckets cuts the engine's buckets (data._layout over the parameters in
    backward order), and each is ready at the backward piece the engine reports last
    for it (GPT.backward_pieces: head, MLP and attention halves from the last block,
    the embedding)."""
    from hpctrain.parallel.data import _layout

    m = ModelConfig(**TINY, tie_embeddings=tied)
    model = GPT(m, seed=0)
    params = model.parameters()
    want, _ = _layout(list(reversed(params)), bucket_mb, 1)
    got = cost.grad_buckets(m, 1, 1, 1, "layers", 0, 4, bucket_mb, 1)
    assert [b.size * 4 for b in want] == [n for n, _ in got]
    pieces = model.backward_pieces()
    last = {id(p): k for k, piece in enumerate(pieces) for p in piece}
    order = cost._unit_order(m, 1, mem.chunk_blocks(m, 1, 1, "layers"))
    assert len(order) == len(pieces)
    assert [max(last[id(p)] for p in b.params) for b in want] == \
        [order.index(unit) for _, unit in got]


def test_pipeline_buckets_wait_for_their_whole_chunk():
    m = ModelConfig(**TINY)
    got = cost.grad_buckets(m, 1, 2, 1, "layers", 1, 4, 0.001, 1)
    assert {unit for _, unit in got} == {("chunk", 1)}  # rank 1 holds the last chunk
    assert sum(n for n, _ in got) == 4 * sum(mem.rank_param_sizes(m, 1, 2, 1, "layers", 1))


def test_buckets_go_over_the_link_one_after_the_other_by_hand():
    """Three buckets of 100 bytes ready at 0, 0.5 and 1.0 s of a step whose compute ends
    at 1.0 s, each all-reduce 0.3 s (dp 2: 100 bytes sent at 1000/3 B/s): the first two
    finish under compute, the last runs 0.3 s past it; all three after the compute
    (dp_overlap off), 0.9 s."""
    cfg = make(world=2, dp=2)
    c = cluster(latency=0.0, bandwidth=1000 / 3)
    buckets = [(100, 0.0), (100, 0.5), (100, 1.0)]
    assert cost.dp_time(cfg, c, buckets, 1.0, 2, False) == pytest.approx(0.3)
    late = [(100, 1.0)] * 3
    assert cost.dp_time(cfg, c, late, 1.0, 2, False) == pytest.approx(0.9)
    # a bucket that waits for the one before it: ready at 0.1, starts at 0.3
    assert cost.dp_time(cfg, c, [(100, 0.0), (100, 0.1), (100, 0.2)], 0.5, 2, False) == \
        pytest.approx(0.4)
    # slowed beside the compute, the sum 2 x and the compute 1.25 x: the first ends at
    # 0.6 s wall (compute at 0.48), the compute alone reaches 0.5 at 0.62, the second
    # runs to 1.22 (compute at 0.98), the compute alone ends at 1.24, the third alone
    # to 1.54: 0.54 exposed
    assert cost.dp_time(cfg, c, buckets, 1.0, 2, False, (2.0, 1.25)) == pytest.approx(0.54)


def test_beside_shares_the_node_between_a_sum_and_the_compute_by_hand():
    """A sum beside 1 s of compute, by hand. Slowdowns 1 (each as if alone): a sum of
    0.3 s ready at once ends inside it, nothing exposed. Sum 2 x, compute 1.25 x: while
    both run the sum moves at 0.5 and the compute at 0.8, so the 0.3 s sum ends at 0.6
    s of wall time with the compute at 0.48; the other 0.52 s of compute alone end the
    step at 1.12 s: 0.12 exposed (the compute's own loss)."""
    assert cost.beside([(0.3, 0.0)], 1.0, 1.0) == pytest.approx(0.0)
    assert cost.beside([(0.3, 0.0)], 1.0, 1.0, 2.0, 1.25) == pytest.approx(0.12)
    # 0.6 s alone: the compute's 1 s at 0.8 takes 1.25 s wall, in which the sum moves
    # 0.625 s of its 0.6: it ends first, at 1.2 s wall with the compute at 0.96; the
    # last 0.04 s of compute alone: 1.24 s, 0.24 exposed
    assert cost.beside([(0.6, 0.0)], 1.0, 1.0, 2.0, 1.25) == pytest.approx(0.24)
    # 1.0 s alone: the compute ends at 1.25 s wall, the sum 0.625 done; 0.375 s alone
    assert cost.beside([(1.0, 0.0)], 1.0, 1.0, 2.0, 1.25) == pytest.approx(0.625)
    assert cost.beside([(0.3, 1.0)], 1.0, 1.0, 2.0, 1.25) == pytest.approx(0.3)
    # ready at 0.5 of the compute's own clock, which the sum before it slowed: sums of
    # 0.2 at 0 and 0.2 at 0.5; the first ends at 0.4 wall (compute at 0.32), the
    # compute alone reaches 0.5 at 0.58, the second runs 0.4 wall to 0.98 (compute at
    # 0.82), the compute's last 0.18 end at 1.16: 0.16 exposed
    assert cost.beside([(0.2, 0.0), (0.2, 0.5)], 1.0, 1.0, 2.0, 1.25) == pytest.approx(0.16)
    # a stage that computes until 0.5 and waits for the others until 1.0: a sum of 0.8
    # from 0 runs beside the compute until it ends at 0.625 wall (0.3125 of the sum
    # done), the other 0.4875 alone: 1.1125, 0.1125 past the makespan; with 0.4 alone,
    # inside the wait: nothing exposed
    assert cost.beside([(0.8, 0.0)], 1.0, 0.5, 2.0, 1.25) == pytest.approx(0.1125)
    assert cost.beside([(0.4, 0.0)], 1.0, 0.5, 2.0, 1.25) == pytest.approx(0.0)
    # the compute's own loss (ending at 0.58 wall, not 0.5) absorbed by the wait
    assert cost.beside([(0.2, 0.0)], 1.0, 0.5, 2.0, 1.25) == pytest.approx(0.0)
    # a sum ready after the stage's compute (the sums after the step, dp_overlap off)
    # starts at its ready time
    assert cost.beside([(0.3, 1.0)], 1.0, 0.5, 2.0, 1.25) == pytest.approx(0.3)


# ---------------------------------------------------------------------------------
# a rank's batch split over its threads


def test_a_batch_split_computes_as_that_many_ranks_a_node_on_their_rows():
    c = cluster()  # two cores: the rates of 1 and 2 ranks a node differ
    plain, split = make(batch=4), make(batch=4, batch_threads=0)  # 0: the rank's 2 cores
    dp2 = cost.estimate(make(world=2, batch=4, dp=2), c).ranks[0]
    e_plain, e_split = cost.estimate(plain, c).ranks[0], cost.estimate(split, c).ranks[0]
    numel = sum(mem.rank_param_sizes(split.model, 1, 1, 1, "layers", 0))
    summed = numel * 4 * 3 / 2 / 5e9  # 1 extra float32 set: read both, write, 2 threads
    # each thread: dp2's rank's rows at dp2's per-rank rates, then the gradients added
    assert e_split.time["compute"] == pytest.approx(dp2.time["compute"] + summed)
    assert e_split.time["compute"] != pytest.approx(e_plain.time["compute"])
    assert e_split.memory.grads == 2 * e_plain.memory.grads  # one gradient set a thread
    assert e_split.memory.activations == e_plain.memory.activations  # the same rows
    assert e_split.time["optimizer"] == e_plain.time["optimizer"]  # on the whole rank
    assert (e_split.split, e_plain.split) == (2, 1)
    assert "its rows over 2 threads" in e_split.describe() and "threads" not in \
        e_plain.describe()


@pytest.mark.parametrize("threads, cores, rpn, rows, recompute, split", [
    (1, 8, 1, 8, "none", 1), (0, 8, 1, 8, "none", 8), (0, 8, 2, 8, "none", 4),
    (0, 8, 1, 3, "none", 3), (3, 8, 4, 8, "none", 3), (0, 1, 1, 8, "none", 1),
    (0, 8, 1, 8, "full", 1)])  # 0 where the layout cannot split: plain
def test_the_threads_a_batch_is_split_over(threads, cores, rpn, rows, recompute, split):
    from dataclasses import replace as dc_replace

    cfg = config.from_dict({"model": TINY, "parallel": {"batch_threads": threads},
                            "train": {"batch_size": 8, "recompute": recompute}}).validate(1)
    kind = dc_replace(cluster().kinds["cpu"], cores=cores)
    assert cost.batch_split(cfg, [kind], rpn, rows) == split


@pytest.mark.parametrize("kernels", ["numpy", "numba"])
def test_sequence_parallel_prices_the_copies_of_its_collectives(kernels):
    # hpctrain's all-gather concatenates along T and its reduce-scatter stacks T blocks:
    # 4 whole (N, C) copies a direction a block, one read and one write each, beside
    # LayerNorm and the residual adds on N / tp rows instead of N
    m = ModelConfig(**TINY)
    b, tp, s = 4, 2, 4
    n, c = b * m.seq_len, m.d_model
    ln = cost.HPCTRAIN_PASSES[kernels][0]
    f_sp, b_sp, _ = cost.block_stream_bytes(m, b, tp, True, kernels)
    f_tp, b_tp, _ = cost.block_stream_bytes(m, b, tp, False, kernels)
    saved_f = s * (2 * ln[0] + 2 * 3) * (n - n // tp) * c
    saved_b = s * (2 * ln[1] + 2 * 3) * (n - n // tp) * c
    assert f_sp - f_tp == pytest.approx(s * 8 * n * c - saved_f)
    assert b_sp - b_tp == pytest.approx(s * 8 * n * c - saved_b)
    # Megatron's (T, B, C) layout gathers and scatters without a copy
    assert cost.block_stream_bytes(m, b, tp, True, "fused")[0] < \
        cost.block_stream_bytes(m, b, tp, False, "fused")[0]
    assert cost.embed_stream_bytes(m, b, tp, s, True)[0] - \
        cost.embed_stream_bytes(m, b, tp, s)[0] == 2 * s * n * c
    assert cost.head_stream_bytes(m, b, tp, kernels, s, True)[1] - \
        cost.head_stream_bytes(m, b, tp, kernels, s)[1] == 2 * s * n * c


def test_attentions_products_take_the_cached_rate_and_the_layers_the_other():
    """A cached table twice as fast halves the per-head products' time and leaves the
    Linear layers' alone."""
    c = cluster()
    kind = c.kinds["cpu"]
    fast = dataclasses.replace(kind, gemm_cached={r: tuple((n, 2 * v) for n, v in t)
                                                  for r, t in kind.gemm.items()})
    m = make().model
    attn, attn_fast = (cost.attention_forward_s(m, k, 1, 2, 1) for k in (kind, fast))
    assert attn_fast == pytest.approx(attn / 2)
    layers, layers_fast = (cost.block_forward_s(m, k, 1, 2, 1) - a
                           for k, a in ((kind, attn), (fast, attn_fast)))
    assert layers_fast == pytest.approx(layers) and layers > 0


def test_bf16_gradient_sums_are_priced_at_two_bytes_an_element():
    # parallel/bf16_reduce.py sends each bucket in bfloat16: half the float32 bytes
    def dp_seconds(dtype):
        cfg = config.from_dict({"model": TINY, "parallel": {
            "dp": 2, "grad_comm_dtype": dtype}, "train": {"batch_size": 4}}).validate(2)
        return cost.estimate(cfg, cluster(latency=0.0, bandwidth=1e6)).ranks[0].time["dp"]

    fp32, bf16 = dp_seconds("fp32"), dp_seconds("bf16")
    assert fp32 > 0 and bf16 == pytest.approx(fp32 / 2, rel=0.02)


def test_groups_and_sends_that_straddle_a_node_boundary_go_over_the_link():
    # block placement: stage r, data rank d, tensor rank t is world rank (r dp + d) tp + t
    # 2 ranks a node, pp 4: stages 0 and 1 on node 0, 2 and 3 on node 1 (1 -> 2 crosses)
    assert [cost.sends_cross(1, 2, r, r + 1) for r in range(3)] == [False, True, False]
    assert cost.sends_cross(1, 2, 0, 3)  # the tied table's exchange
    # 6 ranks a node, tp 4: the second tensor group is ranks 4-7, on both nodes
    tensor, data = cost.spanning_groups(3, 4, 1, 6)
    assert tensor == (True,) and data == (True,)
    assert cost.spanning_groups(2, 4, 1, 8) == ((False,), (False,))  # all on one node
    assert cost.spanning_groups(2, 2, 2, 4) == ((False, False), (False, False))
    assert cost.spanning_groups(2, 2, 1, 2) == ((False,), (True,))

    # priced: a pipeline of 4 on 2 nodes of 2 cores, links 1000x slower between nodes
    ops = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
    desc = {"name": "two", "kinds": [{"name": "cpu", "cores": 2, "memory_gib": 16.0,
                                      "gemm": {"1": [[64, 2e10], [2048, 1.2e11]]},
                                      "stream": {"1": 8e9}}],
            "nodes": [{"kind": "cpu", "count": 2}],
            "links": {"intra": dict.fromkeys(ops, {"latency_s": 1e-6, "bandwidth_Bps": 1e10}),
                      "inter": dict.fromkeys(ops, {"latency_s": 1e-3, "bandwidth_Bps": 1e7})}}
    cfg = config.from_dict({"model": {**TINY, "n_layer": 4}, "parallel": {
        "pp": 4, "microbatches": 4}, "train": {"batch_size": 4}}).validate(4)
    two = from_dict(desc)
    e = cost.estimate(cfg, two)
    boundary = mem.boundary_bytes(cfg.model, 1, 1, False)
    near = two.collective_time("p2p", 2, boundary, False)
    far = two.collective_time("p2p", 2, boundary, True)
    # stage 1 sends forward across (to 2) and backward within (to 0), 4 microbatches each
    assert e.ranks[1].time["p2p"] == pytest.approx(4 * (far + near))
    tied = cost.tied_exchange_s(two, cfg.model, 1, 4, True)  # 0 -> 3 crosses too
    assert e.ranks[0].time["p2p"] == pytest.approx(4 * near + tied)
