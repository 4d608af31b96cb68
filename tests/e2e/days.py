"""Synthetic days for the e2e tests of day-by-day training, export and resharding.

``make_day(root, day, rows)`` writes ``root/day<d>.tsv`` (data_prep synth: one seed, the
given day of a click model that drifts) and, unless ``shards`` is 0, its data shards in
``root/day<d>/``. The same keys recur from day to day; the rows are fresh.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import h5py
import numpy as np

from tests.conftest import VENV_PY

SEED = 21


def make_day(root: Path, day: int, rows: int, drift: float = 0.1, shards: int = 6,
             valid_fraction: float = 0.1) -> tuple[Path, Path]:
    tsv = root / f"day{day}.tsv"
    subprocess.run([VENV_PY, "-m", "data_prep", "synth", "--rows", str(rows), "--seed", str(SEED), "--day", str(day),
                    "--drift", str(drift), "--out", str(tsv)], check=True, capture_output=True, timeout=300)
    out = root / f"day{day}"
    if shards:
        subprocess.run([VENV_PY, "-m", "data_prep", "criteo", "--input", str(tsv), "--out", str(out),
                        "--shards", str(shards), "--valid-fraction", str(valid_fraction)],
                       check=True, capture_output=True, timeout=300)
    return out, tsv


def data_keys(shard_dir: Path, split: str = "train") -> np.ndarray:
    """Every distinct key of a split of a data_prep directory."""
    parts = []
    for path in sorted(shard_dir.glob(f"{split}-*.h5")):
        with h5py.File(path, "r") as f:
            parts.append(f["keys"][...].ravel())
    return np.unique(np.concatenate(parts))
