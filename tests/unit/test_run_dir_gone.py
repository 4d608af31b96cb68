"""The run directory deleted, moved or replaced while the job runs (issue 28, item 4).

Rank 0 holds ``<run_dir>/hvctr.lock`` (hvctr.rundir.RunLock). At every checkpoint, before any
rank writes a byte of it, rank 0 checks that the lock file it holds is still at its path in the
run directory it was taken in; if not, every rank stops with one agreed error naming the
directory, and nothing is written (the deleted directory is not recreated by the checkpoint's
``mkdir``). Here with two simulated ranks (hvctr.sim's ThreadComm) and real stores and files.
"""

from __future__ import annotations

import shutil
import threading

import numpy as np
import pytest
import torch

from hvctr.checkpoint.format import TrainState
from hvctr.checkpoint.manager import CheckpointManager
from hvctr.config import StorageConfig
from hvctr.distributed.world import AgreedError
from hvctr.rundir import RunLock
from hvctr.storage import EmbeddingStore
from tests.unit.test_sim_comm import run_ranks

DENSE = {"param.000": torch.ones(3), "adam_step": torch.tensor([1.0])}


def _delete(run_dir):
    shutil.rmtree(run_dir)


def _replace(run_dir):
    shutil.rmtree(run_dir)
    run_dir.mkdir()  # a new directory at the same path: the job's files went with the old one


def _move(run_dir):
    run_dir.rename(run_dir.with_name("R-moved"))


def _lock_removed(run_dir):
    (run_dir / "hvctr.lock").unlink()


@pytest.mark.parametrize("fault", [_delete, _replace, _move, _lock_removed], ids=lambda f: f.__name__[1:])
def test_a_run_directory_gone_mid_run_stops_every_rank_at_the_next_checkpoint(tmp_path, fault):
    run_dir = tmp_path / "R"
    lock = RunLock(run_dir).acquire()
    went = threading.Event()

    def rank(comm):
        keys = np.arange(1 + comm.rank, 401, 2, dtype=np.uint64)
        store = EmbeddingStore(StorageConfig(dim=4, rows_per_rank=10_000, cpu_cache_bytes=0),
                               tmp_path / f"shard-{comm.rank}.h5", create=True)
        try:
            store.write(keys, store.read(keys) + 1.0)
            manager = CheckpointManager(run_dir / "checkpoints", comm, keep=2, compact_every=4,
                                        guard=lock.check_in_place if comm.rank == 0 else None)
            manager.save(store, DENSE, TrainState(step=1), {})  # checkpoint 0: the directory is there
            if comm.rank == 0:
                fault(run_dir)
                went.set()
            comm.barrier()
            store.write(keys, store.read(keys) + 1.0)
            try:
                manager.save(store, DENSE, TrainState(step=2), {})  # checkpoint 1: must stop
            except AgreedError as e:  # caught here: a rank's thread that raises ends the others' (ThreadWorld)
                return e
            return None
        finally:
            store.close()

    try:
        errors, failed, _ = run_ranks(2, rank, timeout=60)
    finally:
        lock.release()
    assert went.is_set()
    assert failed == [None, None], failed
    assert all(isinstance(e, AgreedError) for e in errors), errors
    msg = str(errors[0])
    assert str(run_dir) in msg and "hvctr.lock" in msg and "checkpoint 1" in msg, msg
    assert "deleted, moved or replaced" in msg, msg
    assert "\n" not in msg  # one error, agreed: not "rank 0: ..." and not one per rank
    assert str(errors[1]) == msg
    assert [e.report for e in errors] == [True, False]  # rank 0 alone prints it
    # nothing of checkpoint 1 was written anywhere: the deleted directory was not recreated
    if fault in (_delete, _move):
        assert not run_dir.exists()
    elif fault is _replace:
        assert list(run_dir.iterdir()) == []
    else:
        assert not (run_dir / "checkpoints" / "ckpt-000001").exists()


def test_the_check_passes_while_the_run_directory_is_in_place(tmp_path):
    run_dir = tmp_path / "R"
    lock = RunLock(run_dir).acquire()
    try:
        lock.check_in_place()
        (run_dir / "other").mkdir()  # the job's own files come and go: fine
        lock.check_in_place()
    finally:
        lock.release()
    lock.check_in_place()  # a released lock checks nothing
