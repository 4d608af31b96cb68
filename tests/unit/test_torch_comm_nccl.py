"""When the torch engine moves CUDA tensors over NCCL (hvctr.distributed.torch_comm.nccl_usable).

NCCL where it is there and each rank of a host has a GPU of its own (NCCL refuses two ranks on
one GPU); never with HVCTR_NCCL=0. The facts of the machine (CUDA, its GPUs, torch's NCCL) are
set here by monkeypatching torch's own queries; the GPU tests (tests/gpu) run the real thing.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hvctr.distributed import torch_comm


@pytest.fixture
def machine(monkeypatch):
    def have(gpus: int, nccl: bool = True) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)
    return have


def test_nccl_where_every_rank_of_the_host_has_a_gpu(machine):
    machine(gpus=8)
    assert torch_comm.nccl_usable(8, environ={})
    assert torch_comm.nccl_usable(1, environ={})


def test_no_nccl_for_more_ranks_than_gpus_without_cuda_or_nccl_or_when_turned_off(machine):
    machine(gpus=1)
    assert not torch_comm.nccl_usable(2, environ={})  # two ranks on one GPU: NCCL would refuse
    machine(gpus=0)
    assert not torch_comm.nccl_usable(1, environ={})
    machine(gpus=4, nccl=False)
    assert not torch_comm.nccl_usable(1, environ={})
    machine(gpus=4)
    assert not torch_comm.nccl_usable(1, environ={"HVCTR_NCCL": "0"})
    assert torch_comm.nccl_usable(1, environ={"HVCTR_NCCL": "1"})


def test_a_comm_without_nccl_runs_every_collective_on_the_host():
    comm = torch_comm.TorchComm(0, 1, [[0]], {}, None, None, None, 1 << 20, nccl=False)
    assert comm._device_for([torch.ones(2), torch.zeros(3, dtype=torch.int64)]) == torch.device("cpu")
    assert "staged through host memory" in repr(comm)
    assert "over NCCL" in repr(torch_comm.TorchComm(0, 1, [[0]], {}, None, None, None, 1 << 20, nccl=True))
