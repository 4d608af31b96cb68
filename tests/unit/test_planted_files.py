"""Files a user or an attacker planted where hvctr writes, and outputs on a full disk (issue 28,
items 1, 2 and 5).

- A symbolic link planted at any name hvctr writes (a temporary name, an appended log, a
  checkpoint's directory) is never followed: the file it points to stays as it was byte for
  byte; an append target that is a link is refused with a message naming it.
- A leftover at export's temporary directory that hvctr did not make is refused and named,
  never removed.
- export and reshard onto a full disk (a real small tmpfs; root only, else skipped): one
  message naming the file, exit 2, no traceback, nothing left on the disk.

The run is made by hand in the trainer's checkpoint format (write_reserved), one rank.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from hvctr.checkpoint.format import FORMAT_VERSION, write_manifest, write_reserved
from hvctr.config import Config, replace, write_toml
from hvctr.formats import RowLayout, default_bucket_owner, owner_of
from hvctr.formats.safefile import PlantedPathError, open_append
from hvctr.log import setup_logging
from hvctr.offline import export as export_mod
from hvctr.offline import score as score_mod
from hvctr.rundir import write_identity
from hvctr.train.meter import Meter
from tests.conftest import REPO, VENV_PY

DIM = 4
VICTIM_TEXT = "precious: not hvctr's\n"


def _cfg() -> Config:
    return replace(Config(), storage={"dim": DIM}, model={"hidden": [8]}, data={"batch_size_per_rank": 64})


def make_run(root: Path, rows: int = 300, world: int = 1) -> Path:
    """A run directory: config.toml and one base checkpoint (seq 0) of ``world`` ranks."""
    from hvctr.models import build_model

    run = root / "run"
    run.mkdir(parents=True)
    cfg = _cfg()
    write_toml(cfg, run / "config.toml")
    layout = RowLayout(DIM)
    rng = np.random.default_rng(0)
    keys = np.unique(rng.integers(1, 2**63, rows, dtype=np.uint64))
    owner = default_bucket_owner(world)
    params = {f"dense/param.{i:03d}": p.detach().numpy().copy()
              for i, (_, p) in enumerate(build_model(cfg.model, DIM).named_parameters())}
    ckdir = run / "checkpoints" / "ckpt-000000"
    ckdir.mkdir(parents=True)
    files = []
    for rank in range(world):
        mine = keys[owner_of(keys, owner) == rank]
        table = rng.standard_normal((mine.size, layout.width)).astype(np.float32)
        path = ckdir / f"rank-{rank:05d}.h5"
        attrs = {"format_version": FORMAT_VERSION, "seq": 0, "kind": "base", "rank": rank, "world_size": world,
                 "pass_index": 0}
        write_reserved(path, attrs, mine.size, layout.width, [(mine, table, np.zeros(mine.size, np.int32))],
                       {**params, "bucket_owner": owner})
        from hvctr.checkpoint.format import file_sha256

        files.append({"file": path.name, "sha256": file_sha256(path), "bytes": path.stat().st_size,
                      "rows": int(mine.size)})
    state = {"epoch": 0, "batch": 4, "window": 1, "step": 4, "samples": 256}
    write_manifest(ckdir / "manifest.json", {"format_version": FORMAT_VERSION, "seq": 0, "kind": "base",
                                             "base_seq": 0, "chain": [0], "world_size": world, "state": state,
                                             "files": files, "train_dir": "/data", "init_from": None})
    return run


@pytest.fixture()
def victim(tmp_path) -> Path:
    v = tmp_path / "victim.txt"
    v.write_text(VICTIM_TEXT)
    return v


def _untouched(victim: Path) -> None:
    assert victim.read_text() == VICTIM_TEXT


# --- 1. planted links are never followed -----------------------------------------------------

def _tsv(path: Path, lines: int, bad_at: int | None = None) -> Path:
    rows = []
    for i in range(lines):
        rows.append("x\tbad" if i == bad_at else "\t".join(["1"] + [str(i)] * 13 + ["a1b2c3d4"] * 26))
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.parametrize("bad_input", [False, True])
def test_score_never_writes_through_a_link_planted_at_its_temporary_name(tmp_path, victim, bad_input):
    run = make_run(tmp_path)
    model = tmp_path / "model"
    export_mod.export(run, model)
    out = tmp_path / "out.pred"
    os.symlink(victim, tmp_path / "out.pred.tmp")
    args = argparse.Namespace(model=str(model), input=str(_tsv(tmp_path / "in.tsv", 5, 3 if bad_input else None)),
                              out=str(out), batch_size=0, threads=1)
    if bad_input:
        with pytest.raises(ValueError):
            score_mod.run(args, [])
        assert not os.path.lexists(out)
    else:
        assert score_mod.run(args, []) == 0
        assert not out.is_symlink() and len(out.read_text().splitlines()) == 5
    _untouched(victim)
    assert (tmp_path / "out.pred.tmp").is_symlink()  # the planted link is left as it was
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out.pred.") and p.name != "out.pred.tmp"]


def test_export_refuses_a_link_planted_at_its_temporary_directory(tmp_path):
    run = make_run(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, tmp_path / "X.tmp")
    with pytest.raises(PlantedPathError, match=rf"{tmp_path / 'X.tmp'} exists \(a symbolic link \(to {elsewhere}\)\)"):
        export_mod.export(run, tmp_path / "X")
    assert list(elsewhere.iterdir()) == [] and (tmp_path / "X.tmp").is_symlink()
    assert not os.path.lexists(tmp_path / "X")


def test_export_refuses_an_out_that_is_a_dangling_link(tmp_path):
    run = make_run(tmp_path)
    os.symlink(tmp_path / "nowhere", tmp_path / "X")
    with pytest.raises(ValueError, match="exists"):
        export_mod.export(run, tmp_path / "X")
    assert not os.path.lexists(tmp_path / "nowhere") and not os.path.lexists(tmp_path / "X.tmp")


def test_metrics_file_planted_as_a_link_is_refused_naming_it(tmp_path, victim):
    path = tmp_path / "metrics.jsonl"
    os.symlink(victim, path)
    with pytest.raises(ValueError, match=rf"{path} is a symbolic link \(to {victim}\)"):
        Meter(0, path, 1, 16, 1)
    _untouched(victim)


def test_a_rank_log_planted_as_a_link_is_refused_naming_it(tmp_path, victim):
    path = tmp_path / "logs" / "rank-00000.log"
    path.parent.mkdir()
    os.symlink(victim, path)
    try:
        with pytest.raises(ValueError, match=rf"{path} is a symbolic link \(to {victim}\)"):
            setup_logging(0, 1, file=str(path), open_file=open_append)
    finally:
        setup_logging(0, 1)
        logging.getLogger("hvctr").handlers.clear()
    _untouched(victim)


def test_a_rank_log_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    import signal

    def waited(*_):
        raise AssertionError(f"opening {path} waited for a reader")

    path = tmp_path / "rank-00000.log"
    os.mkfifo(path)
    old = signal.signal(signal.SIGALRM, waited)
    signal.alarm(5)
    try:
        with pytest.raises(ValueError, match=rf"{path} is not a regular file"):
            setup_logging(0, 1, file=str(path), open_file=open_append)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        setup_logging(0, 1)
        logging.getLogger("hvctr").handlers.clear()


@pytest.mark.parametrize("what", ["config.toml", "identity.json", "summary.json", "rank-00000.h5", "manifest.json"])
def test_a_link_planted_at_a_temporary_name_is_never_followed(tmp_path, victim, what):
    from hvctr.train.cmd import _write_json

    run = tmp_path / "run"
    run.mkdir()
    final = run / what
    os.symlink(victim, run / f"{what}.tmp")
    if what == "config.toml":
        write_toml(_cfg(), final)
    elif what == "identity.json":
        write_identity(run, {"world_size": 1})
    elif what == "summary.json":
        _write_json(final, {"auc": 0.5})
    elif what == "manifest.json":
        write_manifest(final, {"seq": 0})
    else:
        width = RowLayout(DIM).width
        write_reserved(final, {"seq": 0}, 3, width,
                       [(np.arange(1, 4, dtype=np.uint64), np.zeros((3, width), np.float32), np.zeros(3, np.int32))],
                       {"bucket_owner": default_bucket_owner(1)})
    _untouched(victim)
    assert final.is_file() and not final.is_symlink() and final.stat().st_size > 0
    assert sorted(p.name for p in run.iterdir()) == sorted([what, f"{what}.tmp"])  # no temporary file left


class _FakeStore:
    """What CheckpointManager._write_rank_file asks of the store."""

    def __init__(self) -> None:
        self.layout = RowLayout(DIM)
        self.pass_index = 0
        self.shard = argparse.Namespace(bucket_owner=default_bucket_owner(1))

    def count_rows(self, delta_only: bool) -> int:
        return 2

    def iter_rows(self, delta_only: bool, with_last_seen: bool):
        yield np.array([1, 2], np.uint64), np.zeros((2, self.layout.width), np.float32), np.zeros(2, np.int32)

    def admission_state(self):
        return None


def test_a_checkpoint_directory_planted_as_a_link_is_refused(tmp_path):
    from hvctr.checkpoint.format import CheckpointWriteError
    from hvctr.checkpoint.manager import CheckpointManager

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    os.symlink(elsewhere, ckpts / "ckpt-000001")
    comm = argparse.Namespace(rank=0, size=1)
    mgr = CheckpointManager(ckpts, comm, keep=2, compact_every=4)
    with pytest.raises(CheckpointWriteError, match=rf"{ckpts / 'ckpt-000001'} is a symbolic link"):
        mgr._write_rank_file(ckpts / "ckpt-000001" / "rank-00000.h5", 1, "base", {}, _FakeStore())
    assert list(elsewhere.iterdir()) == []
    # a real directory is fine (and one that does not exist is made)
    assert mgr._write_rank_file(ckpts / "ckpt-000002" / "rank-00000.h5", 2, "base", {}, _FakeStore()) == 2


# --- 2. export removes nothing it did not make -----------------------------------------------

def test_export_refuses_a_leftover_it_did_not_make_and_removes_nothing(tmp_path):
    run = make_run(tmp_path)
    planted = tmp_path / "U.tmp"
    planted.mkdir()
    (planted / "thesis.txt").write_text("precious")
    with pytest.raises(PlantedPathError, match=rf"{planted} exists \(a directory\) and was not made by hvctr "
                                               rf"export: it is left as it is"):
        export_mod.export(run, tmp_path / "U")
    assert (planted / "thesis.txt").read_text() == "precious"
    assert sorted(p.name for p in planted.iterdir()) == ["thesis.txt"]


def test_export_replaces_its_own_leftover(tmp_path):
    from hvctr.formats.safefile import make_temp_dir

    run = make_run(tmp_path)
    left = make_temp_dir(tmp_path / "U.tmp", "hvctr export")  # what a killed export leaves
    (left / "dense.h5").write_bytes(b"half")
    export_mod.export(run, tmp_path / "U")
    assert not os.path.lexists(left)
    assert sorted(p.name for p in (tmp_path / "U").iterdir()) == ["dense.h5", "manifest.json", "sparse"]


# --- 5. export and reshard onto a full disk --------------------------------------------------

def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_PY), "-m", "hvctr", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=300)


@pytest.mark.parametrize("command", ["export", "reshard"])
def test_export_and_reshard_on_a_full_disk_are_one_message_and_leave_nothing(tmp_path, tmpfs, command):
    run = make_run(tmp_path, rows=120_000)  # export: 3.4 MB of rows; reshard: 9 MB of rank files
    disk = tmpfs(2 << 20)
    out = disk / "out"
    if command == "export":
        r = _cli("export", "--run-dir", str(run), "--out", str(out))
    else:
        r = _cli("reshard", "--checkpoint", str(run), "--world-size", "2", "--out", str(out))
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, err[-3000:])
    assert "Traceback" not in err and len(err.splitlines()) == 1, err[-3000:]
    assert f"hvctr {command}: error: cannot write {disk}" in err and "no space left on device" in err.lower(), err
    left = [str(p.relative_to(disk)) for p in disk.rglob("*")]
    assert left in ([], ["out"]), left  # reshard's --out may stay (empty): it was asked for
    assert not any(disk.rglob("*")) or (command == "reshard" and not any(out.iterdir()))


def test_export_and_reshard_fit_when_there_is_room(tmp_path):
    run = make_run(tmp_path, rows=2000, world=2)
    m = export_mod.export(run, tmp_path / "E")
    assert m["rows"] > 0 and not os.path.lexists(tmp_path / "E.tmp")
    from hvctr.offline.reader import CheckpointReader
    from hvctr.offline.reshard import reshard

    before = CheckpointReader(run)
    want = {int(k): r for rank in range(2) for ks, rs, _ in before.rows(rank) for k, r in zip(ks, rs)}
    for w2 in (1, 3):
        out = tmp_path / f"R{w2}"
        m = reshard(run, w2, out)
        after = CheckpointReader(out)
        got = {int(k): r for rank in range(w2) for ks, rs, _ in after.rows(rank) for k, r in zip(ks, rs)}
        assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
        assert sum(f["rows"] for f in m["files"]) == len(want)
        assert not [p for p in (out / "ckpt-000000").iterdir() if p.name.endswith(".tmp")]
        assert json.loads((out / "ckpt-000000" / "manifest.json").read_text())["world_size"] == w2
