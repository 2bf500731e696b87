"""Local-loss pipeline training under MPI (``hpctrain.parallel.local_loss``): at pp = 2
and 4 (dp what remains of the world) it follows a serial run of the same local-loss
objective (``LocalLossReference`` on one rank) in float64, losses and every
parameter, auxiliary heads included, for the MLP, the GPT and the CNN (pieces of
differing shapes, BatchNorm over each microbatch); a checkpoint resumes it bitwise."""

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.checkpoint.state import held_tensors
from hpctrain.checkpoint.training import load_training, save_training
from hpctrain.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hpctrain.models.build import build_model
from hpctrain.parallel.data import DataParallel
from hpctrain.parallel.engine import build_engine
from hpctrain.parallel.local_loss import LocalLossEngine, LocalLossReference
from hpctrain.parallel.topology import Topology
from hpctrain.testing import assert_all, assert_close_all
from hpctrain.train import make_data_parallel, make_optimizer, train_step

WORLD = MPI.COMM_WORLD
MLP = ModelConfig(kind="mlp", dtype="float64", input_dim=12, hidden=(8, 8, 8, 8, 8),
                  n_classes=5)
# the GPT with its token table tied: the first stage's local loss and the last stage's
# loss both reach it, summed between the two stages as under backprop
GPT = ModelConfig(kind="gpt", dtype="float64", vocab_size=16, seq_len=4, n_layer=4, n_head=2,
                  d_model=8, tie_embeddings=True)
# 8 x 8 images: four conv pieces (2, 2, 3, 3 channels; sides 8, 4, 4, 2) for pp up to 4
CNN = ModelConfig(kind="cnn", dtype="float64", input_dim=64, channels=(2, 3), n_classes=5)
BATCH, STEPS, SAVE_AT = 16, 4, 2


def config(size, pp, model=MLP):
    """Validated for ``size`` ranks; as written (the serial reference's) for None."""
    par = ParallelConfig(pp=pp, pipeline_training="local", microbatches=4, balance="params")
    cfg = Config(model=model, parallel=par,
                 train=TrainConfig(steps=STEPS, batch_size=BATCH, lr=1e-2, warmup_steps=1,
                                   grad_clip=0.5, keep_checkpoints=2))
    return cfg if size is None else cfg.validate(size)


def batches(model=MLP):
    r = np.random.default_rng(11)
    if model.kind == "gpt":
        shape = (BATCH, model.seq_len)
        return [(r.integers(0, model.vocab_size, shape), r.integers(0, model.vocab_size, shape))
                for _ in range(STEPS)]
    return [(r.random((BATCH, model.input_dim)), r.integers(0, model.n_classes, BATCH))
            for _ in range(STEPS)]


def as_dp(x, dp, m):
    """The batch reordered so that serial microbatch i holds every dp rank's microbatch
    i (BatchNorm's statistics are those of the microbatch over the data group)."""
    return x.reshape(dp, m, -1, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)


class Run:
    """A training run of ``cfg`` on ``comm`` a step at a time, or the serial reference
    of its local-loss objective (``reference``)."""

    def __init__(self, cfg, comm, reference: bool = False):
        self.cfg, self.topo = cfg, None if reference else Topology.build(comm, cfg.parallel)
        if reference:
            model = build_model(cfg.model, cfg.train.seed)
            self.engine = LocalLossReference(model, cfg, cfg.parallel.pp)
            self.dp = DataParallel(self.engine, make_optimizer(cfg, self.engine.named_params),
                                   MPI.COMM_SELF, bucket_mb=4.0)
        else:
            self.engine = build_engine(cfg, self.topo)
            self.dp = make_data_parallel(cfg, self.engine, self.topo)
        self.done, self.dp_size = 0, (1 if reference else self.topo.dp_size)
        self.dp_rank = 0 if reference else self.topo.dp_rank

    def steps(self, data, until):
        losses = []
        while self.done < until:
            x, y = data[self.done]
            b = len(x) // self.dp_size
            rows = slice(self.dp_rank * b, (self.dp_rank + 1) * b)
            loss, _ = train_step(self.engine, self.dp, x[rows], y[rows], lr=1e-2,
                                 grad_clip=self.cfg.train.grad_clip)
            losses.append(loss)
            self.done += 1
        return losses

    def params(self):
        """Every parameter of the whole replica by name, gathered over the world."""
        mine = {n: p.data.copy() for n, p in self.engine.named_params}
        every = {}
        for part in self.topo.world_comm.allgather(mine):
            every.update(part)
        return every


@pytest.mark.mpi
@pytest.mark.parametrize("pp, model", [(2, MLP), (4, MLP), (2, GPT), (4, GPT), (2, CNN),
                                       (4, CNN)],
                         ids=["mlp-pp2", "mlp-pp4", "gpt-pp2", "gpt-pp4", "cnn-pp2", "cnn-pp4"])
def test_local_loss_training_is_the_serial_local_loss_objective(comm, pp, model):
    size = comm.Get_size()
    if size % pp:
        pytest.skip(f"pp ({pp}) does not divide {size} ranks")
    data = batches(model)
    serial = Run(config(None, pp, model), MPI.COMM_SELF, reference=True)
    m = config(None, pp, model).parallel.microbatches
    want = serial.steps([(as_dp(x, size // pp, m), as_dp(y, size // pp, m)) for x, y in data],
                        STEPS)
    run = Run(config(size, pp, model), comm)
    assert_all(comm, isinstance(run.engine, LocalLossEngine), "the local-loss engine is built")
    got = run.steps(data, STEPS)
    what = f"{model.kind} local loss at pp={pp} dp={size // pp}"
    assert_close_all(comm, np.array(got), np.array(want), rtol=1e-10, atol=1e-12,
                     what=f"{what}: losses")
    params, ref = run.params(), dict(serial.engine.named_params)
    assert_all(comm, sorted(params) == sorted(ref),
               f"{what}: parameter names {sorted(params)} vs {sorted(ref)}")
    heads = [n for n in params if n.startswith("aux_heads.")]
    per_head = 3 if model.kind == "gpt" else 2  # LayerNorm's two, lm_head; weight, bias
    assert_all(comm, len(heads) == per_head * (pp - 1),
               f"{what}: one head per stage but the last ({heads})")
    for name in sorted(params):
        assert_close_all(comm, params[name], ref[name].data, rtol=1e-10, atol=1e-12,
                         what=f"{what}: {name}")
    locals_ = run.engine.metrics()["local_losses"]
    assert_close_all(comm, np.array(locals_), np.array(serial.engine.local_losses),
                     rtol=1e-10, atol=1e-12, what=f"{what}: every stage's local loss")
    # the stages learnt different things than backprop would have: heads mattered
    assert_all(comm, not np.allclose(locals_[:-1], locals_[-1]), f"{what}: local losses differ")
    run.topo.free()


@pytest.fixture(scope="module")
def shared_dir():
    """One temporary folder, the same on every rank."""
    path = WORLD.bcast(tempfile.mkdtemp(prefix="hpctrain-local-") if WORLD.Get_rank() == 0
                       else None)
    yield Path(path)
    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def held(run):
    return {h.name: h.array.copy() for h in held_tensors(run.engine, run.dp,
                                                          run.topo.tp_rank, run.topo.tp_size)}


@pytest.mark.mpi
def test_checkpoint_and_resume_are_bitwise(comm, shared_dir):
    size = comm.Get_size()
    pp = 4 if size % 4 == 0 else 2
    cfg, data = config(size, pp), batches()
    first = Run(cfg, comm)
    first.steps(data, SAVE_AT)
    path = save_training(cfg, first.topo, first.engine, first.dp, step=SAVE_AT,
                         loader_state=None, root=shared_dir / f"pp{pp}")
    saved = held(first)
    assert_all(comm, any("aux_heads." in n for n in saved) or
               first.topo.pp_rank == pp - 1, "a stage's head and its state are saved")
    want = first.steps(data, STEPS)
    want_params = first.params()
    first.topo.free()

    second = Run(cfg, comm)
    second.done = load_training(path, cfg, second.topo, second.engine, second.dp).step
    loaded = held(second)
    same = saved.keys() == loaded.keys() and all(np.array_equal(saved[k], loaded[k])
                                                 for k in saved)
    assert_all(comm, same, f"pp={pp}: every held array (heads, optimizer state) bitwise")
    got = second.steps(data, STEPS)
    got_params = second.params()
    second.topo.free()
    assert_all(comm, got == want, f"pp={pp}: losses after resuming {got} vs {want}")
    assert_all(comm, all(np.array_equal(got_params[k], want_params[k]) for k in want_params),
               f"pp={pp}: parameters after resuming bitwise")
