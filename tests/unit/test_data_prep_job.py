"""The criteo job in one process: units, pieces, shard rule, split, manifest, errors."""

from __future__ import annotations

import gzip
import random
from pathlib import Path

import h5py
import numpy as np
import pytest

from hvctr import formats
from hvctr.formats.lines import RowFormat, parse_block
from data_prep.pieces import KeySketch, piece_shard_counts
from hvctr.formats.sources import Unit, assign_units, iter_blocks, make_units, open_sources
from data_prep.synth import generate
from tests.conftest import run_data_prep, shard_checksums
from hvctr.formats import mix64


@pytest.fixture(scope="module")
def tsv(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("in") / "synth.tsv"
    generate(6000, seed=7, out=str(path))
    return path


def run(inputs, out: Path, shards=3, **kw) -> dict:
    return run_data_prep(inputs, out, shards, **kw)



def read_split(out: Path, m: dict, split: str) -> list[dict[str, np.ndarray]]:
    shards = []
    for rec in m["shards"][split]:
        with h5py.File(out / rec["file"], "r") as f:
            shards.append({k: f[k][...] for k in ("labels", "dense", "keys")})
    return shards


def test_piece_counts_match_brute_force():
    rnd = random.Random(0)
    for _ in range(300):
        S, lines, offset = rnd.randint(1, 9), rnd.randint(0, 60), rnd.randint(0, 500)
        cutoff = rnd.randint(offset - 5, offset + lines + 5)
        bad = np.array(sorted(rnd.sample(range(lines), rnd.randint(0, lines))) if lines else [], dtype=np.int64)
        train, valid = piece_shard_counts(offset, lines, bad, S, cutoff)
        want_t, want_v = np.zeros(S, int), np.zeros(S, int)
        for l in set(range(lines)) - set(bad.tolist()):
            g = offset + l
            (want_t if g < cutoff else want_v)[g % S] += 1
        assert train.tolist() == want_t.tolist() and valid.tolist() == want_v.tolist()


def test_key_sketch_estimates_and_merges():
    keys = mix64(np.arange(26 * 40_000, dtype=np.uint64)).reshape(-1, 26)
    a, b, both = KeySketch(), KeySketch(), KeySketch()
    a.update(keys[:25_000])
    b.update(keys[15_000:])
    both.update(keys)
    a.merge(b)
    np.testing.assert_array_equal(a.registers, both.registers)  # union, order-free
    est = both.estimate()
    assert np.all(np.abs(est / 40_000 - 1) < 0.06)
    small = KeySketch()
    small.update(np.repeat(keys[:50], 20, axis=0))  # 50 distinct per field, seen 20 times each
    assert np.all(np.abs(small.estimate() - 50) <= 2)


@pytest.mark.parametrize("chunk", [1 << 16, 100_000, 1 << 30])
def test_units_cover_every_line_once(tmp_path, chunk):
    rnd = random.Random(chunk)
    lines = ["x" * rnd.choice([0, 1, 5, 300, 70_000]) for _ in range(60)]
    path = tmp_path / "lines.tsv"
    path.write_text("\t\n".join(lines) + "\t")  # no final newline; one tab so it sniffs as TSV
    (src,) = open_sources([str(path)])
    got = b"".join(b for u in make_units([src], chunk) for b, _ in iter_blocks(src, u, block_bytes=4096))
    assert got.decode() == "\t\n".join(lines) + "\t\n"


def test_csv_header_and_gzip_are_handled(tmp_path):
    header = ",".join(formats.COLUMN_NAMES)
    (tmp_path / "a.csv").write_text(header + "\n" + "\n".join("1" + "," * 39 for _ in range(5)) + "\n")
    with gzip.open(tmp_path / "b.tsv.gz", "wt") as f:
        f.write("0" + "\t" * 39 + "\n")
    a, b = open_sources([str(tmp_path / "a.csv"), str(tmp_path / "b.tsv.gz")])
    assert a.fmt.kind == "csv" and a.header_lines == 1 and not a.gzip
    assert b.fmt.kind == "tsv" and b.gzip
    units = make_units([a, b], 1 << 16)
    assert [u.source for u in units] == [0, 1]
    assert b"".join(x for x, _ in iter_blocks(a, units[0])).count(b"\n") == 5  # header skipped


def test_assign_units_is_balanced_and_deterministic():
    units = [Unit(i, 0, 0, s) for i, s in enumerate([100, 100, 100, 100, 40, 30, 30])]
    parts = assign_units(units, 2)
    assert parts == assign_units(units, 2)
    assert sorted(u.id for p in parts for u in p) == list(range(7))
    loads = [sum(u.size for u in p) for p in parts]
    assert max(loads) - min(loads) <= 30  # largest first, to the least loaded: within the smallest unit
    assert all([u.id for u in p] == sorted(u.id for u in p) for p in parts)


def test_shard_of_a_row_is_its_global_line_index_mod_s(tmp_path, tsv):
    m = run([tsv, tsv], tmp_path / "out", shards=4, valid_fraction=0.25, chunk_bytes=1 << 16, piece_lines=700)
    whole = parse_block(tsv.read_bytes() * 2, RowFormat.tsv())
    L = whole.num_lines
    cutoff = L - round(0.25 * L)
    assert m["split"]["lines"] == L == 12_000 and m["split"]["cutoff_line"] == cutoff
    for split, rows_of in (("train", whole.lines < cutoff), ("valid", whole.lines >= cutoff)):
        shards = read_split(tmp_path / "out", m, split)
        for s, got in enumerate(shards):
            sel = rows_of & (whole.lines % 4 == s)
            np.testing.assert_array_equal(got["keys"], whole.keys[sel])
            np.testing.assert_array_equal(got["dense"], whole.dense[sel])
            np.testing.assert_array_equal(got["labels"], whole.labels[sel])
    t = m["totals"]
    assert t["rows"] == L and t["train"]["rows"] == cutoff and t["bad_lines"] == 0
    assert t["label_rate"] == pytest.approx(whole.labels.mean())
    assert list(t["missing"].values()) == whole.missing.tolist()
    exact = [len(np.unique(whole.keys[:, f])) for f in range(26)]
    est = [t["distinct_keys_estimate"][c] for c in formats.CAT_NAMES]
    assert all(abs(e - x) <= max(3, 0.06 * x) for e, x in zip(est, exact))
    assert not (tmp_path / "out" / "_work").exists()


def test_output_does_not_depend_on_chunking_or_pieces(tmp_path, tsv):
    small = run([tsv], tmp_path / "small", shards=3, valid_fraction=0.1, chunk_bytes=1 << 16, piece_lines=500)
    big = run([tsv], tmp_path / "big", shards=3, valid_fraction=0.1)
    assert small["job"]["units"] > 10 and big["job"]["units"] == 1
    assert shard_checksums(small) == shard_checksums(big)


def test_gzip_and_deepctr_csv_give_the_same_shards(tmp_path, tsv):
    plain = run([tsv], tmp_path / "plain", shards=2, valid_fraction=0.2)
    gz = tmp_path / "in.tsv.gz"
    gz.write_bytes(gzip.compress(tsv.read_bytes()))
    csv = tmp_path / "in.csv"
    with open(tsv) as src, open(csv, "w") as dst:
        dst.write(",".join(formats.COLUMN_NAMES) + "\n")
        for line in src:
            f = line.rstrip("\n").split("\t")
            dst.write(",".join(x + ".0" if 1 <= c <= 13 and x else x for c, x in enumerate(f)) + "\n")
    assert shard_checksums(run([gz], tmp_path / "gz", shards=2, valid_fraction=0.2)) == shard_checksums(plain)
    csv_run = run([csv], tmp_path / "csv", shards=2, valid_fraction=0.2, chunk_bytes=1 << 16)
    assert shard_checksums(csv_run) == shard_checksums(plain)


def test_bad_lines_are_named_by_file_and_line_in_any_chunk(tmp_path, tsv):
    lines = tsv.read_text().splitlines()
    planted = {150: "1\t2\t3", 2999: "\t".join(["0", "x"] + lines[0].split("\t")[2:]), 5500: ""}
    for i in sorted(planted):  # 1-based line numbers in the new file
        lines.insert(i - 1, planted[i])
    bad_file = tmp_path / "bad.tsv"
    bad_file.write_text("\n".join(lines) + "\n")
    m = run([bad_file], tmp_path / "out", shards=2, chunk_bytes=1 << 16)
    assert [(b["file"], b["line"]) for b in m["bad_lines"]] == [(str(bad_file), i) for i in sorted(planted)]
    assert m["totals"]["bad_lines"] == 3 and m["totals"]["rows"] == 6000
    assert "I1: not an integer: 'x'" in m["bad_lines"][1]["reason"]
    # --strict stops at the first, named the same way (here in a later chunk and piece)
    del lines[149]
    bad_file.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=f"{bad_file}:2998: I1: not an integer: 'x'"):
        run([bad_file], tmp_path / "strict", shards=2, chunk_bytes=1 << 16, strict=True, piece_lines=2000)


def test_clear_errors(tmp_path, tsv):
    with pytest.raises(ValueError, match="nope.tsv: input file not found"):
        run([tmp_path / "nope.tsv"], tmp_path / "o1")
    (tmp_path / "empty.tsv").write_bytes(b"")
    with pytest.raises(ValueError, match="empty.tsv: empty input"):
        run([tmp_path / "empty.tsv"], tmp_path / "o2")
    (tmp_path / "head.csv").write_text(",".join(formats.COLUMN_NAMES) + "\n")
    with pytest.raises(ValueError, match="head.csv: empty input"):
        run([tmp_path / "head.csv"], tmp_path / "o3")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="output directory is not writable"):
        run([tsv], tmp_path / "file" / "out")
    (tmp_path / "junk.tsv").write_text("a\tb\n")
    with pytest.raises(ValueError, match="no valid rows"):
        run([tmp_path / "junk.tsv"], tmp_path / "o4")
    run([tsv], tmp_path / "o5", shards=2)
    with pytest.raises(ValueError, match="different job.*shards: 2 -> 3"):
        run([tsv], tmp_path / "o5", shards=3)
    assert run([tsv], tmp_path / "o5", shards=2)["state"] == "complete"  # a rerun of a done job: nothing to do


def test_valid_input_files_are_the_whole_validation_split(tmp_path, tsv):
    # Criteo Terabyte's split: days 0..22 train, day 23 validates. Here: two "days" of the same
    # generator, the second gzip-compressed and given as --valid-input.
    day = tmp_path / "day_1.gz"
    generate(2000, seed=8, out=str(tmp_path / "day_1"))
    day.write_bytes(gzip.compress((tmp_path / "day_1").read_bytes(), compresslevel=1))
    m = run([tsv], tmp_path / "out", shards=3, valid_inputs=(str(day),))
    assert m["totals"]["train"]["rows"] == 6000 and m["totals"]["valid"]["rows"] == 2000
    assert m["split"]["cutoff_line"] == 6000 and m["split"]["valid_inputs"] == [str(day)]
    valid_labels = np.concatenate([s["labels"] for s in read_split(tmp_path / "out", m, "valid")])
    want = np.loadtxt(tmp_path / "day_1", delimiter="\t", usecols=0)
    assert valid_labels.sum() == want.sum()
    # with a fraction too: the last F of the --input lines join the validation files
    m2 = run([tsv], tmp_path / "out2", shards=3, valid_fraction=0.1, valid_inputs=(str(day),))
    assert m2["totals"]["train"]["rows"] == 5400 and m2["totals"]["valid"]["rows"] == 2600
