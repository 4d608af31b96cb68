"""Day-by-day training (hvctr train --init-from), as a Slurm day chain runs it, without Slurm.

Three synthetic days of one click model that drifts (data_prep synth --day D --drift 0.1:
the same keys every day, fresh rows, value effects that move), and a fourth day held out.
Day d's job trains one pass over day d, starting from day d-1's model:

    hvctr train --data.train_dir=day<d> --train.run_dir=runs/day<d> --init-from runs/day<d-1> --resume

(``--resume`` as slurm/train.sbatch always passes it: a requeued job resumes its own
checkpoint of that day; a first start initialises from yesterday.) With admission
(storage.admit_after = 2) and TTL (storage.ttl_passes = 2) on, the model carries over: dense
parameters and Adam state, sparse rows with their per-row Adam steps, admission counts and
the TTL pass clock. The chain's model must beat a model trained on the last day alone, on
the next day's data.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.e2e.days import data_keys, make_day
from tests.e2e.helpers import assert_same_model, final_model, train

DAY_ROWS = 10000
FLAGS = ["--merge.every_k_steps=4", "--storage.admit_after=2", "--storage.ttl_passes=2"]


@pytest.fixture(scope="module")
def days(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("days")
    out = [make_day(root, d, DAY_ROWS, valid_fraction=0.05)[0] for d in range(3)]
    out.append(make_day(root, 3, 6000, valid_fraction=0.5)[0])  # the next day: evaluation only
    return out


def _day_job(run: Path, data: Path, test_day: Path, previous: Path | None):
    init = ["--init-from", str(previous)] if previous else []
    return train(2, run, data, *FLAGS, f"--data.valid_dir={test_day}", *init, resume=True)


@pytest.fixture(scope="module")
def chain(days, tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("chain")
    runs = [root / f"day{d}" for d in range(3)]
    for d in range(3):
        _day_job(runs[d], days[d], days[3], runs[d - 1] if d else None)
    return runs


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def _newest(run: Path) -> tuple[dict, Path]:
    m = max((json.loads(p.read_text()) for p in (run / "checkpoints").glob("ckpt-*/manifest.json")),
            key=lambda m: m["seq"])
    return m, run / "checkpoints" / f"ckpt-{m['seq']:06d}"


def _rank_files(run: Path) -> list[h5py.File]:
    _, ck = _newest(run)
    return [h5py.File(ck / f"rank-{r:05d}.h5", "r") for r in range(2)]


def test_the_chain_beats_the_last_day_alone_on_the_next_day(days, chain, tmp_path):
    alone = tmp_path / "alone"
    train(2, alone, days[2], *FLAGS, f"--data.valid_dir={days[3]}")
    aucs = [_summary(r)["eval"]["auc"] for r in chain]
    alone_auc = _summary(alone)["eval"]["auc"]
    print(f"AUC on day 3 after days 0, 0-1, 0-2: {aucs}; after day 2 alone: {alone_auc}")
    assert aucs[2] > alone_auc + 0.01, (aucs, alone_auc)
    assert aucs[2] > aucs[0]


def test_state_carries_over_from_day_to_day(days, chain):
    (m0, _), (m1, _), (m2, _) = (_newest(r) for r in chain)
    assert m1["init_from"]["checkpoint"].endswith(f"day0/checkpoints/ckpt-{m0['seq']:06d}")
    assert m2["init_from"]["seq"] == m1["seq"] and m2["state"]["epoch"] == 1  # one pass over its day
    files = [_rank_files(r) for r in chain]
    try:
        # the TTL clock: one pass per day
        assert [f[0].attrs["pass_index"] for f in files] == [1, 2, 3]
        # dense Adam: the step goes on counting
        steps = [f[0]["dense/adam_step"][0] for f in files]
        assert steps[1] == steps[0] + m1["state"]["step"] and steps[2] == steps[1] + m2["state"]["step"]
        # sparse Adam: a hot row's own step count exceeds what one day gives
        dim = 8
        assert max(float(f["rows"][:, 3 * (dim + 1)].max()) for f in files[2]) > m2["state"]["step"]
        # admission counts only grow: day 1 started from day 0's sketch
        for r in range(2):
            a0, a1 = files[0][r]["admission"][...], files[1][r]["admission"][...]
            assert np.all(a1 >= a0) and np.any(a1 > a0)
    finally:
        for fs in files:
            for f in fs:
                f.close()
    # TTL: after day 2, rows unseen on days 1 and 2 are gone; after day 1, day 0's were kept
    k0, k1, k2 = (np.fromiter(final_model(r)[1], np.uint64) for r in chain)
    seen12 = np.union1d(data_keys(days[1]), data_keys(days[2]))
    assert np.all(np.isin(k2, seen12))
    only_day0 = k0[~np.isin(k0, seen12)]
    assert only_day0.size > 100 and np.all(np.isin(only_day0, k1)) and not np.any(np.isin(only_day0, k2))


def test_a_requeued_day_job_resumes_its_own_checkpoint(days, chain):
    before = final_model(chain[2])
    r = _day_job(chain[2], days[2], days[3], chain[1])  # the same command again: nothing left to do
    assert "resumed from checkpoint" in r.stdout + r.stderr and "initialised from" not in r.stdout + r.stderr
    after = final_model(chain[2])
    assert before[1].keys() == after[1].keys()
    assert all(np.array_equal(before[1][k], after[1][k]) for k in before[1])


def test_one_run_directory_for_every_day_gives_the_same_model(days, chain, tmp_path):
    same = tmp_path / "same"  # day 1 continues day 0's checkpoint chain in day 0's directory
    shutil.copytree(chain[0], same)
    _day_job(same, days[1], days[3], same)
    m, _ = _newest(same)
    assert m["seq"] == 1 and m["init_from"]["seq"] == 0  # numbered on from day 0's checkpoint
    assert_same_model(same, chain[1])
