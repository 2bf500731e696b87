"""Ratings: ``hpctrain-prep movielens`` on the real files (folds, feature codes), the
ratings loader (exact epochs, dp independence, resume, the validation fold), the check
of a model's features against the file's, and the refusals."""

from __future__ import annotations

import json
import sys

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from data_prep import sources
from data_prep.cli import main as prep
from data_prep.partition import partition
from hpctrain.config import ModelConfig
from hpctrain.data import DataError, eval_batches, open_loader
from hpctrain.data.contents import _check_ratings, check_fits, read_contents
from hpctrain.data.format import RATINGS, TOKENS, sha256_array
from hpctrain.data.ratings import read_ratings
from hpctrain.models import registry
from hpctrain.testing import run_mpi

FEATURES = ["user", "item", "age_bucket", "gender", "occupation", "zip_prefix", "decade",
            "genres"]


def prep_movielens(out, *args):
    result = CliRunner().invoke(prep, ["movielens", "-o", str(out), "-q", *map(str, args)])
    assert result.exit_code == 0, result.output
    return out


def read_all(path) -> tuple[dict, dict]:
    with h5py.File(path) as f:
        data = {}
        f.visititems(lambda k, v: data.__setitem__(k, v[...])
                     if isinstance(v, h5py.Dataset) else None)
        return data, {k: f.attrs[k] for k in f.attrs}


@pytest.fixture(scope="module")
def movielens(tmp_path_factory):
    return prep_movielens(tmp_path_factory.mktemp("ml") / "movielens.h5")


def columns(attrs) -> dict[str, slice]:
    out, at = {}, 0
    for f in json.loads(attrs["features"]):
        out[f["name"]] = slice(at, at + f["width"])
        at += f["width"]
    return out


# ---------------------------------------------------------------------------------
# the prep, on the real MovieLens-100K


def test_movielens_folds_and_features(movielens):
    data, attrs = read_all(movielens)
    r = data["ratings/fold"]
    assert (attrs["version"], attrs["folds"], attrs["fold_seed"]) == (2, 5, 0)
    assert np.bincount(r).tolist() == [20_000] * 5
    features = json.loads(attrs["features"])
    assert [f["name"] for f in features] == FEATURES
    assert json.loads(attrs["dense"]) == ["age", "year"]
    ids, col = data["ratings/ids"], columns(attrs)
    assert ids.shape == (100_000, sum(f["width"] for f in features)) == (100_000, 13)
    for f in features:
        block = ids[:, col[f["name"]]]
        used = block[block >= 0]
        # every id in [0, rows), and the rows are what the data hold: each id used
        assert used.max() < f["rows"], f
        assert len(np.unique(used)) == f["rows"], f
        assert (block >= -1).all() and (block[:, 0] >= 0).all(), f  # slot 0 always used
    rows = {f["name"]: f["rows"] for f in features}
    assert (rows["user"], rows["item"], rows["age_bucket"], rows["gender"],
            rows["occupation"], rows["zip_prefix"], rows["decade"], rows["genres"]) == \
        (943, 1682, 7, 2, 21, 11, 9, 19)
    # each code against the raw columns, decoded independently
    user = ids[:, col["user"]].ravel()
    item = ids[:, col["item"]].ravel()
    np.testing.assert_array_equal(data["users/id"][user], data["ratings/user"])
    np.testing.assert_array_equal(data["items/id"][item], data["ratings/item"])
    age = data["users/age"][user]
    bucket = sum((age >= edge).astype(int) for edge in (18, 25, 35, 45, 50, 56))
    np.testing.assert_array_equal(ids[:, col["age_bucket"]].ravel(), bucket)
    first = [z.decode()[0] for z in data["users/zip_code"][user]]
    want = [int(c) if c.isdigit() else 10 for c in first]
    np.testing.assert_array_equal(ids[:, col["zip_prefix"]].ravel(), want)
    year = data["items/year"][item]
    decade = ids[:, col["decade"]].ravel()
    assert (decade[year == 0] == 8).all() and (year == 0).any()
    np.testing.assert_array_equal(decade[year > 0], (year[year > 0] - 1920) // 10)
    # the genre bag: the multi-hot columns, ascending, -1 after; width = the most genres
    bag = ids[:, col["genres"]]
    hot = data["items/genres"]
    assert bag.shape[1] == hot.sum(axis=1).max() == 6
    for i in np.unique(item)[::97]:
        got = bag[np.flatnonzero(item == i)[0]]
        np.testing.assert_array_equal(got[got >= 0], np.flatnonzero(hot[i]))
        assert (got[len(np.flatnonzero(hot[i])):] == -1).all()
    dense = data["ratings/dense"]
    assert dense.dtype == np.float64 and dense.min() == 0.0 and dense.max() == 1.0
    np.testing.assert_allclose(dense[:, 0], (age - 7) / (73 - 7))
    known = np.unique(data["items/year"][data["items/year"] > 0])
    assert len(known) > 1
    items_known = data["items/year"][data["items/year"] > 0].astype(float)
    mean = ((items_known - items_known.min()) / np.ptp(items_known)).mean()
    np.testing.assert_allclose(dense[year == 0, 1], mean)


def test_folds_are_seeded_and_balanced(movielens, tmp_path):
    other = prep_movielens(tmp_path / "ml3.h5", "--folds", 3, "--seed", 7)
    fold3 = read_all(other)[0]["ratings/fold"]
    np.testing.assert_array_equal(fold3, sources.assign_folds(100_000, 3, 7))
    assert sorted(np.bincount(fold3).tolist()) == [33_333, 33_333, 33_334]
    np.testing.assert_array_equal(read_all(movielens)[0]["ratings/fold"],
                                  sources.assign_folds(100_000, 5, 0))
    assert (sources.assign_folds(1000, 5, 1) != sources.assign_folds(1000, 5, 2)).any()
    for n, k in ((17, 5), (5, 5), (101, 2)):
        sizes = np.bincount(sources.assign_folds(n, k, 3), minlength=k)
        assert sizes.sum() == n and sizes.max() - sizes.min() <= 1
    with pytest.raises(DataError, match=r"3 rating\(s\) cannot fill 5 folds"):
        sources.assign_folds(3, 5, 0)
    result = CliRunner().invoke(prep, ["movielens", "-o", str(tmp_path / "x.h5"),
                                       "--folds", "1"])
    assert result.exit_code != 0 and "--folds" in result.output


# ---------------------------------------------------------------------------------
# the loader


def draw(path, steps, **kw):
    with open_loader(path, **kw) as ld:
        return [ld.next_batch() for _ in range(steps)], ld.state_dict()


def test_batch_interface_and_an_exact_epoch(movielens):
    data, attrs = read_all(movielens)
    train = np.flatnonzero(data["ratings/fold"] != 2)
    B = 2000  # 80,000 training ratings: 40 steps
    seen = []
    with open_loader(movielens, batch_size=B, seed=4, fold=2) as ld:
        assert ld.num_samples == len(train) == 80_000
        for step in range(40):
            rows = ld.indices(step)
            x, y = ld.next_batch()
            seen.append(rows)
        assert ld.epoch == 1
    assert x.dtype == np.dtype([("dense", "<f8", (2,)), ("ids", "<i8", (13,))])
    assert x.shape == y.shape == (B,) and y.dtype == np.float64
    np.testing.assert_array_equal(x["ids"], data["ratings/ids"][rows])
    np.testing.assert_array_equal(x["dense"], data["ratings/dense"][rows])
    np.testing.assert_array_equal(y, data["ratings/rating"][rows])
    seen = np.concatenate(seen)
    np.testing.assert_array_equal(np.sort(seen), train)  # each training rating once
    assert (np.diff(seen[:B]) != 1).any()  # shuffled, not in file order


def test_dp_ranks_concatenate_to_the_serial_batch(ratings_h5):
    kw = {"batch_size": 24, "seed": 1, "fold": 3}
    serial, _ = draw(ratings_h5, 25, **kw)  # 400 training ratings: crosses an epoch
    parts = [draw(ratings_h5, 25, dp_rank=r, dp_size=2, **kw)[0] for r in range(2)]
    for s, (x, y) in enumerate(serial):
        np.testing.assert_array_equal(np.concatenate([p[s][0] for p in parts]), x)
        np.testing.assert_array_equal(np.concatenate([p[s][1] for p in parts]), y)


@pytest.mark.parametrize("prefetch", [False, True])
def test_resume_mid_epoch_equals_uninterrupted(ratings_h5, prefetch):
    kw = {"batch_size": 16, "dp_rank": 1, "dp_size": 2, "seed": 9, "fold": 1}
    reference, _ = draw(ratings_h5, 40, **kw)
    _, state = draw(ratings_h5, 13, prefetch=prefetch, **kw)
    state = json.loads(json.dumps(state))
    assert (state["fold"], state["folds"]) == (1, 5)
    with open_loader(ratings_h5, prefetch=prefetch, **kw) as ld:
        ld.next_batch()  # a prefetched batch is pending when the state is loaded
        ld.load_state_dict(state)
        resumed = [ld.next_batch() for _ in range(27)]
    for a, b in zip(reference[13:], resumed, strict=True):
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])
    with open_loader(ratings_h5, **{**kw, "fold": 2}) as ld:
        with pytest.raises(DataError, match="fold 1, this loader has 2"):
            ld.load_state_dict(state)


def test_validation_fold_whole_in_order_and_disjoint(ratings_h5):
    data, _ = read_all(ratings_h5)
    val = np.flatnonzero(data["ratings/fold"] == 4)  # 100 ratings
    stamps = data["ratings/timestamp"]  # distinct: a rating's identity
    serial = eval_batches(ratings_h5, batch_size=32, fold=4, num_batches=0)
    assert [len(y) for _, y in serial] == [32, 32, 32, 4]
    x = np.concatenate([b[0] for b in serial])
    np.testing.assert_array_equal(x["ids"], data["ratings/ids"][val])  # whole, in order
    np.testing.assert_array_equal(np.concatenate([b[1] for b in serial]),
                                  data["ratings/rating"][val])
    parts = [eval_batches(ratings_h5, batch_size=32, dp_rank=r, dp_size=2, fold=4,
                          num_batches=0) for r in range(2)]
    assert [len(y) for _, y in parts[1]] == [16, 16, 16, 2]
    for g, (xs, _) in enumerate(serial):
        np.testing.assert_array_equal(np.concatenate([p[g][0] for p in parts]), xs)
    assert len(eval_batches(ratings_h5, batch_size=32, fold=4, num_batches=2)) == 2
    with open_loader(ratings_h5, batch_size=50, seed=0, fold=4) as ld:
        train = np.concatenate([ld.indices(s) for s in range(8)])
    assert len(np.unique(train)) == 400
    assert not np.isin(stamps[train], stamps[val]).any()


# ---------------------------------------------------------------------------------
# refusals


def test_fold_out_of_range_and_wrong_splits(ratings_h5):
    for fold in (5, -1):
        with pytest.raises(DataError, match=rf"fold \({fold}\) must be in \[0, 5\): the file "
                                            r"holds 5 folds"):
            open_loader(ratings_h5, batch_size=4, seed=0, fold=fold)
    with pytest.raises(DataError, match=r"fold \(9\) must be in \[0, 5\)"):
        eval_batches(ratings_h5, batch_size=4, fold=9)
    with pytest.raises(DataError, match="is evaluated on split 'val'.*not 'test'"):
        eval_batches(ratings_h5, split="test", batch_size=4)
    with pytest.raises(DataError, match="trains on split 'train'.*not 'val'"):
        open_loader(ratings_h5, split="val", batch_size=4, seed=0)


def test_old_files_and_partitions_are_refused(ratings_h5, tmp_path):
    out = partition(ratings_h5, tmp_path / "parts", num_shards=2)
    with pytest.raises(DataError, match="a partition of hpctrain.ratings data has no loader"):
        open_loader(out, batch_size=4, seed=0)
    assert read_contents(out).features == read_contents(ratings_h5).features  # carried
    with h5py.File(ratings_h5, "r+") as f:
        f.attrs["version"] = 1
    for call in (lambda: open_loader(ratings_h5, batch_size=4, seed=0),
                 lambda: eval_batches(ratings_h5, batch_size=4),
                 lambda: read_contents(ratings_h5)):
        with pytest.raises(DataError, match="hpctrain.ratings version 1 is not supported "
                                            r"\(this hpctrain reads version 2\); re-run "
                                            "hpctrain-prep movielens"):
            call()


# ---------------------------------------------------------------------------------
# the model's features against the file's


class StandIn:
    """A ratings model reduced to what the check reads."""

    def __init__(self, dense, sparse):
        self.dense, self.sparse = dense, sparse

    def feature_layout(self):
        return self.dense, self.sparse


def test_model_features_must_be_the_files(ratings_h5):
    c = read_contents(ratings_h5)
    assert c.format == RATINGS and c.dense == ("age", "year") and c.folds == 5
    assert [f[0] for f in c.features] == FEATURES
    sparse = [tuple(f) for f in c.features]
    _check_ratings(c, StandIn(["age", "year"], sparse))
    bigger = [(n, rows + 100, w) for n, rows, w in sparse]
    _check_ratings(c, StandIn(["age", "year"], bigger))  # a larger table is fine
    rows = dict((n, r) for n, r, _ in sparse)
    cases = [
        (StandIn(["age"], sparse), r"holds 2 dense feature\(s\) \['age', 'year'\]; the "
                                   r"model takes 1: \['age'\]"),
        (StandIn(["age", "year"], sparse[::-1]), r"holds the sparse features \['user', "),
        (StandIn(["age", "year"], [(n, r - 1 if n == "item" else r, w)
                                   for n, r, w in sparse]),
         rf"feature 'item' has ids in \[0, {rows['item']}\); the model's table 'item' has "
         rf"{rows['item'] - 1} rows, it needs at least {rows['item']}"),
        (StandIn(["age", "year"], [(n, r, 1) for n, r, _ in sparse]),
         r"feature 'genres' has 3 slot\(s\) per sample; the model's 'genres' takes 1, it "
         r"must take 3"),
    ]
    for model, message in cases:
        with pytest.raises(DataError, match=message + ".*re-run hpctrain-prep movielens"):
            _check_ratings(c, model)


def test_ratings_and_other_data_are_not_mixed(ratings_h5, tokens_h5, monkeypatch):
    class RatingsStandIn:
        data_format = RATINGS

        @classmethod
        def feature_layout(cls, m):
            return ["age"], []

    monkeypatch.setitem(registry.MODELS, "ratings_standin", RatingsStandIn)
    with pytest.raises(DataError, match=r"holds ratings \(hpctrain.ratings\), which a "
                                        r"dlrm or ratings_standin model trains on; the "
                                        r"config's "
                                        r"\[model\] kind is 'gpt'"):
        check_fits(read_contents(ratings_h5), ModelConfig(kind="gpt"))
    with pytest.raises(DataError, match=rf"holds a token stream \({TOKENS}\), which a gpt "
                                        r"model trains on; the config's \[model\] kind is "
                                        r"'ratings_standin'.*a hpctrain.ratings file "
                                        r"\(hpctrain-prep movielens\)"):
        check_fits(read_contents(tokens_h5), ModelConfig(kind="ratings_standin"))
    with pytest.raises(DataError, match=r"holds 2 dense feature\(s\).*the model takes 1"):
        check_fits(read_contents(ratings_h5), ModelConfig(kind="ratings_standin"))


# ---------------------------------------------------------------------------------
# ids beyond a table


def _set_ids(path, column: int, row: int, value: int, features=None) -> None:
    """Write ``value`` into ratings/ids[row, column] (its checksum kept valid) and, if
    given, the ``features`` root attribute."""
    with h5py.File(path, "r+") as f:
        ids = f["ratings/ids"][...]
        ids[row, column] = value
        f["ratings/ids"][...] = ids
        f["ratings/ids"].attrs["sha256"] = sha256_array(ids)
        if features is not None:
            f.attrs["features"] = json.dumps(features)


def test_an_id_beyond_the_files_rows_is_refused_on_read(ratings_h5):
    features = json.loads(h5py.File(ratings_h5, "r").attrs["features"])
    item = next(f for f in features if f["name"] == "item")
    _set_ids(ratings_h5, 1, 7, item["rows"] + 4)  # column 1: the item
    with pytest.raises(DataError, match=rf"feature 'item' \(table of {item['rows']} rows\): "
                                        rf"ids must lie in \[0, {item['rows']}\).*e.g. "
                                        rf"\[{item['rows'] + 4}\]"):
        read_ratings(ratings_h5)


def test_an_id_beyond_the_models_table_names_the_table_the_id_and_the_rows(ratings_h5):
    # the file understates its item rows and holds an id beyond them: the model's table,
    # sized from the attribute, would index past its end; the check reads the ids
    features = json.loads(h5py.File(ratings_h5, "r").attrs["features"])
    rows = {f["name"]: f["rows"] for f in features}
    top = read_contents(ratings_h5).largest_ids[1]
    assert top == int(read_ratings(ratings_h5).ids[:, 1].max())
    for f in features:
        if f["name"] == "item":
            f["rows"] = top  # ids reach `top`: one row short
    _set_ids(ratings_h5, 1, 0, top, features)
    c = read_contents(ratings_h5)
    sparse = [tuple(f) for f in c.features]
    assert dict((n, r) for n, r, _ in sparse)["item"] == top <= rows["item"] - 1
    with pytest.raises(DataError, match=rf"feature 'item' holds ids up to {top}; the "
                                        rf"model's table 'item' has {top} rows "
                                        rf"\(ids 0..{top - 1}\): give the table at least "
                                        rf"{top + 1} rows"):
        _check_ratings(c, StandIn(["age", "year"], sparse))
    _check_ratings(c, StandIn(["age", "year"], [(n, r + 1 if n == "item" else r, w)
                                                 for n, r, w in sparse]))


def test_training_on_ids_beyond_a_table_is_one_line_on_every_rank(ratings_h5, tmp_path):
    features = json.loads(h5py.File(ratings_h5, "r").attrs["features"])
    rows = {f["name"]: f["rows"] for f in features}
    for f in features:
        if f["name"] == "user":
            f["rows"] -= 1
    _set_ids(ratings_h5, 0, 3, rows["user"] - 1, features)  # ids reach rows - 1 again
    tables = ", ".join(f'{{name = "{f["name"]}", rows = {f["rows"]}, width = {f["width"]}}}'
                       for f in features)
    config = tmp_path / "dlrm.toml"
    config.write_text(f'[model]\nkind = "dlrm"\ntables = [{tables}]\nembed_dim = 4\n'
                      f'bottom_mlp = [4]\ntop_mlp = [4]\ndense_features = ["age", "year"]\n'
                      f'[train]\nsteps = 2\nbatch_size = 8\neval_interval = 0\n'
                      f'[data]\npath = "{ratings_h5}"\n')
    result = run_mpi(2, [sys.executable, "-m", "hpctrain.cli", "train", "--config",
                         str(config), "--run-dir", str(tmp_path / "run")], timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count(f"feature 'user' holds ids up to {rows['user'] - 1}; the "
                               f"model's table 'user' has {rows['user'] - 1} rows") == 1, \
        result.stderr
    assert "IndexError" not in result.stderr and "Traceback" not in result.stderr


# ---------------------------------------------------------------------------------
# hpctrain cv


def test_cv_trains_each_fold_and_reports_the_rmse_of_its_val_mse(ratings_h5, tmp_path):
    from hpctrain.cli import main
    from hpctrain.testing import tiny_dlrm_config

    config = tiny_dlrm_config(tmp_path / "dlrm.toml", ratings_h5,
                              "steps = 3\nbatch_size = 8\neval_interval = 3")
    run_dir = tmp_path / "cv"
    result = CliRunner().invoke(main, ["cv", "--config", str(config), "--folds", "3",
                                       "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    report = json.loads((run_dir / "cv.json").read_text())
    assert report["folds"] == [0, 1, 2] and len(report["rmse"]) == 3
    for k, rmse in enumerate(report["rmse"]):
        records = [json.loads(line) for line in
                   (run_dir / f"fold{k}" / "metrics.jsonl").read_text().splitlines()]
        assert json.loads((run_dir / f"fold{k}" / "config.json").read_text()
                          )["data"]["fold"] == k
        assert rmse == pytest.approx(np.sqrt(records[-1]["val_mse"]))
        assert f"fold {k}: RMSE {rmse:.4f}" in result.output
    assert len(set(report["rmse"])) == 3  # three runs, three validation folds
    assert report["mean"] == pytest.approx(np.mean(report["rmse"]))
    assert f"mean RMSE {report['mean']:.4f}" in result.output
    bad = CliRunner().invoke(main, ["cv", "--config", str(config), "--folds", "6"])
    assert bad.exit_code == 2 and "--folds (6) must be between 1 and the 5 folds" in bad.output
    tokens = tmp_path / "gpt.toml"  # a model of another kind of data
    tokens.write_text('[model]\nkind = "gpt"\n[data]\npath = "none.h5"\n')
    bad = CliRunner().invoke(main, ["cv", "--config", str(tokens)])
    assert bad.exit_code == 2 and "its model (gpt) reads hpctrain.tokens data; hpctrain " \
        "cv validates models of hpctrain.ratings data" in bad.output
    # a second cv into the folder keeps the first one's result
    again = CliRunner().invoke(main, ["cv", "--config", str(config), "--folds", "1",
                                      "--run-dir", str(run_dir)])
    assert again.exit_code == 0, again.output
    assert f"an earlier cv.json in {run_dir}: kept as cv.1.json" in again.output
    assert json.loads((run_dir / "cv.1.json").read_text()) == report
    assert json.loads((run_dir / "cv.json").read_text())["folds"] == [0]
    # refused before any fold trains: no evaluation to read, a result that cannot be
    # written (a fold's RMSE was printed, then a traceback; on 2 ranks the job hung)
    no_eval = tmp_path / "noeval.toml"
    no_eval.write_text(config.read_text().replace("eval_interval = 3", "eval_interval = 0"))
    bad = CliRunner().invoke(main, ["cv", "--config", str(no_eval), "--run-dir",
                                    str(tmp_path / "cv2")])
    assert bad.exit_code == 2 and "eval_interval (0) must be > 0: cv reads each fold's " \
        "RMSE from its evaluation after the last step" in bad.output, bad.output
    (tmp_path / "cv3" / "cv.json").mkdir(parents=True)
    bad = CliRunner().invoke(main, ["cv", "--config", str(config), "--run-dir",
                                    str(tmp_path / "cv3")])
    assert bad.exit_code == 2 and "cv.json exists and is not a file" in bad.output, bad.output
    assert not (tmp_path / "cv2").exists() and not (tmp_path / "cv3" / "fold0").exists()
