"""Applying a plan in a real process (a child, so this one keeps its binding), NIC checks, the CLI."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hvctr.cli import main
from hvctr.topo.bind import format_binding_table, nic_env_warnings, nic_exports, outer_binding_warnings

ROOT = Path(__file__).parents[2]
VM = str(ROOT / "slurm/hwmaps/vm-2cpu.toml")

CHILD = r"""
import json, os, sys, threading
import torch
from hvctr.config import TopologyConfig, MemoryPolicy
from hvctr.topo import apply_placement, binding_report
from hvctr.topo.bind import current_memory_policy
start = set(map(int, sys.argv[1].split(",")))
os.sched_setaffinity(0, start)              # what a cgroup or taskset would have given us
stop = threading.Event()
early = threading.Thread(target=stop.wait)  # a thread that exists before placement (Horovod's does)
early.start()
cfg = TopologyConfig(hwmap=sys.argv[2], memory_policy=MemoryPolicy(sys.argv[5]))
p = apply_placement(cfg, int(sys.argv[3]), int(sys.argv[4]))
out = {"cpus": sorted(os.sched_getaffinity(0)), "early": sorted(os.sched_getaffinity(early.native_id)),
       "policy": current_memory_policy(), "threads": torch.get_num_threads(), "device": p.device,
       "placed_cpus": list(p.cpus), "ssd": p.ssd_dir, "nic": p.nic, "report": binding_report()}
again = apply_placement(cfg, int(sys.argv[3]), int(sys.argv[4]))
out["same_object"] = again is p
undone = apply_placement(TopologyConfig(), 0, 1)   # no map: the earlier binding is undone
out["undone"] = [sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(early.native_id)),
                 current_memory_policy(), undone.bound]
stop.set(); early.join()
print(json.dumps(out))
"""


def run_child(start: str, local_rank: int, local_size: int, policy: str = "preferred") -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, start, VM, str(local_rank), str(local_size), policy],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_apply_binds_every_thread_and_the_memory_policy():
    out = run_child("0,1", 1, 2)
    assert out["cpus"] == [1] and out["early"] == [1]  # the thread started before placement moved too
    assert out["placed_cpus"] == [1]
    assert out["policy"] == "preferred:0"
    assert out["threads"] == 1 and out["device"] == "cpu"
    assert out["ssd"] == "/var/tmp/hvctr" and out["nic"] == "eth0"
    rep = out["report"]
    assert (rep["cpus"], rep["mempolicy"], rep["threads"], rep["numa_node"], rep["local_rank"]) == (
        "1", "preferred:0", 1, 0, 1)
    assert out["same_object"]
    assert out["undone"] == [[0, 1], [0, 1], "default", False]


def test_apply_with_bind_policy():
    out = run_child("0,1", 0, 2, "bind")
    assert out["cpus"] == [0] and out["policy"] == "bind:0"


def test_apply_intersects_with_the_cpus_allowed_at_start():
    # Allowed only cpu 1 at start (a cgroup): one rank gets it, not the map's 0-1.
    out = run_child("1", 0, 1)
    assert out["cpus"] == [1] and out["threads"] == 1
    assert out["undone"][0] == [1]  # undoing goes back to what was allowed, not to the whole map


def test_nic_exports_and_checks():
    ex = nic_exports("ibp12s0", "mlx5_0")
    assert ex == {"HOROVOD_GLOO_IFACE": "ibp12s0", "OMPI_MCA_btl_tcp_if_include": "ibp12s0",
                  "NCCL_SOCKET_IFNAME": "ibp12s0", "UCX_NET_DEVICES": "mlx5_0:1", "NCCL_IB_HCA": "mlx5_0"}
    assert nic_env_warnings("ibp12s0", "mlx5_0", ex) == []
    assert nic_env_warnings("ibp12s0", "mlx5_0", {}) == []  # nothing exported: nothing to contradict
    bad = nic_env_warnings("ibp12s0", "mlx5_0", {"UCX_NET_DEVICES": "mlx5_3:1", "HOROVOD_GLOO_IFACE": "eth0",
                                                "NCCL_SOCKET_IFNAME": "^ibp12s0", "OMPI_MCA_btl_tcp_if_include":
                                                "10.0.0.0/8"})
    # NCCL matches prefixes: "ib" covers ibp12s0, "mlx5" covers mlx5_0; "=mlx5_1" is exact.
    assert nic_env_warnings("ibp12s0", "mlx5_0", {"NCCL_SOCKET_IFNAME": "ib", "NCCL_IB_HCA": "mlx5"}) == []
    assert nic_env_warnings("ibp12s0", "mlx5_0", {"NCCL_IB_HCA": "=mlx5_1", "UCX_NET_DEVICES": "all"}) == [
        "NCCL_IB_HCA==mlx5_1 does not name the planned NIC ibp12s0 (mlx5_0)"]
    assert bad == ["HOROVOD_GLOO_IFACE=eth0 does not name the planned NIC ibp12s0 (mlx5_0)",
                   "NCCL_SOCKET_IFNAME=^ibp12s0 excludes the planned NIC ibp12s0",
                   "UCX_NET_DEVICES=mlx5_3:1 does not name the planned NIC ibp12s0 (mlx5_0)"]


def test_outer_binding_is_reported():
    assert outer_binding_warnings({"OMPI_COMM_WORLD_RANK": "0"}) == [
        "mpirun binds ranks as well (it does by default): pass --bind-to none"]
    assert outer_binding_warnings({"OMPI_COMM_WORLD_RANK": "0", "OMPI_MCA_hwloc_base_binding_policy": "none"}) == []
    assert outer_binding_warnings({"SLURM_CPU_BIND_TYPE": "mask_cpu:"}) == [
        "srun binds ranks as well (SLURM_CPU_BIND_TYPE=mask_cpu:): pass --cpu-bind=none"]
    assert outer_binding_warnings({"SLURM_CPU_BIND_TYPE": "none"}) == []


def test_binding_table():
    rows = [{"host": "n1", "local_rank": r, "numa_node": 3, "cpus": c, "threads": 8, "mempolicy": "preferred:3",
             "device": f"cuda:{r}", "ssd_dir": "/raid/hvctr", "nic": n, "nic_env": "", "notes": ""}
            for r, c, n in ((0, "48-55,176-183", "ibp12s0"), (1, "56-63,184-191", "ibp18s0"))]
    assert format_binding_table(rows) == (
        "rank  host  local  numa  cpus           threads  mempolicy    device  ssd_dir      nic      nic_env  notes\n"
        "0     n1    0      3     48-55,176-183  8        preferred:3  cuda:0  /raid/hvctr  ibp12s0  -        -\n"
        "1     n1    1      3     56-63,184-191  8        preferred:3  cuda:1  /raid/hvctr  ibp18s0  -        -")


def test_cli_plan_exports_and_errors(capsys, tmp_path):
    assert main(["topo", "--plan", "--local-size", "2", "--map", VM]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[3].split() == ["1", "-", "-", "0", "1", "1", "/var/tmp/hvctr", "eth0"]
    assert main(["topo", "--exports", "--map", str(ROOT / "slurm/hwmaps/dgx-a100.toml"),
                 "--local-rank", "6", "--local-size", "8"]) == 0
    assert "export UCX_NET_DEVICES=mlx5_6:1" in capsys.readouterr().out.splitlines()
    assert main(["topo", "--plan", "--local-size", "3", "--map", VM]) == 2
    assert "3 ranks on NUMA node 0 but only 2 cpus" in capsys.readouterr().err
    assert main(["topo", "--plan", "--local-size", "3", "--map", VM, "--topology.oversubscribe=true"]) == 0
    capsys.readouterr()
    assert main(["topo", "--sysfs-only", "--name", "here", "--out", str(tmp_path / "here.toml")]) == 0
    assert 'name = "here"' in (tmp_path / "here.toml").read_text()


@pytest.mark.parametrize("bad", ["nope.toml"])
def test_apply_with_a_missing_map_names_the_key(bad):
    r = subprocess.run([sys.executable, "-c", "from hvctr.config import TopologyConfig\n"
                        "from hvctr.topo import apply_placement\n"
                        f"apply_placement(TopologyConfig(hwmap={bad!r}), 0, 1)"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode != 0 and "config key 'topology.hwmap': hardware map nope.toml does not exist" in r.stderr


def test_pci_bus_ids_compare_across_spellings():
    from hvctr.topo.bind import _pci_tuple

    # The map writes sysfs's 4-digit domain; nvidia-smi and CUDA print 8 digits.
    assert _pci_tuple("0000:07:00.0") == _pci_tuple("00000000:07:00.0") == (0, 7, 0)
    assert _pci_tuple("0000:bd:00.0") == (0, 0xBD, 0)
    assert _pci_tuple("") is None


def test_rank_cpus_shares_an_unbound_mask_among_the_launchers_ranks(monkeypatch):
    """storage.push_behind = auto reads it: an unbound rank has its mask over the ranks on the
    node (the launcher's local size first, else the count given)."""
    import os

    from hvctr.topo import bind

    monkeypatch.setattr(bind, "_applied", None)
    allowed = len(os.sched_getaffinity(0))
    for var in bind._LOCAL_SIZE_VARS:
        monkeypatch.delenv(var, raising=False)
    for var in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        monkeypatch.delenv(var, raising=False)
    assert bind.rank_cpus(4)[0] == allowed / 4
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    cpus, why = bind.rank_cpus(4)
    assert cpus == allowed / 2 and why == f"{allowed} cpus shared by 2 ranks"
