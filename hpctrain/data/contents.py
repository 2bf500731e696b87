"""What a dataset holds, and whether a model can take it.

Which model kinds train on which data format is what each registered model declares
(``data_format``, ``hpctrain.models.registry``).

Every dataset file records what it holds in its root attributes (``hpctrain-prep``
writes them; a partition copies them into every shard and into its manifest):

    hpctrain.tokens   vocab_size (the tokenizer's: 256 for bytes), max_token
    hpctrain.images   n_classes, classes; the image shape is that of the datasets
    hpctrain.ratings  (no training loader yet)

``read_contents(path)`` returns them as ``Contents``; ``check_fits(contents, model)``
raises a ``DataError`` naming both values and the fix when the model cannot take the
data: a vocabulary smaller than the data's, a classifier with fewer classes or
another input size, an image dataset given to a language model or the reverse.
Training runs it on every rank before the first step (``startup_check``), so a wrong
pairing is one clear line instead of an ``IndexError`` deep inside the embedding.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpctrain.data.format import (
    IMAGES,
    MANIFEST,
    REMEDY,
    SHARD,
    TOKENS,
    DataError,
    open_h5,
    read_format,
)
from hpctrain.data.manifest import resolve

# the root attributes that describe a dataset's contents (copied by partitioning)
CONTENT_ATTRS = ("vocab_size", "max_token", "n_classes", "classes", "image_shape")


@dataclass(frozen=True)
class Contents:
    """What a dataset file holds (None: not recorded, or not applicable)."""

    path: Path
    format: str  # the data format: TOKENS, IMAGES, ...
    vocab_size: int | None = None
    max_token: int | None = None
    n_classes: int | None = None
    image_shape: tuple[int, ...] | None = None


def _int(value) -> int | None:
    return None if value is None else int(value)


def contents_of(f: h5py.File, path: Path, data_format: str) -> Contents:
    """The contents recorded in an open data file (a dataset or a shard)."""
    a = f.attrs
    shape = a.get("image_shape")
    if shape is None and data_format == IMAGES:
        for split in ("train", "test"):
            if f"{split}/images" in f:
                shape = f[f"{split}/images"].shape[1:]
                break
    return Contents(path, data_format, _int(a.get("vocab_size")), _int(a.get("max_token")),
                    _int(a.get("n_classes")),
                    None if shape is None else tuple(int(s) for s in shape))


def read_contents(path: str | Path) -> Contents:
    """What the dataset at ``path`` (a file, a manifest or a partition folder) holds."""
    path = resolve(Path(path))
    with open_h5(path) as f:
        name, _ = read_format(f, path)
        data_format = name
        if name in (MANIFEST, SHARD):
            data_format = str(f.attrs.get("source_format", ""))
        if name != MANIFEST or any(k in f.attrs for k in CONTENT_ATTRS):
            return contents_of(f, path, data_format)
    # a manifest written before manifests carried the attributes: its first shard's
    from hpctrain.data.manifest import open_shard, read_manifest

    m = read_manifest(path)
    if not m.shards:
        return Contents(path, data_format)
    f, _ = open_shard(m, m.shards[0])
    with f:
        return contents_of(f, path, data_format)


def check_fits(c: Contents, model: Any) -> None:
    """Raise ``DataError`` if a model of config ``model`` (``ModelConfig``) cannot
    train on the data ``c``; the message names both values and the fix."""
    from hpctrain.models.registry import MODELS, kinds_for  # the data format each declares

    wants = kinds_for(c.format)
    if not wants:
        which = " and ".join(f"{cls.data_format} for kind = \"{kind}\""
                             for kind, cls in MODELS.items())
        raise DataError(f"{c.path}: holds {c.format} data, which no model trains on yet "
                        f"(the training data are {which})")
    if model.kind not in wants:
        want = " or ".join(wants)
        settings = " or ".join(f'"{k}"' for k in wants)
        what = "a token stream" if c.format == TOKENS else "images"
        raise DataError(f"{c.path}: holds {what} ({c.format}), which a {want} model trains "
                        f"on; the config's [model] kind is {model.kind!r}: set kind = "
                        f"{settings}, or point [data] path at {_data_for(model.kind)}")
    if c.format == TOKENS:
        _check_tokens(c, model)
    else:
        _check_images(c, model)


def _data_for(kind: str) -> str:
    from hpctrain.models.registry import MODELS

    wanted = MODELS[kind].data_format if kind in MODELS else None
    if wanted not in REMEDY:
        return "another dataset"
    return f"{'an' if wanted == IMAGES else 'a'} {wanted} file ({REMEDY[wanted]})"


def _check_tokens(c: Contents, model: Any) -> None:
    need = c.vocab_size if c.vocab_size is not None else (
        None if c.max_token is None else c.max_token + 1)
    if need is None:
        return  # nothing recorded (a file written by hand): the embedding checks ids
    if model.vocab_size < need:
        largest = "" if c.max_token is None else f", largest token id {c.max_token}"
        raise DataError(f"{c.path}: holds tokens of a vocabulary of {need}{largest}; the "
                        f"model's vocab_size ({model.vocab_size}) must be at least {need}: "
                        f"set [model] vocab_size = {need}")


def _check_images(c: Contents, model: Any) -> None:
    if c.image_shape is not None:
        size = int(np.prod(c.image_shape))
        if model.input_dim != size:
            dims = " x ".join(map(str, c.image_shape))
            raise DataError(f"{c.path}: holds images of {dims} = {size} values; the "
                            f"model's input_dim ({model.input_dim}) must equal {size}: set "
                            f"[model] input_dim = {size}")
    if c.n_classes is not None and model.n_classes < c.n_classes:
        raise DataError(f"{c.path}: holds {c.n_classes} classes; the model's n_classes "
                        f"({model.n_classes}) must be at least {c.n_classes}: set [model] "
                        f"n_classes = {c.n_classes}")
