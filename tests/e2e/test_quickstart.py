"""The README's quickstart, command by command, on a synthetic stand-in for each preset.

The commands are the README's (download -> preprocess -> plan -> train -> evaluate -> export,
then report), with the sbatch scripts' payloads run directly (mpirun -np 2 here; the scripts
themselves are tests/e2e/test_slurm.py's) and small row counts and batches as flags on top of
the presets. Criteo Kaggle's stand-in is one plain file split by --valid-fraction; Criteo
Terabyte's is gzip day files with the last one as --valid-input, as day_23 is.
"""

from __future__ import annotations

import gzip
import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, VENV_PY, mpi_env

SMALL = ["--data.batch_size_per_rank=128", "--merge.every_k_steps=2", "--model.hidden=64,32", "--storage.cpu_cache_bytes=2e6",
         "--metrics.log_every_steps=4", "--metrics.eval_every_windows=2", "--checkpoint.every_windows=4",
         "--train.dense_lr=0.01", "--train.sparse_lr=0.01"]
MPIRUN = ["mpirun", "-np", "2", "--bind-to", "none", VENV_PY, "-m", "mpi4py"]


def sh(*cmd: str | Path, timeout: int = 120) -> str:
    r = subprocess.run([str(c) for c in cmd], env=mpi_env(), capture_output=True, text=True, timeout=timeout,
                       cwd=REPO)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout + r.stderr


def download_stand_in(preset: str, raw: Path) -> tuple[list[Path], list[Path], list[str]]:
    """(inputs, validation inputs, data_prep's split flags), as the README's download step leaves them."""
    raw.mkdir(parents=True)
    if preset == "criteo-kaggle":  # train.txt of dac.tar.gz: 7 days in one file, the last one validates
        sh(VENV_PY, "-m", "data_prep", "synth", "--rows", "7000", "--seed", "5", "--out", raw / "train.txt")
        return [raw / "train.txt"], [], ["--valid-fraction", "0.142857"]
    days = []
    for d in range(4):  # day_0.gz .. day_3.gz: days 0-2 train, day 3 stands for day_23
        plain = raw / f"day_{d}"
        sh(VENV_PY, "-m", "data_prep", "synth", "--rows", "2000", "--seed", "5", "--day", str(d), "--drift", "0.05",
           "--out", plain)
        (raw / f"day_{d}.gz").write_bytes(gzip.compress(plain.read_bytes(), compresslevel=1))
        plain.unlink()
        days.append(raw / f"day_{d}.gz")
    return days[:-1], days[-1:], ["--valid-input", *map(str, days[-1:])]


@pytest.mark.parametrize("preset", ["criteo-kaggle", "criteo-terabyte"])
def test_quickstart_end_to_end(preset, tmp_path):
    config = REPO / "slurm" / "configs" / f"{preset}.toml"
    inputs, valid_inputs, split = download_stand_in(preset, tmp_path / "raw")
    data, run, export = tmp_path / "data", tmp_path / "run", tmp_path / "export"
    # preprocess (prep.sbatch's payload, in one process here)
    sh(VENV_PY, "-m", "data_prep", "criteo", "--input", *inputs, *split, "--out", data, "--shards", "4")
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["totals"]["valid"]["rows"] == (1000 if preset == "criteo-kaggle" else 2000)
    # plan
    out = sh(VENV_PY, "-m", "hvctr", "plan", "--config", config, "--data", data,
             "--map", REPO / "slurm" / "hwmaps" / "vm-2cpu.toml", "--ranks-per-node", "2",
             "--data.batch_size_per_rank", "128")
    assert "hvctr plan" in out
    # train (train.sbatch's payload; both override spellings)
    out = sh(*MPIRUN, "-m", "hvctr", "train", "--config", config, "--data.train_dir", data,
             f"--train.run_dir={run}", *SMALL, timeout=180)
    assert "validation at step" in out and " eta " in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval"]["auc"] > 0.55 and 0 < summary["eval"]["ne"] < 1, summary["eval"]  # a few steps
    evals = [e for e in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if e["event"] == "eval"]
    assert len(evals) >= 3 and evals[-1]["final"] and not evals[0]["final"]  # during training, and at the end
    # evaluate (eval.sbatch's payload): the newest checkpoint gives the training's own figures
    sh(*MPIRUN, "-m", "hvctr", "eval", "--run-dir", run)
    ev = json.loads((run / "eval-valid.json").read_text())
    assert ev["auc"] == pytest.approx(summary["eval"]["auc"], abs=1e-12)
    # export, then the report
    sh(VENV_PY, "-m", "hvctr", "export", "--run-dir", run, "--out", export)
    assert (export / "manifest.json").is_file()
    out = sh(VENV_PY, "-m", "hvctr", "report", "--run-dir", run)
    assert (run / "report.png").stat().st_size > 10_000 and "validation during training:" in out
    assert "summary" in out and "NE" in out
