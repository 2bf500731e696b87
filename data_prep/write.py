"""Writers of the four dataset formats; each file appears only once complete.

``progress(total, label)`` is a context manager factory whose object has
``update(n)``; the CLI passes click progress bars, the default shows nothing.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import numpy as np

from data_prep import sources
from hpctrain.data.format import (
    IMAGES,
    RATINGS,
    TOKENS,
    VERSIONS,
    VOLUMES,
    DataError,
    atomic_h5,
    check_output,
    write_array,
)


class _Silent:
    def update(self, n: int) -> None:
        pass


def no_progress(total: int, label: str):
    return nullcontext(_Silent())


def _header(fmt: str) -> dict:
    return {"format": fmt, "version": VERSIONS[fmt]}


def write_tokens(out: Path, files: list[Path], *, val_fraction: float, compression: str = "none",
                 force: bool = False, progress=no_progress) -> dict[str, int]:
    """Byte-level tokens (uint8, vocabulary 256) of ``files``: ``train`` and ``val``.

    Every file gives its first ``1 - val_fraction`` of bytes to ``train`` and its tail
    to ``val``, so each document is represented in both; files are concatenated in
    order. Returns the number of tokens in each split.
    """
    if not 0 < val_fraction < 1:
        raise DataError(f"val fraction ({val_fraction}) must be between 0 and 1")
    check_output(out, force)  # before reading anything
    train, val = [], []
    with progress(sum(f.stat().st_size for f in files), "reading text") as bar:
        for f in files:
            try:
                data = f.read_bytes()
            except OSError as err:
                raise DataError(f"{f}: cannot be read ({err.strerror})") from None
            t, v = sources.split_text(data, val_fraction)
            train.append(t)
            val.append(v)
            bar.update(len(data))
    train_tokens = np.frombuffer(b"".join(train), dtype=np.uint8)
    val_tokens = np.frombuffer(b"".join(val), dtype=np.uint8)
    if train_tokens.size == 0 or val_tokens.size == 0:
        raise DataError(f"the text gives {train_tokens.size} training and {val_tokens.size} "
                        f"validation tokens; both must be non-empty (more text, or another "
                        f"--val-fraction)")
    attrs = _header(TOKENS) | {"vocab_size": 256, "val_fraction": val_fraction,
                               "max_token": int(max(train_tokens.max(), val_tokens.max())),
                               **source_names(files)}
    with atomic_h5(out, force=force, attrs=attrs) as h5:
        with progress(2, "writing") as bar:
            write_array(h5, "train", train_tokens, compression)
            bar.update(1)
            write_array(h5, "val", val_tokens, compression)
            bar.update(1)
    return {"train": int(train_tokens.size), "val": int(val_tokens.size)}


def source_names(files: list[Path], budget: int = 48_000) -> dict:
    """``sources``: the files' names, as many as fit an HDF5 attribute (a compact one
    holds under 64 KiB: 4,100 names failed with "object header message is too large"),
    and ``sources_count``: how many files there were."""
    names, used = [], 0
    for f in files:
        used += len(f.name.encode()) + 16  # a variable-length string's own overhead
        if used > budget:
            break
        names.append(f.name)
    return {"sources": names, "sources_count": len(files)}


def write_images(out: Path, splits: dict[str, tuple[np.ndarray, np.ndarray]], *,
                 classes: tuple[str, ...], compression: str = "none", force: bool = False,
                 progress=no_progress) -> dict[str, int]:
    """``<split>/images`` (N, H, W) uint8 and ``<split>/labels`` (N,) uint8 per split."""
    check_output(out, force)
    shapes = {images.shape[1:] for images, _ in splits.values()}
    if len(shapes) != 1:
        raise DataError(f"the splits' images differ in shape: {sorted(shapes)}")
    attrs = _header(IMAGES) | {"n_classes": len(classes), "classes": list(classes),
                               "image_shape": list(shapes.pop())}
    with atomic_h5(out, force=force, attrs=attrs) as h5:
        with progress(2 * len(splits), "writing") as bar:
            for split, (images, labels) in splits.items():
                g = h5.create_group(split)
                write_array(g, "images", images, compression)
                bar.update(1)
                write_array(g, "labels", labels, compression)
                bar.update(1)
    return {split: int(images.shape[0]) for split, (images, _) in splits.items()}


def write_ratings(out: Path, data: dict, *, compression: str = "none", force: bool = False,
                  progress=no_progress) -> dict[str, int]:
    """``ratings/*`` (R,) per rating; ``users/*`` and ``items/*`` features by id.

    ``data`` as ``sources.model_inputs`` returns it: the ratings carry their fold and
    the model's inputs (``ratings/ids`` (R, K), ``ratings/dense`` (R, D)), described by
    the root attributes ``features`` and ``dense`` (JSON), ``labels`` (JSON: the label
    of each code of the small features), ``folds`` and ``fold_seed``. Categorical
    features are codes with a ``categories`` attribute naming them; strings are UTF-8
    bytes; ``items/genres`` is (n_items, n_genres) multi-hot.
    """
    check_output(out, force)
    ids, dense = data["ratings"]["ids"], data["ratings"]["dense"]
    features = data["features"]
    width = sum(f["width"] for f in features)
    if ids.shape[1:] != (width,) or dense.shape[1:] != (len(data["dense"]),):
        raise DataError(f"ratings/ids {ids.shape} and ratings/dense {dense.shape} must have "
                        f"{width} columns (the features' widths) and {len(data['dense'])} "
                        f"(the dense features)")
    attrs = _header(RATINGS) | {
        "source": "MovieLens-100K (GroupLens), via RecBole's atomic files",
        "features": json.dumps(features), "dense": json.dumps(data["dense"]),
        "labels": json.dumps(data["labels"]), "folds": int(data["folds"]),
        "fold_seed": int(data["fold_seed"])}
    groups = ("ratings", "users", "items")
    with atomic_h5(out, force=force, attrs=attrs) as h5:
        with progress(sum(len(data[g]) for g in groups), "writing") as bar:
            for group in groups:
                g = h5.create_group(group)
                for name, values in data[group].items():
                    d = write_array(g, name, values, compression)
                    if name in data["categories"].get(group, {}):
                        d.attrs["categories"] = data["categories"][group][name]
                    if values.dtype.kind == "S":
                        d.attrs["encoding"] = "utf-8"
                    bar.update(1)
    return {group: int(len(next(iter(data[group].values())))) for group in groups}


HELDOUT_FRACTION = 0.25  # of the brain's extent along Z, at its top, kept from training


def heldout_range(labels: np.ndarray) -> tuple[int, int]:
    """``[start, stop)`` along Z (the last axis) held out from training: the top quarter
    of the slices that hold any labelled voxel (at least one), and the empty slices
    above them. A quarter of the brain, not of the volume: the volume's top quarter is
    mostly air above the skull."""
    z = labels.shape[2]
    filled = np.flatnonzero(labels.reshape(-1, z).any(axis=0))
    if len(filled) < 2:
        raise DataError(f"a volume with {len(filled)} labelled slice(s) along Z (of {z}) "
                        f"cannot be split into training and held-out parts; use a smaller "
                        f"--downsample")
    low, high = int(filled[0]), int(filled[-1]) + 1
    return high - max(1, int((high - low) * HELDOUT_FRACTION)), z


def write_volume(out: Path, data: dict, *, classes: tuple[str, ...], downsample: int,
                 source: str, compression: str = "none", force: bool = False) -> dict:
    """``image`` (X, Y, Z) f4 and ``labels`` (X, Y, Z) u1 of one volume (``data`` as
    ``sources.mni152`` returns it), with what the loader and ``check_fits`` need in the
    root attributes. Returns the attributes written."""
    check_output(out, force)
    image, labels = data["image"], data["labels"]
    if image.ndim != 3 or image.shape != labels.shape:
        raise DataError(f"image {image.shape} and labels {labels.shape} must be one 3-D shape")
    if labels.size and labels.max() >= len(classes):
        raise DataError(f"label {int(labels.max())} is not one of the {len(classes)} classes")
    attrs = _header(VOLUMES) | {
        "n_classes": len(classes), "classes": list(classes),
        "volume_shape": list(image.shape), "spacing_mm": list(data["spacing_mm"]),
        "downsample": downsample, "heldout": list(heldout_range(labels)),
        "intensity_scale": data["intensity_scale"], "source": source,
        "sources": data["sources"], "sources_sha256": data["sha256"]}
    with atomic_h5(out, force=force, attrs=attrs) as h5:
        write_array(h5, "image", image.astype(np.float32), compression)
        write_array(h5, "labels", labels.astype(np.uint8), compression)
    return attrs
