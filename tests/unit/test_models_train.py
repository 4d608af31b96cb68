"""The new archs (dlrm, dcnv2, dlrm-dcnv2) through the real pipeline: ``hvctr simulate --ranks 1``
trains them with the unmodified Trainer in this process and the loss falls; ``hvctr export``
writes their dense tensors under the models' own names and ``hvctr score`` scores a Criteo file
from the export alone.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from hvctr.cli import main
from hvctr.checkpoint.format import read_manifest
from tests.conftest import synth_shards

SMALL = ["--model.hidden=16", "--storage.dim=4", "--model.bottom_mlp=16,4", "--data.batch_size_per_rank=256",
         "--storage.rows_per_rank=100000", "--train.threads=1", "--metrics.log_every_steps=4", "--train.max_steps=24"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("new-archs")
    synth_shards(root, 8000)
    lines = (root / "in.tsv").read_bytes().splitlines(keepends=True)
    (root / "score.tsv").write_bytes(b"".join(lines[:300]))
    return root


@pytest.mark.parametrize("arch, flags, tensor", [
    ("dlrm", [], "top.0.weight"),
    ("dcnv2", ["--model.cross_layers=2"], "cross.layers.1.weight"),  # full rank
    ("dlrm-dcnv2", ["--model.cross_rank=8"], "cross.layers.2.0.weight"),  # low rank: V^T, then U
])
def test_a_new_arch_trains_exports_and_scores(data, tmp_path, arch, flags, tensor):
    run, exp, pred = tmp_path / "run", tmp_path / "export", tmp_path / "pred.txt"
    assert main(["simulate", "--ranks", "1", f"--data.train_dir={data / 'shards'}", f"--train.run_dir={run}",
                 f"--model.arch={arch}", *SMALL, *flags]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r.get("event") == "progress"]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.005, losses

    assert main(["export", "--run-dir", str(run), "--out", str(exp)]) == 0
    m = read_manifest(exp / "manifest.json")
    assert m["model"]["arch"] == arch and tensor in m["dense"]
    assert main(["score", "--model", str(exp), "--input", str(data / "score.tsv"), "--out", str(pred)]) == 0
    p = np.loadtxt(pred)
    assert p.shape == (300,) and np.all((p > 0) & (p < 1)) and np.ptp(p) > 0
