"""hvctr reshard: a checkpoint written by W ranks, resumed on W2 (2 -> 3 and 3 -> 2).

The resharded checkpoint holds the same model, bit for bit (every key's row with its
optimiser state, the dense state), with whole virtual buckets moved to new owners. Resumed
on W2 ranks, the run evaluates as it did on W: the same rows and parameters give the same
predictions (ranks hold other rows at W2 and so batch them differently, which may move a
prediction by an ulp: AUC and logloss agree to 1e-6). It then trains on at W2. A checkpoint
that was not resharded is still refused at another world size, with the way out named.
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from hvctr.cli import main
from hvctr.formats import NUM_BUCKETS, default_bucket_owner, owner_of
from hvctr.offline.reshard import plan_buckets
from tests.e2e.helpers import final_model, make_dataset, train


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory)


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def _newest(run: Path) -> dict:
    return max((json.loads(p.read_text()) for p in (run / "checkpoints").glob("ckpt-*/manifest.json")),
               key=lambda m: m["seq"])


def assert_same_model_resharded(a: Path, b: Path, w: int, w2: int) -> None:
    da, sa = final_model(a)
    db, sb = final_model(b)
    assert da.keys() == db.keys() and all(np.array_equal(da[k], db[k]) for k in da)
    assert sa.keys() == sb.keys()
    keys = sorted(sa)
    assert np.array_equal(np.stack([sa[k] for k in keys]), np.stack([sb[k] for k in keys]))
    m = _newest(b)
    assert m["world_size"] == w2 and m["resharded_from"]["world_size"] == w and m["kind"] == "base"
    want = plan_buckets(default_bucket_owner(w), w2)
    for rank in range(w2):  # each key in the file of its owner under the new table
        with h5py.File(b / "checkpoints" / f"ckpt-{m['seq']:06d}" / f"rank-{rank:05d}.h5", "r") as f:
            assert np.array_equal(f["bucket_owner"][...], want)
            assert np.all(owner_of(f["keys"][...], want) == rank)
    # whole buckets moved, as few as balance allows: a third of them either way
    assert m["resharded_from"]["buckets_moved"] == int(np.count_nonzero(default_bucket_owner(w) != want))
    assert m["resharded_from"]["buckets_moved"] == NUM_BUCKETS // 3


def assert_same_eval(a: dict, b: dict) -> None:
    assert a["count"] == b["count"]
    for k in ("auc", "logloss", "copc"):
        assert abs(a[k] - b[k]) < 1e-6, (k, a[k], b[k])


def test_two_to_three_ranks(dataset, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    train(2, a, dataset, "--merge.every_k_steps=4")
    r = train(3, a, dataset, "--merge.every_k_steps=4", resume=True, check=False)
    assert r.returncode != 0 and "hvctr reshard" in r.stdout + r.stderr  # not resharded: refused

    assert main(["reshard", "--checkpoint", str(a), "--world-size", "3", "--out", str(b / "checkpoints")]) == 0
    assert_same_model_resharded(a, b, 2, 3)
    train(3, b, dataset, "--merge.every_k_steps=4", resume=True)  # the epoch is done: it evaluates
    assert_same_eval(_summary(a)["eval"], _summary(b)["eval"])
    assert main(["reshard", "--checkpoint", str(a), "--world-size", "3", "--out", str(b / "checkpoints")]) == 2


def test_three_to_two_ranks_and_train_on(dataset, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    # row-wise Adam's rows (m per column, one v a row): the resharded files say so, the resume reads them
    flags = ["--merge.every_k_steps=2", "--storage.ttl_passes=1", "--train.sparse_optimizer=rowwise_adam"]
    train(3, a, dataset, *flags, "--train.max_steps=10")  # stops a third into the epoch
    assert main(["reshard", "--checkpoint", str(a / "checkpoints"), "--world-size", "2",
                 "--out", str(b / "checkpoints")]) == 0
    assert_same_model_resharded(a, b, 3, 2)
    assert _newest(b)["state"]["batch"] == 10 * 3 // 2  # the same share of the epoch at 2 ranks
    train(2, b, dataset, *flags, "--train.max_steps=10", resume=True)  # nothing left under that limit
    assert_same_eval(_summary(a)["eval"], _summary(b)["eval"])

    train(2, b, dataset, *flags, resume=True)  # the rest of the epoch, on 2 ranks
    s, m = _summary(b), _newest(b)
    assert m["world_size"] == 2 and m["state"]["epoch"] == 1 and s["steps"] > 10
    assert s["eval"]["auc"] > _summary(a)["eval"]["auc"] and s["eval"]["auc"] > 0.62
    with h5py.File(b / "checkpoints" / f"ckpt-{m['seq']:06d}" / "rank-00000.h5", "r") as f:
        assert f.attrs["pass_index"] == 1  # the pass ended at 2 ranks: the TTL clock moved on
        assert f.attrs["sparse_optimizer"] == "rowwise_adam" and f["rows"].shape[1] == 2 * 9 + 2
