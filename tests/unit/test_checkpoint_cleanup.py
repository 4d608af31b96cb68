"""A checkpoint that fails cleans up after itself; rejected/ does not grow without bound.

- A manifest that cannot be written (a full disk): the error says nothing of the checkpoint was
  kept, and it is true: its directory (every rank's file) is gone, the previous checkpoint is
  the newest complete one and still loads.
- rejected/ keeps the checkpoint.keep checkpoints set aside last.
"""

from __future__ import annotations

import errno
import time

import numpy as np
import pytest
import torch

from hvctr.config import StorageConfig
from hvctr.distributed.world import AgreedError, agree_on
from hvctr.storage import EmbeddingStore
from hvctr.checkpoint import manager as ckpt
from hvctr.checkpoint.format import TrainState
from hvctr.checkpoint.manager import CheckpointManager


class OneRank:
    """The comm of a job of one rank."""

    rank, size = 0, 1

    def allgather_object(self, obj, name):
        return [obj]

    def broadcast_object(self, obj, root, name):
        return obj

    def allreduce_min_int(self, values, name):
        return list(values)

    def agree(self, fn, name):
        return agree_on(self, fn, name)

    def barrier(self):
        pass


@pytest.fixture
def store(tmp_path):
    s = EmbeddingStore(StorageConfig(dim=4, rows_per_rank=10_000, cpu_cache_bytes=0), tmp_path / "shard.h5", create=True)
    keys = np.arange(1, 501, dtype=np.uint64)
    s.write(keys, s.read(keys) + 1.0)
    yield s
    s.close()


DENSE = {"param.000": torch.ones(3), "adam_step": torch.tensor([1.0])}


def test_a_manifest_that_cannot_be_written_leaves_nothing_of_its_checkpoint(tmp_path, store, monkeypatch):
    manager = CheckpointManager(tmp_path / "ck", OneRank(), keep=3, compact_every=4)
    manager.save(store, DENSE, TrainState(step=1), {})
    real = ckpt.write_manifest

    def full_disk(path, manifest):
        if manifest["seq"] == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, manifest)

    monkeypatch.setattr(ckpt, "write_manifest", full_disk)
    with pytest.raises(AgreedError, match=r"checkpoint 1: cannot write .*/ck/ckpt-000001/manifest.json: No space "
                                          r"left on device; nothing of it was kept, the newest complete checkpoint "
                                          r"is checkpoint 0"):
        manager.save(store, DENSE, TrainState(step=2), {})
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["ckpt-000000"]
    assert manager.find_latest()["seq"] == 0


def test_rejected_keeps_the_newest_checkpoint_keep(tmp_path, store):
    manager = CheckpointManager(tmp_path / "ck", OneRank(), keep=2, compact_every=4)
    manager.save(store, DENSE, TrainState(step=1), {})
    base = manager.find_latest()
    for attempt in range(4):  # each crash leaves an incomplete checkpoint, set aside by the next resume
        partial = tmp_path / "ck" / f"ckpt-{2 + attempt:06d}"
        partial.mkdir()
        (partial / "rank-00000.h5").write_bytes(b"partial")
        time.sleep(0.01)
        manager.set_aside_newer(base)
    left = sorted(p.name for p in (tmp_path / "ck" / "rejected").iterdir())
    assert left == ["ckpt-000004", "ckpt-000005"]  # the two set aside last
