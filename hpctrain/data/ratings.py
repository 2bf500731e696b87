"""Batches of ratings (``hpctrain.ratings``): cross-validation folds, the model's inputs.

The file's ratings are read whole into memory once (13 ids, 2 dense values and a
rating each: 12 MB for MovieLens-100K). ``fold`` k is the validation fold; training
reads every other fold. ``B = batch_size`` is the global batch, rank ``r`` of ``dp``
takes ``b = B // dp``, as in the images loader::

    train    rows = the ratings whose fold != k, ascending (N of them)
             perm_e = rng(seed, e).permutation(N) for epoch e
             global sample j = rows[perm_{j // N}[j % N]]; step s draws j in [s*B, (s+1)*B)
             rank r takes j in [s*B + r*b, s*B + (r+1)*b)
    val      rows = the ratings whose fold == k, ascending (M of them), every one once:
             global batch g holds rows [g*B, g*B + n), n = min(B, M - g*B); rank r takes
             [g*B + r*n // dp, g*B + (r+1)*n // dp) (the last batch is short: b or
             fewer rows per rank, the same number of batches on every rank)

    x  structured (b,): ("dense", <f8, (D,)), ("ids", <i8, (K,)), the ids in the
       order of the root attribute ``features``, -1 in unused slots of a bag
    y  (b,) float64, the ratings

The root attributes ``features`` (JSON ``[{"name", "rows", "width"}]``: ids of a
feature lie in [0, rows), ``width`` slots per sample) and ``dense`` (JSON list of
names) describe the columns; ``K`` is the sum of the widths, ``D`` the number of
dense names. So the global batch is the same whatever dp is, and an epoch of
training visits every training rating once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpctrain.data.format import (
    MANIFEST,
    RATINGS,
    REMEDY,
    DataError,
    check_file,
    open_h5,
    read_format,
)
from hpctrain.data.loader import _TRAIN, Loader, Sampler, _check_args

TRAIN_SPLITS = ("train",)
EVAL_SPLITS = ("val",)


@dataclass(frozen=True)
class Feature:
    name: str
    rows: int  # ids lie in [0, rows)
    width: int  # slots per sample: 1, or the largest bag


@dataclass(frozen=True)
class Ratings:
    path: Path
    features: tuple[Feature, ...]
    dense_names: tuple[str, ...]
    folds: int
    fold: np.ndarray  # (R,) uint8
    ids: np.ndarray  # (R, K) int32
    dense: np.ndarray  # (R, D) float64
    rating: np.ndarray  # (R,) float32

    @property
    def dtype(self) -> np.dtype:
        """The dtype of a batch's x."""
        return batch_dtype(len(self.dense_names), self.ids.shape[1])


def batch_dtype(D: int, K: int) -> np.dtype:
    return np.dtype([("dense", "<f8", (D,)), ("ids", "<i8", (K,))])


def parse_features(path: Path, attrs) -> tuple[tuple[Feature, ...], tuple[str, ...]]:
    """The ``features`` and ``dense`` root attributes, checked."""
    remedy = f"re-run {REMEDY[RATINGS]}"
    try:
        features = json.loads(attrs["features"])
        dense = json.loads(attrs["dense"])
        out = tuple(Feature(str(f["name"]), int(f["rows"]), int(f["width"]))
                    for f in features)
    except KeyError as err:
        raise DataError(f"{path}: lacks the root attribute or key {err} of {RATINGS}; "
                        f"{remedy}") from None
    except (TypeError, ValueError) as err:
        raise DataError(f"{path}: its features attribute is not a JSON list of "
                        f"{{name, rows, width}} ({err}); {remedy}") from None
    for f in out:
        if f.rows < 1 or f.width < 1:
            raise DataError(f"{path}: feature {f.name!r} has rows {f.rows} and width "
                            f"{f.width}; both must be at least 1; {remedy}")
    return out, tuple(str(d) for d in dense)


def largest_ids(ids: np.ndarray, features: tuple[Feature, ...]) -> tuple[int, ...]:
    """ids (R, K) in the column order of ``features`` -> each feature's largest id
    (-1: none, an empty file or only unused slots)."""
    out, a = [], 0
    for f in features:
        cols = ids[:, a:a + f.width]
        out.append(int(cols.max(initial=-1)))
        a += f.width
    return tuple(out)


def read_ratings(path: str | Path) -> Ratings:
    """Every rating of an ``hpctrain.ratings`` file (or one shard of it), checked."""
    path = Path(path)
    with open_h5(path) as f:
        name, _ = read_format(f, path)
        if name == MANIFEST:
            raise DataError(f"{path}: a partition of {RATINGS} data has no loader (the "
                            f"ratings are small and read whole): give the file itself")
        info = check_file(f, path)
        if info.data_format != RATINGS:
            raise DataError(f"{path}: holds {info.data_format} data, not {RATINGS}")
        features, dense_names = parse_features(path, f.attrs)
        folds = int(f.attrs.get("folds", 0))
        fold, ids = f["ratings/fold"][...], f["ratings/ids"][...]
        dense, rating = f["ratings/dense"][...], f["ratings/rating"][...]
    K, D = sum(ft.width for ft in features), len(dense_names)
    if ids.shape[1] != K or dense.shape[1] != D:
        raise DataError(f"{path}: ratings/ids has {ids.shape[1]} columns and ratings/dense "
                        f"{dense.shape[1]}; its features need {K} and {D}; re-run "
                        f"{REMEDY[RATINGS]}")
    check_feature_ids(path, features, ids)
    if folds < 1 or (len(fold) and int(fold.max()) >= folds):
        raise DataError(f"{path}: ratings/fold holds fold {int(fold.max(initial=0))}, the file "
                        f"records {folds} folds; re-run {REMEDY[RATINGS]}")
    return Ratings(path, features, dense_names, folds, fold, ids, dense, rating)


def check_feature_ids(path: Path, features: tuple[Feature, ...], ids: np.ndarray) -> None:
    """Every id of a feature's columns in [0, rows) or -1 (an empty slot): an id beyond
    its table is refused here, where every rank reads the file whole, before any
    collective (a sharded table would send it to a rank holding no such row)."""
    at = 0
    for ft in features:
        block = ids[:, at:at + ft.width]
        at += ft.width
        if block.size == 0:
            continue
        lo, hi = int(block.min()), int(block.max())
        if lo < -1 or hi >= ft.rows:
            bad = block[(block < -1) | (block >= ft.rows)]
            raise DataError(f"{path}: feature {ft.name!r} (table of {ft.rows} rows): ids "
                            f"must lie in [0, {ft.rows}) or be -1 (an empty slot); the file "
                            f"holds {bad.size} outside, e.g. {sorted(set(bad.tolist()))[:5]} "
                            f"(smallest {lo}, largest {hi}); re-run {REMEDY[RATINGS]}")


def fold_rows(r: Ratings, fold: int, split: str) -> np.ndarray:
    """(n,) int64 ascending rows of ``split``: "train" every fold but ``fold``, "val"
    that fold."""
    if isinstance(fold, bool) or not isinstance(fold, (int, np.integer)) or \
            not 0 <= fold < r.folds:
        raise DataError(f"{r.path}: fold ({fold}) must be in [0, {r.folds}): the file "
                        f"holds {r.folds} folds; set [data] fold (or --fold) in that range, "
                        f"or re-run {REMEDY[RATINGS]} --folds")
    rows = np.flatnonzero((r.fold == fold) if split == "val" else (r.fold != fold))
    if len(rows) == 0:
        raise DataError(f"{r.path}: split {split!r} with validation fold {fold} has no "
                        f"rating")
    return rows.astype(np.int64)


class RatingRows:
    """The in-memory ratings, gathered by row into the batch interface."""

    def __init__(self, r: Ratings):
        self.r = r

    def gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = np.empty(len(rows), dtype=self.r.dtype)
        x["dense"] = self.r.dense[rows]  # (b, D)
        x["ids"] = self.r.ids[rows]  # (b, K)
        return x, self.r.rating[rows].astype(np.float64)  # (b,) structured, (b,) f8

    def close(self) -> None:
        pass


class RatingsLoader(Loader):
    """``Loader`` over training ratings; ``indices(step)`` are this rank's file rows."""

    def __init__(self, *, rows: np.ndarray, **kwargs):
        super().__init__(**kwargs)
        self.rows = rows  # (N,) the training rows, ascending

    def indices(self, step: int) -> np.ndarray:
        return self.rows[self.sampler.ids(step)]

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        return self.store.gather(self.indices(step))


def _check_split(path: Path, split: str, splits: tuple[str, ...], verb: str) -> None:
    if split not in splits:
        raise DataError(f"{path}: a {RATINGS} file {verb} split "
                        f"{' or '.join(repr(s) for s in splits)} (the validation fold is "
                        f"[data] fold), not {split!r}")


def open_ratings_loader(path: str | Path, *, split: str, batch_size: int, dp_rank: int,
                        dp_size: int, seed: int, fold: int = 0, prefetch: bool = False
                        ) -> RatingsLoader:
    """This rank's stream of training ratings (``split`` "train"); see the module doc."""
    _check_args(batch_size, dp_rank, dp_size, seed)
    path = Path(path)
    _check_split(path, split, TRAIN_SPLITS, "trains on")
    r = read_ratings(path)
    rows = fold_rows(r, fold, "train")
    b = batch_size // dp_size
    identity = {"kind": "ratings", "split": split, "seed": seed, "batch_size": batch_size,
                "fold": int(fold), "folds": r.folds, "source_size": len(r.fold)}
    loader = RatingsLoader(rows=rows, kind="ratings", store=RatingRows(r),
                           sampler=Sampler("epochs", len(rows), batch_size, dp_rank * b, b,
                                           (seed, _TRAIN)),
                           files=[], identity=identity, num_samples=len(rows) // dp_size,
                           prefetch=prefetch)
    loader.paths = [path]
    return loader


def ratings_eval_batches(path: str | Path, *, split: str = "val", batch_size: int,
                         dp_rank: int = 0, dp_size: int = 1, fold: int = 0,
                         num_batches: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """This rank's part of every global batch of the validation fold, in order (see
    the module doc): all of them when ``num_batches <= 0`` or at least their number,
    else the first ``num_batches`` (then covering only part of the fold)."""
    _check_args(batch_size, dp_rank, dp_size, 0)
    path = Path(path)
    _check_split(path, split, EVAL_SPLITS, "is evaluated on")
    r = read_ratings(path)
    rows = fold_rows(r, fold, "val")
    n_batches = -(-len(rows) // batch_size)
    if 0 < num_batches < n_batches:
        n_batches = num_batches
    store, out = RatingRows(r), []
    for g in range(n_batches):
        n = min(batch_size, len(rows) - g * batch_size)  # rows in this global batch
        a, z = (g * batch_size + dp_rank * n // dp_size,
                g * batch_size + (dp_rank + 1) * n // dp_size)
        out.append(store.gather(rows[a:z]))
    return out
