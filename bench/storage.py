"""Benchmarks of the embedding store, as ratios measured side by side in one run.

    python -m bench.storage                   # all parts; prints JSON lines
    python -m bench.storage --write BENCHMARKS.md

Parts:
- ``shard``: reading 4096 random rows (sorted) of a shard, by position and by key, against
  raw np.memmap and os.pread of the same rows of the same file; cold (the file's pages
  dropped with posix_fadvise DONTNEED after unmapping) and warm (the file in the page cache).
- ``cache``: cache lookups plus row gathers (all hits) against a plain numpy gather of the
  same rows from a dense in-RAM array.
- ``policy``: hit rates of LRU and LFU with aging on Zipf(1.1) key streams, caches of 1%,
  5% and 20% of the keys, beside a static cache of the truly hottest keys (the IID optimum).
- ``exchange``: a window's pull and push with 2 ranks (started here with mpirun), split into
  exchange, cache and shard time. The window's keys are routed once before its pull, as the
  prefetch thread does in training (``route_s``, not part of the window's time).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

import numpy as np

from bench.report import write_section
from hvctr.config import CachePolicy, StorageConfig
from hvctr.formats import default_bucket_owner, mix64
from hvctr.storage.cache import ENTRY_OVERHEAD_BYTES, RowCache
from hvctr.formats import RowLayout, init_rows
from hvctr.storage.shard import Shard

SECTION = "## Embedding store"
DIM = 16
CRITEO_CARDINALITIES = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
                        14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _keys(n: int, seed: int) -> np.ndarray:
    return mix64(np.arange(n, dtype=np.uint64) + np.uint64(seed << 40))


# --- shard reads ---------------------------------------------------------------------


def _build_shard(path: str, n_rows: int) -> np.ndarray:
    shard = Shard.create(path, dim=DIM, capacity=n_rows, world_size=1, rank=0,
                         bucket_owner=default_bucket_owner(1), seed=1, init_scale=0.01, max_load_factor=0.8)
    keys = _keys(n_rows, 1)
    layout = RowLayout(DIM)
    for s in range(0, n_rows, 1 << 16):
        k = keys[s:s + (1 << 16)]
        shard.write_rows(shard.insert(k), k, init_rows(k, layout, 0.01, 1))
    shard.close()
    return keys


def _drop_file_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def bench_shard(workdir: str, n_rows: int, batch: int, repeats: int) -> dict:
    """Seconds per batch of ``batch`` rows, medians over repeats; cold and warm."""
    path = os.path.join(workdir, "bench-shard.h5")
    keys = _build_shard(path, n_rows)
    width = RowLayout(DIM).width
    probe = Shard.open(path, writable=False)
    rows_off, row_bytes = probe._off["rows"], 4 * width
    probe.close()

    # Each method returns (read, release); release unmaps everything, so that dropping the
    # file's pages afterwards really empties the page cache (mapped pages cannot be dropped).
    def by_shard_pos(pos):
        s = Shard.open(path, writable=False)
        return (lambda: s.read_rows(pos)), s.close

    def by_shard_key(pos):
        s = Shard.open(path, writable=False)
        k = keys[pos]
        return (lambda: s.read_rows(s.lookup(k))), s.close

    def by_memmap(pos):
        box = [np.memmap(path, np.float32, "r", rows_off, (n_rows, width))]
        return (lambda: np.array(box[0][np.sort(pos)])), box.clear

    def by_pread(pos):
        fd = os.open(path, os.O_RDONLY)

        def read():
            out = np.empty((pos.size, width), np.float32)
            view = memoryview(out).cast("B")
            for i, p in enumerate(np.sort(pos).tolist()):
                view[i * row_bytes:(i + 1) * row_bytes] = os.pread(fd, row_bytes, rows_off + p * row_bytes)
            return out
        return read, (lambda: os.close(fd))

    methods = {"shard_read_rows": by_shard_pos, "shard_lookup_and_read": by_shard_key,
               "raw_memmap": by_memmap, "raw_pread": by_pread}
    rng = np.random.default_rng(0)
    times: dict[str, dict[str, list[float]]] = {"cold": {m: [] for m in methods}, "warm": {m: [] for m in methods}}
    for r in range(repeats):
        pos = rng.choice(n_rows, size=batch, replace=False)
        names = list(methods) if r % 2 == 0 else list(methods)[::-1]  # alternate who goes first
        for name in names:  # cold: every method starts from a dropped page cache
            _drop_file_cache(path)
            read, release = methods[name](pos)
            times["cold"][name].append(_time(read))
            release()
            del read, release
        opened = {name: methods[name](pos) for name in names}
        for read, _ in opened.values():
            read()  # warm: the rows (and index blocks) are in the page cache and mapped now
        rounds: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(7):  # interleaved, so that load from other processes hits all alike
            for name in names:
                rounds[name].append(_time(opened[name][0]))
        for name in names:
            times["warm"][name].append(statistics.median(rounds[name]))
            opened[name][1]()
        del opened
    os.unlink(path)
    out = {"rows": n_rows, "batch": batch, "repeats": repeats, "file_mb": round(n_rows * row_bytes / 2**20)}
    for mode, per in times.items():
        med = {m: statistics.median(v) for m, v in per.items()}
        out[mode] = {m: round(batch / t) for m, t in med.items()}  # rows per second
    return out


# --- cache lookups -------------------------------------------------------------------


def bench_cache(n_rows: int, batch: int, repeats: int) -> dict:
    width = RowLayout(DIM).width
    cache = RowCache(width, n_rows * (4 * width + ENTRY_OVERHEAD_BYTES), CachePolicy.LFU)
    keys = _keys(n_rows, 2)
    dense = np.random.default_rng(0).standard_normal((n_rows, width)).astype(np.float32)
    for s in range(0, n_rows, 1 << 16):
        cache.lookup(keys[s:s + (1 << 16)])
        cache.insert(keys[s:s + (1 << 16)], dense[s:s + (1 << 16)], np.arange(s, min(s + (1 << 16), n_rows)), False)
    rng = np.random.default_rng(1)
    t_cache, t_gather = [], []
    for _ in range(repeats):
        idx = rng.choice(n_rows, size=batch, replace=False)
        k = keys[idx]

        def via_cache():
            ent = cache.lookup(k)
            return cache.rows[ent]

        got = via_cache()
        assert np.array_equal(got, dense[idx])
        t_cache.append(_time(via_cache))
        t_gather.append(_time(lambda: dense[idx]))
    c, g = statistics.median(t_cache), statistics.median(t_gather)
    return {"rows": n_rows, "batch": batch, "cache_rows_per_s": round(batch / c),
            "numpy_gather_rows_per_s": round(batch / g), "ratio": round(g / c, 3)}


# --- policies ------------------------------------------------------------------------


def bench_policy(n_keys: int, batches: int, batch: int, fracs: list[float]) -> list[dict]:
    p = 1.0 / np.arange(1, n_keys + 1) ** 1.1
    cdf = np.cumsum(p / p.sum())
    keys = _keys(n_keys, 3)  # keys[i] is the i-th most frequent
    width = RowLayout(DIM).width
    out = []
    for frac in fracs:
        cap = int(frac * n_keys)
        res = {"cache_frac": frac, "cache_rows": cap}
        for policy in (CachePolicy.LRU, CachePolicy.LFU):
            cache = RowCache(width, cap * (4 * width + ENTRY_OVERHEAD_BYTES), policy)
            rng = np.random.default_rng(7)
            static_hits = lookups = 0
            zeros = np.zeros((batch, width), np.float32)
            for i in range(batches):
                if i == batches // 4:  # measure after a warm-up quarter
                    cache.hits = cache.misses = 0
                    static_hits = lookups = 0
                idx = np.unique(np.minimum(np.searchsorted(cdf, rng.random(batch)), n_keys - 1))
                miss = keys[idx][cache.lookup(keys[idx]) < 0]
                cache.insert(miss, zeros[:miss.size], np.zeros(miss.size, np.int64), False)
                static_hits += int(np.count_nonzero(idx < cap))
                lookups += idx.size
            res[policy.value] = round(cache.hits / (cache.hits + cache.misses), 4)
            res["static_top_keys"] = round(static_hits / lookups, 4)
        out.append(res)
    return out


# --- exchange (2 ranks) --------------------------------------------------------------


def _window_keys(rng: np.random.Generator, samples: int) -> np.ndarray:
    """Unique keys of a window: per Criteo field, ranks drawn with P(r) ~ r^-1.1."""
    card = np.array(CRITEO_CARDINALITIES, dtype=np.float64)
    a = -0.1
    u = rng.random((samples, card.size))
    ranks = np.floor(((card ** a - 1) * u + 1) ** (1 / a)).astype(np.uint64) - np.uint64(1)
    fields = np.arange(card.size, dtype=np.uint64) << np.uint64(56)
    return np.unique(mix64(ranks ^ fields[None, :]))


def exchange_worker(args: argparse.Namespace) -> int:
    """One rank of the exchange benchmark (run under mpirun by bench_exchange)."""
    from hvctr.distributed import init_comm
    from hvctr.storage.exchange import ShardedTable
    from hvctr.storage.store import EmbeddingStore, shard_path

    comm = init_comm()
    width = RowLayout(DIM).width
    cfg = StorageConfig(dim=DIM, rows_per_rank=args.rows_per_rank, cpu_cache_bytes=args.cache_rows * (4 * width + ENTRY_OVERHEAD_BYTES))
    owner = default_bucket_owner(comm.size)
    store = EmbeddingStore(cfg, shard_path(args.workdir, comm.rank), comm.rank, comm.size, owner, create=True)
    table = ShardedTable(comm, store, owner, "cpu")
    rng = np.random.default_rng([comm.rank, 5])
    per_window = []
    for w in range(args.windows):
        keys = _window_keys(rng, args.samples)
        t_route = time.perf_counter()
        routing = table.route(keys, trusted=True)  # training: once per window, in the prefetch thread
        route_s = time.perf_counter() - t_route
        t0 = time.perf_counter()
        rows = table.pull(routing, name=f"b.pull{w}")
        pull = dict(table.last)
        rows[:, :DIM + 1] += 0.001
        table.push(routing, rows, name=f"b.push{w}")
        push = dict(table.last)
        per_window.append({"unique_keys": int(keys.size), "window_s": time.perf_counter() - t0, "route_s": route_s,
                           **{f"pull_{k}": pull[k] for k in ("exchange_s", "cache_s", "shard_s", "other_s")},
                           **{f"push_{k}": push[k] for k in ("exchange_s", "cache_s", "shard_s", "other_s")}})
    stats = store.stats()
    store.close()
    # comm: allgather of each rank's per-window timings (small JSON)
    gathered = comm.allgather_object({"windows": per_window, "hit_rate": stats["cache_hit_rate"],
                                      "shard_rows": stats["shard_rows"]}, name="b.gather")
    if comm.rank == 0:
        print("EXCHANGE " + json.dumps(gathered))
    comm.shutdown()
    return 0


def bench_exchange(workdir: str, windows: int, samples: int, cache_rows: int, rows_per_rank: int) -> dict:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_mpi_yield_when_idle="1", OMPI_MCA_btl_vader_single_copy_mechanism="none",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    cmd = ["mpirun", "-np", "2", "--bind-to", "none", sys.executable, "-m", "mpi4py", "-m", "bench.storage",
           "--exchange-worker", "--workdir", workdir, "--windows", str(windows), "--samples", str(samples),
           "--cache-rows", str(cache_rows), "--rows-per-rank", str(rows_per_rank)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"exchange benchmark failed: {out.stderr[-2000:]}")
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("EXCHANGE "))
    ranks = json.loads(line[len("EXCHANGE "):])
    skip = max(windows // 4, 1)  # the first windows create most rows: report the steady part too
    res = {"windows": windows, "samples_per_window": samples, "cache_rows": cache_rows,
           "hit_rate": [round(r["hit_rate"], 3) for r in ranks]}
    for label, sel in (("all", slice(None)), ("steady", slice(skip, None))):
        wins = [w for r in ranks for w in r["windows"][sel]]
        res[label] = {k: round(statistics.mean(w[k] for w in wins), 4) for k in wins[0]}
    return res


# --- report --------------------------------------------------------------------------


def _markdown(r: dict, argv: list[str]) -> str:
    cmd = "python -m bench.storage " + " ".join(argv)
    lines = [SECTION, "",
             f"Machine: {os.cpu_count()} cores, no GPU, {platform.machine()}, Python {platform.python_version()}; "
             f"one run, {time.strftime('%Y-%m-%d')}, load average {os.getloadavg()[0]:.1f} at its end (other "
             f"jobs share the cores). Command: `{cmd}`. Speeds are ratios of methods timed side by side, "
             "medians over the repeats.", ""]
    s = r.get("shard")
    if s:
        lines += [f"**Shard row reads** ({s['batch']} random rows of {DIM}-dim rows (208 B), sorted, from a "
                  f"{s['file_mb']} MB rows dataset of {s['rows']} rows; rows per second; cold = the file's pages "
                  "dropped (posix_fadvise DONTNEED) before each method, warm = in the page cache):", "",
                  "| method | cold rows/s | warm rows/s | cold vs raw memmap | warm vs raw memmap | warm vs raw pread |",
                  "|---|---|---|---|---|---|"]
        for m in ("shard_read_rows", "shard_lookup_and_read", "raw_memmap", "raw_pread"):
            c, w = s["cold"][m], s["warm"][m]
            lines.append(f"| {m} | {c:,} | {w:,} | {c / s['cold']['raw_memmap']:.2f}x | "
                         f"{w / s['warm']['raw_memmap']:.2f}x | {w / s['warm']['raw_pread']:.2f}x |")
        lines += ["", "shard_read_rows reads by row position (the store's read after its index lookup); "
                  "shard_lookup_and_read adds the key index probe (one more 4 KiB page per key when cold); "
                  "raw_memmap is np.memmap over the rows dataset's offset, raw_pread one os.pread per row.", ""]
    if r.get("cache"):
        lines += ["**Cache lookups** (all hits, random keys of 500,000 cached rows): hash lookup + row gather "
                  "against a plain numpy gather of the same rows from a dense in-RAM array (target >= 0.3x):", "",
                  "| keys per call | cache rows/s | numpy gather rows/s | ratio |", "|---|---|---|---|"]
        for c in r["cache"]:
            lines.append(f"| {c['batch']:,} | {c['cache_rows_per_s']:,} | {c['numpy_gather_rows_per_s']:,} | "
                         f"**{c['ratio']:.2f}x** |")
        lines.append("")
    p = r.get("policy")
    if p:
        lines += ["**Cache policies** (hit rate per unique key lookup, Zipf(1.1) over "
                  f"{r['policy_keys']:,} keys, batches of {r['policy_batch']} draws, after a warm-up quarter):", "",
                  "| cache size | LRU | LFU with aging | static hottest keys (IID optimum) |", "|---|---|---|---|"]
        for q in p:
            lines.append(f"| {q['cache_frac']:.0%} of keys | {q['lru']:.3f} | {q['lfu']:.3f} | {q['static_top_keys']:.3f} |")
        better = "LFU with aging" if all(q["lfu"] >= q["lru"] for q in p) else "neither policy"
        lines += ["", f"{better} keeps more of the hot keys at every size; the default is "
                  "`storage.cache_policy = \"lfu\"`.", ""]
    e = r.get("exchange")
    if e:
        st = e["steady"]
        lines += [f"**Working set pull + push per window, 2 ranks** ({e['samples_per_window']} samples x 26 "
                  f"Criteo-like fields per rank and window, Zipf(1.1) per field; cache {e['cache_rows']:,} rows "
                  f"per rank; hit rate per rank {e['hit_rate']}; means over windows {e['windows'] // 4}..{e['windows'] - 1}, "
                  "both ranks):", "",
                  "| | exchange s | cache s | shard s | other s |", "|---|---|---|---|---|",
                  f"| pull | {st['pull_exchange_s']:.4f} | {st['pull_cache_s']:.4f} | {st['pull_shard_s']:.4f} | {st['pull_other_s']:.4f} |",
                  f"| push | {st['push_exchange_s']:.4f} | {st['push_cache_s']:.4f} | {st['push_shard_s']:.4f} | {st['push_other_s']:.4f} |",
                  "", f"{st['unique_keys']:,.0f} unique keys per rank and window; whole window (pull + push) "
                  f"{st['window_s']:.3f} s, after routing the window's keys once ({st['route_s']:.4f} s: "
                  "owners, their order and counts, computed in the prefetch thread in training). Shard time "
                  "is index probes, row reads, new-key inserts and write-back of evicted rows (push writes "
                  "into the cache only); 'other' is the owners' deduplication, message packing and the merge "
                  "arithmetic. Exchange time includes waiting for the other rank: the 2 ranks "
                  "share 2 cores, with other jobs running. Most misses are keys seen for the first time "
                  "(Criteo-like cardinalities), so shard time here is mostly creating rows; in training the "
                  "prefetch thread's warm moves the reads of known rows out of the pull.", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.storage", description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="shard,cache,policy,exchange")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--shard-rows", type=int, default=1_000_000)
    ap.add_argument("--policy-keys", type=int, default=200_000)
    ap.add_argument("--policy-batch", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=12)
    ap.add_argument("--samples", type=int, default=4 * 4096, help="samples per window and rank (k batches)")
    ap.add_argument("--cache-rows", type=int, default=100_000, help="exchange part: cache rows per rank")
    ap.add_argument("--rows-per-rank", type=int, default=2_000_000)
    ap.add_argument("--workdir", default="")
    ap.add_argument("--write", default="", help="markdown file to update (section '## Embedding store')")
    ap.add_argument("--exchange-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.exchange_worker:
        return exchange_worker(args)
    parts = set(args.parts.split(","))
    results: dict = {"policy_keys": args.policy_keys, "policy_batch": args.policy_batch}
    with tempfile.TemporaryDirectory(prefix="hvctr-bench-", dir=args.workdir or None) as work:
        if "shard" in parts:
            results["shard"] = bench_shard(work, args.shard_rows, 4096, args.repeats)
            print(json.dumps({"shard": results["shard"]}), flush=True)
        if "cache" in parts:
            results["cache"] = [bench_cache(500_000, b, args.repeats) for b in (4096, 65536)]
            print(json.dumps({"cache": results["cache"]}), flush=True)
        if "policy" in parts:
            results["policy"] = bench_policy(args.policy_keys, 1000, args.policy_batch, [0.01, 0.05, 0.2])
            print(json.dumps({"policy": results["policy"]}), flush=True)
        if "exchange" in parts:
            results["exchange"] = bench_exchange(work, args.windows, args.samples, args.cache_rows, args.rows_per_rank)
            print(json.dumps({"exchange": results["exchange"]}), flush=True)
    if args.write:
        write_section(args.write, SECTION, _markdown(results, list(argv if argv is not None else sys.argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
