"""The study directory, shared by every worker of a study (on the shared file system):

    DIR/study.json      what every worker must agree on: the space, the base config and
                        overrides, sampler, pruner, seed (written by the first worker)
    DIR/journal.log     Optuna's JournalStorage: an append-only log of operations, one JSON line
                        each (no database server; the file is the study)
    DIR/journal.log.lock, DIR/sweep.lock   Optuna's symlink locks (NFS-safe; a lock left by a
                        killed process is taken over after 30 s): one around each journal
                        append, one around a worker's reap-and-ask
    DIR/trials/trial-NNNN/   one hvctr run directory per trial, with the worker's files:
                        lease.json (host, pid; its mtime is the heartbeat), evals.jsonl (one line
                        per validation: eval, step, AUC, logloss), train.log (hvctr train's output)

A worker that dies (SIGKILL, a node lost, a preempted array task) leaves its trial RUNNING in
the journal. The next worker to take the lock reaps it: a lease on this host whose pid is gone,
or a heartbeat older than ``stale_after_s``, marks the trial FAIL and enqueues a retry with
the same parameters that resumes the same run directory from its last checkpoint (the
evaluations it had are reported again, so the pruner sees them). A worker stopped by
SIGTERM/SIGINT does this itself after hvctr train checkpointed.

The journal's appends are single write() calls on an O_APPEND descriptor under the lock, and a
torn last line (a writer that died inside a write on a file system that tears) is cut off before
the next append: a record is in the study whole or not at all. An append that fails (a full
disk) is cut off too, and its error names the journal.

Every record is checked as it is read, before Optuna applies it: a line that is not JSON, not an
operation Optuna records, or that Optuna cannot apply (a record of another worker that names no
trial, ...) is an error naming the journal and its line, and saying how to recover the study as
it was before that line (``JournalDamaged``), where Optuna raised a bare JSONDecodeError or
``AssertionError: Should not reach.``
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock

from hvctr.formats import safefile
from hvctr.formats.dirlock import pid_alive
from hvctr.formats.textfile import read_json

STUDY_NAME = "hvctr-sweep"
SETTINGS = "study.json"
JOURNAL = "journal.log"
LOCK_GRACE_S = 30
MAX_RETRIES = 2  # a trial whose worker died is retried at most this many times


# Optuna 5.0.0's journal operations (optuna.storages.journal._storage.JournalOperation): 0
# CREATE_STUDY .. 10 DISCARD_TRIALS. CREATE_TRIAL numbers the study's trials in journal order.
JOURNAL_OPS = range(11)
CREATE_TRIAL = 4


class JournalDamaged(ValueError):
    """A journal line Optuna cannot read: named, with how to get the study back."""


class AtomicJournalBackend(JournalFileBackend):
    """Optuna's file backend with appends that cannot interleave or leave a torn line behind,
    and reads that check every record (``read_logs``)."""

    def __init__(self, path: str, lock: JournalFileSymlinkLock) -> None:
        super().__init__(path, lock)
        self._path, self._lock_obj = path, lock
        self._offsets: dict[int, int] = {0: 0}  # record number -> byte offset of its line
        self.last_line, self.last_record = 0, None  # the record Optuna applies now (JournalStorage)

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        data = ("\n".join(json.dumps(log, separators=(",", ":")) for log in logs) + "\n").encode()
        with lock_held(self._lock_obj):
            fd = os.open(self._path, os.O_RDWR | os.O_APPEND)
            try:
                _cut_torn_tail(fd)
                size = os.fstat(fd).st_size
                try:
                    view = memoryview(data)
                    while view:  # one write() on a local file; a loop for file systems that write short
                        view = view[os.write(fd, view):]
                    os.fsync(fd)
                except OSError as e:  # a full disk: what was written of the records is cut off
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, size)
                    raise OSError(e.errno, e.strerror, self._path) from None
            finally:
                os.close(fd)

    def read_logs(self, log_number_from: int) -> Iterator[dict[str, Any]]:
        """The records from number ``log_number_from`` on (Optuna's reader, each record checked):
        an unterminated last line is not read (a torn write, cut before the next append)."""
        with open(self._path, "rb") as f:
            end = os.fstat(f.fileno()).st_size  # appends after this are read next time
            number = log_number_from if log_number_from in self._offsets else 0
            pos = self._offsets[number]
            f.seek(pos)
            for line in f:
                if pos + len(line) > end or not line.endswith(b"\n"):
                    return
                pos += len(line)
                self._offsets[number + 1] = pos
                number += 1
                if number <= log_number_from:
                    continue
                record = self._record(line, number)
                self.last_line, self.last_record = number, record
                yield record

    def _record(self, line: bytes, number: int) -> dict[str, Any]:
        try:
            record = json.loads(line)
        except ValueError as e:  # not JSON, not UTF-8
            raise self.damaged(number, f"not JSON ({e})") from None
        if not isinstance(record, dict) or not isinstance(record.get("worker_id"), str):
            raise self.damaged(number, "not a journal record (a JSON object with a worker_id)")
        op = record.get("op_code")
        if type(op) is not int or op not in JOURNAL_OPS:
            raise self.damaged(number, f"op_code {op!r} is not an operation the journal records (Optuna "
                                       f"5.0.0's are 0..{JOURNAL_OPS[-1]})")
        return record

    def damaged(self, number: int, problem: str) -> JournalDamaged:
        """The error for journal line ``number``: what is wrong, and how to keep the study as it
        was before it (the trials created before that line; the later trials' directories must
        go, or new trials of their numbers would resume them)."""
        trials = 0
        with contextlib.suppress(OSError), open(self._path, "rb") as f:
            for _, line in zip(range(number - 1), f):
                with contextlib.suppress(ValueError):
                    trials += json.loads(line).get("op_code") == CREATE_TRIAL
        path = Path(self._path)
        return JournalDamaged(
            f"{path}, line {number}: {problem}: the study cannot be read from that line on (damaged by a "
            f"disk error or an edit). To recover the study as it was before it: stop every worker, then "
            f"`mv {path} {path}.damaged && head -n {number - 1} {path}.damaged > {path}`; it then holds "
            f"{trials} trial(s): move {path.parent / 'trials'}/trial-{trials:04d} and any later trial "
            f"directories away before the workers start again (a new trial of that number would resume it)")


class CheckedJournalStorage(JournalStorage):
    """Optuna's JournalStorage whose replay names the journal line Optuna could not apply. The
    errors Optuna raises on purpose for this worker's own records (a finished trial updated, a
    study created twice) go on unchanged."""

    def _sync_with_backend(self) -> None:
        backend: AtomicJournalBackend = self._backend
        try:
            super()._sync_with_backend()
        except JournalDamaged:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, AssertionError) as e:
            record = backend.last_record
            if record is not None and record.get("worker_id") == self._replay_result.worker_id:
                raise  # Optuna's own answer to this process's request
            raise backend.damaged(backend.last_line, f"Optuna cannot apply it ({type(e).__name__}: {e})") from None


def _cut_torn_tail(fd: int) -> None:
    """A last line without its newline is a record cut by a writer's death: drop it (it was never
    read as a record: Optuna's reader skips an unterminated last line)."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return
    pos = size
    while pos > 0:
        start = max(0, pos - 65536)
        block = os.pread(fd, pos - start, start)
        nl = block.rfind(b"\n")
        if nl >= 0:
            os.ftruncate(fd, start + nl + 1)
            return
        pos = start
    os.ftruncate(fd, 0)


@contextmanager
def lock_held(lock: JournalFileSymlinkLock) -> Iterator[None]:
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


class StudyDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.lock = JournalFileSymlinkLock(str(self.path / "sweep"), grace_period=LOCK_GRACE_S)
        self._storage: JournalStorage | None = None

    @property
    def journal(self) -> Path:
        return self.path / JOURNAL

    def exists(self) -> bool:
        return (self.path / SETTINGS).is_file() and self.journal.is_file()

    def settings(self) -> dict[str, Any]:
        f = self.path / SETTINGS
        if not f.is_file():
            raise ValueError(f"{self.path} is not a sweep study: {f} is missing (hvctr sweep run creates it)")
        settings = read_json(f, "study settings")
        if not isinstance(settings, dict) or not isinstance(settings.get("space"), dict):
            raise ValueError(f"study settings {f}: not the settings of a study (no space): damaged")
        return settings

    def create_or_check(self, settings: dict[str, Any]) -> dict[str, Any]:
        """The study's settings: ``settings`` for a new study; for an existing one, its own,
        which must equal ``settings`` (workers of one study share them) unless that is empty."""
        if not settings and not (self.path / SETTINGS).is_file():
            raise ValueError(f"{self.path} holds no study yet: the first worker needs --space")
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "trials").mkdir(exist_ok=True)
        with lock_held(self.lock):
            f = self.path / SETTINGS
            if f.is_file():
                have = self.settings()
                diff = sorted(k for k in set(have) | set(settings) if settings and have.get(k) != settings.get(k))
                if diff:
                    raise ValueError(f"{self.path} holds a study made with other settings ({', '.join(diff)}: "
                                     f"{', '.join(f'{k}={have.get(k)!r}' for k in diff)}): join it with the same "
                                     f"--space, --config, overrides, --sampler, --pruner and --seed, or use a new --study")
                return have
            if not settings:
                raise ValueError(f"{self.path} holds no study yet: the first worker needs --space")
            # key order kept: the space's order is the report's; a fresh temporary file, then renamed
            safefile.write_text(f, json.dumps(settings, indent=1))
            return settings

    def storage(self) -> JournalStorage:
        if self._storage is None:
            lock = JournalFileSymlinkLock(str(self.journal), grace_period=LOCK_GRACE_S)
            self._storage = CheckedJournalStorage(AtomicJournalBackend(str(self.journal), lock))
        return self._storage

    def study(self, sampler=None, pruner=None) -> optuna.Study:
        return optuna.create_study(study_name=STUDY_NAME, storage=self.storage(), sampler=sampler, pruner=pruner,
                                   direction="maximize", load_if_exists=True)

    def trial_dir(self, number: int) -> Path:
        return self.path / "trials" / f"trial-{number:04d}"


# --- leases: which RUNNING trials still have a live worker --------------------------------

class Lease:
    """The file that says a worker holds a trial; a thread touches it every ``beat_s``."""

    def __init__(self, run_dir: Path, trial_number: int, beat_s: float) -> None:
        self.path = run_dir / "lease.json"
        run_dir.mkdir(parents=True, exist_ok=True)
        safefile.write_text(self.path, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                   "trial": trial_number, "since": time.time()}))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(beat_s,), daemon=True, name="sweep-lease")
        self._thread.start()

    def _beat(self, beat_s: float) -> None:
        while not self._stop.wait(beat_s):
            try:
                os.utime(self.path)
            except OSError:
                pass  # the directory went away: the reaper decides by age

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def lost_reason(run_dir: Path, started: float | None, stale_after_s: float, now: float | None = None) -> str:
    """Why a RUNNING trial has no live worker ("" when it may have one)."""
    now = time.time() if now is None else now
    lease = run_dir / "lease.json"
    try:
        info = read_json(lease, "lease")
        age = now - lease.stat().st_mtime
        if not isinstance(info, dict):
            raise ValueError(f"{lease}: not a lease")
    except (OSError, ValueError):
        # no lease yet: the worker died between ask and writing it, or is just writing it
        age = now - (started or now)
        return f"no lease, started {age:.0f} s ago" if age > stale_after_s else ""
    pid = info.get("pid")
    if info.get("host") == socket.gethostname() and not (type(pid) is int and pid_alive(pid)):
        return f"worker pid {info.get('pid')} on {info.get('host')} is gone"
    if age > stale_after_s:
        return f"worker pid {info.get('pid')} on {info.get('host')}: no heartbeat for {age:.0f} s"
    return ""


def reap(sd: StudyDir, study: optuna.Study, stale_after_s: float, log=print) -> int:
    """Marks FAIL every RUNNING trial whose worker is gone, and enqueues its retry (resuming its
    run directory) unless it was retried MAX_RETRIES times. Call with the study lock held."""
    n = 0
    storage = study._storage
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        run_dir = Path(t.user_attrs.get("run_dir", sd.trial_dir(t.number)))
        started = t.datetime_start.timestamp() if t.datetime_start else None
        why = lost_reason(run_dir, started, stale_after_s)
        if not why:
            continue
        storage.set_trial_user_attr(t._trial_id, "failed", f"worker lost: {why}")
        storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)
        retries = int(t.user_attrs.get("retry", 0))
        if retries < MAX_RETRIES and t.params:
            study.enqueue_trial(t.params, user_attrs={"run_dir": str(run_dir), "retry_of": t.number,
                                                      "retry": retries + 1}, skip_if_exists=False)
            log(f"trial {t.number}: {why}: marked failed; a retry resumes {run_dir}")
        else:
            log(f"trial {t.number}: {why}: marked failed (retried {retries} times already: no retry)")
        n += 1
    return n
