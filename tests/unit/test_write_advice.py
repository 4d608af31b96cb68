"""What a failed write advises depends on why it failed (issue 28, item 10): a checkpoint that
could not be written on a read-only file system said "free space in ...". ``hvctr.formats.space
.remedy`` turns the error into the advice (a full disk: free space; read-only: make it writable;
permissions), shared by every writer's message (checkpoints, the metrics file, working shards,
data_prep, export, reshard, sweep).

Here the checkpoint directory is a real tmpfs remounted read-only after checkpoint 0, and one
simulated rank (hvctr.sim's ThreadComm) with a real store writes checkpoint 1.
"""

from __future__ import annotations

import errno
import subprocess

import numpy as np
import pytest
import torch

from hvctr.checkpoint.format import TrainState
from hvctr.checkpoint.manager import CheckpointManager
from hvctr.config import StorageConfig
from hvctr.distributed.world import AgreedError
from hvctr.formats.space import remedy
from hvctr.storage import EmbeddingStore
from tests.unit.test_sim_comm import run_ranks

DENSE = {"param.000": torch.ones(3), "adam_step": torch.tensor([1.0])}


def test_a_checkpoint_on_a_file_system_gone_read_only_says_so_not_free_space(tmp_path, tmpfs):
    disk = tmpfs(64 << 20)

    def rank(comm):
        keys = np.arange(1, 401, dtype=np.uint64)
        store = EmbeddingStore(StorageConfig(dim=4, rows_per_rank=10_000, cpu_cache_bytes=0),
                               tmp_path / "shard.h5", create=True)
        try:
            store.write(keys, store.read(keys) + 1.0)
            manager = CheckpointManager(disk / "checkpoints", comm, keep=2, compact_every=4)
            manager.save(store, DENSE, TrainState(step=1), {})
            r = subprocess.run(["mount", "-o", "remount,ro", str(disk)], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
            store.write(keys, store.read(keys) + 1.0)
            with pytest.raises(AgreedError) as e:  # every rank agrees on it (here the one)
                manager.save(store, DENSE, TrainState(step=2), {})
            return str(e.value)
        finally:
            store.close()

    results, errors, _ = run_ranks(1, rank, timeout=60)
    assert errors == [None], errors
    msg = results[0]
    assert msg.startswith(f"checkpoint 1: cannot write {disk / 'checkpoints'}/ckpt-000001") and "Read-only file system" in msg
    assert (f"{disk / 'checkpoints'} is on a read-only file system (remounted read-only after a disk error?): make it "
            f"writable (or set checkpoint.dir elsewhere), then run again with --resume") in msg
    assert "free space" not in msg


def test_the_advice_follows_the_error():
    def err(code):
        return OSError(code, "x")
    assert remedy(err(errno.ENOSPC), "/d") == remedy(err(errno.EDQUOT), "/d") == "free space in /d"
    assert remedy(err(errno.EROFS), "/d").startswith("/d is on a read-only file system")
    assert remedy(err(errno.EACCES), "/d") == "this user may not write in /d: give it write permission"
    assert remedy(err(errno.EIO), "/d") == "check the disk under /d (EIO)"
