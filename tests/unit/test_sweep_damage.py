"""A study meets bad input and a full disk: one message naming the file and line, never a traceback
(issue 28, items 9 and 10).

- a search space with ``high = inf``, ``low = nan``, ``4.0`` for an integer key, ``step = 0``:
  refused naming the parameter, before the study directory is created (an int range raised
  OverflowError);
- a journal line that is not JSON, an unknown ``op_code``, a record Optuna cannot apply: the
  journal and the line are named with how to recover the study as it was before that line (the
  recipe is followed here and the study works again); Optuna raised JSONDecodeError or
  ``AssertionError: Should not reach.``;
- ``hvctr sweep run`` and ``report`` on a full disk (a 1 MiB tmpfs): one message naming the file
  it could not write, exit 2, no trial left running for good (once there is room, the next worker
  ends with none running), no half-written report file;
- the working shards hvctr train leaves in a trial's run directory go after each chunk (they are
  rebuilt at every start): a study kept 233-439 MB of them per trial.

The workers are real ``hvctr sweep run`` processes; the training command is tests/unit/fake_train.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.unit.test_sweep import SPACE, run_worker, trials_of, worker_cmd

optuna = pytest.importorskip("optuna")


def report_cmd(study: Path) -> list[str]:
    return [sys.executable, "-m", "hvctr", "sweep", "report", "--study", str(study)]


def run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, **kw)


def error_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout[-2000:] + r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.mark.parametrize("spec, want", [
    ('"train.dense_lr" = { low = 1e-4, high = inf, log = true }',
     "parameter 'train.dense_lr': high must be a finite number (train.dense_lr takes numbers), got inf"),
    ('"train.seed" = { low = 1, high = inf }',
     "parameter 'train.seed': high must be an integer (train.seed takes integers), got inf"),
    ('"train.dense_lr" = { low = nan, high = 1e-2 }',
     "parameter 'train.dense_lr': low must be a finite number (train.dense_lr takes numbers), got nan"),
    ('"storage.dim" = { low = 4.0, high = 32 }',
     "parameter 'storage.dim': low must be an integer (storage.dim takes integers), got 4.0"),
    ('"storage.dim" = { low = 4, high = 32, step = 0 }', "parameter 'storage.dim': step must be > 0, got 0"),
    ('"train.dense_lr" = { low = 1e-4, high = 1e-2, log = "yes" }',
     "parameter 'train.dense_lr': log must be true or false, got 'yes'"),
])
def test_a_space_optuna_cannot_sample_is_refused_before_the_study_exists(tmp_path, spec, want):
    space = tmp_path / "space.toml"
    space.write_text(f"[params]\n{spec}\n")
    study = tmp_path / "study"
    r = run(worker_cmd(study, space, 2))
    assert error_line(r) == f"hvctr sweep: error: {space}: {want}"
    assert not study.exists()


@pytest.fixture
def study(tmp_path) -> Path:
    space = tmp_path / "space.toml"
    space.write_text(SPACE)
    study = tmp_path / "study"
    run_worker(study, space, 2, "--worker-id", "0")
    return study


def _rewrite_line(journal: Path, number: int, edit) -> None:
    lines = journal.read_text().splitlines()
    lines[number - 1] = edit(lines[number - 1])
    journal.write_text("\n".join(lines) + "\n")


def _first_line_with(journal: Path, op_code: int) -> int:
    return next(n for n, line in enumerate(journal.read_text().splitlines(), start=1)
                if json.loads(line)["op_code"] == op_code)


def _op(line: str, **changes) -> str:
    return json.dumps({**json.loads(line), **changes})


@pytest.mark.parametrize("damage, problem", [
    (lambda line: "garbage{{", "not JSON (Expecting value: line 1 column 1 (char 0))"),
    (lambda line: _op(line, op_code=99), "op_code 99 is not an operation the journal records (Optuna 5.0.0's are 0..10)"),
    (lambda line: _op(line, worker_id="another", distribution='{"name": "Nope", "attributes": {}}'),
     "Optuna cannot apply it (ValueError: Unknown distribution class: Nope)"),
], ids=["garbage", "unknown-op", "unappliable"])
def test_a_damaged_journal_line_is_named_with_the_way_back(study, damage, problem):
    journal = study / "journal.log"
    n = _first_line_with(journal, 5)  # the first trial parameter set: trial 0 was created before it
    _rewrite_line(journal, n, damage)
    recovery = (f"the study cannot be read from that line on (damaged by a disk error or an edit). To recover the "
                f"study as it was before it: stop every worker, then `mv {journal} {journal}.damaged && head -n "
                f"{n - 1} {journal}.damaged > {journal}`; it then holds 1 trial(s): move {study / 'trials'}/trial-0001 "
                f"and any later trial directories away before the workers start again (a new trial of that number "
                f"would resume it)")
    for cmd in (worker_cmd(study, None, 3), report_cmd(study)):
        assert error_line(run(cmd)) == f"hvctr sweep: error: {journal}, line {n}: {problem}: {recovery}"
    # the recipe, as the message gives it
    r = subprocess.run(f"mv {journal} {journal}.damaged && head -n {n - 1} {journal}.damaged > {journal} && "
                       f"mv {study / 'trials' / 'trial-0001'} {study.parent / 'trial-0001.moved'}", shell=True)
    assert r.returncode == 0
    run_worker(study, None, 3, "--worker-id", "1")
    trials = trials_of(study)
    # trial 0 was cut off while running (its lease gone: reaped once --stale-after old), 1 and 2 are new
    assert len(trials) == 3 and trials[0].state.name == "RUNNING" and not trials[0].params
    assert {t.state.name for t in trials[1:]} <= {"COMPLETE", "PRUNED"}
    assert [int(line.split()[0]) for line in (study / "trials" / "trial-0001" / "calls.txt").read_text().splitlines()][0] == 10


def _fill(directory: Path) -> Path:
    """Fills the file system of ``directory`` to the last byte; returns the filler."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for chunk in (bytes(4096), b"x"):  # whole pages, then what is left of the last one
            try:
                while os.write(fd, chunk):
                    pass
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def test_a_worker_and_a_report_on_a_full_disk_are_one_message_and_leave_no_trial_running(tmp_path, tmpfs):
    disk = tmpfs(1 << 20)
    space = tmp_path / "space.toml"
    space.write_text(SPACE)
    study = disk / "study"
    run_worker(study, space, 1, "--worker-id", "0")
    (study / "trials" / "trial-0000" / "evals.jsonl").unlink()  # (kept small: the fill decides)
    filler = _fill(disk)
    line = error_line(run(worker_cmd(study, None, 3, "--worker-id", "1")))
    assert line.startswith(f"hvctr sweep: error: cannot write {study}") and "No space left on device" in line, line
    assert line.endswith(f"free space in {study}, then start the workers again") or \
        line.endswith(f"free space in {study}, then start the worker again"), line
    report = error_line(run(report_cmd(study)))
    assert report.startswith(f"hvctr sweep: error: cannot write {study / 'report'}/") and \
        "No space left on device (no file of the report is left half-written)" in report, report
    assert not list(disk.rglob("*.tmp"))
    filler.unlink()
    if "once it has run --stale-after (5 s) without a lease" in line:
        time.sleep(5)  # what the message says: the next worker marks it failed after that
    run_worker(study, None, 3, "--worker-id", "2")  # room again: the study goes on
    states = [t.state.name for t in trials_of(study)]
    assert "RUNNING" not in states and states.count("COMPLETE") + states.count("PRUNED") >= 3, (states, line)
    assert main_report_ok(study)


def main_report_ok(study: Path) -> bool:
    r = run(report_cmd(study))
    return r.returncode == 0 and (study / "report" / "trials.csv").stat().st_size > 0


def test_the_working_shards_a_trial_leaves_are_removed(study):
    trial_dirs = sorted((study / "trials").iterdir())
    assert len(trial_dirs) == 2
    for d in trial_dirs:  # fake_train left shards/shard-r00000.h5 as hvctr train does; the worker removed it
        assert (d / "calls.txt").is_file() and (d / "summary.json").is_file()
        assert not (d / "shards").exists(), os.listdir(d)
