"""Activation recomputation: trade a second forward for the caches kept until backward.

``[train] recompute`` chooses what a piece keeps between its forward and its backward;
``[train] recompute_pieces`` which pieces (the model's pipeline pieces,
``Model.pipeline_pieces``; empty: every middle piece, the GPT's blocks)::

    "none"       the whole cache (every activation backward reads)
    "full"       the piece's input only; backward runs the piece's forward again from
                 it, then the piece's backward on that fresh cache, and drops it
    "selective"  the whole cache but attention's core: each attention layer keeps
                 the core's inputs q, k, v (and its own input, for qkv's weight
                 gradient) and computes the probabilities P (B, H, T, T) and the
                 weighted sum y = P v (B, T, C) again in backward (Megatron's
                 selective recomputation, arXiv 2205.05198): the large and cheap
                 part, one q k^T product, one softmax and one P v a layer
    "attention"  selective, and q, k, v dropped too: each attention layer keeps only
                 its input (which qkv's weight gradient reads anyway) and runs its
                 qkv product again in backward before the core. Keeps nothing of
                 attention but what its first Linear needs, for one x Wqkv product
                 more a layer (3 C^2 multiply-adds a token)

Pieces are named by their place in the pipeline: ``"first"`` (the GPT's embedding),
``"middle.K"`` (block K), ``"last"`` (the head); ``"middle"`` is every middle piece.

Each is applied to the model's pieces in place (``apply``), after tensor parallelism
has swapped its layers in and before an engine cuts the model into stages, so every
engine and schedule runs them: the local engine through ``model.forward`` and
``model.backward`` (whose ``after_piece`` hook, the overlapped all-reduce, passes
through), the pipeline schedules through ``ModelChunk``, tensor parallelism by
recomputing its forward collectives too (the same calls in the same order on every
rank of the tensor group). Parameter names do not change (no wrapper module), so
checkpoints load with or without recomputation.

Gradients are bitwise those without recomputation: the second forward runs the same
operations on the same inputs. Nothing here may consume random numbers in forward:
hpctrain's layers draw none (no dropout); a layer that did would have to replay its
generator's state here. A layer with running statistics (BatchNorm) would update them
twice: ``apply`` refuses such a piece by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from hpctrain.config import ConfigError

MODES = ("none", "full", "selective", "attention")


class Kept(NamedTuple):
    """What a fully recomputed piece keeps between forward and backward."""

    x: Any  # its input: an activation (B, T, C), or the token ids (B, T) of the first
    args: tuple  # its other forward arguments (the last piece's targets)


# ---------------------------------------------------------------------------------
# which pieces: pure, checked by Config.validate before any collective


def piece_names(n_middle: int) -> list[str]:
    """Every piece's name, in pipeline order."""
    return ["first", *(f"middle.{k}" for k in range(n_middle)), "last"]


def select(names: tuple[str, ...], n_middle: int, model: str = "model") -> list[str]:
    """The pieces ``names`` (``recompute_pieces``) selects; () is every middle piece.

    Raises ConfigError naming a piece that does not exist."""
    known = piece_names(n_middle)
    if not names:
        return known[1:-1]
    chosen = []
    for name in names:
        if name == "middle":
            chosen += known[1:-1]
        elif name in known:
            chosen.append(name)
        else:
            raise ConfigError(
                f"recompute_pieces names {name!r}, but the {model} has no such piece: its "
                f"pieces are 'first', 'middle.0' to 'middle.{n_middle - 1}' (or 'middle', "
                f"all of them) and 'last'")
    return [k for k in known if k in chosen]  # pipeline order, each once


def _pieces_by_name(pieces: Any) -> dict[str, Any]:
    named = {"first": pieces.first, "last": pieces.last}
    named.update({f"middle.{k}": p for k, p in enumerate(pieces.middle)})
    return named


# ---------------------------------------------------------------------------------
# applying it


def apply(model: Any, mode: str, names: tuple[str, ...] = ()) -> list[str]:
    """Make the selected pipeline pieces of ``model`` recompute (in place); return
    their names. ``mode`` "none" leaves the model as it is."""
    if mode not in MODES:
        raise ConfigError(f"recompute ({mode!r}) must be one of {', '.join(MODES)}")
    if mode == "none":
        return []
    pieces = model.pipeline_pieces()
    chosen = select(names, len(pieces.middle), model.name)
    named = _pieces_by_name(pieces)
    attention = 0
    for name in chosen:
        piece = named[name]
        if piece.named_buffers():
            raise ConfigError(f"recompute ({mode!r}) of piece {name!r}: it keeps running "
                             f"statistics {[n for n, _ in piece.named_buffers()]}, which "
                             f"a second forward would update twice")
        if mode == "full":
            recompute_full(piece)
        else:
            attention += recompute_scores(piece, qkv=mode == "attention")
    if mode != "full" and not attention:
        raise ConfigError(f"recompute ({mode!r}) recomputes attention, but pieces "
                         f"{chosen} of the {model.name} hold no attention layer")
    return chosen


def recompute_full(piece: Any) -> None:
    """``piece.forward`` keeps only its input; ``piece.backward`` runs forward again.

    The methods are replaced on the instance (the class's stay): the module tree, its
    parameter names and every caller are unchanged. Extra backward arguments (a
    block's ``after_half`` hook) pass through to the piece's own backward.
    """
    forward: Callable = piece.forward  # the bound originals
    backward: Callable = piece.backward

    def forward_keeping_input(x, *args):
        y, _ = forward(x, *args)  # the cache is dropped here
        return y, Kept(x, args)

    def backward_recomputing(dy, kept: Kept, *args, **kwargs):
        _, cache = forward(kept.x, *kept.args)  # the same operations on the same input
        return backward(dy, cache, *args, **kwargs)

    piece.forward = forward_keeping_input
    piece.backward = backward_recomputing


def recompute_scores(piece: Any, qkv: bool = False) -> int:
    """Every attention layer of ``piece`` drops and recomputes its probabilities and
    their weighted sum (``CausalSelfAttention.recompute_scores``), and with ``qkv`` its
    q, k and v too (``recompute_qkv``); return how many there are."""
    from hpctrain.nn import CausalSelfAttention

    layers = [m for m in _modules(piece) if isinstance(m, CausalSelfAttention)]
    for layer in layers:
        layer.recompute_scores = True
        layer.recompute_qkv = qkv
    return len(layers)


def _modules(module: Any):
    yield module
    for _, child in module._children():
        yield from _modules(child)
