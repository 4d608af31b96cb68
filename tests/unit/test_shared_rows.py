"""merge.shared_rows (hvctr.storage.shared_rows, hvctr.train.row_sync) on simulated ranks
(ThreadComm): the owners choose the rows the most ranks asked for, every holder of a shared row
takes sync's Adam step at every step and so holds the same bits at the push, the owner keeps them,
and the other rows merge as before."""

import numpy as np
import pytest
import torch

from hvctr.config import StorageConfig, load_config
from hvctr.formats import RowLayout, default_bucket_owner
from hvctr.optim import sparse_adam_step
from hvctr.storage import EmbeddingStore, ShardedTable
from hvctr.storage.shared_rows import choose_owned
from hvctr.train.row_sync import SharedRowSync
from tests.unit.test_sim_comm import run_ranks

W, DIM, STEPS = 3, 4, 5
LR, B1, B2, EPS = 0.05, 0.9, 0.999, 1e-8


def test_an_owner_shares_the_keys_the_most_ranks_asked_for():
    asked_by = np.array([1, 3, 2, 3, 1, 2, 2])
    assert choose_owned(asked_by, 6, 3).tolist() == [1, 3]  # quota ceil(6 / 3) = 2: the two asked by 3
    assert choose_owned(asked_by, 9, 3).tolist() == [1, 2, 3]  # quota 3: ties among the 2s by position
    assert choose_owned(asked_by, 100, 3).tolist() == [1, 2, 3, 5, 6]  # never a key one rank asked for
    assert choose_owned(np.ones(5, dtype=np.int64), 100, 3).size == 0
    assert choose_owned(asked_by, 0, 3).size == 0


def _keys(rank: int) -> np.ndarray:
    """Every rank: keys 1..8 (hot); keys 100..109 for ranks 0 and 1; keys of its own."""
    own = 1000 * (rank + 1) + np.arange(12, dtype=np.uint64)
    pair = np.arange(100, 110, dtype=np.uint64) if rank < 2 else np.zeros(0, dtype=np.uint64)
    return np.concatenate([np.arange(1, 9, dtype=np.uint64), pair, own])


def _grads(rank: int, step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's touched working-set positions (sorted, distinct) and their gradients."""
    g = torch.Generator().manual_seed(97 * rank + step)
    idx = torch.sort(torch.randperm(n, generator=g)[: n // 2]).values
    return idx, torch.randn(idx.numel(), DIM + 1, generator=g)


def _train(tmp_path, limit):
    def rank_fn(comm):
        store = EmbeddingStore(StorageConfig(dim=DIM, rows_per_rank=1000), tmp_path / f"s{comm.rank}.h5",
                               rank=comm.rank, world_size=W)
        table = ShardedTable(comm, store, default_bucket_owner(W), "cpu", shared_rows=limit)
        x = table.exchange(_keys(comm.rank))
        rows = table.pull(x, name="w0.pull")
        pulled = rows.clone()
        assert (x.shared is None) == (limit == 0)  # no pull chooses rows where none may be shared
        sync = SharedRowSync(comm, x.shared, rows.shape[0], rows.device) if limit else None
        for step in range(STEPS):
            idx, g = _grads(comm.rank, step, rows.shape[0])
            if sync is not None:
                idx, g = sync.split_step(rows, idx, g, LR, B1, B2, EPS, name=f"w0.shared{step}")
            sparse_adam_step(rows, idx, g, LR, B1, B2, EPS)
        keys = x.routing.keys
        held = x.shared.positions if limit else np.zeros(0, dtype=np.int64)
        ends = {int(keys[p]): rows[p].clone() for p in held}
        table.push(x, rows, name="w0.push", steps=STEPS)
        every = np.unique(np.concatenate([_keys(r) for r in range(W)]))
        final = table.read_only(every, "final")  # a collective: every rank reads every key once
        stored = {int(k): final[i].clone() for i, k in enumerate(every)}
        return keys, pulled, ends, stored, x.shared.total if limit else 0

    results, errors, _ = run_ranks(W, rank_fn)
    assert not any(errors), errors
    return results


def _reference(results, key):
    """Sync's steps on one row: the gradients of the ranks that touched it summed (sync's mean
    times W: the same Adam step up to eps, hvctr.train.row_sync), one Adam step wherever any rank
    touched it."""
    row = None
    for keys, pulled, *_ in results:
        at = np.flatnonzero(keys == key)
        if at.size:
            row = pulled[at[0]].clone()[None]
            break
    for step in range(STEPS):
        total, touched = torch.zeros(1, DIM + 1), False
        for rank, (keys, pulled, *_) in enumerate(results):
            at = np.flatnonzero(keys == key)
            if not at.size:
                continue
            idx, g = _grads(rank, step, pulled.shape[0])
            hit = torch.nonzero(idx == int(at[0])).reshape(-1)
            if hit.numel():
                total += g[hit[0]]
                touched = True
        if touched:
            sparse_adam_step(row, torch.zeros(1, dtype=torch.int64), total, LR, B1, B2, EPS)
    return row[0]


def test_shared_rows_take_syncs_steps_and_every_holder_keeps_the_same_bits(tmp_path):
    results = _train(tmp_path, limit=9)  # quota 3 an owner: keys asked for by 3 ranks first, then by 2
    total = results[0][4]
    assert all(r[4] == total for r in results) and 0 < total <= 9
    shared = set().union(*(r[2] for r in results))
    assert all(k < 200 for k in shared)  # never a key one rank asked for
    for key in shared:
        copies = [r[2][key] for r in results if key in r[2]]
        assert len(copies) >= 2
        for c in copies[1:]:
            assert torch.equal(c, copies[0])  # the same bits on every holder
        stored = results[0][3][key]
        assert torch.equal(stored, copies[0])  # the owner kept them (no average of equal floats)
        torch.testing.assert_close(stored, _reference(results, key), rtol=1e-5, atol=1e-6)
        assert float(stored[RowLayout(DIM).step]) >= 1  # they took steps


def test_the_rows_not_shared_merge_as_without_shared_rows(tmp_path):
    base = _train(tmp_path / "a", limit=0)
    assert base[0][4] == 0 and not base[0][2]
    with_shared = _train(tmp_path / "b", limit=9)
    shared = set().union(*(r[2] for r in with_shared))
    rest = [k for k in base[0][3] if k not in shared]
    assert any(100 <= k < 110 for k in rest) and any(k >= 1000 for k in rest)
    for key in rest:  # the same local steps, the same average at the push
        assert torch.equal(base[0][3][key], with_shared[0][3][key]), key
    for key in shared:
        assert not torch.equal(base[0][3][key], with_shared[0][3][key]), key


def test_config_refuses_shared_rows_outside_kstep():
    with pytest.raises(ValueError, match="merge.shared_rows"):
        load_config(None, ["--merge.shared_rows=-1"])
    with pytest.raises(ValueError, match="merge.shared_rows"):
        load_config(None, ["--merge.mode=sync", "--merge.shared_rows=8"])


def test_the_planner_counts_the_shared_rows_allreduce():
    from hvctr.config import MergeMode
    from hvctr.plan.model import Job, shared_row_step_bytes

    job = Job(nodes=1, ranks_per_node=3, keys=10**6, dim=8, batch_size_per_rank=256, every_k_steps=4, shared_rows=64)
    assert shared_row_step_bytes(job) == 66 * (8 + 2) * 4  # 22 rows an owner, D + 1 gradient columns and a count
    assert shared_row_step_bytes(Job(**{**job.__dict__, "shared_rows": 0})) == 0
    assert shared_row_step_bytes(Job(**{**job.__dict__, "mode": MergeMode.SYNC})) == 0
