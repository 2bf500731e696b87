"""The model protocol without mpiexec: a third model, registered here, runs through the
engine that never heard of it (pipeline pieces, tensor plan, overlapped backward,
model FLOPs); unknown kinds and foreign keys are refused by validation, before any
collective; and ``hpctrain.parallel`` imports no model."""

import ast
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI
from toy_model import TOY, ToyLM, register

import hpctrain.parallel
from hpctrain.bench import model_flops
from hpctrain.config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.models.build import build_model
from hpctrain.parallel import stages
from hpctrain.parallel.engine import LocalEngine, build_engine
from hpctrain.parallel.pipeline import PipelineEngine
from hpctrain.parallel.tensor import apply_tensor_parallel
from hpctrain.parallel.topology import Topology
from hpctrain.testing import train_losses


@pytest.fixture(autouse=True)
def toy(monkeypatch):
    register(monkeypatch)


def config(**parallel):
    return Config(model=TOY, parallel=ParallelConfig(**parallel),
                  train=TrainConfig(steps=4, batch_size=8, lr=1e-2, warmup_steps=1,
                                    grad_clip=0.5)).validate(1)


def batches(n=4, b=8):
    rng = np.random.default_rng(0)
    return [(x, (x + 1) % TOY.vocab_size)
            for x in (rng.integers(0, TOY.vocab_size, (b, TOY.seq_len)) for _ in range(n))]


def test_the_registry_builds_the_toy_and_the_serial_loop_trains_it():
    assert isinstance(build_model(TOY, 0), ToyLM)
    losses = train_losses(config(microbatches=2), MPI.COMM_SELF, batches(), steps=8)
    assert losses[-1] < losses[0]


def test_its_pipeline_engine_at_pp1_and_its_tensor_plan_at_tp1_equal_the_local_engine():
    cfg = config(microbatches=4, schedule="gpipe")
    topo = Topology.build(MPI.COMM_SELF, cfg.parallel)
    local = LocalEngine(ToyLM(TOY, 1), 4)
    piped = PipelineEngine(ToyLM(TOY, 1), cfg, topo)
    split = LocalEngine(apply_tensor_parallel(ToyLM(TOY, 1), cfg, MPI.COMM_SELF), 4)
    x, y = batches()[0]
    for engine in (local, piped, split):
        engine.zero_grad()
    ref = local.forward_backward(x, y)
    assert piped.forward_backward(x, y) == pytest.approx(ref, rel=1e-12)
    assert split.forward_backward(x, y) == ref
    for engine in (piped, split):
        for (name, a), (_, b) in zip(local.named_params, engine.named_params, strict=True):
            np.testing.assert_allclose(b.grad, a.grad, rtol=1e-12, atol=1e-15, err_msg=name)
    topo.free()


def test_chunks_cut_by_its_declared_costs_chain_to_the_whole_model():
    specs = stages.plan(ToyLM.piece_costs(TOY), 2, balance="params")
    assert [len(s.blocks) for s in specs] == [2, 2]
    whole, cut = ToyLM(TOY, 3), ToyLM(TOY, 3)
    x, y = batches()[0]
    loss, cache = whole.forward(x, y)
    whole.backward(cache, dloss=0.5)
    chunks = [stages.ModelChunk(s, cut) for s in stages.plan(TOY, 3)]
    out, caches = x, []
    for chunk in chunks:
        out, c = chunk.forward(out, y)
        caches.append(c)
    assert out == loss
    d = 0.5
    for chunk, c in zip(reversed(chunks), reversed(caches), strict=True):
        d = chunk.backward(d, c)
    for (name, a), (_, b) in zip(whole.named_parameters(), cut.named_parameters(), strict=True):
        np.testing.assert_allclose(b.grad, a.grad, rtol=1e-12, atol=1e-15, err_msg=name)


def test_overlapped_backward_reports_every_parameter_once_in_its_declared_order():
    cfg = config()
    topo = Topology.build(MPI.COMM_SELF, cfg.parallel)
    engine = build_engine(cfg, topo)
    seen = []
    engine.on_grads_ready = seen.extend
    engine.forward_backward(*batches()[0])
    assert [id(p) for p in seen] == [id(p) for piece in engine.model.backward_pieces()
                                     for p in piece]
    assert sorted(map(id, seen)) == sorted(map(id, engine.params))
    topo.free()


def test_model_flops_are_the_models_declaration():
    assert model_flops(TOY, 3) == ToyLM.model_flops(TOY, 3) > 0


@pytest.mark.parametrize("model, parallel, world, message", [
    (ModelConfig(kind="resnet"), {}, 1,
     r"model kind \('resnet'\) must be one of gpt, mlp, cnn, seg3d, dlrm, toy"),
    (ModelConfig(kind="mlp", n_head=8), {}, 1,
     r"\[model\] key\(s\) \['n_head'\] are not read by model kind 'mlp' \(the MLP "
     r"classifier\); its keys: \['dtype', 'hidden', 'init_std', 'input_dim', 'kind', "
     r"'n_classes'\]"),
    (replace(TOY, hidden=(3,)), {}, 1, r"\['hidden'\] are not read by model kind 'toy'"),
    (TOY, {"tp": 2, "sequence_parallel": True}, 2,
     r"the toy residual MLP declares no tensor-parallel plan: tp \(2\) must be 1"),
    (ModelConfig(kind="cnn"), {"pp": 8}, 8,
     r"\(8 \* 1 = 8\) must not exceed the 4 middle pipeline pieces of the CNN classifier"),
    (ModelConfig(kind="mlp"), {"pp": 2}, 2,
     r"\(2 \* 1 = 2\) must not exceed the 1 middle pipeline pieces of the MLP classifier"),
    (TOY, {"pp": 2, "virtual_stages": 4, "schedule": "interleaved", "microbatches": 2}, 2,
     r"\(2 \* 4 = 8\) must not exceed the 4 middle pipeline pieces of the toy"),
])
def test_validation_refuses_what_the_model_does_not_declare(model, parallel, world, message):
    with pytest.raises(ConfigError, match=message):
        Config(model=model, parallel=ParallelConfig(**parallel)).validate(world)


def test_an_unregistered_kind_stops_the_engine_before_any_collective():
    cfg = Config(model=ModelConfig(kind="resnet"))
    topo = Topology.build(MPI.COMM_SELF, ParallelConfig(dp=1))
    with pytest.raises(ConfigError, match=r"model kind \('resnet'\) must be one of"):
        build_engine(cfg, topo)
    topo.free()


def test_the_parallel_package_imports_no_model():
    """Only the protocol, the registry and build_model; ``tensor_gpt`` is the old name of
    the GPT's plan, kept as a re-export for the code that imports it from there."""
    allowed = {"hpctrain.models.protocol", "hpctrain.models.registry",
               "hpctrain.models.build"}
    for path in sorted(Path(hpctrain.parallel.__file__).parent.glob("*.py")):
        if path.name == "tensor_gpt.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith("hpctrain.models") or name in allowed, \
                    f"{path.name} imports {name}"
