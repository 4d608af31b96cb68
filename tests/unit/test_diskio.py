"""hvctr.kernels.diskio, the shard's I/O pool, against numpy's view of the same file: reads of
sorted positions (coalesced or not, runs past the 256 KiB cap), writes of scattered and of
contiguous items (read-modify-write of the pages they share, the head and tail page of a run),
at the file's end, write-behind; and its errors."""

import errno
import os

import numpy as np
import pytest

from hvctr.kernels import diskio, native

pytestmark = pytest.mark.skipif(not native.enabled(), reason="the I/O pool is part of the C kernels")


@pytest.fixture
def f(tmp_path):
    path = tmp_path / "f.bin"
    data = np.random.default_rng(0).integers(0, 255, 3 << 20, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDWR)
    yield fd, str(path), data
    os.close(fd)


@pytest.mark.parametrize("item", [16, 208, 4096, 5000])
@pytest.mark.parametrize("threads", [1, 7, 32])
def test_reads_are_the_files_bytes(f, item, threads):
    fd, path, data = f
    base = 123
    n_items = (data.size - base) // item
    rng = np.random.default_rng(item + threads)
    for pos in (np.unique(rng.integers(0, n_items, 500)), np.arange(0, min(n_items, 2000)),
                np.array([0, 1, 2, n_items - 1])):
        out = np.empty(pos.size * item, dtype=np.uint8)
        stats = diskio.IOStats()
        diskio.read(fd, path, base, item, pos, out, threads, stats)
        want = np.concatenate([data[base + p * item: base + (p + 1) * item] for p in pos])
        np.testing.assert_array_equal(out, want)
        assert stats.read_items == pos.size and 0 < stats.read_calls <= pos.size


@pytest.mark.parametrize("item", [16, 208, 4096])
@pytest.mark.parametrize("behind", [False, True])
def test_writes_change_exactly_their_items(f, item, behind):
    fd, path, data = f
    base = 4096 + 40
    n_items = (data.size - base) // item
    rng = np.random.default_rng(item)
    model = data.copy()
    for pos in (np.unique(rng.integers(0, n_items, 700)),            # scattered: pages shared or not
                np.arange(10, 10 + 3000 if item < 4096 else 300),   # contiguous: head and tail pages
                np.arange(n_items - 50, n_items)):                  # up to the file's last item
        items = rng.integers(0, 255, (pos.size, item), dtype=np.uint8)
        diskio.write(fd, path, base, item, pos, items, 9, behind)
        for p, row in zip(pos, items):
            model[base + p * item: base + (p + 1) * item] = row
        assert os.fstat(fd).st_size == data.size  # never grows the file
        got = np.frombuffer(open(path, "rb").read(), dtype=np.uint8)
        np.testing.assert_array_equal(got, model)


def test_an_item_past_the_end_is_an_error_naming_the_file(f):
    fd, path, data = f
    out = np.empty(208, dtype=np.uint8)
    with pytest.raises(OSError, match=r"past the end of the file .*truncated") as e:
        diskio.read(fd, path, 0, 208, np.array([data.size // 208 + 3]), out, 4)
    assert e.value.errno == errno.EIO and e.value.filename == path


def test_unsorted_positions_and_a_bad_descriptor_are_errors(f):
    fd, path, _ = f
    out = np.empty(2 * 16, dtype=np.uint8)
    with pytest.raises(OSError) as e:
        diskio.read(fd, path, 0, 16, np.array([5, 3]), out, 2)
    assert e.value.errno == errno.EINVAL
    with pytest.raises(OSError) as e:
        diskio.read(987654, path, 0, 16, np.array([1, 3]), out, 2)
    assert e.value.errno == errno.EBADF and path in str(e.value)


@pytest.mark.parametrize("item", [208, 4096])
def test_direct_reads_match_and_end_inside_the_files_last_page(tmp_path, item):
    """The shard's reads under write-behind go through an O_DIRECT descriptor: page-aligned spans
    into the pool's page-aligned buffers, the same bytes; a run that ends in the file's last,
    partial page reads up to the end (where a file system refuses the unaligned offset after the
    short read with EINVAL, the pool takes it as the end of the file; ext4 here reports 0)."""
    path = tmp_path / "d.bin"
    data = np.random.default_rng(1).integers(0, 255, (3 << 20) + 1000, dtype=np.uint8)  # not a page multiple
    path.write_bytes(data.tobytes())
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT ({e})")
    try:
        base = 7
        n_items = (data.size - base) // item
        pos = np.unique(np.concatenate([np.random.default_rng(2).integers(0, n_items, 300), [n_items - 1]]))
        out = np.empty(pos.size * item, dtype=np.uint8)
        diskio.read(fd, str(path), base, item, pos, out, 8)
        want = np.concatenate([data[base + p * item: base + (p + 1) * item] for p in pos])
        np.testing.assert_array_equal(out, want)
    finally:
        os.close(fd)


def _threads_now() -> int:
    return len(os.listdir("/proc/self/task"))


def _drop_pages(fd: int, start: int = 0, length: int = 0) -> None:
    """The file's pages out of the page cache (written first): reads of them wait on the device."""
    os.fsync(fd)
    os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)


@pytest.mark.parametrize("item", [208, 4096])
def test_runs_the_page_cache_holds_and_runs_it_lacks_in_one_batch(f, item):
    """The calling thread reads the runs whose pages are cached (RWF_NOWAIT) and the pool the
    rest: a batch over a file half dropped from the page cache reads the file's bytes, and so
    does a write's read-modify-write of pages cached or not."""
    fd, path, data = f
    n_items = data.size // item
    _drop_pages(fd, 0, data.size // 2)  # the first half must be read from the device
    pos = np.unique(np.random.default_rng(item).integers(0, n_items, 900))
    out = np.empty(pos.size * item, dtype=np.uint8)
    diskio.read(fd, path, 0, item, pos, out, 32)
    np.testing.assert_array_equal(out, data[(pos[:, None] * item + np.arange(item)).ravel()])
    _drop_pages(fd, data.size // 3, data.size // 3)
    rows = np.random.default_rng(1).integers(0, 255, (pos.size, item), dtype=np.uint8)
    diskio.write(fd, path, 0, item, pos, rows, 32, False)
    model = data.copy()
    model[(pos[:, None] * item + np.arange(item)).ravel()] = rows.ravel()
    np.testing.assert_array_equal(np.frombuffer(open(path, "rb").read(), dtype=np.uint8), model)


def test_batches_of_several_threads_share_one_kept_pool(f):
    """The pool's threads are started once and kept: batches from several Python threads at
    once (the prefetch thread's warm beside the training thread's pull and write-back) each get
    their own bytes, and the process's thread count does not grow with the batches."""
    import threading

    fd, path, data = f
    item, n_items = 208, data.size // 208
    out = np.empty(64 * item, dtype=np.uint8)
    _drop_pages(fd)
    diskio.read(fd, path, 0, item, np.arange(0, 64 * 40, 40), out, 32)  # the pool started (no page cached)
    before = _threads_now()
    assert before >= 32, "the batch's 31 helpers did not stay"  # and the main thread
    errors = []

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for i in range(40):
                if i % 4 == 0:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # some runs for the pool
                pos = np.unique(rng.integers(0, n_items, 300))
                got = np.empty(pos.size * item, dtype=np.uint8)
                diskio.read(fd, path, 0, item, pos, got, 1 + seed * 5)
                want = data[(pos[:, None] * item + np.arange(item)).ravel()]
                if not np.array_equal(got, want):
                    errors.append(f"reader {seed}: wrong bytes")
        except Exception as e:  # raised in the test below
            errors.append(repr(e))

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert _threads_now() <= before + 1, "the batches started threads of their own"  # 1: a pool thread still starting


def test_a_forked_child_reads_with_a_pool_of_its_own(f):
    fd, path, data = f
    pos = np.arange(0, 5000, 7)
    out = np.empty(pos.size * 16, dtype=np.uint8)
    _drop_pages(fd)
    diskio.read(fd, path, 0, 16, pos, out, 32)  # the parent's pool started
    want = data[(pos[:, None] * 16 + np.arange(16)).ravel()]
    child = os.fork()
    if child == 0:  # the parent's pool threads do not exist here
        try:
            got = np.empty_like(out)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read by the child's own pool
            diskio.read(fd, path, 0, 16, pos, got, 32)
            os._exit(0 if np.array_equal(got, want) else 3)
        except BaseException:
            os._exit(4)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_batch_the_page_cache_holds_is_read_without_the_pool(f):
    """A table the page cache holds: the calling thread reads every run itself, no pool thread
    started (a fresh process, whose pool no earlier batch started)."""
    import json
    import subprocess
    import sys

    fd, path, data = f
    os.pread(fd, data.size, 0)  # every page cached
    child = "\n".join([
        "import json, os, sys, numpy as np",
        "from hvctr.kernels import diskio",
        "fd = os.open(sys.argv[1], os.O_RDONLY)",
        "before = len(os.listdir('/proc/self/task'))",
        "pos = np.arange(0, 10000, 3)",
        "out = np.empty(pos.size * 208, dtype=np.uint8)",
        "diskio.read(fd, sys.argv[1], 0, 208, pos, out, 32)",
        "print(json.dumps([before, len(os.listdir('/proc/self/task')), out[:8].tolist()]))"])
    # cwd: the file's folder, not a source tree whose hvctr (its kernels maybe not built there) would come first
    out = subprocess.run([sys.executable, "-c", child, path], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(path)).stdout
    before, after, head = json.loads(out)
    assert after == before, f"threads before / after the batch: {before} / {after}"
    assert head == data[:8].tolist()


@pytest.mark.parametrize("item", [208, 4096])
def test_a_mapped_batch_copies_the_cached_items_alone_and_the_pool_reads_the_rest(f, item):
    """Given the file's mapping, the calling thread copies the items of every run the page cache
    holds straight through it: a batch over a cached file is one mincore call and exactly its
    items' bytes (a pread would copy each 4 KiB page, a write read-modify-write it); over a file
    half dropped from the page cache, reads and writes are still the file's bytes exactly, the
    dropped runs read and written by the pool; with write-behind the mapping is not used."""
    fd, path, data = f
    n_items = data.size // item
    pos = np.unique(np.random.default_rng(item).integers(0, n_items, 600))
    want = data[(pos[:, None] * item + np.arange(item)).ravel()]
    os.pread(fd, data.size, 0)  # every page cached
    mapped = diskio.FileMap(fd, path, data.size, writable=True)
    try:
        out = np.empty(pos.size * item, dtype=np.uint8)
        stats = diskio.IOStats()
        diskio.read(fd, path, 0, item, pos, out, 32, stats, mapped)
        np.testing.assert_array_equal(out, want)
        assert (stats.read_calls, stats.read_bytes) == (1, pos.size * item)
        rows = np.random.default_rng(2).integers(0, 255, (pos.size, item), dtype=np.uint8)
        stats = diskio.IOStats()
        diskio.write(fd, path, 0, item, pos, rows, 32, False, stats, mapped)
        assert (stats.write_calls, stats.write_bytes) == (1, pos.size * item)
        model = data.copy()
        model[(pos[:, None] * item + np.arange(item)).ravel()] = rows.ravel()
        np.testing.assert_array_equal(np.frombuffer(open(path, "rb").read(), dtype=np.uint8), model)
    finally:
        mapped.close()
    _cache_only(fd, data.size // 2, data.size)  # the first half must come from the device
    mapped = diskio.FileMap(fd, path, data.size, writable=True)
    try:
        out = np.empty(pos.size * item, dtype=np.uint8)
        stats = diskio.IOStats()
        diskio.read(fd, path, 0, item, pos, out, 32, stats, mapped)
        np.testing.assert_array_equal(out, model[(pos[:, None] * item + np.arange(item)).ravel()])
        assert stats.read_calls > 10  # one mincore, then the pool's preads of the dropped half's runs
        for behind in (False, True):
            _cache_only(fd, 0, data.size // 3)
            rows = np.random.default_rng(3 + behind).integers(0, 255, (pos.size, item), dtype=np.uint8)
            diskio.write(fd, path, 0, item, pos, rows, 32, behind, None, mapped)
            model[(pos[:, None] * item + np.arange(item)).ravel()] = rows.ravel()
            assert os.fstat(fd).st_size == data.size
            np.testing.assert_array_equal(np.frombuffer(open(path, "rb").read(), dtype=np.uint8), model)
    finally:
        mapped.close()
    mapped.close()  # twice: nothing


def _cache_only(fd: int, start: int, stop: int) -> None:
    """Only [start, stop) of the file in the page cache. (A ranged drop can leave pages: the page
    cache holds large folios, and a drop takes only the folios wholly inside its range.)"""
    _drop_pages(fd)
    os.pread(fd, stop - start, start)


def test_a_write_given_a_read_only_mapping_goes_to_the_pool(f):
    """A mapping made for reading only is not written through (that would be a SIGSEGV): the
    pool writes the batch, and the file holds its bytes."""
    fd, path, data = f
    os.pread(fd, data.size, 0)
    mapped = diskio.FileMap(fd, path, data.size, writable=False)
    try:
        pos = np.arange(0, 1000, 7)
        rows = np.random.default_rng(5).integers(0, 255, (pos.size, 208), dtype=np.uint8)
        stats = diskio.IOStats()
        diskio.write(fd, path, 0, 208, pos, rows, 8, False, stats, mapped)
        assert stats.write_bytes > pos.size * 208  # pages read-modify-written by the pool, not copied in
        out = np.empty(pos.size * 208, dtype=np.uint8)
        diskio.read(fd, path, 0, 208, pos, out, 8, None, mapped)
        np.testing.assert_array_equal(out, rows.ravel())
    finally:
        mapped.close()
