"""A table many times the memory the job may use: the same job inside a memory cgroup and without one.

    python -m bench.scale                                  # >= 16 GB of table, a limit 1/10 of it
    python -m bench.scale --rows 1000000 --limit-gib 1     # a quick look (says what it does not meet)
    python -m bench.scale --write BENCHMARKS.md

What it does, on one machine, as root:

1. checks that it can: root, a memory cgroup controller (v1 at /sys/fs/cgroup/memory, or v2), and
   the free disk the run needs (data, two runs' shards one after the other, a checkpoint, an
   export): it says what is missing and exits non-zero;
2. measures the device's random-read rate on the file system the shards live on: fio (4 KiB
   random reads, O_DIRECT, depth 1 and 32, libaio) where fio is installed, else hvctr's own pread
   pool on a file of its own with the page cache dropped;
3. makes the data with the real tools: ``data_prep synth --unique-fields U`` (U keys a row that
   no other row has: the table's size knob) and ``data_prep criteo``;
4. trains 2 ranks for 2 passes (``mpirun -np 2 ... hvctr train``) without a limit, then the same
   job with every process of it inside a memory cgroup it creates, whose limit counts page
   cache (as Slurm's ConstrainRAMSpace does); each run writes a checkpoint base after the first
   pass and a delta at the end, is resumed (timed to its first window) and exported;
5. reports samples/s of both runs and their ratio, the cache hit rate, cold rows read per second
   and the shard's read system calls per second against the device's rate, the peak of the
   cgroup's memory against its limit, the limit's hits and OOM kills, the shard bytes, and the
   times of the checkpoint base and delta, the resume and the export.

The figures are ratios measured in one run on one machine (a shared, noisy machine: absolute
times move; ratios less). Both runs start with the shard files' pages dropped from the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SECTION = "## A table larger than memory"
V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")
EXPORT_MEMORY_MIB = 512  # hvctr export --memory-mib: the sort within the cgroup beside the interpreter
BYTES_PER_KEY = 260  # shard bytes a stored key costs at D = 16: row 208, row_meta 16, index 16 / 0.8, headroom


class CannotRun(SystemExit):
    def __init__(self, why: str) -> None:
        super().__init__(f"bench.scale: cannot run: {why}")


# --- preconditions ---------------------------------------------------------------------------


def cgroup_kind() -> str:
    """"v1" or "v2", the memory controller this machine can make a group with."""
    if os.geteuid() != 0:
        raise CannotRun("it creates a memory cgroup, which needs root (run it as root, or on a machine "
                        "where you have it)")
    if (V1 / "memory.limit_in_bytes").is_file():
        return "v1"
    ctl = V2 / "cgroup.controllers"
    if ctl.is_file() and "memory" in ctl.read_text().split():
        return "v2"
    raise CannotRun(f"no memory cgroup controller: neither {V1}/memory.limit_in_bytes (v1) nor 'memory' in "
                    f"{ctl} (v2)")


def check_disk(work: Path, need: int) -> None:
    free = shutil.disk_usage(work).free
    if free < need:
        raise CannotRun(f"{work} has {free / 1e9:,.1f} GB free, the run needs about {need / 1e9:,.1f} GB "
                        f"(data, one run's shards at a time, a checkpoint, an export): point --work at a larger "
                        f"disk or lower --table-gb")


class Cgroup:
    """A memory cgroup of this benchmark's own; ``wrap(cmd)`` runs cmd inside it. ``limit`` 0:
    no limit (the unlimited run runs in one too, so that its processes' own memory is measured).
    A sampler thread records the peak of the processes' own memory (anon) every 0.2 s."""

    def __init__(self, kind: str, limit: int, tag: str) -> None:
        self.kind = kind
        name = f"hvctr-bench-scale-{os.getpid()}-{tag}"
        self.path = (V1 if kind == "v1" else V2) / name
        self.path.mkdir()
        self.anon_peak = 0
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        if not limit:
            pass
        elif kind == "v1":
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
            try:
                (self.path / "memory.swappiness").write_text("0")
            except OSError:
                pass
        else:
            (self.path / "memory.max").write_text(str(limit))
            (self.path / "memory.swap.max").write_text("0") if (self.path / "memory.swap.max").exists() else None
        self.limit = limit

    def wrap(self, cmd: list[str]) -> list[str]:
        procs = self.path / "cgroup.procs"
        return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *cmd]

    def read(self) -> dict:
        p = self.path
        if self.kind == "v1":
            oom = dict(line.split() for line in (p / "memory.oom_control").read_text().splitlines())
            return {"peak": int((p / "memory.max_usage_in_bytes").read_text()), "anon_peak": self.anon_peak,
                    "limit_hits": int((p / "memory.failcnt").read_text()), "oom_kills": int(oom.get("oom_kill", 0))}
        ev = dict(line.split() for line in (p / "memory.events").read_text().splitlines())
        peak = int((p / "memory.peak").read_text()) if (p / "memory.peak").exists() else -1
        return {"peak": peak, "anon_peak": self.anon_peak, "limit_hits": int(ev.get("max", 0)),
                "oom_kills": int(ev.get("oom_kill", 0))}

    def _sample(self) -> None:
        from hvctr import memcg

        while not self._stop.wait(0.2):
            try:
                self.anon_peak = max(self.anon_peak, memcg.read_group(str(self.path)).anon)
            except (OSError, ValueError):
                pass

    def reset_peak(self) -> None:
        self.anon_peak = 0
        if self.kind == "v1":
            (self.path / "memory.max_usage_in_bytes").write_text("0")
            (self.path / "memory.failcnt").write_text("0")

    def close(self) -> None:
        self._stop.set()
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.2)


# --- the device ------------------------------------------------------------------------------


def _pool_rate(path: Path, size: int, seconds: int, threads: int, item: int, write: bool = False,
               cached: bool = False, behind: bool = False, writers: int = 1) -> int:
    """Items of ``item`` bytes at random sorted positions of ``path`` read (``write``: written,
    as the store's write-back does: each page read, changed, written, then flushed and dropped)
    per second by hvctr's pool (storage.io_threads = ``threads``), in batches of 20k as a
    window's cold rows come, by ``writers`` callers at once (as many as the job's ranks on the
    device: the device's rate at the job's concurrency, which the planner shares among them);
    the file's pages dropped first, unless ``cached`` (the file read into the page cache first:
    what a row or index block costs that the page cache holds)."""
    import threading

    from hvctr.kernels import diskio

    fd = os.open(path, os.O_RDWR if write else os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if cached:
            with open(path, "rb", buffering=0) as f:
                while f.read(1 << 24):
                    pass
        done = [0] * writers
        errors: list[BaseException] = []
        t0 = time.perf_counter()

        def caller(i: int) -> None:  # the pool releases the GIL: the callers' batches overlap
            try:
                rng = np.random.default_rng(threads + 2 * write + cached + 4 * behind + 8 * i)
                while time.perf_counter() - t0 < seconds:
                    pos = np.unique(rng.integers(0, size // item, 20000 if threads > 1 else 2000))
                    buf = np.zeros(pos.size * item, dtype=np.uint8)
                    if write:  # behind: flushed and dropped after (storage.write_behind on)
                        diskio.write(fd, str(path), 0, item, pos, buf, threads, behind)
                    else:
                        diskio.read(fd, str(path), 0, item, pos, buf, threads)
                    done[i] += pos.size
            except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
                errors.append(e)

        callers = [threading.Thread(target=caller, args=(i,)) for i in range(writers)]
        for c in callers:
            c.start()
        for c in callers:
            c.join()
        if errors:
            raise errors[0]
        return round(sum(done) / (time.perf_counter() - t0))
    finally:
        os.close(fd)


def device_rate(work: Path, seconds: int, writers: int = 2) -> dict:
    """4 KiB random reads per second at depth 1 and 32 on ``work``'s file system (fio, else the
    pool), and what hvctr's pool reads of the same file: 4 KiB pages and 208-byte rows (D = 16);
    the rows' rates with ``writers`` callers at once (the job's 2 ranks)."""
    path = work / "device-probe.bin"
    size = 4 << 30
    with open(path, "wb") as f:
        block = np.random.default_rng(0).integers(0, 255, 1 << 24, dtype=np.uint8).tobytes()
        for _ in range(size // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    try:
        if shutil.which("fio"):
            out = {"tool": "fio (libaio, O_DIRECT, 4 KiB randread)"}
            for depth in (1, 32):
                r = subprocess.run(["fio", "--name=probe", f"--filename={path}", "--rw=randread", "--bs=4k",
                                    "--direct=1", "--ioengine=libaio", f"--iodepth={depth}", f"--runtime={seconds}",
                                    "--time_based", "--output-format=json", "--group_reporting"],
                                   capture_output=True, text=True, check=True)
                out[f"iops_depth{depth}"] = round(json.loads(r.stdout)["jobs"][0]["read"]["iops"])
            out["pool_pages_per_s"] = _pool_rate(path, size, seconds, 32, 4096)
            out.update(_pool_row_rates(path, size, seconds, writers))
            return out
        from hvctr.kernels import diskio
        out = {"tool": "hvctr's pread pool (fio not installed), 4 KiB randread, page cache dropped"}
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            rng = np.random.default_rng(1)
            for depth in (1, 32):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < seconds:
                    pos = np.unique(rng.integers(0, size // 4096, 20000 if depth > 1 else 2000))
                    buf = np.empty(pos.size * 4096, dtype=np.uint8)
                    diskio.read(fd, str(path), 0, 4096, pos, buf, depth)
                    n += pos.size
                out[f"iops_depth{depth}"] = round(n / (time.perf_counter() - t0))
        finally:
            os.close(fd)
        out.update(_pool_row_rates(path, size, seconds, writers))
        return out
    finally:
        path.unlink(missing_ok=True)


def _pool_row_rates(path: Path, size: int, seconds: int, writers: int) -> dict:
    """The pool's rates for 208-byte rows (D = 16) at random places of the probe file, the things
    a window's shard traffic is made of (``predict`` gives them to the planner), ``writers``
    callers at once: read from the device and from the page cache; written back as under a
    memory limit (storage.write_behind on: each page flushed to the device and dropped; its read
    before the write is a page-cache hit, as a written-back row's is: the pull read it in the
    same window or the one before) and as without one (written into the page cache, left to the
    kernel). Two writers got 1.25x one's write-back rate on this machine's disk (2026-12-04)."""
    return {"pool_rows_per_s": _pool_rate(path, size, seconds, 32, 208, writers=writers),
            "pool_rows_cached_per_s": _pool_rate(path, size, seconds, 32, 208, cached=True, writers=writers),
            "pool_write_rows_per_s": _pool_rate(path, size, seconds, 32, 208, write=True, cached=True, behind=True,
                                                writers=writers),
            "pool_write_rows_cached_per_s": _pool_rate(path, size, seconds, 32, 208, write=True, cached=True,
                                                       writers=writers),
            "pool_row_callers": writers}


# --- the job ---------------------------------------------------------------------------------


# /sys/dev/block/MAJ:MIN/stat (Documentation/block/stat.rst): the counters this reads
_BLOCK_FIELDS = ("reads", "read_merges", "read_sectors", "read_ms", "writes", "write_merges", "write_sectors",
                 "write_ms", "in_flight", "busy_ms", "queue_ms")


def block_stat(path: Path) -> dict | None:
    """The I/O counters of the block device that holds ``path`` (its partition's, where it is
    one), or None where the file system has none (tmpfs, overlay, NFS)."""
    st = os.stat(path)
    stat = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat")
    try:
        vals = [int(x) for x in stat.read_text().split()]
    except (OSError, ValueError):
        return None
    return dict(zip(_BLOCK_FIELDS, vals)) | {"t": time.monotonic()}


def device_use(before: dict | None, after: dict | None) -> dict:
    """What the device did between two ``block_stat``s, every process on it counted (the job's
    two ranks together, and anything else on the disk): reads a second of the span; reads a
    second of the time it was busy; reads in flight on average (the read time summed over
    requests over the span: the depth the device saw); bytes a read."""
    if not before or not after:
        return {}
    span = max(after["t"] - before["t"], 1e-9)
    d = {k: after[k] - before[k] for k in _BLOCK_FIELDS if k != "in_flight"}
    return {"seconds": round(span, 1), "reads": d["reads"], "writes": d["writes"],
            "reads_per_s": round(d["reads"] / span), "writes_per_s": round(d["writes"] / span),
            "reads_per_busy_s": round(d["reads"] / max(d["busy_ms"] / 1e3, 1e-9)),
            "busy": round(d["busy_ms"] / 1e3 / span, 3),
            "reads_in_flight": round(d["read_ms"] / 1e3 / span, 2),
            "bytes_a_read": round(512 * d["read_sectors"] / max(d["reads"], 1))}


def _env() -> dict:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_mpi_yield_when_idle="1", OMPI_MCA_btl_vader_single_copy_mechanism="none",
               OMPI_MCA_rmaps_base_oversubscribe="1", PYTHONPATH=str(REPO))
    return env


def _run(cmd: list[str], log: Path, cwd: Path) -> float:
    t0 = time.monotonic()
    with open(log, "ab") as f:
        f.write(("$ " + " ".join(cmd) + "\n").encode())
        f.flush()
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, env=_env())
    if r.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"bench.scale: {' '.join(cmd[:8])} ... failed (rc {r.returncode}); the end of {log}:\n{tail}")
    return time.monotonic() - t0


def make_data(work: Path, rows: int, unique_fields: int, log: Path) -> Path:
    data = work / "data"
    if (data / "manifest.json").is_file() and json.loads((data / "manifest.json").read_text()).get("state") == "complete":
        return data
    tsv = work / "raw.tsv"
    py = sys.executable
    _run([py, "-m", "data_prep", "synth", "--rows", str(rows), "--seed", "5", "--unique-fields", str(unique_fields),
          "--out", str(tsv)], log, work)
    _run(["mpirun", "-np", "2", "--bind-to", "none", py, "-m", "mpi4py", "-m", "data_prep", "criteo", "--input",
          str(tsv), "--out", str(data), "--shards", "4", "--valid-fraction", "0.02"], log, work)
    tsv.unlink()
    return data


def _drop_cache(paths: list[Path]) -> None:
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _job_flags(cfg: dict) -> list[str]:
    """The job's settings, as `hvctr train` and `hvctr plan` both take them."""
    return [f"--storage.cpu_cache_bytes={cfg['cache_bytes']}", "--storage.dim=16", "--model.hidden=[512,256]",
            f"--data.batch_size_per_rank={cfg['batch']}", f"--merge.every_k_steps={cfg['k']}",
            f"--storage.write_behind={cfg.get('write_behind', 'on')}"]


def _train_cmd(data: Path, run: Path, cfg: dict, extra: list[str]) -> list[str]:
    return ["mpirun", "-np", "2", "--bind-to", "none", sys.executable, "-m", "mpi4py", "-m", "hvctr", "train",
            f"--data.train_dir={data}", f"--train.run_dir={run}", f"--storage.rows_per_rank={cfg['rows_per_rank']}",
            *_job_flags(cfg), "--metrics.eval_every_windows=0", "--train.stall_timeout_s=900",
            # both runs hand their freed memory back after each window (hvctr.heap), as a job under a
            # limit does by default: the runs differ by the limit alone, and the unlimited run's own
            # memory is what the limited one needs beside its page cache
            "--storage.heap_trim=window", *extra]


def _checkpoint_times(log_text: str) -> list[tuple[str, float]]:
    return [(kind, float(s)) for kind, s in re.findall(r"checkpoint ckpt-\d+ \((base|delta)\b[^)]*\) written at step \d+ in "
                                                       r"([0-9.]+) s", log_text)]


def one_run(name: str, data: Path, work: Path, cfg: dict, cgroup: Cgroup, log: Path) -> dict:
    run = work / f"run-{name}"
    shutil.rmtree(run, ignore_errors=True)
    wrap = cgroup.wrap
    _drop_cache(list(data.glob("*.h5")))
    cgroup.reset_peak()
    steps_per_pass = cfg["steps_per_pass"]
    # pass 1, a checkpoint (the base) at its end; pass 2 to the end, a checkpoint (a delta) there
    common = [f"--checkpoint.every_windows={steps_per_pass // cfg['k']}", "--checkpoint.compact_every=1000",
              "--train.epochs=2"]
    disk0 = block_stat(work)
    t = _run(wrap(_train_cmd(data, run, cfg, common)), log, work)
    disk = device_use(disk0, block_stat(work))
    summary = json.loads((run / "summary.json").read_text())
    text = (run / "logs" / "rank-00000.log").read_text(errors="replace") if (run / "logs" / "rank-00000.log").exists() else ""
    ckpt = _checkpoint_times(text)
    shards = sorted(run.rglob("shard-r*.h5"))
    shard_bytes = sum(p.stat().st_size for p in shards)
    mem = cgroup.read()
    # resume: one more window from the newest checkpoint (the working shards rebuilt from it)
    _drop_cache(shards)
    t_resume = _run(wrap(_train_cmd(data, run, cfg, [*common, "--resume",
                                                     f"--train.max_steps={summary['steps'] + cfg['k']}"])), log, work)
    resumed = _resume_seconds((run / "logs" / "rank-00000.log").read_text(errors="replace"))
    mem_resume = cgroup.read()
    # export inside the cgroup too: its sort holds --memory-mib, whatever the table (hvctr.offline.keysort)
    t_export = _run(wrap([sys.executable, "-m", "hvctr", "export", "--run-dir", str(run), "--out",
                          str(work / f"export-{name}"), f"--memory-mib={EXPORT_MEMORY_MIB}"]),
                    log, work)
    export_bytes = sum(p.stat().st_size for p in (work / f"export-{name}").rglob("*") if p.is_file())
    mem_all = cgroup.read()
    first = None
    if name == "unlimited":  # the reference of the kill phase: the model at the first checkpoint
        m = re.search(r"checkpoint ckpt-000000 \((?:base|delta)\b[^)]*\) written at step (\d+)", text)
        if m:
            out_first = work / "export-unlimited-first"
            shutil.rmtree(out_first, ignore_errors=True)
            _run(wrap([sys.executable, "-m", "hvctr", "export", "--run-dir", str(run), "--checkpoint",
                       str(run / "checkpoints" / "ckpt-000000"), "--out", str(out_first),
                       f"--memory-mib={EXPORT_MEMORY_MIB}"]), log, work)
            first = {"step": int(m.group(1)), "digests": export_digests(out_first)}
            shutil.rmtree(out_first, ignore_errors=True)
    store = summary["store"]
    shard_s = max(summary["exchange"].get("warm_shard_s", 0) + summary["exchange"].get("pull_shard_s", 0)
                  + summary["exchange"].get("push_shard_s", 0), 1e-9)
    out = {
        "name": name, "wall_s": round(t, 1), "samples": summary["samples"], "steps": summary["steps"],
        "samples_per_s": summary["samples_per_s"], "cache_hit_rate": store["cache_hit_rate"],
        # a training step's time on rank 0: its whole time but checkpoints and the ends of passes ("io")
        "step_s": (summary["seconds"] - summary.get("time_split_s", {}).get("io", 0.0)) / max(summary["steps"], 1),
        "rows_read": store["shard_bytes_read"] // cfg["row_bytes"], "read_calls": store.get("shard_io_read_calls", 0),
        "rows_written": int(store.get("writeback_rows", 0) + store.get("writethrough_rows", 0)),
        "index_blocks_read": store.get("shard_index_blocks_read", 0), "shard_s": round(store["shard_s"], 2),
        "exchange_shard_s": round(shard_s, 2), "shard_bytes": shard_bytes, "checkpoints": ckpt,
        "resume_s": resumed, "resume_wall_s": round(t_resume, 1), "export_s": round(t_export, 1),
        "export_bytes": export_bytes, "time_split_s": summary.get("time_split_s", {}),
        # rank 0's shard traffic by cause (rows, index blocks, pool calls, bytes, seconds)
        "shard_traffic": summary.get("shard_traffic", {}),
        "memory": mem, "memory_resume": mem_resume, "memory_all": mem_all, "first_checkpoint": first,
        "device_use": disk,  # the block device under the work directory, during training (both ranks)
    }
    shutil.rmtree(work / f"export-{name}", ignore_errors=True)
    shutil.rmtree(run, ignore_errors=True)
    return out


def export_digests(out: Path) -> dict[str, str]:
    """sha256 of every model file of an export (its manifest names the run: left out)."""
    import hashlib

    digests = {}
    for f in sorted(out.rglob("*")):
        if f.is_file() and f.name != "manifest.json":
            h = hashlib.sha256()
            with open(f, "rb") as fp:
                while chunk := fp.read(1 << 24):
                    h.update(chunk)
            digests[str(f.relative_to(out))] = h.hexdigest()
    if not digests:
        raise SystemExit(f"bench.scale: the export {out} holds no model files")
    return digests


def _rank_pid(cgroup: "Cgroup", rank: int) -> int | None:
    """The pid of training rank ``rank`` among the cgroup's processes (OMPI_COMM_WORLD_RANK)."""
    for line in (cgroup.path / "cgroup.procs").read_text().split():
        try:
            env = Path(f"/proc/{line}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{line}/cmdline").read_bytes()
        except OSError:
            continue
        if b"hvctr" in cmd and f"OMPI_COMM_WORLD_RANK={rank}".encode() in env:
            return int(line)
    return None


def kill_during_checkpoint(data: Path, work: Path, cfg: dict, cgroup: "Cgroup", log: Path, first: dict) -> dict:
    """Issue 26 item 4, inside the memory cgroup: the job of the unlimited run up to its first
    checkpoint's step S, with a checkpoint every quarter of it (a base, then deltas: bases of the
    whole table at every quarter would not fit this machine's disk beside the shards); rank 1
    SIGKILLed while it writes checkpoint 1 (a delta of a quarter of the table's rows; its rank file
    still a temporary file); resumed (from checkpoint 0, the partial one set aside) to step S;
    exported. Its model files must equal, sha256 for sha256,
    the export of the unlimited run's checkpoint at S."""
    import signal

    run = work / "run-killed"
    shutil.rmtree(run, ignore_errors=True)
    S = first["step"]
    every = max(S // cfg["k"] // 4, 1)
    flags = [f"--checkpoint.every_windows={every}", "--checkpoint.compact_every=1000", "--train.epochs=2",
             f"--train.max_steps={S}"]
    cmd = cgroup.wrap(_train_cmd(data, run, cfg, flags))
    target = run / "checkpoints" / "ckpt-000001"
    killed_at = None
    t0 = time.monotonic()
    with open(log, "ab") as f:
        f.write(("$ " + " ".join(cmd) + "   # rank 1 to be SIGKILLed inside checkpoint 1\n").encode())
        f.flush()
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=work, env=_env())
        while p.poll() is None and killed_at is None:
            if (target / "manifest.json").exists():
                break  # written before a look found its temporary file: reported below
            if any(target.glob("rank-00001.h5.*.tmp")):
                pid = _rank_pid(cgroup, 1)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed_at = time.monotonic() - t0
            time.sleep(0.05)
        rc = p.wait(timeout=900)
    partial = not (target / "manifest.json").exists()
    tmp_bytes = sum(f.stat().st_size for f in target.glob("rank-*.h5*")) if target.is_dir() else 0
    out = {"partial_bytes": tmp_bytes, "step": S, "every_windows": every, "killed_after_s": killed_at, "job_rc": rc,
           "checkpoint_left_partial": partial}
    if killed_at is None or not partial:
        out["ok"] = False
        out["why"] = "checkpoint 1 was complete before the kill reached rank 1" if killed_at else "no kill"
        return out
    t_resume = _run(cgroup.wrap(_train_cmd(data, run, cfg, [*flags, "--resume"])), log, work)
    text = (run / "logs" / "rank-00000.log").read_text(errors="replace")
    m = re.findall(r"resumed from checkpoint (\d+) ", text)
    export = work / "export-killed"
    shutil.rmtree(export, ignore_errors=True)
    _run(cgroup.wrap([sys.executable, "-m", "hvctr", "export", "--run-dir", str(run), "--out", str(export),
                      f"--memory-mib={EXPORT_MEMORY_MIB}"]), log, work)
    digests = export_digests(export)
    out.update({"resumed_from": int(m[-1]) if m else None, "resume_wall_s": round(t_resume, 1),
                "set_aside": (run / "checkpoints" / "rejected" / "ckpt-000001").is_dir(),
                "files": len(digests), "export_equal": digests == first["digests"],
                "differing": sorted(k for k in digests.keys() | first["digests"].keys()
                                    if digests.get(k) != first["digests"].get(k))})
    out["ok"] = bool(out["export_equal"] and out["resumed_from"] == 0)
    shutil.rmtree(export, ignore_errors=True)
    shutil.rmtree(run, ignore_errors=True)
    return out


def predict(data: Path, cfg: dict, dev: dict, memory: int, work: Path) -> dict:
    """`hvctr plan`'s figures for this job on this machine (slurm/hwmaps/vm-2cpu.toml, the rates
    `hvctr bench --calibrate` wrote to hvctr/plan/rates.toml) with the shard's rates measured
    here on the file system of the shards (the pool's random 208-byte rows: read from the device
    as ``disk_rows_per_s``, from the page cache as ``shard_rows_per_s``, written back behind as
    ``disk_write_rows_per_s``, into the page cache as ``shard_write_rows_per_s``); ``memory``:
    what the job may use (the cgroup's limit; 0: the machine's). The job runs two passes, one
    over fresh keys and one over known keys: both are planned, and ``figures["step_s"]`` is
    their mean (each pass has as many steps)."""
    import dataclasses

    from hvctr.plan.cmd import DEFAULT_RATES
    from hvctr.plan.rates import load_rates, write_rates

    rf = load_rates(DEFAULT_RATES)
    measured = {"disk_rows_per_s": float(dev.get("pool_rows_per_s") or dev["iops_depth32"])}
    for key, name in (("pool_rows_cached_per_s", "shard_rows_per_s"), ("pool_write_rows_per_s", "disk_write_rows_per_s"),
                      ("pool_write_rows_cached_per_s", "shard_write_rows_per_s")):
        if dev.get(key):
            measured[name] = float(dev[key])
    rates = dataclasses.replace(rf, entries=tuple(dataclasses.replace(e, **measured) for e in rf.entries))
    path = work / "rates-measured.toml"
    write_rates(rates, path, [f"bench.scale: {DEFAULT_RATES} with " + ", ".join(f"{k} = {v:,.0f}" for k, v in measured.items())
                              + f" measured on the file system of {work} ({dev['tool']})"])
    passes = []
    for pass_rows in ("", "0"):  # the first pass (new keys, from the data), the second (every key known)
        cmd = [sys.executable, "-m", "hvctr", "plan", "--map", str(REPO / "slurm/hwmaps/vm-2cpu.toml"),
               "--ranks-per-node", "2", "--threads-per-rank", "1", "--data", str(data), "--rates", str(path), "--json",
               *(["--pass-rows", pass_rows] if pass_rows else []), "--train.epochs=2",
               *(["--memory-bytes", str(memory)] if memory else []), *_job_flags(cfg)]
        r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=work)
        if r.returncode != 0:
            raise SystemExit(f"bench.scale: {' '.join(cmd[:4])} ... failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
        passes.append(json.loads(r.stdout))
    out = passes[1]  # the second pass's fits and notes: the SSD-bound one
    out["passes"] = [p["figures"] for p in passes]
    f = dict(out["figures"])
    for key in ("step_s", "shard_read_s_per_step", "shard_write_s_per_step", "compute_s_per_step", "pull_s_per_step",
                "merge_s_per_step", "prep_s_per_step"):
        f[key] = sum(p["figures"][key] for p in passes) / 2
    out["figures"] = f
    out["disk_rows_per_s"] = measured["disk_rows_per_s"]
    out["rates"] = measured
    return out


def _resume_seconds(text: str) -> float | None:
    m = re.findall(r"resumed from checkpoint \d+ at step \d+ [^\n]*?in ([0-9.]+) s", text)
    return float(m[-1]) if m else None


# --- the report ------------------------------------------------------------------------------


def report(res: dict) -> str:
    a, b, dev = res["unlimited"], res["limited"], res["device"]
    cfg = res["config"]

    def gb(n: float) -> str:
        return f"{n / 1e9:,.2f} GB"

    def per_s(r: dict, key: str) -> float:
        return r[key] / max(r["shard_s"], 1e-9)

    def cold(r: dict) -> tuple[float, float, float]:
        """Pool read calls, cold rows and reads (rows + index blocks) a second inside the warm's and
        the pull's shard calls: the window's cold reads, apart from write-back, checkpoints and
        flushes. The rows a second are issue 26's measure (cold rows read against the device's best
        random-read rate); calls fall as rows share pages and reads coalesce."""
        t = r.get("shard_traffic", {})
        secs = max(sum(t.get(c, {}).get("seconds", 0.0) for c in ("warm", "pull")), 1e-9)
        calls = sum(t.get(c, {}).get("read_calls", 0) for c in ("warm", "pull"))
        rows = sum(t.get(c, {}).get("rows_read", 0) for c in ("warm", "pull"))
        blocks = sum(t.get(c, {}).get("index_blocks_read", 0) for c in ("warm", "pull"))
        return calls / secs, rows / secs, (rows + blocks) / secs

    best = dev["iops_depth32"]
    lines = [
        f"Data: {cfg['rows']:,} rows of `data_prep synth --unique-fields {cfg['unique_fields']}` ({res['keys']:,} "
        f"distinct keys), 2 ranks, 2 passes, batch {cfg['batch']} a rank, k = {cfg['k']}, DNN 26 x 16 -> 512-256-1, "
        f"storage.write_behind = {cfg.get('write_behind', 'on')} in both runs, "
        f"storage.cpu_cache_bytes = {cfg['cache_bytes']:,} a rank, storage.rows_per_rank = {cfg['rows_per_rank']:,}; "
        f"shards {gb(b['shard_bytes'])} on disk; memory limit {cfg['limit'] / 2**30:,.2f} GiB "
        f"({cfg['kind']}, page cache counted): the table is {b['shard_bytes'] / cfg['limit']:.1f}x the limit.",
        f"Device ({dev['tool']}): {dev['iops_depth1']:,} reads/s at depth 1, {best:,} at depth 32."
        + (f" hvctr's pool (32 threads, pages dropped) on the same file: {dev['pool_pages_per_s']:,} random 4 KiB "
           f"pages/s (**{dev['pool_pages_per_s'] / best:.2f}x** fio) and {dev['pool_rows_per_s']:,} random 208-byte "
           f"rows/s ({dev['pool_rows_per_s'] / best:.2f}x; {dev.get('pool_row_callers', 1)} caller(s) at once, as the "
           f"rows' rates the planner takes)." if "pool_pages_per_s" in dev else ""),
        "",
        "| | no limit | in the cgroup | limited / unlimited |",
        "|---|---|---|---|",
        f"| samples/s (whole run) | {a['samples_per_s']:,.0f} | {b['samples_per_s']:,.0f} | "
        f"**{b['samples_per_s'] / a['samples_per_s']:.2f}x** |",
        f"| cache hit rate | {a['cache_hit_rate']:.3f} | {b['cache_hit_rate']:.3f} | |",
        f"| rows read from the shard (rank 0) | {a['rows_read']:,} | {b['rows_read']:,} | |",
        f"| shard read calls/s inside shard time (rank 0) | {per_s(a, 'read_calls'):,.0f} | {per_s(b, 'read_calls'):,.0f} | "
        f"device best {best:,}: **{per_s(b, 'read_calls') / best:.2f}x** |",
        f"| cold reads: rows read /s inside the warm's and the pull's shard calls (rank 0) | "
        f"{cold(a)[1]:,.0f} | {cold(b)[1]:,.0f} | device best {best:,}: **{cold(b)[1] / best:.2f}x** |",
        f"| pool read calls/s inside those calls (rank 0; rows sharing pages share a call) | "
        f"{cold(a)[0]:,.0f} | {cold(b)[0]:,.0f} | {cold(b)[0] / best:.2f}x |",
        f"| cold rows + index blocks read /s inside those calls (rank 0) | "
        f"{cold(a)[2]:,.0f} | {cold(b)[2]:,.0f} | |",
        f"| cold rows + index blocks read /s inside all shard time (rank 0) | "
        f"{(a['rows_read'] + a['index_blocks_read']) / max(a['shard_s'], 1e-9):,.0f} | "
        f"{(b['rows_read'] + b['index_blocks_read']) / max(b['shard_s'], 1e-9):,.0f} | |",
    ]
    ua, ub = a.get("device_use") or {}, b.get("device_use") or {}
    if ua and ub:  # runs before 2026-12-04 did not count the device
        lines += [
            f"| the device during training (both ranks): reads/s; reads/s of its busy time ({ua['busy']:.0%} / "
            f"{ub['busy']:.0%} busy) | {ua['reads_per_s']:,} ; {ua['reads_per_busy_s']:,} | "
            f"{ub['reads_per_s']:,} ; {ub['reads_per_busy_s']:,} | device best {best:,}: "
            f"**{ub['reads_per_busy_s'] / best:.2f}x** of its busy time |",
            f"| the device: reads in flight on average (the depth it saw); bytes a read; writes/s | "
            f"{ua['reads_in_flight']:.1f} ; {ua['bytes_a_read']:,} ; {ua['writes_per_s']:,} | "
            f"{ub['reads_in_flight']:.1f} ; {ub['bytes_a_read']:,} ; {ub['writes_per_s']:,} | |",
        ]
    lines += [
        f"| peak memory of the cgroup, page cache counted (training / with resume and export) | "
        f"{a['memory'].get('peak', 0) / 2**30:,.2f} / {a['memory_all'].get('peak', 0) / 2**30:,.2f} GiB | "
        f"{b['memory'].get('peak', 0) / 2**30:,.2f} / {b['memory_all'].get('peak', 0) / 2**30:,.2f} GiB | "
        f"limit {cfg['limit'] / 2**30:,.2f} GiB |",
        f"| peak of the processes' own memory (anon, sampled every 0.2 s) | {a['memory_all'].get('anon_peak', 0) / 2**30:,.2f} GiB "
        f"| {b['memory_all'].get('anon_peak', 0) / 2**30:,.2f} GiB | |",
        f"| limit reached / OOM kills | - / {a['memory_all'].get('oom_kills', 0)} | "
        f"{b['memory_all'].get('limit_hits', 0):,} / {b['memory_all'].get('oom_kills', 0)} | |",
    ]
    for kind in ("base", "delta"):
        ta = [s for k, s in a["checkpoints"] if k == kind]
        tb = [s for k, s in b["checkpoints"] if k == kind]
        if ta and tb:
            lines.append(f"| checkpoint {kind} (the last) | {ta[-1]:.1f} s | {tb[-1]:.1f} s | {tb[-1] / max(ta[-1], 1e-9):.2f}x |")
    pa, pb = res.get("plan_unlimited"), res.get("plan_limited")
    if pa and pb:
        fa, fb = pa["figures"], pb["figures"]
        err = lambda r, f: f"{f['step_s'] / r['step_s'] - 1:+.0%}"
        lines += [
            f"| a step, measured (rank 0, checkpoints and ends of passes left out) | {1e3 * a['step_s']:,.1f} ms | "
            f"{1e3 * b['step_s']:,.1f} ms | {b['step_s'] / a['step_s']:.2f}x |",
            f"| a step, `hvctr plan` (error; bound by) | {1e3 * fa['step_s']:,.1f} ms ({err(a, fa)}; {fa['bound_by']}) | "
            f"{1e3 * fb['step_s']:,.1f} ms ({err(b, fb)}; {fb['bound_by']}) | |",
            f"| of which the shard's reads, planned (a step) | {1e3 * fa['shard_read_s_per_step']:,.1f} ms | "
            f"{1e3 * fb['shard_read_s_per_step']:,.1f} ms | |",
            f"| of which the shard's write-back and the push's lookups, planned (a step) | "
            f"{1e3 * fa['shard_write_s_per_step']:,.1f} ms | {1e3 * fb['shard_write_s_per_step']:,.1f} ms | |",
            f"| the planner's shard reads from | {fa.get('shard_reads_from', '?')} | {fb.get('shard_reads_from', '?')} | |",
            f"| cache hit rate, planned | {fa['cache_hit_rate']:.3f} | {fb['cache_hit_rate']:.3f} | |",
        ]
    lines += [
        f"| resume (start to the first window) | {a['resume_s'] or a['resume_wall_s']} s | {b['resume_s'] or b['resume_wall_s']} s | |",
        f"| export | {a['export_s']} s | {b['export_s']} s | |",
        "",
        f"Targets: limited >= 0.7x unlimited; cold reads (rows read a second inside the warm's and the pull's "
        f"calls) >= 0.8x the device's best random-read rate; peak within the limit. "
        f"Met: {b['samples_per_s'] / a['samples_per_s'] >= 0.7}, "
        f"{cold(b)[1] / best >= 0.8}, {b['memory_all'].get('peak', 0) <= cfg['limit']}"
        + (f"; the planner's step within 25% in the cgroup: {abs(pb['figures']['step_s'] / b['step_s'] - 1) <= 0.25}."
           if pa and pb else "."),
    ]
    if pb and "passes" in pb:
        lines += ["", "The shard's traffic of rank 0 over both passes (the run summary's `shard_traffic`), against the "
                      "planner's counts (`shard_*_per_window` of each pass, times its windows):", "",
                  "| rank 0, both passes | measured, no limit | measured, in the cgroup | planned |", "|---|---|---|---|"]
        windows = b["steps"] / cfg["k"] / 2  # a pass's windows
        planned = {n: windows * sum(p.get(f"shard_{n}_per_window", 0.0) for p in pb["passes"])
                   for n in ("rows_read", "index_blocks_read", "rows_written", "new_rows_written", "push_index_blocks")}

        def got(r: dict, causes: tuple[str, ...], key: str) -> int:
            return int(sum(r.get("shard_traffic", {}).get(c, {}).get(key, 0) for c in causes))

        for label, causes, key, plan_key in (
                ("rows read by the warm and the pull", ("warm", "pull"), "rows_read", ("rows_read",)),
                ("their index blocks", ("warm", "pull"), "index_blocks_read", ("index_blocks_read",)),
                ("the push's index blocks", ("push",), "index_blocks_read", ("push_index_blocks",)),
                ("rows written back (evicted or written through)", (), "rows_written",
                 ("rows_written", "new_rows_written"))):
            cell = lambda r: f"{got(r, causes, key):,}" if causes else (f"{r['rows_written']:,}" if "rows_written" in r else "-")
            lines.append(f"| {label} | {cell(a)} | {cell(b)} | {sum(planned[k] for k in plan_key):,.0f} |")
        lines.append("| seconds inside those calls: warm and pull / write-back / push | "
                     + " | ".join(f"{got(r, ('warm', 'pull'), 'seconds'):,} / {got(r, ('writeback',), 'seconds'):,} / "
                                  f"{got(r, ('push',), 'seconds'):,}" for r in (a, b)) + " | |")
    kd = res.get("killed")
    if kd:
        lines += ["", f"A kill inside a checkpoint (in the cgroup): the job to step {kd['step']:,} with a checkpoint "
                      f"every {kd['every_windows']:,} windows (a base, then deltas); rank 1 SIGKILLed "
                      + (f"{kd['killed_after_s']:,.0f} s in, while its file of checkpoint 1 was still a temporary "
                         f"file ({kd['partial_bytes'] / 1e9:,.2f} GB of rank files on disk; the job ended with rc {kd['job_rc']})"
                         if kd.get("killed_after_s") else "(missed)")
                      + (f"; resumed from checkpoint {kd.get('resumed_from')} in {kd.get('resume_wall_s')} s "
                         f"(checkpoint 1 set aside: {kd.get('set_aside')}); its export against the unlimited run's "
                         f"checkpoint at step {kd['step']:,}: {kd.get('files')} model files, "
                         + ("sha256-equal" if kd.get("export_equal") else f"DIFFERENT: {kd.get('differing')}")
                         if "export_equal" in kd else f": {kd.get('why')}") + "."]
    if pb:
        lines += ["", f"The plan in the cgroup (`hvctr plan --memory-bytes {cfg['limit']}`, disk_rows_per_s "
                      f"{pb['disk_rows_per_s']:,.0f} as measured here) says:"]
        lines += [f"- {f['where']}: {f['status']}: {f['why']}" for f in pb["fits"]]
        lines += [f"- {n}" for n in pb["notes"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.splitlines()[0])
    p.add_argument("--table-gb", type=float, default=16.0, help="shard bytes on disk to reach (default 16)")
    p.add_argument("--limit-gib", type=float, default=0.0,
                   help="the cgroup's memory limit (default: a tenth of the table, at least 1.5 GiB)")
    p.add_argument("--unique-fields", type=int, default=8, help="keys a row that no other row has (default 8)")
    p.add_argument("--rows", type=int, default=0, help="rows of data (default: enough keys for --table-gb)")
    p.add_argument("--cache-mib", type=int, default=128, help="storage.cpu_cache_bytes a rank, MiB (default 128)")
    p.add_argument("--batch", type=int, default=4096, help="data.batch_size_per_rank (default 4096)")
    p.add_argument("--k", type=int, default=8, help="merge.every_k_steps (default 8): a smaller window holds less")
    p.add_argument("--write-behind", choices=("on", "auto"), default="on",
                   help="storage.write_behind of both runs: on (default: both flush and drop their writes, so that "
                        "they differ by the limit alone) or auto (each as a user's job would: the unlimited run leaves "
                        "its writes in the page cache)")
    p.add_argument("--work", default="", help="work directory (default: a new one under /var/tmp)")
    p.add_argument("--fio-seconds", type=int, default=15)
    p.add_argument("--device-only", action="store_true", help="measure the device and the pool, then stop")
    p.add_argument("--limited-only", action="store_true",
                   help="run only the job inside the cgroup (its figures as JSON; the unlimited run from an earlier one)")
    p.add_argument("--no-kill", dest="kill", action="store_false",
                   help="leave out the third job (rank 1 SIGKILLed inside a checkpoint, resumed, export compared)")
    p.add_argument("--replan", default="",
                   help="no runs: read an earlier run's JSON (--out), plan both jobs again with today's planner "
                        "and print the report (its data directory must still be there)")
    p.add_argument("--reprobe", action="store_true", help="with --replan: measure the device again first")
    p.add_argument("--out", default="", help="also write the results as JSON here")
    p.add_argument("--write", default="", help="put the report into this Markdown file (BENCHMARKS.md)")
    args = p.parse_args(argv)
    if args.replan:
        return replan(Path(args.replan), args, argv)
    kind = cgroup_kind()
    rows = args.rows or int(args.table_gb * 1e9 / BYTES_PER_KEY / args.unique_fields)
    keys_est = rows * args.unique_fields
    rows_per_rank = int(keys_est / 2 * 1.15) + 1_000_000
    from hvctr.formats import RowLayout
    row_bytes = RowLayout(16).row_bytes
    from hvctr.plan.model import shard_bytes
    table = 2 * shard_bytes(rows_per_rank, 16, 0.8)["total"]
    limit = int(args.limit_gib * 2**30) if args.limit_gib else max(int(table / 10), int(1.5 * 2**30))
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="hvctr-scale-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    # data (TSV, then shards), one run's shards at a time, a checkpoint base and a delta of every
    # row (keys, rows, last_seen), an export (key, w, w1) and its sort's temporary file (key, w, w1
    # of a rank's base and delta copies: one rank at a time), a resume's rebuilt shards beside them
    ckpt = keys_est * (8 + row_bytes + 4)
    need = rows * 700 + 2 * table + 2 * ckpt + keys_est * 80 + keys_est * 76
    check_disk(work, int(need) if not args.device_only else 5 << 30)
    log = work / "bench-scale.log"
    print(f"bench.scale: {rows:,} rows x {args.unique_fields} unique fields, table {table / 1e9:,.1f} GB, limit "
          f"{limit / 2**30:,.2f} GiB ({table / limit:.1f}x), work {work}; log {log}", flush=True)
    dev = device_rate(work, args.fio_seconds)
    print(f"bench.scale: device {dev}", flush=True)
    if args.device_only:
        return 0
    data = make_data(work, rows, args.unique_fields, log)
    manifest = json.loads((data / "manifest.json").read_text())
    train_rows = sum(s["rows"] for s in manifest["shards"]["train"])
    cfg = {"rows": rows, "unique_fields": args.unique_fields, "cache_bytes": args.cache_mib << 20,
           "rows_per_rank": rows_per_rank, "limit": limit, "kind": kind, "row_bytes": row_bytes,
           "batch": args.batch, "k": args.k, "steps_per_pass": train_rows // 2 // args.batch,
           "write_behind": args.write_behind}
    res = {"config": cfg, "device": dev, "keys": int(manifest["totals"].get("distinct_keys_estimate_total", keys_est))}
    if args.limited_only:
        group = Cgroup(kind, limit, "limited")
        try:
            res["limited"] = one_run("limited", data, work, cfg, group, log)
        finally:
            group.close()
        print(json.dumps(res["limited"], indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))
        return 0
    free = Cgroup(kind, 0, "unlimited")
    try:
        res["unlimited"] = one_run("unlimited", data, work, cfg, free, log)
    finally:
        free.close()
    res["plan_unlimited"] = predict(data, cfg, dev, 0, work)
    anon = res["unlimited"]["memory"]["anon_peak"]  # training's; resume's and export's are reported apart
    print(f"bench.scale: unlimited {res['unlimited']['samples_per_s']:,.0f} samples/s; the job's own memory "
          f"peaked at {anon / 2**30:,.2f} GiB", flush=True)
    if anon * 1.15 > limit:
        print(f"bench.scale: the limit {limit / 2**30:,.2f} GiB does not hold the job's own memory "
              f"({anon / 2**30:,.2f} GiB) with room for a working page cache: the limited run would be "
              f"OOM-killed for its processes, not for the table; raising the limit to "
              f"{anon * 1.3 / 2**30:,.2f} GiB (the table is then {table / (anon * 1.3):.1f}x it)", flush=True)
        limit = int(anon * 1.3)
        cfg["limit"] = limit
    group = Cgroup(kind, limit, "limited")
    try:
        res["limited"] = one_run("limited", data, work, cfg, group, log)
    finally:
        group.close()
    print(f"bench.scale: limited {res['limited']['samples_per_s']:,.0f} samples/s", flush=True)
    first = res["unlimited"].get("first_checkpoint")
    if args.kill and first:
        group = Cgroup(kind, limit, "killed")
        try:
            res["killed"] = kill_during_checkpoint(data, work, cfg, group, log, first)
            res["killed"]["memory"] = group.read()
        finally:
            group.close()
        print(f"bench.scale: kill during a checkpoint: {res['killed']}", flush=True)
    res["plan_limited"] = predict(data, cfg, dev, limit, work)
    res["work"] = str(work)
    _finish(res, args, argv)
    return 0


def _finish(res: dict, args: argparse.Namespace, argv: list[str] | None) -> None:
    text = report(res)
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    if args.write:
        from bench.report import write_section
        cmd = "python -m bench.scale " + " ".join(argv if argv is not None else sys.argv[1:])
        write_section(args.write, SECTION, f"{SECTION}\n\n`{cmd}`\n\n{text}\n")


def replan(path: Path, args: argparse.Namespace, argv: list[str] | None) -> int:
    """The report of an earlier run with both plans made again by the planner as it is now."""
    try:
        res = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"bench.scale: --replan {path}: cannot read it: {e}")
    missing = [k for k in ("config", "device", "unlimited", "limited") if k not in res]
    if missing:
        raise SystemExit(f"bench.scale: --replan {path}: not a complete run's results (no {', '.join(missing)})")
    work = Path(res.get("work") or path.parent)
    data = work / "data"
    if not (data / "manifest.json").is_file():
        raise SystemExit(f"bench.scale: --replan {path}: its data {data} is gone (the planner reads its manifest)")
    if not res["device"].get("pool_write_rows_per_s") or args.reprobe:  # an earlier probe: the write rates too
        print("bench.scale: --replan: the run's device probe has no write rates; measuring the device now", flush=True)
        res["device"] = {**device_rate(work, args.fio_seconds), "measured_at_replan": True}
    res["plan_unlimited"] = predict(data, res["config"], res["device"], 0, work)
    res["plan_limited"] = predict(data, res["config"], res["device"], res["config"]["limit"], work)
    _finish(res, args, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
