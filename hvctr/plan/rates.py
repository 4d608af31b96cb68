"""Measured (or assumed) rates of a node type: what the planner turns bytes and rows into time.

A rates file is TOML, one ``[[rates]]`` table per number of ranks that ran at once on the
node when it was measured (ranks share memory bandwidth and cores, so the rates of 1 rank
alone and of 8 side by side differ):

    name = "vm-2cpu"
    source = "hvctr bench --calibrate, 2026-11-30 14:02, load average 3.1"
    [[rates]]
    ranks_per_node = 1
    compute_flops_per_s = 2.9e10   # dense forward + backward, per rank
    ...

``hvctr bench --calibrate`` writes one for this machine; a file for a machine you do not
have (the projection in docs/planning.md) is written by hand, and says which numbers are
assumptions. Every rate is per rank unless its name says per node.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path

from hvctr.formats import safefile
from hvctr.formats.tomlfile import read_toml

# field -> what it measures (written as a comment next to each value)
DOC = {
    "ranks_per_node": "ranks that ran at once on the node when these were measured",
    "compute_flops_per_s": "dense model forward + backward FLOP/s (6 * sum(in * out) per sample)",
    "dense_adam_params_per_s": "torch Adam step on the dense parameters, parameters/s",
    "sparse_keys_per_s": "gather of a batch's rows + per-row gradient sum, batch keys/s",
    "sparse_rows_per_s": "lazy Adam on embedding rows, rows/s",
    "step_overhead_s": "per training step besides the above (loss, Python, allocation)",
    "unique_keys_per_s": "distinct keys with inverse, one hash pass (hvctr.kernels.unique.unique_in_order: windows, routing, merge), keys/s",
    "cache_rows_per_s": "store reads answered by the CPU cache, rows/s",
    "cache_write_rows_per_s": "store writes into the CPU cache, rows/s",
    "new_rows_per_s": "rows created: init from the key, shard index insert, cache insert, rows/s",
    "shard_rows_per_s": "shard rows read with the file in the page cache, rows/s",
    "disk_rows_per_s": "shard rows read from the device (page cache dropped), rows/s: the device's, one process alone (ranks on one SSD share it)",
    "data_rows_per_s": "training data rows read from HDF5 data shards, rows/s",
    "alltoall_latency_s": "one alltoall of a few bytes",
    "allreduce_latency_s": "one grouped allreduce of a few bytes",
    "memcpy_bytes_per_s": "host memory copies (packing messages, fusion buffers), bytes/s",
    "intra_node_bytes_per_s": "collective payload between ranks of one node, bytes/s per rank",
    "nic_bytes_per_s": "across nodes, bytes/s per node; 0: not measured (one node)",
    "device_bytes_per_s": "host <-> accelerator copies, bytes/s; 0: no accelerator (the working set stays on the host)",
    "flush_rows_per_s": "dirty cached rows written back to the shard (end of pass, checkpoint), rows/s; 0: unknown",
    "shard_write_rows_per_s": "rows written back to random places of the shard, its pages in the page cache (storage.write_behind off), rows/s; 0: half shard_rows_per_s",
    "disk_write_rows_per_s": "rows written back to random places of the shard as under a memory limit (each page written, flushed to the device, dropped), rows/s, the device's; 0: half disk_rows_per_s",
    "gpu_flops_per_s": "GPU nodes: the dense model's forward + backward on the GPU, FLOP/s; 0: the map's GPU datasheet, derated (hvctr.plan.gpus)",
    "gpu_bytes_per_s": "GPU nodes: memory-bound kernels (gather, gradient sums, Adam), bytes/s; 0: the datasheet's HBM bandwidth, derated",
    "gpu_kernel_s": "GPU nodes: one kernel of a training step, its launch and eager PyTorch's dispatch, seconds; 0: assumed (hvctr.plan.gpus.KERNEL_S)",
    "gpu_sparse_keys_per_s": "GPU nodes: batch keys through the gather, the per-row gradient sum and lazy Adam on the GPU, keys/s; 0: assumed from the HBM bandwidth (hvctr.plan.gpus)",
}


@dataclass(frozen=True)
class Rates:
    ranks_per_node: int
    compute_flops_per_s: float
    dense_adam_params_per_s: float
    sparse_keys_per_s: float
    sparse_rows_per_s: float
    step_overhead_s: float
    unique_keys_per_s: float
    cache_rows_per_s: float
    cache_write_rows_per_s: float
    new_rows_per_s: float
    shard_rows_per_s: float
    disk_rows_per_s: float
    data_rows_per_s: float
    alltoall_latency_s: float
    allreduce_latency_s: float
    memcpy_bytes_per_s: float
    intra_node_bytes_per_s: float
    nic_bytes_per_s: float = 0.0
    device_bytes_per_s: float = 0.0
    flush_rows_per_s: float = 0.0
    shard_write_rows_per_s: float = 0.0
    disk_write_rows_per_s: float = 0.0
    gpu_flops_per_s: float = 0.0
    gpu_bytes_per_s: float = 0.0
    gpu_kernel_s: float = 0.0
    gpu_sparse_keys_per_s: float = 0.0


@dataclass(frozen=True)
class RatesFile:
    name: str
    source: str
    entries: tuple[Rates, ...]
    path: str = ""

    def for_ranks(self, ranks_per_node: int) -> Rates:
        """The entry measured with the most ranks at once, but no more than ``ranks_per_node``
        (the fewest when every entry had more)."""
        fit = [e for e in self.entries if e.ranks_per_node <= ranks_per_node]
        if fit:
            return max(fit, key=lambda e: e.ranks_per_node)
        return min(self.entries, key=lambda e: e.ranks_per_node)


def _check_entry(raw: dict, where: str) -> Rates:
    fields = {f.name: f for f in dataclasses.fields(Rates)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; valid keys: {sorted(fields)}")
    missing = sorted(n for n, f in fields.items() if n not in raw and f.default is dataclasses.MISSING)
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing} (run `hvctr bench --calibrate` to measure them)")
    clean = {}
    for name, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{where}.{name} = {value!r}: expected a number >= 0")
        clean[name] = int(value) if name == "ranks_per_node" else float(value)
    if clean["ranks_per_node"] < 1:
        raise ValueError(f"{where}.ranks_per_node must be >= 1")
    for name in ("compute_flops_per_s", "sparse_keys_per_s", "unique_keys_per_s", "cache_rows_per_s"):
        if clean[name] <= 0:
            raise ValueError(f"{where}.{name} must be > 0")
    return Rates(**clean)


def load_rates(path: str | Path) -> RatesFile:
    path = Path(path)
    raw = read_toml(path, "rates file", f": measure this machine with `hvctr bench --calibrate --rates {path}`, "
                                        f"or write one (see slurm/rates/)")
    unknown = sorted(set(raw) - {"name", "source", "rates"})
    if unknown:
        raise ValueError(f"rates file {path}: unknown top-level key(s) {unknown}; valid: name, source, [[rates]]")
    items = raw.get("rates", [])
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) for i in items):
        raise ValueError(f"rates file {path}: needs at least one [[rates]] table")
    entries = tuple(_check_entry(e, f"rates file {path}: rates[{i}]") for i, e in enumerate(items))
    counts = [e.ranks_per_node for e in entries]
    if len(set(counts)) != len(counts):
        raise ValueError(f"rates file {path}: ranks_per_node repeats: {counts}")
    return RatesFile(name=str(raw.get("name", "")), source=str(raw.get("source", "")),
                     entries=tuple(sorted(entries, key=lambda e: e.ranks_per_node)), path=str(path))


def _fmt(v: float | int) -> str:
    return str(v) if isinstance(v, int) else repr(float(f"{v:.4g}"))  # 4 digits: these are measurements


def rates_to_toml(rf: RatesFile, header: list[str] = ()) -> str:
    lines = [f"# {h}" for h in header]
    lines += ["# hvctr rates: what `hvctr plan` turns rows and bytes into seconds. Per rank unless",
              "# the name says per node. Written by `hvctr bench --calibrate`; edit freely.",
              f'name = "{rf.name}"', f'source = "{rf.source}"']
    for e in rf.entries:
        lines += ["", "[[rates]]"]
        lines += [f"{f.name} = {_fmt(getattr(e, f.name))}  # {DOC[f.name]}" for f in dataclasses.fields(Rates)]
    return "\n".join(lines) + "\n"


def write_rates(rf: RatesFile, path: str | Path, header: list[str] = ()) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = rates_to_toml(rf, list(header))
    tomllib.loads(text)  # never write a file we cannot read
    safefile.write_text(path, text)  # a fresh temporary file, then renamed: never through a planted link
