"""Discovery on recorded topologies: faked sysfs trees, lstopo XML, nvidia-smi topo -m captures."""

import os
from pathlib import Path

import pytest

from hvctr.topo.discover import (
    from_sysfs,
    map_from_nvidia_smi,
    merge,
    nearest_nics,
    parse_hwloc_bitmap,
    parse_lstopo_xml,
    parse_nvidia_smi_topo,
)
from hvctr.topo.hwmap import Gpu, HardwareMap, Nic, NumaNode, Ssd, format_cpulist, load_map, write_map

FIX = Path(__file__).parent / "fixtures" / "topo"


# A faked sysfs + procfs tree --------------------------------------------------------------


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(target, link.parent), link)


def _pci(root: Path, bus_id: str, cls: str, vendor: str, numa: int, device: str = "0x0000") -> Path:
    dev = root / "sys/devices/pci0000:00" / bus_id
    for name, value in (("class", cls), ("vendor", vendor), ("device", device), ("numa_node", str(numa))):
        _write(dev / name, value + "\n")
    _link(root / "sys/bus/pci/devices" / bus_id, dev)
    return dev


def fake_two_socket(root: Path) -> Path:
    """2 NUMA nodes x 4 cpus, 2 NVIDIA GPUs (one per node), a BMC VGA, an Ethernet NIC on node 0,
    an InfiniBand HCA with numa_node -1, an NVMe SSD on node 1 mounted at /scratch (partition)."""
    for n, cpus in ((0, "0-3"), (1, "4-7")):
        d = root / f"sys/devices/system/node/node{n}"
        _write(d / "cpulist", cpus + "\n")
        _write(d / "meminfo", f"Node {n} MemTotal:       16777216 kB\nNode {n} MemFree: 1 kB\n")
    _write(root / "proc/meminfo", "MemTotal:       33554432 kB\n")
    _pci(root, "0000:3b:00.0", "0x030200", "0x10de", 0, "0x20b0")
    _pci(root, "0000:d8:00.0", "0x030200", "0x10de", 1, "0x20b0")
    _pci(root, "0000:03:00.0", "0x030000", "0x1a03", 0)  # ASPEED BMC: a display controller, not a GPU
    eth = _pci(root, "0000:5e:00.0", "0x020000", "0x8086", 0)
    _write(eth / "net/ens1f0/address", "00:00:00:00:00:01\n")
    _link(eth / "net/ens1f0/device", eth)
    _link(root / "sys/class/net/ens1f0", eth / "net/ens1f0")
    hca = _pci(root, "0000:86:00.0", "0x020700", "0x15b3", -1)
    _write(hca / "infiniband/mlx5_0/node_type", "1: CA\n")
    _link(hca / "infiniband/mlx5_0/device", hca)
    _link(root / "sys/class/infiniband/mlx5_0", hca / "infiniband/mlx5_0")
    _write(hca / "net/ib0/address", "x\n")
    _link(hca / "net/ib0/device", hca)
    _link(root / "sys/class/net/ib0", hca / "net/ib0")
    _write(root / "sys/devices/virtual/net/lo/address", "00:00:00:00:00:00\n")
    _link(root / "sys/class/net/lo", root / "sys/devices/virtual/net/lo")
    nvme = _pci(root, "0000:af:00.0", "0x010802", "0x144d", 1)
    disk = nvme / "nvme/nvme0/nvme0n1"
    _write(disk / "queue/rotational", "0\n")
    _write(disk / "nvme0n1p1/partition", "1\n")
    _link(root / "sys/class/block/nvme0n1", disk)
    _link(root / "sys/class/block/nvme0n1p1", disk / "nvme0n1p1")
    _write(root / "sys/devices/virtual/block/loop0/queue/rotational", "0\n")
    _link(root / "sys/class/block/loop0", root / "sys/devices/virtual/block/loop0")
    _write(root / "proc/mounts", "\n".join([
        "sysfs /sys sysfs rw 0 0",
        "/dev/nvme0n1p1 /scratch ext4 rw,relatime 0 0",
        "/dev/loop0 /snap/core squashfs ro 0 0",
        "tmpfs /tmp tmpfs rw 0 0",
    ]) + "\n")
    return root


def fake_vm(root: Path) -> Path:
    """This project's machine type as sysfs shows it: one node, virtio NIC and disk at numa_node -1."""
    _write(root / "sys/devices/system/node/node0/cpulist", "0-1\n")
    _write(root / "sys/devices/system/node/node0/meminfo", "Node 0 MemTotal:        7432396 kB\n")
    _write(root / "proc/meminfo", "MemTotal:       24684084 kB\n")
    net = _pci(root, "0000:00:03.0", "0x020000", "0x1af4", -1)
    _write(net / "virtio2/net/eth0/address", "02:fc:00:00:00:01\n")
    _link(net / "virtio2/net/eth0/device", net / "virtio2")
    _link(root / "sys/class/net/eth0", net / "virtio2/net/eth0")
    blk = _pci(root, "0000:00:02.0", "0x018000", "0x1af4", -1)
    _write(blk / "virtio1/block/vda/queue/rotational", "1\n")
    _link(root / "sys/class/block/vda", blk / "virtio1/block/vda")
    _write(root / "proc/mounts", "/dev/vda / ext4 rw,relatime 0 0\ntmpfs /dev/shm tmpfs rw 0 0\n")
    return root


# sysfs ------------------------------------------------------------------------------------


def test_sysfs_two_socket(tmp_path):
    m = from_sysfs(fake_two_socket(tmp_path), name="fake")
    assert m.numa == (NumaNode(0, (0, 1, 2, 3), 16.0), NumaNode(1, (4, 5, 6, 7), 16.0))
    assert m.gpus == (Gpu(0, 0, "0000:3b:00.0", "NVIDIA 0x20b0"), Gpu(1, 1, "0000:d8:00.0", "NVIDIA 0x20b0"))
    # ib0 resolves to the HCA's PCI device; its numa_node of -1 stays unknown
    assert m.nics == (Nic("ens1f0", 0, "", "0000:5e:00.0"), Nic("ib0", -1, "mlx5_0", "0000:86:00.0"))
    assert m.ssds == (Ssd("/scratch/hvctr", 1, "/scratch", "nvme0n1", False),)


def test_sysfs_vm_unknown_numa_filled_by_lstopo(tmp_path):
    base = from_sysfs(fake_vm(tmp_path), name="vm-2cpu")
    assert base.numa == (NumaNode(0, (0, 1), 23.5),)  # one node owns all of /proc/meminfo
    assert [(n.name, n.numa_node) for n in base.nics] == [("eth0", -1)]
    assert [(s.path, s.numa_node, s.rotational) for s in base.ssds] == [("/var/tmp/hvctr", -1, True)]
    merged = merge(base, parse_lstopo_xml((FIX / "lstopo_vm.xml").read_text()))
    assert merged.source == "sysfs+lstopo"
    assert [(n.name, n.numa_node) for n in merged.nics] == [("eth0", 0)]
    assert [(s.device, s.numa_node) for s in merged.ssds] == [("vda", 0)]


def test_discovered_map_round_trips_through_toml(tmp_path):
    m = from_sysfs(fake_two_socket(tmp_path / "root"), name="fake")
    write_map(m, tmp_path / "fake.toml", header=["test"])
    back = load_map(tmp_path / "fake.toml")
    assert back == m and back.path == str(tmp_path / "fake.toml")
    assert not list(tmp_path.glob("*.tmp"))


# lstopo XML -------------------------------------------------------------------------------


def test_hwloc_bitmaps():
    assert parse_hwloc_bitmap("0x000000f0") == (4, 5, 6, 7)
    assert parse_hwloc_bitmap("0x00000001,0x80000000") == (31, 32)
    assert parse_hwloc_bitmap("") == ()


def test_lstopo_synthetic_two_packages():
    info = parse_lstopo_xml((FIX / "lstopo_2pack.xml").read_text())
    assert [(n.node, format_cpulist(n.cpus), n.memory_gib) for n in info.numa] == [(0, "0-3", 14.9), (1, "4-7", 14.9)]
    assert info.pci_numa == {}


def test_lstopo_cpusets_wider_than_a_word():
    info = parse_lstopo_xml((FIX / "lstopo_2pack_96pu.xml").read_text())
    assert [(n.node, format_cpulist(n.cpus)) for n in info.numa] == [(0, "0-47"), (1, "48-95")]


def test_lstopo_io_devices_of_this_machine():
    info = parse_lstopo_xml((FIX / "lstopo_vm.xml").read_text())
    assert info.pci_numa == {"0000:00:02.0": 0, "0000:00:03.0": 0}
    assert info.osdevs == {"vda": "0000:00:02.0", "eth0": "0000:00:03.0"}


def test_lstopo_bad_xml_is_an_error():
    with pytest.raises(ValueError, match="lstopo XML"):
        parse_lstopo_xml("<topology><object")


# nvidia-smi topo -m -----------------------------------------------------------------------


def test_dgx_a100_capture():
    smi = parse_nvidia_smi_topo((FIX / "nvidia_smi_dgx_a100.txt").read_text())
    assert [node for _, _, node in smi.gpus] == [3, 3, 1, 1, 7, 7, 5, 5]
    assert format_cpulist(smi.gpus[0][1]) == "48-63,176-191"
    assert smi.nics == [f"mlx5_{i}" for i in range(10)]  # legend names, not NIC0..
    assert smi.links[("GPU0", "mlx5_1")] == "PXB" and smi.links[("GPU0", "GPU7")] == "NV12"
    # both GPUs of a pair see both of the pair's HCAs at PXB: one each
    assert nearest_nics(smi) == {g: f"mlx5_{g}" for g in range(8)}
    m = map_from_nvidia_smi((FIX / "nvidia_smi_dgx_a100.txt").read_text(), "dgx")
    assert [n.node for n in m.numa] == [1, 3, 5, 7]  # nodes without GPUs are not in a capture
    assert m.gpus[0].numa_node == 3 and m.gpus[0].nic == "mlx5_0"
    assert [n.numa_node for n in m.nics] == [3, 3, 1, 1, 7, 7, 5, 5, -1, -1]  # storage ports: SYS to all


def test_pcie_4090_capture():
    m = map_from_nvidia_smi((FIX / "nvidia_smi_pcie_8x4090_2socket.txt").read_text(), "pcie")
    assert [(n.node, format_cpulist(n.cpus)) for n in m.numa] == [(0, "0-55,112-167"), (1, "56-111,168-223")]
    assert [g.numa_node for g in m.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [g.nic for g in m.gpus] == ["", "", "", "", "", "", "NIC0", ""]  # only GPU 6 reaches them locally
    assert [(n.name, n.numa_node) for n in m.nics] == [("NIC0", 1), ("NIC1", 1)]


def test_old_capture_without_numa_column():
    m = map_from_nvidia_smi((FIX / "nvidia_smi_pcie_8gpu_2socket_mlx4.txt").read_text(), "old")
    assert [(n.node, format_cpulist(n.cpus)) for n in m.numa] == [(0, "0-9,20-29"), (1, "10-19,30-39")]
    assert [g.numa_node for g in m.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [g.nic for g in m.gpus] == ["mlx4_0"] * 4 + [""] * 4
    assert m.nics == (Nic("mlx4_0", 0, "mlx4_0", ""),)
    assert "no NUMA column" in m.source


def test_not_a_capture_is_an_error():
    with pytest.raises(ValueError, match="no header line"):
        parse_nvidia_smi_topo("No devices were found\n")


TWO_GPU = """\
\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tSYS\tPIX\t0-3\t0\t\tN/A
GPU1\tSYS\t X \tSYS\t4-7\t1\t\tN/A
NIC0\tPIX\tSYS\t X

NIC Legend:

  NIC0: mlx5_0
"""


def test_merge_takes_gpu_numa_and_nearest_nic_from_nvidia_smi(tmp_path):
    root = fake_two_socket(tmp_path)
    for bus in ("0000:3b:00.0", "0000:d8:00.0"):  # firmware that did not say
        (root / "sys/devices/pci0000:00" / bus / "numa_node").write_text("-1\n")
    base = from_sysfs(root, name="fake")
    assert [g.numa_node for g in base.gpus] == [-1, -1]
    m = merge(base, None, parse_nvidia_smi_topo(TWO_GPU))
    assert [(g.numa_node, g.nic) for g in m.gpus] == [(0, "mlx5_0"), (1, "")]
    assert m.source == "sysfs+nvidia-smi"


def test_shipped_maps_load():
    maps = {p.stem: load_map(p) for p in (Path(__file__).parents[2] / "slurm/hwmaps").glob("*.toml")}
    assert {"vm-2cpu", "dgx-a100", "pcie-8gpu-2socket", "pcie-8gpu-2socket-mlx4"} <= set(maps)
    dgx = maps["dgx-a100"]
    assert len(dgx.numa) == 8 and len(dgx.gpus) == 8
    assert dgx.gpus[0].numa_node == 3  # the map is data: GPU 0 is not on node 0
    assert isinstance(dgx, HardwareMap)
