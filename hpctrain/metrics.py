"""Per-step metrics: one JSON object a line in ``RUN_DIR/metrics.jsonl``, and a
readable progress line. Only the rank that owns the writer (rank 0) touches files."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from hpctrain.data.format import DataError


class MetricsWriter:
    """Appends metrics records to ``run_dir/metrics.jsonl`` and prints progress."""

    def __init__(self, run_dir: str | Path, *, stream: TextIO | None = None,
                 resume_after: int | None = None, evaluates_again: bool = False):
        """A new file, or with ``resume_after`` the old one minus records of later steps
        (a run resumed from step N's checkpoint redoes the steps after N); with
        ``evaluates_again`` (a resume with no step left, which evaluates step N's
        checkpoint) minus an earlier such evaluation's record of step N too, which
        each rerun added again."""
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._stream = stream if stream is not None else sys.stdout
        if resume_after is not None and self.path.exists():
            records, cut = read_records(self.path)
            kept = [r for r in records if r["step"] < resume_after or (
                r["step"] == resume_after and not (evaluates_again and "loss" not in r))]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
            tmp.replace(self.path)
            if cut:
                self.say(f"{self.path}: its last line was cut off mid-record (the run "
                         f"stopped while writing it): dropped")
        self._file = self.path.open("w" if resume_after is None else "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()

    def say(self, text: str) -> None:
        print(text, file=self._stream, flush=True)

    def close(self) -> None:
        self._file.close()


def keep_earlier(run_dir: str | Path) -> list[Path]:
    """Before a fresh run writes ``run_dir``'s ``metrics.jsonl`` and ``config.json``:
    an earlier run's non-empty metrics file and its config are renamed to
    ``metrics.<k>.jsonl`` and ``config.<k>.json`` (the first k from 1 free for both),
    so a second run into one folder replaces neither. Returns the new names (none: no
    earlier records)."""
    run_dir = Path(run_dir)
    metrics, config = run_dir / "metrics.jsonl", run_dir / "config.json"
    if not (metrics.is_file() and metrics.stat().st_size):
        return []
    k = next(k for k in itertools.count(1)
             if not (run_dir / f"metrics.{k}.jsonl").exists()
             and not (run_dir / f"config.{k}.json").exists())
    kept = []
    for old, new in ((metrics, run_dir / f"metrics.{k}.jsonl"),
                     (config, run_dir / f"config.{k}.json")):
        if old.is_file():
            old.rename(new)
            kept.append(new)
    return kept


def progress_line(rec: dict[str, Any], total_steps: int, unit: str = "tok/s") -> str:
    """``step   10/200 | loss 3.1416 | val 3.2000 | lr 1.00e-03 | ...``; ``unit`` names
    ``tokens_per_s`` as printed: "tok/s", or "samp/s" for a model without tokens."""
    width = len(str(total_steps))
    parts = [f"step {rec['step']:{width}d}/{total_steps}", f"loss {rec['loss']:.4f}"]
    if "val_loss" in rec:
        parts.append(f"val {rec['val_loss']:.4f}")
    if "val_accuracy" in rec:
        parts.append(f"acc {rec['val_accuracy']:.4f}")
    parts += [f"{key[4:].replace('_', ' ')} {value:.4f}" for key, value in rec.items()
              if key.startswith("val_dice_")]  # "dice 1 0.8123": the model's classes
    parts += [f"lr {rec['lr']:.2e}", f"gnorm {rec['grad_norm']:.3f}",
              f"{rec['tokens_per_s']:,.0f} {unit}", f"{rec['step_time_s'] * 1e3:.0f} ms/step"]
    return " | ".join(parts)


class MetricsError(DataError):
    """A metrics file holds a line that is not a JSON record; the message names it."""


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics file, in order (for tests, plots and resume checks); a
    last line cut off mid-record (no newline: the run stopped while writing it) is left
    out, any other line that is not a JSON object is a ``MetricsError``."""
    return read_records(path)[0]


def read_records(path: str | Path) -> tuple[list[dict[str, Any]], bool]:
    """``read_metrics``'s records, and whether a cut-off last line was left out."""
    path = Path(path)
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")  # the last item: what follows the last newline
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):  # no newline after it: a write cut short
                return records, True
            raise MetricsError(f"{path}, line {number}: not a JSON record ({err}); remove "
                               f"or repair that line") from None
        if not isinstance(record, dict):
            raise MetricsError(f"{path}, line {number}: a JSON {type(record).__name__}, "
                               f"not a record (an object); remove or repair that line")
        records.append(record)
    return records, False
