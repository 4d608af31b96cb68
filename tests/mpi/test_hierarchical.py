"""The hierarchical dense merge against the flat allreduce: 4 ranks in 2 virtual nodes.

Runs only with 4 ranks (`make test-mpi` has a line for it); at -np 2 and -np 3 it is skipped.
It starts its own Comm (virtual nodes), so it runs alone in its process: not with the session
``comm`` fixture of the other tests in this directory.
"""

import os

import pytest
import torch

from hvctr.distributed import init_comm

WORLD = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("SLURM_NTASKS", "0")))
pytestmark = pytest.mark.skipif(WORLD != 4, reason="needs exactly 4 ranks (mpirun -np 4)")


@pytest.fixture(scope="module")
def vcomm():
    c = init_comm(ranks_per_virtual_node=2)
    yield c
    c.barrier()


def test_virtual_nodes(vcomm):
    assert vcomm.node_ranks == [[0, 1], [2, 3]] and vcomm.num_nodes == 2
    assert (vcomm.node, vcomm.local_rank, vcomm.local_size) == (vcomm.rank // 2, vcomm.rank % 2, 2)
    assert (vcomm._leader_set is not None) == (vcomm.local_rank == 0)  # only leaders cross nodes


def test_hierarchical_equals_flat(vcomm):
    g = torch.Generator().manual_seed(100 + vcomm.rank)
    dense = torch.randn(1000, generator=g, dtype=torch.float64)
    weights = torch.randn(7, 5, generator=g, dtype=torch.float32)
    counts = torch.arange(12, dtype=torch.int64) * (vcomm.rank + 1)
    hier = vcomm.allreduce_sum_hierarchical([dense, weights, counts], name="t.hier")
    flat = vcomm.allreduce_sum([dense, weights, counts], name="t.flat")
    # Float sums in another order round differently: close, not bit-equal. Integers are exact.
    assert torch.allclose(hier[0], flat[0], rtol=0, atol=1e-12)
    assert torch.allclose(hier[1], flat[1], rtol=0, atol=1e-5)
    assert torch.equal(hier[2], torch.arange(12, dtype=torch.int64) * 10)  # 1 + 2 + 3 + 4
    assert [t.shape for t in hier] == [dense.shape, weights.shape, counts.shape]
    assert [t.dtype for t in hier] == [torch.float64, torch.float32, torch.int64]


def test_every_rank_gets_the_same_bits(vcomm):
    x = torch.full((64,), 0.1, dtype=torch.float32) * (vcomm.rank + 1) ** 0.5
    (h,) = vcomm.allreduce_sum_hierarchical([x], name="t.bits")
    gathered = vcomm.allgather(h.view(1, -1), name="t.bits.gather")
    assert all(torch.equal(gathered[0], row) for row in gathered)  # the k-step merge must not drift apart


def test_closed_form(vcomm):
    x = torch.full((3,), float(vcomm.rank))
    (h,) = vcomm.allreduce_sum_hierarchical([x], name="t.closed")
    assert torch.equal(h, torch.full((3,), 6.0))  # 0 + 1 + 2 + 3
    assert vcomm.allreduce_sum_hierarchical([], name="t.empty") == []
