"""The allocator's settings for a training rank: freed memory goes back to the system.

glibc malloc serves a request of at least its mmap threshold with a mapping of its own,
unmapped when freed; smaller ones come from its heaps, whose free pages stay in the process
until the top of a heap is free. The threshold starts at 128 KiB, and every free of a larger
mapped block raises it to that block's size (up to 32 MiB): after a window's first arrays (a
327k-key window's positions and inverses are 7-10 MB each) are freed, every later array of that
size comes from a heap, where the arrays of two threads (the prefetch thread's window, the main
thread's pull and push) interleave and the freed ones are kept. Measured at 2 ranks, batch 4096,
k = 8 (BENCHMARKS.md, issue 26): about 180 MiB a rank of anonymous memory held that way during
training, a third of the job's own memory beyond torch's floor.

``fix_mmap_threshold()`` sets the threshold (and the heap trim threshold) once, which also
turns glibc's raising off, where the environment sets ``HVCTR_MALLOC_TUNE=1``: it is a trade,
off by default. Every array of 128 KiB and more is then a fresh mapping whose pages fault in
(a step's [B, F, D] tensors, 7 MB at B = 4096): measured at the configuration above, 170 MiB a
rank less at the peak (RssAnon 882 -> 709 MiB), and training 18-20% slower in two runs of each
(page faults: 5.6M, 41 s of system time in a 66 s job at B = 2048). Where
``MALLOC_MMAP_THRESHOLD_`` (glibc's own tunable, which any threshold can be set with) is in the
environment, or the C library is not glibc, it changes nothing.

``HeapTrimmer`` is the default way back (``storage.heap_trim``): ``malloc_trim(0)`` after each
window, which hands every whole free page of every glibc heap back to the system (the pages of
the window's freed arrays) without changing how arrays are allocated. Measured at 2 ranks on a
16.7 GB table (batch 2048, k = 4, cache 32 MiB, 800 steps; BENCHMARKS.md, issue 26) together with
the 16 MiB fusion buffer (hvctr.distributed.world): a rank's peak anonymous memory 974 -> about
560 MiB. A window's arrays then fault their pages in again once per window, not once per
array as with the fixed threshold above. ``auto`` trims only where the job runs under a memory
limit (a memory cgroup with a limit: Slurm's ConstrainRAMSpace, a container), where memory the
process keeps is memory the page cache of the table does not get.
"""

from __future__ import annotations

import ctypes
import os
import time

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
THRESHOLD = 128 << 10  # glibc's own starting value, kept


def fix_mmap_threshold(threshold: int = THRESHOLD, environ=os.environ) -> str:
    """Fixes glibc's mmap and trim thresholds at ``threshold`` bytes; returns what it did, for
    the log ("" where it left the allocator alone)."""
    if environ.get("HVCTR_MALLOC_TUNE", "") != "1" or "MALLOC_MMAP_THRESHOLD_" in environ:
        return ""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to set
        return ""
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(M_MMAP_THRESHOLD, threshold) and mallopt(M_TRIM_THRESHOLD, threshold)):
        return ""
    return f"malloc: arrays of {threshold >> 10} KiB and more mapped and unmapped on their own (hvctr.heap)"


def _malloc_trim():
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class HeapTrimmer:
    """``trim()`` hands the free pages of the C heaps back to the system where ``enabled``;
    ``calls`` and ``seconds`` say what it cost (the run's summary)."""

    def __init__(self, enabled: bool) -> None:
        self._fn = _malloc_trim() if enabled else None
        self.enabled = self._fn is not None
        self.calls = 0
        self.seconds = 0.0

    def trim(self) -> None:
        if self._fn is None:
            return
        t0 = time.perf_counter()
        self._fn(0)
        self.seconds += time.perf_counter() - t0
        self.calls += 1


def trim_wanted(policy: str, memory_limited: bool) -> bool:
    """Whether ``storage.heap_trim = policy`` trims: "window" always, "off" never, "auto" where
    the job's memory is limited."""
    return policy == "window" or (policy == "auto" and memory_limited)
