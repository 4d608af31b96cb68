"""Faults a unit test can show (the rest, in whole jobs: tests/e2e/test_faults.py).

- Loading never runs code: no deserialiser that can execute code from a file anywhere in hvctr.
- A truncated working shard is a ValueError naming the file.
- A full disk: a new shard, and a compaction's new shard, fail at creation with a ValueError
  naming the file; the old shard stays as it was and keeps working. A real small tmpfs.
- A hardware map naming a NUMA node the machine lacks is a ValueError naming the map.
"""

from __future__ import annotations

import io
import os
import tokenize
from pathlib import Path

import numpy as np
import pytest

from hvctr.config import StorageConfig
from hvctr.formats import default_bucket_owner
from hvctr.storage import EmbeddingStore
from hvctr.storage.shard import Shard
from hvctr.topo.bind import check_map_matches_machine
from hvctr.topo.hwmap import load_map

ROOT = Path(__file__).resolve().parents[2]
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}


def _code_tokens(path: Path) -> list[tokenize.TokenInfo]:
    """The file's tokens without comments and strings (a docstring saying "no pickle" is fine)."""
    toks = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [t for t in toks if t.type in (tokenize.NAME, tokenize.OP)]


def _call_args(toks: list[tokenize.TokenInfo], open_paren: int) -> str:
    depth, out = 0, []
    for t in toks[open_paren:]:
        depth += {"(": 1, ")": -1}.get(t.string, 0)
        out.append(t.string)
        if depth == 0:
            break
    return "".join(out)


def unsafe_loads(path: Path) -> list[str]:
    """Places in a Python file that could run code from data: pickle-like modules,
    torch.load without weights_only=True, numpy loads with allow_pickle=True, yaml.load."""
    toks = _code_tokens(path)
    found = []
    for i, t in enumerate(toks):
        where = f"{path.name}:{t.start[0]}"
        if t.string in UNSAFE_MODULES:
            found.append(f"{where}: {t.string}")
        dotted = "".join(x.string for x in toks[max(0, i - 2):i + 1])
        if i + 1 < len(toks) and toks[i + 1].string == "(":
            args = _call_args(toks, i + 1)
            if dotted == "torch.load" and "weights_only=True" not in args:
                found.append(f"{where}: torch.load without weights_only=True")
            if dotted.endswith(".load") and "allow_pickle=True" in args:
                found.append(f"{where}: {dotted} with allow_pickle=True")
            if dotted == "yaml.load":
                found.append(f"{where}: yaml.load")
    return found


def test_no_deserialiser_that_runs_code_in_hvctr():
    files = sorted((ROOT / "hvctr").rglob("*.py"))
    assert len(files) > 20
    assert [f for path in files for f in unsafe_loads(path)] == []


def test_the_scan_finds_what_it_looks_for(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('"""no pickle here"""  # nor here\nimport pickle\nx = torch.load(f)\n'
                     'y = torch.load(f, weights_only=True)\nz = np.load(f, allow_pickle=True)\n')
    assert unsafe_loads(probe) == ["probe.py:2: pickle", "probe.py:3: torch.load without weights_only=True",
                                   "probe.py:5: np.load with allow_pickle=True"]


def _shard_kw(world_size: int = 1) -> dict:
    return dict(dim=8, world_size=world_size, rank=0, bucket_owner=default_bucket_owner(world_size), seed=1,
                init_scale=0.01, max_load_factor=0.8)


def test_truncated_working_shard_is_named(tmp_path):
    path = tmp_path / "shard.h5"
    Shard.create(path, capacity=4096, **_shard_kw()).close()
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(ValueError, match=f"shard file {path}: cannot open as HDF5.*truncated"):
        Shard.open(path)


def test_new_shard_on_a_full_disk_fails_at_creation(tmpfs):
    disk = tmpfs(8 << 20)
    with pytest.raises(ValueError, match=rf"cannot create the shard {disk}/big.h5 .*no space left on device.*"
                                         r"storage.rows_per_rank"):
        Shard.create(disk / "big.h5", capacity=200_000, **_shard_kw())  # 28 MiB
    assert os.listdir(disk) == []  # the temporary file is gone: the space is free again
    small = Shard.create(disk / "small.h5", capacity=20_000, **_shard_kw())  # 2.8 MiB: fits
    small.close()


def test_compaction_on_a_full_disk_keeps_the_old_shard(tmpfs):
    disk = tmpfs(4 << 20)  # room for one shard of 2.8 MiB, not for the compacted copy beside it
    cfg = StorageConfig(dim=8, rows_per_rank=20_000, cpu_cache_bytes=0, ttl_passes=1, seed=5)
    keys = np.arange(1, 3001, dtype=np.uint64)
    store = EmbeddingStore(cfg, disk / "shard.h5", create=True)
    rows = store.read(keys) + 1.0
    store.write(keys, rows)
    store.end_pass()
    store.end_pass()  # every row is now past its TTL: compaction would drop them all
    with pytest.raises(ValueError, match=rf"cannot create the shard {disk}/shard.h5.compact .*no space left"):
        store.compact()
    assert sorted(os.listdir(disk)) == ["shard.h5"]
    np.testing.assert_array_equal(store.read(keys), rows)  # nothing dropped, nothing changed
    store.close()
    reopened = EmbeddingStore(cfg, disk / "shard.h5", create=False)
    np.testing.assert_array_equal(reopened.read(keys), rows)
    reopened.close()


def test_hwmap_naming_a_missing_numa_node(tmp_path):
    node_dir = tmp_path / "sys/devices/system/node"
    (node_dir / "node0").mkdir(parents=True)
    vm = load_map(ROOT / "slurm/hwmaps/vm-2cpu.toml")  # NUMA node 0
    check_map_matches_machine(vm, root=str(tmp_path))
    dgx = load_map(ROOT / "slurm/hwmaps/dgx-a100.toml")  # NUMA nodes 0-7
    with pytest.raises(ValueError, match=r"dgx-a100.toml names NUMA node\(s\) 1-7, which this machine .* "
                                         r"does not have \(its nodes: 0\)"):
        check_map_matches_machine(dgx, root=str(tmp_path))
