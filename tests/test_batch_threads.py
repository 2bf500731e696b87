"""A rank's batch split over threads (hpctrain.parallel.batch_threads) against the
plain engine: the same loss and gradients within rounding, hooks that see the whole
sum, a thread's failure raised and never a hang, and the config's rules."""

import threading
from dataclasses import replace

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.models.build import build_model
from hpctrain.nn import threads as nn_threads
from hpctrain.parallel.batch_threads import BatchThreadsEngine, replica, split_rows
from hpctrain.parallel.local import LocalEngine
from hpctrain.testing import train_losses

GPT = ModelConfig(n_layer=2, d_model=16, n_head=2, seq_len=8, vocab_size=32,
                  dtype="float64", init_std=0.3)
MLP = ModelConfig(kind="mlp", input_dim=12, hidden=(10, 10), n_classes=5, dtype="float64")


def batch(m: ModelConfig, rows: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    if m.kind == "mlp":
        return rng.standard_normal((rows, m.input_dim)), rng.integers(0, m.n_classes, rows)
    shape = (rows, m.seq_len)
    return rng.integers(0, m.vocab_size, shape), rng.integers(0, m.vocab_size, shape)


def grads(engine) -> list[np.ndarray]:
    return [p.grad.copy() for p in engine.params]


def test_split_rows_covers_every_row_in_even_nonempty_parts():
    assert split_rows(5, 2) == [(0, 2), (2, 5)]
    assert split_rows(8, 3) == [(0, 2), (2, 5), (5, 8)]
    assert split_rows(1, 4) == [(0, 1)]  # fewer rows than threads: fewer parts
    for b in range(1, 20):
        for k in range(1, 6):
            parts = split_rows(b, k)
            assert parts[0][0] == 0 and parts[-1][1] == b and len(parts) == min(b, k)
            assert all(r1 > r0 for r0, r1 in parts)
            assert all(a[1] == c[0] for a, c in zip(parts, parts[1:], strict=False))


@pytest.mark.parametrize("tie", [False, True])
def test_a_replica_shares_the_weights_and_keeps_its_own_gradients(tie):
    model = build_model(replace(GPT, tie_embeddings=tie), seed=1)
    twin = replica(model)
    ours, theirs = model.parameters(), twin.parameters()
    assert len(ours) == len(theirs)  # a tied table is one Parameter in both
    for p, q in zip(ours, theirs, strict=True):
        assert p is not q and q.data is p.data
    theirs[0].grad += 1.0
    assert not ours[0].grad.any()  # separate gradients
    ours[0].data += 0.5  # an in-place update (the optimizers') is seen by the replica
    assert theirs[0].data is ours[0].data


@pytest.mark.parametrize("m, threads, rows, mb", [
    (GPT, 2, 8, 1), (GPT, 3, 8, 2), (GPT, 2, 5, 1), (GPT, 4, 3, 1),
    (replace(GPT, tie_embeddings=True), 2, 6, 2), (MLP, 2, 9, 1), (MLP, 3, 12, 3)])
def test_the_split_gives_the_plain_engines_loss_and_gradients(m, threads, rows, mb):
    x, y = batch(m, rows)
    plain = LocalEngine(build_model(m, seed=3), mb)
    split = BatchThreadsEngine(build_model(m, seed=3), mb, threads)
    for engine in (plain, split):
        engine.zero_grad()
    loss = plain.forward_backward(x, y, scale=0.5)
    got = split.forward_backward(x, y, scale=0.5)
    assert got == pytest.approx(loss, rel=1e-13)
    for name_p, a, b in zip(plain.named_params, grads(plain), grads(split), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-11, atol=1e-14, err_msg=name_p[0])
    # a second step after zero_grad: nothing of the first step's replica gradients stays
    for engine in (plain, split):
        engine.zero_grad()
    x, y = batch(m, rows, seed=1)
    plain.forward_backward(x, y)
    split.forward_backward(x, y)
    for a, b in zip(grads(plain), grads(split), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-11, atol=1e-14)


def test_weights_moved_after_the_engine_is_built_are_followed():
    # ZeRO 1 and 2 move every p.data into a flat buffer after the engine is built
    x, y = batch(GPT, 6)
    plain = LocalEngine(build_model(GPT, seed=3), 1)
    split = BatchThreadsEngine(build_model(GPT, seed=3), 1, 2)
    for engine in (plain, split):
        for p in engine.params:
            p.data = p.data * 1.5  # new arrays
        engine.zero_grad()
        engine.forward_backward(x, y)
    for a, b in zip(grads(plain), grads(split), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-11, atol=1e-14)


def test_the_split_restores_the_thread_counts():
    blas, rows = nn_threads.blas_threads(), nn_threads.threads()
    split = BatchThreadsEngine(build_model(GPT, seed=3), 1, 2)
    split.forward_backward(*batch(GPT, 4))
    assert (nn_threads.blas_threads(), nn_threads.threads()) == (blas, rows)


@pytest.mark.parametrize("mb", [1, 2])
def test_each_piece_is_reported_with_every_threads_gradient_in_it(mb):
    m = replace(GPT, tie_embeddings=True)
    x, y = batch(m, 8)
    plain = LocalEngine(build_model(m, seed=5), mb)
    plain.zero_grad()
    plain.forward_backward(x, y)
    final = {id(p): g for p, g in zip(plain.params, grads(plain), strict=True)}
    split = BatchThreadsEngine(build_model(m, seed=5), mb, 2)
    by_id = {id(s): id(p) for s, p in zip(split.params, plain.params, strict=True)}
    seen, order = {}, []

    def ready(params):  # what the data-parallel engine would send now
        order.append([by_id[id(p)] for p in params])
        for p in params:
            seen[by_id[id(p)]] = p.grad.copy()

    plain_order = []
    plain.on_grads_ready = lambda params: plain_order.append([id(p) for p in params])
    plain.zero_grad()
    plain.forward_backward(x, y)
    split.on_grads_ready = ready
    split.zero_grad()
    split.forward_backward(x, y)
    assert order == plain_order  # the same pieces, in the same order
    assert set(seen) == set(final)
    for key, g in seen.items():
        np.testing.assert_allclose(g, final[key], rtol=1e-11, atol=1e-14)
    for p in split.params:  # and nothing was added twice after the hooks
        np.testing.assert_allclose(p.grad, final[by_id[id(p)]], rtol=1e-11, atol=1e-14)


@pytest.mark.parametrize("hooked", [False, True])
def test_a_failing_thread_raises_in_the_caller_and_never_hangs(hooked):
    split = BatchThreadsEngine(build_model(GPT, seed=1), 1, 2)
    if hooked:
        split.on_grads_ready = lambda params: None

    def broken(*args, **kwargs):
        raise FloatingPointError("a replica's block failed")

    split.replicas[0].blocks[1].forward = broken
    outcome = []

    def step():
        try:
            split.forward_backward(*batch(GPT, 4))
        except Exception as e:  # noqa: BLE001 - the test reads it
            outcome.append(e)

    t = threading.Thread(target=step, daemon=True)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "the step hung after a thread failed"
    assert outcome, "the failure was not raised"
    text = f"{outcome[0]!r} {outcome[0].__cause__!r}"
    assert "a replica's block failed" in text


def test_training_with_the_split_follows_the_plain_loss_curve():
    train = TrainConfig(batch_size=6, lr=1e-2, warmup_steps=2, grad_clip=1.0, steps=6)
    rng = np.random.default_rng(0)
    batches = [batch(GPT, 6, seed=int(s)) for s in rng.integers(0, 1000, 6)]
    curves = [train_losses(Config(model=GPT, train=train,
                                  parallel=ParallelConfig(batch_threads=k, microbatches=2)
                                  ).validate(1), MPI.COMM_SELF, batches)
              for k in (1, 2, 3)]
    np.testing.assert_allclose(curves[1], curves[0], rtol=1e-10)
    np.testing.assert_allclose(curves[2], curves[0], rtol=1e-10)
    assert curves[0][-1] < curves[0][0]


def test_zero_splits_where_the_layout_allows_it_and_runs_plain_elsewhere():
    from hpctrain.parallel.batch_threads import threads_for
    from hpctrain.runtime import set_blas_threads

    blas, rows = nn_threads.blas_threads(), nn_threads.threads()
    set_blas_threads(2)
    try:
        auto = ParallelConfig(batch_threads=0)
        whole = Config(model=GPT, parallel=auto, train=TrainConfig(batch_size=4)).validate(1)
        assert threads_for(whole) == 2  # the rank's BLAS threads
        again = Config(model=GPT, parallel=auto,
                       train=TrainConfig(batch_size=4, recompute="full")).validate(1)
        assert threads_for(again) == 1  # accepted, and run plain
        tensor = Config(model=GPT, parallel=replace(auto, tp=2, dp=1),
                        train=TrainConfig(batch_size=4)).validate(2)
        assert threads_for(tensor) == 1
        assert threads_for(replace(whole, parallel=replace(auto, batch_threads=3))) == 3
    finally:
        set_blas_threads(blas)
        nn_threads.set_threads(rows)


@pytest.mark.parametrize("parallel, train, model, says", [
    ({"batch_threads": -1}, {}, GPT, "batch_threads (-1) must not be negative"),
    ({"batch_threads": 2, "tp": 2, "dp": 1}, {}, GPT, "tp (2) must be 1"),
    ({"batch_threads": 2, "pp": 2, "dp": 1}, {}, GPT, "pp (2) must be 1"),
    ({"batch_threads": 2, "zero": 3}, {}, GPT, "zero (3) must be below 3"),
    ({"batch_threads": 2}, {"precision": "bf16"}, replace(GPT, dtype="float32"),
     "precision ('bf16')"),
    ({"batch_threads": 2}, {"recompute": "full"}, GPT, "recompute ('full')"),
    ({"batch_threads": 2}, {}, ModelConfig(kind="cnn", input_dim=784, channels=(4,),
                                           n_classes=10), "does not declare splits_batch"),
])
def test_a_layout_that_cannot_split_is_refused_by_name(parallel, train, model, says):
    cfg = Config(model=model, parallel=ParallelConfig(**parallel),
                 train=TrainConfig(batch_size=8, **train))
    with pytest.raises(ConfigError, match="batch_threads") as err:
        cfg.validate(2 if parallel.get("tp", 1) * parallel.get("pp", 1) > 1
                     or parallel.get("zero") else 1)
    assert says in str(err.value)


def test_a_split_run_resumed_from_its_checkpoint_gives_the_bitwise_losses(tmp_path):
    # the checkpoint holds the model's weights and optimizer state; the replicas hold
    # none of their own, so a resumed run follows the loaded weights exactly
    import shutil

    from hpctrain.config import load
    from hpctrain.testing import tiny_corpus_config, tiny_gpt_template
    from hpctrain.train import train

    path = tiny_corpus_config(tmp_path, tiny_gpt_template(
        train="steps = 6\nbatch_size = 4\nsave_interval = 3",
        parallel="batch_threads = 2"), "the quality of mercy is not strained.", 200)

    def run(run_dir, resume=None):
        cfg = load(path, {"train.run_dir": str(run_dir)}).validate(1)
        return train(cfg, MPI.COMM_SELF, quiet=True, resume=resume).losses

    whole = run(tmp_path / "whole")
    stopped = tmp_path / "resumed" / "checkpoints"
    stopped.mkdir(parents=True)
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "step-000003",
                    stopped / "step-000003")
    (stopped / "latest").write_text("step-000003\n")
    resumed = run(tmp_path / "resumed", resume="auto")
    assert resumed == whole[3:]  # bitwise
    plain = load(path, {"train.run_dir": str(tmp_path / "x")}).validate(1)
    assert plain.parallel.batch_threads == 2
