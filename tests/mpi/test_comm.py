"""Comm's collectives against closed forms; run under mpirun -np 2 and -np 3."""

import os

import pytest
import torch

from hvctr.log import get_logger, setup_logging


def launcher_rank_and_size() -> tuple[int, int]:
    """What the launcher told this process: mpirun sets OMPI_COMM_WORLD_*, srun SLURM_*."""
    env = os.environ
    if "OMPI_COMM_WORLD_RANK" in env:
        return int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"])
    return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])


def test_rank_and_size_come_from_horovod(comm):
    # tests/e2e/test_slurm.py runs this file under `srun --mpi=pmix`, where no OMPI_COMM_WORLD_* exists.
    assert (comm.rank, comm.size) == launcher_rank_and_size()
    assert 0 <= comm.local_rank < comm.local_size
    assert comm.num_nodes == 1 and comm.local_size == comm.size  # one machine


def test_sum_allreduce_is_tensor_times_size(comm):
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = torch.full((5,), 2.0, dtype=torch.float64)
    sa, sb = comm.allreduce_sum([a, b], name="t.sum")
    assert torch.equal(sa, a * comm.size)
    assert torch.equal(sb, b * comm.size)


def test_average_of_rank_values(comm):
    x = torch.full((4,), float(comm.rank))
    (avg,) = comm.allreduce_avg([x], name="t.avg")
    assert torch.allclose(avg, torch.full((4,), (comm.size - 1) / 2))


def test_min_max_int(comm):
    assert comm.allreduce_min_int([comm.rank + 5, 100 - comm.rank], name="t.min") == [5, 100 - (comm.size - 1)]
    assert comm.allreduce_max_int([comm.rank], name="t.max") == [comm.size - 1]


def test_alltoall_uneven_splits(comm):
    # rank r sends (r + d + 1) rows to rank d; each row holds (src, dst, i).
    rows, splits = [], []
    for d in range(comm.size):
        n = comm.rank + d + 1
        splits.append(n)
        rows += [[comm.rank, d, i] for i in range(n)]
    out, received = comm.alltoall(torch.tensor(rows, dtype=torch.int64), splits, name="t.a2a")
    expect = [[s, comm.rank, i] for s in range(comm.size) for i in range(s + comm.rank + 1)]
    assert received.tolist() == [s + comm.rank + 1 for s in range(comm.size)]
    assert out.tolist() == expect


def test_alltoall_with_empty_splits(comm):
    # Only rank 0 sends anything, and only to the last rank: most splits are 0.
    n = 3 if comm.rank == 0 else 0
    splits = [0] * comm.size
    splits[-1] = n
    data = torch.arange(n * 2, dtype=torch.float32).reshape(n, 2)
    out, received = comm.alltoall(data, splits, name="t.a2a0")
    if comm.rank == comm.size - 1:
        assert received.tolist() == [3] + [0] * (comm.size - 1) and out.shape == (3, 2)
    else:
        assert out.shape == (0, 2)


def test_broadcast_tensor_and_object(comm):
    t = torch.arange(4) * (comm.rank + 1)
    assert torch.equal(comm.broadcast(t, root=comm.size - 1, name="t.bc"), torch.arange(4) * comm.size)
    obj = {"window": 7, "keys": [1, 2, 3], "rank": comm.rank}
    got = comm.broadcast_object(obj, root=1, name="t.bco")
    assert got == {"window": 7, "keys": [1, 2, 3], "rank": 1}


def test_allgather_object(comm):
    got = comm.allgather_object({"r": comm.rank, "pad": "x" * comm.rank}, name="t.ago")
    assert got == [{"r": r, "pad": "x" * r} for r in range(comm.size)]


def test_rank_logging(comm, capsys):
    setup_logging(rank=comm.rank, world_size=comm.size)
    get_logger("test").info("hello")
    get_logger("test").warning("careful")
    out, err = capsys.readouterr()
    if comm.rank == 0:
        assert "[r0 " in out and "hello" in out
    else:
        assert "hello" not in out + err and f"[r{comm.rank} " in err and "careful" in err
    comm.barrier()


def test_alltoall_with_every_split_empty(comm):
    # a step of merge.shared_rows where no rank touched a shared row: every rank sends nothing
    out, received = comm.alltoall(torch.zeros((0, 17), dtype=torch.float32), [0] * comm.size, name="t.a2a.none")
    assert out.shape == (0, 17) and received.tolist() == [0] * comm.size


def test_a_stream_pairs_collectives_whatever_thread_issues_them(comm):
    """The push's rows left behind go out from the prefetch thread on one rank and from the
    main thread on another (storage.push_behind): in comm.stream("behind") they pair, and the
    main thread's collectives meanwhile pair with the other ranks' main-thread ones."""
    import threading

    def behind(out: list) -> None:
        with comm.stream("behind"):
            out.append(comm.allreduce_sum([torch.ones(3)], name="t.stream.behind")[0])

    got: list = []
    if comm.rank == 0:
        helper = threading.Thread(target=behind, args=(got,))
        helper.start()
        low = comm.allreduce_min_int([comm.rank + 5], name="t.stream.main")
        helper.join(timeout=60)
    else:
        behind(got)
        low = comm.allreduce_min_int([comm.rank + 5], name="t.stream.main")
    assert low == [5] and torch.equal(got[0], torch.full((3,), float(comm.size)))


def test_ranks_at_different_collectives_fail_naming_it(comm):
    """TorchComm checks each collective's name across its group (Horovod matches by name
    itself: a mismatch there waits until the stall watchdog ends the job)."""
    if type(comm).__name__ != "TorchComm":
        pytest.skip("Horovod's Comm: names are matched by Horovod, a mismatch stalls")
    if comm.size == 1:
        pytest.skip("one rank cannot disagree")
    with pytest.raises(RuntimeError, match=rf"collective 't.mismatch.{comm.rank}' on rank {comm.rank}: another rank "
                                           r"of its group is at a different collective"):
        comm.allreduce_min_int([1], name=f"t.mismatch.{comm.rank}")
    assert comm.allreduce_max_int([comm.rank], name="t.after") == [comm.size - 1]  # the ranks go on together
