"""Measures this machine's rates for the planner (``hvctr bench --calibrate``).

    python -m bench.calibrate --rates my-rates.toml [--ranks 1,2] [--quick]

For each count R in ``--ranks``, ``mpirun -np R`` starts the worker (this module with
``--worker``): every rank runs the same measurement at the same moment (a barrier before
each), on one torch thread as an unbound training rank does, so an entry holds the rates of R
ranks sharing the node. Each rate is the fastest of its repeats (the one least disturbed by
other work on the machine: training nodes are allocated whole; collectives, which wait for
every rank, take the median), averaged over the ranks. What
is measured is hvctr's own code on the sizes training uses:

- a whole local step of the default DNN on a batch of 4096 (as the trainer runs it), and its
  parts: the dense Adam step, gather_rows + sum_rows_grad per batch key, sparse_adam_step
  per row; the rest of the step, loss and Python included, is the dense FLOP rate;
- distinct uint64 keys with inverse (hvctr.kernels.unique.unique_in_order); host memory copies;
- an EmbeddingStore on a fresh shard: rows created, cache hits, cache writes, shard rows
  warmed from the page cache; and random rows of a larger shard warmed from the disk (its
  pages dropped from the page cache, the store reopened);
- data rows read from an HDF5 file laid out as a data shard;
- Horovod alltoall and grouped allreduce through hvctr.distributed: the latency of a tiny one and
  the bytes per second of a large one (with one rank nothing crosses between ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

from hvctr.plan.rates import Rates, RatesFile, write_rates

DIM, BATCH, FIELDS = 16, 4096, 26
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_mpi_yield_when_idle": "1", "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
           "OMPI_MCA_rmaps_base_oversubscribe": "1"}


def _seconds(fn: Callable[[], object], reps: int, stat: Callable = min) -> float:
    """Seconds of ``fn`` over ``reps`` calls (the fastest, or ``stat``), after a warm-up call."""
    return _interleaved({"x": fn}, reps, stat)["x"]


def _interleaved(fns: dict[str, Callable[[], object]], reps: int, stat: Callable = min) -> dict[str, float]:
    """Seconds of each function over ``reps`` rounds that call each once, after a warm-up
    round (the fastest round, or ``stat`` of them): load from other processes, which comes
    and goes, hits all of them alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: stat(v) for name, v in times.items()}


# --- the measurements (one rank) ------------------------------------------------------


class LocalStep:
    """One rank's local step as the trainer runs it (Trainer._forward_backward + _local_step) on
    a batch of ``batch`` power-law keys, and its parts, for the rates measured here and in
    bench.gpu_step. ``model`` and ``opt`` may be shared by several batch sizes. Nothing waits
    for a device: the callers time to their own synchronize."""

    def __init__(self, cfg, batch: int, device, model=None, opt=None, seed: int = 0) -> None:
        import torch

        from bench.sparse import power_law_positions
        from hvctr.models import build_model

        self.cfg = cfg
        self.model = model if model is not None else build_model(cfg, DIM, seed=0).to(device)
        self.opt = opt if opt is not None else torch.optim.Adam(self.model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(seed)
        self.pos = torch.from_numpy(power_law_positions(batch, seed=1)).to(device)
        self.rows = (torch.rand(int(self.pos.max()) + 1, 3 * (DIM + 1) + 1, generator=g) * 0.01).to(device)
        self.dense = torch.rand(batch, cfg.num_dense, generator=g).to(device)
        self.labels = (torch.rand(batch, generator=g) < 0.25).float().to(device)

    def forward_backward(self):
        """The gather, forward, backward and the loss read back; the gathered leaf (its .grad set)."""
        import torch.nn.functional as F

        from hvctr.optim import gather_rows

        p = gather_rows(self.rows, self.pos, DIM)
        loss = F.binary_cross_entropy_with_logits(self.model(self.dense, p[..., :DIM], p[..., DIM]), self.labels)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        float(loss.detach())
        return p

    def sparse(self) -> None:
        """The gather, the per-row gradient sum and lazy Adam on the rows (on the gathered values)."""
        from hvctr.optim import gather_rows, sparse_adam_step, sum_rows_grad

        i, s = sum_rows_grad(self.pos, gather_rows(self.rows, self.pos, DIM).detach())
        sparse_adam_step(self.rows, i, s, 1e-3, 0.9, 0.999, 1e-8)

    def step(self) -> None:
        """The whole local step."""
        from hvctr.optim import sparse_adam_step, sum_rows_grad

        p = self.forward_backward()
        i, s = sum_rows_grad(self.pos, p.grad)
        sparse_adam_step(self.rows, i, s, 1e-3, 0.9, 0.999, 1e-8)
        self.opt.step()


def compute_rates(reps: int) -> dict[str, float]:
    import torch

    from hvctr.config import ModelConfig
    from hvctr.optim import gather_rows, sparse_adam_step, sum_rows_grad
    from hvctr.plan.model import dense_flops_per_sample, dense_params

    cfg = ModelConfig()
    ls = LocalStep(cfg, BATCH, torch.device("cpu"))
    opt, pos, rows = ls.opt, ls.pos, ls.rows
    idx, summed = sum_rows_grad(pos, ls.forward_backward().grad)

    t = _interleaved({"step": ls.step, "adam": opt.step,
                      "keys": lambda: sum_rows_grad(pos, gather_rows(rows, pos, DIM).detach()),
                      "rows": lambda: sparse_adam_step(rows, idx, summed, 1e-3, 0.9, 0.999, 1e-8)}, reps)
    # The dense rate is what a whole local step leaves after its measured sparse parts and
    # Adam: loss, Python and allocation are counted with the matrix products, so the plan of
    # this very step is the step measured (a separate overhead would be a noisy difference).
    dense_s = max(t["step"] - t["adam"] - t["keys"] - t["rows"], 0.2 * t["step"])
    return {"compute_flops_per_s": dense_flops_per_sample(cfg, DIM) * BATCH / dense_s,
            "dense_adam_params_per_s": dense_params(cfg, DIM) / t["adam"],
            "sparse_keys_per_s": pos.numel() / t["keys"], "sparse_rows_per_s": idx.numel() / t["rows"],
            "step_overhead_s": 0.0}


def gpu_rates(reps: int, device: str = "cuda", batches: tuple[int, int] = (2048, 32768)) -> dict[str, float]:
    """The GPU's figures hvctr plan uses on GPU maps (hvctr.plan.gpus; 0 there means the
    datasheet), each from the default DNN's local step as the trainer runs it, at two batch
    sizes (medians of ``reps``, each timed to a synchronize):

    - gpu_flops_per_s: the FLOPs the larger batch adds to the forward + backward, over the time
      it adds (the marginal rate: the fixed cost of a step is its kernels');
    - gpu_sparse_keys_per_s: likewise for the gather, the per-row gradient sum and lazy Adam;
    - gpu_kernel_s: the smaller batch's whole step, less its FLOPs' and keys' time at those
      rates, over the kernels hvctr.plan.model.gpu_step_s counts in it (launch, dispatch,
      autograd and Python: on an H200, 25-45 us a kernel);
    - gpu_bytes_per_s: a 256 MiB device-to-device copy, bytes read + written.
    """
    import statistics

    import torch

    from hvctr.config import ModelConfig
    from hvctr.plan.model import dense_flops_per_sample, dense_params, gpu_kernels_per_step

    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    cfg = ModelConfig()
    first = LocalStep(cfg, batches[0], dev)  # the larger batch trains the same model
    steps = {batches[0]: first, batches[1]: LocalStep(cfg, batches[1], dev, first.model, first.opt)}
    timed: dict[str, list[float]] = {}

    def time_of(name: str, fn: Callable[[], object]) -> None:
        t0 = time.perf_counter()
        fn()
        sync()
        timed.setdefault(name, []).append(time.perf_counter() - t0)

    big = torch.empty(64 << 20, dtype=torch.float32, device=dev)  # 256 MiB
    fns = {"copy": big.clone, **{f"{name}{b}": fn for b, ls in steps.items()
                                 for name, fn in (("fb", ls.forward_backward), ("sparse", ls.sparse), ("step", ls.step))}}
    for name, fn in fns.items():
        time_of(name, fn)  # warm-up
    timed.clear()
    for _ in range(max(reps, 1)):
        for name, fn in fns.items():
            time_of(name, fn)
    t = {name: statistics.median(v) for name, v in timed.items()}
    small, large = batches
    flops = dense_flops_per_sample(cfg, DIM)
    # a difference of medians can come out <= 0 on a busy host: then the larger batch's own rate
    flops_per_s = (flops * (large - small) / (t[f"fb{large}"] - t[f"fb{small}"]) if t[f"fb{large}"] > t[f"fb{small}"]
                   else flops * large / t[f"fb{large}"])
    keys = cfg.num_fields * (large - small)
    keys_per_s = (keys / (t[f"sparse{large}"] - t[f"sparse{small}"]) if t[f"sparse{large}"] > t[f"sparse{small}"]
                  else cfg.num_fields * large / t[f"sparse{large}"])
    bytes_per_s = 2 * big.numel() * 4 / t["copy"]
    kernels = gpu_kernels_per_step(cfg, DIM)
    rest = t[f"step{small}"] - flops * small / flops_per_s - cfg.num_fields * small / keys_per_s \
        - 28 * dense_params(cfg, DIM) / bytes_per_s
    return {"gpu_flops_per_s": flops_per_s, "gpu_bytes_per_s": bytes_per_s,
            "gpu_kernel_s": max(rest, 0.1 * t[f"step{small}"]) / kernels, "gpu_sparse_keys_per_s": keys_per_s}


def host_rates(reps: int) -> dict[str, float]:
    from hvctr.formats import mix64
    from hvctr.kernels import unique_in_order

    keys = mix64(np.arange(1 << 19, dtype=np.uint64) + np.uint64(12345 << 32))
    a = np.ones(4 << 20, dtype=np.float64)  # 32 MiB, beyond the last-level cache
    b = np.empty_like(a)
    t = _interleaved({"unique": lambda: unique_in_order(keys, distinct=keys.size), "copy": lambda: np.copyto(b, a)}, reps)
    return {"unique_keys_per_s": keys.size / t["unique"], "memcpy_bytes_per_s": a.nbytes / t["copy"]}


def _drop_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def store_rates(work: str, batches: int) -> dict[str, float]:
    """Rows/s of the store's operations, each over ``batches`` batches of 2^15 fresh keys."""
    from hvctr.config import StorageConfig
    from hvctr.formats import mix64
    from hvctr.storage import EmbeddingStore

    n = 1 << 15
    cfg = StorageConfig(dim=DIM, rows_per_rank=max(4 * batches * n, 1 << 18), cpu_cache_bytes=256 << 20)
    path = os.path.join(work, "calibrate-store.h5")
    keys = [mix64(np.arange(n, dtype=np.uint64) + np.uint64((b + 1) << 40)) for b in range(batches)]
    t: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[[], object]) -> None:
        t0 = time.perf_counter()
        fn()
        t.setdefault(name, []).append(time.perf_counter() - t0)

    store = EmbeddingStore(cfg, path, create=True)
    rows = np.zeros((n, store.layout.width), dtype=np.float32)
    for k in keys:
        timed("new", lambda: store.read(k))
        timed("hit", lambda: store.read(k))
        timed("write", lambda: store.write(k, rows))
    timed("flush", store.flush)  # every row is dirty: created, then written
    store.cache.clear()
    everything = np.concatenate(keys)
    rng = np.random.default_rng(3)
    shard = store.shard
    shard.write_behind = False  # the page cache's rates (no memory limit: storage.write_behind auto)
    for _ in keys:  # rows at random places of the shard (one page each, as a big table's), in the page cache
        pick = everything[rng.choice(everything.size, n, replace=False)]
        timed("shard", lambda: store.warm(pick))
        store.cache.clear()
        pos = shard.lookup(pick)
        order = np.argsort(pos)
        timed("shard_write", lambda: shard.write_rows(pos[order], pick[order], rows))
    store.close()
    os.unlink(path)
    rate = {name: n / min(v) for name, v in t.items()}
    return {"new_rows_per_s": rate["new"], "cache_rows_per_s": rate["hit"], "cache_write_rows_per_s": rate["write"],
            "shard_rows_per_s": rate["shard"], "shard_write_rows_per_s": rate["shard_write"],
            "flush_rows_per_s": batches * n / t["flush"][0]}


def disk_rate(work: str, shard_rows: int, reads: int, repeats: int) -> dict[str, float]:
    """Rows/s of the store's warm (index probe, row read, cache insert) for random rows of a
    shard whose pages were dropped from the page cache: one 4 KiB page or more per row, as
    a window's rows are in a table far larger than the window."""
    from hvctr.config import StorageConfig
    from hvctr.formats import default_bucket_owner, mix64
    from hvctr.storage import EmbeddingStore
    from hvctr.formats import RowLayout
    from hvctr.storage.shard import Shard

    path = os.path.join(work, "calibrate-disk.h5")
    cfg = StorageConfig(dim=DIM, rows_per_rank=shard_rows, cpu_cache_bytes=64 << 20)
    shard = Shard.create(path, dim=DIM, capacity=shard_rows, world_size=1, rank=0, bucket_owner=default_bucket_owner(1),
                         seed=cfg.seed, init_scale=0.01, max_load_factor=cfg.max_load_factor)
    keys = mix64(np.arange(shard_rows, dtype=np.uint64) + np.uint64(77 << 40))
    zeros = np.zeros((1 << 16, RowLayout(DIM).width), dtype=np.float32)
    for a in range(0, shard_rows, 1 << 16):
        k = keys[a:a + (1 << 16)]
        shard.write_rows(shard.insert(k), k, zeros[:k.size])
    shard.close()
    rng = np.random.default_rng(5)
    times = []
    for _ in range(repeats):
        _drop_page_cache(path)
        store = EmbeddingStore(cfg, path, create=False)
        pick = keys[rng.choice(shard_rows, size=reads, replace=False)]
        t0 = time.perf_counter()
        store.warm(pick)
        times.append(time.perf_counter() - t0)
        store.close()
    # write-back as under a memory limit: rows at random places, each page read from the device,
    # written, flushed and dropped (storage.write_behind on)
    writes = []
    for _ in range(repeats):
        _drop_page_cache(path)
        shard = Shard.open(path, write_behind=True)
        pos = np.sort(rng.choice(shard_rows, size=reads, replace=False)).astype(np.int64)
        t0 = time.perf_counter()
        shard.write_rows(pos, keys[pos], zeros[:1].repeat(reads, axis=0))
        writes.append(time.perf_counter() - t0)
        shard.close()
    os.unlink(path)
    return {"disk_rows_per_s": reads / min(times), "disk_write_rows_per_s": reads / min(writes)}


def data_rate(work: str, reps: int) -> dict[str, float]:
    """Rows/s of reading a data shard's three datasets in slices, as hvctr.data.reader.ShardReader does."""
    import h5py

    n, step = 1 << 17, 1 << 15
    path = os.path.join(work, "calibrate-data.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("labels", data=np.zeros(n, np.float32))
        f.create_dataset("dense", data=np.ones((n, 13), np.float32))
        f.create_dataset("keys", data=np.arange(n * FIELDS, dtype=np.uint64).reshape(n, FIELDS))
    out = (np.empty(step, np.float32), np.empty((step, 13), np.float32), np.empty((step, FIELDS), np.uint64))

    def read_all() -> None:
        with h5py.File(path, "r") as f:
            for a in range(0, n, step):
                for name, arr in zip(("labels", "dense", "keys"), out):
                    f[name].read_direct(arr, source_sel=np.s_[a:a + step])

    rate = n / _seconds(read_all, reps)
    os.unlink(path)
    return {"data_rows_per_s": rate}


def exchange_rates(comm, reps: int, memcpy_bytes_per_s: float) -> dict[str, float]:
    """Latency of tiny collectives; bytes/s between ranks from a large alltoall (beyond the
    copies the call makes anyway)."""
    import torch

    W = comm.size
    width = 3 * (DIM + 1) + 1 + 2  # a pushed row: key (2 float32) + row
    per_peer = 1 << 14
    tiny, big = torch.zeros(W, 2), torch.zeros(W * per_peer, width)
    counter = iter(range(1 << 30))

    def a2a(t: torch.Tensor) -> Callable[[], object]:
        # comm: alltoall of calibration messages, every rank sends len/W rows to each rank
        return lambda: comm.alltoall(t, [t.shape[0] // W] * W, name=f"calibrate.a2a.{next(counter)}")

    def ar(ts: list[torch.Tensor]) -> Callable[[], object]:
        # comm: grouped allreduce (Sum) of calibration tensors
        return lambda: comm.allreduce_sum(ts, name=f"calibrate.ar.{next(counter)}")

    lat_a2a = _seconds(a2a(tiny), reps * 4, statistics.median)
    lat_ar = _seconds(ar([torch.zeros(2)]), reps * 4, statistics.median)
    out = {"alltoall_latency_s": lat_a2a, "allreduce_latency_s": lat_ar, "intra_node_bytes_per_s": 0.0}
    if W > 1:
        sent = big.element_size() * width * per_peer * (W - 1)
        t = _seconds(a2a(big), reps, statistics.median) - lat_a2a - sent / memcpy_bytes_per_s
        out["intra_node_bytes_per_s"] = sent / max(t, 1e-6)
    return out


def measure_rank(comm, work: str, quick: bool) -> dict[str, float]:
    """Every rate of this rank; the ranks run each part together."""
    import torch

    from hvctr.determinism import deterministic_torch

    torch.set_num_threads(1)
    deterministic_torch()
    reps = 3 if quick else 7
    res: dict[str, float] = {}
    for part in ("compute", "host", "store", "disk", "data"):
        comm.barrier()  # comm: barrier: the ranks measure each part at the same time
        if part == "compute":
            res.update(compute_rates(reps))
        elif part == "host":
            res.update(host_rates(reps))
        elif part == "store":
            res.update(store_rates(work, 2 if quick else 4))
        elif part == "disk":
            res.update(disk_rate(work, 1 << (18 if quick else 19), 2048, 2 if quick else 3))
        else:
            res.update(data_rate(work, reps))
    if torch.cuda.is_available():  # a GPU node: its figures replace hvctr plan's datasheet assumptions
        res.update(gpu_rates(reps))
    comm.barrier()  # comm: barrier before the exchange measurements
    res.update(exchange_rates(comm, reps, res["memcpy_bytes_per_s"]))
    return res


def worker(out: str, work: str, quick: bool) -> int:
    from hvctr.distributed import init_comm

    comm = init_comm()
    mine = os.path.join(work, f"rank-{comm.rank}")
    os.makedirs(mine, exist_ok=True)
    res = measure_rank(comm, mine, quick)
    # comm: allgather of every rank's rates; rank 0 writes their mean
    every = comm.allgather_object(res, name="calibrate.results")
    if comm.rank == 0:
        mean = {k: float(np.mean([r[k] for r in every])) for k in res}
        Path(out).write_text(json.dumps({"ranks": comm.size, "rates": mean, "per_rank": every}, indent=1))
    comm.shutdown()
    return 0


# --- the driver -----------------------------------------------------------------------


def run_ranks(ranks: int, work: Path, quick: bool, python: str = sys.executable) -> dict:
    out = work / f"rates-{ranks}.json"
    cmd = ["mpirun", "-np", str(ranks), "--bind-to", "none", python, "-m", "mpi4py", "-m", "bench.calibrate",
           "--worker", "--out", str(out), "--work-dir", str(work)] + (["--quick"] if quick else [])
    r = subprocess.run(cmd, env={**os.environ, **MPI_ENV}, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"calibration with {ranks} ranks failed ({r.returncode}): {' '.join(cmd)}\n"
                           f"{r.stdout[-2000:]}{r.stderr[-4000:]}")
    return json.loads(out.read_text())


def calibrate(rates_path: str, ranks: list[int], quick: bool, name: str = "", work_dir: str | None = None) -> RatesFile:
    """Measures each rank count, writes the rates file, returns it."""
    load0 = os.getloadavg()[0]
    t0 = time.time()
    entries = []
    with tempfile.TemporaryDirectory(prefix="hvctr-calibrate-", dir=work_dir) as work:
        for r in ranks:
            res = run_ranks(r, Path(work), quick)
            entries.append(Rates(ranks_per_node=r, **res["rates"]))
    stamp = time.strftime("%Y-%m-%d %H:%M")
    source = (f"measured by hvctr bench --calibrate{' --quick' if quick else ''} on {os.uname().nodename}, {stamp}, "
              f"{os.cpu_count()} cpus, load average {load0:.1f} at the start, {time.time() - t0:.0f} s")
    rf = RatesFile(name=name or os.uname().nodename, source=source, entries=tuple(entries))
    write_rates(rf, rates_path, header=["Measured on this machine: one torch thread per rank, ranks side by side."])
    return rf


def default_ranks() -> list[int]:
    """1 rank alone, and as many side by side as the machine has cpus (at most 8)."""
    n = min(os.cpu_count() or 1, 8)
    return [1] if n == 1 else [1, n]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.calibrate", description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="", help="rates file to write (required; hvctr/plan/rates.toml is the planner's "
                                               "default, refreshed by hvctr bench --write-benchmarks)")
    p.add_argument("--ranks", default="", help="rank counts to measure, e.g. 1,2 (default: 1 and the cpu count)")
    p.add_argument("--quick", action="store_true", help="fewer repeats")
    p.add_argument("--name", default="", help="the rates file's name (default: the host name)")
    p.add_argument("--work-dir", default=None, help="scratch directory for the shard and data files")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.out, args.work_dir, args.quick)
    if not args.rates:
        p.error("--rates FILE is required: the rates file to write")
    ranks = [int(x) for x in args.ranks.split(",") if x] if args.ranks else default_ranks()
    rf = calibrate(args.rates, ranks, args.quick, args.name, args.work_dir)
    print(f"wrote {args.rates}: {rf.source}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
