"""The planner's arithmetic against the code it models and against brute force."""

import dataclasses
import math
import re

import h5py
import numpy as np
import pytest
import torch

from hvctr.config import Compression, MergeConfig, MergeMode, MergeStates, ModelArch, ModelConfig
from hvctr.formats import NUM_BUCKETS, RowLayout, SparseOptimizer, default_bucket_owner
from hvctr.models import build_model
from hvctr.plan.keyfreq import KeyCurve, zipf_curve, zipf_distinct
from hvctr.plan.model import (FITS, NO_FIT, UNKNOWN, Job, NodeInfo, dense_flops_per_sample, dense_params,
                              dense_payload_bytes, linear_layers, plan, rows_per_rank, shard_bytes,
                              rows_held_over, sparse_bytes_per_window)
from hvctr.plan.rates import Rates, RatesFile, load_rates, write_rates
from hvctr.storage.shard import Shard
from hvctr.train.merger import KStepMerger, SyncGradients

RATES = Rates(ranks_per_node=1, compute_flops_per_s=1e10, dense_adam_params_per_s=1e8, sparse_keys_per_s=1e7,
              sparse_rows_per_s=1e7, step_overhead_s=0.001, unique_keys_per_s=5e6, cache_rows_per_s=1e6,
              cache_write_rows_per_s=1e6, new_rows_per_s=2e5, shard_rows_per_s=5e5, disk_rows_per_s=2e4,
              data_rows_per_s=1e7, alltoall_latency_s=1e-3, allreduce_latency_s=1e-3, memcpy_bytes_per_s=3e9,
              intra_node_bytes_per_s=1e9)
NODE = NodeInfo(name="test", cpus=2, threads_per_rank=1, host_memory_bytes=24 * 2**30)


@pytest.mark.parametrize("arch", list(ModelArch))
@pytest.mark.parametrize("hidden,dim,rank", [((512, 256), 16, 0), ((32, 16), 8, 0), ((32, 16), 8, 5)])
def test_dense_params_and_layers_match_the_models(arch, hidden, dim, rank):
    cfg = ModelConfig(arch=arch, hidden=hidden, bottom_mlp=(64, dim), cross_layers=2, cross_rank=rank)
    model = build_model(cfg, dim)
    assert dense_params(cfg, dim) == sum(p.numel() for p in model.parameters())
    shapes = sorted((m.in_features, m.out_features, m.bias is not None) for m in model.modules()
                    if isinstance(m, torch.nn.Linear))
    assert sorted(linear_layers(cfg, dim)) == shapes


def test_dense_flops_of_the_default_dnn_by_hand():
    # 26 * 16 + 13 = 429 inputs -> 512 -> 256 -> 1
    assert dense_flops_per_sample(ModelConfig(), 16) == 6 * (429 * 512 + 512 * 256 + 256 * 1)


def test_dense_flops_and_params_of_the_new_archs_by_hand():
    """MLPerf's DLRM-DCNv2 at D = 128 (bottom 13-512-256-128, 3 cross layers of rank 512 over
    27 x 128 = 3456, top 3456-1024-1024-512-256-1), DLRM and DCN-v2 written out by hand."""
    mlperf = ModelConfig(arch=ModelArch.DLRM_DCNV2, bottom_mlp=(512, 256, 128), hidden=(1024, 1024, 512, 256),
                         cross_layers=3, cross_rank=512)
    bottom = [(13, 512), (512, 256), (256, 128)]
    cross = [(3456, 512), (512, 3456)] * 3
    top = [(3456, 1024), (1024, 1024), (1024, 512), (512, 256), (256, 1)]
    weights = sum(i * o for i, o in bottom + cross + top)
    biases = 512 + 256 + 128 + 3 * 3456 + 1024 + 1024 + 512 + 256 + 1
    assert dense_params(mlperf, 128) == weights + biases
    assert dense_flops_per_sample(mlperf, 128) == 6 * weights - 2 * 13 * 512  # no gradient into the dense input
    # DLRM, D = 16: top over 16 + 27 * 26 / 2 = 367; the 27 x 27 x 16 batched GEMM, forward and backward
    dlrm = ModelConfig(arch=ModelArch.DLRM, bottom_mlp=(64, 16), hidden=(512, 256))
    assert dense_flops_per_sample(dlrm, 16) == (4 * 13 * 64 + 6 * 64 * 16 + 6 * (367 * 512 + 512 * 256 + 256)
                                                + 6 * 27 * 27 * 16)
    # DCN-v2, full rank over 429: W 429 x 429 and b per layer
    dcn = ModelConfig(arch=ModelArch.DCNV2, hidden=(512, 256), cross_layers=2, cross_rank=0)
    assert dense_params(dcn, 16) == 2 * (429 * 429 + 429) + 429 * 512 + 512 + 512 * 256 + 256 + 256 + 1


@pytest.mark.parametrize("world", [1, 2, 3, 5, 7, 128])
def test_rows_per_rank_is_the_fullest_shard_of_the_bucket_table(world):
    keys = 10**9 + 7
    buckets = np.bincount(default_bucket_owner(world), minlength=world)
    assert rows_per_rank(keys, world) == math.ceil(keys * buckets.max() / NUM_BUCKETS)


@pytest.mark.parametrize("capacity,dim,lf,optimizer", [(10_000, 8, 0.8, "adam"), (3_000, 16, 0.5, "adam"),
                                                        (3_000, 16, 0.5, "rowwise_adam"),
                                                        (10_000, 8, 0.8, "rowwise_adagrad")])
def test_shard_bytes_are_the_shard_files_datasets(tmp_path, capacity, dim, lf, optimizer):
    path = tmp_path / "s.h5"
    Shard.create(path, dim=dim, capacity=capacity, world_size=1, rank=0, bucket_owner=default_bucket_owner(1),
                 seed=1, init_scale=0.01, max_load_factor=lf, optimizer=SparseOptimizer(optimizer)).close()
    want = shard_bytes(capacity, dim, lf, SparseOptimizer(optimizer))
    with h5py.File(path, "r") as f:
        assert (f["index"].nbytes, f["rows"].nbytes, f["row_meta"].nbytes) == (want["index"], want["rows"], want["meta"])
    size = path.stat().st_size
    assert want["total"] <= size < want["total"] + (64 << 10)  # HDF5's own metadata and alignment


class _OneRank:
    """A comm of one rank: the reducers' byte counting is under test, not the collective."""

    size = 1

    def allreduce_sum(self, tensors, name):
        return [t.clone() for t in tensors]


@pytest.mark.parametrize("states", list(MergeStates))
@pytest.mark.parametrize("compression", list(Compression))
def test_dense_payload_is_what_the_k_step_merger_sends(states, compression):
    model = build_model(ModelConfig(hidden=(32, 16)), 8, seed=0)
    params = list(model.parameters())
    merger = KStepMerger(_OneRank(), MergeConfig(states=states, compression=compression), params)
    merger.mark_start()
    moments = ([torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params])
    merger.merge(moments, [0, 0], name="m")
    P = dense_params(ModelConfig(hidden=(32, 16)), 8)
    assert merger.bytes_sent == dense_payload_bytes(P, MergeMode.KSTEP, states, compression)


@pytest.mark.parametrize("compression", list(Compression))
def test_dense_payload_is_what_sync_sends(compression):
    model = build_model(ModelConfig(hidden=(32, 16)), 8, seed=0)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    reducer = SyncGradients(_OneRank(), MergeConfig(mode=MergeMode.SYNC, compression=compression),
                            list(model.parameters()))
    reducer.average([0, 0], name="g")
    P = dense_params(ModelConfig(hidden=(32, 16)), 8)
    assert reducer.bytes_sent == dense_payload_bytes(P, MergeMode.SYNC, MergeStates.PARAMS_M_V, compression)


def test_sparse_bytes_closed_forms():
    row = 4 * (3 * 17 + 1)
    b = sparse_bytes_per_window(1000, 4, 16, MergeMode.KSTEP, prefetch=True)
    assert b == {"pull": 750 * row, "warm": 750 * 8, "push": 750 * row}  # the keys went with the warm
    c = sparse_bytes_per_window(1000, 4, 16, MergeMode.KSTEP, prefetch=False)
    assert c == {"pull": 750 * (8 + row), "warm": 0.0, "push": 750 * row}  # ... or with the pull
    s = sparse_bytes_per_window(1000, 4, 16, MergeMode.SYNC, prefetch=False)
    assert s == {"pull": 750 * (8 + row), "warm": 0.0, "push": 750 * (8 + 4 * 17)}
    assert sum(sparse_bytes_per_window(1000, 1, 16, MergeMode.KSTEP, True).values()) == 0


@pytest.mark.parametrize("exponent", [0.8, 1.1, 1.5])
def test_zipf_distinct_matches_brute_force(exponent):
    keys = 300_000  # beyond the exactly summed head: the integrated tail counts
    p = np.arange(1, keys + 1, dtype=np.float64) ** -exponent
    p /= p.sum()
    for rows in (1, 100, 4096):
        brute = float(-np.expm1(-rows * 26 * p).sum())
        assert zipf_distinct(rows, keys, exponent, 26) == pytest.approx(brute, rel=1e-6)


def test_zipf_hit_rate_matches_brute_force():
    keys, exponent, rows = 200_000, 1.1, 2048
    curve = zipf_curve(keys, exponent, fields=1)
    p = np.arange(1, keys + 1, dtype=np.float64) ** -exponent
    q = -np.expm1(-rows * p / p.sum())
    for cached in (1_000, 20_000, 100_000):
        assert curve.hit_rate(rows, cached) == pytest.approx(q[:cached].sum() / q.sum(), rel=1e-5)
    assert curve.hit_rate(rows, 0) == 0.0 and curve.hit_rate(rows, keys) == 1.0


def test_a_sampled_curves_hit_rate_counts_the_rare_keys_the_sample_did_not_see():
    """A sample of 100 keys (4 seen more than once) out of data with 1,000: a cache of 504 keys
    holds the 4 and a share of the rare pool, 500 of its 996, not every key the sample saw (the
    planner read 1.000 there for the 16.7 GB table's 2 GiB cache); with the whole data sampled
    the cache's top keys, as before."""
    from hvctr.plan.keyfreq import KeyCurve

    counts = np.array([5, 4, 3, 2] + [1] * 96)
    curve = KeyCurve(rows=(1.0, 100.0), distinct=(1.0, 100.0), fields=1, keys=1000.0, sample_counts=counts,
                     sample_rows=100)
    q = -np.expm1(-counts * 10 / 100)
    assert curve.hit_rate(10, 504) == pytest.approx((q[:4].sum() + 500 / 996 * q[4:].sum()) / q.sum())
    assert curve.hit_rate(10, 3) == pytest.approx(q[:3].sum() / q.sum())  # within the keys seen twice or more
    assert curve.hit_rate(10, 100) < 0.2 < curve.hit_rate(10, 1000) == 1.0
    whole = dataclasses.replace(curve, keys=100.0)
    assert whole.hit_rate(10, 50) == pytest.approx(q[:50].sum() / q.sum())


def test_key_curve_interpolates_in_log_space_and_stays_within_bounds():
    c = KeyCurve(rows=(10.0, 1000.0), distinct=(100.0, 1000.0), fields=26, keys=5000.0)
    assert c(10) == pytest.approx(100) and c(1000) == pytest.approx(1000)
    assert c(100) == pytest.approx(math.sqrt(100 * 1000))  # the geometric middle
    assert c(5) == pytest.approx(50)  # below the first point: linear
    assert c(10**6) == 5000  # never more keys than the table's
    assert c(0) == 0.0
    tiny = KeyCurve(rows=(1.0, 2.0), distinct=(26.0, 60.0), fields=26)
    assert tiny(2) == 52  # never more than the rows' keys


def _job(**kw):
    base = dict(nodes=1, ranks_per_node=1, keys=10**6, dim=16, batch_size_per_rank=4096, every_k_steps=8,
                model=ModelConfig(), cpu_cache_bytes=1 << 30)
    return Job(**{**base, **kw})


def test_compute_time_is_the_sum_of_the_rated_parts():
    curve = zipf_curve(10**6, 1.1, 26)
    f = plan(_job(), NODE, RATES, curve).figures
    cfg, B = ModelConfig(), 4096
    per_step = (dense_flops_per_sample(cfg, 16) * B / RATES.compute_flops_per_s
                + dense_params(cfg, 16) / RATES.dense_adam_params_per_s + B * 26 / RATES.sparse_keys_per_s
                + curve(B) / RATES.sparse_rows_per_s + RATES.step_overhead_s)
    assert f["compute_s_per_step"] == pytest.approx(per_step)
    assert f["working_set_rows"] == pytest.approx(curve(8 * B))
    assert f["samples_per_s"] == pytest.approx(B / f["step_s"])


def test_prefetch_overlaps_only_with_a_spare_core():
    curve = zipf_curve(10**6, 1.1, 26)
    spare = plan(_job(), NODE, RATES, curve).figures
    main = spare["pull_s_per_step"] + spare["compute_s_per_step"] + spare["merge_s_per_step"]
    assert spare["step_s"] == pytest.approx(max(main, spare["prep_s_per_step"]))
    busy = plan(_job(), dataclasses.replace(NODE, cpus=1), RATES, curve).figures
    assert busy["step_s"] == pytest.approx(busy["pull_s_per_step"] + busy["compute_s_per_step"]
                                           + busy["merge_s_per_step"] + busy["prep_s_per_step"])


def test_more_ranks_than_cpus_stretch_cpu_time():
    curve = zipf_curve(10**6, 1.1, 26)
    two = dataclasses.replace(RATES, ranks_per_node=2)
    f2 = plan(_job(ranks_per_node=2), NODE, two, curve).figures
    f3 = plan(_job(ranks_per_node=3), NODE, two, curve).figures
    assert f3["compute_s_per_step"] == pytest.approx(1.5 * f2["compute_s_per_step"])
    statuses = {w: s for w, s, _ in plan(_job(ranks_per_node=3), NODE, two, curve).fits}
    assert statuses["cpus"] == NO_FIT


def test_sync_sends_gradients_every_step():
    curve = zipf_curve(10**6, 1.1, 26)
    f = plan(_job(ranks_per_node=2, mode=MergeMode.SYNC), NODE, RATES, curve).figures
    P = dense_params(ModelConfig(), 16)
    assert f["dense_payload_bytes_per_step"] == P * 4 + 8
    assert f["push_bytes_per_step"] == pytest.approx(curve(4096) / 2 * (8 + 4 * 17))
    k8 = plan(_job(ranks_per_node=2), NODE, RATES, curve).figures
    assert k8["dense_payload_bytes_per_step"] == pytest.approx((3 * P * 4 + 8) / 8)
    # merge.dense_every_steps = 4: two dense merges a window of 8 (one inside, one at its end)
    inner = plan(_job(ranks_per_node=2, dense_every_steps=4), NODE, RATES, curve).figures
    assert inner["dense_payload_bytes_per_step"] == pytest.approx(2 * (3 * P * 4 + 8) / 8)
    assert _job(dense_every_steps=3).dense_merges(8) == 3 and _job(dense_every_steps=8).dense_merges(8) == 1


def test_fits_say_what_does_not_fit_where():
    curve = zipf_curve(10**9, 1.1, 26)
    small = NodeInfo(name="n", cpus=16, threads_per_rank=1, host_memory_bytes=8 * 2**30, gpus=1,
                     gpu_memory_bytes=2**20, ssd_bytes=10 * 2**30)
    fits = {w: s for w, s, _ in plan(_job(keys=10**9, cpu_cache_bytes=16 << 30), small, RATES, curve).fits}
    assert fits["SSD"] == NO_FIT and fits["host memory"] == NO_FIT and fits["GPU memory"] == NO_FIT
    roomy = dataclasses.replace(small, host_memory_bytes=2**40, gpu_memory_bytes=40e9, ssd_bytes=2**40)
    fits = {w: s for w, s, _ in plan(_job(keys=10**9, cpu_cache_bytes=16 << 30), roomy, RATES, curve).fits}
    assert fits["SSD"] == FITS and fits["host memory"] == FITS and fits["GPU memory"] == FITS
    unknown = dataclasses.replace(small, ssd_bytes=0, host_memory_bytes=0, gpu_memory_bytes=0)
    fits = {w: s for w, s, _ in plan(_job(keys=10**9), unknown, RATES, curve).fits}
    assert fits["SSD"] == fits["host memory"] == fits["GPU memory"] == UNKNOWN


def test_several_nodes_need_a_network_rate():
    with pytest.raises(ValueError, match="nic_bytes_per_s"):
        plan(_job(nodes=2), NODE, RATES, zipf_curve(10**6, 1.1, 26))


def test_rates_file_round_trip_and_errors(tmp_path):
    rf = RatesFile(name="m", source="test", entries=(dataclasses.replace(RATES, ranks_per_node=2), RATES))
    path = tmp_path / "r.toml"
    write_rates(rf, path)
    back = load_rates(path)
    assert [e.ranks_per_node for e in back.entries] == [1, 2]
    assert back.for_ranks(1).ranks_per_node == 1 and back.for_ranks(3).ranks_per_node == 2
    assert back.entries[0].compute_flops_per_s == pytest.approx(RATES.compute_flops_per_s, rel=1e-3)
    path.write_text(path.read_text().replace("compute_flops_per_s", "compute_flop_per_s", 1))
    with pytest.raises(ValueError, match="unknown key.*compute_flop_per_s"):
        load_rates(path)
    with pytest.raises(ValueError, match="does not exist.*hvctr bench --calibrate"):
        load_rates(tmp_path / "missing.toml")


def test_a_gpu_node_takes_its_compute_from_the_gpus_datasheet_not_the_cpu_rates():
    """A GPU map with a CPU's rates file (issue 32: the DGX projection put an A100's step at
    the VM's 115 ms): the step's compute is the GPU's FLOPs, sparse keys, dense Adam's bytes and
    kernels at the A100's datasheet figures derated by hvctr.plan.gpus, written out here by hand."""
    from hvctr.plan.gpus import BANDWIDTH_EFFICIENCY, KERNEL_S, MATMUL_EFFICIENCY, SPARSE_KEYS_PER_HBM_BYTE

    curve = zipf_curve(10**6, 1.1, 26)
    gpu_node = dataclasses.replace(NODE, cpus=16, gpus=1, gpu_memory_bytes=40e9, gpu_model="A100-SXM4-40GB")
    f = plan(_job(), gpu_node, RATES, curve).figures
    cfg, B, F, D = ModelConfig(), 4096, 26, 16
    P, row = dense_params(cfg, D), 4 * (3 * (D + 1) + 1)
    kernels = 108 + 7 * 3  # three linear layers (512, 256, 1): 129, as torch.profiler counted 130 on an H200
    by_hand = (dense_flops_per_sample(cfg, D) * B / (19.5e12 * MATMUL_EFFICIENCY)
               + B * F / (SPARSE_KEYS_PER_HBM_BYTE * 1.555e12)
               + 28 * P / (1.555e12 * BANDWIDTH_EFFICIENCY) + kernels * KERNEL_S)
    assert f["compute_s_per_step"] == pytest.approx(by_hand)
    assert 3e-3 < f["compute_s_per_step"] < 12e-3  # a few ms (an H200 measured 3.9-6.6), not the CPU rates' tens
    assert "assumed from the datasheet of the A100 40GB" in f["compute_source"]
    cpu = plan(_job(), NODE, RATES, curve).figures
    assert cpu["compute_s_per_step"] > 5 * f["compute_s_per_step"]
    assert f["exposed_non_compute_s_per_step"] == pytest.approx(f["step_s"] - f["compute_s_per_step"])
    # the working set crosses PCIe (Gen4, 25 GB/s) both ways when the rates file has no host-device figure:
    # at the window's end all of it without storage.pull_ahead, the rows the window before holds with it
    for ahead, rows in ((False, curve(8 * B)), (True, rows_held_over(_job(), curve)[0])):
        linked = plan(_job(pull_ahead=ahead), gpu_node, RATES, curve).figures
        no_link = plan(_job(pull_ahead=ahead), gpu_node, dataclasses.replace(RATES, device_bytes_per_s=1e15),
                       curve).figures
        assert linked["pull_s_per_step"] - no_link["pull_s_per_step"] == pytest.approx(
            (rows * row / 25e9 - rows * row / 1e15) / 8, rel=1e-6)


def test_measured_gpu_rates_win_and_an_unknown_gpu_says_so():
    curve = zipf_curve(10**6, 1.1, 26)
    node = dataclasses.replace(NODE, cpus=16, gpus=1, gpu_model="Some Accelerator 9000")
    p = plan(_job(), node, RATES, curve)
    assert p.figures["compute_source"] == "the rates file (GPU unknown)"
    assert any("'Some Accelerator 9000' is not one hvctr.plan.gpus knows" in n for n in p.notes)
    measured = dataclasses.replace(RATES, gpu_flops_per_s=1e13, gpu_bytes_per_s=1e12, gpu_kernel_s=5e-6,
                                   gpu_sparse_keys_per_s=1e8)
    f = plan(_job(), node, measured, curve).figures
    assert f["compute_source"] == "measured (rates file)"
    # a figure the rates file lacks comes from the datasheet, and only that one is called assumed
    part = plan(_job(), dataclasses.replace(node, gpu_model="NVIDIA H200"),
                dataclasses.replace(measured, gpu_flops_per_s=0.0), curve).figures["compute_source"]
    assert "67 TFLOP/s FP32 peak" in part and "HBM" not in part and "a kernel" not in part and "keys" not in part


@pytest.mark.parametrize("model, name", [("A100-SXM4-40GB", "A100 40GB"), ("NVIDIA A100-SXM4-80GB", "A100 SXM4 80GB"),
                                         ("NVIDIA A100 80GB PCIe", "A100 PCIe 80GB"), ("NVIDIA H200", "H200 SXM 141GB"),
                                         ("NVIDIA H100 PCIe", "H100 PCIe 80GB"), ("NVIDIA H100 80GB HBM3", "H100 SXM5 80GB"),
                                         ("Tesla V100-SXM2-32GB", "V100 SXM2 32GB"), ("NVIDIA L40S", "L40S 48GB")])
def test_gpu_datasheets_are_found_by_the_maps_model_names(model, name):
    from hvctr.plan.gpus import spec_for

    assert spec_for(model).name == name
    assert spec_for("AMD Instinct MI250X") is None


def test_calibrate_measures_the_gpu_figures_the_plan_then_calls_measured():
    """bench.calibrate's GPU part (run where CUDA is, tests/gpu) on this host's CPU: every figure
    measured and positive; in a rates entry they replace the datasheet."""
    from bench.calibrate import gpu_rates

    g = gpu_rates(1, device="cpu", batches=(256, 1024))
    assert set(g) == {"gpu_flops_per_s", "gpu_bytes_per_s", "gpu_kernel_s", "gpu_sparse_keys_per_s"}
    assert all(v > 0 for v in g.values()), g
    node = dataclasses.replace(NODE, cpus=16, gpus=1, gpu_model="A100-SXM4-40GB")
    f = plan(_job(), node, dataclasses.replace(RATES, **g), zipf_curve(10**6, 1.1, 26)).figures
    assert f["compute_source"] == "measured (rates file)"


def test_a_scaling_owner_rule_keeps_the_owners_pulled_rows_to_the_push():
    """merge.sparse_rule other than average (matched, the default from 16 ranks on) reads the
    rows as pulled at the push; the pull keeps them (hvctr.storage.exchange.WindowExchange.pulled)
    instead of a second store read: host memory of one row per owned key of a window, no time;
    with storage.pull_ahead two windows' (the next one's rows, answered at its warm, wait for its
    pull beside them; with the average rule the owner keeps none)."""
    from hvctr.config import SparseRule

    curve = zipf_curve(10**6, 1.1, 26)
    row = 4 * (3 * 17 + 1)
    for ahead, windows in ((False, 1), (True, 2)):
        small_cache = dict(ranks_per_node=2, cpu_cache_bytes=1 << 20, pull_ahead=ahead)
        avg = plan(_job(**small_cache), NODE, RATES, curve).figures
        matched = plan(_job(**small_cache, sparse_rule=SparseRule.MATCHED), NODE, RATES, curve).figures
        assert matched["host_bytes"] - avg["host_bytes"] == pytest.approx(windows * avg["owner_rows_per_window"] * row)
        assert matched["step_s"] == avg["step_s"]


def test_a_memory_limit_below_the_table_makes_shard_reads_come_from_the_device():
    """`hvctr plan --memory-bytes` (a cgroup's or Slurm's limit, page cache counted): a table
    that no longer fits in what the job may use is read at disk_rows_per_s, which the map's two
    ranks on one SSD share, not from the page cache; under the limit the shard's writes are
    flushed and dropped (storage.write_behind = auto), so each written row's page is read from
    the device first."""
    from hvctr.plan.cmd import node_info
    from hvctr.topo.hwmap import load_map

    hwmap = load_map("slurm/hwmaps/vm-2cpu.toml")
    roomy, tight = node_info(hwmap, 2), node_info(hwmap, 2, memory_bytes=2**30)
    assert roomy.host_memory_bytes == 23.5 * 2**30 and tight.host_memory_bytes == 2**30
    curve = zipf_curve(4 * 10**7, 1.1, 26)
    job = _job(keys=4 * 10**7, ranks_per_node=2, cpu_cache_bytes=32 << 20)
    a, b = plan(job, roomy, RATES, curve), plan(job, tight, RATES, curve)
    assert (roomy.ranks_per_ssd, roomy.memory_limited, tight.memory_limited) == (2, False, True)
    ratio = RATES.shard_rows_per_s / (RATES.disk_rows_per_s / 2)
    assert b.figures["shard_read_s_per_step"] == pytest.approx(ratio * a.figures["shard_read_s_per_step"])
    assert (a.figures["shard_write_behind"], b.figures["shard_write_behind"]) == (False, True)
    assert "page cache" in a.figures["shard_reads_from"] and "device" in b.figures["shard_reads_from"]
    t = b.figures
    from hvctr.plan.model import WRITEBACK_PAGES_PER_ROW

    want = ((t["shard_rows_written_per_window"] * WRITEBACK_PAGES_PER_ROW + t["shard_index_blocks_written_per_window"])
            / (RATES.disk_rows_per_s / 2 / 2)
            + t["shard_push_index_blocks_per_window"] / (RATES.disk_rows_per_s / 2)
            + t["shard_new_rows_written_per_window"] / (RATES.flush_rows_per_s or RATES.shard_rows_per_s))
    assert t["shard_write_s_per_step"] == pytest.approx(want / job.every_k_steps)
    # bound by the SSD: the note names what would lift it, each with a step shorter than this one
    note = next(n for n in b.notes if n.startswith("the SSD bounds the step"))
    assert "a cache of" in note and "one SSD a rank (2 a node, not 1)" in note and "x as fast" in note
    steps = [float(x.replace(",", "")) for x in re.findall(r"would make it ([0-9,.]+) ms", note)]
    assert len(steps) == 2 and all(x < 1e3 * t["step_s"] for x in steps), (steps, t["step_s"])
    assert not any(n.startswith("the SSD bounds") for n in a.notes)  # page cache: no SSD note
    assert "SSD" in dict((w, why) for w, _, why in b.fits)["page cache"]


def test_a_later_pass_with_the_position_log_reads_no_index_blocks():
    """storage.position_log: a pass after the first over the same data finds its cold rows'
    positions in the log (hvctr.storage.position_log): the planner charges no index block for
    them, nor for the push's lookups; only a job of several epochs, every key known, gets it."""
    from hvctr.config import load_config
    from hvctr.plan.cmd import job_from
    from hvctr.plan.model import shard_traffic_per_window

    plain = shard_traffic_per_window(60_000, 0, 0.5, 10_000, 4096)
    logged = shard_traffic_per_window(60_000, 0, 0.5, 10_000, 4096, logged=True)
    assert plain["index_blocks_read"] > 0 and plain["push_index_blocks"] > 0
    assert logged["index_blocks_read"] == logged["push_index_blocks"] == 0
    assert logged["rows_read"] == plain["rows_read"] and logged["rows_written"] == plain["rows_written"]
    two = load_config(None, ["--train.epochs=2"])
    assert job_from(two, 1, 2, 10**6, 0).logged_pass
    assert not job_from(two, 1, 2, 10**6, 5000).logged_pass  # a first pass: nothing logged yet
    assert not job_from(load_config(None, []), 1, 2, 10**6, 0).logged_pass  # one epoch: no pass repeats
    assert not job_from(load_config(None, ["--train.epochs=2", "--storage.position_log=false"]), 1, 2, 10**6,
                        0).logged_pass


def test_rows_held_over_match_independent_draws():
    """storage.pull_ahead's window's-end pull: a rank's working-set rows the whole window before
    holds, and an owner's rows in both windows, against keys drawn as the curve assumes (every
    row 26 keys from one Zipf law), W = 4 ranks, k = 2 batches of 64 rows, 40 trials."""
    keys, F, W, k, B = 20_000, 26, 4, 2, 64
    curve = zipf_curve(keys, 1.1, F)
    p = np.arange(1, keys + 1, dtype=np.float64) ** -1.1
    p /= p.sum()
    rng = np.random.default_rng(5)
    holder, owner = [], []
    for _ in range(40):
        t, t1 = ([np.unique(rng.choice(keys, size=k * B * F, p=p)) for _ in range(W)] for _ in range(2))
        before = np.unique(np.concatenate(t))
        holder.append(np.mean([np.intersect1d(h, before).size for h in t1]))
        owner.append(np.intersect1d(before, np.unique(np.concatenate(t1))).size / W)
    want_holder, want_owner = rows_held_over(_job(nodes=1, ranks_per_node=W, every_k_steps=k, batch_size_per_rank=B),
                                             curve)
    assert np.mean(holder) == pytest.approx(want_holder, rel=0.05)
    assert np.mean(owner) == pytest.approx(want_owner, rel=0.05)
    assert 0 < want_holder < curve(k * B)


def test_the_plan_pulls_ahead_and_pushes_behind_where_training_would():
    """job_from turns pull ahead off where the exchange does (keys admitted by count, rows that
    expire); plan resolves push_behind = auto as the trainer does: on with a core to spare, a GPU
    or a cache of at most a tenth of the shard's rows, and then the window's end pushes less."""
    from hvctr.config import PushBehind, load_config
    from hvctr.plan.cmd import job_from

    def job(*flags):
        return job_from(load_config(None, list(flags)), nodes=1, ranks_per_node=2, keys=10**7, pass_rows=0)

    assert job().pull_ahead
    assert not job("--storage.admit_after=2").pull_ahead and not job("--storage.ttl_passes=3").pull_ahead
    curve = zipf_curve(10**6, 1.1, 26)
    busy = dataclasses.replace(NODE, cpus=2, threads_per_rank=1)
    big_cache = _job(ranks_per_node=2, cpu_cache_bytes=1 << 34)
    assert plan(big_cache, busy, RATES, curve).job.push_behind is PushBehind.OFF
    spare = dataclasses.replace(NODE, cpus=8)
    assert plan(big_cache, spare, RATES, curve).job.push_behind is PushBehind.ON  # a core to spare
    small = _job(ranks_per_node=2, cpu_cache_bytes=1 << 20)
    on = plan(small, busy, RATES, curve)
    off = plan(dataclasses.replace(small, push_behind=PushBehind.OFF), busy, RATES, curve)
    assert on.job.push_behind is PushBehind.ON
    assert on.figures["merge_s_per_step"] < off.figures["merge_s_per_step"]
    assert on.figures["prep_s_per_step"] > off.figures["prep_s_per_step"]


def test_the_plan_sizes_rows_by_their_optimizer():
    """train.sparse_optimizer reaches the plan: a row-wise Adagrad row is D + 3 floats (76 B at D = 16
    against Adam's 208), in the shard, the cache's rows and the host's bytes."""
    from hvctr.config import load_config
    from hvctr.plan.cmd import job_from

    curve = zipf_curve(10**6, 1.1, 26)
    figures = {}
    for o in ("adam", "rowwise_adagrad"):
        job = job_from(load_config(None, [f"--train.sparse_optimizer={o}"]), 1, 2, 10**6, 0)
        assert job.sparse_optimizer is SparseOptimizer(o) and job.layout == RowLayout(16, o)
        figures[o] = plan(job, NODE, RATES, curve).figures
    assert (figures["adam"]["row_bytes"], figures["rowwise_adagrad"]["row_bytes"]) == (208, 76)
    assert figures["rowwise_adagrad"]["shard_bytes"] < figures["adam"]["shard_bytes"]
    assert figures["rowwise_adagrad"]["host_bytes"] < figures["adam"]["host_bytes"]
