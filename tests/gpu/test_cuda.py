"""The CUDA path, on a machine with one GPU (tests/gpu/smoke.sh runs this; skipped without CUDA).

- the sparse optimiser's ops (gather, per-row gradient sums, lazy Adam, the row-wise steps) with
  device cuda give what they give on the host (within float rounding) and the same bits twice;
- a model step (DNN; DLRM, whose dot interaction has its own backward) under hvctr.determinism
  runs (cuBLAS needs CUBLAS_WORKSPACE_CONFIG, which hvctr.train.cmd sets before CUDA starts) and
  repeats bit for bit;
- the trainer on cuda: `hvctr simulate` (the real Trainer, 2 ranks over threads) with
  --train.device=cuda;
- two ranks of `hvctr train` under mpirun on the one GPU, with a small table: a run killed after
  a checkpoint and resumed ends bit-equal to an uninterrupted one;
- the torch.distributed engine: one rank moves CUDA tensors over NCCL on the GPU (they stay
  there, the results on the tensors' own devices); two ranks on the one GPU, which NCCL refuses,
  stage them through host memory and train Horovod's model.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from hvctr.train.cmd import cuda_determinism_env

cuda_determinism_env()  # before anything below initialises CUDA

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.conftest import VENV_PY  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
CUDA = torch.device("cuda:0")


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> Path:
    from tests.e2e.helpers import make_dataset

    return make_dataset(tmp_path_factory)


def _sparse_step(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    from hvctr.optim import gather_rows, sparse_adam_step, sum_rows_grad

    dim = 8
    g = torch.Generator().manual_seed(3)
    rows = torch.rand(500, 3 * (dim + 1) + 1, generator=g)
    rows[:, -1] = 0  # step counts
    pos = torch.randint(0, 500, (64, 26), generator=g)
    rows, pos = rows.to(device), pos.to(device)
    gathered = gather_rows(rows, pos, dim)
    (gathered.sin().sum()).backward()
    idx, grad = sum_rows_grad(pos, gathered.grad)
    sparse_adam_step(rows, idx, grad, 1e-2, 0.9, 0.999, 1e-8)
    return rows.cpu(), idx.cpu()


def test_sparse_ops_on_cuda_match_the_host_and_repeat():
    host, idx_h = _sparse_step(torch.device("cpu"))
    a, idx_a = _sparse_step(CUDA)
    b, _ = _sparse_step(CUDA)
    assert torch.equal(idx_h, idx_a)
    assert torch.allclose(host, a, rtol=1e-5, atol=1e-6)
    assert torch.equal(a, b)


@pytest.mark.parametrize("optimizer", ["rowwise_adam", "rowwise_adagrad"])
def test_rowwise_steps_on_cuda_match_the_host_kernels(optimizer):
    """train.sparse_optimizer's row-wise steps: torch's form on the GPU against the C kernels."""
    from hvctr.formats import RowLayout
    from hvctr.optim import sparse_step

    lay = RowLayout(8, optimizer)
    g = torch.Generator().manual_seed(4)
    rows = torch.rand(500, lay.width, generator=g)
    rows[:, lay.states] = 0
    idx = torch.randperm(500, generator=g)[:200]
    grad = torch.randn(200, lay.model_width, generator=g)
    host = rows.clone()
    sparse_step(lay, host, idx, grad, 1e-2, 0.9, 0.999, 1e-8)
    dev = rows.to(CUDA)
    sparse_step(lay, dev, idx.to(CUDA), grad.to(CUDA), 1e-2, 0.9, 0.999, 1e-8)
    assert torch.allclose(host, dev.cpu(), rtol=1e-5, atol=1e-6)


def test_pooled_gather_and_backward_on_cuda_match_the_host_kernels():
    """Multi-valued fields' pooling (hvctr.optim.pooling): torch's form on the GPU against the C kernels."""
    import numpy as np

    from hvctr.formats import RowLayout
    from hvctr.optim import batch_unique
    from hvctr.optim.pooling import gather_pooled, sum_pooled_grads

    g = torch.Generator().manual_seed(5)
    rows = torch.rand(300, RowLayout(8).width, generator=g)
    lengths = torch.randint(0, 5, (64 * 4,), generator=g)
    off = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    pos = torch.randint(0, 300, (int(off[-1]),), generator=g)
    mean = np.array([0, 1, 0, 1], dtype=np.uint8)
    ge, gw = torch.randn(64, 4, 8, generator=g), torch.randn(64, 4, generator=g)
    out = []
    for dev in (torch.device("cpu"), CUDA):
        emb, w1 = gather_pooled(rows.to(dev), pos.to(dev), off.to(dev), mean, 4, 8)
        uniq, summed = sum_pooled_grads(pos.to(dev), off.to(dev), mean, ge.to(dev), gw.to(dev),
                                        tuple(t.to(dev) for t in batch_unique(pos)))
        out.append([t.cpu() for t in (emb, w1, uniq, summed)])
    for host, dev in zip(*out):
        assert torch.allclose(host.float(), dev.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["dnn", "dlrm"])
def test_model_step_is_deterministic_on_cuda(arch):
    from hvctr.config import ModelArch, ModelConfig
    from hvctr.determinism import deterministic_torch
    from hvctr.models import build_model

    deterministic_torch()
    grads = []
    for _ in range(2):
        cfg = ModelConfig(arch=ModelArch(arch), hidden=(64, 32), bottom_mlp=(32, 8))
        model = build_model(cfg, 8, seed=1).to(CUDA)
        g = torch.Generator().manual_seed(5)
        dense = torch.rand(256, 13, generator=g).to(CUDA)
        emb = torch.rand(256, 26, 8, generator=g).to(CUDA)
        w1 = torch.rand(256, 26, generator=g).to(CUDA)
        labels = (torch.rand(256, generator=g) > 0.7).float().to(CUDA)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, emb, w1), labels)
        loss.backward()
        grads.append([p.grad.cpu() for p in model.parameters()])
    assert all(torch.equal(x, y) for x, y in zip(*grads))


def test_trainer_on_cuda_through_simulate(dataset, tmp_path):
    from tests.e2e.helpers import SMALL

    run = tmp_path / "sim"
    r = subprocess.run([VENV_PY, "-m", "hvctr", "simulate", "--ranks", "2", f"--data.train_dir={dataset}",
                        f"--train.run_dir={run}", *SMALL, "--train.device=cuda", "--train.max_steps=16",
                        "--merge.every_k_steps=4"], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "device cuda" in r.stdout + r.stderr
    assert json.loads((run / "summary.json").read_text())["steps"] == 16


def test_two_ranks_on_one_gpu_resume_bit_equal(dataset, tmp_path):
    from tests.e2e.helpers import assert_same_model, kill_after_checkpoint, train

    flags = ["--train.device=cuda", "--merge.every_k_steps=2", "--checkpoint.every_windows=3",
             "--checkpoint.compact_every=2", "--storage.rows_per_rank=0", "--train.max_steps=30"]
    r = train(2, tmp_path / "whole", dataset, *flags, timeout=240)
    assert "device cuda:0" in r.stdout, r.stdout[-2000:]
    kill_after_checkpoint(flags, 2, tmp_path / "cut", dataset, seq=2)
    train(2, tmp_path / "cut", dataset, *flags, resume=True, timeout=240)
    assert_same_model(tmp_path / "whole", tmp_path / "cut")


_ONE_RANK_NCCL = """
import torch
from hvctr.distributed.torch_comm import init_torch_comm
comm = init_torch_comm()
assert comm.nccl, repr(comm)
cuda = torch.device("cuda:0")
dense = [torch.arange(40000, dtype=torch.float32, device=cuda) / 7, torch.ones(3, device=cuda)]
summed = comm.allreduce_sum(dense, "dense")
assert all(s.device == cuda and torch.equal(s, d) for s, d in zip(summed, dense))
mixed = comm.allreduce_sum([dense[0], torch.ones(5)], "mixed")  # the host tensor comes back to the host
assert mixed[0].device == cuda and mixed[1].device.type == "cpu" and torch.equal(mixed[1], torch.ones(5))
rows = torch.randn(9, 4, device=cuda).to(torch.bfloat16)
got, received = comm.alltoall(rows, [9], "rows")
assert got.device == cuda and torch.equal(got, rows) and received.tolist() == [9]
assert torch.equal(comm.allgather(rows, "gather"), rows) and torch.equal(comm.broadcast(rows, 0, "bcast"), rows)
comm.barrier()
comm.shutdown()
print("ok", repr(comm))
"""


def test_torch_engine_moves_cuda_tensors_over_nccl(tmp_path):
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    r = subprocess.run([VENV_PY, "-c", _ONE_RANK_NCCL], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "GPU tensors over NCCL" in r.stdout, (r.stdout[-2000:], r.stderr[-3000:])


def test_torch_engine_two_ranks_on_one_gpu_stage_and_train_horovods_model(dataset, tmp_path):
    """NCCL refuses two ranks on one GPU: the torch engine sees it at start and stages GPU tensors
    through host memory, in hvctr's ring order: the model Horovod trains (bit for bit where
    Horovod too sums on the host; with Horovod's NCCL, whose GPU sums follow NCCL's order, the
    same AUC to 4 digits)."""
    import horovod.torch as hvd

    from tests.e2e.helpers import train
    from tests.e2e.test_simulate import compare, evaluation

    flags = ["--train.device=cuda", "--merge.every_k_steps=2", "--train.max_steps=24"]
    runs = {b: tmp_path / b for b in ("horovod", "torch")}
    out = {b: train(2, run, dataset, *flags, f"--distributed.backend={b}", timeout=240) for b, run in runs.items()}
    assert "GPU tensors staged through host memory" in out["torch"].stdout + out["torch"].stderr
    if hvd.nccl_built():
        a, b = evaluation(runs["horovod"]), evaluation(runs["torch"])
        assert round(a["auc"], 4) == round(b["auc"], 4), (a, b)
    else:
        compare(runs["horovod"], runs["torch"])


def test_calibrate_measures_this_gpu_for_the_planner():
    """bench.calibrate's GPU figures on the real device: in the range of a datacenter GPU, and
    `hvctr plan` on a GPU map takes them over the datasheet (issue 32, item 3)."""
    import dataclasses

    from bench.calibrate import gpu_rates
    from hvctr.plan.model import Job, NodeInfo, plan
    from hvctr.plan.keyfreq import zipf_curve
    from hvctr.plan.rates import load_rates

    g = gpu_rates(3)
    assert g["gpu_flops_per_s"] > 1e11 and g["gpu_bytes_per_s"] > 1e11 and 0 < g["gpu_kernel_s"] < 1e-3, g
    assert g["gpu_sparse_keys_per_s"] > 1e6, g
    from hvctr.plan.cmd import DEFAULT_RATES

    rates = dataclasses.replace(load_rates(DEFAULT_RATES).entries[0], **g)
    node = NodeInfo(name="here", cpus=16, threads_per_rank=1, gpus=1, gpu_model=torch.cuda.get_device_name(0))
    job = Job(nodes=1, ranks_per_node=1, keys=10**6, dim=16, batch_size_per_rank=4096, every_k_steps=8)
    f = plan(job, node, rates, zipf_curve(10**6, 1.1, 26)).figures
    assert f["compute_source"] == "measured (rates file)"
    print(json.dumps({**g, "planned_compute_ms": 1e3 * f["compute_s_per_step"]}))
