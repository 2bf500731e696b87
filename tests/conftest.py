"""Shared fixtures: small synthetic dataset files whose every sample is distinct.

``make_tokens``, ``make_images`` and ``make_ratings`` write files through the same
writers as ``hpctrain-prep``; image row i carries i in its first four pixels, so a
sample can be told by its content alone. Tests reach these helpers through the
``datasets`` fixture rather than by importing this file.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from data_prep.sources import model_inputs
from data_prep.write import write_images, write_ratings, write_tokens


def image_ids(images: np.ndarray) -> np.ndarray:
    """The id written into each image's first four pixels (little-endian uint32)."""
    flat = np.asarray(images).reshape(len(images), -1)[:, :4]
    if flat.dtype != np.uint8:  # loader output: float32 in [0, 1]
        flat = np.rint(flat * 255).astype(np.uint8)
    return np.ascontiguousarray(flat).view("<u4").ravel().astype(np.int64)


def synthetic_images(n: int, first_id: int = 0, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    ids = np.arange(first_id, first_id + n, dtype="<u4")
    images.reshape(n, -1)[:, :4] = ids.view(np.uint8).reshape(n, 4)
    return images, (ids % 10).astype(np.uint8)


def make_images(path: Path, n_train: int = 300, n_test: int = 70, **kw) -> Path:
    splits = {"train": synthetic_images(n_train), "test": synthetic_images(n_test, 10**6)}
    write_images(path, splits, classes=tuple(str(c) for c in range(10)), **kw)
    return path


def make_tokens(path: Path, sizes=(3000, 2000, 1500), seed: int = 0, **kw) -> Path:
    """Random bytes in a few files (so windows are unique), 10% of each for val."""
    rng = np.random.default_rng(seed)
    files = []
    for i, n in enumerate(sizes):
        f = path.parent / f"{path.stem}-src{i}.txt"
        f.write_bytes(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
        files.append(f)
    write_tokens(path, files, val_fraction=0.1, **kw)
    return path


def make_ratings(path: Path, n: int = 500, seed: int = 0, folds: int = 5, **kw) -> Path:
    """Random ratings of 20 users and 30 items with every side feature, through the same
    ``sources.model_inputs`` as MovieLens; timestamps are distinct (a rating's id)."""
    rng = np.random.default_rng(seed)
    users, items = 20, 30
    years = rng.integers(1950, 2000, items).astype(np.int16)
    years[0] = 0  # unknown
    data = {
        "ratings": {"user": rng.integers(1, users + 1, n).astype(np.int32),
                    "item": rng.integers(1, items + 1, n).astype(np.int32),
                    "rating": rng.integers(1, 6, n).astype(np.float32),
                    "timestamp": np.arange(n, dtype=np.int64) + 880_000_000},
        "users": {"id": np.arange(1, users + 1, dtype=np.int32),
                  "age": rng.integers(10, 70, users).astype(np.int16),
                  "gender": rng.integers(0, 2, users).astype(np.uint8),
                  "occupation": rng.integers(0, 4, users).astype(np.uint8),
                  "zip_code": np.array([b"T8H1N" if u % 7 == 0 else b"%05d" % (u * 4099)
                                        for u in range(users)])},
        "items": {"id": np.arange(1, items + 1, dtype=np.int32),
                  "year": years,
                  "genres": rng.integers(0, 2, (items, 3)).astype(np.uint8)},
        "categories": {"users": {"gender": ["F", "M"], "occupation": ["a", "b", "c", "d"]},
                       "items": {"genres": ["a", "b", "c"]}},
    }
    write_ratings(path, model_inputs(data, folds=folds, seed=seed), **kw)
    return path


@pytest.fixture
def tokens_h5(tmp_path) -> Path:
    return make_tokens(tmp_path / "tokens.h5")


@pytest.fixture
def images_h5(tmp_path) -> Path:
    return make_images(tmp_path / "images.h5")


@pytest.fixture
def ratings_h5(tmp_path) -> Path:
    return make_ratings(tmp_path / "ratings.h5")


@pytest.fixture(scope="session")
def datasets() -> SimpleNamespace:
    return SimpleNamespace(make_tokens=make_tokens, make_images=make_images,
                           make_ratings=make_ratings, synthetic_images=synthetic_images,
                           image_ids=image_ids)
