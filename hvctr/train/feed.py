"""The trainer's view of the data: batches per epoch agreed over ranks, windows, eval batches.

Rank r reads the data shards s with s % W == r (hvctr.train.data.ShardReader). Ranks hold different
numbers of rows, and every step is a collective, so the batches per epoch are the minimum over
ranks; a rank's batches past it (and its partial last batch) are dropped, counted and reported.
Evaluation reads every row, the partial last batch included.
"""

from __future__ import annotations

import numpy as np

from hvctr.config import DataConfig
from hvctr.train.data import NUM_DENSE, NUM_FIELDS, ShardReader
from hvctr.dist.world import AgreedError
from hvctr.dist.log import get_logger

log = get_logger(__name__)


class _WindowReader:
    """``read(first, count)``: batches first .. first+count-1 as [n, B, ...] arrays."""

    def __init__(self, reader: ShardReader) -> None:
        self._reader = reader
        self._b = reader.batch_size

    def read(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        labels, dense, keys = self._reader.read_rows(first * self._b, (first + count) * self._b)
        return (labels.reshape(count, self._b), dense.reshape(count, self._b, NUM_DENSE),
                keys.reshape(count, self._b, NUM_FIELDS))


class EvalReader:
    """Every row of a split on this rank, in batches; the last one may be short."""

    def __init__(self, reader: ShardReader) -> None:
        self._reader = reader
        self._b = reader.batch_size
        self.num_batches = -(-reader.rows // self._b)

    def batch(self, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self._reader.read_rows(b * self._b, min((b + 1) * self._b, self._reader.rows))

    @staticmethod
    def empty() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (np.zeros(0, np.float32), np.zeros((0, NUM_DENSE), np.float32),
                np.zeros((0, NUM_FIELDS), np.uint64))


class TrainData:
    def __init__(self, cfg: DataConfig, comm, verify: bool = True) -> None:
        if not cfg.train_dir:
            raise ValueError("config key 'data.train_dir' is empty: point it at a data_prep output directory")
        self.cfg, self.comm = cfg, comm
        # comm: allgather of open/verify errors: a damaged shard is one rank's, and the others
        # must not wait for it in the allreduce below
        self._reader = comm.agree(lambda: ShardReader(cfg.train_dir, "train", comm.rank, comm.size,
                                                      cfg.batch_size_per_rank, verify=verify), name="data.open")
        mine = self._reader.num_batches
        # comm: allreduce (Min) of the full batches each rank holds: the batches per epoch
        (self.batches_per_epoch,) = comm.allreduce_min_int([mine], name="data.batches_per_epoch")
        if self.batches_per_epoch == 0:
            raise AgreedError(f"{cfg.train_dir}: some rank has fewer rows than one batch (data.batch_size_per_rank="
                              f"{cfg.batch_size_per_rank}); lower it or add data", report=comm.rank == 0)
        self.dropped_batches = mine - self.batches_per_epoch
        self.dropped_rows = self._reader.rows - self.batches_per_epoch * cfg.batch_size_per_rank

    def reader_for_epoch(self, epoch: int) -> _WindowReader:
        return _WindowReader(self._reader)

    def eval_reader(self, split: str) -> EvalReader:
        data_dir = self.cfg.valid_dir or self.cfg.train_dir
        return EvalReader(ShardReader(data_dir, split, self.comm.rank, self.comm.size,
                                      self.cfg.batch_size_per_rank))
