"""A full disk outside checkpoint writes: one message naming the file, nothing half-written.

Real small disks (a tmpfs, filled up; root only, else skipped): the run's metrics file, the
JSON files and config.toml of the run directory, a rank's log file, data_prep's pieces and
shards (then, with room made, the same command completes), and any other write a command did
not name itself (hvctr.cli's last resort: the path and the reason, exit 2).
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import pytest

from data_prep.synth import generate
from hvctr import cli
from hvctr.config import Config, write_toml
from hvctr.log import get_logger, setup_logging
from hvctr.train.cmd import _write_json
from hvctr.train.meter import Meter
from tests.conftest import REPO, VENV_PY, mpi_env


def _fill(disk: Path) -> None:
    with open(disk / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError:
            pass


@pytest.fixture
def full_disk(tmpfs):
    disk = tmpfs(1 << 20)
    (disk / "run").mkdir()
    return disk


def test_metrics_on_a_full_disk_is_a_message_naming_the_file(full_disk):
    path = full_disk / "run" / "metrics.jsonl"
    meter = Meter(0, path, 1, 16, 2)
    _fill(full_disk)
    with pytest.raises(ValueError, match=rf"cannot write the run's metrics file {path} \(progress record\): "
                                         rf"No space left on device"):
        meter.record({"event": "progress", "step": 1, "pad": "x" * 8192})
    meter.close()  # the failed buffer does not raise again


@pytest.mark.parametrize("what", ["json", "toml"])
def test_run_directory_files_on_a_full_disk_leave_nothing_half_written(full_disk, what):
    _fill(full_disk)
    path = full_disk / "run" / ("summary.json" if what == "json" else "config.toml")
    with pytest.raises(ValueError, match=rf"cannot write (the resolved config )?{path}: No space left on device"):
        if what == "json":
            _write_json(path, {"pad": "x" * 100_000})
        else:
            write_toml(Config(), path)
    assert list((full_disk / "run").iterdir()) == []


def test_a_log_file_on_a_full_disk_is_said_once(full_disk, capsys):
    log_file = full_disk / "run" / "rank-00000.log"
    setup_logging(0, 1, file=str(log_file))
    try:
        _fill(full_disk)
        log = get_logger("hvctr.test")
        for i in range(5):
            log.info("x" * 8192)
        err = capsys.readouterr().err
        assert err.count(f"hvctr: cannot write the log file {log_file}: No space left on device") == 1, err
        assert "Traceback" not in err and "Logging error" not in err
    finally:
        setup_logging(0, 1)
        logging.getLogger("hvctr").handlers.clear()


def test_any_other_write_error_is_one_line_naming_the_path(monkeypatch, capsys, tmp_path):
    class Module:
        @staticmethod
        def add_arguments(p):
            pass

        @staticmethod
        def run(args, overrides):
            raise OSError(28, "No space left on device", str(tmp_path / "out.h5"))

    monkeypatch.setattr(cli, "_command_module", lambda name: Module)
    assert cli.main(["export"]) == 2
    assert capsys.readouterr().err == f"hvctr export: error: {tmp_path / 'out.h5'}: No space left on device\n"


@pytest.mark.parametrize("size_mib,where", [(2, "_work/u0000000-p0000.h5"), (10, "train-00000.h5")])
def test_data_prep_on_a_full_disk_is_one_message_and_continues_once_there_is_room(tmpfs, tmp_path, size_mib, where):
    """2 MiB: no room for the first piece; 10 MiB: room for the pieces, not for the shards."""
    generate(30000, seed=3, out=str(tmp_path / "in.tsv"))
    disk = tmpfs(size_mib << 20)
    cmd = [VENV_PY, "-m", "data_prep", "criteo", "--input", str(tmp_path / "in.tsv"), "--out", str(disk / "out"),
           "--shards", "2"]
    r = subprocess.run(cmd, cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert errors == [line for line in r.stderr.splitlines() if line.startswith(
        f"data_prep criteo: error: cannot write {disk / 'out' / where}: no space left on device: ")], r.stderr
    assert len(errors) == 1 and "Traceback" not in r.stderr
    assert list(disk.rglob("*.tmp")) == []
    subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)  # room made
    again = subprocess.run(cmd, cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
