"""The end of training on a periodic checkpoint (issue 28, item 10): the checkpoint written at
the last window was written again at the end, a delta of 0 rows (and a resume with nothing left
to train wrote one more). Now the end writes one only where the newest checkpoint does not hold
the step training ended at.

Real training: ``hvctr simulate --ranks 1`` runs the unmodified Trainer in this process.
"""

from __future__ import annotations

import json

import pytest

from hvctr.cli import main
from tests.conftest import synth_shards

SMALL = ["--model.hidden=8", "--storage.dim=4", "--data.batch_size_per_rank=256", "--storage.rows_per_rank=100000",
         "--train.threads=1", "--metrics.log_every_steps=100"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synth_shards(tmp_path_factory.mktemp("ckpt-end"), 8000)


def checkpoints(run) -> list[tuple[int, list[int]]]:
    out = []
    for d in sorted((run / "checkpoints").glob("ckpt-*")):
        m = json.loads((d / "manifest.json").read_text())
        out.append((m["state"]["step"], [f["rows"] for f in m["files"]]))
    return out


def simulate(data, run, *flags) -> None:
    assert main(["simulate", "--ranks", "1", f"--data.train_dir={data}", f"--train.run_dir={run}", *SMALL,
                 *flags]) == 0


def test_the_end_of_training_on_a_periodic_checkpoint_writes_no_second_one(data, tmp_path):
    run = tmp_path / "run"
    simulate(data, run, "--checkpoint.every_windows=2", "--train.max_steps=16")  # windows of 4: 2 and 4 are periodic
    ckpts = checkpoints(run)
    assert [step for step, _ in ckpts] == [8, 16] and all(rows[0] > 0 for _, rows in ckpts), ckpts
    simulate(data, run, "--checkpoint.every_windows=2", "--train.max_steps=16", "--resume")  # nothing left to train
    assert checkpoints(run) == ckpts
    simulate(data, run, "--checkpoint.every_windows=3", "--train.max_steps=20", "--resume")  # ends off the period
    assert [step for step, _ in checkpoints(run)] == [8, 16, 20]
