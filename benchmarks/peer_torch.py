"""The benchmark GPT in PyTorch, written as its users would: the peer of ``bench_peer.py``.

Runs in the peer venv (``make bench-peer`` makes ``.venv-peer``), never in hpctrain's:
it imports only torch, NumPy and the standard library.

    python peer_torch.py train --threads 2 --tokens T.npy --out R.json     serial
    torchrun --standalone --nproc-per-node 2 peer_torch.py train ...        DDP (gloo)
    python peer_torch.py check --npz W.npz       float64: same loss and gradients
    python peer_torch.py probe --shapes S.json   torch's GEMM rate at given shapes

The model is the same function as ``hpctrain.models.gpt.GPT`` (pre-LayerNorm blocks,
biases on every Linear but the head, LayerNorm eps 1e-5 with bias, GELU tanh, untied
embeddings, learned positions), its modules named as hpctrain's parameters, so
``embed.wte.weight`` here is ``embed.wte.weight`` there; a Linear's weight here is
``(out, in)``, hpctrain's ``(in, out)``. The step: AdamW (decay on matrices and
embeddings only, betas 0.9, 0.95), gradient norm clipped to 1, warm-up and cosine
learning rate, as ``hpctrain.train`` does; each step's loss is averaged over the ranks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)  # columns [q | k | v], head by head
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in (q, k, v))  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.fc = nn.Linear(d_model, d_ff)
        self.proj = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, d_ff: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_head)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embed(nn.Module):
    def __init__(self, vocab_size: int, seq_len: int, d_model: int):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))


class Head(nn.Module):
    def __init__(self, d_model: int, vocab_size: int):
        super().__init__()
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


class GPT(nn.Module):
    def __init__(self, *, vocab_size: int, seq_len: int, n_layer: int, n_head: int,
                 d_model: int, init_std: float = 0.02):
        super().__init__()
        self.embed = Embed(vocab_size, seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, 4 * d_model) for _ in range(n_layer))
        self.head = Head(d_model, vocab_size)
        for name, p in self.named_parameters():  # GPT-2's initialisation, as hpctrain's
            if p.dim() == 1:
                nn.init.ones_(p) if ".ln" in name else nn.init.zeros_(p)
            else:
                std = init_std / math.sqrt(2 * n_layer) if name.endswith("proj.weight") \
                    else init_std
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x, targets)


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """hpctrain's schedule (``hpctrain.optim.schedule.lr_at``): linear warm-up, cosine."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if step >= total:
        return min_lr
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * (step - warmup)
                                                          / (total - warmup)))


def adamw(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings, none on biases and gains."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


# ---------------------------------------------------------------------------------
# train: tokens/s, serial or DDP (torchrun sets WORLD_SIZE, RANK, MASTER_ADDR)


def train(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = GPT(vocab_size=args.vocab_size, seq_len=args.seq_len, n_layer=args.n_layer,
                n_head=args.n_head, d_model=args.d_model)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = adamw(model, args.lr, args.weight_decay)
    if args.batch_size % world:
        raise SystemExit(f"batch_size ({args.batch_size}) must divide over {world} ranks")
    B, T = args.batch_size // world, args.seq_len
    tokens = np.load(args.tokens, mmap_mode="r")  # the training stream, uint8
    rng = np.random.default_rng((args.seed, rank))

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        starts = rng.integers(0, len(tokens) - T - 1, size=B)
        window = np.stack([tokens[s:s + T + 1] for s in starts]).astype(np.int64)
        x, y = window[:, :-1].copy(), window[:, 1:].copy()  # (B, T) each, contiguous
        return torch.from_numpy(x), torch.from_numpy(y)

    times, losses = [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        x, y = get_batch()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr=args.lr, min_lr=args.min_lr, warmup=args.warmup_lr,
                                total=args.steps)
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss = loss.detach()
        if world > 1:  # the mean over ranks, as hpctrain logs it
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    if world > 1:
        dist.destroy_process_group()
    if rank != 0:
        return
    step_s = statistics.median(times[args.warmup:])
    result = {"framework": "pytorch", "torch": torch.__version__, "ranks": world,
              "threads": torch.get_num_threads(),
              "interop_threads": torch.get_num_interop_threads(),
              "backend": "gloo" if world > 1 else None,
              "steps": args.steps, "warmup_steps": args.warmup, "step_time_s": step_s,
              "step_times_s": times, "tokens_per_s": args.batch_size * T / step_s,
              "final_loss": losses[-1], "losses": losses}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


# ---------------------------------------------------------------------------------
# check: float64, hpctrain's weights and batch -> loss, gradients, the loss after a step


def check(args: argparse.Namespace) -> int:
    """Compare with what ``bench_peer.py`` computed in hpctrain (the npz): the loss and
    every gradient at the same weights, and the loss after one AdamW step (clipped)."""
    torch.set_default_dtype(torch.float64)
    ref = np.load(args.npz)
    m = json.loads(str(ref["config"]))
    model = GPT(vocab_size=m["vocab_size"], seq_len=m["seq_len"], n_layer=m["n_layer"],
                n_head=m["n_head"], d_model=m["d_model"])
    linear = {f"{name}.weight" for name, mod in model.named_modules()
              if isinstance(mod, nn.Linear)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            w = ref[f"w:{name}"]
            p.copy_(torch.from_numpy(w.T.copy() if name in linear else w))
    x, y = torch.from_numpy(ref["idx"]), torch.from_numpy(ref["targets"])
    loss = model(x, y)
    loss.backward()
    worst = ("", 0.0)
    for name, p in model.named_parameters():
        g = p.grad.numpy()
        g = g.T if name in linear else g
        hp = ref[f"g:{name}"]
        rel = float(np.abs(g - hp).max() / max(np.abs(hp).max(), 1e-300))
        worst = max(worst, (name, rel), key=lambda t: t[1])
    opt = adamw(model, float(ref["lr"]), float(ref["weight_decay"]))
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    with torch.no_grad():
        loss2 = model(x, y)
    loss_diff = abs(loss.item() - float(ref["loss"]))
    loss2_diff = abs(loss2.item() - float(ref["loss_after_step"]))
    ok = loss_diff < args.tol and loss2_diff < args.tol and worst[1] < args.grad_tol
    print(f"float64 check (torch {torch.__version__}), {m['n_layer']} layers, d_model "
          f"{m['d_model']}, batch {tuple(x.shape)}:\n"
          f"  loss          hpctrain {float(ref['loss']):.15f}  pytorch {loss.item():.15f}  "
          f"|diff| {loss_diff:.1e}\n"
          f"  gradients     largest relative difference {worst[1]:.1e} ({worst[0]}; "
          f"max |diff| / max |grad| per parameter)\n"
          f"  after 1 step  hpctrain {float(ref['loss_after_step']):.15f}  pytorch "
          f"{loss2.item():.15f}  |diff| {loss2_diff:.1e}\n"
          f"  {'same function' if ok else 'DIFFERENT'} (tolerances: loss {args.tol:.0e}, "
          f"gradients {args.grad_tol:.0e})")
    return 0 if ok else 1


# ---------------------------------------------------------------------------------
# probe: torch's own GEMM rate at the model's shapes


def probe(args: argparse.Namespace) -> None:
    """Best time of each ``(batch, m, k, n)`` float32 product with ``args.threads``
    threads: a JSON list of seconds, in the order of the shapes file."""
    torch.set_num_threads(args.threads)
    with open(args.shapes) as f:
        shapes = json.load(f)
    best = []
    for batch, m, k, n in shapes:
        a = torch.randn(batch, m, k) if batch > 1 else torch.randn(m, k)
        b = torch.randn(batch, k, n) if batch > 1 else torch.randn(k, n)
        torch.matmul(a, b)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            torch.matmul(a, b)
            times.append(time.perf_counter() - t0)
        best.append(min(times))
    with open(args.out, "w") as f:
        json.dump(best, f)


def smoke() -> int:
    """What ``make bench-peer`` checks after installing: torch imports, trains a tiny GPT
    on the CPU, and has gloo for DDP."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = GPT(vocab_size=16, seq_len=8, n_layer=1, n_head=2, d_model=8)
    opt = adamw(model, 1e-2, 0.1)
    x = torch.randint(0, 16, (2, 8))
    losses = []
    for _ in range(3):
        loss = model(x, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if not (losses[-1] < losses[0] and dist.is_available() and dist.is_gloo_available()):
        print(f"torch {torch.__version__}: losses {losses}, gloo available: "
              f"{dist.is_available() and dist.is_gloo_available()}", file=sys.stderr)
        return 1
    print(f"torch {torch.__version__} trains on the CPU ({torch.get_num_threads()} threads), "
          f"gloo available; CUDA available: {torch.cuda.is_available()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train the GPT, serial or under torchrun (DDP, gloo)")
    t.add_argument("--threads", type=int, required=True, help="torch threads per process")
    t.add_argument("--tokens", required=True, help="the training token stream, .npy uint8")
    t.add_argument("--out", required=True, help="rank 0's figures, JSON")
    t.add_argument("--steps", type=int, default=12)
    t.add_argument("--warmup", type=int, default=2, help="first steps left out of the figures")
    for name, default in (("vocab-size", 256), ("seq-len", 256), ("n-layer", 6),
                          ("n-head", 6), ("d-model", 384), ("batch-size", 8),
                          ("seed", 1234), ("warmup-lr", 2)):
        t.add_argument(f"--{name}", type=int, default=default)
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--min-lr", type=float, default=1e-4)
    t.add_argument("--weight-decay", type=float, default=0.1)
    c = sub.add_parser("check", help="float64: loss and gradients against hpctrain's")
    c.add_argument("--npz", required=True, help="hpctrain's weights, batch, loss, gradients")
    c.add_argument("--tol", type=float, default=1e-10, help="largest |loss difference|")
    c.add_argument("--grad-tol", type=float, default=1e-8,
                   help="largest max |diff| / max |grad| of any parameter")
    p = sub.add_parser("probe", help="torch's float32 GEMM times at the given shapes")
    p.add_argument("--shapes", required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=5)
    sub.add_parser("smoke", help="torch imports, trains a tiny GPT, has gloo (the install)")
    args = parser.parse_args(argv)
    if args.command == "smoke":
        return smoke()
    if args.command == "train":
        train(args)
    elif args.command == "check":
        return check(args)
    else:
        probe(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
