"""The planner's sparse bytes per window against ShardedTable's counters (mpirun -np 2 and 3).

When every rank's window holds the same U keys, rank r sends U - own_r keys and answers
(W - 1) own_r rows, so over all ranks the pull sends U (W - 1) (8 + row) bytes exactly: W times
the plan's per-rank figure U (W - 1) / W (8 + row). Likewise warm, push and the sync push.
"""

import shutil
import tempfile

import numpy as np
import pytest
import torch

from hvctr.config import MergeMode, StorageConfig
from hvctr.formats import default_bucket_owner
from hvctr.plan.model import sparse_bytes_per_window
from hvctr.storage import EmbeddingStore, ShardedTable, shard_path

DIM = 4


@pytest.fixture
def table(comm):
    d = tempfile.mkdtemp(prefix=f"hvctr-plan-r{comm.rank}-")
    owner = default_bucket_owner(comm.size)
    store = EmbeddingStore(StorageConfig(dim=DIM, rows_per_rank=5000), shard_path(d, comm.rank), comm.rank,
                           comm.size, owner, create=True)
    yield ShardedTable(comm, store, owner, "cpu")
    store.close()
    comm.barrier()
    shutil.rmtree(d, ignore_errors=True)


def _sent_over_ranks(comm, table, op):
    mine = torch.tensor([float(table.stats().get(f"{op}_bytes_sent", 0.0))], dtype=torch.float64)
    # comm: allreduce (Sum) of one counter, to compare the ranks' total with the plan
    return float(comm.allreduce_sum([mine], name=f"test.plan.{op}")[0][0])


def test_window_bytes_are_the_plans(comm, table):
    keys = np.unique(np.random.default_rng(3).integers(1, 2**63, size=700, dtype=np.uint64))
    u, w = keys.shape[0], comm.size
    window = table.warm(keys, name="w.warm")  # as training does: the window's exchange, kept from its warm
    rows = table.pull(window, name="w.pull")
    table.push(window, rows, name="w.push")
    table.push_gradients(keys, torch.zeros(u, DIM + 1), lambda r, g: r, name="w.grads")
    kstep = sparse_bytes_per_window(u, w, DIM, MergeMode.KSTEP, prefetch=True)
    sync = sparse_bytes_per_window(u, w, DIM, MergeMode.SYNC, prefetch=True)
    assert _sent_over_ranks(comm, table, "warm") == pytest.approx(w * kstep["warm"])
    assert _sent_over_ranks(comm, table, "pull") == pytest.approx(w * kstep["pull"])
    assert _sent_over_ranks(comm, table, "push") == pytest.approx(w * kstep["push"])
    assert _sent_over_ranks(comm, table, "push_gradients") == pytest.approx(w * sync["push"])
