"""The planner against published runs at scale: Megatron-LM on Selene, BLOOM on Jean Zay.

Two tables of Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (SC '21, arXiv 2104.04473), both GPT models with a
vocabulary of 51,200 and sequences of 2,048, on DGX A100 nodes:

* Table 1, weak scaling: ten models from 1.7B to 1T parameters, each with its (t, p),
  GPU count, global batch and achieved teraFLOP/s per GPU;
* Table 2, PTD-P's rows of the comparison with ZeRO-3: the 175B and 530B models at
  three GPU counts each (microbatch 1).

and a second study on the same hardware, Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models" (2022, arXiv 2205.05198), whose
abstract gives two runs of the 530B model on 2,240 A100 GPUs: model FLOPs utilization
54.2% with sequence parallelism and selective recomputation, 42.1% with full
recomputation. Its layout is the 530B model's of both papers (t 8, p 35, so d 8), with
the global batch of 2,240 of the first paper's row on those GPUs, microbatch 1.

And a run on another machine with other software: BLOOM-176B on Jean Zay (48 nodes
of 8 A100 80 GB, NVLink inside a node, 4 Omni-Path links of 100 Gbit/s a node;
``configs/clusters/a100-jean-zay.toml``) with Megatron-DeepSpeed, from its own job
script and log (bigscience-workshop/bigscience, ``train/tr11-176B-ml``): t 4, p 12, d 8,
microbatch 2, global batch 2,048, the vocabulary padded to 250,880, the embedding
counted as a block when the stages are cut (5, 6, ..., 6, 5 blocks: ``balance =
"params"`` cuts the same), full recomputation, bf16 with fp32 master weights and
optimizer state sharded as ZeRO-1, DeepSpeed's pipeline (the whole activation sent by
every tensor rank, no scatter/gather): 104.70 s an iteration, 149.77 TFLOP/s a GPU in
the first paper's count (``Row.software``, ``DEEPSPEED``).

The first paper's rows are typed in from the paper (the stored reference text gave the
README's description of Table 1 but not its numbers); the second study's figures are
its abstract's, BLOOM's its job script's and its log's. Every row goes through the same
``cost.estimate`` on the description of its machine (``Row.cluster``) with the one
``Practice`` of its software (``MEGATRON`` for both Megatron-LM studies, ``DEEPSPEED``
for BLOOM), nothing fitted per row; what a run recomputed, whether it split the
sequence, its microbatch, padded vocabulary, ZeRO stage and stage cut are the run's
own, like its layout.

Published teraFLOP/s are the first paper's model FLOPs (its equation 3, with full
activation recomputation) over the measured time, so the prediction is the same
count over the predicted time::

    F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h))      per step
    predicted TFLOP/s per GPU = F / (predicted step * GPUs)

The second study counts model FLOPs without recomputation, ``72 B s l h^2 (1 + s /
(6 h) + V / (12 l h))`` (the GPT's own ``model_flops``), as a share of the 312
TFLOP/s peak; its rows hold that share times the peak (``Row.counts = "model"``).

What the paper does not give, its repository's scripts for it do (Megatron-LM,
``examples/sc21/run_table_1.sh`` and ``CONFIG.sh``: "scripts that were used to produce
the results in the paper"): Table 1's microbatches (16, 16, 16, 8, 4, 2, 2, 1, 1, 1),
the interleaved schedule for the 76B to 530B models (chunks of 5, 5, 3 and 1 layers:
``Row.chunk_layers``), PyTorch's DDP (25 MB buckets summed during the backward) for
the rows without a pipeline and Megatron's own (the whole gradient buffer summed
after the backward, ``WHOLE_BUCKET_MB``) for the others (``Row.ddp``), fp16, full
recomputation of every layer (``--recompute-method uniform``). Table 2's rows give
microbatch 1 and no schedule: the plain 1F1B. Taken the same for all: fp16 weights,
gradients and messages with fp32 master weights and Adam state; pipeline messages
split over the 8 tensor-parallel ranks' adapters (its scatter/gather optimisation);
fused element-wise kernels.

The descriptions' GEMM efficiency (0.80) was chosen from the A100's published GEMM
rates before any row was compared. ``calibrated`` finds instead the one efficiency at
which a given row is predicted exactly; ``bench_plan.py published`` shows both, the
second calibrated on the least parallel run (``CALIBRATION``) with every other row
predicted from it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hpctrain import config
from hpctrain.config import Config
from hpctrain.plan import cost
from hpctrain.plan import memory as mem
from hpctrain.plan.cluster import Cluster

VOCAB, SEQ = 51200, 2048
CLUSTER = "configs/clusters/a100-selene.toml"
MEGATRON = cost.Practice(element_bytes=2, master_bytes=4, recompute="full",
                         dp_overlap=False, kernels="fused", p2p_scatter_gather=True,
                         keeps_whole_model=False)
# Megatron-DeepSpeed as BLOOM ran it: the same kernels and precision, DeepSpeed's
# pipeline sending each tensor rank's whole activation to the next stage
DEEPSPEED = replace(MEGATRON, p2p_scatter_gather=False)
PRACTICES = {"megatron": MEGATRON, "megatron-deepspeed": DEEPSPEED}
JEAN_ZAY = "configs/clusters/a100-jean-zay.toml"


@dataclass(frozen=True)
class Row:
    """One published run: the model, the layout, the measured throughput."""

    table: str
    billions: float  # parameters, as published
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float  # achieved teraFLOP/s per GPU, counted as ``counts`` says
    recompute: str = "full"  # what the run recomputed (cost.RECOMPUTE)
    sequence_parallel: bool = False
    # "paper": 2104.04473's FLOPs, full recomputation counted (paper_flops); "model":
    # the model's FLOPs without recomputation (2205.05198's utilisation times the peak)
    counts: str = "paper"
    # what the run trained on and with (PRACTICES), its microbatch, vocabulary (padded
    # as the run padded it), ZeRO stage and how its stages were cut
    cluster: str = CLUSTER
    software: str = "megatron"
    microbatch: int = 1
    vocab: int = VOCAB
    zero: int = 0
    balance: str = "layers"
    # the interleaved schedule's model chunk, in layers (Megatron's
    # --num-layers-per-virtual-pipeline-stage); 0: the plain 1F1B schedule
    chunk_layers: int = 0
    # Megatron's --DDP-impl: "local" sums the whole gradient buffer after the backward,
    # "torch" is PyTorch's DDP, 25 MB buckets summed during the backward
    ddp: str = "local"

    @property
    def virtual_stages(self) -> int:
        return self.layers // (self.pp * self.chunk_layers) if self.chunk_layers else 1

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def name(self) -> str:
        extra = (" sp" if self.sequence_parallel else "") + \
            ("" if self.recompute == "full" else f" {self.recompute}")
        return f"{self.billions:g}B t{self.tp} p{self.pp} d{self.dp}{extra}"


def _t1(billions, heads, hidden, layers, tp, pp, gpus, batch, tflops, microbatch,
        chunk_layers=0) -> Row:
    return Row("Table 1", billions, heads, hidden, layers, tp, pp, gpus, batch, tflops,
               microbatch=microbatch, chunk_layers=chunk_layers,
               ddp="torch" if pp == 1 else "local")


def _t2(billions, heads, hidden, layers, tp, pp, gpus, batch, tflops) -> Row:
    return Row("Table 2", billions, heads, hidden, layers, tp, pp, gpus, batch, tflops)


A100_PEAK = 312e12  # dense bf16/fp16 FLOP/s of an A100, the utilisations' denominator


def _mfu(billions, heads, hidden, layers, tp, pp, gpus, batch, utilisation, recompute,
         sequence_parallel) -> Row:
    return Row("2205.05198", billions, heads, hidden, layers, tp, pp, gpus, batch,
               utilisation * A100_PEAK / 1e12, recompute, sequence_parallel, "model")


ROWS = (
    # Table 1: weak scaling (published % of peak: 44 44 46 43 44 45 47 50 52 52), with
    # the microbatch and interleaved chunk of each run's script (run_table_1.sh)
    _t1(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 16),
    _t1(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 16),
    _t1(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 16),
    _t1(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 8),
    _t1(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 4),
    _t1(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 5),
    _t1(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 5),
    _t1(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 3),
    _t1(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 1),
    _t1(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 1),
    # Table 2: PTD-P against ZeRO-3, microbatch 1 (model-parallel size 96 = 8 x 12,
    # 280 = 8 x 35)
    _t2(174.6, 96, 12288, 96, 8, 12, 384, 1536, 153),
    _t2(174.6, 96, 12288, 96, 8, 12, 768, 1536, 149),
    _t2(174.6, 96, 12288, 96, 8, 12, 1536, 1536, 141),
    _t2(529.6, 128, 20480, 105, 8, 35, 560, 2240, 171),
    _t2(529.6, 128, 20480, 105, 8, 35, 1120, 2240, 167),
    _t2(529.6, 128, 20480, 105, 8, 35, 2240, 2240, 159),
    # 2205.05198's abstract: the 530B model on 2,240 GPUs, model FLOPs utilisation with
    # sequence parallelism and selective recomputation, and with full recomputation
    _mfu(529.6, 128, 20480, 105, 8, 35, 2240, 2240, 0.542, "selective", True),
    _mfu(529.6, 128, 20480, 105, 8, 35, 2240, 2240, 0.421, "full", False),
    # BLOOM-176B's log at iteration 85376 (global batch 2048): 104.70 s, 149.77 TFLOPs;
    # 176,247M parameters as published (ALiBi, no position table, vocabulary 250,680)
    Row("BLOOM", 176.2, 112, 14336, 70, 4, 12, 384, 2048, 149.77, cluster=JEAN_ZAY,
        software="megatron-deepspeed", microbatch=2, vocab=250880, zero=1,
        balance="params"),
)


WHOLE_BUCKET_MB = 2.0**20  # a bucket larger than any row's gradients: one all-reduce


TORCH_BUCKET_MB = 25.0  # PyTorch DDP's default bucket (bucket_cap_mb)


def row_config(row: Row) -> Config:
    """The row's GPT (tied embeddings, learned positions, 4h MLP: Megatron's GPT) at
    its layout, microbatch, schedule and gradient buckets, validated by the same rules
    as ``hpctrain train``."""
    raw = {"model": {"kind": "gpt", "n_layer": row.layers, "d_model": row.hidden,
                     "n_head": row.heads, "seq_len": SEQ, "vocab_size": row.vocab,
                     "tie_embeddings": True},
           "parallel": {"dp": row.dp, "tp": row.tp, "pp": row.pp,
                        "microbatches": row.batch // (row.dp * row.microbatch),
                        "schedule": "interleaved" if row.chunk_layers else "1f1b",
                        "virtual_stages": row.virtual_stages,
                        "bucket_mb": TORCH_BUCKET_MB if row.ddp == "torch"
                        else WHOLE_BUCKET_MB,
                        "zero": row.zero, "balance": row.balance,
                        "sequence_parallel": row.sequence_parallel},
           "train": {"batch_size": row.batch}}
    return config.from_dict(raw, source=f"published {row.name}").validate(row.gpus)


def parameters(row: Row) -> int:
    """The row's parameter count, from the planner's own per-piece sizes."""
    m = row_config(row).model
    return sum(mem.rank_param_sizes(m, 1, 1, 1, "layers", 0))


def paper_parameters(row: Row) -> float:
    """The paper's count: ``12 l h^2 (1 + 13 / (12 h) + (V + s) / (12 l h))``."""
    n, h = row.layers, row.hidden
    return 12 * n * h * h * (1 + 13 / (12 * h) + (row.vocab + SEQ) / (12 * n * h))


def paper_flops(row: Row) -> float:
    """FLOPs of one step as the paper counts them (full recomputation included)."""
    n, h = row.layers, row.hidden  # the paper's l and h
    v = row.vocab
    return 96 * row.batch * SEQ * n * h * h * (1 + SEQ / (6 * h) + v / (16 * n * h))


def model_flops(row: Row) -> float:
    """FLOPs of one step without recomputation, 2205.05198's count: ``72 B s l h^2 (1 +
    s / (6 h) + V / (12 l h))``, the GPT's own ``model_flops``."""
    from hpctrain.models.registry import model_class

    return model_class("gpt").model_flops(row_config(row).model, row.batch)


def counted_flops(row: Row) -> float:
    """A step's FLOPs as the row's study counts them (``Row.counts``)."""
    return paper_flops(row) if row.counts == "paper" else model_flops(row)


@dataclass(frozen=True)
class Prediction:
    row: Row
    estimate: cost.Estimate

    @property
    def tflops(self) -> float:
        return counted_flops(self.row) / (self.estimate.step_s * self.row.gpus) / 1e12

    @property
    def error(self) -> float:
        return self.tflops / self.row.tflops - 1


def on_gpus(cluster: Cluster, gpus: int) -> Cluster:
    """The first ``gpus / ranks per node`` nodes of a one-kind cluster."""
    (kind, count), = cluster.nodes
    per = cluster.kinds[kind].cores
    if gpus % per or gpus // per > count:
        raise ValueError(f"{gpus} GPUs must fill whole nodes of {per}, at most {count}")
    return replace(cluster, nodes=((kind, gpus // per),))


def predict(row: Row, cluster: Cluster, practice: cost.Practice | None = None) -> Prediction:
    """The row on its GPUs of ``cluster`` (its description, ``Row.cluster``), with
    ``practice`` (default: its software's), recomputing what the run recomputed."""
    practice = replace(practice or PRACTICES[row.software], recompute=row.recompute,
                       dp_overlap=row.ddp == "torch")
    return Prediction(row, cost.estimate(row_config(row), on_gpus(cluster, row.gpus),
                                         practice=practice))


def with_efficiency(clusters: dict[str, Cluster], efficiency: float) -> dict[str, Cluster]:
    """Every description with ``efficiency`` as each node kind's GEMM efficiency."""
    return {path: replace(c, kinds={n: replace(k, gemm_efficiency=efficiency)
                                    for n, k in c.kinds.items()})
            for path, c in clusters.items()}


def calibrated(row: Row, clusters: dict[str, Cluster], *, low: float = 0.05,
               high: float = 1.0, tolerance: float = 1e-4) -> float:
    """The GEMM efficiency at which ``row`` is predicted at its published throughput
    (bisection: a row's prediction rises with the efficiency)."""
    def error(efficiency: float) -> float:
        return predict(row, with_efficiency(clusters, efficiency)[row.cluster]).error

    if error(low) > 0 or error(high) < 0:
        raise ValueError(f"no GEMM efficiency in [{low}, {high}] predicts {row.table} "
                         f"{row.name} at its published {row.tflops:g} TFLOP/s")
    while high - low > tolerance:
        middle = (low + high) / 2
        low, high = (low, middle) if error(middle) > 0 else (middle, high)
    return (low + high) / 2


# The run a calibration of the GEMM rate reads: the least parallel one (t 1, p 1; its
# predicted step is 98% products, the rest the overlapped data-parallel sum and the
# update), the nearest any published row comes to a measurement of what the software
# computed a second on this hardware
CALIBRATION = ROWS[0]


def report(clusters: dict[str, Cluster], limit: float = 0.15,
           calibration: Row | None = None) -> str:
    """Predicted against published for every row, on the description of its machine
    (``clusters`` by ``Row.cluster``) with its software's practice: the error, and each
    miss's reason. ``calibration``: a row the descriptions' GEMM efficiency was fitted
    to, shown but not counted."""
    head = (f"{'table':<10} {'model':<29} {'GPUs':>5} {'batch':>5} {'pub TF':>6} "
            f"{'pred TF':>7} {'error':>7}  {'step s':>7} {'GiB/GPU':>7}  largest terms")
    lines = [head, "-" * len(head)]
    counted = []
    for row in ROWS:
        p = predict(row, clusters[row.cluster])
        if row is not calibration:
            counted.append((p.error, row))
        top = sorted(p.estimate.shares.items(), key=lambda kv: -kv[1])[:3]
        terms = ", ".join(f"{k} {100 * v:.0f}%" for k, v in top if v > 0.005)
        flag = "  (calibration)" if row is calibration else \
            "" if abs(p.error) <= limit else "  MISS"
        lines.append(f"{row.table:<10} {row.name:<29} {row.gpus:>5} {row.batch:>5} "
                     f"{row.tflops:>6.0f} {p.tflops:>7.1f} {100 * p.error:>+6.1f}%  "
                     f"{p.estimate.step_s:>7.2f} {p.estimate.max_memory / 2**30:>7.1f}  "
                     f"{terms}{flag}")
    errors = sorted(abs(e) for e, _ in counted)
    worst, row = max(counted, key=lambda er: abs(er[0]))
    inside = sum(e <= limit for e in errors)
    lines.append("TF per GPU as each study counts: Tables 1 and 2 (2104.04473) and BLOOM with "
                 "full recomputation's FLOPs, 2205.05198 the model's (its utilisation x 312)")
    lines.append(f"{inside} of {len(counted)} {'other ' if calibration else ''}rows within "
                 f"{100 * limit:.0f}%; median |error| {100 * errors[len(errors) // 2]:.1f}%, "
                 f"worst {100 * worst:+.1f}% ({row.table} {row.name})")
    return "\n".join(lines)
