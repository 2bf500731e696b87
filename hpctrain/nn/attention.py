"""Causal multi-head self-attention with a hand-written backward pass.

    qkv = x @ Wqkv + bqkv                      (B, T, 3 H D), columns [q | k | v]
    S   = (q / sqrt(D)) @ k^T  + mask          (B, H, T, T), mask = -inf above diagonal
    P   = softmax(S)  along the last axis
    y   = P @ v                                (B, H, T, D) -> (B, T, H D)
    out = y @ Wproj + bproj                    (B, T, C)

Each of q, k, v is a block of ``H * D`` columns ordered head by head, so head ``h`` of
q is columns ``h*D : (h+1)*D``. The number of heads is ``self.n_head`` and nothing is
derived from ``d_model`` at run time: a tensor-parallel wrapper may swap ``qkv`` and
``proj`` for sharded linears and set ``n_head`` to the local head count.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from hpctrain.nn.kernels import SOFTMAX_BLOCK, kernels
from hpctrain.nn.layers import Linear, LinearCache
from hpctrain.nn.module import Module
from hpctrain.nn.threads import products_over_rows


class AttentionCache(NamedTuple):
    qkv: LinearCache
    q: np.ndarray | None  # (B, H, T, D), already scaled by 1/sqrt(D); views into the
    k: np.ndarray | None  # qkv output (B, H, T, D); None: recomputed from qkv's input
    v: np.ndarray | None  # (B, H, T, D)
    p: np.ndarray | None  # (B, H, T, T) attention probabilities; None: recomputed
    proj: LinearCache | None  # proj's input y (B, T, H D); None: recomputed as P v


class CausalSelfAttention(Module):
    """Batched attention over ``(B, H, T, D)``; no Python loop over batch or heads.

    Backward, with ``dy`` the gradient of ``y = P v`` in ``(B, H, T, D)``:
    ``dv = P^T dy``, ``dP = dy v^T``, ``dS = P * (dP - rowsum(dP * P))``,
    ``dq = dS k / sqrt(D)``, ``dk = dS^T (q / sqrt(D))``.

    ``recompute_scores`` (selective recomputation, ``hpctrain.parallel.recompute``):
    the cache keeps the inputs of the score/softmax/weighted-sum core, q, k and v (the
    qkv output), and the layer's input x (qkv's weight gradient reads it), as
    Megatron's selective recomputation does; it drops ``P`` and the weighted sum
    ``y = P v`` (proj's input). Backward computes both again from the cached (scaled)
    ``q``, ``k`` and ``v`` by the same products and the same softmax, so the gradients
    are bitwise those of the kept arrays. Per token and layer that keeps ``C + 3 C``
    elements instead of ``C + 3 C + H T + C``, for one ``q k^T``, one softmax and one
    ``P v`` again.

    ``recompute_qkv`` (attention recomputation) drops q, k and v too: the cache keeps
    only the layer's input x, which qkv's weight gradient reads anyway, and backward
    runs qkv's local product again (``Linear.again``: no communication, the input a
    tensor-parallel qkv cached is the gathered one) before the core. Per token and
    layer nothing is kept beyond x, for one more ``x Wqkv`` product (3 C^2
    multiply-adds a token: about 8% of a block's forward and backward at T = 256).
    """

    recompute_scores = False  # class defaults; set per instance
    recompute_qkv = False  # (implies recompute_scores)

    def __init__(self, d_model: int, n_head: int, *, rng: np.random.Generator,
                 dtype=np.float32, std: float = 0.02, proj_std: float | None = None):
        if d_model % n_head:
            raise ValueError(f"n_head ({n_head}) must divide d_model ({d_model})")
        self.n_head = n_head
        self.head_dim = d_model // n_head
        self.qkv = Linear(d_model, 3 * d_model, rng=rng, dtype=dtype, std=std)
        self.proj = Linear(d_model, d_model, rng=rng, dtype=dtype,
                           std=std if proj_std is None else proj_std)

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, AttentionCache]:
        # x (B, T, C) -> out (B, T, C)
        B, T, _ = x.shape
        H, D = self.n_head, self.head_dim
        qkv, qkv_cache = self.qkv.forward(x)  # (B, T, 3 H D)
        if qkv.shape[-1] != 3 * H * D:
            raise ValueError(f"qkv width ({qkv.shape[-1]}) must be 3 * n_head * head_dim "
                             f"(3 * {H} * {D})")
        q, k, v = qkv.reshape(B, T, 3, H, D).transpose(2, 0, 3, 1, 4)  # 3 x (B, H, T, D)
        p = np.empty((B, H, T, T), dtype=qkv.dtype)
        y = np.empty((B, T, H, D), dtype=qkv.dtype)
        scale = 1.0 / math.sqrt(D)
        # y (B, H, T, D) is written as (B, T, H, D), the layout proj reads
        products_over_rows(lambda *blocks: _attend(*blocks, scale),
                           q, k, v, p, y.transpose(0, 2, 1, 3))
        out, proj_cache = self.proj.forward(y.reshape(B, T, H * D))  # (B, T, C)
        if self.recompute_qkv:  # attention: q, k, v, P and y are made again in backward
            return out, AttentionCache(qkv_cache, None, None, None, None, None)
        if self.recompute_scores:  # selective: P and y are made again in backward
            return out, AttentionCache(qkv_cache, q, k, v, None, None)
        return out, AttentionCache(qkv_cache, q, k, v, p, proj_cache)

    def backward(self, dout: np.ndarray, cache: AttentionCache) -> np.ndarray:
        # dout (B, T, C) -> dx (B, T, C)
        B, T, _ = dout.shape
        H, D = self.n_head, self.head_dim
        q, k, v, p, proj_cache = cache.q, cache.k, cache.v, cache.p, cache.proj
        if p is None:  # recomputation: P and y again, exactly as forward made them
            again = q is None  # attention recomputation: q, k and v too, unscaled
            if again:
                qkv = self.qkv.again(cache.qkv)  # (B, T, 3 H D)
                q, k, v = qkv.reshape(B, T, 3, H, D).transpose(2, 0, 3, 1, 4)
            p = np.empty((B, H, T, T), dtype=q.dtype)
            y = np.empty((B, T, H, D), dtype=q.dtype)
            scale = 1.0 / math.sqrt(D)
            attend = (lambda *blocks: _attend(*blocks, scale)) if again else _attend_again
            products_over_rows(attend, q, k, v, p, y.transpose(0, 2, 1, 3))
            proj_cache = LinearCache(y.reshape(B, T, H * D))  # what proj.forward kept
        dy = self.proj.backward(dout, proj_cache)  # (B, T, H D)
        dy = dy.reshape(B, T, H, D).transpose(0, 2, 1, 3)  # (B, H, T, D)
        dqkv = np.empty((B, T, 3, H, D), dtype=dout.dtype)
        dq, dk, dv = dqkv.transpose(2, 0, 3, 1, 4)  # 3 x (B, H, T, D), views into dqkv
        scale = 1.0 / math.sqrt(D)
        products_over_rows(lambda *blocks: _attend_backward(*blocks, scale),
                           q, k, v, p, dy, dq, dk, dv)
        return self.qkv.backward(dqkv.reshape(B, T, 3 * H * D), cache.qkv)


def _attend(q, k, v, p, y, scale) -> None:
    # a block of the batch: q, k, v (b, H, T, D) -> p (b, H, T, T), y (b, H, T, D),
    # written in place; q is scaled in place (the cache keeps it scaled)
    q *= scale
    _attend_again(q, k, v, p, y)


def _attend_again(q, k, v, p, y) -> None:
    # a block of the batch: _attend without the scaling (the cached q is scaled already)
    _scores(q, k, p)
    for i0, i1 in _query_blocks(q.shape[-2]):  # y_i = sum_{j <= i} P_ij v_j
        np.matmul(p[..., i0:i1, :i1], v[..., :i1, :], out=y[..., i0:i1, :])


def _scores(q, k, p) -> None:
    # a block of the batch: q (already scaled), k (b, H, T, D) -> p (b, H, T, T) in place;
    # forward and selective recomputation both run this, so P is the same bits. Only
    # the blocks on and below the diagonal are products; the softmax zeroes the rest.
    kt = k.swapaxes(-1, -2)
    for i0, i1 in _query_blocks(q.shape[-2]):
        np.matmul(q[..., i0:i1, :], kt[..., :i1], out=p[..., i0:i1, :i1])
    kernels(p.dtype).causal_softmax(p)


def _attend_backward(q, k, v, p, dy, dq, dk, dv, scale) -> None:
    # a block of the batch: dy (b, H, T, D) -> dq, dk, dv, written in place. P is 0 above
    # the diagonal, so each product runs over the blocks on and below it only: query
    # block i reads keys :i1, key block j is read by queries j0: (_query_blocks).
    T = q.shape[-2]
    pt = p.swapaxes(-1, -2)
    for j0, j1 in _query_blocks(T):  # dv_j = sum_{i >= j} P_ij dy_i
        np.matmul(pt[..., j0:j1, j0:], dy[..., j0:, :], out=dv[..., j0:j1, :])
    softmax_backward = kernels(p.dtype).softmax_backward
    ds = np.empty_like(p)  # dP, then dS; only the blocks on and below the diagonal are set
    vt = v.swapaxes(-1, -2)
    for i0, i1 in _query_blocks(T):
        rows, prob = ds[..., i0:i1, :i1], p[..., i0:i1, :i1]
        np.matmul(dy[..., i0:i1, :], vt[..., :i1], out=rows)  # dP = dy v^T
        softmax_backward(rows, prob)
        np.matmul(rows, k[..., :i1, :], out=dq[..., i0:i1, :])
    dq *= scale
    dst = ds.swapaxes(-1, -2)
    for j0, j1 in _query_blocks(T):  # dk_j = sum_{i >= j} dS_ij q_i (q cached scaled)
        np.matmul(dst[..., j0:j1, j0:], q[..., j0:, :], out=dk[..., j0:j1, :])


ATTENTION_BLOCK = 64  # query (and key) rows per block of attention's products
# the softmax of a block of rows reads the columns its attention block computed
assert ATTENTION_BLOCK % SOFTMAX_BLOCK == 0


def _query_blocks(T: int) -> list[tuple[int, int]]:
    """[(i0, i1)]: the blocks of ``ATTENTION_BLOCK`` rows that cover 0..T."""
    return [(i0, min(i0 + ATTENTION_BLOCK, T)) for i0 in range(0, T, ATTENTION_BLOCK)]
