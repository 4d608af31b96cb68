"""Agreeing on one rank's error (Comm.agree, and before Horovod, hvctr.distributed.world); run under
mpirun -np 2 and -np 3. Every rank must come out of each test: a rank left waiting would hang
the run, which is the failure these functions exist to prevent."""

import pytest

from hvctr.distributed.world import AgreedError, agree_on_errors, check_collectively


def _fail_on(ranks, rank, message="bad input"):
    def fn():
        if rank in ranks:
            raise ValueError(f"{message} on rank {rank}")
        return rank * 10
    return fn


def test_no_error_returns_each_ranks_result(comm):
    assert comm.agree(_fail_on((), comm.rank), name="agree.none") == comm.rank * 10


def test_one_ranks_error_reaches_every_rank_reported_by_rank_0(comm):
    last = comm.size - 1
    with pytest.raises(AgreedError) as e:
        comm.agree(_fail_on((last,), comm.rank), name="agree.one")
    assert str(e.value) == f"rank {last}: bad input on rank {last}"
    assert e.value.report == (comm.rank == 0)
    comm.barrier()  # everyone is still here, and in step


def test_same_error_everywhere_is_one_message(comm):
    def everywhere():
        raise ValueError("same everywhere")

    with pytest.raises(AgreedError, match="^same everywhere$"):
        comm.agree(everywhere, name="agree.all")


def test_before_horovod_the_same_through_mpi(comm):
    assert agree_on_errors(None if comm.rank else "only rank 0") == [("only rank 0", [0])]

    def fails_on_0_and_1():
        if comm.rank in (0, 1):
            raise ValueError("bad input")
        return comm.rank

    with pytest.raises(AgreedError) as e:
        check_collectively(fails_on_0_and_1, comm.size)
    assert str(e.value) == ("bad input" if comm.size == 2 else "rank 0,1: bad input")
    assert check_collectively(lambda: comm.rank, comm.size) == comm.rank
