"""Multi-valued fields as users make and preprocess them: ``data_prep synth --multi-hot`` then
``data_prep criteo --multi-valued`` under mpirun; every row in exactly one shard with exactly its
keys, the same shards for any process count, killed and resumed."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest

from hvctr import formats
from tests.conftest import VENV_PY, shard_checksums
from tests.e2e.test_data_prep_criteo import criteo, criteo_cmd, manifest, run_until

MULTI_HOT = "C3=5,C7=3,C21=12,C26=4"
FIELDS = "C3,C7,C21,C26"
MULTI = [2, 6, 20, 25]
ROWS = 20_000
TOO_LONG = 1 + ROWS // 2  # 1-based line numbers of the planted lines
BAD_INT = 2 + ROWS // 2


@pytest.fixture(scope="module")
def tsv(tmp_path_factory) -> Path:
    """synth --multi-hot as a user runs it, with two planted lines: a field of too many values, a bad integer."""
    root = tmp_path_factory.mktemp("mv")
    r = subprocess.run([VENV_PY, "-m", "data_prep", "synth", "--rows", str(ROWS), "--seed", "12", "--out",
                        str(root / "raw.tsv"), "--multi-hot", MULTI_HOT],
                       capture_output=True, text=True, timeout=300, check=True)
    assert f"--multi-valued {FIELDS}" in r.stdout  # the printed next step names the fields
    lines = (root / "raw.tsv").read_bytes().split(b"\n")[:-1]
    cols = lines[0].split(b"\t")
    long_line = b"\t".join(cols[:14 + 20] + [b",".join([b"ab"] * (formats.MAX_FIELD_KEYS + 1))] + cols[15 + 20:])
    bad_int = b"\t".join(cols[:3] + [b"x7"] + cols[4:])
    lines[TOO_LONG - 1:TOO_LONG - 1] = [long_line, bad_int]
    (root / "in.tsv").write_bytes(b"\n".join(lines) + b"\n")
    return root / "in.tsv"


def run_args(tsv: Path, out: Path) -> list:
    return ["--input", tsv, "--out", out, "--shards", 5, "--valid-fraction", 0.1, "--chunk-mb", 1 / 16,
            "--piece-lines", 1500, "--multi-valued", FIELDS]


@pytest.fixture(scope="module")
def outputs(tsv, tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("mv_out")
    for np_ in (0, 2):
        criteo(np_, *run_args(tsv, root / f"np{np_}"))
    return {np_: root / f"np{np_}" for np_ in (0, 2)}


def expected_rows(tsv: Path) -> list[tuple[int, float, list[int], list[int]]]:
    """Per good line, the reference: (global line index, label, lengths [26], keys), computed line by
    line in Python (8-hex values by the hex rule in one numpy call, any other by formats.key_of)."""
    rows, hex_at, hex_field, hex_value = [], [], [], []
    for g, line in enumerate(tsv.read_text().splitlines()):
        f = line.split("\t")
        if g + 1 in (TOO_LONG, BAD_INT):
            continue
        lengths, keys = [], []
        for c in range(formats.NUM_FIELDS):
            text = f[1 + formats.NUM_DENSE + c]
            tokens = [t for t in text.split(",") if t] if c in MULTI else [text]
            lengths.append(len(tokens))
            for t in tokens:
                if len(t) == 8:
                    hex_at.append((len(rows), len(keys)))
                    hex_field.append(c)
                    hex_value.append(int(t, 16))
                    keys.append(None)
                else:
                    keys.append(formats.key_of(c, t))
        rows.append((g, float(f[0]), lengths, keys))
    hk = formats.hex_keys(np.array(hex_field, dtype=np.uint64), np.array(hex_value, dtype=np.uint64))
    for (r, k), key in zip(hex_at, hk.tolist()):
        rows[r][3][k] = key
    return rows


def test_every_row_is_in_one_shard_with_exactly_its_keys(tsv, outputs):
    out = outputs[2]
    m = manifest(out)
    assert m["state"] == "complete" and m["format_version"] == formats.MULTI_VALUED_VERSION
    assert m["multi_valued"] == {"fields": MULTI, "separator": ","}
    assert m["job"]["multi_valued"] == m["multi_valued"] and m["sessions"][-1]["processes"] == 2
    assert m["job"]["units"] > 10  # many byte ranges, and pieces of 1500 lines: rows are moved between them
    # the planted lines: rejected, each with its reason, by file and line
    bad = {b["line"]: b["reason"] for b in m["bad_lines"]}
    assert bad == {TOO_LONG: f"C21: {formats.MAX_FIELD_KEYS + 1:,} values, more than {formats.MAX_FIELD_KEYS:,} "
                             "(the most one field of a row holds)",
                   BAD_INT: "I3: not an integer: 'x7'"}
    S, cutoff = m["job"]["shards"], m["split"]["cutoff_line"]
    want = {(split, s): [] for split in formats.SPLITS for s in range(S)}
    for g, label, lengths, keys in expected_rows(tsv):
        want["valid" if g >= cutoff else "train", g % S].append((label, lengths, keys))
    total = 0
    for split in formats.SPLITS:
        for s in range(S):
            rec = m["shards"][split][s]
            with h5py.File(out / rec["file"], "r") as f:
                assert f.attrs["format_version"] == formats.MULTI_VALUED_VERSION
                data = {name: f[name][...] for name in formats.MULTI_VALUED_DATASETS}
            assert set(rec["checksums"]) == set(formats.MULTI_VALUED_DATASETS)
            for name, arr in data.items():
                assert rec["checksums"][name] == "sha256:" + hashlib.sha256(np.ascontiguousarray(arr)).hexdigest()
            lengths, offsets, keys = data["lengths"], data["offsets"], data["keys"]
            assert lengths.dtype == np.uint16 and offsets.dtype == np.int64 and keys.dtype == np.uint64
            assert offsets[0] == 0 and np.array_equal(np.diff(offsets), lengths.sum(axis=1))
            assert offsets[-1] == len(keys) == rec["keys"] == int(lengths.sum())
            rows = want[split, s]  # in line order, each with exactly its keys
            assert rec["rows"] == len(rows) == len(data["labels"])
            assert data["labels"].tolist() == [r[0] for r in rows]
            assert lengths.tolist() == [r[1] for r in rows]
            assert keys.tolist() == [k for r in rows for k in r[2]]
            total += len(keys)
    assert m["totals"]["rows"] == ROWS and m["totals"]["keys"] == total
    assert m["totals"]["bad_lines"] == 2
    one = [c for c in range(formats.NUM_FIELDS) if c not in MULTI]
    assert all(r[1][c] == 1 for rows in want.values() for r in rows for c in one)
    assert any(r[1][c] == 0 for rows in want.values() for r in rows for c in MULTI)  # empty bags


def test_the_shards_do_not_depend_on_the_process_count(outputs):
    a, b = manifest(outputs[0]), manifest(outputs[2])
    assert shard_checksums(a) == shard_checksums(b)
    assert [r["keys"] for r in a["shards"]["train"]] == [r["keys"] for r in b["shards"]["train"]]
    assert a["totals"] == b["totals"]


def test_other_multi_valued_options_are_another_job(tsv, outputs, tmp_path):
    out = outputs[0]
    args = run_args(tsv, out)
    for change in (["--multi-valued", "C3,C7"], ["--multi-valued", ""], ["--value-separator", "|"]):
        i = args.index(change[0]) if change[0] in args else len(args)
        r = criteo(0, *args[:i], *change, *args[i + 2:], check=False)
        assert r.returncode == 2 and "holds the output of a different job (multi_valued:" in r.stderr, r.stderr
    r = criteo(0, *args)  # the same options: complete already
    assert "already complete" in r.stdout
    r = criteo(2, "--input", tsv, "--out", tmp_path / "x", "--shards", 2, "--format", "csv",
               "--multi-valued", "C3", check=False)
    assert r.returncode == 2 and "--value-separator ',' is the column separator of CSV input" in r.stderr
    r = criteo(2, "--input", tsv, "--out", tmp_path / "x", "--shards", 2, "--multi-valued", "C3,D4", check=False)
    assert r.returncode == 2 and "--multi-valued: unknown field 'D4'" in r.stderr
    r = criteo(2, "--input", tsv, "--out", tmp_path / "x", "--shards", 2, "--value-separator", "|", check=False)
    assert r.returncode == 2 and "--value-separator '|' without --multi-valued" in r.stderr  # not silently ignored
    assert r.stderr.count("error:") == 1  # said once, by rank 0


@pytest.fixture(scope="module")
def big(tsv, tmp_path_factory) -> tuple[Path, dict]:
    """A file long enough to be killed in the middle of its parse (the small one, 30 times), and
    its uninterrupted output."""
    root = tmp_path_factory.mktemp("mv_big")
    body = tsv.read_bytes()
    with open(root / "big.tsv", "wb") as f:
        for _ in range(30):
            f.write(body)
    criteo(0, *big_args(root / "big.tsv", root / "ref"))
    return root / "big.tsv", shard_checksums(manifest(root / "ref"))


def big_args(tsv: Path, out: Path) -> list:
    return ["--input", tsv, "--out", out, "--shards", 4, "--valid-fraction", 0.05, "--chunk-mb", 1,
            "--piece-lines", 20_000, "--multi-valued", FIELDS]


def test_killed_in_the_parse_and_resumed_equals_uninterrupted(tmp_path, big):
    tsv, ref = big
    out = tmp_path / "out"
    for attempt in range(3):  # as test_data_prep_criteo's: only a kill after the whole parse is retried
        shutil.rmtree(out, ignore_errors=True)
        run_until(criteo_cmd(2, *big_args(tsv, out)), out, lambda m: sum(u is not None for u in m["units"]) >= 3)
        m = manifest(out)
        done_before = sum(u is not None for u in m["units"])
        if done_before < len(m["units"]):
            break
    assert m["state"] == "in_progress" and m["format_version"] == formats.MULTI_VALUED_VERSION
    assert all("keys" in p for u in m["units"] if u for p in u["pieces"])  # the pieces record their keys
    r = criteo(0, *big_args(tsv, out))
    assert re.search(r"resuming .*: \d+ of \d+ units recorded as parsed", r.stdout)
    m = manifest(out)
    assert m["state"] == "complete" and len(m["sessions"]) == 2
    sessions = [u["session"] for u in m["units"]]
    assert sessions.count(1) == done_before > 0 and 2 in sessions
    assert shard_checksums(m) == ref
    assert not list(out.glob("*.tmp")) and not (out / "_work").exists()
