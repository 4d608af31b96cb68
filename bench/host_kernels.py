"""The host-side kernels the prefetch thread and the DLRM step spend their CPU in, each against
the way it was done before, interleaved in one process (ratios; absolute times follow the
machine's neighbours).

    python -m bench.host_kernels [--reps 9]

- ``eviction cut``: the score below which the CPU cache evicts (hvctr.kernels.select's radix
  selection) against numpy's partition, on the scores of a full cache of 1.75M entries (the
  DLRM benchmark's 256 MiB of row-wise Adagrad rows), 7,500 to evict, with half and with 95% of
  the entries in one (count, tick) group, as the entries of one operation are;
- ``window unique``: unique_in_order over a window's keys (3.7M multi-hot keys, 260k distinct;
  852k one-hot keys, 57k distinct) with its table sized for the distinct keys expected (the
  default) against a table for every key (distinct = n, as before);
- ``key filter``: the shard's Bloom filter adding 200k keys and testing 300k, in C against
  numpy (``native.disabled()``);
- ``reply scatter``: the rows of an exchange's reply put where the working set wants them
  (hvctr.storage.exchange.put_rows, one memcpy a row in C) against numpy's fancy assignment:
  300k rows of 52 floats (a DNN window's rows of dim 16 with Adam's states) to a permutation;
- ``first index flush``: a new shard's first index flush (641k new keys, the all-cached run's
  rank of bench.train, storage.rows_per_rank 4M) with the blocks create() left empty filled in
  memory against read back from the file (the shard's ``_blank`` dropped: as a shard opened from
  disk does); each rep a fresh shard under /var/tmp;
- ``dot interaction``: one DLRM step (forward, backward, Adam; batch 4096, 26 fields of 16, 1
  thread, deterministic) with its written-out backward against autograd's through the gather.

Medians in ms, and old / new.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import numpy as np

from hvctr.kernels import native, unique_in_order
from hvctr.kernels.select import kth_smallest


def _interleaved(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()  # warm-up
    for r in range(reps):
        for name in (list(fns) if r % 2 else list(fns)[::-1]):
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def _line(what: str, old: str, new: str, t: dict[str, float]) -> str:
    return f"{what}: {old} {t[old]:.1f} ms, {new} {t[new]:.1f} ms, {old} / {new} = {t[old] / t[new]:.2f}x"


def eviction_cut(reps: int) -> list[str]:
    rng = np.random.default_rng(0)
    n, m = 1_754_480, 7_500
    out = []
    for share in (0.5, 0.95):
        score = rng.integers(0, 2**50, n)
        score[rng.random(n) < share] = (1 << 40) | 12345
        t = _interleaved({"np.partition": lambda: np.partition(score, m - 1)[m - 1],
                          "kth_smallest": lambda: kth_smallest(score, m - 1)}, reps)
        out.append(_line(f"eviction cut, {share:.0%} of 1.75M scores equal", "np.partition", "kth_smallest", t))
    return out


def window_unique(reps: int) -> list[str]:
    rng = np.random.default_rng(1)
    out = []
    for n, d in ((3_700_000, 260_000), (852_000, 57_000)):
        pool = rng.integers(0, 2**63, d, dtype=np.uint64)
        keys = rng.choice(pool, n)
        t = _interleaved({"table for every key": lambda: unique_in_order(keys, distinct=n),
                          "table for the distinct": lambda: unique_in_order(keys)}, reps)
        out.append(_line(f"window unique, {n:,} keys ({d:,} distinct)", "table for every key",
                         "table for the distinct", t))
    return out


def key_filter(reps: int) -> list[str]:
    from hvctr.storage.shard import KeyFilter

    rng = np.random.default_rng(2)
    keys = rng.integers(0, 2**64 - 2, 200_000, dtype=np.uint64)
    asked = rng.integers(0, 2**64 - 2, 300_000, dtype=np.uint64)
    f = KeyFilter(4_000_000)

    def numpy_path() -> None:
        with native.disabled():
            f.add(keys)
            f.may_hold(asked)

    def c_path() -> None:
        f.add(keys)
        f.may_hold(asked)

    return [_line("key filter, add 200k + test 300k", "numpy", "C", _interleaved({"numpy": numpy_path, "C": c_path},
                                                                                  reps))]


def reply_scatter(reps: int) -> list[str]:
    from hvctr.storage.exchange import put_rows

    rng = np.random.default_rng(3)
    n, width = 300_000, 52
    values = np.empty((n, width), dtype=np.float32)
    rows = rng.standard_normal((n, width)).astype(np.float32)
    at = rng.permutation(n)

    def numpy_way() -> None:
        values[at] = rows

    t = _interleaved({"numpy": numpy_way, "put_rows": lambda: put_rows(values, at, rows)}, reps)
    return [_line("reply scatter, 300k rows of 52 floats", "numpy", "put_rows", t)]


def first_index_flush(reps: int) -> list[str]:
    import shutil
    import tempfile

    from hvctr.storage.shard import NUM_BUCKETS, Shard, pending_bytes_for

    rng = np.random.default_rng(4)
    keys = np.unique(rng.integers(1, 2**63, 700_000, dtype=np.uint64))[:641_000]
    work = tempfile.mkdtemp(prefix="host_kernels.", dir="/var/tmp")

    def flush(read_back: bool) -> Callable[[], None]:
        def run() -> None:
            path = f"{work}/s.h5"
            shard = Shard.create(path, dim=16, capacity=4_000_000, world_size=2, rank=0,
                                 bucket_owner=np.zeros(NUM_BUCKETS, np.int32), seed=0, init_scale=0.01,
                                 max_load_factor=0.8, pending_bytes=pending_bytes_for(256 << 20))
            if read_back:
                shard._blank = None
            for part in np.array_split(keys, 31):
                shard.insert(part)
            shard.flush_index()
            shard.close()
            os.unlink(path)
        return run

    try:
        t = _interleaved({"read back": flush(True), "filled": flush(False)}, max(3, reps // 3))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return [_line("a new shard's inserts and first index flush, 641k keys", "read back", "filled", t)]


def dot_interaction(reps: int) -> list[str]:
    import torch
    import torch.nn.functional as F

    import hvctr.models.ctr as ctr
    from hvctr.determinism import deterministic_torch

    torch.set_num_threads(1)
    deterministic_torch()
    written_out = ctr.dot_interaction

    def autograd_way(x: torch.Tensor) -> torch.Tensor:
        n = int(x.shape[1])
        i, j = torch.tril_indices(n, n, offset=-1, device=x.device)
        return torch.bmm(x, x.transpose(1, 2))[:, i, j]

    torch.manual_seed(0)
    model = ctr.DLRM(26, 16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    emb, w1 = torch.randn(4096, 26, 16, requires_grad=True), torch.randn(4096, 26)
    dense, y = torch.randn(4096, 13), (torch.rand(4096) < 0.25).float()

    def step(fn) -> None:
        ctr.dot_interaction = fn
        try:
            opt.zero_grad()
            emb.grad = None
            F.binary_cross_entropy_with_logits(model(dense, emb, w1), y).backward()
            opt.step()
        finally:
            ctr.dot_interaction = written_out

    t = _interleaved({"autograd": lambda: step(autograd_way), "written out": lambda: step(written_out)}, reps)
    return [_line("DLRM step, dot interaction", "autograd", "written out", t)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.host_kernels", description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=9)
    args = p.parse_args(argv)
    if native.lib() is None:
        raise SystemExit("bench.host_kernels compares the C kernels with their fallbacks: unset HVCTR_NATIVE")
    for part in (eviction_cut, window_unique, key_filter, reply_scatter, first_index_flush, dot_interaction):
        for line in part(args.reps):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
