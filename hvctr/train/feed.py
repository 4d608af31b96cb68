"""The trainer's view of the data: batches per epoch agreed over ranks, windows, eval batches.

Rank r reads the data shards s with s % W == r (hvctr.data.reader.ShardReader). Ranks hold different
numbers of rows, and every step is a collective, so the batches per epoch are the minimum over
ranks; a rank's batches past it (and its partial last batch) are dropped, counted and reported.
Evaluation reads every row, the partial last batch included.

At start the train shards are checked against the manifest's checksums as ``data.verify``
says: ``full`` every start; ``stamp`` (the default) once per data set: after a full check
rank 0 writes a stamp of the files' sizes, mtimes and inodes beside the manifest (or in the
run directory where the data directory is read-only), and later starts (requeues) re-hash only
the files whose record differs; ``off`` never (shapes are still checked).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from hvctr.config import DataConfig, DataVerify
from hvctr.data.bags import Bags, empty_bags
from hvctr.data.layout import reshard_coverage
from hvctr.data.reader import NUM_DENSE, NUM_FIELDS, ShardReader, read_stamp, write_stamp
from hvctr.distributed.world import AgreedError
from hvctr.log import get_logger

if TYPE_CHECKING:
    from hvctr.distributed.protocol import Comm

log = get_logger(__name__)


class _WindowReader:
    """``read(first, count)``: batches first .. first+count-1 as [n, B, ...] arrays."""

    def __init__(self, reader: ShardReader) -> None:
        self._reader = reader
        self._b = reader.batch_size

    def read(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | Bags]:
        """keys [n, B, F], or for multi-valued data a Bags of the n x B rows, batch after batch."""
        labels, dense, keys = self._reader.read_rows(first * self._b, (first + count) * self._b)
        return (labels.reshape(count, self._b), dense.reshape(count, self._b, NUM_DENSE),
                keys if isinstance(keys, Bags) else keys.reshape(count, self._b, NUM_FIELDS))


class EvalReader:
    """Every row of a split on this rank, in batches; the last one may be short."""

    def __init__(self, reader: ShardReader) -> None:
        self._reader = reader
        self._b = reader.batch_size
        self.num_batches = -(-reader.rows // self._b)

    def batch(self, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | Bags]:
        return self._reader.read_rows(b * self._b, min((b + 1) * self._b, self._reader.rows))

    def empty(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | Bags]:
        return (np.zeros(0, np.float32), np.zeros((0, NUM_DENSE), np.float32),
                empty_bags(NUM_FIELDS) if self._reader.multi_valued else np.zeros((0, NUM_FIELDS), np.uint64))


class TrainData:
    def __init__(self, cfg: DataConfig, comm: Comm, verify: bool = True, run_dir=None) -> None:
        if not cfg.train_dir:
            raise ValueError("config key 'data.train_dir' is empty: point it at a data_prep output directory")
        self.cfg, self.comm = cfg, comm
        mode = cfg.verify if verify else DataVerify.OFF
        stamp, stamp_path = read_stamp(cfg.train_dir, run_dir) if mode is DataVerify.STAMP else ({}, "")

        def open_and_verify():
            t0 = time.perf_counter()
            reader = ShardReader(cfg.train_dir, "train", comm.rank, comm.size, cfg.batch_size_per_rank)
            if mode is DataVerify.OFF:
                return reader, None
            try:
                good, hashed = reader.verify(skip=stamp if mode is DataVerify.STAMP else None)
            except ValueError:
                reader.close()
                raise
            return reader, (good, hashed, len(reader.paths), time.perf_counter() - t0)

        # comm: allgather of open/verify errors: a damaged shard is one rank's, and the others
        # must not wait for it in the allreduce below
        self._reader, checked = comm.agree(open_and_verify, name="data.open")
        if checked is not None:
            self._stamp(mode, checked, stamp, stamp_path, run_dir)
        # multi-valued fields ({"fields": [...], "separator": ...} of the manifest), None: one key a field
        self.multi_valued = self._reader.manifest.get("multi_valued") if self._reader.multi_valued else None
        mine = self._reader.num_batches
        # comm: allreduce (Min) of the full batches each rank holds: the batches per epoch
        (self.batches_per_epoch,) = comm.allreduce_min_int([mine], name="data.batches_per_epoch")
        if self.batches_per_epoch == 0:
            raise AgreedError(f"{cfg.train_dir}: some rank has fewer rows than one batch (data.batch_size_per_rank="
                              f"{cfg.batch_size_per_rank}); lower it or add data", report=comm.rank == 0)
        self.dropped_batches = mine - self.batches_per_epoch
        self.dropped_rows = self._reader.rows - self.batches_per_epoch * cfg.batch_size_per_rank

    def _stamp(self, mode: DataVerify, checked, stamp: dict, stamp_path: str, run_dir) -> None:
        """Rank 0 writes the stamp of every rank's files known good, when any was hashed."""
        # comm: allgather of each rank's verified files (names, sizes, mtimes) and counts
        everyone = self.comm.allgather_object(checked, name="data.verified")
        if self.comm.rank != 0:
            return
        hashed = sum(c[1] for c in everyone)
        files = sum(c[2] for c in everyone)
        slowest = max(c[3] for c in everyone)
        if mode is DataVerify.FULL:
            log.info(f"data: {files} train shard files checked against the manifest's checksums in {slowest:.1f} s "
                     f"(data.verify = full)")
            return
        if hashed == 0:
            log.info(f"data: {files} train shard files unchanged since the verification stamp {stamp_path}: "
                     f"not hashed again (data.verify = stamp)")
            return
        good = {name: ident for c in everyone for name, ident in c[0].items()}
        path, note = write_stamp(self.cfg.train_dir, good, run_dir)
        if note:
            log.warning(f"data: {note}")
        why = "no stamp yet" if not stamp_path else f"changed since the stamp {stamp_path}"
        log.info(f"data: {hashed} of {files} train shard files checked against the manifest's checksums "
                 f"({why}) in {slowest:.1f} s" + (f"; stamp written to {path}" if path else "")
                 + " (data.verify = stamp)")

    def resharded_position(self, origin: dict, batch: int, epoch: int) -> tuple[int, str]:
        """(the batch to continue the epoch at, a note on that epoch) for a run resumed from a
        checkpoint ``hvctr reshard`` wrote (``origin``: its manifest's ``resharded_from``).
        The position is the samples the epoch had trained (``epoch_rows``): W B rows a step
        before, W' B' now, so it holds at a fixed data.global_batch_size too, where the batch
        the reshard scaled by W / W' (the same B assumed) was off by that factor. Checkpoints
        from before ``epoch_rows`` keep that batch, and no note."""
        rows, per_rank = origin.get("epoch_rows"), origin.get("batch_size_per_rank")
        if type(rows) is not int or type(per_rank) is not int or not rows:
            return batch, ""
        step = self.cfg.batch_size_per_rank * self.comm.size
        batch = rows // step
        shard_rows = np.array([r["rows"] for r in self._reader.manifest["shards"]["train"]], dtype=np.int64)
        c = reshard_coverage(shard_rows, (origin["world_size"], per_rank, rows // (per_rank * origin["world_size"])),
                             (self.comm.size, self.cfg.batch_size_per_rank, batch))
        return batch, (f"resumed mid-epoch after hvctr reshard from {origin['world_size']} to {self.comm.size} ranks: "
                       f"epoch {epoch} had trained {c.before:,} of its {c.rows:,} rows; its rest, in this size's "
                       f"layout, trains {c.twice:,} of them again and leaves out {c.left_out:,} rows an epoch of "
                       f"{self.comm.size} rank(s) trains (it leaves out {c.dropped:,}, its remainders); from epoch "
                       f"{epoch + 1} on, every row once an epoch (hvctr.data.layout; a reshard at an epoch "
                       f"boundary is exact)")

    def reader_for_epoch(self, epoch: int) -> _WindowReader:
        return _WindowReader(self._reader)

    def eval_reader(self, split: str) -> EvalReader:
        data_dir = self.cfg.valid_dir or self.cfg.train_dir
        reader = ShardReader(data_dir, split, self.comm.rank, self.comm.size, self.cfg.batch_size_per_rank)
        theirs = reader.manifest.get("multi_valued") if reader.multi_valued else None
        if (theirs or {}).get("fields") != (self.multi_valued or {}).get("fields"):
            reader.close()
            raise ValueError(f"data.valid_dir {data_dir}: multi-valued fields {(theirs or {}).get('fields', [])}, "
                             f"data.train_dir {self.cfg.train_dir}: {(self.multi_valued or {}).get('fields', [])} "
                             f"(0-based): prepare both with the same data_prep --multi-valued")
        return EvalReader(reader)
