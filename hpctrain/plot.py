"""PNG pictures of a run: loss curves from metrics.jsonl, and the pipeline schedule as it
ran, from a Chrome trace written by ``hpctrain train --trace``.

matplotlib is an optional extra (``pip install 'hpctrain[plot]'``) and is imported
only inside the drawing functions, so importing this module costs nothing; the span
extraction (``pipeline_spans``, ``trace_steps``) is pure and needs no matplotlib.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpctrain.trace import TRACE_FORMAT


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("hpctrain plot needs matplotlib: pip install 'hpctrain[plot]'") \
            from None
    matplotlib.use("Agg")  # files only, no screen
    import matplotlib.pyplot as plt

    return plt


def plot_losses(records: list[dict[str, Any]], out_path: str | Path,
                title: str | None = None, tokens: bool = True) -> Path:
    """Training loss (raw and smoothed) and validation loss against the step; below
    it the throughput, if the records carry it (``tokens``: a model of token sequences,
    whose loss and throughput are per token; else per sample). A value that is not a
    number is a ValueError naming its record and field."""
    for i, r in enumerate(records, 1):
        if "step" not in r and any(k in r for k in ("loss", "val_loss", "tokens_per_s")):
            raise ValueError(f"record {i} has a loss or a throughput but no step; remove "
                             f"or repair that record's line")
        for key in ("step", "loss", "val_loss", "tokens_per_s"):
            value = r.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"record {i}: {key} ({value!r}) must be a number; remove "
                                 f"or repair that record's line")
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if not train and not val:
        raise ValueError("no record has a loss or a val_loss")
    speed = [(r["step"], r["tokens_per_s"]) for r in records if "tokens_per_s" in r]
    plt = _pyplot()
    rows = 2 if speed else 1
    fig, axes = plt.subplots(rows, 1, figsize=(8, 3.2 * rows + 1), squeeze=False,
                             sharex=True)
    ax = axes[0][0]
    if train:
        steps, losses = zip(*train, strict=True)
        ax.plot(steps, losses, lw=0.6, alpha=0.45, color="tab:blue", label="train")
        w = max(1, len(losses) // 50)
        smooth = [sum(losses[max(0, i - w + 1):i + 1]) / len(losses[max(0, i - w + 1):i + 1])
                  for i in range(len(losses))]
        ax.plot(steps, smooth, lw=1.6, color="tab:blue", label=f"train, mean of {w}")
    if val:
        ax.plot(*zip(*val, strict=True), "o-", color="tab:orange", ms=4, label="validation")
    ax.set_ylabel("loss (nats per token)" if tokens else "loss")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title or "loss")
    if speed:
        ax2 = axes[1][0]
        ax2.plot(*zip(*speed, strict=True), lw=0.8, color="tab:green")
        ax2.set_ylabel("tokens / s" if tokens else "samples / s")
        ax2.grid(alpha=0.3)
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    return _save(fig, plt, out_path)


def trace_steps(trace: dict) -> list[int]:
    """The training steps that have spans in the trace, ascending."""
    return sorted({e["args"]["step"] for e in _spans(trace) if "step" in e.get("args", {})})


def pipeline_spans(trace: dict, step: int) -> dict[int, list[tuple[float, float, str, int, int]]]:
    """Per rank, the (start ms, end ms, "F" or "B", microbatch, chunk) of each compute
    span of ``step``, times from the step's earliest span over all ranks."""
    steps = trace_steps(trace)
    if not steps:
        raise ValueError("the trace has no spans of a training step")
    if step not in steps:
        raise ValueError(f"step {step} is not in the trace (steps {steps[0]}..{steps[-1]})")
    events = [e for e in _spans(trace) if e.get("args", {}).get("step") == step]
    origin = min(e["ts"] for e in events)
    out: dict[int, list] = {}
    for e in events:
        if e.get("cat") == "compute" and e["tid"] == 0:
            start = (e["ts"] - origin) / 1e3
            out.setdefault(e["pid"], []).append((start, start + e["dur"] / 1e3, e["name"],
                                                 e["args"].get("mb", 0),
                                                 e["args"].get("chunk", 0)))
    if not out:
        raise ValueError(f"step {step} has no compute spans")
    return {rank: sorted(spans) for rank, spans in sorted(out.items())}


def plot_pipeline(trace: dict, out_path: str | Path, step: int | None = None) -> Path:
    """One row per rank: forward and backward boxes labelled by microbatch (hatched
    on odd virtual stages), pipeline waits in grey, tensor-parallel collectives in
    red, for one step (default the last), with the measured idle fraction (1 - compute
    time / step time, mean over ranks) in the title."""
    _check_format(trace)
    step = trace_steps(trace)[-1] if step is None and trace_steps(trace) else step
    compute = pipeline_spans(trace, step)
    events = [e for e in _spans(trace) if e.get("args", {}).get("step") == step]
    origin = min(e["ts"] for e in events)
    other = trace.get("otherData", {})
    pp = max(1, int(other.get("pp", 1)))  # model chunk k is virtual stage k // pp
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    ranks = sorted({e["pid"] for e in events})
    steps = {e["pid"]: e["dur"] / 1e3 for e in events if e["name"] == "step"}
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 0.7 * len(ranks) + 1.8))
    colours = {"F": "tab:blue", "B": "tab:orange"}
    for row, rank in enumerate(ranks):
        y = len(ranks) - 1 - row
        for e in events:
            if e["pid"] != rank or e["tid"] != 0 or e.get("cat") not in ("pp_wait", "tp_comm"):
                continue
            colour = "lightgrey" if e["cat"] == "pp_wait" else "tab:red"
            ax.barh(y - 0.3, e["dur"] / 1e3, left=(e["ts"] - origin) / 1e3, height=0.12,
                    color=colour, align="edge")
        for start, end, name, mb, chunk in compute.get(rank, []):
            ax.barh(y, end - start, left=start, height=0.5, color=colours.get(name, "grey"),
                    edgecolor="black", lw=0.5, hatch="//" if (chunk // pp) % 2 else None,
                    alpha=0.95 if name == "F" else 0.85)
            ax.text((start + end) / 2, y, str(mb), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(ranks)), [names.get(r, f"rank {r}") for r in reversed(ranks)])
    ax.set_xlabel(f"ms since the start of step {step}")
    busy = [sum(e - s for s, e, *_ in compute.get(r, [])) for r in ranks]
    bubble = sum(1 - b / steps[r] for b, r in zip(busy, ranks, strict=True) if steps.get(r)) \
        / max(1, sum(1 for r in ranks if steps.get(r)))
    ax.set_title(f"step {step}, schedule {other.get('schedule', '?')}, "
                 f"{other.get('microbatches', '?')} microbatches: idle {bubble:.0%} of the step")
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color="tab:blue", label="forward"),
                       Patch(color="tab:orange", label="backward"),
                       Patch(color="lightgrey", label="pipeline wait"),
                       Patch(color="tab:red", label="tensor-parallel collective")],
              loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=4, fontsize=8)
    fig.tight_layout()
    return _save(fig, plt, out_path)


def _check_format(trace: dict) -> None:
    fmt = trace.get("otherData", {}).get("format") if isinstance(trace, dict) else None
    if fmt != TRACE_FORMAT:
        raise ValueError(f"trace format {fmt!r} is not {TRACE_FORMAT!r}")


def _spans(trace: dict) -> list[dict]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]


def _save(fig, plt, out_path: str | Path) -> Path:
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
