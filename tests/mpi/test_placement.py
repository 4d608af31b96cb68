"""Placement under mpirun (-np 2 and -np 3): each rank's affinity and reported binding equal the plan."""

import os
from pathlib import Path

from hvctr.config import TopologyConfig
from hvctr.log import setup_logging
from hvctr.topo import apply_placement, binding_report, format_binding_table, load_map, plan_rank
from hvctr.topo.hwmap import format_cpulist

VM = str(Path(__file__).parents[2] / "slurm/hwmaps/vm-2cpu.toml")


def _thread_affinities() -> dict[int, set[int]]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[int(tid)] = os.sched_getaffinity(int(tid))
        except ProcessLookupError:
            pass
    return out


def test_each_rank_is_bound_as_planned(comm):
    assert comm.num_nodes == 1  # one machine: the map of this machine type applies to every rank
    setup_logging(rank=comm.rank, world_size=comm.size)  # placement warnings go to this process's streams
    oversubscribe = comm.local_size > len(load_map(VM).numa[0].cpus)  # -np 3 on 2 cpus
    cfg = TopologyConfig(hwmap=VM, oversubscribe=oversubscribe)
    placement = apply_placement(cfg, comm.local_rank, comm.local_size)
    plan = plan_rank(load_map(VM), comm.local_rank, comm.local_size, placement.allowed_at_start, oversubscribe)
    try:
        assert os.sched_getaffinity(0) == set(plan.cpus)
        # Horovod's background thread was running before placement: it moved as well.
        assert all(cpus == set(plan.cpus) for cpus in _thread_affinities().values())
        report = binding_report()
        assert report["cpus"] == format_cpulist(plan.cpus) == format_cpulist(placement.cpus)
        assert report["mempolicy"] == f"preferred:{plan.numa_node}"
        assert report["threads"] == len(plan.cpus)
        assert (report["local_rank"], report["numa_node"], report["ssd_dir"], report["nic"], report["device"]) == (
            comm.local_rank, plan.numa_node, plan.ssd_dir, plan.nic, "cpu")
        # comm: allgather of every rank's binding; rank 0 prints the table as the trainer does
        reports = comm.allgather_object(report, name="t.binding")
        table = format_binding_table(reports)
        plans = [plan_rank(load_map(VM), r, comm.size, placement.allowed_at_start, oversubscribe)
                 for r in range(comm.size)]
        lines = table.splitlines()
        assert len(lines) == comm.size + 1
        for r, line in enumerate(lines[1:]):
            cells = line.split()
            assert cells[:5] == [str(r), reports[r]["host"], str(r), "0", format_cpulist(plans[r].cpus)]
        if comm.rank == 0:
            print("\n" + table)
    finally:
        undone = apply_placement(TopologyConfig(), comm.local_rank, comm.local_size)  # leave later tests unbound
    assert os.sched_getaffinity(0) == set(placement.allowed_at_start) and not undone.bound
    comm.barrier()
