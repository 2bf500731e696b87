"""``hpctrain ckpt``: look into, check and convert checkpoints (serial, no MPI).

A CHECKPOINT argument is a run folder (its ``checkpoints/latest``), a checkpoints
folder (its ``latest``), a step folder (``step-000120``) or a consolidated file.
Problems are printed one a line, each naming the file and the tensor; the exit
status is then 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from hpctrain.runtime import EXIT_USER_ERROR


def _fail(messages: list[str]) -> None:
    for message in messages:
        click.echo(f"error: {message}", err=True)
    sys.exit(EXIT_USER_ERROR)


def _not_hdf5(path: str) -> bool:
    """Whether ``path`` is a file without HDF5's signature (``h5py.is_hdf5``, which a
    truncated or locked HDF5 file passes): no checkpoint at all (``metrics.jsonl``),
    rather than a damaged one."""
    import h5py

    from hpctrain.checkpoint.format import LATEST_NAME

    file = Path(path)
    if not file.is_file() or file.name == LATEST_NAME:  # the pointer is text: followed
        return False
    return not h5py.is_hdf5(file)


def _open_error(path: str, err: Exception) -> str:
    """The message of a checkpoint that failed to open: for a file that is not HDF5 at
    all, what a CHECKPOINT argument is instead of the reader's remedy (load an earlier
    checkpoint), which is for a damaged one."""
    if _not_hdf5(path):
        return (f"{path}: not an hpctrain checkpoint (not an HDF5 file); give a run folder, "
                f"a checkpoints folder, a step folder or a consolidated .h5 file")
    return str(err)


def _opened(path: str):
    from hpctrain.checkpoint import Checkpoint, CheckpointError

    try:
        return Checkpoint(path)
    except CheckpointError as err:
        _fail([_open_error(path, err)])


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def ckpt() -> None:
    """Inspect, verify and convert checkpoints.

    \b
    Examples:
      hpctrain ckpt inspect runs/gpt-shakespeare
      hpctrain ckpt verify runs/gpt-shakespeare/checkpoints/step-000200
      hpctrain ckpt convert runs/gpt-shakespeare --output gpt-200.h5
    """


@ckpt.command()
@click.argument("checkpoint", type=click.Path(exists=True))
@click.option("--tensors/--no-tensors", default=True, show_default=True,
              help="List every tensor with its global shape and pieces.")
@click.option("--json", "as_json", is_flag=True, help="Print the metadata as JSON instead.")
def inspect(checkpoint: str, tensors: bool, as_json: bool) -> None:
    """Show a checkpoint's step, layout, metadata and tensors (reads no tensor data).

    \b
    Examples:
      hpctrain ckpt inspect runs/demo
      hpctrain ckpt inspect runs/demo/checkpoints/step-000050 --no-tensors
      hpctrain ckpt inspect gpt-200.h5 --json
    """
    import numpy as np

    with _opened(checkpoint) as ck:
        idx = ck.index
        if as_json:
            click.echo(json.dumps({"path": str(idx.path), "step": idx.step, **idx.meta,
                                   "files": idx.files}, indent=2))
            return
        nbytes = sum(int(np.prod(t.global_shape)) * np.dtype(t.dtype).itemsize
                     for t in ck.tensors.values())
        layout = idx.meta.get("layout") or {}
        click.echo(f"checkpoint {idx.path}")
        click.echo(f"  step {idx.step}, {len(ck.tensors)} tensors, {nbytes / 2**20:.2f} MiB "
                   f"in {len(idx.files)} file(s)")
        click.echo("  saved at " + " ".join(f"{k}={layout[k]}" for k in
                                             ("world_size", "dp", "tp", "pp", "sp", "zero")
                                             if k in layout and (k != "sp" or layout[k] > 1)))
        click.echo(f"  optimizer {json.dumps(idx.meta.get('optimizer'))}")
        click.echo(f"  schedule {json.dumps(idx.meta.get('schedule'))}")
        if idx.meta.get("precision") is not None:  # the stored tensors' dtypes are below
            click.echo(f"  precision {json.dumps(idx.meta['precision'])}")
        for key in ("averaging", "shares"):  # what a resume must match, or takes back
            if idx.meta.get(key) is not None:
                click.echo(f"  {key} {json.dumps(idx.meta[key])}")
        loader = idx.meta.get("loader") or {}
        click.echo(f"  loader step {loader.get('step')}")
        if tensors:
            width = max((len(n) for n in ck.tensors), default=0)
            for t in ck.tensors.values():
                click.echo(f"  {t.name:<{width}}  {np.dtype(t.dtype).name:>7} "
                           f"{str(t.global_shape):<14} {len(t.pieces)} piece(s)")


@ckpt.command()
@click.argument("checkpoint", type=click.Path(exists=True))
def verify(checkpoint: str) -> None:
    """Read every piece of a checkpoint and check its shape, dtype and checksum, and
    that every tensor is finite (no nan or inf).

    Exit status 0 if the checkpoint is whole; else each problem is printed (file and
    tensor) and the status is 2.

    \b
    Examples:
      hpctrain ckpt verify runs/demo
      hpctrain ckpt verify gpt-200.h5
    """
    from hpctrain.checkpoint import CheckpointError
    from hpctrain.checkpoint import verify as check

    try:
        ck, problems = check(checkpoint)
    except CheckpointError as err:
        _fail([_open_error(checkpoint, err)])
    if problems:
        _fail(problems)
    pieces = sum(len(t.pieces) for t in ck.tensors.values())
    click.echo(f"ok: {ck.index.path}: step {ck.step}, {len(ck.tensors)} tensors, {pieces} "
               f"pieces in {len(ck.index.files)} file(s), every checksum matches, every value "
               f"is finite")


@ckpt.command()
@click.argument("checkpoint", type=click.Path(exists=True))
@click.option("--output", "-o", required=True, type=click.Path(),
              help="A consolidated .h5 file (from a checkpoint folder), or a checkpoints "
                   "folder (from a consolidated file).")
@click.option("--files", default=1, show_default=True, type=click.IntRange(min=1),
              help="Data files to spread the pieces over, when writing a folder.")
@click.option("--force", is_flag=True,
              help="Replace what exists. Writing a file: the file (or empty folder) at "
                   "OUTPUT. Writing a folder: OUTPUT/step-N/, and move OUTPUT/latest back "
                   "if it names a later step. Never a file of the checkpoint converted.")
def convert(checkpoint: str, output: str, files: int, force: bool) -> None:
    """Convert between a checkpoint folder and a consolidated single file.

    From a folder (any layout) it writes one HDF5 file with every tensor whole; from
    such a file it writes OUTPUT/step-N/ and OUTPUT/latest, which `hpctrain train
    --resume OUTPUT` loads at any layout (a run with --averaging other than sync: the
    same averaging and dp only). Nothing is written over without --force
    (an existing output, OUTPUT/step-N/, a latest naming a later step), and nothing
    is written at all when it is refused.

    \b
    Examples:
      hpctrain ckpt convert runs/demo --output demo.h5
      hpctrain ckpt convert demo.h5 --output runs/demo2/checkpoints --files 4
    """
    from hpctrain.checkpoint import CheckpointError
    from hpctrain.checkpoint.consolidate import consolidate, expand
    from hpctrain.checkpoint.format import SELF
    from hpctrain.data.format import DataError

    with _opened(checkpoint) as ck:
        single = ck.index.files == [SELF]
    try:
        if single:
            done = expand(checkpoint, output, files=files, force=force)
        else:
            done = consolidate(checkpoint, output, force=force)
    except (CheckpointError, DataError) as err:
        _fail([str(err)])
    click.echo(f"wrote {done} (step {ck.step}, {len(ck.tensors)} tensors)")
