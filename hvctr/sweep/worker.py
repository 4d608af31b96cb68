"""``hvctr sweep run``: one worker of a study. Any number of them share a study directory.

    hvctr sweep run --space S.toml --study DIR --trials 24 --config base.toml --data.train_dir=...

Loop: under the study's worker lock, reap trials whose worker died (hvctr.sweep.study) and ask
for the next trial while the study holds fewer than --trials (complete, pruned, running or
waiting); then, without the lock, train it: ``hvctr train --train.max_steps=s_i --resume`` for
each evaluation i of the space (each resumes the last chunk's checkpoint, trains to s_i and ends
with a validation pass: the trial-local evaluation), reporting the validation AUC of each to
the pruner; a pruned trial stops there. Each trial is a normal hvctr run directory. A new
study's first trial is the base config's own values of the searched keys (--no-baseline: none),
so the search starts from the config it is meant to improve on.

A failing hvctr train (exit code other than 0) fails the trial with the command's log named,
and the worker goes on with the next. SIGTERM / SIGINT (scancel, a preempted array task,
Ctrl-C) are forwarded to hvctr train as SIGUSR1 (it checkpoints and exits 75); the trial is
then marked failed with a retry queued that resumes it, and the worker exits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from hvctr.config import load_config
from hvctr.formats import safefile
from hvctr.formats.space import remedy
from hvctr.formats.textfile import read_json, read_text
from hvctr.sweep.space import Space, space_from_dict
from hvctr.sweep.study import Lease, StudyDir, lock_held, reap


EXIT_STOPPED = 143  # the worker was asked to stop (128 + SIGTERM)


class Stopped(Exception):
    """The worker got SIGTERM or SIGINT."""


def log(msg: str) -> None:
    print(f"[sweep {socket.gethostname()}:{os.getpid()} {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_sampler(name: str, seed: int):
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=8)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise ValueError(f"--sampler {name!r}: one of tpe, random")


def make_pruner(name: str, evals: int):
    """Rungs are evaluation indices 1..evals (each a chunk of steps)."""
    if name == "sha":  # asynchronous successive halving: top 1/3 of each rung go on
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource=evals, reduction_factor=3)
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=0)
    if name == "none":
        return optuna.pruners.NopPruner()
    raise ValueError(f"--pruner {name!r}: one of sha, hyperband, median, none")


class Worker:
    def __init__(self, sd: StudyDir, settings: dict[str, Any], args: argparse.Namespace) -> None:
        self.sd, self.settings, self.args = sd, settings, args
        self.space: Space = space_from_dict(settings["space"], f"{sd.path}/study.json")
        worker_id = args.worker_id if args.worker_id is not None else int(
            os.environ.get("SLURM_ARRAY_TASK_ID", os.getpid()))
        # each worker its own stream: workers with one seed would propose the same first trials
        self.study = sd.study(make_sampler(settings["sampler"], settings["seed"] * 1_000_003 + worker_id),
                              make_pruner(settings["pruner"], self.space.evals))
        self.child: subprocess.Popen | None = None
        self.stop_signal = 0

    def enqueue_baseline(self) -> None:
        """A new study's first trial is the base config itself (its values of the searched keys), so
        the search has the user's current config as its reference and the best trial is at least
        as good (unless it is pruned by better ones). Once per study: the first worker, under the lock."""
        with lock_held(self.sd.lock):
            if self.study.get_trials(deepcopy=False):
                return
            s = self.settings
            values, why = self.space.baseline(load_config(s["config"] or None, s["overrides"]))
            if values is None:
                log(f"no baseline trial: {why}")
                return
            self.study.enqueue_trial(values, user_attrs={"baseline": True})
            log(f"trial 0 is the base config: {_fmt(values)}")

    # --- the loop --------------------------------------------------------------------------

    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        done = failed_in_a_row = 0
        try:
            while not self.stop_signal and (self.args.max_trials == 0 or done < self.args.max_trials):
                try:
                    trial = self._next_trial()
                except OSError as e:  # the journal (reaping, asking) on a full or read-only disk
                    raise ValueError(f"cannot write {e.filename or self.sd.journal}: {e.strerror or e}; no trial "
                                     f"was started: {remedy(e, self.sd.path)}, then start the worker again") from None
                if trial is None:
                    log(f"the study holds {self.args.trials} trials: nothing left to run")
                    break
                failed_in_a_row = failed_in_a_row + 1 if self._run_trial(trial) is TrialState.FAIL else 0
                done += 1
                if failed_in_a_row >= self.args.max_failures:  # a broken base config: every trial fails
                    raise ValueError(f"{failed_in_a_row} trials in a row failed (--max-failures): stopping this "
                                     f"worker; the trials' train.log under {self.sd.path / 'trials'} say why")
        except Stopped:
            pass
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
        return EXIT_STOPPED if self.stop_signal else 0

    def _on_signal(self, signum, _frame) -> None:
        self.stop_signal = signum
        log(f"signal {signal.Signals(signum).name}: stopping the trial at its next window (checkpoint first)")
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGUSR1)  # hvctr train: checkpoint, exit 75; mpirun/srun pass it on

    def _next_trial(self) -> optuna.Trial | None:
        with lock_held(self.sd.lock):
            reap(self.sd, self.study, self.args.stale_after, log)
            trials = self.study.get_trials(deepcopy=False)
            live = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)]
            waiting = [t for t in trials if t.state is TrialState.WAITING]
            if len(live) + len(waiting) >= self.args.trials and not waiting:
                return None
            trial = self.study.ask()  # a waiting retry first, else a new trial
            try:
                run_dir = Path(trial.user_attrs.get("run_dir") or self.sd.trial_dir(trial.number))
                trial.set_user_attr("run_dir", str(run_dir))
                trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
                # the lease exists before the lock is released: a reaper never sees this trial leaseless
                self.lease = Lease(run_dir, trial.number, beat_s=max(1.0, self.args.stale_after / 4))
            except OSError as e:
                self.lease = None
                raise self._cannot_write(trial, e) from None
            return trial

    def _run_trial(self, trial: optuna.Trial) -> TrialState | None:
        run_dir = Path(trial.user_attrs["run_dir"])
        t0 = time.time()
        params: dict[str, Any] = {}
        try:
            params = {p.key: p.suggest(trial) for p in self.space.params}
            (state, value), note = self._train(trial, run_dir, params), ""
        except Stopped:
            self._tell_interrupted(trial, run_dir, t0)
            self.lease.release()
            raise
        except optuna.exceptions.UpdateFinishedTrialError:
            log(f"trial {trial.number}: another worker marked it finished (reaped as lost): abandoned")
            self._kill_child()
            self.lease.release()
            return None
        except TrialFailed as e:
            state, value, note = TrialState.FAIL, None, str(e)
        except OSError as e:  # the study's disk (evals.jsonl, train.log, the journal): full, read-only
            raise self._cannot_write(trial, e) from None
        try:
            self._finish(trial, t0, state, value, note)
        except OSError as e:
            raise self._cannot_write(trial, e) from None
        self.lease.release()  # after the tell: a reaper never sees a running trial without a lease
        if state is TrialState.FAIL:
            log(f"trial {trial.number}: failed: {note}")
        else:
            log(f"trial {trial.number}: {state.name.lower()}, AUC {value:.4f}  {_fmt(params)}")
        return state

    def _finish(self, trial: optuna.Trial, t0: float, state: TrialState, value: float | None, note: str) -> None:
        trial.set_user_attr("wall_s", round(time.time() - t0, 1))
        if note:
            trial.set_user_attr("failed", note)
        self.study.tell(trial, value if state is TrialState.COMPLETE else None, state=state)

    def _train(self, trial: optuna.Trial, run_dir: Path, params: dict[str, Any]) -> tuple[TrialState, float]:
        evals_file = run_dir / "evals.jsonl"
        done = _read_evals(evals_file) if evals_file.is_file() else []
        for e in done:  # a retry: what its predecessor measured, so the pruner sees it
            trial.report(e["auc"], e["eval"])
        steps = self.space.eval_steps()
        auc = done[-1]["auc"] if done else float("nan")
        for i in range(len(done), len(steps)):
            if done and trial.should_prune():
                return self._pruned(trial, done[-1])
            summary = self._chunk(trial, run_dir, params, steps[i])
            ev = summary.get("eval") or {}
            if "auc" not in ev:
                raise TrialFailed(f"{run_dir}/summary.json has no validation AUC after {steps[i]} steps")
            rec = {"eval": i + 1, "step": summary["steps"], "auc": ev["auc"], "logloss": ev.get("logloss"),
                   "time": time.time()}
            _append_line(evals_file, json.dumps(rec))
            done.append(rec)
            auc = rec["auc"]
            trial.report(auc, i + 1)
            trial.set_user_attr("auc", auc)
            trial.set_user_attr("logloss", rec["logloss"])
            trial.set_user_attr("steps", rec["step"])
            log(f"trial {trial.number}: eval {i + 1}/{len(steps)} at step {rec['step']}: AUC {auc:.4f}")
        return TrialState.COMPLETE, auc

    def _pruned(self, trial: optuna.Trial, last: dict[str, Any]) -> tuple[TrialState, float]:
        trial.set_user_attr("pruned_at_step", last["step"])
        return TrialState.PRUNED, last["auc"]

    def _chunk(self, trial: optuna.Trial, run_dir: Path, params: dict[str, Any], max_steps: int) -> dict[str, Any]:
        """hvctr train up to ``max_steps``, resuming the run directory's newest checkpoint."""
        if self.stop_signal:
            raise Stopped()
        s = self.settings
        overrides = [*s["overrides"], *(f"--{k}={v}" for k, v in params.items()),
                     f"--train.run_dir={run_dir}", f"--train.max_steps={max_steps}"]
        cmd = [*shlex.split(self.args.launcher.format(ranks=self.space.ranks)), sys.executable, "-m", "mpi4py",
               "-m", "hvctr", "train", *(["--config", s["config"]] if s["config"] else []), *overrides, "--resume"]
        run_dir.mkdir(parents=True, exist_ok=True)
        _append_line(run_dir / "train.log", f"\n# trial {trial.number}: {shlex.join(cmd)}")
        with safefile.open_append(run_dir / "train.log", "a") as out:
            self.child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
            rc = self.child.wait()
            self.child = None
        drop_working_shards(run_dir)
        if self.stop_signal:
            raise Stopped()
        if rc != 0:
            raise TrialFailed(f"hvctr train exited with {rc} (its output: {run_dir / 'train.log'})")
        try:
            summary = read_json(run_dir / "summary.json", "run summary")
        except ValueError as e:
            raise TrialFailed(f"hvctr train exited 0 but {e}") from None
        if not isinstance(summary, dict):
            raise TrialFailed(f"hvctr train exited 0 but {run_dir / 'summary.json'} is not a summary")
        return summary

    def _cannot_write(self, trial: optuna.Trial, e: OSError) -> ValueError:
        """The error that stops this worker when a file of the study cannot be written. The
        trial is marked failed when the journal still takes it (its lease then goes); else it
        stays running, and the next worker reaps it (hvctr.sweep.study.reap): at once where its
        lease names this worker's pid (gone by then), else once it is --stale-after old."""
        self._kill_child()
        where = e.filename or self.sd.path
        note = f"cannot write {where}: {e.strerror or e}"
        try:
            self._finish(trial, time.time(), TrialState.FAIL, None, note)
        except (OSError, optuna.exceptions.UpdateFinishedTrialError):
            when = ("at once (its lease names this worker, whose pid will be gone)" if self.lease is not None
                    else f"once it has run --stale-after ({self.args.stale_after:g} s) without a lease")
            told = f"the journal could not record that trial {trial.number} failed: the next worker marks it so {when}"
        else:
            told = f"trial {trial.number} is marked failed"
            if self.lease is not None:
                self.lease.release()
        return ValueError(f"{note}; {told}; {remedy(e, self.sd.path)}, then start the workers again")

    def _tell_interrupted(self, trial: optuna.Trial, run_dir: Path, t0: float) -> None:
        """Stopped by a signal: the trial fails, and a retry queued with the same parameters
        resumes its run directory from the checkpoint hvctr train wrote on the way out."""
        self._kill_child()
        retries = int(trial.user_attrs.get("retry", 0))
        self._finish(trial, t0, TrialState.FAIL, None, f"worker stopped by signal {self.stop_signal}")
        self.study.enqueue_trial(trial.params, user_attrs={"run_dir": str(run_dir), "retry_of": trial.number,
                                                           "retry": retries + 1}, skip_if_exists=False)
        log(f"trial {trial.number}: marked failed; a retry queued resumes {run_dir}")

    def _kill_child(self) -> None:
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGUSR1)
            try:
                self.child.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.child.kill()
                self.child.wait()


class TrialFailed(Exception):
    pass


def drop_working_shards(run_dir: Path) -> None:
    """Removes the working shards hvctr train left in a trial's run directory (``shards/``, where
    no storage.shard_dir, hardware-map SSD or node-local scratch takes them). Every start rebuilds
    them from the checkpoint, so between a trial's chunks and after it they are dead weight: a
    few hundred MB a trial, for every trial of the study. A link planted there is left alone."""
    shards = run_dir / "shards"
    try:
        if not safefile.check_dir(shards):
            return
    except safefile.PlantedPathError:
        return
    for f in [*shards.glob("shard-r[0-9][0-9][0-9][0-9][0-9].h5"), *shards.glob("shard-r*.h5.*.tmp")]:
        safefile.remove_quietly(f)
    with contextlib.suppress(OSError):
        shards.rmdir()  # only when empty: nothing of anyone else's goes


def _read_evals(path: Path) -> list[dict[str, Any]]:
    """The evaluations a trial recorded (evals.jsonl): a line cut by a full disk is left out."""
    out = []
    for n, line in enumerate(read_text(path, "trial evaluations").splitlines(), start=1):
        try:
            rec = json.loads(line)
        except ValueError:
            log(f"{path}, line {n}: not an evaluation record (cut by a full disk?): left out")
            continue
        if isinstance(rec, dict) and isinstance(rec.get("auc"), float) and isinstance(rec.get("eval"), int):
            out.append(rec)
    return out


def _append_line(path: Path, line: str) -> None:
    """``line`` appended to ``path`` in one write (never through a planted link); an OSError names it."""
    try:
        with safefile.open_append(path, "a") as f:
            f.write(line + "\n")
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the worker dies, even by SIGKILL (Linux prctl), so a
    killed worker's hvctr train never runs on beside the retry that resumes its run directory."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _fmt(params: dict[str, Any]) -> str:
    return "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def settings_from_args(args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    """What every worker of the study must share (empty without --space: join as recorded)."""
    if not args.space:
        if overrides or args.config:
            raise ValueError("--config and overrides are the study's: give them with --space (the first worker), "
                             "or leave all three out to join the study as recorded")
        return {}
    from hvctr.formats.tomlfile import read_toml

    space = read_toml(args.space, "search space")  # read once: what is checked is what is recorded
    space_from_dict(space, args.space)  # checks it, with the file's name in any error
    load_config(args.config, overrides)  # the base config must load
    return {"space": space,
            "config": str(Path(args.config).resolve()) if args.config else "",
            "overrides": list(overrides), "sampler": args.sampler, "pruner": args.pruner, "seed": args.seed,
            # recorded only when off, so that studies made before the baseline existed still match
            **({} if args.baseline else {"baseline": False})}


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.trials < 1:
        raise ValueError(f"--trials must be >= 1, got {args.trials}")
    sd = StudyDir(args.study)
    settings = sd.create_or_check(settings_from_args(args, overrides))
    worker = Worker(sd, settings, args)
    if settings.get("baseline", True):  # a study setting: every worker of the study agrees on it
        worker.enqueue_baseline()
    log(f"study {sd.path}: {len(worker.study.trials)} trials so far, up to {args.trials}; sampler "
        f"{settings['sampler']}, pruner {settings['pruner']}, evaluations at steps {worker.space.eval_steps()}")
    return worker.run()
