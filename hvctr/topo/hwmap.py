"""The hardware map: one node type's NUMA nodes, GPUs, NICs and SSDs, as editable TOML.

The map is data, not arithmetic: which NUMA node a GPU hangs off is read from the machine
(or from a public capture) and written down, never derived from its index. A DGX A100 puts
GPU 0 on NUMA node 3; ``local_rank // gpus_per_socket`` would say 0.

    hwmap = load_map("slurm/hwmaps/dgx-a100.toml")
    write_map(hwmap, "mynode.toml")     # what ``hvctr topo --out`` does

A ``numa_node`` of -1 means unknown (sysfs says -1 for a PCI device whose firmware did not
tell; a capture may not show it). Placement accepts unknown only where it cannot matter
(a map with one NUMA node) or where a fallback is honest (an SSD or NIC shared by all).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from hvctr.formats import safefile
from hvctr.formats.tomlfile import read_toml

UNKNOWN = -1


@dataclass(frozen=True)
class NumaNode:
    node: int
    cpus: tuple[int, ...]  # ascending; may be empty (a memory-only node)
    memory_gib: float = 0.0  # 0: unknown


@dataclass(frozen=True)
class Gpu:
    index: int  # nvidia-smi's index: PCI bus order (CUDA's too with CUDA_DEVICE_ORDER=PCI_BUS_ID)
    numa_node: int = UNKNOWN
    pci_bus_id: str = ""  # "0000:07:00.0"; "" unknown
    model: str = ""
    nic: str = ""  # the NIC nearest this GPU (a [[nic]] name or hca); "" none named


@dataclass(frozen=True)
class Nic:
    name: str  # network interface (HOROVOD_GLOO_IFACE, OMPI_MCA_btl_tcp_if_include)
    numa_node: int = UNKNOWN
    hca: str = ""  # RDMA device (UCX_NET_DEVICES, NCCL_IB_HCA); "" none
    pci_bus_id: str = ""


@dataclass(frozen=True)
class Ssd:
    path: str  # the directory hvctr writes shard and spill files into
    numa_node: int = UNKNOWN
    mount: str = ""
    device: str = ""
    rotational: bool = False  # what the kernel reports; virtio disks always say rotational


@dataclass(frozen=True)
class HardwareMap:
    name: str
    numa: tuple[NumaNode, ...]
    gpus: tuple[Gpu, ...] = ()
    nics: tuple[Nic, ...] = ()
    ssds: tuple[Ssd, ...] = ()
    source: str = ""  # how the map was made (discovery sources, capture URL)
    path: str = field(default="", compare=False)  # the file it was loaded from

    def node(self, node: int) -> NumaNode:
        for n in self.numa:
            if n.node == node:
                return n
        raise KeyError(node)

    @property
    def node_ids(self) -> list[int]:
        return [n.node for n in self.numa]

    def find_nic(self, name: str) -> Nic | None:
        return next((n for n in self.nics if name in (n.name, n.hca) and name), None)


# cpu lists ----------------------------------------------------------------------------


def parse_cpulist(text: str, where: str = "cpu list") -> tuple[int, ...]:
    """Linux's list format, "0-15,64-79" -> (0, ..., 15, 64, ..., 79); "" -> ()."""
    out: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if hi else int(lo)
        except ValueError:
            raise ValueError(f"{where}: {text!r} is not a cpu list like '0-15,64-79'") from None
        if a < 0 or b < a:
            raise ValueError(f"{where}: bad range {part!r} in {text!r}")
        out.update(range(a, b + 1))
    return tuple(sorted(out))


def format_cpulist(cpus: Iterable[int]) -> str:
    """(0, 1, 2, 5) -> "0-2,5"."""
    cpus = sorted(set(cpus))
    parts, i = [], 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(parts)


def cpu_ranges(cpus: Iterable[int]) -> list[list[int]]:
    """Runs of consecutive cpus: (0..3, 8..11) -> [[0..3], [8..11]]."""
    runs: list[list[int]] = []
    for c in sorted(set(cpus)):
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return runs


# loading and validation ---------------------------------------------------------------

_KEYS = {
    "numa": {"node": int, "cpus": str, "memory_gib": float},
    "gpu": {"index": int, "numa_node": int, "pci_bus_id": str, "model": str, "nic": str},
    "nic": {"name": str, "numa_node": int, "hca": str, "pci_bus_id": str},
    "ssd": {"path": str, "numa_node": int, "mount": str, "device": str, "rotational": bool},
}
_REQUIRED = {"numa": ("node", "cpus"), "gpu": ("index",), "nic": ("name",), "ssd": ("path",)}


def _entries(raw: dict[str, Any], table: str, where: str) -> list[dict[str, Any]]:
    items = raw.get(table, [])
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise ValueError(f"{where}: '{table}' must be an array of tables ([[{table}]])")
    out = []
    for i, item in enumerate(items):
        at = f"{where}: {table}[{i}]"
        unknown = sorted(set(item) - set(_KEYS[table]))
        if unknown:
            raise ValueError(f"{at}: unknown key(s) {unknown}; valid keys: {sorted(_KEYS[table])}")
        for key in _REQUIRED[table]:
            if key not in item:
                raise ValueError(f"{at}: missing key {key!r}")
        clean = {}
        for key, value in item.items():
            typ = _KEYS[table][key]
            ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
            if typ is float and isinstance(value, int) and not isinstance(value, bool):
                value, ok = float(value), True  # memory_gib = 128 is a float to a person
            if not ok:
                raise ValueError(f"{at}.{key} = {value!r}: expected {typ.__name__}")
            clean[key] = value
        out.append(clean)
    return out


def map_from_dict(raw: dict[str, Any], where: str = "hardware map") -> HardwareMap:
    unknown = sorted(set(raw) - {"name", "source", *_KEYS})
    if unknown:
        raise ValueError(f"{where}: unknown top-level key(s) {unknown}; valid: "
                         f"{sorted({'name', 'source', *_KEYS})}")
    numa = [NumaNode(node=e["node"], cpus=parse_cpulist(e["cpus"], f"{where}: numa node {e['node']} cpus"),
                     memory_gib=e.get("memory_gib", 0.0)) for e in _entries(raw, "numa", where)]
    hwmap = HardwareMap(
        name=str(raw.get("name", "")),
        source=str(raw.get("source", "")),
        numa=tuple(sorted(numa, key=lambda n: n.node)),
        gpus=tuple(sorted((Gpu(**e) for e in _entries(raw, "gpu", where)), key=lambda g: g.index)),
        nics=tuple(Nic(**e) for e in _entries(raw, "nic", where)),
        ssds=tuple(Ssd(**e) for e in _entries(raw, "ssd", where)),
    )
    validate_map(hwmap, where)
    return hwmap


def validate_map(hwmap: HardwareMap, where: str = "hardware map") -> None:
    """Raises ValueError naming the entry when the map contradicts itself."""
    if not hwmap.numa:
        raise ValueError(f"{where}: no [[numa]] nodes; a map needs at least one")
    ids = hwmap.node_ids
    if len(set(ids)) != len(ids):
        raise ValueError(f"{where}: NUMA node ids repeat: {ids}")
    seen: dict[int, int] = {}
    for n in hwmap.numa:
        for c in n.cpus:
            if c in seen:
                raise ValueError(f"{where}: cpu {c} is in NUMA node {seen[c]} and in node {n.node}")
            seen[c] = n.node
    if not seen:
        raise ValueError(f"{where}: no NUMA node has cpus")
    for kind, items in (("gpu", hwmap.gpus), ("nic", hwmap.nics), ("ssd", hwmap.ssds)):
        for i, item in enumerate(items):
            if item.numa_node != UNKNOWN and item.numa_node not in ids:
                raise ValueError(f"{where}: {kind}[{i}].numa_node = {item.numa_node}: no such NUMA node "
                                 f"(nodes: {ids}; -1 means unknown)")
    indices = [g.index for g in hwmap.gpus]
    if indices != list(range(len(indices))):
        raise ValueError(f"{where}: gpu indices must be 0..{len(indices) - 1} without gaps, got {indices}")
    names = [n.name for n in hwmap.nics]
    if len(set(names)) != len(names):
        raise ValueError(f"{where}: NIC names repeat: {names}")
    for g in hwmap.gpus:
        if g.nic and hwmap.find_nic(g.nic) is None:
            raise ValueError(f"{where}: gpu {g.index}.nic = {g.nic!r} is not a [[nic]] name or hca "
                             f"(nics: {names})")


def load_map(path: str | Path) -> HardwareMap:
    path = Path(path)
    raw = read_toml(path, "hardware map", " (see slurm/hwmaps/, or write one with `hvctr topo --out`)")
    hwmap = map_from_dict(raw, str(path))
    return HardwareMap(**{**hwmap.__dict__, "path": str(path)})


# writing ------------------------------------------------------------------------------


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _numa_comment(node: int) -> str:
    return "  # unknown: edit" if node == UNKNOWN else ""


def to_toml(hwmap: HardwareMap, header: Iterable[str] = ()) -> str:
    """A readable map: one table per device, comments where a person should look."""
    lines = [f"# {h}" if h else "#" for h in header]
    lines += [
        "# hvctr hardware map: edit freely, hvctr reads only what is written here.",
        "# numa_node = -1 means unknown. GPU index = nvidia-smi's index (PCI bus order).",
        "# Placement: local rank i -> gpu i -> its numa_node -> a fair share of that node's cpus,",
        "# the SSD and NIC on that node. Without GPUs, ranks are spread over the nodes with cpus.",
        f"name = {_q(hwmap.name)}",
        f"source = {_q(hwmap.source)}",
    ]
    for n in hwmap.numa:
        mem = repr(round(n.memory_gib, 1)) + ("  # unknown" if n.memory_gib == 0 else "")
        lines += ["", "[[numa]]", f"node = {n.node}", f"cpus = {_q(format_cpulist(n.cpus))}",
                  f"memory_gib = {mem}"]
    for g in hwmap.gpus:
        lines += ["", "[[gpu]]", f"index = {g.index}", f"numa_node = {g.numa_node}{_numa_comment(g.numa_node)}",
                  f"pci_bus_id = {_q(g.pci_bus_id)}", f"model = {_q(g.model)}", f"nic = {_q(g.nic)}"]
    for n in hwmap.nics:
        lines += ["", "[[nic]]", f"name = {_q(n.name)}", f"numa_node = {n.numa_node}{_numa_comment(n.numa_node)}",
                  f"hca = {_q(n.hca)}", f"pci_bus_id = {_q(n.pci_bus_id)}"]
    for s in hwmap.ssds:
        lines += ["", "[[ssd]]", f"path = {_q(s.path)}  # shard and spill files go here",
                  f"numa_node = {s.numa_node}{_numa_comment(s.numa_node)}", f"mount = {_q(s.mount)}",
                  f"device = {_q(s.device)}", f"rotational = {'true' if s.rotational else 'false'}"]
    return "\n".join(lines) + "\n"


def write_map(hwmap: HardwareMap, path: str | Path, header: Iterable[str] = ()) -> None:
    path = Path(path)
    text = to_toml(hwmap, header)
    map_from_dict(tomllib.loads(text), f"{path} (as written)")  # never write a map we cannot read
    safefile.write_text(path, text)  # a fresh temporary file, then renamed: never through a planted link
