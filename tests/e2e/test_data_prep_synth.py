"""``data_prep synth`` as users run it: its labels follow its truth, its printed scores are right."""

from __future__ import annotations

import re
import subprocess

import numpy as np

from tests.conftest import VENV_PY


def test_labels_follow_the_truth_in_every_decile(tmp_path):
    out, truth = tmp_path / "s.tsv", tmp_path / "s.truth"
    r = subprocess.run([VENV_PY, "-m", "data_prep", "synth", "--rows", "1000000", "--seed", "9",
                        "--out", str(out), "--truth-out", str(truth)],
                       capture_output=True, text=True, timeout=300, check=True)
    buf = np.frombuffer(out.read_bytes(), dtype=np.uint8)
    starts = np.concatenate([[0], np.flatnonzero(buf == 10)[:-1] + 1])
    labels = (buf[starts] - ord("0")).astype(np.float64)
    p = np.array(truth.read_bytes().split(), dtype=np.float64)
    assert len(labels) == len(p) == 1_000_000
    order = np.argsort(p, kind="stable")
    for decile in np.array_split(order, 10):
        assert abs(labels[decile].mean() - p[decile].mean()) < 0.01
    assert abs(labels.mean() - 0.25) < 0.01
    # the printed Bayes-optimal scores: expected near the target, realised close to expected
    exp_auc, real_auc = map(float, re.search(r"AUC expected ([\d.]+), realised ([\d.]+)", r.stdout).groups())
    exp_ll, real_ll = map(float, re.search(r"logloss expected ([\d.]+), realised ([\d.]+)", r.stdout).groups())
    assert abs(exp_auc - 0.80) < 0.01 and abs(real_auc - exp_auc) < 0.01
    realised = -np.mean(labels * np.log(p) + (1 - labels) * np.log1p(-p))
    assert abs(real_ll - realised) < 1e-3 and abs(exp_ll - real_ll) < 0.01
