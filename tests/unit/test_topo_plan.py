"""Placement plans on recorded maps, with the expected tables; maps that cannot be met are errors."""

from pathlib import Path

import pytest

from hvctr.topo.discover import parse_lstopo_xml
from hvctr.topo.hwmap import (
    Gpu,
    HardwareMap,
    Nic,
    NumaNode,
    Ssd,
    format_cpulist,
    load_map,
    map_from_dict,
    parse_cpulist,
)
from hvctr.topo.plan import format_plan, plan_node, plan_rank, share_cpus

ROOT = Path(__file__).parents[2]
FIX = Path(__file__).parent / "fixtures" / "topo"


def hwmap(name: str) -> HardwareMap:
    return load_map(ROOT / "slurm/hwmaps" / f"{name}.toml")


def lstopo_map() -> HardwareMap:
    """The synthetic two-package lstopo topology, with a NIC and an SSD on node 1."""
    numa = tuple(parse_lstopo_xml((FIX / "lstopo_2pack.xml").read_text()).numa)
    return HardwareMap(name="2pack", numa=numa, nics=(Nic("eth1", 1),), ssds=(Ssd("/nvme1/hvctr", 1),))


def test_cpu_lists():
    assert parse_cpulist("0-3,8,10-11") == (0, 1, 2, 3, 8, 10, 11)
    assert format_cpulist([11, 10, 8, 3, 2, 1, 0]) == "0-3,8,10-11"
    assert parse_cpulist("") == ()
    with pytest.raises(ValueError, match="bad range"):
        parse_cpulist("5-3")


def test_fair_share_keeps_hyperthread_siblings_together():
    node3 = parse_cpulist("48-63,176-191")
    assert format_cpulist(share_cpus(node3, 2, 0)) == "48-55,176-183"
    assert format_cpulist(share_cpus(node3, 2, 1)) == "56-63,184-191"
    shares = [share_cpus(node3, 3, i) for i in range(3)]
    assert sorted(c for s in shares for c in s) == list(node3)  # a partition: nothing lost, nothing twice
    assert [len(s) for s in shares] == [10, 10, 12]  # 16 = 5 + 5 + 6 per run


DGX_8 = """\
local_rank  gpu   pci_bus_id    numa  cpus             ncpus  ssd_dir      nic                notes
0           gpu0  0000:07:00.0  3     48-55,176-183    16     /raid/hvctr  ibp12s0 (mlx5_0)   SSD of unknown NUMA node
1           gpu1  0000:0f:00.0  3     56-63,184-191    16     /raid/hvctr  ibp18s0 (mlx5_1)   SSD of unknown NUMA node
2           gpu2  0000:47:00.0  1     16-23,144-151    16     /raid/hvctr  ibp75s0 (mlx5_2)   SSD of unknown NUMA node
3           gpu3  0000:4e:00.0  1     24-31,152-159    16     /raid/hvctr  ibp84s0 (mlx5_3)   SSD of unknown NUMA node
4           gpu4  0000:87:00.0  7     112-119,240-247  16     /raid/hvctr  ibp141s0 (mlx5_4)  SSD of unknown NUMA node
5           gpu5  0000:90:00.0  7     120-127,248-255  16     /raid/hvctr  ibp148s0 (mlx5_5)  SSD of unknown NUMA node
6           gpu6  0000:b7:00.0  5     80-87,208-215    16     /raid/hvctr  ibp186s0 (mlx5_6)  SSD of unknown NUMA node
7           gpu7  0000:bd:00.0  5     88-95,216-223    16     /raid/hvctr  ibp204s0 (mlx5_7)  SSD of unknown NUMA node"""


def test_dgx_a100_eight_ranks():
    assert format_plan(plan_node(hwmap("dgx-a100"), 8)) == DGX_8
    assert plan_rank(hwmap("dgx-a100"), 0, 8).numa_node == 3  # not local_rank // 4


PCIE_8 = """\
local_rank  gpu   pci_bus_id  numa  cpus            ncpus  ssd_dir  nic   notes
0           gpu0  -           0     0-13,112-125    28     -        NIC0  NIC on another NUMA node
1           gpu1  -           0     14-27,126-139   28     -        NIC1  NIC on another NUMA node
2           gpu2  -           0     28-41,140-153   28     -        NIC0  NIC on another NUMA node
3           gpu3  -           0     42-55,154-167   28     -        NIC1  NIC on another NUMA node
4           gpu4  -           1     56-69,168-181   28     -        NIC0
5           gpu5  -           1     70-83,182-195   28     -        NIC1
6           gpu6  -           1     84-97,196-209   28     -        NIC0
7           gpu7  -           1     98-111,210-223  28     -        NIC1"""


def test_pcie_two_socket_eight_ranks():
    assert format_plan(plan_node(hwmap("pcie-8gpu-2socket"), 8)) == PCIE_8


MLX4_4 = """\
local_rank  gpu   pci_bus_id  numa  cpus       ncpus  ssd_dir  nic           notes
0           gpu0  -           0     0-1,20-21  4      -        ib0 (mlx4_0)
1           gpu1  -           0     2-4,22-24  6      -        ib0 (mlx4_0)
2           gpu2  -           0     5-6,25-26  4      -        ib0 (mlx4_0)
3           gpu3  -           0     7-9,27-29  6      -        ib0 (mlx4_0)"""


def test_pcie_mlx4_four_ranks_use_the_first_socket():
    assert format_plan(plan_node(hwmap("pcie-8gpu-2socket-mlx4"), 4)) == MLX4_4


LSTOPO_3 = """\
local_rank  gpu  pci_bus_id  numa  cpus  ncpus  ssd_dir       nic   notes
0           -    -           0     0-1   2      /nvme1/hvctr  eth1  SSD on another NUMA node; NIC on another NUMA node
1           -    -           0     2-3   2      /nvme1/hvctr  eth1  SSD on another NUMA node; NIC on another NUMA node
2           -    -           1     4-7   4      /nvme1/hvctr  eth1"""


def test_cpu_only_ranks_fill_nodes_in_blocks():
    assert format_plan(plan_node(lstopo_map(), 3)) == LSTOPO_3
    assert [(p.numa_node, format_cpulist(p.cpus)) for p in plan_node(lstopo_map(), 4)] == [
        (0, "0-1"), (0, "2-3"), (1, "4-5"), (1, "6-7")]


VM_2 = """\
local_rank  gpu  pci_bus_id  numa  cpus  ncpus  ssd_dir         nic   notes
0           -    -           0     0     1      /var/tmp/hvctr  eth0
1           -    -           0     1     1      /var/tmp/hvctr  eth0"""


def test_this_machine_two_ranks():
    assert format_plan(plan_node(hwmap("vm-2cpu"), 2)) == VM_2


def test_oversubscription_is_an_error_unless_asked_for():
    with pytest.raises(ValueError, match=r"3 ranks on NUMA node 0 but only 2 cpus \(0-1\).*oversubscribe"):
        plan_node(hwmap("vm-2cpu"), 3)
    plans = plan_node(hwmap("vm-2cpu"), 3, oversubscribe=True)
    assert [p.cpus for p in plans] == [(0,), (1,), (0,)]
    assert all("cpus shared (oversubscribed)" in p.notes for p in plans)


def test_more_ranks_than_gpus_is_an_error():
    with pytest.raises(ValueError, match="9 ranks per node but the map has 8 GPUs"):
        plan_node(hwmap("dgx-a100"), 9)


def test_allowed_cpus_restrict_the_share():
    # A cgroup that gives the job half of node 3: both ranks share what is left, fairly.
    allowed = parse_cpulist("48-55,176-183")
    plans = plan_node(hwmap("dgx-a100"), 2, allowed)
    assert [format_cpulist(p.cpus) for p in plans] == ["48-51,176-179", "52-55,180-183"]
    # A cgroup on socket 0 only: rank 4's node 7 has none of its cpus.
    with pytest.raises(ValueError, match=r"NUMA node 7 \(local rank 4\) has none of the allowed cpus 0-63"):
        plan_node(hwmap("dgx-a100"), 8, range(64))


def test_gpu_of_unknown_numa_node():
    two = (NumaNode(0, (0, 1)), NumaNode(1, (2, 3)))
    with pytest.raises(ValueError, match="gpu 1 has numa_node = -1 .*write its node into the map"):
        plan_node(HardwareMap("x", two, gpus=(Gpu(0, 0), Gpu(1, -1))), 2)
    # With one node, unknown cannot be wrong.
    one = HardwareMap("x", (NumaNode(0, (0, 1, 2, 3)),), gpus=(Gpu(0, -1), Gpu(1, -1)))
    assert [(p.numa_node, p.cpus) for p in plan_node(one, 2)] == [(0, (0, 1)), (0, (2, 3))]


def test_bad_maps_name_the_entry():
    base = {"name": "x", "numa": [{"node": 0, "cpus": "0-3"}]}
    with pytest.raises(ValueError, match=r"gpu\[0\].numa_node = 9: no such NUMA node \(nodes: \[0\]"):
        map_from_dict({**base, "gpu": [{"index": 0, "numa_node": 9}]})
    with pytest.raises(ValueError, match="cpu 3 is in NUMA node 0 and in node 1"):
        map_from_dict({**base, "numa": [{"node": 0, "cpus": "0-3"}, {"node": 1, "cpus": "3-4"}]})
    with pytest.raises(ValueError, match=r"numa\[0\]: unknown key\(s\) \['cpu'\]"):
        map_from_dict({"numa": [{"node": 0, "cpu": "0-3"}]})
    with pytest.raises(ValueError, match="gpu indices must be 0..1 without gaps"):
        map_from_dict({**base, "gpu": [{"index": 0}, {"index": 2}]})
    with pytest.raises(ValueError, match="gpu 0.nic = 'mlx5_9' is not a"):
        map_from_dict({**base, "gpu": [{"index": 0, "nic": "mlx5_9"}]})
    with pytest.raises(ValueError, match=r"gpu\[0\].numa_node = '0': expected int"):
        map_from_dict({**base, "gpu": [{"index": 0, "numa_node": "0"}]})


def test_missing_map_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_map(tmp_path / "nope.toml")
