"""What a dataset holds, and whether a model can take it.

Which model kinds train on which data format is what each registered model declares
(``data_format``, ``hpctrain.models.registry``).

Every dataset file records what it holds in its root attributes (``hpctrain-prep``
writes them; a partition copies them into every shard and into its manifest):

    hpctrain.tokens   vocab_size (the tokenizer's: 256 for bytes), max_token
    hpctrain.images   n_classes, classes; the image shape is that of the datasets
    hpctrain.volumes  n_classes, classes, volume_shape (X, Y, Z), heldout [start, stop)
                      along Z, spacing_mm, downsample
    hpctrain.ratings  features (JSON [{"name", "rows", "width"}] in the column order of
                      ratings/ids), dense (JSON list of names), folds; the largest id
                      of each feature is read from ratings/ids itself

``read_contents(path)`` returns them as ``Contents``; ``check_fits(contents, model)``
raises a ``DataError`` naming both values and the fix when the model cannot take the
data: a vocabulary smaller than the data's, a classifier with fewer classes or
another input size, an image dataset given to a language model or the reverse, a
segmentation model with another number of classes or a crop that does not fit the
volume, a ratings model whose features (``feature_layout()``) are not the file's or
whose tables are smaller than the ids the file holds.
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
    RATINGS,
    REMEDY,
    SHARD,
    TOKENS,
    VOLUMES,
    DataError,
    open_h5,
    read_format,
)
from hpctrain.data.manifest import resolve

# the root attributes that describe a dataset's contents (copied by partitioning)
CONTENT_ATTRS = ("vocab_size", "max_token", "n_classes", "classes", "image_shape",
                 "volume_shape", "heldout", "features", "dense", "folds")
WHAT = {TOKENS: "a token stream", IMAGES: "images", VOLUMES: "a 3-D volume",
        RATINGS: "ratings"}  # for messages


@dataclass(frozen=True)
class Contents:
    """What a dataset file holds (None: not recorded, or not applicable)."""

    path: Path
    format: str  # the data format: TOKENS, IMAGES, ...
    vocab_size: int | None = None
    max_token: int | None = None
    n_classes: int | None = None
    image_shape: tuple[int, ...] | None = None
    volume_shape: tuple[int, ...] | None = None  # (X, Y, Z)
    heldout: tuple[int, int] | None = None  # [start, stop) along Z, kept from training
    features: tuple[tuple[str, int, int], ...] | None = None  # (name, rows, width)
    dense: tuple[str, ...] | None = None  # names of the dense features
    folds: int | None = None
    largest_ids: tuple[int, ...] | None = None  # ratings: per feature, its largest id


def _int(value) -> int | None:
    return None if value is None else int(value)


def _ints(value) -> tuple[int, ...] | None:
    return None if value is None else tuple(int(v) for v in value)


def contents_of(f: h5py.File, path: Path, data_format: str) -> Contents:
    """The contents recorded in an open data file (a dataset or a shard)."""
    a = f.attrs
    shape = a.get("image_shape")
    if shape is None and data_format == IMAGES:
        for split in ("train", "test"):
            if f"{split}/images" in f:
                shape = f[f"{split}/images"].shape[1:]
                break
    volume = a.get("volume_shape")
    if volume is None and data_format == VOLUMES and "image" in f:
        volume = f["image"].shape
    features = dense = largest = None
    if data_format == RATINGS and "features" in a and "dense" in a:
        from hpctrain.data.ratings import largest_ids, parse_features

        parsed, dense = parse_features(path, a)
        features = tuple((f.name, f.rows, f.width) for f in parsed)
        if "ratings/ids" in f:
            largest = largest_ids(f["ratings/ids"][...], parsed)
    return Contents(path, data_format, _int(a.get("vocab_size")), _int(a.get("max_token")),
                    _int(a.get("n_classes")), _ints(shape), _ints(volume),
                    _ints(a.get("heldout")), features, dense, _int(a.get("folds")), largest)


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
        what = WHAT.get(c.format, "data")
        raise DataError(f"{c.path}: holds {what} ({c.format}), which a {want} model trains "
                        f"on; the config's [model] kind is {model.kind!r}: set kind = "
                        f"{settings}, or point [data] path at {_data_for(model.kind)}")
    if c.format == TOKENS:
        _check_tokens(c, model)
    elif c.format == IMAGES:
        _check_images(c, model)
    elif c.format == VOLUMES:
        _check_volume(c, model)
    elif c.format == RATINGS:
        _check_ratings(c, model)


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


def _check_volume(c: Contents, model: Any) -> None:
    if c.n_classes is not None and model.n_classes != c.n_classes:
        raise DataError(f"{c.path}: holds {c.n_classes} classes; the model's n_classes "
                        f"({model.n_classes}) must equal {c.n_classes}: set [model] "
                        f"n_classes = {c.n_classes}")
    crop = tuple(model.crop)
    if len(crop) != 3:
        raise DataError(f"{c.path}: holds a 3-D volume; the model's crop {list(crop)} must be 3 "
                        f"sizes (D, H, W): set [model] crop = [32, 32, 32] or another")
    if c.volume_shape is None:
        return
    # the largest crop that fits: the volume's side, and along Z the training region
    room = list(c.volume_shape)
    if c.heldout is not None:
        room[2] = min(room[2], c.heldout[0])
    if all(1 <= k <= r for k, r in zip(crop, room, strict=True)):
        return
    # each side a multiple of what the model's levels halve it by (seg3d: 2^(levels - 1))
    step = 2 ** max(0, len(getattr(model, "channels", ()) or ()) - 1)
    fit = [max(step, min(k, r) // step * step) for k, r in zip(crop, room, strict=True)]
    dims = " x ".join(map(str, c.volume_shape))
    train = "" if c.heldout is None or c.heldout[0] >= c.volume_shape[2] else \
        f", of which Z [0, {c.heldout[0]}) is for training"
    fix = (f"set [model] crop = {fit}" if all(k <= r for k, r in zip(fit, room, strict=True))
           else f"no crop of sides divisible by {step} fits: use fewer levels ([model] "
                f"channels) or a smaller --downsample of the volume")
    raise DataError(f"{c.path}: holds a volume of {dims} voxels{train}; every entry of the "
                    f"model's crop {list(crop)} must be at least 1 and fit in "
                    f"{' x '.join(map(str, room))}: {fix}")


def feature_layout(model: Any) -> tuple[list[str], list[tuple[str, int, int]]]:
    """``(dense names, [(name, rows, width)])`` of a model: its own ``feature_layout()``
    (a built model), or its registered class's ``feature_layout(m)`` for a config."""
    if hasattr(model, "feature_layout"):
        return model.feature_layout()
    from hpctrain.models.registry import MODELS

    return MODELS[model.kind].feature_layout(model)


def _check_ratings(c: Contents, model: Any) -> None:
    """The model's features must be the file's, in order: names, rows, widths, and the
    dense names; every id the file holds must be a row of the model's table."""
    if c.features is None or c.dense is None:
        raise DataError(f"{c.path}: records no features/dense attributes; re-run "
                        f"{REMEDY[RATINGS]}")
    dense, sparse = feature_layout(model)
    dense, sparse = list(dense), [tuple(s) for s in sparse]
    fix = f"set the model's features to the file's, or re-run {REMEDY[RATINGS]}"
    if len(dense) != len(c.dense) or list(dense) != list(c.dense):
        raise DataError(f"{c.path}: holds {len(c.dense)} dense feature(s) {list(c.dense)}; "
                        f"the model takes {len(dense)}: {dense}; {fix}")
    names = [f[0] for f in c.features]
    if [s[0] for s in sparse] != names:
        raise DataError(f"{c.path}: holds the sparse features {names} (in this order); the "
                        f"model takes {[s[0] for s in sparse]}; {fix}")
    largest = c.largest_ids or (None,) * len(sparse)
    for (name, rows, width), (_, m_rows, m_width), top in zip(c.features, sparse, largest,
                                                               strict=True):
        if m_rows < rows:
            raise DataError(f"{c.path}: feature {name!r} has ids in [0, {rows}); the "
                            f"model's table {name!r} has {m_rows} rows, it needs at least "
                            f"{rows}: {fix}")
        if m_width != width:
            raise DataError(f"{c.path}: feature {name!r} has {width} slot(s) per sample; "
                            f"the model's {name!r} takes {m_width}, it must take {width}: "
                            f"{fix}")
        if top is not None and top >= m_rows:
            raise DataError(f"{c.path}: feature {name!r} holds ids up to {top}; the model's "
                            f"table {name!r} has {m_rows} rows (ids 0..{m_rows - 1}): "
                            f"give the table at least {top + 1} rows, or re-run "
                            f"{REMEDY[RATINGS]}")
