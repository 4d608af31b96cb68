"""Damaged gzip input and an unwritable output are input errors, not tracebacks.

- A truncated or corrupt gzip file, in data_prep criteo and in hvctr score: one message naming
  the file and the compressed byte offset where it broke; exit 2; no .tmp file left.
- A directory given as an input file is named as such.
- hvctr score --out in a directory that cannot take it: one message naming --out.
"""

from __future__ import annotations

import argparse
import gzip
import subprocess

import pytest

from data_prep.synth import generate
from hvctr.formats.sources import open_sources
from hvctr.offline import score
from tests.conftest import REPO, VENV_PY, mpi_env


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gz")
    generate(20000, seed=3, out=str(root / "in.tsv"))
    data = gzip.compress((root / "in.tsv").read_bytes())
    (root / "truncated.tsv.gz").write_bytes(data[: len(data) // 2])
    corrupt = bytearray(data)
    for i in range(len(data) // 2, len(data) // 2 + 64):
        corrupt[i] ^= 0xFF
    (root / "corrupt.tsv.gz").write_bytes(bytes(corrupt))
    return root


@pytest.mark.parametrize("case,why", [("truncated", "truncated"), ("corrupt", "corrupt")])
def test_data_prep_names_the_damaged_gzip_and_leaves_no_tmp(inputs, tmp_path, case, why):
    out = tmp_path / "out"
    r = subprocess.run([VENV_PY, "-m", "data_prep", "criteo", "--input", str(inputs / f"{case}.tsv.gz"),
                        "--out", str(out), "--shards", "2"], cwd=REPO, env=mpi_env(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"{inputs / f'{case}.tsv.gz'}: {why} gzip input" in errors[0] and "at compressed byte" in errors[0]
    assert [p for p in out.rglob("*.tmp")] == []


def test_hvctr_score_names_the_damaged_gzip_and_leaves_no_out(inputs, tmp_path, monkeypatch):
    class Model:
        batch_size = 512
        multi_valued = None  # the export's data had one value a field

        def logits(self, dense, keys):
            import torch
            return torch.zeros(dense.shape[0])

    monkeypatch.setattr(score, "ExportedModel", lambda path: Model())
    out = tmp_path / "scores.txt"
    args = argparse.Namespace(model="m", input=str(inputs / "truncated.tsv.gz"), out=str(out), batch_size=0, threads=1)
    with pytest.raises(ValueError, match=r"truncated.tsv.gz: truncated gzip input: .* \(at compressed byte "):
        score.run(args, [])
    assert list(tmp_path.iterdir()) == []
    args.input, args.out = str(inputs / "in.tsv"), str(tmp_path / "no-such-dir" / "scores.txt")
    with pytest.raises(ValueError, match=rf"--out {args.out}: cannot write it: No such file or directory"):
        score.run(args, [])


def test_a_directory_as_input_is_named(tmp_path):
    with pytest.raises(ValueError, match=rf"{tmp_path}: a directory, not an input file"):
        open_sources([str(tmp_path)])
