"""What a run reports: progress lines on rank 0, a JSON-lines metrics file, a closing summary.

Time is split into the phases a user tunes against: compute (forward, backward, optimiser),
pull (working-set rows from their owners), merge (dense allreduce and sparse push), io (data
reading in the main thread, checkpoints). Prefetch time overlaps training and is reported apart.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from hvctr.dist.log import get_logger

log = get_logger(__name__)

PHASES = ("compute", "pull", "merge", "io")


class Meter:
    def __init__(self, rank: int, metrics_path: Path | None, log_every_steps: int,
                 batch_size_per_rank: int, world_size: int) -> None:
        self.rank = rank
        self.seconds = {p: 0.0 for p in PHASES}
        self.log_every_steps = log_every_steps
        self.global_batch = batch_size_per_rank * world_size
        self._file = open(metrics_path, "a") if metrics_path is not None and rank == 0 else None
        self._t_start = time.perf_counter()
        self._t_last = self._t_start
        self._steps_last = 0
        self._loss_sum = 0.0
        self._loss_n = 0

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
        """One JSON line in metrics.jsonl (rank 0)."""
        if self._file is not None:
            event = {"time": round(time.time(), 3), **event}
            self._file.write(json.dumps(event, sort_keys=True) + "\n")
            self._file.flush()

    def maybe_log(self, step: int, total_steps: int, extra: dict[str, Any]) -> None:
        if step - self._steps_last < self.log_every_steps and step != total_steps:
            return
        now = time.perf_counter()
        rate = (step - self._steps_last) * self.global_batch / max(now - self._t_last, 1e-9)
        loss = self._loss_sum / max(self._loss_n, 1)
        event = {"event": "progress", "step": step, "samples_per_s": round(rate, 1),
                 "loss": round(loss, 5), **extra}
        self.record(event)
        pct = 100.0 * step / max(total_steps, 1)
        hit = extra.get("cache_hit_rate")
        log.info(
            f"step {step}/{total_steps} ({pct:4.1f}%)  {rate:,.0f} samples/s  loss {loss:.4f}  "
            + (f"cache hit {hit:.3f}  " if hit is not None else "")
            + f"ws rows {extra.get('working_set_rows', 0):,}  merge {extra.get('merge_ms', 0):.1f} ms")
        self._t_last, self._steps_last = now, step
        self._loss_sum, self._loss_n = 0.0, 0

    def elapsed(self) -> float:
        return time.perf_counter() - self._t_start

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
