"""``data_prep criteo`` as users run it: under mpirun -np 1/2/3, killed and resumed, on real rows."""

from __future__ import annotations

import gzip
import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from hvctr import formats
from data_prep.synth import generate
from tests.conftest import TEST_DATA, VENV_PY, mpi_env, shard_checksums

SAMPLE = TEST_DATA / "criteo_sample_400.tsv"


def criteo_cmd(np_: int, *args) -> list[str]:
    """np_ = 0: a plain process without mpirun."""
    launch = ["mpirun", "-np", str(np_), "--bind-to", "none", VENV_PY, "-m", "mpi4py"] if np_ else [VENV_PY]
    return [*launch, "-m", "data_prep", "criteo", *map(str, args)]


def criteo(np_: int, *args, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(criteo_cmd(np_, *args), env=mpi_env(), capture_output=True, text=True, timeout=300)
    if check and r.returncode != 0:
        raise AssertionError(f"data_prep failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())



@pytest.fixture(scope="module")
def mixed_inputs(tmp_path_factory) -> list[Path]:
    """A plain TSV (many byte-range units), a gzip TSV (one unit), a DeepCTR CSV."""
    root = tmp_path_factory.mktemp("inputs")
    generate(60_000, seed=21, out=str(root / "a.tsv"))
    generate(20_000, seed=22, out=str(root / "b.tsv"))
    (root / "b.tsv.gz").write_bytes(gzip.compress((root / "b.tsv").read_bytes(), compresslevel=1))
    generate(10_000, seed=23, out=str(root / "c.tsv"))
    with open(root / "c.tsv") as src, open(root / "c.csv", "w") as dst:
        dst.write(",".join(formats.COLUMN_NAMES) + "\n")
        for line in src:
            f = line.rstrip("\n").split("\t")
            dst.write(",".join(x + ".0" if 1 <= c <= 13 and x else x for c, x in enumerate(f)) + "\n")
    return [root / "a.tsv", root / "b.tsv.gz", root / "c.csv"]


def test_same_shards_for_1_2_3_processes(tmp_path, mixed_inputs):
    sums = {}
    for np_ in (0, 1, 2, 3):
        out = tmp_path / f"np{np_}"
        r = criteo(np_, "--input", *mixed_inputs, "--out", out, "--shards", 7, "--valid-fraction", 0.1,
                   "--chunk-mb", 1)
        m = manifest(out)
        assert m["state"] == "complete" and m["sessions"][-1]["processes"] == max(np_, 1)
        assert m["totals"]["rows"] == 90_000 and m["totals"]["bad_lines"] == 0
        assert m["job"]["units"] > 10  # the plain file really is split into byte ranges
        sums[np_] = shard_checksums(m)
        # progress on rank 0: rows/s, bytes, ETA
        assert "rows/s" in r.stdout and "MB" in r.stdout and "ETA" in r.stdout
    assert sums[0] == sums[1] == sums[2] == sums[3]


@pytest.fixture(scope="module")
def big_input(tmp_path_factory) -> tuple[Path, dict]:
    """A file large enough to be killed in the middle, and its uninterrupted output."""
    root = tmp_path_factory.mktemp("big")
    generate(2_000_000, seed=31, out=str(root / "big.tsv"))  # parse lasts several manifest flushes (0.5 s apart)
    criteo(0, "--input", root / "big.tsv", "--out", root / "ref", "--shards", 16, "--valid-fraction", 0.05,
           "--chunk-mb", 1)
    return root / "big.tsv", shard_checksums(manifest(root / "ref"))


def run_until(cmd: list[str], out: Path, ready) -> None:
    """Starts the job and SIGKILLs all its processes once the manifest satisfies ready()."""
    p = subprocess.Popen(cmd, env=mpi_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if ready(manifest(out)):
                    break
            except (FileNotFoundError, json.JSONDecodeError):
                pass
            assert p.poll() is None, "the job ended before it could be killed"
            time.sleep(0.005)
    finally:
        # mpirun puts its ranks in process groups of their own: kill the whole tree, by pid
        procs = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
        psutil.wait_procs(procs, timeout=30)
        p.wait()


@pytest.mark.parametrize("phase, np_killed, np_resumed", [("parse", 2, 0), ("assemble", 1, 3)])
def test_killed_and_resumed_equals_uninterrupted(tmp_path, big_input, phase, np_killed, np_resumed):
    tsv, ref = big_input
    args = ["--input", tsv, "--out", tmp_path / "out", "--shards", 16, "--valid-fraction", 0.05, "--chunk-mb", 1]
    if phase == "parse":
        ready = lambda m: sum(u is not None for u in m["units"]) >= 3
    else:
        ready = lambda m: m["phase"] == "assemble"
    for attempt in range(3):
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
        run_until(criteo_cmd(np_killed, *args), tmp_path / "out", ready)
        m = manifest(tmp_path / "out")
        done_before = sum(u is not None for u in m["units"])
        # Rank 0 rewrites the manifest at most every max(0.5 s, 50 x a rewrite's cost): on a loaded
        # machine the first rewrite after the phase starts can already hold every parse unit, and
        # then there is no middle of the parse to kill in. Only that case is run again.
        if phase != "parse" or done_before < len(m["units"]):
            break
    assert m["state"] == "in_progress"
    r = criteo(np_resumed, *args)
    assert "resuming" in r.stdout
    m = manifest(tmp_path / "out")
    assert m["state"] == "complete" and len(m["sessions"]) == 2
    sessions = [u["session"] for u in m["units"]]
    assert sessions.count(1) == done_before > 0  # what was recorded was kept, not redone
    if phase == "parse":
        assert 2 in sessions
    assert shard_checksums(m) == ref
    assert not list((tmp_path / "out").glob("*.tmp")) and not (tmp_path / "out" / "_work").exists()


def test_real_rows_parse_with_no_rejects(tmp_path):
    criteo(2, "--input", SAMPLE, "--out", tmp_path / "out", "--shards", 2, "--chunk-mb", 1 / 16)
    m = manifest(tmp_path / "out")
    assert m["job"]["units"] == 2
    assert m["totals"]["bad_lines"] == 0 and m["bad_lines"] == [] and m["totals"]["rows"] == 400


def test_planted_bad_lines_are_reported_exactly(tmp_path):
    lines = SAMPLE.read_text().splitlines()
    good = lines[0].split("\t")
    planted = {  # 1-based line number in the new file -> the bad line
        1: "\t".join(good[:-1]),  # a field short
        57: "\t".join(good[:5] + ["12x"] + good[6:]),  # a non-integer in I5
        200: "\t".join(["2"] + good[1:]),  # not a label
        281: "",  # an empty line
        333: "\t".join(good + ["extra"]),  # a field too many
        405: "\t".join(good[:3] + ["4.5"] + good[4:]),  # a fraction in I3, the last line
    }
    for i in sorted(planted):
        lines.insert(i - 1, planted[i])
    bad = tmp_path / "bad.tsv"
    bad.write_text("\n".join(lines) + "\n")
    r = criteo(2, "--input", bad, "--out", tmp_path / "out", "--shards", 2, "--chunk-mb", 1 / 16)
    m = manifest(tmp_path / "out")
    assert [(b["file"], b["line"]) for b in m["bad_lines"]] == [(str(bad), i) for i in sorted(planted)]
    assert m["totals"]["bad_lines"] == 6 and m["totals"]["rows"] == 400
    assert f"{bad}:57: I5: not an integer: '12x'" in r.stdout  # the first few are printed
    r = criteo(2, "--input", bad, "--out", tmp_path / "strict", "--shards", 2, "--strict", check=False)
    assert r.returncode != 0
    assert f"{bad}:1: expected 40 fields, found 39" in r.stderr


def test_clear_errors_under_mpirun(tmp_path):
    (tmp_path / "empty.tsv").write_bytes(b"")
    (tmp_path / "file").write_text("x")
    for args, msg in (
        (["--input", tmp_path / "missing.tsv"], f"{tmp_path / 'missing.tsv'}: input file not found"),
        (["--input", tmp_path / "empty.tsv"], f"{tmp_path / 'empty.tsv'}: empty input"),
        (["--input", SAMPLE, "--out", tmp_path / "file" / "out"], "output directory is not writable"),
    ):
        if "--out" not in args:
            args += ["--out", tmp_path / "out"]
        r = criteo(2, *args, "--shards", 2, check=False)
        assert r.returncode != 0 and msg in r.stderr
        assert r.stderr.count("error:") == 1  # said once, by rank 0
