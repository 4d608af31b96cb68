"""Files a person edits, read as hvctr reads them: one message naming the file (issue 28, item 9).

- a config, a search space, a hardware map saved in Latin-1, a metrics file with a non-UTF-8
  byte: ``<what> <path>: not UTF-8 text: byte 0xe9 at line L, column C`` (hvctr.formats.textfile,
  the one reader of hvctr's text files), exit 2, no traceback;
- ``--config /tmp``: "is a directory, not a file" (it said "does not exist");
- TOML values of another type for int, float, bool and list keys (``dim = "16"``, ``dim = 16.0``,
  ``all_ranks = "yes"``) are refused naming the file and the key; the same spellings as
  command-line flags, where everything is a string, are still read as a person means them.

Each case runs the real command in this process (hvctr.cli.main) and reads what it printed.
"""

from __future__ import annotations

import json

import pytest

from hvctr.cli import main
from hvctr.config import load_config
from tests.conftest import REPO

LATIN1 = "# r\xe9glages\n".encode("latin-1")  # an editor's Latin-1 e-acute on line 1, column 4


def run_cli(capsys, *argv) -> tuple[int, str]:
    rc = main(list(argv))
    err = capsys.readouterr().err
    return rc, err


def one_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("what", ["config", "space", "hwmap"])
def test_a_latin1_file_is_named_with_the_line_and_column_of_its_first_bad_byte(tmp_path, capsys, what):
    if what == "config":
        p = tmp_path / "run.toml"
        p.write_bytes(LATIN1 + b"[train]\nepochs = 1\n")
        rc, err = run_cli(capsys, "config", "--config", str(p))
        want = f"hvctr config: error: config file {p}: not UTF-8 text: byte 0xe9 at line 1, column 4 (save it as UTF-8)"
    elif what == "space":
        pytest.importorskip("optuna")  # hvctr sweep asks for its optional extra before it reads a space
        p = tmp_path / "space.toml"
        p.write_bytes(b'[params]\n"train.dense_lr" = { low = 1e-4, high = 1e-2 }\n' + LATIN1)
        rc, err = run_cli(capsys, "sweep", "run", "--study", str(tmp_path / "study"), "--space", str(p),
                          "--trials", "1")
        want = f"hvctr sweep: error: search space {p}: not UTF-8 text: byte 0xe9 at line 3, column 4 (save it as UTF-8)"
        assert not (tmp_path / "study").exists()  # refused before the study is created
    else:
        p = tmp_path / "map.toml"
        p.write_bytes((REPO / "slurm/hwmaps/vm-2cpu.toml").read_bytes() + LATIN1)
        rc, err = run_cli(capsys, "topo", "--map", str(p))
        lines = (REPO / "slurm/hwmaps/vm-2cpu.toml").read_bytes().count(b"\n")
        want = (f"hvctr topo: error: hardware map {p}: not UTF-8 text: byte 0xe9 at line {lines + 1}, column 4 "
                f"(save it as UTF-8)")
    assert rc == 2 and one_error(err) == want


def test_a_metrics_file_with_a_bad_byte_is_named_by_hvctr_report(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    good = json.dumps({"event": "progress", "step": 10, "loss": 0.5, "samples": 100})
    (run / "metrics.jsonl").write_bytes(good.encode() + b"\n" + b'{"event": "eval", "note": "\xff"}\n')
    rc, err = run_cli(capsys, "report", "--run-dir", str(run))
    assert rc == 2
    assert one_error(err) == (f"hvctr report: error: metrics file {run / 'metrics.jsonl'}: not UTF-8 text: byte 0xff "
                              f"at line 2, column 28 (save it as UTF-8)")


def test_a_directory_given_as_the_config_is_named_as_one(tmp_path, capsys):
    rc, err = run_cli(capsys, "config", "--config", str(tmp_path))
    assert rc == 2 and one_error(err) == f"hvctr config: error: config file {tmp_path} is a directory, not a file"
    rc, err = run_cli(capsys, "config", "--config", str(tmp_path / "missing.toml"))
    assert one_error(err) == f"hvctr config: error: config file {tmp_path / 'missing.toml'} does not exist"


def test_the_reader_names_json_errors_and_reads_good_files(tmp_path):
    from hvctr.formats.textfile import read_json, read_text

    p = tmp_path / "x.json"
    p.write_text('{"a": 1,\n "b": }\n')
    with pytest.raises(ValueError, match=rf"^thing {p}: not JSON: Expecting value \(at line 2, column 7\)$"):
        read_json(p, "thing")
    p.write_text('{"a": "\u00e9"}')
    assert read_json(p, "thing") == {"a": "\u00e9"} and read_text(p, "thing") == '{"a": "\u00e9"}'


@pytest.mark.parametrize("line, key, got", [
    ('[storage]\ndim = "16"', "storage.dim", "expected an integer, got '16' (a string)"),
    ("[storage]\ndim = 16.0", "storage.dim", "expected an integer, got 16.0 (a float)"),
    ("[storage]\ncpu_cache_bytes = 1e9", "storage.cpu_cache_bytes", "expected an integer, got 1000000000.0 (a float)"),
    ("[storage]\ndim = true", "storage.dim", "expected an integer, got True (a boolean)"),
    ('[metrics]\nall_ranks = "yes"', "metrics.all_ranks", "expected true or false, got 'yes' (a string)"),
    ("[metrics]\nall_ranks = 1", "metrics.all_ranks", "expected true or false, got 1 (an integer)"),
    ('[train]\ndense_lr = "0.01"', "train.dense_lr", "expected a number, got '0.01' (a string)"),
    ('[model]\nhidden = "32,16"', "model.hidden", "expected a list, got '32,16' (a string)"),
    ('[model]\nhidden = [32.0, 16]', "model.hidden", "expected an integer, got 32.0 (a float)"),
    ("[train]\nrun_dir = 5", "train.run_dir", "expected a string, got 5 (an integer)"),
])
def test_a_toml_value_of_another_type_is_refused_naming_the_file_and_key(tmp_path, line, key, got):
    p = tmp_path / "run.toml"
    p.write_text(line + "\n")
    with pytest.raises(ValueError) as e:
        load_config(p)
    assert str(e.value).startswith(f"{p}: config key '{key}': {got}"), str(e.value)


def test_the_same_spellings_on_the_command_line_are_read_as_meant(tmp_path):
    cfg = load_config(None, ["--storage.dim=16", "--storage.cpu_cache_bytes=1e9", "--metrics.all_ranks=yes",
                             "--train.dense_lr=0.01", "--model.hidden=32,16", "--storage.rows_per_rank=1_000"])
    assert (cfg.storage.dim, cfg.storage.cpu_cache_bytes, cfg.metrics.all_ranks) == (16, 10**9, True)
    assert (cfg.train.dense_lr, cfg.model.hidden, cfg.storage.rows_per_rank) == (0.01, (32, 16), 1000)
    p = tmp_path / "run.toml"  # and TOML's own types, an integer for a float key included
    p.write_text("[storage]\ndim = 16\ncpu_cache_bytes = 1_000_000_000\n[train]\ndense_lr = 1\n"
                 "[metrics]\nall_ranks = true\n[model]\nhidden = [32, 16]\n")
    cfg = load_config(p)
    assert (cfg.storage.dim, cfg.storage.cpu_cache_bytes, cfg.train.dense_lr) == (16, 10**9, 1.0)
    assert cfg.metrics.all_ranks is True and cfg.model.hidden == (32, 16)
