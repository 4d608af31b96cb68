"""The HDF5 shard: round trips, reopening from a new process, h5py-only reading, full shard.

Every test runs on both of the shard's I/O paths: pread (the C kernels' pool, the default) and
mmap (the reference)."""

import contextlib
import os
import subprocess
import textwrap

import h5py
import numpy as np
import pytest

from hvctr.formats import EMPTY_KEY, default_bucket_owner, mix64
from hvctr.formats import RowLayout
from hvctr.kernels import native
from hvctr.storage import shard as shard_mod
from hvctr.storage.shard import (BLOCK_BYTES, SLOTS_PER_BLOCK, Shard, ShardFullError, file_system_type, num_slots_for,
                                 pending_capacity, pwrite_runs)
from tests.conftest import VENV_PY


IO = {"path": "pread"}


@pytest.fixture(autouse=True, params=["pread", "mmap"])
def io_path(request):
    IO["path"] = request.param
    yield request.param
    IO["path"] = "pread"


def _create(path, capacity=1000, dim=4, load=0.8, world_size=2, rank=1):
    return Shard.create(path, dim=dim, capacity=capacity, world_size=world_size, rank=rank,
                        bucket_owner=default_bucket_owner(world_size), seed=11, init_scale=0.01,
                        max_load_factor=load, io=IO["path"])


def _open(path, writable=True):
    return Shard.open(path, writable=writable, io=IO["path"])


def _keys(n, seed=0):
    return np.unique(np.random.default_rng(seed).integers(0, 2**64 - 2, size=n, dtype=np.uint64))


def test_insert_lookup_write_read_round_trip(tmp_path):
    path = tmp_path / "s.h5"
    shard = _create(path)
    keys = _keys(700)
    pos = shard.insert(keys)
    assert sorted(pos.tolist()) == list(range(keys.size)) and shard.n_rows == keys.size
    rows = np.random.default_rng(1).standard_normal((keys.size, RowLayout(4).width)).astype(np.float32)
    perm = np.random.default_rng(2).permutation(keys.size)
    shard.write_rows(pos[perm], keys[perm], rows[perm])  # unsorted positions
    np.testing.assert_array_equal(shard.lookup(keys[::-1]), pos[::-1])
    assert np.all(shard.lookup(_keys(50, seed=9)) == -1)
    np.testing.assert_array_equal(shard.read_rows(pos[perm]), rows[perm])
    meta = shard.read_meta(0, 10_000)
    np.testing.assert_array_equal(meta["key"][pos], keys)
    shard.close()
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("copy_on_write", [False, True])
def test_index_entries_reach_the_file_by_map_or_by_pwrite(tmp_path, monkeypatch, copy_on_write):
    """In-place file systems take index entries through the map; copy-on-write ones by pwrite.
    Either way a fresh reader of the file (h5py alone) sees every entry."""
    fs = file_system_type(str(tmp_path))
    assert fs, "/proc/self/mounts names the file system of the test directory"
    if copy_on_write:
        monkeypatch.setattr(shard_mod, "_COPY_ON_WRITE_FS", frozenset({fs}))
    path = tmp_path / "s.h5"
    shard = _create(path, capacity=3000)
    assert shard.index_by_map is (IO["path"] == "mmap" and not copy_on_write)
    keys = _keys(2500, seed=3)
    pos = np.concatenate([shard.insert(part) for part in np.array_split(keys, 5)])
    shard.close()
    with h5py.File(path, "r") as f:
        index = f["index"][...]
    used = index[index["key"] != EMPTY_KEY]
    order = np.argsort(used["key"])
    np.testing.assert_array_equal(used["key"][order], keys)  # keys from np.unique: sorted
    np.testing.assert_array_equal(used["row"][order], pos)
    assert _open(path, writable=False).lookup(keys).tolist() == pos.tolist()


@pytest.mark.parametrize("inserts,lookups", [("native", "native"), ("numpy", "numpy"), ("numpy", "native"),
                                              ("native", "numpy"), ("mixed", "native")])
def test_probing_crosses_index_blocks_at_high_load(tmp_path, inserts, lookups, io_path):
    # 95% load in one small index: long probe runs wrap across 4 KiB blocks and the table end.
    # The C probe (hv_probe_find, hv_probe_claim) and numpy's read each other's indexes (the
    # mmap path's probes; the pread path's have a test of their own below).
    if io_path == "pread":
        pytest.skip("the mmap path's probes")

    def probing(path, i=0):
        numpy = path == "numpy" or (path == "mixed" and i % 2)
        return native.disabled() if numpy else contextlib.nullcontext()

    shard = _create(tmp_path / "s.h5", capacity=2 * SLOTS_PER_BLOCK, load=0.95)
    keys = _keys(2 * SLOTS_PER_BLOCK)
    pos = []
    for i in range(0, keys.size, 100):
        with probing(inserts, i // 100):
            pos.append(shard.insert(keys[i:i + 100]))
    pos = np.concatenate(pos)
    assert shard.num_slots == 3 * SLOTS_PER_BLOCK
    absent = _keys(300, seed=5)
    absent = absent[~np.isin(absent, keys)]
    with probing(lookups):
        np.testing.assert_array_equal(shard.lookup(keys), pos)
        assert (shard.lookup(absent) == -1).all()
    shard.close()


def test_layout_attributes_allocation_and_state(tmp_path):
    path = tmp_path / "s.h5"
    shard = _create(path, capacity=5000, dim=8)
    shard.insert(_keys(10))
    shard.pass_index = 3
    shard.close()
    with h5py.File(path, "r") as f:
        a = f.attrs
        assert (a["format_version"], a["dim"], a["width"], a["capacity"]) == (1, 8, 28, 5000)
        assert (a["world_size"], a["rank"], a["init_seed"]) == (2, 1, 11) and "slot_seed" in a
        for name in ("index", "rows", "row_meta", "state", "bucket_owner"):
            d = f[name]
            assert d.chunks is None and d.compression is None  # contiguous, uncompressed
        for name in ("index", "rows", "row_meta"):
            assert f[name].id.get_offset() % BLOCK_BYTES == 0
        state = f["state"][0]
        assert (state["n_rows"], state["pass_index"], state["clean"]) == (10, 3, 1)
        np.testing.assert_array_equal(f["bucket_owner"][...], default_bucket_owner(2))
    st = os.stat(path)
    assert st.st_blocks * 512 >= st.st_size  # posix_fallocate reserved every block


def test_full_shard_names_the_option(tmp_path):
    shard = _create(tmp_path / "s.h5", capacity=100)
    shard.insert(_keys(90))
    with pytest.raises(ShardFullError, match="storage.rows_per_rank") as e:
        shard.insert(_keys(20, seed=5))
    assert isinstance(e.value, ValueError) and str(tmp_path / "s.h5") in str(e.value)
    assert shard.n_rows == 90  # nothing half-inserted
    shard.close()


def test_reopened_by_a_new_process_and_read_by_h5py_alone(tmp_path):
    path = tmp_path / "s.h5"
    shard = _create(path, capacity=3000, dim=4)
    keys = _keys(2000)
    pos = shard.insert(keys)
    rows = np.random.default_rng(3).standard_normal((keys.size, 16)).astype(np.float32)
    shard.write_rows(pos, keys, rows)
    shard.close()
    np.save(tmp_path / "keys.npy", keys)
    np.save(tmp_path / "rows.npy", rows)
    child = textwrap.dedent(f"""
        import numpy as np, h5py
        from hvctr.storage.shard import Shard
        keys, rows = np.load("{tmp_path}/keys.npy"), np.load("{tmp_path}/rows.npy")
        s = Shard.open("{path}", writable=False)
        assert s.was_clean and s.n_rows == keys.size
        got = s.read_rows(s.lookup(keys))
        assert np.array_equal(got, rows), "rows differ after reopening"
        s.close()
        # h5py alone, no hvctr code: the index maps keys to row numbers.
        with h5py.File("{path}", "r") as f:
            index = f["index"][...]
            used = index[index["key"] != np.iinfo(np.uint64).max]
            by_key = dict(zip(used["key"].tolist(), used["row"].tolist()))
            rows_ds = f["rows"][...]
            assert np.array_equal(rows_ds[[by_key[k] for k in keys.tolist()]], rows)
            assert np.array_equal(f["row_meta"]["key"][:keys.size][[by_key[k] for k in keys.tolist()]], keys)
        print("ok")
    """)
    # cwd outside the checkout: the child imports the installed hvctr (with its built kernels)
    out = subprocess.run([VENV_PY, "-c", child], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    h5dump = subprocess.run(["h5dump", "-H", str(path)], capture_output=True, text=True, timeout=60)
    assert h5dump.returncode == 0, h5dump.stderr
    assert 'DATASET "rows"' in h5dump.stdout and 'ATTRIBUTE "format_version"' in h5dump.stdout


def test_slot_hash_is_independent_of_the_owner_hash(tmp_path):
    # Keys of one owner (rank 1 of 2) must still spread over all index blocks.
    shard = _create(tmp_path / "s.h5", capacity=20 * SLOTS_PER_BLOCK)
    keys = _keys(20000)
    owner_bits = (mix64(keys) >> np.uint64(52)) % np.uint64(2)
    mine = keys[owner_bits == 1][:4000]
    slots = shard._home(mine)
    blocks = np.bincount(slots // SLOTS_PER_BLOCK, minlength=shard.num_slots // SLOTS_PER_BLOCK)
    assert np.count_nonzero(blocks) == blocks.size  # every block gets keys
    assert blocks.max() < 3 * blocks.mean()
    shard.close()


@pytest.mark.parametrize("writer_io,reader_io", [("pread", "mmap"), ("mmap", "pread"), ("pread", "pread")])
def test_block_probes_cross_blocks_and_the_table_end_and_agree_with_the_map(tmp_path, writer_io, reader_io, io_path):
    # The pread path probes the index over the blocks a batch needs (hv_index_find, hv_index_claim):
    # at 99% load its walks cross block ends and wrap at the table's end, in later rounds; an
    # index it wrote reads the same through the map, and the other way round.
    if io_path == "mmap":
        pytest.skip("parametrized over both paths already")
    path = tmp_path / "s.h5"
    shard = Shard.create(path, dim=4, capacity=5 * SLOTS_PER_BLOCK - 12, world_size=2, rank=1,
                         bucket_owner=default_bucket_owner(2), seed=11, init_scale=0.01, max_load_factor=0.995,
                         io=writer_io)
    shard.close()
    shard = Shard.open(path, io=writer_io)  # opened from disk: its index blocks are read, none known blank
    keys = _keys(5 * SLOTS_PER_BLOCK - 12, seed=8)
    pos = np.concatenate([shard.insert(part) for part in np.array_split(keys, 7)])
    shard.close()  # the entries waiting in memory go to the file's index
    blocks_read = shard.index_blocks_read
    reader = Shard.open(path, writable=False, io=reader_io)
    np.testing.assert_array_equal(reader.lookup(keys), pos)
    absent = _keys(500, seed=6)
    assert (reader.lookup(absent[~np.isin(absent, keys)]) == -1).all()
    with h5py.File(path, "r") as f:
        index = f["index"][...]
    used = index[index["key"] != EMPTY_KEY]
    assert used.shape[0] == keys.size
    slot = np.flatnonzero(index["key"] != EMPTY_KEY)
    home = (mix64(index["key"][slot] ^ np.uint64(reader.slot_seed)) % np.uint64(reader.num_slots)).astype(np.int64)
    assert (slot < home).any(), "some probe run wrapped at the table's end"
    assert ((slot // SLOTS_PER_BLOCK) != (home // SLOTS_PER_BLOCK)).any(), "some probe run crossed a block end"
    if writer_io == "pread":
        assert blocks_read > 0
    reader.close()


@pytest.mark.parametrize("n_keys", [1000, 30 * SLOTS_PER_BLOCK])  # one flush, at the close; a flush every few inserts
def test_a_new_shards_index_flushes_fill_its_blank_blocks_instead_of_reading_them(tmp_path, n_keys):
    # A shard create() made knows every index block is still empty: its flushes read only the
    # blocks written since. The index it writes equals, bit for bit, the one a shard opened
    # from disk (which reads every block) writes for the same inserts.
    def fill(path, reopen):
        shard = Shard.create(path, dim=4, capacity=40 * SLOTS_PER_BLOCK, world_size=2, rank=0,
                             bucket_owner=default_bucket_owner(2), seed=5, init_scale=0.01, max_load_factor=0.9,
                             io="pread")
        if reopen:
            shard.close()
            shard = Shard.open(path, io="pread")
        keys = _keys(n_keys, seed=12)
        pos = np.concatenate([shard.insert(part) for part in np.array_split(keys, 9)])
        np.testing.assert_array_equal(shard.lookup(keys), pos)
        shard.close()
        with h5py.File(path, "r") as f:
            return f["index"][...], shard.index_blocks_read, keys, pos

    shard_pending = pending_capacity(40 * SLOTS_PER_BLOCK, num_slots_for(40 * SLOTS_PER_BLOCK, 0.9))
    new, new_read, keys, pos = fill(tmp_path / "new.h5", reopen=False)
    old, old_read, _, _ = fill(tmp_path / "old.h5", reopen=True)
    assert new.tobytes() == old.tobytes()
    assert old_read > 0 and new_read < old_read
    if n_keys < shard_pending:
        assert new_read == 0  # one flush, every block blank before it
    reader = Shard.open(tmp_path / "new.h5", writable=False)
    np.testing.assert_array_equal(reader.lookup(keys), pos)
    reader.close()


def test_an_open_writer_marks_the_file_unclean(tmp_path):
    path = tmp_path / "s.h5"
    writer = _create(path)
    writer.insert(_keys(5))
    writer.save_state()
    reader = _open(path, writable=False)  # what a crash of the writer leaves behind
    assert not reader.was_clean and reader.n_rows == 5
    reader.close()
    writer.close()
    reader = _open(path, writable=False)
    assert reader.was_clean
    with h5py.File(path, "r") as f:
        assert np.count_nonzero(f["index"]["key"] != EMPTY_KEY) == 5
    reader.close()


def test_rejects_missing_and_foreign_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        Shard.open(tmp_path / "nope.h5")
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"] = np.arange(3)
    with pytest.raises(ValueError, match="format_version"):
        Shard.open(tmp_path / "other.h5")



@pytest.mark.parametrize("with_current", [False, True])
def test_pwrite_runs_writes_exactly_the_given_items(tmp_path, with_current):
    # With the current contents, nearby runs merge and gaps are rewritten unchanged.
    rng = np.random.default_rng(0)
    path = str(tmp_path / "f.bin")
    for trial in range(30):
        n_items, width = int(rng.integers(1, 20_000)), int(rng.choice([4, 28, 52]))
        init = rng.standard_normal((n_items, width)).astype(np.float32)
        init.tofile(path)
        pos = np.sort(rng.choice(n_items, int(rng.integers(0, n_items + 1)), replace=False))
        data = rng.standard_normal((pos.size, width)).astype(np.float32)
        fd = os.open(path, os.O_RDWR)
        current = np.memmap(path, np.float32, "r", 0, (n_items, width)) if with_current else None
        pwrite_runs(fd, 0, 4 * width, pos, data, current)
        os.close(fd)
        want = init.copy()
        want[pos] = data
        np.testing.assert_array_equal(np.fromfile(path, np.float32).reshape(n_items, width), want, err_msg=str(trial))


def test_the_key_filter_skips_index_reads_of_new_keys_and_never_hides_a_stored_one(tmp_path, io_path):
    if io_path == "mmap":
        pytest.skip("the pread path's filter")
    path = tmp_path / "s.h5"
    shard = _create(path, capacity=50_000)
    keys = _keys(40_000, seed=12)
    pos = shard.insert(keys[:30_000])
    before = shard.index_blocks_read
    fresh = keys[30_000:]
    assert (shard.lookup(fresh) == -1).all()
    assert shard.filtered_lookups > 0.9 * fresh.size  # about 1% false positives at 10 bits a row
    assert shard.index_blocks_read - before < 0.1 * fresh.size
    np.testing.assert_array_equal(shard.lookup(keys[:30_000]), pos)
    shard.close()
    reopened = _open(path, writable=False)  # the filter is rebuilt from row_meta
    np.testing.assert_array_equal(reopened.lookup(keys[:30_000]), pos)
    assert (reopened.lookup(fresh) == -1).all()
    reopened.close()


def test_the_key_filters_c_pass_sets_and_tests_the_bits_numpy_does():
    """KeyFilter's add and may_hold in C (hv_bloom_add / hv_bloom_test) against its numpy path: the
    same table bit for bit, the same answers, every added key held."""
    keys, asked = _keys(20_000, seed=31), _keys(30_000, seed=32)
    asked[:500] = keys[:500]
    c, ref = shard_mod.KeyFilter(3000), shard_mod.KeyFilter(3000)  # small: many keys share bytes
    c.add(keys)
    got = c.may_hold(asked)
    with native.disabled():
        ref.add(keys)
        want = ref.may_hold(asked)
    np.testing.assert_array_equal(c.table, ref.table)
    np.testing.assert_array_equal(got, want)
    assert got[:500].all() and c.may_hold(keys).all()
    assert not got[500:].all()  # the filter says absent of some keys


def test_recent_positions_spare_the_index_reads_of_keys_looked_up_lately(tmp_path, io_path):
    # A window's push looks up the keys its warm and pull looked up: from memory, not the index
    # blocks again (issue 26). Two generations of 1000: the answers stay right past them.
    if io_path == "mmap":
        pytest.skip("the pread path's index")
    path = tmp_path / "s.h5"
    shard = _create(path, capacity=6000)
    keys = _keys(5000, seed=3)
    pos = shard.insert(keys)
    shard.close()  # the entries reach the file's index
    shard = Shard.open(path, io="pread", recent_positions=1000)
    blocks = shard.index_blocks_read
    np.testing.assert_array_equal(shard.lookup(keys[:800]), pos[:800])
    assert shard.index_blocks_read > blocks
    blocks = shard.index_blocks_read
    np.testing.assert_array_equal(shard.lookup(keys[:800][::-1]), pos[:800][::-1])  # the same keys again
    assert shard.index_blocks_read == blocks and shard.recent.hits == 800
    for start in range(800, 5000, 700):  # past both generations: rotated, never wrong
        np.testing.assert_array_equal(shard.lookup(keys[start:start + 700]), pos[start:start + 700])
        np.testing.assert_array_equal(shard.lookup(keys[:300]), pos[:300])  # kept: carried into the newer
    blocks = shard.index_blocks_read
    np.testing.assert_array_equal(shard.lookup(keys[:300]), pos[:300])
    assert shard.index_blocks_read == blocks
    np.testing.assert_array_equal(shard.lookup(keys), pos)
    assert (shard.lookup(_keys(500, seed=99)) == -1).all()
    shard.close()


def test_a_writer_killed_with_entries_in_memory_leaves_a_shard_that_reopens_whole(tmp_path, io_path):
    # The pread path keeps new index entries in memory until a flush; a writer that dies first
    # leaves rows in row_meta that the file's index lacks: reopening it for writing indexes them.
    if io_path == "mmap":
        pytest.skip("the pread path's insert buffer")
    path = tmp_path / "s.h5"
    shard = _create(path, capacity=5000)
    keys = _keys(3000, seed=21)
    pos = shard.insert(keys)
    shard.save_state()  # what a checkpoint's flush leaves; then the process dies (no close)
    os.close(shard._fd)
    shard._fd = -1
    reopened = _open(path)
    assert not reopened.was_clean
    np.testing.assert_array_equal(reopened.lookup(keys), pos)
    reopened.close()
    np.testing.assert_array_equal(_open(path, writable=False).lookup(keys), pos)


def test_waiting_index_entries_give_way_to_a_small_cache():
    """New index entries wait at 32 a block of the index, but their memory stays within a quarter
    of the CPU cache's budget, down to 8 a block: two ranks of 5.7M-row shards with 4 MiB caches in
    a 256 MiB cgroup were OOM-killed at 32 a block (49 MiB of entries a rank)."""
    cap = 5_720_000
    slots = shard_mod.num_slots_for(cap, 0.7)
    blocks = slots // SLOTS_PER_BLOCK
    full = shard_mod.pending_capacity(cap, slots)
    assert full == blocks * shard_mod.PENDING_PER_BLOCK
    small = shard_mod.pending_capacity(cap, slots, shard_mod.pending_bytes_for(4 << 20))
    assert small == blocks * shard_mod.PENDING_PER_BLOCK_MIN
    assert shard_mod.pending_capacity(cap, slots, shard_mod.pending_bytes_for(256 << 20)) == full
    middle = shard_mod.pending_capacity(cap, slots, shard_mod.pending_bytes_for(128 << 20))
    assert small < middle < full and middle * shard_mod.PENDING_ENTRY_BYTES <= (128 << 20) // 4
    assert shard_mod.pending_capacity(10_000, 16_384, 0) == 4096  # never under 4096 entries
    filter_bytes = (cap * 10 + 7) // 8
    recent = shard_mod.recent_positions_for(4 << 20) * shard_mod.RECENT_POSITION_BYTES
    assert shard_mod.memory_bytes(cap, 0.7, 4 << 20) == filter_bytes + small * shard_mod.PENDING_ENTRY_BYTES + recent


@pytest.mark.parametrize("write_behind", [False, True])
def test_a_writer_without_write_behind_reads_and_writes_through_its_mapping(tmp_path, io_path, write_behind):
    """pread path, pages kept (no write-behind), opened for writing: the shard is mapped, the
    rows the page cache holds are copied through the mapping (one mincore call a batch, no page
    copied whole) and the index blocks it holds are probed and claimed in place (none copied);
    the same rows and index as through the pool, before and after a page-cache drop (which maps
    the file anew) and for a reader; read-only and write-behind shards are not mapped."""
    if io_path != "pread" or not native.enabled():
        pytest.skip("the pread path's mapping")
    path = tmp_path / "s.h5"
    shard = Shard.create(path, dim=4, capacity=20_000, world_size=2, rank=1, bucket_owner=default_bucket_owner(2),
                         seed=11, init_scale=0.01, max_load_factor=0.8, io="pread", write_behind=write_behind)
    mapped = not write_behind and file_system_type(str(path)) not in shard_mod._COPY_ON_WRITE_FS
    assert (shard._map is not None) == mapped
    keys = _keys(15_000)
    pos = shard.insert(keys)
    rows = np.random.default_rng(1).standard_normal((keys.size, RowLayout(4).width)).astype(np.float32)
    shard.write_rows(pos, keys, rows)
    some = np.sort(np.random.default_rng(2).choice(keys.size, 3000, replace=False))
    rows[some] += 1.0
    before = shard.io_stats.as_dict()
    shard.write_rows(pos[some], keys[some], rows[some])  # scattered: 3000 of 15,000 rows of 80 bytes
    got = shard.read_rows(pos[some])
    after = shard.io_stats.as_dict()
    np.testing.assert_array_equal(got, rows[some])
    if mapped:  # exactly the rows' and their meta's bytes, one mincore a batch
        meta_bytes = shard_mod.META_DTYPE.itemsize
        assert after["write_bytes"] - before["write_bytes"] == some.size * (rows.itemsize * rows.shape[1] + meta_bytes)
        assert (after["write_calls"] - before["write_calls"], after["read_calls"] - before["read_calls"]) == (2, 1)
    shard.flush_index()  # the entries waiting in memory claimed in the file's index blocks
    before = shard.io_stats.as_dict()
    np.testing.assert_array_equal(shard.lookup(keys), pos)
    copied = shard.io_stats.as_dict()["read_bytes"] - before["read_bytes"]
    assert copied == 0 if mapped else copied >= BLOCK_BYTES  # probed in the mapping: no block copied
    shard.drop_page_cache()
    np.testing.assert_array_equal(shard.read_rows(pos), rows)
    np.testing.assert_array_equal(shard.lookup(keys), pos)
    shard.close()
    reader = Shard.open(path, writable=False, io="pread", write_behind=False)
    assert reader._map is None
    np.testing.assert_array_equal(reader.read_rows(pos), rows)
    np.testing.assert_array_equal(reader.lookup(keys), pos)  # the index claimed through the mapping, read by pread
    reader.close()


def test_a_writer_whose_file_cannot_be_mapped_reads_through_the_pool(tmp_path, io_path, monkeypatch, caplog):
    """Where the mapping fails (a virtual-memory limit, vm.max_map_count), the shard opens
    unmapped with a warning naming it, and its rows and index go through the pool alike."""
    if io_path != "pread" or not native.enabled():
        pytest.skip("the pread path's mapping")
    import errno
    import logging

    def refuse(fd, path, length, writable):
        raise OSError(errno.ENOMEM, f"mapping {length} bytes: {os.strerror(errno.ENOMEM)}", path)

    monkeypatch.setattr(shard_mod.diskio, "FileMap", refuse)
    path = tmp_path / "s.h5"
    with caplog.at_level(logging.WARNING):
        shard = Shard.create(path, dim=4, capacity=2000, world_size=2, rank=1, bucket_owner=default_bucket_owner(2),
                             seed=11, init_scale=0.01, max_load_factor=0.8, io="pread", write_behind=False)
    assert shard._map is None
    assert any(str(path) in r.getMessage() and "not mapped" in r.getMessage() for r in caplog.records)
    keys = _keys(1500)
    pos = shard.insert(keys)
    rows = np.random.default_rng(1).standard_normal((keys.size, RowLayout(4).width)).astype(np.float32)
    shard.write_rows(pos, keys, rows)
    shard.flush_index()
    np.testing.assert_array_equal(shard.read_rows(pos), rows)
    np.testing.assert_array_equal(shard.lookup(keys), pos)
    shard.close()
