"""``data_prep criteo --shards S`` for fewer rows than S (issue 28, item 10): 2,000 rows and
--shards 100000 made 200,000 files without a word, most of them empty (a training rank reads
whole shards, so a rank of empty ones trains nothing).

- plain inputs: refused before anything is parsed or written, from their size (a line is at
  least 41 bytes), naming the bound;
- gzip inputs (their line count is known after the parse): refused after the parse, before any
  shard file, with the exact row count; what was parsed is removed, so the same --out takes the
  next attempt.
"""

from __future__ import annotations

import gzip
import subprocess

import pytest

from data_prep.synth import generate
from tests.conftest import REPO, VENV_PY, mpi_env


@pytest.fixture(scope="module")
def rows_2000(tmp_path_factory):
    root = tmp_path_factory.mktemp("rows")
    generate(2000, seed=3, out=str(root / "in.tsv"))
    (root / "in.tsv.gz").write_bytes(gzip.compress((root / "in.tsv").read_bytes()))
    return root


def data_prep(inp, out, shards) -> subprocess.CompletedProcess:
    return subprocess.run([VENV_PY, "-m", "data_prep", "criteo", "--input", str(inp), "--out", str(out),
                           "--shards", str(shards)], cwd=REPO, env=mpi_env(), capture_output=True, text=True,
                          timeout=300)


def error(r) -> str:
    lines = [line for line in r.stderr.splitlines() if "error" in line]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_more_shards_than_a_plain_input_can_fill_is_refused_before_anything_is_written(rows_2000, tmp_path):
    out = tmp_path / "out"
    inp = rows_2000 / "in.tsv"
    most = inp.stat().st_size // 41
    assert error(data_prep(inp, out, 100_000)) == (
        f"data_prep criteo: error: --shards 100,000: the --input files ({inp.stat().st_size:,} bytes) hold at most "
        f"{most:,} lines (a line is at least 41 bytes), so most train shards would be empty (a training rank reads "
        f"whole shards): use --shards {most:,} or fewer")
    assert not out.exists()


def test_more_shards_than_rows_of_a_gzip_input_is_refused_before_any_shard_and_leaves_out_reusable(rows_2000,
                                                                                                   tmp_path):
    out = tmp_path / "out"
    assert error(data_prep(rows_2000 / "in.tsv.gz", out, 5000)) == (
        "data_prep criteo: error: --shards 5,000: the input holds 2,000 training rows, so 3,000 of the 5,000 train "
        "shards would be empty (a training rank reads whole shards): no shard was written; use --shards 2,000 or "
        "fewer")
    assert sorted(p.name for p in out.iterdir()) == ["data_prep.lock"]  # the pieces and manifest removed
    r = data_prep(rows_2000 / "in.tsv.gz", out, 8)  # the same --out, another --shards: no "different job"
    assert r.returncode == 0, r.stderr
    assert len(list(out.glob("train-*.h5"))) == 8
