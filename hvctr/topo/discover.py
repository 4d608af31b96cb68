"""Discovery: a hardware map from sysfs, ``lstopo --of xml`` and ``nvidia-smi topo -m``.

Sources, in order of trust:

- sysfs is always there: NUMA nodes (``/sys/devices/system/node/node*/cpulist``, ``meminfo``),
  every PCI device's ``numa_node`` (-1: the firmware did not say), network interfaces and
  block devices resolved to their PCI device, mounts from ``/proc/mounts``.
- ``lstopo --of xml`` (hwloc) places a PCI device by its local cpus where ``numa_node`` is
  -1; used to fill unknowns only.
- ``nvidia-smi topo -m`` gives each GPU's NUMA affinity and the GPU-NIC distance matrix (the
  nearest NIC of each GPU); it wins for GPU NUMA nodes because NVIDIA's driver reads ACPI too.

Every parser takes text or a root directory, so tests run on recorded topologies.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field, replace
from pathlib import Path

from hvctr.topo.hwmap import UNKNOWN, Gpu, HardwareMap, Nic, NumaNode, Ssd, parse_cpulist

_PCI_ID = re.compile(r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
_GPU_VENDORS = {"0x10de": "NVIDIA", "0x1002": "AMD"}  # not 0x1a03 (ASPEED BMC VGA)
_SKIP_BLOCK = ("loop", "ram", "zram", "sr", "fd", "nbd")


# sysfs --------------------------------------------------------------------------------


def _read(path: Path, default: str = "") -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return default


def _pci_of(path: Path) -> str:
    """The PCI bus id a sysfs device path hangs off: the last path component that is one."""
    try:
        parts = path.resolve().parts
    except OSError:
        return ""
    ids = [p for p in parts if _PCI_ID.match(p)]
    return ids[-1].lower() if ids else ""


def _pci_numa(root: Path, pci: str) -> int:
    text = _read(root / "sys/bus/pci/devices" / pci / "numa_node", "-1")
    try:
        node = int(text)
    except ValueError:
        return UNKNOWN
    return node if node >= 0 else UNKNOWN  # the kernel writes -1 for "no information"


def _meminfo_gib(text: str) -> float:
    m = re.search(r"MemTotal:\s+(\d+)\s*kB", text)
    return round(int(m.group(1)) / (1 << 20), 1) if m else 0.0


def sysfs_numa(root: Path) -> list[NumaNode]:
    base = root / "sys/devices/system/node"
    nodes = []
    for d in sorted(base.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        nodes.append(NumaNode(node=int(d.name[4:]), cpus=parse_cpulist(_read(d / "cpulist"), str(d / "cpulist")),
                              memory_gib=_meminfo_gib(_read(d / "meminfo"))))
    whole = _meminfo_gib(_read(root / "proc/meminfo"))
    if not nodes:  # a kernel without NUMA support: the machine is one node
        cpus = parse_cpulist(_read(root / "sys/devices/system/cpu/online"), "cpu/online")
        return [NumaNode(node=0, cpus=cpus, memory_gib=whole)]
    if len(nodes) == 1 and whole:
        # One node owns all memory; its meminfo can miss hot-plugged (virtio-mem) blocks.
        nodes = [replace(nodes[0], memory_gib=max(nodes[0].memory_gib, whole))]
    return nodes


def sysfs_gpus(root: Path) -> list[Gpu]:
    out = []
    for dev in sorted((root / "sys/bus/pci/devices").glob("*")):
        cls, vendor = _read(dev / "class"), _read(dev / "vendor")
        if cls.startswith("0x03") and vendor in _GPU_VENDORS:  # display controller: VGA or 3D
            model = f"{_GPU_VENDORS[vendor]} {_read(dev / 'device')}"
            out.append(Gpu(index=len(out), numa_node=_pci_numa(root, dev.name.lower()),
                           pci_bus_id=dev.name.lower(), model=model))
    return out


def sysfs_nics(root: Path) -> list[Nic]:
    hcas = {}
    for ib in sorted((root / "sys/class/infiniband").glob("*")):
        pci = _pci_of(ib / "device")
        if pci:
            hcas[pci] = ib.name
    out = []
    for net in sorted((root / "sys/class/net").glob("*")):
        if not (net / "device").exists():
            continue  # lo, bridges, bonds, ifb: no hardware behind them
        pci = _pci_of(net)
        if not pci:
            continue
        out.append(Nic(name=net.name, numa_node=_pci_numa(root, pci), hca=hcas.get(pci, ""), pci_bus_id=pci))
    return out


def _disk_of(root: Path, dev: str) -> str:
    """The whole disk behind a block device name: nvme0n1p2 -> nvme0n1, vda1 -> vda."""
    block = root / "sys/class/block" / dev
    if (block / "partition").exists():
        return block.resolve().parent.name
    return dev


def _disk_numa(root: Path, disk: str) -> int:
    slaves = sorted((root / "sys/class/block" / disk / "slaves").glob("*"))
    if slaves:  # md / dm: local only if every member sits on one node
        nodes = {_disk_numa(root, _disk_of(root, s.name)) for s in slaves}
        return nodes.pop() if len(nodes) == 1 else UNKNOWN
    pci = _pci_of(root / "sys/class/block" / disk)
    return _pci_numa(root, pci) if pci else UNKNOWN


def ssd_dir_for(mount: str) -> str:
    # The root file system is shared with the OS; /var/tmp survives reboots, unlike /tmp on tmpfs.
    return "/var/tmp/hvctr" if mount == "/" else os.path.join(mount, "hvctr")


def sysfs_ssds(root: Path) -> list[Ssd]:
    out, seen = [], set()
    for line in _read(root / "proc/mounts").splitlines():
        fields = line.split()
        if len(fields) < 3 or not fields[0].startswith("/dev/"):
            continue
        dev = Path(fields[0]).name
        if fields[0].startswith("/dev/mapper/"):
            dev = Path(os.path.realpath(root / fields[0].lstrip("/"))).name
        disk = _disk_of(root, dev)
        if disk.startswith(_SKIP_BLOCK) or not (root / "sys/class/block" / disk).exists():
            continue
        mount = fields[1].replace("\\040", " ")
        if mount in seen or mount.startswith(("/boot", "/snap")):
            continue
        seen.add(mount)
        rotational = _read(root / "sys/class/block" / disk / "queue/rotational", "0") == "1"
        out.append(Ssd(path=ssd_dir_for(mount), numa_node=_disk_numa(root, disk), mount=mount,
                       device=disk, rotational=rotational))
    return out


def from_sysfs(root: str | Path = "/", name: str = "") -> HardwareMap:
    root = Path(root)
    return HardwareMap(name=name or socket.gethostname(), numa=tuple(sysfs_numa(root)),
                       gpus=tuple(sysfs_gpus(root)), nics=tuple(sysfs_nics(root)),
                       ssds=tuple(sysfs_ssds(root)), source="sysfs")


# lstopo XML ---------------------------------------------------------------------------


def parse_hwloc_bitmap(text: str) -> tuple[int, ...]:
    """hwloc's "0x000000ff" or "0xffffffff,0x0000000f" (32-bit words, most significant first)."""
    text = text.strip()
    if not text:
        return ()
    infinite = text.startswith("0xf...f,")
    words = text.removeprefix("0xf...f,").split(",")
    value = 0
    for w in words:
        value = (value << 32) | int(w, 16)
    assert not infinite or value, "infinite hwloc bitmaps never describe real cpus"
    return tuple(i for i in range(value.bit_length()) if value >> i & 1)


@dataclass
class LstopoInfo:
    numa: list[NumaNode] = field(default_factory=list)
    pci_numa: dict[str, int] = field(default_factory=dict)  # PCI bus id -> node (-1 unknown)
    osdevs: dict[str, str] = field(default_factory=dict)  # OS device name (eth0, mlx5_0, nvme0n1) -> PCI id


def parse_lstopo_xml(text: str) -> LstopoInfo:
    """NUMA nodes, each PCI device's NUMA node and OS device names from hwloc 2.x XML."""
    try:
        top = ET.fromstring(text)
    except ET.ParseError as e:
        raise ValueError(f"lstopo XML: {e}") from None
    info = LstopoInfo()

    def walk(obj: ET.Element, nodeset: str) -> None:
        nodeset = obj.get("nodeset", nodeset)  # I/O objects inherit their parent's locality
        kind = obj.get("type")
        if kind == "NUMANode":
            info.numa.append(NumaNode(node=int(obj.get("os_index", "0")),
                                      cpus=parse_hwloc_bitmap(obj.get("cpuset", "")),
                                      memory_gib=round(int(obj.get("local_memory", "0")) / (1 << 30), 1)))
        elif kind == "PCIDev":
            nodes = parse_hwloc_bitmap(nodeset)
            pci = obj.get("pci_busid", "").lower()
            info.pci_numa[pci] = nodes[0] if len(nodes) == 1 else UNKNOWN
            for osdev in obj.iter("object"):
                if osdev.get("type") == "OSDev" and osdev.get("name"):
                    info.osdevs[osdev.get("name")] = pci
        for child in obj.findall("object"):
            walk(child, nodeset)

    for obj in top.findall("object"):
        walk(obj, "")
    info.numa.sort(key=lambda n: n.node)
    return info


def run_lstopo() -> str | None:
    exe = shutil.which("lstopo-no-graphics") or shutil.which("lstopo")
    if not exe:
        return None
    try:
        r = subprocess.run([exe, "--of", "xml", "-"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


# nvidia-smi topo -m -------------------------------------------------------------------

_LEVELS = {"PIX": 0, "PXB": 1, "PHB": 2, "NODE": 3, "SYS": 4, "SOC": 4}  # nearer first


@dataclass
class SmiTopo:
    gpus: list[tuple[int, tuple[int, ...], int]]  # (index, cpu affinity, NUMA affinity or -1)
    nics: list[str]  # NIC names in column order (legend names when the capture has a legend)
    links: dict[tuple[str, str], str]  # (row device, column device) -> "PIX", "NV12", ...


def parse_nvidia_smi_topo(text: str) -> SmiTopo:
    """The matrix of ``nvidia-smi topo -m``: old (mlx5_0 columns, no NUMA column) and new formats."""
    lines = [ln.rstrip() for ln in text.expandtabs(8).splitlines()]
    try:
        h = next(i for i, ln in enumerate(lines) if re.match(r"^\s+GPU0\b", ln))
    except StopIteration:
        raise ValueError("nvidia-smi topo -m: no header line starting with GPU0") from None
    header = lines[h].replace("CPU Affinity", "CPU_Affinity").replace("NUMA Affinity", "NUMA_Affinity")
    header = header.replace("GPU NUMA ID", "GPU_NUMA_ID").split()
    devices = [c for c in header if c not in ("CPU_Affinity", "NUMA_Affinity", "GPU_NUMA_ID")]
    has_numa = "NUMA_Affinity" in header
    legend = dict(re.findall(r"^\s*(NIC\d+):\s*(\S+)", text, flags=re.M))
    gpus, links = [], {}
    for ln in lines[h + 1:]:
        cells = ln.split()
        if not cells or cells[0] not in devices:
            if cells and cells[0].startswith("Legend"):
                break
            continue
        row, rest = cells[0], cells[1:]
        for col, val in zip(devices, rest[: len(devices)]):
            links[(legend.get(row, row), legend.get(col, col))] = val
        tail = rest[len(devices):]
        if row.startswith("GPU"):
            cpus = parse_cpulist(tail[0], f"nvidia-smi topo -m: {row} CPU affinity") if tail and tail[0] != "N/A" else ()
            numa = int(tail[1]) if has_numa and len(tail) > 1 and tail[1].isdigit() else UNKNOWN
            gpus.append((int(row[3:]), cpus, numa))
    nics = [legend.get(d, d) for d in devices if not d.startswith("GPU")]
    return SmiTopo(gpus=sorted(gpus), nics=nics, links=links)


def nearest_nics(smi: SmiTopo) -> dict[int, str]:
    """Each GPU's nearest NIC (PIX before PXB before PHB before NODE; never across sockets).

    GPUs that share their nearest NICs get different ones where there are enough: on a DGX
    A100 GPU 0 and GPU 1 both see mlx5_0 and mlx5_1 at PXB, and take one each.
    """
    use = {n: 0 for n in smi.nics}
    out = {}
    for index, _, _ in smi.gpus:
        levels = {n: _LEVELS.get(smi.links.get((f"GPU{index}", n), "SYS"), 4) for n in smi.nics}
        best = min(levels.values(), default=4)
        if best >= _LEVELS["SYS"]:
            continue
        nic = min((n for n in smi.nics if levels[n] == best), key=lambda n: (use[n], smi.nics.index(n)))
        use[nic] += 1
        out[index] = nic
    return out


def nic_numa_from_smi(smi: SmiTopo) -> dict[str, int]:
    """A NIC sits on the NUMA node of any GPU that reaches it without crossing sockets."""
    numa = {index: node for index, _, node in smi.gpus}
    out = {}
    for nic in smi.nics:
        nodes = {numa[i] for i, _, _ in smi.gpus
                 if _LEVELS.get(smi.links.get((f"GPU{i}", nic), "SYS"), 4) < _LEVELS["SYS"] and numa[i] != UNKNOWN}
        out[nic] = nodes.pop() if len(nodes) == 1 else UNKNOWN
    return out


def map_from_nvidia_smi(text: str, name: str, source: str = "") -> HardwareMap:
    """A map from a capture alone: NUMA nodes are the GPUs' affinities (nodes without GPUs
    are not in a capture: add them by hand). PCI bus ids are not in it either."""
    smi = parse_nvidia_smi_topo(text)
    if any(node == UNKNOWN for _, _, node in smi.gpus):
        smi = _numa_from_affinity(smi)
        source = (source or "nvidia-smi topo -m") + " (no NUMA column: node ids numbered by CPU affinity)"
    nodes: dict[int, set[int]] = {}
    for _, cpus, node in smi.gpus:
        nodes.setdefault(node, set()).update(cpus)
    nic_numa, nearest = nic_numa_from_smi(smi), nearest_nics(smi)
    return HardwareMap(
        name=name, source=source or "nvidia-smi topo -m",
        numa=tuple(NumaNode(node=n, cpus=tuple(sorted(c))) for n, c in sorted(nodes.items())),
        gpus=tuple(Gpu(index=i, numa_node=node, nic=nearest.get(i, "")) for i, _, node in smi.gpus),
        nics=tuple(Nic(name=n, numa_node=nic_numa[n], hca=n if n.startswith("mlx") else "") for n in smi.nics),
    )


def _numa_from_affinity(smi: SmiTopo) -> SmiTopo:
    """Old nvidia-smi prints no NUMA column: each distinct CPU affinity is one node, numbered
    by its lowest cpu (Linux numbers nodes that way on the two-socket x86 boxes it ran on)."""
    sets = sorted({cpus for _, cpus, _ in smi.gpus}, key=lambda c: min(c, default=0))
    if not all(sets) or any(set(a) & set(b) for a in sets for b in sets if a is not b):
        raise ValueError("nvidia-smi topo -m capture: GPUs lack a NUMA column and their CPU affinities "
                         "overlap or are missing; write the map by hand")
    node = {cpus: i for i, cpus in enumerate(sets)}
    return SmiTopo(gpus=[(i, cpus, node[cpus]) for i, cpus, _ in smi.gpus], nics=smi.nics, links=smi.links)


def run_nvidia_smi() -> str | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        r = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 and "GPU0" in r.stdout else None


# merging ------------------------------------------------------------------------------


def merge(base: HardwareMap, lstopo: LstopoInfo | None = None, smi: SmiTopo | None = None) -> HardwareMap:
    """sysfs + what the tools add: unknown PCI NUMA nodes from hwloc, GPU NUMA and nearest
    NIC from nvidia-smi. sysfs's known values stay (they are what the kernel uses)."""
    sources = [base.source]

    def fill(node: int, pci: str) -> int:
        if node == UNKNOWN and lstopo is not None:
            return lstopo.pci_numa.get(pci, UNKNOWN)
        return node

    gpus = [replace(g, numa_node=fill(g.numa_node, g.pci_bus_id)) for g in base.gpus]
    nics = [replace(n, numa_node=fill(n.numa_node, n.pci_bus_id)) for n in base.nics]
    ssds = list(base.ssds)
    if lstopo is not None:
        sources.append("lstopo")
        for i, s in enumerate(ssds):
            if s.numa_node == UNKNOWN and s.device in lstopo.osdevs:
                ssds[i] = replace(s, numa_node=lstopo.pci_numa.get(lstopo.osdevs[s.device], UNKNOWN))
    if smi is not None and len(smi.gpus) == len(gpus):
        sources.append("nvidia-smi")
        nearest = nearest_nics(smi)
        for (index, _, node), g in zip(smi.gpus, list(gpus)):
            nic = nearest.get(index, "")
            nic = nic if any(nic in (n.name, n.hca) for n in nics) else ""
            gpus[index] = replace(g, numa_node=node if node != UNKNOWN else g.numa_node, nic=nic or g.nic)
    return replace(base, gpus=tuple(gpus), nics=tuple(nics), ssds=tuple(ssds), source="+".join(sources))


def discover(root: str | Path = "/", use_tools: bool = True, name: str = "") -> HardwareMap:
    """This machine's map. ``use_tools=False`` reads sysfs only (tests on faked trees)."""
    base = from_sysfs(root, name)
    if not use_tools:
        return base
    xml = run_lstopo()
    smi_text = run_nvidia_smi()
    return merge(base, parse_lstopo_xml(xml) if xml else None,
                 parse_nvidia_smi_topo(smi_text) if smi_text else None)
