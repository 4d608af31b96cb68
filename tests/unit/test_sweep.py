"""hvctr sweep: the search space's checks, the study directory's guarantees (a killed worker
leaves its trial failed and resumed, never a corrupt journal; two workers on one study lose and
duplicate no trial), report and best, and the message without Optuna.

The workers here are real ``hvctr sweep run`` processes; the training command they launch is
tests/unit/fake_train.py (a summary.json in milliseconds), so that the study's machinery is
tested in seconds. Real training under Slurm: tests/e2e/test_slurm.py::test_sweep_array.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvctr.cli import main
from tests.conftest import REPO

optuna = pytest.importorskip("optuna")

from hvctr.sweep.space import load_space, space_from_dict  # noqa: E402
from hvctr.sweep.study import StudyDir  # noqa: E402

SPACE = """
[trial]
steps = 30
evals = 3
ranks = 1

[params]
"train.dense_lr" = { low = 1e-4, high = 1e-1, log = true }
"merge.every_k_steps" = { choices = [1, 4, 16] }
"model.hidden" = { choices = [[32, 16], [64]] }
"""
FAKE = f"{sys.executable} {REPO / 'tests' / 'unit' / 'fake_train.py'}"


@pytest.fixture
def space(tmp_path) -> Path:
    p = tmp_path / "space.toml"
    p.write_text(SPACE)
    return p


def worker_cmd(study: Path, space: Path | None, trials: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "hvctr", "sweep", "run", "--study", str(study), "--trials", str(trials),
            "--launcher", FAKE, "--stale-after", "5", *(["--space", str(space)] if space else []), *extra]


def run_worker(study: Path, space: Path | None, trials: int, *extra: str, env=None) -> subprocess.CompletedProcess:
    r = subprocess.run(worker_cmd(study, space, trials, *extra), cwd=REPO, capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def trials_of(study: Path) -> list:
    return optuna.load_study(study_name="hvctr-sweep", storage=StudyDir(study).storage()).get_trials()


def test_space_is_checked_against_the_config(tmp_path):
    s = space_from_dict({"params": {"storage.dim": {"low": 4, "high": 32, "step": 4},
                                    "model.hidden": {"choices": [[64, 32], [8]]}}})
    assert s.params[0].is_int and s.params[1].choices == ("64,32", "8")
    assert s.eval_steps() == [100, 200, 300, 400]
    bad = [({"params": {"train.dense_l": {"low": 1e-4, "high": 1e-2}}}, "'train.dense_l' is not a config key"),
           ({"params": {"merge.every_k_steps": {"low": 0, "high": 4}}}, "'merge.every_k_steps', value 0"),
           ({"params": {"merge.mode": {"choices": ["kstep", "async"]}}}, "'async' is not one of"),
           ({"params": {"train.dense_lr": {"low": 0, "high": 1, "log": True}}}, "a log range needs low > 0"),
           ({"params": {}}, "[params] is empty"),
           ({"trial": {"steps": 0}, "params": {"train.seed": {"low": 1, "high": 3}}}, "trial.steps must be"),
           ({"param": {}}, "unknown section(s) ['param']")]
    for raw, msg in bad:
        with pytest.raises(ValueError, match=None) as e:
            space_from_dict(raw)
        assert msg in str(e.value), (msg, str(e.value))
    with pytest.raises(ValueError, match="does not exist"):
        load_space(tmp_path / "nope.toml")


def test_two_workers_share_a_study_without_losing_or_duplicating_a_trial(tmp_path, space):
    study = tmp_path / "study"
    run_worker(study, space, 1, "--worker-id", "0")  # creates the study: both others join it
    procs = [subprocess.Popen(worker_cmd(study, None, 14, "--worker-id", str(i)), cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in (1, 2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    trials = trials_of(study)
    assert [t.number for t in trials] == list(range(14))  # each number once, none missing
    assert {t.state.name for t in trials} <= {"COMPLETE", "PRUNED"}
    run_dirs = [t.user_attrs["run_dir"] for t in trials]
    assert len(set(run_dirs)) == 14
    workers = {t.user_attrs["worker"] for t in trials[1:]}
    assert len(workers) == 2, "both workers ran trials"
    for t in trials:  # each trial's run directory saw its own chunks only, each once, in order
        calls = [int(line.split()[0]) for line in (Path(t.user_attrs["run_dir"]) / "calls.txt").read_text().split("\n")
                 if line]
        assert calls == [10, 20, 30][:len(calls)] and len(calls) == len(t.intermediate_values)
        assert (t.state.name == "PRUNED") == (len(calls) < 3)
    assert any(t.state.name == "PRUNED" for t in trials)
    # a worker given other settings is refused, by name
    r = subprocess.run(worker_cmd(study, space, 14, "--pruner", "median"), cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 2 and "holds a study made with other settings (pruner" in r.stderr


def _wait(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_killed_worker_leaves_its_trial_failed_and_resumed(tmp_path, space):
    study = tmp_path / "study"
    env = {**os.environ, "FAKE_TRAIN_SLEEP": "60", "FAKE_TRAIN_SLEEP_FROM": "20"}  # hangs in trial 0's 2nd chunk
    p = subprocess.Popen(worker_cmd(study, space, 4, "--worker-id", "0", "--pruner", "none"), cwd=REPO, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    calls = study / "trials" / "trial-0000" / "calls.txt"
    _wait(lambda: calls.is_file() and len(calls.read_text().splitlines()) == 2)
    child = int(calls.read_text().splitlines()[1].split()[1])
    p.send_signal(signal.SIGKILL)
    p.wait()
    _wait(lambda: not Path(f"/proc/{child}").exists() or "zombie" in Path(f"/proc/{child}/status").read_text())
    # the journal is whole: the trial is still RUNNING there, with its first evaluation
    (t0,) = trials_of(study)
    assert t0.state.name == "RUNNING" and list(t0.intermediate_values) == [1]

    r = run_worker(study, None, 4, "--worker-id", "1")
    assert "trial 0: worker pid" in r.stdout and "is gone: marked failed; a retry resumes" in r.stdout
    trials = trials_of(study)
    assert trials[0].state.name == "FAIL" and "worker lost" in trials[0].user_attrs["failed"]
    retry = next(t for t in trials if t.user_attrs.get("retry_of") == 0)
    assert retry.state.name == "COMPLETE" and retry.params == trials[0].params
    assert retry.user_attrs["run_dir"] == trials[0].user_attrs["run_dir"]
    assert dict(retry.intermediate_values).keys() == {1, 2, 3}
    # the retry resumed: chunk 1 was not trained again (10 once; 20 killed, then again; 30)
    assert [int(line.split()[0]) for line in calls.read_text().splitlines()] == [10, 20, 20, 30]
    assert sum(t.state.name == "COMPLETE" for t in trials) == 4 and len(trials) == 5


def test_the_first_trial_is_the_base_config(tmp_path, space):
    from hvctr.config import load_config

    base = load_config(None, ["--model.hidden=32,16"])
    run_worker(tmp_path / "a", space, 2, "--worker-id", "0", "--pruner", "none", "--model.hidden=32,16")
    t0, t1 = trials_of(tmp_path / "a")
    assert t0.params == {"train.dense_lr": base.train.dense_lr, "merge.every_k_steps": base.merge.every_k_steps,
                         "model.hidden": "32,16"} and t0.user_attrs["baseline"] is True
    assert "baseline" not in t1.user_attrs
    # a base value outside the space (hidden 512,256 is not a choice): no baseline, and the log says why
    r = run_worker(tmp_path / "b", space, 1, "--worker-id", "0")
    assert "no baseline trial: the base config's model.hidden = '512,256' lies outside the search space" in r.stdout
    assert "baseline" not in trials_of(tmp_path / "b")[0].user_attrs
    r = run_worker(tmp_path / "c", space, 1, "--worker-id", "0", "--no-baseline", "--model.hidden=64")
    assert "baseline" not in trials_of(tmp_path / "c")[0].user_attrs and "base config" not in r.stdout
    # --no-baseline is the study's: a worker that joins with --space must give it too
    r = subprocess.run(worker_cmd(tmp_path / "c", space, 2, "--model.hidden=64"), cwd=REPO, capture_output=True,
                       text=True)
    assert r.returncode == 2 and "holds a study made with other settings (baseline" in r.stderr


def test_a_torn_journal_line_is_cut_not_spread(tmp_path, space):
    study = tmp_path / "study"
    run_worker(study, space, 2, "--worker-id", "0")
    with open(study / "journal.log", "ab") as f:  # a writer that died inside a write
        f.write(b'{"op_code":6,"worker_id":"x","trial_id":1,"user_a')
    assert len(trials_of(study)) == 2  # Optuna's reader skips the unterminated line
    run_worker(study, None, 3, "--worker-id", "1")  # its first append cuts it off
    trials = trials_of(study)
    assert len(trials) == 3 and all(line.endswith("}") for line in (study / "journal.log").read_text().splitlines())


def test_report_and_best(tmp_path, space, capsys):
    study = tmp_path / "study"
    run_worker(study, space, 5, "--worker-id", "0", "--pruner", "none", "--model.hidden=8")
    assert main(["sweep", "report", "--study", str(study)]) == 0
    out = capsys.readouterr().out
    assert "| trial | state | train.dense_lr | merge.every_k_steps | model.hidden | auc |" in out
    assert "complete 5" in out
    for f in ("trials.md", "trials.csv", "auc_over_trials.png", "auc_vs_params.png"):
        assert (study / "report" / f).stat().st_size > 0
    assert main(["sweep", "best", "--study", str(study), "--out", str(tmp_path / "best.toml")]) == 0
    best = max(trials_of(study), key=lambda t: t.value)
    from hvctr.config import load_config

    cfg = load_config(tmp_path / "best.toml")
    assert cfg.train.dense_lr == best.params["train.dense_lr"] and cfg.train.max_steps == 0
    assert cfg.merge.every_k_steps == best.params["merge.every_k_steps"]
    assert list(cfg.model.hidden) == [int(x) for x in best.params["model.hidden"].split(",")]
    assert f"trial {best.number} of" in (tmp_path / "best.toml").read_text()
    assert main(["sweep", "report", "--study", str(tmp_path / "none")]) == 2
    assert "is not a sweep study" in capsys.readouterr().err


def test_without_optuna_it_says_how_to_install_it(tmp_path):
    code = ("import sys\nsys.modules['optuna'] = None\nfrom hvctr.cli import main\n"
            f"raise SystemExit(main(['sweep', 'report', '--study', {str(tmp_path)!r}]))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "pip install 'hvctr[sweep]'" in r.stderr, r.stderr


def test_a_stopped_worker_queues_a_resuming_retry_and_a_failing_trial_is_named(tmp_path, space):
    study = tmp_path / "study"
    env = {**os.environ, "FAKE_TRAIN_SLEEP": "60", "FAKE_TRAIN_SLEEP_FROM": "20"}
    p = subprocess.Popen(worker_cmd(study, space, 3, "--worker-id", "0", "--pruner", "none"), cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    calls = study / "trials" / "trial-0000" / "calls.txt"
    _wait(lambda: calls.is_file() and len(calls.read_text().splitlines()) == 2)
    p.send_signal(signal.SIGTERM)  # scancel, a preempted array task: SIGUSR1 to the trainer, exit 75
    out = p.communicate(timeout=60)[0]
    assert p.returncode == 143, out
    assert "trial 0: marked failed; a retry queued resumes" in out
    (t0, retry) = trials_of(study)
    assert t0.state.name == "FAIL" and t0.user_attrs["failed"] == "worker stopped by signal 15"
    assert retry.state.name == "WAITING" and retry.user_attrs["retry_of"] == 0

    # the next worker takes the retry first; a trial whose trainer fails is failed, named, and skipped
    r = run_worker(study, None, 3, "--worker-id", "1", env={**os.environ, "FAKE_TRAIN_FAIL": "trial-0002"})
    trials = trials_of(study)
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE", "FAIL", "COMPLETE", "COMPLETE"], r.stdout
    assert trials[1].params == t0.params and trials[1].user_attrs["run_dir"] == t0.user_attrs["run_dir"]
    assert [int(line.split()[0]) for line in calls.read_text().splitlines()] == [10, 20, 20, 30]
    assert trials[2].user_attrs["failed"].startswith("hvctr train exited with 3 (its output: ")
    assert "this run fails, for the test" in (Path(trials[2].user_attrs["run_dir"]) / "train.log").read_text()
    # a trainer that always fails stops the worker after --max-failures in a row, with a message
    r = subprocess.run(worker_cmd(study, None, 6, "--worker-id", "2", "--max-failures", "2"), cwd=REPO,
                       env={**os.environ, "FAKE_TRAIN_FAIL": "trial-"}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "2 trials in a row failed" in r.stderr, r.stdout + r.stderr
