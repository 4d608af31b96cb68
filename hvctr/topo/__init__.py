"""Hardware maps and rank placement: where on the node each rank runs and keeps its data.

Owns the hardware map (TOML in slurm/hwmaps/: NUMA nodes, GPUs, NICs, SSDs), its discovery
(sysfs, ``lstopo --of xml``, ``nvidia-smi topo -m``), the placement plan (local rank -> GPU ->
NUMA node -> cpus, SSD directory, NIC) and applying it in-process once, before CUDA starts:

    local rank i --> gpu i --> NUMA node n (from the map, not from i)
                                 |-> a fair share of n's cpus   (sched_setaffinity, all threads)
                                 |-> memory on n                (set_mempolicy via libnuma)
                                 |-> the SSD on n               (shard and spill files)
                                 '-> the NIC on n               (exported by the launcher, checked here)

Nothing here talks to other ranks: the trainer gathers ``binding_report()`` and rank 0 logs
``format_binding_table(...)``.
"""

from hvctr.topo.bind import Placement, apply_placement, binding_report, format_binding_table
from hvctr.topo.hwmap import HardwareMap, load_map, write_map
from hvctr.topo.plan import RankPlan, format_plan, plan_node, plan_rank

__all__ = [
    "HardwareMap", "Placement", "RankPlan", "apply_placement", "binding_report", "format_binding_table",
    "format_plan", "load_map", "plan_node", "plan_rank", "write_map",
]
