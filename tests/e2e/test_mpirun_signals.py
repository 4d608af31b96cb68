"""Which signal to send to `mpirun ... hvctr train` so that it returns 75 (checkpointed: requeue).

OpenMPI's mpirun (4.1) forwards SIGUSR1 (and SIGUSR2, SIGTSTP, SIGCONT, SIGABRT, SIGALRM) to
every rank and then returns the ranks' exit status: hvctr checkpoints and exits 75, mpirun
returns 75. SIGTERM and SIGINT it does not forward (ess_base_forward_signals refuses them): it
tears the job down itself and returns 1, whatever the ranks would have returned. So a wrapper
that requeues on 75 must send SIGUSR1 to mpirun; docs/checkpoints.md and slurm/train.sbatch say so.
Both jobs run at once (about 40 s on the 2-core machine).
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.e2e.helpers import launch, make_dataset, signal_job

@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory)


FLAGS = ["--merge.every_k_steps=2", "--checkpoint.every_windows=2", "--train.epochs=50"]


def _signal_after_first_checkpoint(jobs, sig_of):
    """Sends each job's signal to its mpirun alone once its checkpoint 0 is complete."""
    deadline = time.monotonic() + 240
    pending = dict(jobs)
    while pending and time.monotonic() < deadline:
        for name, (p, run, _) in list(pending.items()):
            if (run / "checkpoints" / "ckpt-000000" / "manifest.json").exists() or p.poll() is not None:
                os.kill(p.pid, sig_of[name])  # mpirun only: the ranks are in process groups of their own
                pending.pop(name)
        time.sleep(0.05)
    assert not pending, f"no checkpoint 0 within 240 s: {list(pending)}"


def test_sigusr1_to_mpirun_returns_75_and_sigterm_returns_1(dataset, tmp_path):
    sig_of = {"usr1": signal.SIGUSR1, "term": signal.SIGTERM}
    jobs = {}
    for name in sig_of:
        run, log = tmp_path / name / "run", tmp_path / f"{name}.log"
        run.parent.mkdir()
        jobs[name] = (launch(2, run, dataset, *FLAGS, log=log), run, log)
    try:
        _signal_after_first_checkpoint(jobs, sig_of)
        rc = {name: p.wait(timeout=120) for name, (p, _, _) in jobs.items()}
    finally:
        for p, _, _ in jobs.values():
            if p.poll() is None:
                signal_job(p, signal.SIGKILL)
                p.wait(timeout=60)
    usr1_run, usr1_log = jobs["usr1"][1], jobs["usr1"][2].read_text()
    assert rc["usr1"] == 75, usr1_log[-3000:]
    assert "mpirun: Forwarding signal 10 to job" in usr1_log and "got SIGUSR1" in usr1_log
    newest = max(json.loads(m.read_text())["seq"] for m in usr1_run.glob("checkpoints/ckpt-*/manifest.json"))
    assert newest >= 1  # the checkpoint the signal asked for, after checkpoint 0
    assert (usr1_run / "hvctr.lock").read_text() == ""  # a clean stop releases the run directory
    # SIGTERM: mpirun ends the job itself; its status is 1, never the ranks' 75
    assert rc["term"] == 1, jobs["term"][2].read_text()[-3000:]
