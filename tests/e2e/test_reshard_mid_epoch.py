"""A reshard 2 -> 1 in the middle of an epoch (issue 28, "also measure and state").

2 ranks of 256 rows (data.global_batch_size = 512) train 20 steps of the 52 of an epoch over the
27,000-row set of 6 shards and checkpoint; ``hvctr reshard`` makes it a 1-rank checkpoint, and
1 rank of 512 rows resumes it for the rest of 2 epochs. Before: the batch was scaled by W / W'
as if the rows per rank stayed 256, so the rank resumed at batch 40 of 52 and left out 10,240
rows of that epoch (84 steps, 43,008 samples, where the uninterrupted run trains 104 and
53,248). Now the position is the epoch's samples (``epoch_rows``, checkpoints record their
batch size): it resumes at batch 20, trains the same 104 steps and 53,248 samples, and says
what that epoch covers: in the new layout, 620 rows a second time and 620 left out
(hvctr.data.layout; tests/unit/test_reshard_position.py counts them row by row).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hvctr.cli import main
from tests.e2e.helpers import make_dataset, train

FLAGS = ["--data.global_batch_size=512", "--train.epochs=2", "--checkpoint.every_windows=5"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory)


def test_a_mid_epoch_reshard_resumes_at_the_epochs_samples_and_says_what_it_covers(dataset, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    train(2, a, dataset, *FLAGS, "--train.max_steps=20")  # checkpoint 0 at step 20: batch 20 of 52
    manifest = json.loads((a / "checkpoints" / "ckpt-000000" / "manifest.json").read_text())
    assert manifest["state"]["batch"] == 20 and manifest["batch_size_per_rank"] == 256
    assert main(["reshard", "--checkpoint", str(a), "--world-size", "1", "--out", str(b / "checkpoints")]) == 0
    origin = json.loads((b / "checkpoints" / "ckpt-000000" / "manifest.json").read_text())["resharded_from"]
    assert origin["epoch_rows"] == 20 * 256 * 2
    r = train(1, b, dataset, *FLAGS, resume=True)
    log = (b / "logs" / "rank-00000.log").read_text()
    assert "resumed from checkpoint 0 at step 20 (epoch 0, batch 20)" in log
    assert ("resumed mid-epoch after hvctr reshard from 2 to 1 ranks: epoch 0 had trained 10,240 of its 27,000 "
            "rows; its rest, in this size's layout, trains 620 of them again and leaves out 620 rows an epoch of 1 "
            "rank(s) trains (it leaves out 376, its remainders); from epoch 1 on, every row once an epoch") in log
    summary = json.loads((b / "summary.json").read_text())
    assert (summary["steps"], summary["samples"]) == (104, 53_248), r.stdout[-2000:]  # as the uninterrupted run's
