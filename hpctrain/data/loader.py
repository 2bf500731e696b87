"""The loader each data-parallel rank reads its part of every global batch with.

``batch_size`` is the global batch B; rank ``r`` of ``dp`` returns ``b = B // dp`` rows.
Every batch is a pure function of the step, so a resumed run (``load_state_dict``)
and a prefetching run see exactly the batches of an uninterrupted one.

Unpartitioned file (a dataset file, or one shard file): the *global* batch at step s
is the same whatever ``dp`` is, and rank r takes its rows ``[r*b, (r+1)*b)`` of it,
reading only those samples (its hyperslab). This is what lets a run at dp=2 follow
the serial loss curve::

    tokens  starts = rng(seed, step).integers(0, W, size=B)     W = n - T windows
            (rng(key, s): Philox keyed by the seed, at counter s)
            rank r reads windows starts[r*b:(r+1)*b] of T + 1 tokens
            x = window[:-1], y = window[1:]                      (b, T) int64 each
    images  perm_e = rng(seed, e).permutation(N) for epoch e
            global sample j = perm_{j // N}[j % N]; step s draws j in [s*B, (s+1)*B)
            rank r takes j in [s*B + r*b, s*B + (r+1)*b)         x (b, 784) float32

A 3-D volume (``hpctrain.volumes``) is read whole; its training crops and evaluation
tiles, global across dp in the same way, are drawn in ``volumes.py``. Ratings
(``hpctrain.ratings``) are read whole too; ``ratings.py`` permutes the training folds
per epoch like images and evaluates the validation fold whole, in order.

Partition manifest: rank r opens only the shards ``assign_shards(S, dp)[r]`` gives it
and draws b samples per step from them alone, with streams seeded by (seed, rank):
windows from ``rng(seed, rank, step)``, rows from a per-epoch permutation
``rng(seed, rank, epoch)`` of the rank's rows. A token window never crosses from one
run of consecutive source text into another.

Epoch maths: ``num_samples`` is what this rank sees per epoch (its share of the split,
or its shards' samples), so ``steps_per_epoch = num_samples // b`` in both cases.

``state_dict()`` is ``{"step": s, ...}`` plus what the stream depends on; it is the
same on every rank, and ``load_state_dict`` checks it fits this loader.

Reads: uncompressed datasets are sliced from a memory map of the file at the chunk
offsets HDF5 records (``stores.DirectRows``), touching only the selected bytes;
compressed ones go through h5py. ``prefetch`` computes batch s + 1 on a background
thread while the caller works on batch s; it overlaps only with work that releases
the GIL (BLAS), and changes no batch.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import h5py
import numpy as np

from hpctrain.data.format import (
    IMAGES,
    MANIFEST,
    RATINGS,
    SHARD,
    TOKENS,
    VOLUMES,
    DataError,
    check_file,
    open_h5,
    read_format,
    table_rows,
)
from hpctrain.data.manifest import (
    assign_shards,
    open_shard,
    read_manifest,
    resolve,
    shard_segments,
)
from hpctrain.data.stores import ImageRows, TokenWindows

STATE_FORMAT = "hpctrain.loader"
STATE_VERSION = 1
EVAL_SEED = 0  # validation batches are the same in every run
_TRAIN, _EVAL = 1, 2  # stream tags: training and validation draws never coincide
CHUNK_CACHE = {"rdcc_nbytes": 32 << 20, "rdcc_nslots": 10007}  # HDF5 chunk cache per file


class Sampler:
    """Sample ids of this rank's rows at a step, as a pure function of the step.

    ``mode`` is "windows" (uniform draws with replacement, one generator per step),
    "epochs" (a permutation per epoch) or "ordered" (0, 1, 2, ... wrapping). Each step
    draws ``per_step`` samples, of which this rank takes ``[offset, offset + count)``.
    """

    def __init__(self, mode: str, n: int, per_step: int, offset: int, count: int,
                 key: tuple[int, ...]):
        self.mode, self.n, self.per_step = mode, n, per_step
        self.offset, self.count, self.key = offset, count, key
        self._perms: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()
        # counter-based: the generator of step s is Philox(key, counter=s), so any step's
        # draw is cheap to make on its own (no state carried from step to step)
        self._philox_key = np.random.SeedSequence(list(key)).generate_state(2, np.uint64)

    def ids(self, step: int) -> np.ndarray:
        if self.mode == "windows":
            counter = np.array([step, 0, 0, 0], dtype=np.uint64)
            rng = np.random.Generator(np.random.Philox(key=self._philox_key, counter=counter))
            return rng.integers(0, self.n, size=self.per_step)[self.offset:
                                                               self.offset + self.count]
        pos = step * self.per_step + self.offset + np.arange(self.count, dtype=np.int64)
        if self.mode == "ordered":
            return pos % self.n
        epochs = pos // self.n
        out = np.empty(self.count, dtype=np.int64)
        for e in np.unique(epochs).tolist():
            sel = epochs == e
            out[sel] = self._perm(e)[pos[sel] % self.n]
        return out

    def epoch(self, step: int) -> int:
        return step * self.per_step // self.n

    def _perm(self, epoch: int) -> np.ndarray:
        with self._lock:
            if epoch not in self._perms:
                if len(self._perms) >= 2:
                    self._perms.pop(min(self._perms))
                rng = np.random.default_rng([*self.key, epoch])
                self._perms[epoch] = rng.permutation(self.n)
            return self._perms[epoch]


class Loader:
    """This rank's stream of batches; see the module docstring for what it draws."""

    def __init__(self, *, kind: str, store, sampler: Sampler, files: list[h5py.File],
                 identity: dict, num_samples: int, prefetch: bool):
        self.kind = kind  # "tokens" or "images"
        self.store = store
        self.sampler = sampler
        self.files = files
        self.paths = [Path(f.filename) for f in files]  # the files this rank opened
        self.num_samples = num_samples
        self._identity = identity
        self._step = 0
        self._pool = ThreadPoolExecutor(1, "hpctrain-prefetch") if prefetch else None
        self._pending: tuple[int, Future] | None = None

    @property
    def step(self) -> int:
        """Index of the batch ``next_batch`` returns next."""
        return self._step

    @property
    def epoch(self) -> int:
        return self.sampler.epoch(self._step)

    def indices(self, step: int) -> np.ndarray:
        """Sample ids (windows or rows) of this rank's batch at ``step``."""
        return self.sampler.ids(step)

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's batch at ``step``, without moving the position."""
        ids = self.sampler.ids(step)
        if self.kind == "tokens":
            w = self.store.gather(ids)  # (b, T + 1) uint8
            return w[:, :-1].astype(np.int64), w[:, 1:].astype(np.int64)  # (b, T) each
        images, labels = self.store.gather(ids)  # (b, H, W) uint8, (b,) uint8
        x = np.multiply(images.reshape(len(ids), -1), np.float32(1 / 255), dtype=np.float32)
        return x, labels.astype(np.int64)  # (b, H*W) float32, (b,) int64

    def set_share(self, offset: int, count: int) -> None:
        """From the next batch on, take samples ``[offset, offset + count)`` of each
        global batch (heterogeneity-aware shares, ``hpctrain.parallel.shares``). The
        global batches stay the same, so nothing is lost or repeated. Unpartitioned
        data only: a partition gives each rank its own shards."""
        if self._identity.get("partitioned"):
            raise DataError("unequal batch shares need an unpartitioned dataset: each rank "
                            "of a partition reads only its own shards")
        per_step = self.sampler.per_step
        if offset < 0 or count < 1 or offset + count > per_step:
            raise DataError(f"a share of samples [{offset}, {offset + count}) must lie in the "
                            f"global batch of {per_step}")
        self._drop_pending()
        self.sampler.offset, self.sampler.count = offset, count

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        s = self._step
        if self._pending is not None and self._pending[0] == s:
            batch = self._pending[1].result()
        else:
            self._drop_pending()
            batch = self.batch(s)
        self._pending = None
        self._step = s + 1
        if self._pool is not None:
            self._pending = (s + 1, self._pool.submit(self.batch, s + 1))
        return batch

    def state_dict(self) -> dict:
        return {"format": STATE_FORMAT, "version": STATE_VERSION, "step": self._step,
                **self._identity}

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION:
            raise DataError(f"loader state is not {STATE_FORMAT} version {STATE_VERSION}: "
                            f"format {state.get('format')!r}, version {state.get('version')!r}")
        for key, mine in self._identity.items():
            if state.get(key) != mine:
                raise DataError(f"loader state has {key} {state.get(key)!r}, this loader "
                                f"has {mine!r}; resume with the run's own data and config")
        step = state.get("step")
        if not isinstance(step, int) or step < 0:
            raise DataError(f"loader state step ({step!r}) must be a non-negative integer")
        self._drop_pending()
        self._step = step

    def close(self) -> None:
        self._drop_pending()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.store.close()
        for f in self.files:
            if f.id.valid:
                f.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _drop_pending(self) -> None:
        if self._pending is not None:
            self._pending[1].cancel()
            try:
                self._pending[1].result()
            except Exception:  # a batch nobody will see; its error is not this call's
                pass
            self._pending = None


def open_loader(path: str | Path, *, split: str = "train", batch_size: int, dp_rank: int = 0,
                dp_size: int = 1, seed: int, seq_len: int | None = None,
                prefetch: bool = False, direct: bool = True,
                crop: tuple[int, int, int] | None = None, fold: int = 0) -> Loader:
    """Open this rank's loader on a dataset file, a shard file or a partition manifest.

    ``seq_len`` (T) is required for token streams and ignored otherwise; ``crop``
    (D, H, W) is required for a volume and ignored otherwise. Splits are "train" and
    "val" in a token stream, "train" and "test" in an image file, "train" in a volume.
    ``direct`` reads uncompressed chunks from a memory map of the file instead of
    through h5py (``stores.DirectRows``); the batches are the same either way. ``fold``
    is the validation fold of a ratings file (training reads the others).
    """
    fmt = _data_format(path)
    if fmt == RATINGS:
        from hpctrain.data.ratings import open_ratings_loader

        return open_ratings_loader(resolve(path), split=split, batch_size=batch_size,
                                   dp_rank=dp_rank, dp_size=dp_size, seed=seed, fold=fold,
                                   prefetch=prefetch)
    if fmt == VOLUMES:
        from hpctrain.data.volumes import open_volume_loader

        return open_volume_loader(resolve(path), split=split, batch_size=batch_size,
                                  dp_rank=dp_rank, dp_size=dp_size, seed=seed, crop=crop,
                                  prefetch=prefetch)
    return _open(path, split, batch_size, dp_rank, dp_size, seed, seq_len, prefetch,
                 train=True, direct=direct)


def eval_batches(path: str | Path, *, split: str = "val", batch_size: int, dp_rank: int = 0,
                 dp_size: int = 1, seq_len: int | None = None, num_batches: int = 8,
                 crop: tuple[int, int, int] | None = None, fold: int = 0
                 ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Fixed validation batches, the same at every call: token windows drawn with a
    fixed seed, or image rows in file order; global across dp as in training.

    A volume (splits "whole" and "heldout") gives the batches of tiles that cover the
    split: all of them, unless ``num_batches`` is positive and smaller than their
    number (then the first ``num_batches``, covering part of the split). Ratings
    (split "val": the validation ``fold``) likewise give the batches that cover the fold.
    """
    fmt = _data_format(path)
    if fmt == RATINGS:
        from hpctrain.data.ratings import ratings_eval_batches

        return ratings_eval_batches(resolve(path), split=split, batch_size=batch_size,
                                    dp_rank=dp_rank, dp_size=dp_size, fold=fold,
                                    num_batches=num_batches)
    if fmt == VOLUMES:
        from hpctrain.data.volumes import volume_eval_batches

        return volume_eval_batches(resolve(path), split=split, batch_size=batch_size,
                                   dp_rank=dp_rank, dp_size=dp_size, crop=crop,
                                   num_batches=num_batches)
    with _open(path, split, batch_size, dp_rank, dp_size, EVAL_SEED, seq_len, False,
               train=False, direct=True) as loader:
        # every batch is held in memory for the run: more samples than the rank's part
        # of the split holds only repeats them (an eval_batches of 100,000 took the demo
        # 15 minutes and gigabytes before its first step)
        per_batch = batch_size // dp_size
        most = loader.num_samples // per_batch
        if num_batches > most:
            what = "windows" if loader.kind == "tokens" else "rows"
            fix = (f"use eval_batches {most} or fewer" if most else
                   f"not one batch fits: use a batch_size of at most "
                   f"{loader.num_samples * dp_size:,} ({loader.num_samples:,} a rank), fewer "
                   f"ranks or shards, or a larger split")
            raise DataError(f"{path}: eval_batches ({num_batches}) x {per_batch} samples "
                            f"a rank is more than the {loader.num_samples:,} {what} of split "
                            f"{split!r} a rank draws from: {fix}")
        return [loader.batch(s) for s in range(num_batches)]


# ---------------------------------------------------------------------------------


def _check_args(batch_size: int, dp_rank: int, dp_size: int, seed: int) -> None:
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise DataError(f"dp_rank ({dp_rank}) must be in [0, dp_size) with dp_size "
                        f"({dp_size}) at least 1")
    if batch_size < 1 or batch_size % dp_size:
        raise DataError(f"batch_size ({batch_size}) must be a positive multiple of "
                        f"dp_size ({dp_size})")
    if seed < 0:
        raise DataError(f"seed ({seed}) must not be negative")


def _data_format(path: str | Path) -> str:
    """The data format of a dataset file, a shard or a manifest (its source's)."""
    path = resolve(path)
    with open_h5(path) as f:
        name, _ = read_format(f, path)
        if name in (SHARD, MANIFEST):
            return str(f.attrs.get("source_format", ""))
    return name


def _open(path, split, batch_size, dp_rank, dp_size, seed, seq_len, prefetch, *, train,
          direct) -> Loader:
    _check_args(batch_size, dp_rank, dp_size, seed)
    path = resolve(path)
    with open_h5(path) as f:
        name, _ = read_format(f, path)
    if name == MANIFEST:
        m = read_manifest(path)
        fmt, table_names, partitioned = m.source_format, m.tables, True
        try:
            mine = assign_shards(len(m.shards), dp_size)[dp_rank]
        except DataError as err:
            raise DataError(f"{path}: {err}") from None
        opened = []
        try:
            for k in mine:
                opened.append(open_shard(m, m.shards[k], **CHUNK_CACHE))
        except BaseException:
            for f, _ in opened:
                f.close()
            raise
    else:
        f = open_h5(path, **CHUNK_CACHE)
        try:
            info = check_file(f, path)
        except BaseException:
            f.close()
            raise
        fmt, table_names, partitioned = info.data_format, info.layout.tables, False
        opened = [(f, info)]
    files = [f for f, _ in opened]
    try:
        table = _split_table(path, fmt, split, table_names)
        if partitioned:
            source_size = m.tables[table].elements
        else:
            source_size = table_rows(files[0], opened[0][1].layout, table)
        store, kind = _store(opened, fmt, table, seq_len, path, direct)
        return _loader(store, kind, files, path, split, table, batch_size, dp_rank,
                       dp_size, seed, seq_len, partitioned, prefetch, train, source_size)
    except BaseException:
        for f in files:
            f.close()
        raise


def _split_table(path: Path, fmt: str, split: str, tables) -> str:
    if fmt not in (TOKENS, IMAGES):
        raise DataError(f"{path}: {fmt} data have no training loader; the loader reads "
                        f"{TOKENS} and {IMAGES}")
    if split not in tables:
        raise DataError(f"{path}: no split {split!r} (it has {', '.join(tables)})")
    return split


def _store(opened, fmt: str, table: str, seq_len: int | None, path: Path, direct: bool):
    if fmt == IMAGES:
        parts = [(f[f"{table}/images"], f[f"{table}/labels"]) for f, _ in opened]
        return ImageRows(parts, direct), "images"
    if seq_len is None or seq_len < 1:
        raise DataError(f"{path}: a token stream needs seq_len >= 1 (got {seq_len})")
    segments = []
    for f, info in opened:
        dset = f[table]
        if info.format == SHARD:
            segments += [(dset, a, n) for a, n in shard_segments(f, Path(f.filename), table)]
        else:
            segments.append((dset, 0, int(dset.shape[0])))
    return TokenWindows(segments, seq_len, direct), "tokens"


def _loader(store, kind, files, path, split, table, batch_size, dp_rank, dp_size, seed,
            seq_len, partitioned, prefetch, train, source_size) -> Loader:
    b = batch_size // dp_size
    n = store.num_samples
    names = ", ".join(Path(f.filename).name for f in files)
    if n == 0:
        what = f"window of seq_len + 1 ({(seq_len or 0) + 1}) tokens" if seq_len else "row"
        if partitioned:
            fix = "re-partition with a larger --row-size or fewer shards"
        elif split == "val":
            fix = "prepare the data with a larger share for it (hpctrain-prep --val-fraction)"
        else:
            fix = "prepare it from more data"
        raise DataError(f"{path}: split {table!r} of rank {dp_rank} ({names}) has no "
                        f"{what}; use a smaller seq_len, or {fix}")
    mode = "windows" if kind == "tokens" else ("epochs" if train else "ordered")
    tag = _TRAIN if train else _EVAL
    if partitioned:
        sampler = Sampler(mode, n, b, 0, b, (seed, tag, dp_rank))
        num_samples = n
    else:
        sampler = Sampler(mode, n, batch_size, dp_rank * b, b, (seed, tag))
        num_samples = n // dp_size
    identity = {"kind": kind, "split": split, "seed": seed, "batch_size": batch_size,
                "seq_len": seq_len if kind == "tokens" else None,
                "source_size": source_size, "partitioned": partitioned,
                "dp_size": dp_size if partitioned else None}
    return Loader(kind=kind, store=store, sampler=sampler, files=files, identity=identity,
                  num_samples=num_samples, prefetch=prefetch)
