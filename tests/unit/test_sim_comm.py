"""ThreadComm (hvctr.sim.comm): Comm's collectives for simulated ranks in threads of one process.

Results in rank order whatever the thread timing, OpenMPI's ring summation order (and plain
ascending rank order on request), one rank running at a time, and a failure on one simulated
rank ending every rank (never a hang), named with its rank.
"""

from __future__ import annotations

import logging
import random
import threading
import time

import pytest
import torch

from hvctr.config import load_config
from hvctr.distributed.world import AgreedError
from hvctr.sim.cmd import node_grouping, simulated_config
from hvctr.sim.comm import SimulationAborted, ThreadComm, ThreadWorld


def run_ranks(size, fn, timeout=30, **world_kwargs):
    """fn(comm) in one thread per simulated rank; returns (results by rank, exceptions by rank, world)."""
    world = ThreadWorld(size, **world_kwargs)
    results, errors = [None] * size, [None] * size

    def main(rank):
        exc = None
        try:
            world.enter(rank)
            results[rank] = fn(ThreadComm(world, rank))
        except BaseException as e:
            exc = errors[rank] = e
        finally:
            world.finish(rank, exc)

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a simulated rank hangs"
    return results, errors, world


def test_gathers_and_exchanges_come_in_rank_order():
    def fn(comm):
        time.sleep(random.random() * 0.01)
        r = comm.rank
        gathered = comm.allgather(torch.full((r + 1, 2), float(r)), name="g")
        objs = comm.allgather_object({"rank": r, "b": [r] * r}, name="o")
        root = comm.broadcast_object({"from": r} if r == 1 else None, root=1, name="bo")
        bt = comm.broadcast(torch.tensor([r * 10]), root=2, name="bt")
        # rank r sends j+1 rows to rank j, each row [source, dest]
        splits = [j + 1 for j in range(comm.size)]
        msg = torch.tensor([[r, j] for j in range(comm.size) for _ in range(j + 1)], dtype=torch.int64)
        got, received = comm.alltoall(msg, splits, name="a2a")
        mn, mx = comm.allreduce_min_int([r, -r], name="min"), comm.allreduce_max_int([r, -r], name="max")
        comm.barrier()
        return gathered, objs, root, bt, got, received, mn, mx

    results, errors, _ = run_ranks(3, fn)
    assert errors == [None] * 3
    for r, (gathered, objs, root, bt, got, received, mn, mx) in enumerate(results):
        assert gathered[:, 0].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 2.0]
        assert objs == [{"b": [], "rank": 0}, {"b": [1], "rank": 1}, {"b": [2, 2], "rank": 2}]
        assert root == {"from": 1} and bt.tolist() == [20]
        assert received.tolist() == [r + 1] * 3 and received.dtype == torch.int64
        assert got[:, 0].tolist() == [s for s in range(3) for _ in range(r + 1)]  # by source rank
        assert (got[:, 1] == r).all()
        assert mn == [0, -2] and mx == [2, 0]
    # every rank gets its own copy
    results[0][0].add_(1)
    assert results[1][0][0, 0] == 0.0


def test_allreduce_sums_in_openmpi_ring_order_and_in_rank_order_on_request():
    """With W = 3 and a 3-element buffer, block j is summed from rank j upwards (OpenMPI's ring):
    element 0 is (x0 + x1) + x2, element 1 (x1 + x2) + x0, element 2 (x2 + x0) + x1. With
    x0 = 1e8, x1 = 1, x2 = -1e8 in float32 only the last order keeps the 1."""
    values = [1e8, 1.0, -1e8]

    def fn(comm):
        time.sleep(random.random() * 0.01)
        (s,) = comm.allreduce_sum([torch.full((3,), values[comm.rank], dtype=torch.float32)], name="s")
        return s

    ring, errors, _ = run_ranks(3, fn)
    assert errors == [None] * 3
    for s in ring:
        assert s.tolist() == [0.0, 0.0, 1.0]
    ranked, _, _ = run_ranks(3, fn, reduce_order="rank")
    for s in ranked:
        assert s.tolist() == [0.0, 0.0, 0.0]  # ((x0 + x1) + x2) everywhere


def test_grouped_allreduce_fuses_per_dtype_in_list_order():
    """A group's tensors of one dtype form one buffer (Horovod's fusion), cut into W blocks over
    the whole buffer: the same sums as a hand-made ring over the concatenation."""
    gen = torch.Generator().manual_seed(0)
    data = [[torch.randn(5, 3, generator=gen), torch.randn(4, generator=gen, dtype=torch.float64),
             torch.randn(7, generator=gen)] for _ in range(3)]

    def fn(comm):
        return comm.allreduce_sum(data[comm.rank], name="grp")

    results, errors, world = run_ranks(3, fn)
    assert errors == [None] * 3
    flat = [torch.cat([d[0].reshape(-1), d[2]]) for d in data]  # the float32 buffer: 22 elements
    want = world.reduce_flat(flat)
    # by hand: blocks of 8, 7, 7 elements, block j summed from rank j
    bounds = [0, 8, 15, 22]
    for j in range(3):
        lo, hi = bounds[j], bounds[j + 1]
        acc = flat[j][lo:hi].clone()
        for m in (1, 2):
            acc += flat[(j + m) % 3][lo:hi]
        assert torch.equal(want[lo:hi], acc)
    for got in results:
        assert torch.equal(torch.cat([got[0].reshape(-1), got[2]]), want)
        assert got[1].dtype == torch.float64 and torch.allclose(got[1], sum(d[1] for d in data))


def test_results_do_not_depend_on_thread_timing():
    def fn(comm):
        g = torch.Generator().manual_seed(comm.rank)
        out = []
        for i in range(5):
            time.sleep(random.random() * 0.005)
            out.append(comm.allreduce_sum([torch.randn(101, generator=g)], name=f"s{i}")[0])
        return torch.stack(out)

    first, _, _ = run_ranks(5, fn)
    second, _, _ = run_ranks(5, fn)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert all(torch.equal(first[0], x) for x in first)


def test_hierarchical_allreduce_gives_the_sum_on_every_rank():
    def fn(comm):
        return comm.allreduce_sum_hierarchical([torch.arange(10, dtype=torch.float32) * (comm.rank + 1)], name="h")[0]

    results, errors, _ = run_ranks(4, fn, node_ranks=node_grouping(4, 2))
    assert errors == [None] * 4
    for s in results:
        assert s.tolist() == (torch.arange(10, dtype=torch.float32) * 10).tolist()


def test_one_rank_runs_at_a_time():
    running, peak = [0], [0]
    lock = threading.Lock()

    def busy():
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.002)
        with lock:
            running[0] -= 1

    def fn(comm):
        for i in range(10):
            busy()
            comm.allreduce_sum([torch.ones(4)], name=f"x{i}")
        busy()

    _, errors, _ = run_ranks(4, fn)
    assert errors == [None] * 4 and peak[0] == 1


def test_an_exception_on_one_rank_aborts_every_rank_naming_it():
    def fn(comm):
        comm.allreduce_sum([torch.ones(3)], name="first")
        if comm.rank == 1:
            raise RuntimeError("disk on fire")
        comm.allreduce_sum([torch.ones(3)], name="second")  # ranks 0 and 2 wait here for rank 1

    t0 = time.monotonic()
    _, errors, world = run_ranks(3, fn)
    assert time.monotonic() - t0 < 10
    rank, exc = world.error
    assert rank == 1 and str(exc) == "disk on fire"
    assert isinstance(errors[1], RuntimeError)
    for r in (0, 2):
        assert isinstance(errors[r], SimulationAborted) and "simulated rank 1 failed" in str(errors[r])


def test_ranks_that_would_wait_forever_fail_naming_the_collective():
    def ends_early(comm):
        if comm.rank == 0:
            return
        comm.barrier()

    _, errors, world = run_ranks(2, ends_early)
    assert "rank 1 in barrier" in str(world.error[1]) and "ranks [0] have ended" in str(world.error[1])

    def mismatch(comm):
        if comm.rank == 0:
            comm.allgather_object(0, name="a")
        else:
            comm.allreduce_min_int([1], name="b")

    _, errors, world = run_ranks(2, mismatch)
    assert "collective mismatch" in str(world.error[1]) and "'a'" in str(world.error[1])


def test_agree_raises_on_every_rank_when_one_fails():
    def fn(comm):
        def check():
            if comm.rank == 2:
                raise ValueError("bad shard")
            return comm.rank

        try:
            return comm.agree(check, name="check")
        except AgreedError as e:
            return str(e), e.report

    results, errors, _ = run_ranks(3, fn, timeout=10)
    assert errors == [None] * 3
    assert results == [("rank 2: bad shard", True), ("rank 2: bad shard", False), ("rank 2: bad shard", False)]


def test_simulated_config_turns_prefetch_off_and_caps_the_cache():
    cfg = simulated_config(load_config(None, ["--storage.cpu_cache_bytes=1e9", "--data.prefetch=true"]), 16_000_000)
    assert cfg.data.prefetch is False and cfg.storage.cpu_cache_bytes == 16_000_000 and cfg.topology.bind is False
    small = simulated_config(load_config(None, ["--storage.cpu_cache_bytes=1e6"]), 16_000_000)
    assert small.storage.cpu_cache_bytes == 1_000_000
    assert simulated_config(load_config(None, ["--storage.cpu_cache_bytes=1e9"]), 0).storage.cpu_cache_bytes == 10**9
    assert node_grouping(6, 0) == [list(range(6))] and node_grouping(6, 2) == [[0, 1], [2, 3], [4, 5]]


def test_simulate_reports_the_failing_rank_and_ends_every_rank(tmp_path, monkeypatch):
    """hvctr simulate's driver: a rank's exception ends the run with an error naming that rank."""
    import hvctr.train.trainer as trainer_mod
    from hvctr.sim.cmd import simulate

    class FakeTrainer:
        def __init__(self, cfg, comm, device, run_dir, **kw):
            self.comm, self.preempted = comm, False

        def train_and_evaluate(self):  # the trainer's job: a collective per step, rank 1 fails in the second
            for i in range(3):
                self.comm.allreduce_sum([torch.ones(2)], name=f"w{i}")
                if self.comm.rank == 1 and i == 1:
                    raise KeyError("lost row")
            return {}

    monkeypatch.setattr(trainer_mod, "Trainer", FakeTrainer)
    cfg = load_config(None, [f"--train.run_dir={tmp_path / 'run'}"])
    logger = logging.getLogger("hvctr")  # simulate() sets up its logging: put it back afterwards
    saved = (list(logger.handlers), logger.propagate, logger.level)
    try:
        with pytest.raises(RuntimeError, match=r"simulated rank 1 failed: KeyError: 'lost row'"):
            simulate(cfg, 4, threads=1)
    finally:
        for h in list(logger.handlers):
            logger.removeHandler(h)
            h.close()
        for h in saved[0]:
            logger.addHandler(h)
        logger.propagate, logger.level = saved[1], saved[2]
    assert (tmp_path / "run" / "logs" / "rank-00003.log").is_file()
