"""merge.shared_rows (hvctr.storage.shared_rows, hvctr.train.row_sync) on simulated ranks
(ThreadComm): the owners choose the rows the most ranks asked for, take sync's Adam step on each at
every step, serve every holder the row's current value whenever its step reads it, and keep their
own copy at the push; the other rows merge as before; only touched rows travel."""

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
    """A step's touched working-set positions (sorted, distinct) and their gradients; step 2
    touches nothing on any rank (every alltoall of that step is empty)."""
    if step == 2:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, DIM + 1)
    g = torch.Generator().manual_seed(97 * rank + step)
    idx = torch.sort(torch.randperm(n, generator=g)[: n // 2]).values
    return idx, torch.randn(idx.numel(), DIM + 1, generator=g)


def _train(tmp_path, limit, bf16=False):
    def rank_fn(comm):
        store = EmbeddingStore(StorageConfig(dim=DIM, rows_per_rank=1000), tmp_path / f"s{comm.rank}.h5",
                               rank=comm.rank, world_size=W)
        table = ShardedTable(comm, store, default_bucket_owner(W), "cpu", shared_rows=limit)
        x = table.exchange(_keys(comm.rank))
        rows = table.pull(x, name="w0.pull")
        pulled = rows.clone()
        assert (x.shared is None) == (limit == 0)  # no pull chooses rows where none may be shared
        touched = [_grads(comm.rank, step, rows.shape[0])[0] for step in range(STEPS)]
        sync = SharedRowSync(comm, x.shared, rows, store.layout, touched, name="w0.shared", bf16=bf16) if limit else None
        keys = x.routing.keys
        held = set(x.shared.positions.tolist()) if limit else set()
        read = {}  # (key, step): the model columns a shared row had when this rank's step read it
        for step in range(STEPS):
            idx, g = _grads(comm.rank, step, rows.shape[0])
            for p in idx.tolist():
                if p in held:
                    read[int(keys[p]), step] = rows[p, RowLayout(DIM).model].clone()
            if sync is not None:
                idx, g = sync.split_step(rows, step, idx, g, LR, B1, B2, EPS, name=f"w0.shared{step}")
            sparse_adam_step(rows, idx, g, LR, B1, B2, EPS)
        table.push(x, rows, name="w0.push", steps=STEPS)
        wire = None
        if sync is not None:  # per step, the touched shared rows another rank owns
            lo, hi = x.shared.owner_first[comm.rank], x.shared.owner_first[comm.rank + 1]
            away = [int(((n < lo) | (n >= hi)).sum()) for n in sync.numbers]
            wire = (sync.bytes_sent, sync.bytes_received, away)
        every = np.unique(np.concatenate([_keys(r) for r in range(W)]))
        final = table.read_only(every, "final")  # a collective: every rank reads every key once
        stored = {int(k): final[i].clone() for i, k in enumerate(every)}
        return keys, pulled, read, stored, x.shared.total if limit else 0, wire

    results, errors, _ = run_ranks(W, rank_fn)
    assert not any(errors), errors
    return results


def _reference(results, key, upto=STEPS):
    """Sync's steps on one row (the first ``upto``): the gradients of the ranks that touched it
    summed (sync's mean times W: the same Adam step up to eps, hvctr.train.row_sync), one Adam
    step wherever any rank touched it."""
    row = None
    for keys, pulled, *_ in results:
        at = np.flatnonzero(keys == key)
        if at.size:
            row = pulled[at[0]].clone()[None]
            break
    for step in range(upto):
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


def test_shared_rows_take_syncs_steps_and_every_holder_reads_the_owners_value(tmp_path):
    results = _train(tmp_path, limit=9)  # quota 3 an owner: keys asked for by 3 ranks first, then by 2
    total = results[0][4]
    assert all(r[4] == total for r in results) and 0 < total <= 9
    shared = {key for r in results for key, _ in r[2]}
    assert shared and all(k < 200 for k in shared)  # never a key one rank asked for
    m = RowLayout(DIM).model
    for key in shared:
        assert sum(any(k == key for k, _ in r[2]) for r in results) >= 2  # read by two ranks at least
        stored = results[0][3][key]
        torch.testing.assert_close(stored, _reference(results, key), rtol=1e-5, atol=1e-6)  # the owner's
        assert float(stored[RowLayout(DIM).step]) >= 1  # they took steps
    reads = [(key, step, value) for r in results for (key, step), value in r[2].items()]
    assert any(step > 0 for _, step, _ in reads)
    for key, step, value in reads:  # every read, on every holder, saw sync's row after the steps before it
        torch.testing.assert_close(value, _reference(results, key, upto=step)[m], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bf16", [False, True])
def test_only_the_shared_rows_a_step_touches_travel(tmp_path, bf16):
    results = _train(tmp_path, limit=9, bf16=bf16)
    total = results[0][4]
    sent = sum(r[5][0] for r in results)
    assert sent == sum(r[5][1] for r in results)  # every byte sent is received
    row = (DIM + 1) * (2 if bf16 else 4)  # a gradient out, a value back: the model columns (bfloat16: 2 bytes)
    # each rank's touched rows that another rank owns: their gradients at every step, their values
    # before every step but the first; the schedule: per other owner a count a step, an int64 a row
    expected = sum(row * (sum(away) + sum(away[1:])) + 8 * (sum(away) + STEPS * (W - 1))
                   for *_, (_, _, away) in results)
    assert sent == expected
    assert sent < W * STEPS * total * (DIM + 2) * 4  # less than an allreduce of every shared row a step


def test_a_bfloat16_wire_reads_and_steps_within_its_rounding(tmp_path):
    exact = _train(tmp_path / "a", limit=9)
    rounded = _train(tmp_path / "b", limit=9, bf16=True)
    m = RowLayout(DIM).model
    shared = {key for r in exact for key, _ in r[2]}
    assert shared == {key for r in rounded for key, _ in r[2]}
    for key in shared:  # the owner steps in float32 on gradients rounded to 8 bits of mantissa
        torch.testing.assert_close(rounded[0][3][key][m], exact[0][3][key][m], rtol=2e-2, atol=2e-3)
    differ = 0
    for r_exact, r_rounded in zip(exact, rounded):
        for (key, step), value in r_rounded[2].items():
            if step:  # a value served: the owner's, rounded to bfloat16
                torch.testing.assert_close(value, value.to(torch.bfloat16).to(torch.float32), rtol=0, atol=0)
                differ += not torch.equal(value, r_exact[2][key, step])
    assert differ  # it did round


def test_the_rows_not_shared_merge_as_without_shared_rows(tmp_path):
    base = _train(tmp_path / "a", limit=0)
    assert base[0][4] == 0 and not base[0][2]
    with_shared = _train(tmp_path / "b", limit=9)
    shared = {key for r in with_shared for key, _ in r[2]}
    rest = [k for k in base[0][3] if k not in shared]
    assert any(100 <= k < 110 for k in rest) and any(k >= 1000 for k in rest)
    for key in rest:  # the same local steps, the same average at the push
        assert torch.equal(base[0][3][key], with_shared[0][3][key]), key
    for key in shared:
        assert not torch.equal(base[0][3][key], with_shared[0][3][key]), key


def test_config_refuses_shared_rows_outside_kstep():
    with pytest.raises(ValueError, match="merge.shared_rows"):
        load_config(None, ["--merge.shared_rows=-2"])
    with pytest.raises(ValueError, match="merge.shared_rows"):
        load_config(None, ["--merge.mode=sync", "--merge.shared_rows=8"])


def test_auto_shares_rows_from_the_ranks_where_the_merge_lost_them():
    from hvctr.config.resolve import AUTO_SHARED_RANKS, AUTO_SHARED_RANKS_LONG, AUTO_SHARED_ROWS, resolve_merge

    cfg = load_config(None, ["--merge.every_k_steps=8"])
    assert cfg.merge.shared_rows == -1  # the default: auto
    assert (AUTO_SHARED_RANKS, AUTO_SHARED_RANKS_LONG, AUTO_SHARED_ROWS) == (32, 16, 32768)
    assert resolve_merge(cfg.merge, 32).shared_rows == AUTO_SHARED_ROWS
    assert resolve_merge(cfg.merge, 31).shared_rows == 0  # k = 8 held without them at 16 ranks
    long = load_config(None, ["--merge.every_k_steps=32"])
    assert resolve_merge(long.merge, 16).shared_rows == AUTO_SHARED_ROWS  # k = 32 did not
    assert resolve_merge(long.merge, 15).shared_rows == 0
    assert resolve_merge(cfg.merge, 2).shared_rows == 0  # the 2-rank path is unchanged
    sync = load_config(None, ["--merge.mode=sync"])  # auto in sync mode: none, and no error
    assert resolve_merge(sync.merge, 64).shared_rows == 0
    explicit = load_config(None, ["--merge.shared_rows=100"])
    assert resolve_merge(explicit.merge, 2).shared_rows == 100 and resolve_merge(explicit.merge, 64).shared_rows == 100
    assert resolve_merge(load_config(None, ["--merge.shared_rows=0"]).merge, 64).shared_rows == 0


def test_the_planner_counts_the_shared_rows_a_step_touches():
    from hvctr.config import MergeMode
    from hvctr.plan.model import Job, shared_row_step_bytes

    job = Job(nodes=1, ranks_per_node=3, keys=10**6, dim=8, batch_size_per_rank=256, every_k_steps=4, shared_rows=64)
    # at most the step's distinct rows, at most N; 2 / 3 of them another rank's: D + 1 floats out
    # (the gradient), as many in as an owner's values served, and an int64 of schedule
    assert shared_row_step_bytes(job, 300) == int(64 * 2 / 3 * (2 * 4 * 9 + 8))
    assert shared_row_step_bytes(job, 30) == int(30 * 2 / 3 * (2 * 4 * 9 + 8))
    assert shared_row_step_bytes(Job(**{**job.__dict__, "shared_rows_bf16": True}), 300) == int(64 * 2 / 3 * (2 * 2 * 9 + 8))
    assert shared_row_step_bytes(Job(**{**job.__dict__, "shared_rows": 0}), 300) == 0
    assert shared_row_step_bytes(Job(**{**job.__dict__, "mode": MergeMode.SYNC}), 300) == 0
