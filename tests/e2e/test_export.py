"""hvctr export and hvctr score: the served model predicts what the trainer predicts, row for row.

A 2-rank run is exported; ``hvctr score`` reads only the export and scores a file that mixes
rows of the training day with rows of a later day (many keys training never stored). The
reference is the trainer itself under mpirun (tests/e2e/trainer_predict.py): a Trainer rebuilt
from the run's checkpoint, its table's read-only pulls and its model, in the same batches.
Equality is exact, with admission off (unseen keys read their init row) and on (the shared
default row, also for keys seen too rarely to be stored).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest

from hvctr.formats.lines import RowFormat, parse_block
from hvctr.checkpoint.format import read_manifest, write_manifest
from hvctr.cli import main
from hvctr.formats import owner_of
from tests.conftest import REPO, VENV_PY, mpi_env
from tests.e2e.days import make_day
from tests.e2e.helpers import final_model, train


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("export")
    train_dir, day0 = make_day(root, 0, 12000)
    _, day1 = make_day(root, 1, 1000, shards=0)
    mixed = root / "mixed.tsv"  # 800 rows of the training day, 1000 of the next
    mixed.write_bytes(b"".join(day0.read_bytes().splitlines(keepends=True)[:800]) + day1.read_bytes())
    return train_dir, mixed


def trainer_predictions(run: Path, tsv: Path, batch_size: int, out: Path) -> np.ndarray:
    cmd = ["mpirun", "-np", "2", "--bind-to", "none", VENV_PY, "-m", "mpi4py", str(REPO / "tests/e2e/trainer_predict.py"),
           "--run-dir", str(run), "--input", str(tsv), "--batch-size", str(batch_size), "--out", str(out)]
    r = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return np.load(out)


def check_export_matches_checkpoint(run: Path, exp: Path, dim: int) -> int:
    """The export holds the checkpoint's model columns and dense parameters, nothing else."""
    manifest = json.loads((exp / "manifest.json").read_text())
    dense, sparse = final_model(run)
    seen = []
    for rank in range(manifest["world_size"]):
        with h5py.File(exp / "sparse" / f"rank-{rank:05d}.h5", "r") as f:
            keys, weights, owner = f["keys"][...], f["weights"][...], f["bucket_owner"][...]
            assert f["keys"].chunks is None and f["weights"].chunks is None  # contiguous: mappable by offset
        assert np.all(keys[1:] > keys[:-1]), "keys sorted, each once"
        assert np.all(owner_of(keys, owner) == rank)
        assert weights.shape == (keys.size, dim + 1)  # w | w1, no optimiser state
        assert np.array_equal(weights, np.stack([sparse[k][:dim + 1] for k in keys.tolist()]))
        seen.append(keys)
    assert sorted(np.concatenate(seen).tolist()) == sorted(sparse)
    with h5py.File(exp / "dense.h5", "r") as f:
        assert list(f) == manifest["dense"] and manifest["dense"][0] == "mlp.0.weight"
        for i, name in enumerate(manifest["dense"]):
            assert np.array_equal(f[name][...], dense[f"param.{i:03d}"])
    return len(sparse)


@pytest.mark.parametrize("admit_after", [0, 2], ids=["admission-off", "admission-on"])
def test_scores_equal_the_trainers_row_for_row(data, tmp_path, admit_after):
    train_dir, mixed = data
    run, exp, pred = tmp_path / "run", tmp_path / "export", tmp_path / "pred.txt"
    train(2, run, train_dir, "--merge.every_k_steps=4", f"--storage.admit_after={admit_after}")
    assert main(["export", "--run-dir", str(run), "--out", str(exp)]) == 0
    stored = check_export_matches_checkpoint(run, exp, dim=8)
    assert main(["export", "--run-dir", str(run), "--out", str(exp)]) == 2  # never overwritten

    assert main(["score", "--model", str(exp), "--input", str(mixed), "--out", str(pred)]) == 0
    got = np.loadtxt(pred, dtype=np.float32)
    ref = trainer_predictions(run, mixed, 256, tmp_path / "ref.npy")  # 256: the run's batch size
    assert got.shape == ref.shape == (1800,)
    assert np.array_equal(got, ref), f"{np.count_nonzero(got != ref)} rows differ"

    # The unseen-key rule was exercised: many keys of the file are in no table.
    keys = np.unique(parse_block(mixed.read_bytes(), RowFormat.tsv()).keys)
    _, sparse = final_model(run)
    unseen = np.count_nonzero(~np.isin(keys, np.fromiter(sparse, np.uint64, len(sparse))))
    assert unseen > 1000 and stored > 1000
    # ... and it matters: the other rule gives other scores.
    manifest = read_manifest(exp / "manifest.json")
    manifest["unseen_keys"]["row"] = "init" if admit_after > 1 else "default"
    write_manifest(exp / "manifest.json", manifest)  # an edit, sealed again: a bare edit is damage
    assert main(["score", "--model", str(exp), "--input", str(mixed), "--out", str(tmp_path / "other.txt")]) == 0
    assert not np.array_equal(np.loadtxt(tmp_path / "other.txt", dtype=np.float32), ref)


def test_score_rejects_a_corrupt_export_and_a_bad_line(data, tmp_path, capsys):
    train_dir, mixed = data
    run, exp = tmp_path / "run", tmp_path / "export"
    train(2, run, train_dir, "--train.max_steps=4")
    assert main(["export", "--run-dir", str(run), "--out", str(exp)]) == 0
    bad = tmp_path / "bad.tsv"
    lines = mixed.read_bytes().splitlines(keepends=True)
    bad.write_bytes(b"".join(lines[:5]) + b"1\t2\tthree\n" + b"".join(lines[5:10]))
    assert main(["score", "--model", str(exp), "--input", str(bad)]) == 2
    assert f"{bad}:6:" in capsys.readouterr().err
    with open(exp / "sparse" / "rank-00001.h5", "r+b") as f:
        f.seek(-8, 2)
        f.write(b"\0\1\2\3\4\5\6\7")
    assert main(["score", "--model", str(exp), "--input", str(mixed)]) == 2
    assert "rank-00001.h5 is missing or does not match its checksum" in capsys.readouterr().err
    text = (exp / "manifest.json").read_text()  # an edit that keeps the JSON valid
    (exp / "manifest.json").write_text(text.replace('"batch_size": ', '"batch_size": 1', 1))
    assert main(["score", "--model", str(exp), "--input", str(mixed)]) == 2
    assert "manifest.json does not match its own checksum" in capsys.readouterr().err


def test_compressed_rows_score_close_to_float32(data, tmp_path, capsys):
    """--rows fp16 / int8: the manifest and the files say the format, the rows' bytes shrink
    (int8 at dim 8: 13 bytes a row against 36), the scores stay close to the float32 export's;
    an export whose row_format this hvctr does not know is refused by name."""
    train_dir, mixed = data
    run = tmp_path / "run"
    train(2, run, train_dir, "--train.max_steps=16")
    preds, manifests = {}, {}
    for rows in ("fp32", "fp16", "int8"):
        exp = tmp_path / f"export-{rows}"
        assert main(["export", "--run-dir", str(run), "--out", str(exp), "--rows", rows]) == 0
        manifests[rows] = m = read_manifest(exp / "manifest.json")
        with h5py.File(exp / "sparse" / "rank-00000.h5", "r") as f:
            assert f.attrs["row_format"] == m["row_format"]
            assert f["weights"].dtype == {"fp32": np.float32, "fp16": np.float16, "int8": np.uint8}[rows]
        assert main(["score", "--model", str(exp), "--input", str(mixed), "--out", str(tmp_path / f"{rows}.txt")]) == 0
        preds[rows] = np.loadtxt(tmp_path / f"{rows}.txt")
    assert [manifests[r]["row_format"] for r in preds] == ["float32", "float16", "int8"]
    n = manifests["fp32"]["rows"]
    assert manifests["fp32"]["row_bytes"] == n * 9 * 4 and manifests["fp16"]["row_bytes"] == n * 9 * 2
    assert manifests["int8"]["row_bytes"] == n * (9 + 4)
    assert np.abs(preds["fp16"] - preds["fp32"]).max() < 1e-3
    assert np.abs(preds["int8"] - preds["fp32"]).max() < 1e-2
    assert not np.array_equal(preds["int8"], preds["fp32"])  # the rows were read as quantised

    exp = tmp_path / "export-int8"
    m = manifests["int8"]
    m["row_format"] = "int4"
    write_manifest(exp / "manifest.json", m)
    capsys.readouterr()
    assert main(["score", "--model", str(exp), "--input", str(mixed)]) == 2
    assert "row_format 'int4' is not one this hvctr reads (float32, float16, int8)" in capsys.readouterr().err
