"""Batches of one 3-D volume (``hpctrain.volumes``): random training crops, eval tiles.

The volume, image (X, Y, Z) float32 and labels (X, Y, Z) uint8, is read whole into
memory once (4 MB at ``--downsample 2``). A crop (D, H, W) spans the axes (X, Y, Z) in
that order; Z [start, stop) (the file's ``heldout``, the superior end) is held out.
``B = batch_size`` is the global batch, rank ``r`` of ``dp`` takes ``b = B // dp``::

    train    corners = {(x, y, z): x + D <= X, y + H <= Y, z + W <= start,
                        labels[x + D // 2, y + H // 2, z + W // 2] != 0}   (C order)
             crop i of the global batch at step s:
                 corners[default_rng((seed, s, i)).integers(len(corners))]
             rank r takes crops i in [r*b, (r+1)*b)
    whole    the volume, padded at the high end of every axis to a multiple of the
             crop (image 0, labels IGNORE), cut into tiles in C order of tile index
    heldout  likewise for Z [start, stop) alone (the tiles start at Z = start)
             global batch g holds tiles [g*B, (g+1)*B), the last one completed with
             empty tiles (image 0, labels IGNORE); rank r takes [g*B + r*b, g*B + (r+1)*b)

    x (b, 1, D, H, W) float32, y (b, D, H, W) int64

So the global batch is the same whatever dp is, every rank has the same number of
evaluation batches, and a loss or Dice that skips IGNORE counts every voxel of the
region exactly once. Training crops never touch the held-out slices.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpctrain.data.format import REMEDY, VOLUMES, DataError, check_file, open_h5
from hpctrain.data.loader import Loader, _check_args

IGNORE = 255  # label of padding: not a voxel of the volume (or of the evaluated region)
TRAIN_SPLITS = ("train",)
EVAL_SPLITS = ("whole", "heldout")


@dataclass(frozen=True)
class Volume:
    path: Path
    image: np.ndarray  # (X, Y, Z) float32
    labels: np.ndarray  # (X, Y, Z) uint8
    heldout: tuple[int, int]  # [start, stop) along Z


def read_volume(path: str | Path) -> Volume:
    """The whole volume of an ``hpctrain.volumes`` file, checked."""
    path = Path(path)
    with open_h5(path) as f:
        info = check_file(f, path)
        if info.data_format != VOLUMES:
            raise DataError(f"{path}: holds {info.data_format} data, not {VOLUMES}")
        image, labels = f["image"][...], f["labels"][...]
        heldout = [int(h) for h in f.attrs.get("heldout", ())]
    Z = image.shape[2]
    if len(heldout) != 2 or not 0 < heldout[0] < heldout[1] <= Z:
        raise DataError(f"{path}: attribute heldout ({heldout}) must be [start, stop) with "
                        f"0 < start < stop <= Z ({Z}); re-run {REMEDY[VOLUMES]}")
    return Volume(path, image, labels, (heldout[0], heldout[1]))


def check_crop(path: Path, crop, shape: tuple[int, ...]) -> tuple[int, int, int]:
    """``crop`` as three ints, each in [1, the volume's side]; a DataError otherwise."""
    if crop is None:
        raise DataError(f"{path}: a {VOLUMES} file needs crop = (D, H, W) (the model's "
                        f"[model] crop)")
    crop = tuple(int(k) for k in crop)
    if len(crop) != 3:
        raise DataError(f"{path}: crop {list(crop)} must be 3 sizes (D, H, W)")
    if not all(1 <= k <= s for k, s in zip(crop, shape, strict=True)):
        raise DataError(f"{path}: crop {list(crop)} must fit the volume of "
                        f"{' x '.join(map(str, shape))} voxels, each size at least 1")
    return crop


# ---------------------------------------------------------------------------------
# training


def train_corners(v: Volume, crop: tuple[int, int, int]) -> np.ndarray:
    """(n, 3) int64: the corners of crops inside Z [0, start) centred on a brain voxel."""
    D, H, W = crop
    X, Y, _ = v.labels.shape
    nx, ny, nz = X - D + 1, Y - H + 1, v.heldout[0] - W + 1
    if nz < 1:
        raise DataError(f"{v.path}: crop W ({W}) exceeds the training slices Z [0, "
                        f"{v.heldout[0]}); use a smaller crop")
    centres = v.labels[D // 2:D // 2 + nx, H // 2:H // 2 + ny, W // 2:W // 2 + nz]
    corners = np.argwhere(centres != 0)  # (n, 3), C order
    if len(corners) == 0:
        raise DataError(f"{v.path}: no crop of {list(crop)} in Z [0, {v.heldout[0]}) is "
                        f"centred on a labelled voxel")
    return corners.astype(np.int64)


class CropSampler:
    """Corners of this rank's crops at a step, a pure function of the step."""

    def __init__(self, corners: np.ndarray, per_step: int, offset: int, count: int,
                 seed: int):
        self.corners, self.n = corners, len(corners)
        self.per_step, self.offset, self.count, self.seed = per_step, offset, count, seed

    def ids(self, step: int) -> np.ndarray:
        picks = [np.random.default_rng((self.seed, step, i)).integers(self.n)
                 for i in range(self.offset, self.offset + self.count)]
        return self.corners[picks]  # (b, 3)

    def epoch(self, step: int) -> int:
        """Crops drawn so far over the number of corners (draws are with replacement)."""
        return step * self.per_step // self.n


class Crops:
    """The in-memory volume, cut at given corners."""

    def __init__(self, v: Volume, crop: tuple[int, int, int]):
        self.v, self.crop = v, crop

    def gather(self, corners: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        D, H, W = self.crop
        x = np.empty((len(corners), 1, D, H, W), dtype=np.float32)
        y = np.empty((len(corners), D, H, W), dtype=np.int64)
        for n, (i, j, k) in enumerate(corners.tolist()):
            x[n, 0] = self.v.image[i:i + D, j:j + H, k:k + W]
            y[n] = self.v.labels[i:i + D, j:j + H, k:k + W]
        return x, y  # (b, 1, D, H, W), (b, D, H, W)

    def close(self) -> None:
        pass


class VolumeLoader(Loader):
    """``Loader`` over training crops: ``indices(step)`` are this rank's corners (b, 3)."""

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        return self.store.gather(self.sampler.ids(step))


def open_volume_loader(path: str | Path, *, split: str, batch_size: int, dp_rank: int,
                       dp_size: int, seed: int, crop, prefetch: bool = False
                       ) -> VolumeLoader:
    """This rank's stream of training crops (``split`` "train"); see the module doc."""
    _check_args(batch_size, dp_rank, dp_size, seed)
    path = Path(path)
    if split not in TRAIN_SPLITS:
        raise DataError(f"{path}: a {VOLUMES} file trains on split 'train' (evaluate on "
                        f"{' or '.join(repr(s) for s in EVAL_SPLITS)}), not {split!r}")
    v = read_volume(path)
    crop = check_crop(path, crop, v.image.shape)
    corners = train_corners(v, crop)
    b = batch_size // dp_size
    identity = {"kind": "volumes", "split": split, "seed": seed, "batch_size": batch_size,
                "crop": list(crop), "source_size": int(v.labels.size),
                "heldout": list(v.heldout)}
    loader = VolumeLoader(kind="volumes", store=Crops(v, crop),
                          sampler=CropSampler(corners, batch_size, dp_rank * b, b, seed),
                          files=[], identity=identity, num_samples=len(corners) // dp_size,
                          prefetch=prefetch)
    loader.paths = [path]
    return loader


# ---------------------------------------------------------------------------------
# evaluation


def tiles(v: Volume, crop: tuple[int, int, int], split: str
          ) -> tuple[np.ndarray, np.ndarray]:
    """Every tile of ``split``: image (t, 1, D, H, W) float32, labels (t, D, H, W) uint8."""
    z0, z1 = (0, v.image.shape[2]) if split == "whole" else v.heldout
    image, labels = v.image[:, :, z0:z1], v.labels[:, :, z0:z1]
    grid = [-(-s // k) for s, k in zip(image.shape, crop, strict=True)]  # tiles per axis
    pad = [(0, g * k - s) for g, k, s in zip(grid, crop, image.shape, strict=True)]
    image = np.pad(image, pad, constant_values=0)
    labels = np.pad(labels, pad, constant_values=IGNORE)
    D, H, W = crop
    gx, gy, gz = grid

    def cut(a: np.ndarray) -> np.ndarray:  # (gx*D, gy*H, gz*W) -> (t, D, H, W), C order
        return a.reshape(gx, D, gy, H, gz, W).transpose(0, 2, 4, 1, 3, 5).reshape(-1, D, H, W)

    return cut(image)[:, None], cut(labels)


def volume_eval_batches(path: str | Path, *, split: str, batch_size: int, dp_rank: int,
                        dp_size: int, crop, num_batches: int = 0
                        ) -> list[tuple[np.ndarray, np.ndarray]]:
    """This rank's part of every global batch of tiles (see the module doc): all of
    them when ``num_batches <= 0`` or at least their number, else the first
    ``num_batches`` (which then cover only part of the region)."""
    _check_args(batch_size, dp_rank, dp_size, 0)
    path = Path(path)
    if split not in EVAL_SPLITS:
        raise DataError(f"{path}: a {VOLUMES} file is evaluated on split "
                        f"{' or '.join(repr(s) for s in EVAL_SPLITS)}, not {split!r}")
    v = read_volume(path)
    crop = check_crop(path, crop, v.image.shape)
    image, labels = tiles(v, crop, split)
    n_batches = -(-len(image) // batch_size)
    if 0 < num_batches < n_batches:
        n_batches = num_batches
    b = batch_size // dp_size
    out = []
    for g in range(n_batches):
        x = np.zeros((b, 1, *crop), dtype=np.float32)
        y = np.full((b, *crop), IGNORE, dtype=np.int64)
        a = min(g * batch_size + dp_rank * b, len(image))
        n = min(b, len(image) - a)
        x[:n], y[:n] = image[a:a + n], labels[a:a + n]
        out.append((x, y))  # (b, 1, D, H, W) float32, (b, D, H, W) int64
    return out
