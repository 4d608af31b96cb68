"""data_prep criteo at the edges of its input and output (issue 17's last items).

- A UTF-8 BOM at the start of an input (plain or gzip, TSV or CSV) is skipped: the same shards
  as without it.
- A TSV file whose first line is a header (every field a name) has it read as the column names,
  as a CSV header is: the same shards, no bad line, later lines numbered as in the file; a
  header line that does not name the Criteo columns is refused naming the file and line 1.
- Shard files in an output directory without a manifest are refused, named, never overwritten.
- An input modified since the output was made (same size, other content) is not "already
  complete": the job is refused naming the file; a manifest from before mtimes were recorded is
  still complete.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from data_prep.synth import generate
from hvctr import formats
from hvctr.formats.sources import open_sources
from hvctr.offline.score import read_rows
from tests.conftest import run_data_prep, shard_checksums

BOM = b"\xef\xbb\xbf"
HEADER = "\t".join(formats.COLUMN_NAMES).encode()


@pytest.fixture(scope="module")
def tsv(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("in") / "synth.tsv"
    generate(1500, seed=11, out=str(path))
    return path


def run(inputs, out: Path, shards=2, **kw) -> dict:
    return run_data_prep(inputs, out, shards, **kw)



@pytest.fixture(scope="module")
def plain(tsv, tmp_path_factory) -> dict:
    return run([tsv], tmp_path_factory.mktemp("plain") / "out", valid_fraction=0.2)


def test_a_utf8_bom_is_skipped(tmp_path, tsv, plain):
    data = tsv.read_bytes()
    (tmp_path / "bom.tsv").write_bytes(BOM + data)
    m = run([tmp_path / "bom.tsv"], tmp_path / "o1", valid_fraction=0.2, chunk_bytes=1 << 16)
    assert m["totals"]["bad_lines"] == 0 and shard_checksums(m) == shard_checksums(plain)
    (tmp_path / "bom.tsv.gz").write_bytes(gzip.compress(BOM + data, compresslevel=1))
    m = run([tmp_path / "bom.tsv.gz"], tmp_path / "o2", valid_fraction=0.2)
    assert m["totals"]["bad_lines"] == 0 and shard_checksums(m) == shard_checksums(plain)
    csv = BOM + HEADER.replace(b"\t", b",") + b"\n" + data.replace(b"\t", b",")
    (tmp_path / "bom.csv").write_bytes(csv)
    m = run([tmp_path / "bom.csv"], tmp_path / "o3", valid_fraction=0.2)
    assert m["totals"]["bad_lines"] == 0 and shard_checksums(m) == shard_checksums(plain)


def test_a_tsv_header_line_is_read_as_column_names(tmp_path, tsv, plain):
    data = tsv.read_bytes()
    (tmp_path / "head.tsv").write_bytes(HEADER + b"\n" + data)
    m = run([tmp_path / "head.tsv"], tmp_path / "o1", valid_fraction=0.2, chunk_bytes=1 << 16)
    assert m["totals"]["bad_lines"] == 0 and shard_checksums(m) == shard_checksums(plain)
    # an output made when the header line was a bad line is not resumed, nor "complete"
    m["sources"][0]["header"] = None
    (tmp_path / "o1" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="different job .inputs' header lines read otherwise"):
        run([tmp_path / "head.tsv"], tmp_path / "o1", valid_fraction=0.2, chunk_bytes=1 << 16)
    # gzip, with a BOM and a CRLF header line end too
    (tmp_path / "head.tsv.gz").write_bytes(gzip.compress(BOM + HEADER + b"\r\n" + data, compresslevel=1))
    m = run([tmp_path / "head.tsv.gz"], tmp_path / "o2", valid_fraction=0.2)
    assert m["totals"]["bad_lines"] == 0 and shard_checksums(m) == shard_checksums(plain)
    # columns in another order are read by name
    lines = [line.split(b"\t") for line in data.splitlines()]
    order = [0] + list(range(39, 0, -1))
    swapped = [b"\t".join(f[i] for i in order) for f in [HEADER.split(b"\t")] + lines]
    (tmp_path / "swapped.tsv").write_bytes(b"\n".join(swapped) + b"\n")
    m = run([tmp_path / "swapped.tsv"], tmp_path / "o3", valid_fraction=0.2)
    assert m["totals"]["bad_lines"] == 0 and shard_checksums(m) == shard_checksums(plain)
    # a bad line is named by its line in the file (the header is line 1)
    bad = data.splitlines()
    bad.insert(9, b"2" + b"\t" * 39)
    (tmp_path / "bad.tsv").write_bytes(HEADER + b"\n" + b"\n".join(bad) + b"\n")
    m = run([tmp_path / "bad.tsv"], tmp_path / "o4")
    assert [(b["line"], b["reason"][:5]) for b in m["bad_lines"]] == [(11, "label")]
    # hvctr score reads the same file: the header is not a line it fails on
    assert sum(len(lab) for lab, _, _ in read_rows(str(tmp_path / "head.tsv"))) == 1500
    # a first line that is data (even a bad one) is not a header
    (tmp_path / "x.tsv").write_bytes(b"x\t1" + b"\t" * 38 + b"\n" + data)
    assert open_sources([str(tmp_path / "x.tsv")])[0].header_lines == 0


def test_a_tsv_header_line_that_does_not_name_the_columns_is_refused(tmp_path, tsv):
    names = b"\t".join(b"click" if i == 0 else b"f%d" % i for i in range(40))
    (tmp_path / "other.tsv").write_bytes(names + b"\n" + tsv.read_bytes())
    with pytest.raises(ValueError, match=r"other.tsv:1: a header line must name column 'label' exactly once"):
        run([tmp_path / "other.tsv"], tmp_path / "o")
    assert not (tmp_path / "o" / "manifest.json").exists()
    (tmp_path / "short.tsv").write_bytes(b"label\tI1\tC1\n" + tsv.read_bytes())  # fewer names than 40
    with pytest.raises(ValueError, match=r"short.tsv:1: a header line must name column 'I2'"):
        run([tmp_path / "short.tsv"], tmp_path / "o2")


def test_stray_shards_without_a_manifest_are_refused_not_overwritten(tmp_path, tsv):
    out = tmp_path / "out"
    out.mkdir()
    (out / "train-00001.h5").write_bytes(b"someone else's")
    with pytest.raises(ValueError, match=r"out/train-00001.h5: shard files in .* without a manifest.json"):
        run([tsv], out)
    assert (out / "train-00001.h5").read_bytes() == b"someone else's"
    assert not (out / "manifest.json").exists()
    (out / "train-00001.h5").unlink()
    assert run([tsv], out)["state"] == "complete"
    # with a manifest, a shard it does not record is ours to redo (a kill before its record)
    m = json.loads((out / "manifest.json").read_text())
    m["shards"]["train"][1] = None
    m["state"] = "in_progress"
    (out / "manifest.json").write_text(json.dumps(m))
    assert run([tsv], out)["state"] == "complete"


def test_an_input_modified_at_the_same_size_is_not_already_complete(tmp_path, tsv):
    src = tmp_path / "in.tsv"
    src.write_bytes(tsv.read_bytes())
    out = tmp_path / "out"
    run([src], out)
    assert run([src], out)["state"] == "complete"  # unchanged: nothing to do
    data = bytearray(src.read_bytes())
    data[0:1] = b"1" if data[0:1] == b"0" else b"0"  # another label, the same size
    st = src.stat()
    src.write_bytes(bytes(data))
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    assert src.stat().st_size == st.st_size
    with pytest.raises(ValueError, match=rf"different job \({src}: modified since .*the size is the same\)"):
        run([src], out)
    # a manifest written before mtimes were recorded: compared on path and size, as then
    m = json.loads((out / "manifest.json").read_text())
    for i in m["job"]["inputs"]:
        del i["mtime_ns"]
    (out / "manifest.json").write_text(json.dumps(m))
    assert run([src], out)["state"] == "complete"
