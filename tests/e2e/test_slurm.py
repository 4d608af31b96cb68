"""The sbatch scripts, submitted as users submit them, to a real Slurm cluster on this machine.

The cluster (tests/e2e/slurm_cluster.py, fixture ``slurm_cluster``) is Debian's slurm-wlm 22.05
with munge, started as root without systemd or cgroups. Jobs are submitted from the checkout
(the scripts find the code through the submit directory) with HVCTR_RUN_DIR, HVCTR_OUT and --output under
tmp_path.

Facts checked on this stack (Slurm 22.05.8, OpenMPI 4.1.4, PMIx 4.2.2); [test] marks those a
test below keeps, the others were checked by hand while writing the scripts:
- [test] `srun --mpi=pmix` starts mpi4py + Horovod ranks: tests/mpi/test_comm.py passes under
  it with 2 tasks (and 3). Only SLURM_PROCID/PMIX_RANK are set, not OMPI_COMM_WORLD_RANK.
- [test] `sbatch --wait` follows a requeued job (same id) and returns the exit code of its last
  run, not the first run's end. It polls at 2, 10 and 42 s, then every 32 s, so it may return up to
  32 s after the job ended: the longer jobs here are polled (cluster.wait_done, every 0.5 s).
- [test] A SIGUSR1 to the batch shell (what --signal=B:USR1@N sends, and `scancel --batch
  --signal=USR1`) reaches the trap once srun runs in the background; forwarding it with
  `kill -USR1 <srun pid>` reaches every rank (`scancel --signal=USR1 <job>` and `<job>.0` do
  too, by hand). A rank that exits 75 under `python -m mpi4py` becomes MPI_Abort(75): srun still
  returns 75. By hand: a rank that has not yet installed its handler dies of the USR1, and
  srun returns 138.
- [test] `scontrol requeue` from inside the job ends the batch shell at once ("CANCELLED DUE TO JOB
  REQUEUE"); the job runs again with the same id and SLURM_RESTART_COUNT=1. It becomes
  eligible cred_expire + 1 s later (default 120 s) and starts at the next scheduler pass.
- [test] `scancel <job>` sends SIGTERM to the batch shell too: it dies before it could requeue, and the
  job ends CANCELLED (hvctr checkpoints on the SIGTERM within KillWait).
- `--dependency=afterok:<job>` waits for the end of a job that requeued itself (its last run),
  and `--dependency=singleton` starts a job once the previous one of that name has ended.
- --signal=B:USR1@N comes early: with --time=2 and @90 it came 0-14 s after each start (Slurm
  checks limits every 30 s and sends up to 60 s early). Not tested (timing); the time
  left after the signal must cover a window and a checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import MPI_ENV, REPO, VENV_PY
from tests.e2e.slurm_cluster import exit_code

# Small model and data: a job is seconds of training after ~10 s of start-up on 2 cores.
# Pinned allreduce algorithm: OpenMPI picks one by message size, and resume must be bit-equal.
TRAIN_FLAGS = ["--model.hidden=32,16", "--storage.dim=8", "--data.batch_size_per_rank=256",
               "--storage.rows_per_rank=200000", "--storage.cpu_cache_bytes=3e5", "--merge.every_k_steps=2",
               "--checkpoint.every_windows=3", "--checkpoint.compact_every=2", "--train.epochs=2",
               "--metrics.log_every_steps=10"]
DETERMINISTIC = {"OMPI_MCA_coll_tuned_use_dynamic_rules": "1", "OMPI_MCA_coll_tuned_allreduce_algorithm": "4"}
ROWS, SHARDS = 20000, 4


def job_env(cluster, **extra: str) -> dict[str, str]:
    return cluster.env(**MPI_ENV, **DETERMINISTIC, HVCTR_HOME=str(REPO), **extra)


def submit(cluster, script: str, out: Path, *args: str, **env: str) -> int:
    job = cluster.sbatch([f"--output={out}", str(REPO / "slurm" / script), *args],
                         env=job_env(cluster, **env), cwd=REPO)
    return job.job_id


def wait_for_checkpoint(cluster, jid: int, run: Path, out: Path, seq: int = 1, timeout: float = 300) -> None:
    """Until checkpoint ``seq`` of the job's run is complete (training is under way)."""
    marker = run / "checkpoints" / f"ckpt-{seq:06d}" / "manifest.json"
    deadline = time.monotonic() + timeout
    while not marker.exists() and time.monotonic() < deadline:
        assert cluster.job(jid).get("JobState") in ("PENDING", "RUNNING"), out.read_text()
        time.sleep(0.05)
    assert marker.exists(), f"no checkpoint {seq} after {timeout:g} s:\n{out.read_text()}"


def task_pid(jid: int, procid: int) -> int:
    """The pid of task ``procid`` of job ``jid`` (hvctr's python, not srun's wrappers)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if (f"SLURM_JOB_ID={jid}".encode() in env and f"SLURM_PROCID={procid}".encode() in env
                and b"hvctr" in cmd and b"python" in cmd.split(b"\0")[0]):
            return int(entry.name)
    raise AssertionError(f"no task {procid} of job {jid} found in /proc")


def assert_completed(record: dict[str, str], out: Path) -> None:
    text = out.read_text(errors="replace") if out.exists() else "(no output file)"
    assert record["JobState"] == "COMPLETED" and exit_code(record) == 0, \
        f"job {record['JobId']} {record['JobState']} exit {record['ExitCode']}:\n{text[-6000:]}"


# --- the stack ----------------------------------------------------------------------------

def test_srun_pmix_runs_the_horovod_comm_tests(slurm_cluster, tmp_path):
    out = tmp_path / "smoke.out"
    cmd = (f"srun --mpi=pmix --cpu-bind=none --kill-on-bad-exit=1 {VENV_PY} -m mpi4py "
           f"-m pytest -q -p no:cacheprovider --color=no tests/mpi/test_comm.py")
    job = slurm_cluster.sbatch(["-n", "2", f"--output={out}", "--wrap", cmd], env=job_env(slurm_cluster), cwd=REPO)
    assert_completed(slurm_cluster.wait_done(job.job_id), out)
    assert out.read_text().count(" passed") == 2, out.read_text()  # one pytest summary per rank


def test_sbatch_wait_returns_the_exit_code_of_the_requeued_run(slurm_cluster, tmp_path):
    out = tmp_path / "requeue.out"
    script = tmp_path / "requeue.sh"
    script.write_text("#!/bin/bash\n"
                      "echo \"start ${SLURM_RESTART_COUNT:-0}\"\n"
                      "if [ \"${SLURM_RESTART_COUNT:-0}\" = 0 ]; then scontrol requeue \"$SLURM_JOB_ID\"; sleep 60; fi\n"
                      "exit 3\n")
    job = slurm_cluster.sbatch(["--open-mode=append", f"--output={out}", str(script)], wait=True,
                               env=job_env(slurm_cluster))
    assert job.returncode == 3, out.read_text()
    record = slurm_cluster.job(job.job_id)
    assert record["Restarts"] == "1" and record["JobState"] == "FAILED"
    assert out.read_text().splitlines()[0] == "start 0" and "start 1" in out.read_text()


# --- the scripts --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prepared(slurm_cluster, tmp_path_factory):
    """Raw synthetic Criteo TSV, preprocessed by slurm/prep.sbatch with 2 tasks: (data dir, record)."""
    root = tmp_path_factory.mktemp("prep")
    (root / "raw").mkdir()
    subprocess.run([VENV_PY, "-m", "data_prep", "synth", "--rows", str(ROWS), "--seed", "3",
                    "--out", str(root / "raw" / "day_0.tsv")], check=True, capture_output=True, timeout=300)
    out = root / "prep.out"
    jid = submit(slurm_cluster, "prep.sbatch", out, HVCTR_INPUT=str(root / "raw" / "day_*.tsv"),
                 HVCTR_OUT=str(root / "shards"), HVCTR_SHARDS=str(SHARDS), HVCTR_VALID_FRACTION="0.1")
    record = slurm_cluster.wait_done(jid)
    assert_completed(record, out)
    return root / "shards", record


def test_prep_job_writes_the_shards(prepared):
    data, _ = prepared
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["state"] == "complete"
    assert manifest["sessions"][-1]["processes"] == 2  # srun gave data_prep 2 MPI processes
    assert manifest["totals"]["rows"] == ROWS and manifest["totals"]["bad_lines"] == 0
    assert manifest["totals"]["valid"]["rows"] == ROWS // 10
    assert sorted(p.name for p in data.glob("*.h5")) == \
        [f"{split}-{s:05d}.h5" for split in ("train", "valid") for s in range(SHARDS)]


def test_old_unprefixed_variables_are_refused_naming_the_new_ones(slurm_cluster, tmp_path):
    # sbatch exports the submitting shell's environment: a DATA or OUT set there for something
    # else must not steer a job, and a user of the old names learns the new ones.
    out = tmp_path / "old.out"
    jid = submit(slurm_cluster, "train.sbatch", out, DATA=str(tmp_path), CONFIG="x.toml")
    record = slurm_cluster.wait_done(jid)
    text = out.read_text()
    assert record["JobState"] == "FAILED" and exit_code(record) == 2, text
    assert "DATA -> HVCTR_DATA" in text and "CONFIG -> HVCTR_CONFIG" in text


def test_prep_job_without_input_fails_with_a_message(slurm_cluster, tmp_path):
    out = tmp_path / "prep.out"
    jid = submit(slurm_cluster, "prep.sbatch", out, HVCTR_INPUT=str(tmp_path / "nothing_*.tsv"), HVCTR_OUT=str(tmp_path / "o"))
    record = slurm_cluster.wait_done(jid)
    assert record["JobState"] == "FAILED" and exit_code(record) == 2
    assert f"no input file matches {tmp_path}/nothing_*.tsv" in out.read_text()


@pytest.fixture(scope="module")
def trained(slurm_cluster, prepared, tmp_path_factory):
    """slurm/train.sbatch, 2 tasks, never interrupted: (run dir, job record, output file)."""
    data, _ = prepared
    root = tmp_path_factory.mktemp("train")
    out = root / "train.out"
    jid = submit(slurm_cluster, "train.sbatch", out, *TRAIN_FLAGS, HVCTR_CONFIG=str(REPO / "slurm/configs/demo.toml"),
                 HVCTR_DATA=str(data), HVCTR_RUN_DIR=str(root / "run"))
    record = slurm_cluster.wait_done(jid)
    assert_completed(record, out)
    return root / "run", record, out


def test_train_job_fills_its_run_directory(trained):
    run, record, out = trained
    jid = record["JobId"]
    assert record["Restarts"] == "0" and record["NumTasks"] == "2"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval"]["count"] == ROWS // 10 and math.isfinite(summary["eval"]["auc"])
    assert (run / "config.toml").is_file() and (run / "binding.json").is_file()
    assert sorted(p.name for p in (run / "logs").iterdir()) == ["rank-00000.log", "rank-00001.log"]
    assert (run / "metrics.jsonl").stat().st_size > 0
    assert any((run / "checkpoints").glob("ckpt-*/manifest.json"))
    job_record = (run / "slurm" / f"job-{jid}.start-0.txt").read_text()
    assert f"JobId={jid} " in job_record and "NumTasks=2" in job_record
    assert (run / "slurm" / f"job-{jid}.out").resolve() == out.resolve()
    events = (run / "slurm" / "events.log").read_text().splitlines()
    assert len(events) == 1 and events[0].endswith(f"job={jid} start=0 rc=0 usr1=0 action=exit")
    assert "AUC" in out.read_text()


def test_eval_job_reproduces_the_training_evaluation(slurm_cluster, trained, tmp_path):
    # With the hardware map of this machine type: the per-rank wrapper exports each rank's NIC.
    run, _, _ = trained
    out = tmp_path / "eval.out"
    jid = submit(slurm_cluster, "eval.sbatch", out, HVCTR_RUN_DIR=str(run), HVCTR_HWMAP=str(REPO / "slurm/hwmaps/vm-2cpu.toml"))
    assert_completed(slurm_cluster.wait_done(jid), out)
    result = json.loads((run / "eval-valid.json").read_text())
    expected = json.loads((run / "summary.json").read_text())["eval"]
    assert result["count"] == expected["count"]
    assert result["auc"] == pytest.approx(expected["auc"], abs=1e-12)
    assert result["logloss"] == pytest.approx(expected["logloss"], abs=1e-9)
    binding = json.loads((run / "binding.json").read_text())
    assert len(binding) == 2 and all(r["nic_env"] for r in binding), binding


def test_preempted_job_checkpoints_requeues_and_ends_with_the_same_model(slurm_cluster, prepared, trained, tmp_path):
    from tests.e2e.test_train import assert_same_model

    data, _ = prepared
    reference, _, _ = trained
    run, out = tmp_path / "run", tmp_path / "train.out"
    jid = submit(slurm_cluster, "train.sbatch", out, *TRAIN_FLAGS, HVCTR_CONFIG=str(REPO / "slurm/configs/demo.toml"),
                 HVCTR_DATA=str(data), HVCTR_RUN_DIR=str(run))
    # Signal once training is under way (its second checkpoint is written): what Slurm sends
    # before the time limit (--signal=B:USR1@120), to the batch shell only.
    wait_for_checkpoint(slurm_cluster, jid, run, out)
    slurm_cluster.run("scancel", "--batch", "--signal=USR1", str(jid))
    record = slurm_cluster.wait_done(jid, min_restarts=1)
    assert_completed(record, out)
    assert record["Restarts"] == "1"
    events = (run / "slurm" / "events.log").read_text().splitlines()
    assert [e.split(" ", 2)[2] for e in events] == [
        f"job={jid} start=0 rc=75 usr1=1 action=requeue",
        f"job={jid} start=1 rc=0 usr1=0 action=exit"], events
    first, second = out.read_text().split(f"job {jid} start 1", 1)
    assert "got SIGUSR1" in first
    resumed = re.search(r"resumed from checkpoint \d+ at step (\d+)", second)
    steps = json.loads((run / "summary.json").read_text())["steps"]
    assert resumed and 0 < int(resumed.group(1)) < steps, second  # stopped mid-run, resumed there
    assert (run / "slurm" / f"job-{jid}.start-1.txt").is_file()
    assert_same_model(reference, run)


def test_cancelled_job_is_not_requeued(slurm_cluster, prepared, tmp_path):
    # scancel sends SIGTERM to every process of the job, the batch shell included: the shell
    # dies before it could requeue, so a self-requeueing job can still be cancelled for good.
    data, _ = prepared
    run, out = tmp_path / "run", tmp_path / "train.out"
    jid = submit(slurm_cluster, "train.sbatch", out, *TRAIN_FLAGS, HVCTR_CONFIG=str(REPO / "slurm/configs/demo.toml"),
                 HVCTR_DATA=str(data), HVCTR_RUN_DIR=str(run))
    wait_for_checkpoint(slurm_cluster, jid, run, out)
    slurm_cluster.run("scancel", str(jid))
    assert slurm_cluster.wait_done(jid)["JobState"] == "CANCELLED"
    time.sleep(8)  # longer than a requeue takes to start here (cred_expire 5 s + 1 s + a scheduler pass)
    record = slurm_cluster.job(jid)
    assert record["JobState"] == "CANCELLED" and record["Restarts"] == "0", record
    assert not (run / "slurm" / "events.log").exists(), "the batch shell outlived the cancel"


def test_hung_task_fails_the_job_instead_of_holding_it(slurm_cluster, prepared, tmp_path):
    # Task 1 frozen (SIGSTOP) once training is under way: task 0's watchdog ends the step after
    # train.stall_timeout_s, srun (--kill-on-bad-exit) takes the frozen task with it, and the
    # job fails for good (a hang is not a preemption: no requeue) instead of running to its limit.
    data, _ = prepared
    run, out = tmp_path / "run", tmp_path / "train.out"
    jid = submit(slurm_cluster, "train.sbatch", out, *TRAIN_FLAGS, "--train.stall_timeout_s=4",
                 HVCTR_CONFIG=str(REPO / "slurm/configs/demo.toml"), HVCTR_DATA=str(data), HVCTR_RUN_DIR=str(run))
    wait_for_checkpoint(slurm_cluster, jid, run, out)
    os.kill(task_pid(jid, 1), signal.SIGSTOP)
    t0 = time.monotonic()
    record = slurm_cluster.wait_done(jid, timeout=120)
    text = out.read_text(errors="replace")
    assert record["JobState"] == "FAILED" and record["Restarts"] == "0", (record, text[-4000:])
    assert time.monotonic() - t0 < 90
    assert re.search(r"hvctr train: error: rank 0: collective '[^']+' has waited \d+ s .*train\.stall_timeout_s = 4",
                     text), text[-4000:]
    assert "action=exit" in (run / "slurm" / "events.log").read_text()


def test_sweep_array_tasks_are_workers_of_one_study(slurm_cluster, prepared, tmp_path):
    """slurm/sweep.sbatch as a 2-task job array: each task a worker of one study, its trials'
    ranks started by srun inside the task; 3 tiny trials (2 evaluations each), each run once
    as a normal run directory; then hvctr sweep report and best read the study."""
    optuna = pytest.importorskip("optuna")
    from hvctr.cli import main
    from hvctr.sweep.study import StudyDir

    data, _ = prepared
    space, study = tmp_path / "space.toml", tmp_path / "study"
    space.write_text('[trial]\nsteps = 6\nevals = 2\nranks = 1\n\n[params]\n'
                     '"train.dense_lr" = { low = 1e-3, high = 3e-2, log = true }\n')
    flags = ["--model.hidden=16", "--storage.dim=4", "--data.batch_size_per_rank=256",
             "--storage.rows_per_rank=100000", "--checkpoint.every_windows=0", "--train.threads=1"]
    job = slurm_cluster.sbatch(["--array=0-1", "--ntasks=1", f"--output={tmp_path}/sweep-%a.out",
                                str(REPO / "slurm" / "sweep.sbatch"), "--trials", "3", *flags],
                               env=job_env(slurm_cluster, HVCTR_STUDY=str(study), HVCTR_SPACE=str(space),
                                           HVCTR_DATA=str(data)), cwd=REPO)
    for task in (0, 1):
        record = slurm_cluster.wait_done(f"{job.job_id}_{task}", timeout=600)
        assert_completed(record, tmp_path / f"sweep-{task}.out")
    trials = optuna.load_study(study_name="hvctr-sweep", storage=StudyDir(study).storage()).get_trials()
    assert [t.number for t in trials] == [0, 1, 2]
    assert {t.state.name for t in trials} <= {"COMPLETE", "PRUNED"} and trials[0].state.name == "COMPLETE"
    for t in trials:
        run = Path(t.user_attrs["run_dir"])
        assert json.loads((run / "summary.json").read_text())["steps"] == t.user_attrs["steps"]
        assert "srun --mpi=pmix" in (run / "train.log").read_text()
    out = "".join((tmp_path / f"sweep-{task}.out").read_text() for task in (0, 1))
    assert out.count("nothing left to run") == 2, out
    assert main(["sweep", "report", "--study", str(study)]) == 0
    assert (study / "report" / "auc_vs_params.png").is_file()
    assert main(["sweep", "best", "--study", str(study), "--out", str(tmp_path / "best.toml")]) == 0
    assert f"--data.train_dir={data}" not in (tmp_path / "best.toml").read_text()
    assert f'train_dir = "{data}"' in (tmp_path / "best.toml").read_text()
