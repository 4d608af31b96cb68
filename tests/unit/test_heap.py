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
