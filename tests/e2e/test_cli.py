"""The installed console script, as a user runs it."""

import subprocess
import sys
from pathlib import Path

import hvctr

HVCTR = str(Path(sys.executable).with_name("hvctr"))


def run(*args, check=True):
    return subprocess.run([HVCTR, *args], capture_output=True, text=True, check=check, timeout=120)


def test_version():
    assert run("--version").stdout.strip() == f"hvctr {hvctr.__version__}"


def test_help_lists_only_working_commands():
    from hvctr.cli import COMMANDS
    out = subprocess.run([sys.executable, "-m", "hvctr", "--help"], capture_output=True, text=True, check=True).stdout
    for name in COMMANDS:
        assert name in out
        # every listed command has a working --help of its own
        assert run(name, "--help").returncode == 0


def test_misspelled_key_in_config_file(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[storage]\ncpu_cache_byte = 100\n")
    r = run("config", "--config", str(cfg), check=False)
    assert r.returncode == 2
    assert "storage.cpu_cache_byte" in r.stderr and "cpu_cache_bytes" in r.stderr


def test_resolved_config_reflects_flags(tmp_path):
    out = run("config", "--merge.every_k_steps=8").stdout
    assert "every_k_steps = 8" in out
