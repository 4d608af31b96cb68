"""The memory a job may use: the memory cgroup this process runs in (v1 or v2).

A Slurm job under ``ConstrainRAMSpace`` (and any container) runs inside a memory cgroup whose
limit counts the page cache as well as the processes' own memory: a shard file read through
the page cache fills the group like an allocation would. When the group is full the kernel
reclaims clean page cache (cheap) and waits for dirty pages to be written back (v1 does not
throttle a group's dirty pages, so that wait can stall a job for minutes) before it kills a
process. This module reads where the group stands, for the checks before training
(hvctr.train.preflight), for the message of a stalled collective (hvctr.distributed.watchdog) and
for the benchmarks (bench.scale).

    m = current()              # None: no memory cgroup with a limit
    m.limit, m.usage, m.page_cache, m.anon, m.peak, m.limit_hits
    describe(m)                # one line a person can read
"""

from __future__ import annotations

import os
from dataclasses import dataclass

V1_ROOT = "/sys/fs/cgroup/memory"
V2_ROOT = "/sys/fs/cgroup"
_V1_UNLIMITED = 1 << 62  # v1 writes "no limit" as a number near 2^63


@dataclass(frozen=True)
class MemoryCgroup:
    path: str  # the group's directory
    version: int  # 1 or 2
    limit: int | None  # bytes; None: no limit
    usage: int  # bytes charged now, page cache included
    page_cache: int  # of which file pages (reclaimable when clean)
    dirty: int  # of which dirty file pages (must be written back before reclaim)
    anon: int  # the processes' own memory
    peak: int  # the most charged at once (0 where the kernel does not say)
    limit_hits: int  # times the group reached its limit (v1 failcnt, v2 memory.events max)

    @property
    def available(self) -> int | None:
        """What a new allocation can still take: the limit less what cannot be reclaimed."""
        if self.limit is None:
            return None
        return max(self.limit - (self.usage - max(self.page_cache - self.dirty, 0)), 0)


def _read_int(path: str) -> int | None:
    try:
        text = open(path).read().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: str) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in open(path):
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():
                out[parts[0]] = int(parts[1])
    except OSError:
        pass
    return out


def group_dir(proc_cgroup: str = "/proc/self/cgroup", v1_root: str = V1_ROOT,
              v2_root: str = V2_ROOT) -> tuple[str, int] | None:
    """(directory, version) of this process's memory cgroup, None where there is none."""
    try:
        lines = open(proc_cgroup).read().splitlines()
    except OSError:
        return None
    for line in lines:  # v1: "4:memory:/slurm/uid_0/job_12" (controllers may be joined by commas)
        parts = line.split(":", 2)
        if len(parts) == 3 and "memory" in parts[1].split(","):
            path = os.path.join(v1_root, parts[2].lstrip("/"))
            if os.path.isfile(os.path.join(path, "memory.limit_in_bytes")):
                return path, 1
    for line in lines:  # v2: "0::/system.slice/job_12"
        if line.startswith("0::"):
            path = os.path.join(v2_root, line[3:].strip().lstrip("/"))
            if os.path.isfile(os.path.join(path, "memory.max")) or os.path.isfile(os.path.join(path, "memory.current")):
                return path, 2
    return None


def _v2_limit(path: str) -> int | None:
    """The lowest memory.max of the group and its ancestors (an ancestor's limit binds too)."""
    limit = None
    here = os.path.abspath(path)
    while os.path.isfile(os.path.join(here, "memory.max")):
        own = _read_int(os.path.join(here, "memory.max"))
        if own is not None and (limit is None or own < limit):
            limit = own
        up = os.path.dirname(here)
        if up == here:
            break
        here = up
    return limit


def read_group(path: str, version: int | None = None) -> MemoryCgroup:
    """Where the memory cgroup at ``path`` stands (version: found from its files when None)."""
    if version is None:
        version = 1 if os.path.isfile(os.path.join(path, "memory.limit_in_bytes")) else 2
    if version == 1:
        limit = _read_int(os.path.join(path, "memory.limit_in_bytes"))
        st = _stat(os.path.join(path, "memory.stat"))
        # an ancestor's limit binds too (Slurm limits the job's group, its tasks live below it)
        inherited = st.get("hierarchical_memory_limit")
        if inherited is not None and (limit is None or inherited < limit):
            limit = inherited
        if limit is not None and limit >= _V1_UNLIMITED:
            limit = None
        return MemoryCgroup(path=path, version=1, limit=limit,
                            usage=_read_int(os.path.join(path, "memory.usage_in_bytes")) or 0,
                            page_cache=st.get("total_cache", st.get("cache", 0)),
                            dirty=st.get("total_dirty", st.get("dirty", 0)),
                            anon=st.get("total_rss", st.get("rss", 0)),
                            peak=_read_int(os.path.join(path, "memory.max_usage_in_bytes")) or 0,
                            limit_hits=_read_int(os.path.join(path, "memory.failcnt")) or 0)
    st = _stat(os.path.join(path, "memory.stat"))
    events = _stat(os.path.join(path, "memory.events"))
    return MemoryCgroup(path=path, version=2, limit=_v2_limit(path),
                        usage=_read_int(os.path.join(path, "memory.current")) or 0,
                        page_cache=st.get("file", 0), dirty=st.get("file_dirty", 0), anon=st.get("anon", 0),
                        peak=_read_int(os.path.join(path, "memory.peak")) or 0,
                        limit_hits=events.get("max", 0))


def current(proc_cgroup: str = "/proc/self/cgroup", v1_root: str = V1_ROOT,
            v2_root: str = V2_ROOT) -> MemoryCgroup | None:
    """This process's memory cgroup where it has a limit, else None."""
    found = group_dir(proc_cgroup, v1_root, v2_root)
    if found is None:
        return None
    m = read_group(*found)
    return m if m.limit is not None else None


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def describe(m: MemoryCgroup) -> str:
    """One line: how full the group is and with what."""
    limit = "no limit" if m.limit is None else f"limit {_gib(m.limit)}"
    line = (f"memory cgroup {m.path} (v{m.version}): {_gib(m.usage)} charged of its {limit} "
            f"({_gib(m.anon)} process memory, {_gib(m.page_cache)} page cache of which {_gib(m.dirty)} dirty)")
    if m.limit_hits:
        line += f", the limit reached {m.limit_hits:,} times"
    return line


def pressure_note(m: MemoryCgroup | None) -> str:
    """Why a rank may be stuck, where its memory cgroup is full; "" where it is not."""
    if m is None or m.limit is None or m.usage < 0.9 * m.limit:
        return ""
    what = ("dirty pages wait for write-back" if m.dirty > 0.1 * m.limit else
            "its own memory fills it" if m.anon > 0.8 * m.limit else "reclaim runs on every allocation")
    return (f"this rank's {describe(m)}: it is at its limit and {what}; give the job more memory "
            f"(--mem), or lower storage.cpu_cache_bytes")
