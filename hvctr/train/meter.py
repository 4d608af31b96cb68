"""What a run reports: progress lines on rank 0, a JSON-lines metrics file, a closing summary.

metrics.jsonl (rank 0) holds one JSON object a line: ``"event": "progress"`` every
``metrics.log_every_steps`` (training loss since the last line, samples/s, ETA, cache hit rate),
``"event": "eval"`` every ``metrics.eval_every_windows`` and at the end (validation AUC,
logloss, NE, COPC, calibration; read-only, as ``hvctr eval``). ``hvctr report`` draws it.

Time is split into the phases a user tunes against: compute (forward, backward, optimiser),
pull (working-set rows from their owners), merge (dense allreduce and sparse push), io (data
reading in the main thread, checkpoints). Prefetch time overlaps training and is reported apart.
"""

from __future__ import annotations

import datetime
import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from hvctr.formats import safefile
from hvctr.formats.space import remedy
from hvctr.log import get_logger

log = get_logger(__name__)

PHASES = ("compute", "pull", "merge", "io")
# metrics.tensorboard: what goes to TensorBoard from each kind of metrics.jsonl record
TB_SCALARS = {"progress": ("loss", "samples_per_s", "cache_hit_rate", "merge_ms"),
              "eval": ("auc", "logloss", "ne", "copc", "calibration")}


def open_tensorboard(directory: Path):
    """A TensorBoard SummaryWriter on ``directory`` (metrics.tensorboard = true). TensorBoard is
    an optional extra: without it this is a ValueError saying how to install it."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        raise ValueError("config key 'metrics.tensorboard': true, but the tensorboard package is not installed: "
                         "pip install 'hvctr[tensorboard]' (or set it to false; metrics.jsonl and hvctr report "
                         "need nothing more)")
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(directory))


class Meter:
    def __init__(self, rank: int, metrics_path: Path | None, log_every_steps: int,
                 batch_size_per_rank: int, world_size: int, tensorboard_dir: Path | None = None) -> None:
        self.rank = rank
        self.seconds = {p: 0.0 for p in PHASES}
        self.log_every_steps = log_every_steps
        self.global_batch = batch_size_per_rank * world_size
        self._path = metrics_path
        try:
            # O_NOFOLLOW: a link planted at metrics.jsonl is refused, naming it (a ValueError)
            self._file = safefile.open_append(metrics_path) if metrics_path is not None and rank == 0 else None
        except OSError as e:
            raise ValueError(f"cannot open the run's metrics file {metrics_path}: {e.strerror or e}") from None
        self._t_start = time.perf_counter()
        self._t_last = self._t_start
        self._steps_last = 0
        self._step0 = 0  # the step this process started at (a resumed run's checkpoint)
        self._train_s = 0.0  # seconds between progress lines, evaluation excluded: the ETA's rate
        self.excluded_s = 0.0  # validation passes during training: not in elapsed()
        self._loss_sum = 0.0
        self._loss_n = 0
        self._tb = open_tensorboard(tensorboard_dir) if tensorboard_dir is not None and rank == 0 else None

    def start(self, step: int) -> None:
        """Training starts (or resumes) at ``step``: rates and the ETA count from here."""
        self._step0 = self._steps_last = step
        self._t_last = time.perf_counter()
        self._train_s = 0.0

    def exclude(self, seconds: float) -> None:
        """Time spent outside training (a validation pass) that rates and the ETA leave out."""
        self._t_last += seconds
        self.excluded_s += seconds

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0

    def add_loss(self, loss: float) -> None:
        self._loss_sum += loss
        self._loss_n += 1

    def record(self, event: dict[str, Any]) -> None:
        """One JSON line in metrics.jsonl (rank 0), and its scalars in TensorBoard's event file."""
        if self._tb is not None and event.get("event") in TB_SCALARS:
            at = int(event.get("samples", event.get("step", 0)))  # TensorBoard's x axis: samples trained
            for key in TB_SCALARS[event["event"]]:
                if isinstance(event.get(key), (int, float)):
                    self._tb.add_scalar(f"{'train' if event['event'] == 'progress' else 'valid'}/{key}", event[key], at)
            self._tb.flush()
        if self._file is not None:
            event = {"time": round(time.time(), 3), **event}
            try:
                self._file.write(json.dumps(event, sort_keys=True) + "\n")
                self._file.flush()
            except OSError as e:  # a full disk: one message naming the file, not a traceback
                raise ValueError(f"cannot write the run's metrics file {self._path} ({event.get('event')} record): "
                                 f"{e.strerror or e}; {remedy(e, Path(self._path).parent)} (--resume continues from the last "
                                 f"complete checkpoint)") from None

    def maybe_log(self, step: int, total_steps: int, extra: dict[str, Any]) -> None:
        if step - self._steps_last < self.log_every_steps and step != total_steps:
            return
        now = time.perf_counter()
        rate = (step - self._steps_last) * self.global_batch / max(now - self._t_last, 1e-9)
        self._train_s += max(now - self._t_last, 0.0)
        eta = eta_seconds(step - self._step0, total_steps - step, self._train_s)
        loss = self._loss_sum / max(self._loss_n, 1)
        event = {"event": "progress", "step": step, "samples": step * self.global_batch,
                 "samples_per_s": round(rate, 1),
                 "loss": round(loss, 5), "eta_s": None if eta is None else round(eta, 1), **extra}
        self.record(event)
        pct = 100.0 * step / max(total_steps, 1)
        hit = extra.get("cache_hit_rate")
        log.info(
            f"step {step}/{total_steps} ({pct:4.1f}%)  {rate:,.0f} samples/s  loss {loss:.4f}  "
            + (f"cache hit {hit:.3f}  " if hit is not None else "")
            + f"ws rows {extra.get('working_set_rows', 0):,}  merge {extra.get('merge_ms', 0):.1f} ms  "
            + format_eta(eta))
        self._t_last, self._steps_last = now, step
        self._loss_sum, self._loss_n = 0.0, 0

    def log_eval(self, step: int, samples: int, result: dict[str, Any], seconds: float, final: bool = False) -> None:
        """A validation pass: one "eval" line in metrics.jsonl and one log line."""
        self.record({"event": "eval", "split": "valid", "step": step, "samples": samples, "final": final,
                     "seconds": round(seconds, 3), **result})
        log.info(f"validation at step {step} ({samples:,} samples): AUC {result['auc']:.4f}  "
                 f"logloss {result['logloss']:.4f}  NE {result['ne']:.4f}  COPC {result['copc']:.3f}  "
                 f"({seconds:.1f} s)")

    def elapsed(self) -> float:
        """Seconds since the meter started, validation passes during training left out."""
        return time.perf_counter() - self._t_start - self.excluded_s

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError:  # a write that failed already said so (record)
                pass


def eta_seconds(steps_done: int, steps_left: int, seconds: float) -> float | None:
    """Seconds to go at the mean rate so far; None before any step was timed."""
    if steps_done <= 0 or seconds <= 0:
        return None
    return steps_left * seconds / steps_done


def format_eta(eta: float | None, now: float | None = None) -> str:
    """``eta 0:12:05 (2026-12-01 21:40)``: time left, then the local date and time it ends."""
    if eta is None:
        return "eta -"
    end = datetime.datetime.fromtimestamp((time.time() if now is None else now) + eta)
    return f"eta {datetime.timedelta(seconds=round(eta))} ({end:%Y-%m-%d %H:%M})"
