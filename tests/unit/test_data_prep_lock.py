"""Two data_prep jobs on one --out, and a damaged piece on resume (issue 28, item 3).

- A second job on an --out another job holds is refused before it reads or writes anything,
  naming the holder and ``<out>/data_prep.lock`` (as hvctr train's run directory lock).
- A piece that the manifest records but whose file is shorter, unreadable or of another size
  than recorded is parsed again on resume, with a warning naming it; the shards are then those
  of an uninterrupted run, checksum for checksum.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
from pathlib import Path

import pytest

import data_prep.criteo as criteo
from data_prep.synth import generate
from tests.conftest import REPO, VENV_PY, run_data_prep, shard_checksums

LOCK = "data_prep.lock"

@pytest.fixture(scope="module")
def tsv(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("in") / "synth.tsv"
    generate(3000, seed=5, out=str(path))
    return path


@pytest.fixture
def holder(tmp_path):
    """A process holding tmp_path/out's lock, as a running data_prep job's rank 0 does; its lock
    file written as a job writes it (fcntl alone: the test names no function of the fix)."""
    out = tmp_path / "out"
    out.mkdir()
    code = ("import fcntl, json, os, socket, sys, time; "
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644); fcntl.flock(fd, fcntl.LOCK_EX); "
            "os.write(fd, json.dumps({'host': socket.gethostname(), 'pid': os.getpid(), "
            "'command': 'data_prep criteo', 'started': '2026-12-01T10:00:00+0000'}).encode()); "
            "print('held', flush=True); time.sleep(120)")
    p = subprocess.Popen([VENV_PY, "-c", code, str(out / LOCK)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    yield out, p
    p.kill()
    p.wait()


def test_a_second_job_on_an_out_in_use_is_refused_up_front(holder, tsv):
    out, p = holder
    with pytest.raises(ValueError) as e:
        run_data_prep([tsv], out, 2)
    assert str(e.value) == (f"{out} is in use by another job: host {socket.gethostname()} pid {p.pid} "
                            f"(since 2026-12-01T10:00:00+0000, data_prep criteo) holds {out / LOCK}; wait for "
                            f"that job to end (or stop it), or choose another --out")
    assert sorted(x.name for x in out.iterdir()) == [LOCK]  # nothing read into it, nothing written


def test_a_finished_job_releases_its_lock(tmp_path, tsv):
    out = tmp_path / "out"
    run_data_prep([tsv], out, 2)
    assert (out / LOCK).read_text() == ""  # released: the next job sees no stale lock
    assert run_data_prep([tsv], out, 2)["state"] == "complete"


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _killed_after_parse(monkeypatch, tsv, out: Path) -> dict:
    """The job stopped after phase 1 (every unit recorded, no shard): its manifest."""
    def killed(*a, **kw):
        raise KeyboardInterrupt  # as a kill: nothing after it runs

    monkeypatch.setattr(criteo, "assemble_shards", killed)
    with pytest.raises(KeyboardInterrupt):
        run_data_prep([tsv], out, 2, chunk_bytes=1 << 16, piece_lines=700)
    monkeypatch.undo()
    m = json.loads((out / "manifest.json").read_text())
    assert all(m["units"]) and not any(m["shards"]["train"])
    return m


@pytest.mark.parametrize("damage", ["truncated", "garbage", "grown"])
def test_a_damaged_piece_is_redone_on_resume(tmp_path, tsv, monkeypatch, damage):
    clean = run_data_prep([tsv], tmp_path / "clean", 2, chunk_bytes=1 << 16, piece_lines=700)
    out = tmp_path / "out"
    _killed_after_parse(monkeypatch, tsv, out)
    pieces = sorted((out / "_work").glob("u*-p*.h5"))
    assert len(pieces) > 2
    victim = pieces[1]
    size = victim.stat().st_size
    if damage == "truncated":  # as the concurrent job left it
        os.truncate(victim, 1101)
    elif damage == "garbage":
        victim.write_bytes(os.urandom(size))
    else:
        with open(victim, "ab") as f:
            f.write(b"\0" * 10)
    lines = _Lines()
    logger = logging.getLogger("hvctr.data_prep")
    logger.addHandler(lines)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        m = run_data_prep([tsv], out, 2, chunk_bytes=1 << 16, piece_lines=700)
    finally:
        logger.removeHandler(lines)
        logger.setLevel(old_level)
    assert m["state"] == "complete"
    assert shard_checksums(m) == shard_checksums(clean)
    named = [line for line in lines.lines if str(victim) in line]
    assert named and "parsed again" in named[0], lines.lines
    assert not any(str(p) in line for p in pieces if p != victim for line in lines.lines)  # only the damaged one


def test_a_piece_damaged_during_the_job_is_named_not_a_full_disk(tmp_path, tsv, monkeypatch):
    out = tmp_path / "out"
    real = criteo.assemble_shards

    def damaged_then_assemble(job, asm, batch, tick):
        os.truncate(asm.pieces[1][0], 1101)
        return real(job, asm, batch, tick)

    monkeypatch.setattr(criteo, "assemble_shards", damaged_then_assemble)
    with pytest.raises(ValueError) as e:
        run_data_prep([tsv], out, 2, chunk_bytes=1 << 16, piece_lines=700)
    victim = sorted((out / "_work").glob("u*-p*.h5"))[1]
    assert str(e.value).startswith(f"{victim}: cannot read this piece (")
    assert "free space" not in str(e.value) and "run the same data_prep command again" in str(e.value)
    monkeypatch.undo()
    assert run_data_prep([tsv], out, 2, chunk_bytes=1 << 16, piece_lines=700)["state"] == "complete"
