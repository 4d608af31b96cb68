"""hvctr.heap: glibc's mmap threshold fixed only where HVCTR_MALLOC_TUNE=1 asks for it."""

import platform

import pytest

from hvctr.heap import fix_mmap_threshold


def test_off_by_default_and_under_glibcs_own_tunable():
    assert fix_mmap_threshold(environ={}) == ""
    assert fix_mmap_threshold(environ={"HVCTR_MALLOC_TUNE": "0"}) == ""
    assert fix_mmap_threshold(environ={"HVCTR_MALLOC_TUNE": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}) == ""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_sets_the_threshold_on_glibc():
    assert "128 KiB" in fix_mmap_threshold(environ={"HVCTR_MALLOC_TUNE": "1"})


def test_trim_policies():
    from hvctr.heap import trim_wanted

    assert trim_wanted("window", memory_limited=False) and trim_wanted("window", memory_limited=True)
    assert trim_wanted("auto", memory_limited=True) and not trim_wanted("auto", memory_limited=False)
    assert not trim_wanted("off", memory_limited=True)


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_trim_hands_freed_heap_pages_back():
    """Arrays below the mmap threshold live in the heap; freed between live ones they stay with
    the process until trimmed. 2,048 arrays of 64 KiB, every other one freed: 64 MiB of free
    heap pages, of which the trim must give back most."""
    import numpy as np

    from hvctr.heap import HeapTrimmer

    off = HeapTrimmer(False)
    off.trim()
    assert not off.enabled and off.calls == 0
    arrays = [np.ones(8 << 10, dtype=np.float64) for _ in range(2048)]  # 64 KiB each, touched
    del arrays[::2]
    before = _rss_anon()
    heap = HeapTrimmer(True)
    heap.trim()
    after = _rss_anon()
    assert heap.enabled and heap.calls == 1 and heap.seconds > 0
    assert before - after > 32 << 20, (before, after)
    assert sum(int(a[0]) for a in arrays) == 1024  # the live ones are untouched
