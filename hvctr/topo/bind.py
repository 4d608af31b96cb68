"""Applying the plan in-process, once, before CUDA initialisation and large allocations.

    placement = apply_placement(cfg.topology, comm.local_rank, comm.local_size)
    rows = comm.allgather_object(binding_report(), name="binding")   # comm: in the trainer
    if comm.rank == 0: log.info("binding\\n" + format_binding_table(rows))

What it does, in this order:

1. cpu affinity: the plan's cpus intersected with those allowed at start (a Slurm cgroup),
   set for every thread of the process (``sched_setaffinity`` acts on one thread; Horovod's
   background thread already runs when this is called).
2. memory policy: ``set_mempolicy`` through libnuma (ctypes), else the raw system call.
   It covers this thread and threads started later. Threads started earlier keep the
   default policy, which with their new affinity means first touch on the rank's node.
3. ``torch.set_num_threads``: the plan's share, or ``topology.threads_per_rank``.
4. device: ``cuda:<n>`` for the plan's GPU (found by PCI bus id) if CUDA is available, else cpu.

The NIC cannot be chosen here: MPI and Horovod opened their connections before. The launcher
exports it per rank (``hvctr topo --exports``, ``slurm/hwmaps/rank_env.sh``); this module
checks the environment against the plan and warns on a mismatch.
Exactly one layer binds: launchers pass ``--bind-to none`` / ``--cpu-bind=none``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from hvctr.config import MemoryPolicy, TopologyConfig
from hvctr.log import get_logger
from hvctr.topo.hwmap import UNKNOWN, HardwareMap, format_cpulist, load_map
from hvctr.topo.plan import RankPlan, format_table, plan_rank

log = get_logger(__name__)

_RSS_WARN_BYTES = 2 << 30  # resident memory before binding above this: pages already placed elsewhere


@dataclass(frozen=True)
class Placement:
    """What a rank was given. ``cpus`` is the affinity set (or left) on every thread."""

    local_rank: int
    local_size: int
    device: str  # "cuda:<n>" or "cpu"
    gpu: int  # the map's GPU index; -1 none
    numa_node: int  # -1: no map, or not bound
    cpus: tuple[int, ...]
    threads: int  # torch intra-op threads of the plan (set when bound); 0: no plan, nothing decided
    memory_policy: str  # "preferred:3", "bind:3", "local", "default" (not bound)
    ssd_dir: str  # where the rank's shard and spill files go; "" when the map names none
    nic: str  # the network interface the launcher should have exported; "" none
    nic_hca: str
    bound: bool  # affinity and memory policy were applied
    hwmap: str  # the map's path ("" none, "auto" discovered)
    allowed_at_start: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()


# Process state, not rank state: affinity and memory policy belong to the process.
_applied: tuple[tuple, Placement] | None = None  # the last placement and its arguments
_start: tuple[tuple[int, ...], int] | None = None  # cpus allowed and torch threads before the first one


# memory policy ------------------------------------------------------------------------

_MPOL = {"default": 0, "preferred": 1, "bind": 2, "interleave": 3, "local": 4, "preferred_many": 5}
_SYSCALLS = {"x86_64": (238, 239), "aarch64": (237, 236), "ppc64le": (261, 260)}  # set_, get_mempolicy
_MASK_WORDS = 16  # 1024 nodes: get_mempolicy wants a mask at least as wide as the kernel's


def _mempolicy_calls() -> tuple[Any, Any, str]:
    """(set_mempolicy, get_mempolicy, how): libnuma's wrappers, else raw syscalls via libc."""
    for name in ("libnuma.so.1", ctypes.util.find_library("numa")):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name, use_errno=True)
            return lib.set_mempolicy, lib.get_mempolicy, "libnuma"
        except (OSError, AttributeError):
            continue
    nrs = _SYSCALLS.get(platform.machine())
    if nrs is None:
        return None, None, "unavailable"
    libc = ctypes.CDLL(None, use_errno=True)
    set_nr, get_nr = nrs
    return (lambda *a: libc.syscall(set_nr, *a)), (lambda *a: libc.syscall(get_nr, *a)), "syscall"


def set_memory_policy(policy: MemoryPolicy, node: int) -> str:
    """Applies the policy for this thread (and threads it starts); returns what is in force."""
    set_fn, _, how = _mempolicy_calls()
    if set_fn is None:
        log.warning("no libnuma and no known set_mempolicy syscall on %s: memory stays first-touch",
                    platform.machine())
        return current_memory_policy()
    mask = (ctypes.c_ulong * _MASK_WORDS)()
    if policy is MemoryPolicy.LOCAL:
        mode, mask_ptr, maxnode = _MPOL["local"], None, 0
    else:
        mode = _MPOL[policy.value]
        bits = 8 * ctypes.sizeof(ctypes.c_ulong)
        mask[node // bits] = 1 << (node % bits)
        mask_ptr, maxnode = mask, _MASK_WORDS * bits + 1  # the kernel counts maxnode - 1 bits
    if set_fn(mode, mask_ptr, ctypes.c_ulong(maxnode)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"set_mempolicy({policy.value}, node {node}) via {how}: {os.strerror(err)}")
    return current_memory_policy()


def reset_memory_policy() -> str:
    """Back to the kernel default (MPOL_DEFAULT) for this thread."""
    set_fn, _, how = _mempolicy_calls()
    if set_fn is not None and set_fn(_MPOL["default"], None, ctypes.c_ulong(0)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"set_mempolicy(default) via {how}: {os.strerror(err)}")
    return current_memory_policy()


def current_memory_policy() -> str:
    """This thread's policy as the kernel reports it: "default", "local", "preferred:3", "bind:0-1"."""
    _, get_fn, _ = _mempolicy_calls()
    if get_fn is None:
        return "unknown"
    mode = ctypes.c_int(0)
    mask = (ctypes.c_ulong * _MASK_WORDS)()
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    if get_fn(ctypes.byref(mode), mask, ctypes.c_ulong(_MASK_WORDS * bits), None, ctypes.c_ulong(0)) != 0:
        return "unknown"
    name = {v: k for k, v in _MPOL.items()}.get(mode.value & 0xFF, f"mode{mode.value}")
    nodes = [w * bits + b for w in range(_MASK_WORDS) for b in range(bits) if mask[w] >> b & 1]
    return f"{name}:{format_cpulist(nodes)}" if nodes and name not in ("default", "local") else name


# affinity -----------------------------------------------------------------------------


def set_process_affinity(cpus: Sequence[int]) -> None:
    """sched_setaffinity on every thread: the call itself only moves the calling one."""
    os.sched_setaffinity(0, cpus)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that ended meanwhile


def outer_binding_warnings(env: Mapping[str, str]) -> list[str]:
    """Launchers that bind too: then two layers fight and ranks see a sliver of the node."""
    out = []
    if "OMPI_COMM_WORLD_RANK" in env and env.get("OMPI_MCA_hwloc_base_binding_policy", "") != "none":
        out.append("mpirun binds ranks as well (it does by default): pass --bind-to none")
    cpu_bind = env.get("SLURM_CPU_BIND_TYPE", "")
    if cpu_bind and not cpu_bind.startswith("none"):
        out.append(f"srun binds ranks as well (SLURM_CPU_BIND_TYPE={cpu_bind}): pass --cpu-bind=none")
    return out


# NIC ----------------------------------------------------------------------------------


def nic_exports(nic: str, hca: str) -> dict[str, str]:
    """The variables a launcher exports so that MPI, Gloo, UCX and NCCL use the plan's NIC."""
    if not nic:
        return {}
    out = {"HOROVOD_GLOO_IFACE": nic, "OMPI_MCA_btl_tcp_if_include": nic, "NCCL_SOCKET_IFNAME": nic,
           "UCX_NET_DEVICES": f"{hca}:1" if hca else nic}
    if hca:
        out["NCCL_IB_HCA"] = hca
    return out


_PREFIX_VARS = ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA")  # NCCL matches prefixes unless a name starts with "="


def _names(var: str, value: str, nic: str, hca: str) -> tuple[bool, bool]:
    """(is an exclusion list, names the plan's NIC) for one variable's value."""
    exclude = value.startswith("^")
    want = [n for n in (nic, hca) if n]
    hit = False
    for item in value.lstrip("^").split(","):
        name = item.split(":")[0]  # UCX and NCCL append ":port"
        if var in _PREFIX_VARS and not name.startswith("="):
            hit |= any(w.startswith(name) for w in want if name)
        else:
            hit |= name.lstrip("=") in want
    return exclude, hit


def nic_env_warnings(nic: str, hca: str, env: Mapping[str, str]) -> list[str]:
    """Variables that name a different NIC than the plan's. Unset variables are fine."""
    if not nic:
        return []
    out = []
    for var in ("HOROVOD_GLOO_IFACE", "OMPI_MCA_btl_tcp_if_include", "NCCL_SOCKET_IFNAME",
                "UCX_NET_DEVICES", "NCCL_IB_HCA"):
        value = env.get(var, "")
        if not value or "/" in value or value == "all":  # unset, a CIDR subnet, UCX's default
            continue
        exclude, hit = _names(var, value, nic, hca)
        if exclude and hit:
            out.append(f"{var}={value} excludes the planned NIC {nic}")
        elif not exclude and not hit:
            out.append(f"{var}={value} does not name the planned NIC {nic}" + (f" ({hca})" if hca else ""))
    return out


# device -------------------------------------------------------------------------------


def _select_device(plan: RankPlan | None, local_rank: int) -> tuple[str, list[str]]:
    import torch

    notes = []
    if plan is not None and plan.gpu >= 0:
        # nvidia-smi and the map count GPUs in PCI bus order; CUDA does too only when told.
        if os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID") != "PCI_BUS_ID":
            notes.append(f"CUDA_DEVICE_ORDER={os.environ['CUDA_DEVICE_ORDER']}: GPU indices may not match the map")
    if not torch.cuda.is_available():
        return "cpu", notes
    count = torch.cuda.device_count()
    if plan is None or plan.gpu < 0:
        return f"cuda:{local_rank % count}", notes
    want = _pci_tuple(plan.gpu_pci_bus_id)
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        found = tuple(getattr(props, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
        if want and found == want:
            return f"cuda:{i}", notes
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None and plan.gpu < count:
        return f"cuda:{plan.gpu}", notes
    listed = [v.strip() for v in (visible or "").split(",")]
    if str(plan.gpu) in listed and all(v.isdigit() for v in listed) and listed.index(str(plan.gpu)) < count:
        return f"cuda:{listed.index(str(plan.gpu))}", notes  # indices in the list follow PCI bus order
    if count == 1:
        notes.append("one visible GPU, taken without checking its PCI bus id")
        return "cuda:0", notes
    raise ValueError(f"the plan's gpu {plan.gpu} ({plan.gpu_pci_bus_id or 'no PCI bus id in the map'}) is not "
                     f"among the {count} visible CUDA devices (CUDA_VISIBLE_DEVICES={visible})")


def _pci_tuple(bus_id: str) -> tuple[int, int, int] | None:
    """"0000:07:00.0" or nvidia-smi's "00000000:07:00.0" -> (domain, bus, device)."""
    try:
        dom, bus, rest = bus_id.split(":")
        return int(dom, 16), int(bus, 16), int(rest.split(".")[0], 16)
    except ValueError:
        return None


# applying -----------------------------------------------------------------------------


def _load(cfg: TopologyConfig) -> HardwareMap | None:
    if not cfg.hwmap:
        return None
    if cfg.hwmap == "auto":
        from hvctr.topo.discover import discover

        return discover()
    try:
        return load_map(cfg.hwmap)
    except ValueError as e:
        raise ValueError(f"config key 'topology.hwmap': {e}") from None


def check_map_matches_machine(hwmap: HardwareMap, root: str = "/") -> None:
    """Every NUMA node the map names exists here (ValueError otherwise).

    Binding to a node the kernel does not have fails deep in set_mempolicy (EINVAL); a map
    for another node type should fail at start, naming the map. Without a sysfs node list
    (some containers) there is nothing to check against.
    """
    here = {int(p.name[4:]) for p in Path(root, "sys/devices/system/node").glob("node[0-9]*")}
    missing = sorted(set(hwmap.node_ids) - here)
    if here and missing:
        raise ValueError(f"config key 'topology.hwmap': {hwmap.path or hwmap.name} names NUMA node(s) "
                         f"{format_cpulist(missing)}, which this machine ({socket.gethostname()}) does not have "
                         f"(its nodes: {format_cpulist(sorted(here))}); the map is for another node type: "
                         f"write one for this node with `hvctr topo --out FILE`")


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def apply_placement(topology_cfg: TopologyConfig, local_rank: int, local_size: int) -> Placement:
    """Plans this rank's place on the node and applies it. Call once, right after init_comm.

    A second call with the same arguments returns the first result. With other arguments it
    re-plans from the cpus allowed at the first call and warns: memory already touched stays
    where it is (in-process test suites do this; a training job should not). A call that
    does not bind (no map, or bind = false) undoes an earlier binding.
    """
    global _applied, _start
    key = (topology_cfg, local_rank, local_size)
    if _applied is not None and _applied[0] == key:
        return _applied[1]
    import torch

    if _start is None:  # what the process was given, before any placement of ours
        _start = (tuple(sorted(os.sched_getaffinity(0))), torch.get_num_threads())
    allowed, start_threads = _start
    notes = outer_binding_warnings(os.environ)
    if torch.cuda.is_initialized():
        notes.append("CUDA was initialised before placement: its threads and pinned buffers may sit elsewhere")
    if _rss_bytes() > _RSS_WARN_BYTES:
        notes.append(f"{_rss_bytes() >> 20} MiB resident before placement: those pages keep their node")
    hwmap = _load(topology_cfg)
    if hwmap is not None and topology_cfg.bind:
        check_map_matches_machine(hwmap)
    plan = plan_rank(hwmap, local_rank, local_size, allowed, topology_cfg.oversubscribe) if hwmap else None
    notes += plan.notes if plan else ()
    bind = plan is not None and topology_cfg.bind
    if bind and _applied is not None:
        notes.append("placement applied again with other arguments: memory already touched keeps its node")
    threads = topology_cfg.threads_per_rank or (len(plan.cpus) if plan else 0)
    if bind:
        set_process_affinity(plan.cpus)
        policy = set_memory_policy(topology_cfg.memory_policy, plan.numa_node)
        torch.set_num_threads(threads)  # before the intra-op pool starts: its threads inherit both
    else:
        if _applied is not None and _applied[1].bound:  # undo our earlier binding
            set_process_affinity(allowed)
            reset_memory_policy()
            torch.set_num_threads(start_threads)
        policy = current_memory_policy()
    device, device_notes = _select_device(plan, local_rank)
    notes += device_notes
    notes += nic_env_warnings(plan.nic, plan.nic_hca, os.environ) if plan else ()
    placement = Placement(
        local_rank=local_rank, local_size=local_size, device=device, gpu=plan.gpu if plan else -1,
        numa_node=plan.numa_node if plan else UNKNOWN, cpus=plan.cpus if bind else allowed, threads=threads,
        memory_policy=policy, ssd_dir=plan.ssd_dir if plan else "", nic=plan.nic if plan else "",
        nic_hca=plan.nic_hca if plan else "", bound=bind, hwmap=(hwmap.path or topology_cfg.hwmap) if hwmap else "",
        allowed_at_start=allowed, notes=tuple(notes))
    for n in notes:
        log.warning("placement: %s", n)
    _applied = (key, placement)
    return placement


# threads of an unbound rank --------------------------------------------------------------

# Where the number of ranks sharing a node's cpus comes from, first set wins (launchers export them)
_LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")


def _slurm_tasks_here(env: Mapping[str, str]) -> int:
    """This node's tasks from SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE ("4(x2),3") and SLURM_NODEID."""
    for var in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        value, node = env.get(var, ""), env.get("SLURM_NODEID", "0")
        counts: list[int] = []
        try:
            for item in filter(None, value.split(",")):
                n, _, rep = item.partition("(x")
                counts += [int(n)] * (int(rep.rstrip(")")) if rep else 1)
            if counts:
                return counts[min(int(node), len(counts) - 1)]
        except ValueError:
            continue
    return 0


def launcher_local_size(env: Mapping[str, str]) -> tuple[int, str]:
    """(ranks the launcher started on this node, the variable that says so), or (0, "") where
    none does: OMPI_COMM_WORLD_LOCAL_SIZE (mpirun), MPI_LOCALNRANKS, SLURM_NTASKS_PER_NODE, then
    this node's entry of SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE (srun sets no
    OMPI_COMM_WORLD_* variable). Readable before MPI starts, unlike the host-name grouping."""
    for var in _LOCAL_SIZE_VARS:
        if env.get(var, "").strip().isdigit() and int(env[var]) > 0:
            return int(env[var]), var
    here = _slurm_tasks_here(env)
    return (here, "SLURM_STEP_TASKS_PER_NODE") if here else (0, "")


def default_threads(allowed: int, env: Mapping[str, str], local_size: int) -> tuple[int, str]:
    """(torch threads, where the number came from) for a rank that no hardware map binds.

    The rank's cpus (``allowed``: its affinity mask at start, e.g. the job's cgroup on the
    node) divided by the ranks sharing them on the node: the launcher's local size
    (OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS, SLURM_NTASKS_PER_NODE, SLURM_STEP_TASKS_PER_NODE),
    else ``local_size`` (ranks on this host). With SLURM_CPUS_PER_TASK, at most that many; a mask
    no larger than SLURM_CPUS_PER_TASK is the rank's own (srun bound it) and is not divided.
    At least 1.
    """
    local, source = launcher_local_size(env)
    if not local:
        local, source = max(1, local_size), "ranks on this host"
    per_task = int(env["SLURM_CPUS_PER_TASK"]) if env.get("SLURM_CPUS_PER_TASK", "").isdigit() else 0
    if per_task and allowed <= per_task:
        return max(1, allowed), f"{allowed} cpus in the rank's own affinity mask (SLURM_CPUS_PER_TASK={per_task})"
    n = allowed // local
    why = f"{allowed} cpus in the affinity mask / {local} rank{'s' if local != 1 else ''} sharing them ({source})"
    if per_task and per_task < n:
        n, why = per_task, why + f", at most SLURM_CPUS_PER_TASK={per_task}"
    return max(1, n), why


def rank_cpus(local_size: int) -> tuple[float, str]:
    """(cpus this rank has to itself, how that was counted): its affinity mask where a hardware
    map bound it, else the mask shared by the ranks on the node (the launcher's local size, else
    ``local_size``)."""
    allowed = len(os.sched_getaffinity(0))
    placement = applied_placement()
    if placement is not None and placement.bound:
        return float(allowed), f"{allowed} cpus bound by the hardware map"
    local, _ = launcher_local_size(os.environ)
    local = local or max(1, local_size)
    return allowed / local, f"{allowed} cpus shared by {local} rank{'s' if local != 1 else ''}"


def applied_placement() -> Placement | None:
    return _applied[1] if _applied else None


# reporting ----------------------------------------------------------------------------

_NIC_VARS = ("HOROVOD_GLOO_IFACE", "OMPI_MCA_btl_tcp_if_include", "UCX_NET_DEVICES", "NCCL_IB_HCA")


def binding_report(placement: Placement | None = None) -> dict[str, Any]:
    """This rank's effective binding, read back from the kernel, plus what the plan said.

    JSON-serialisable, for ``comm.allgather_object``. ``cpus`` and ``mempolicy`` are what is
    in force now (not what was asked for), so a rank that lost its binding shows it.
    """
    import torch

    p = placement or applied_placement()
    env_nic = ",".join(f"{v}={os.environ[v]}" for v in _NIC_VARS if os.environ.get(v))
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "local_rank": p.local_rank if p else -1,
        "numa_node": p.numa_node if p else UNKNOWN,
        "cpus": format_cpulist(os.sched_getaffinity(0)),
        "planned_cpus": format_cpulist(p.cpus) if p else "",
        "threads": torch.get_num_threads(),
        "mempolicy": current_memory_policy(),
        "device": p.device if p else "",
        "ssd_dir": p.ssd_dir if p else "",
        "nic": p.nic if p else "",
        "nic_env": env_nic,
        "bound": bool(p and p.bound),
        "notes": "; ".join(p.notes) if p else "not placed",
    }


def format_binding_table(reports: Sequence[Mapping[str, Any]]) -> str:
    """One line per rank (the list index is the rank), for rank 0's log."""
    cols = ["host", "local_rank", "numa_node", "cpus", "threads", "mempolicy", "device", "ssd_dir", "nic",
            "nic_env", "notes"]
    rows = [[r] + [rep.get(c, "") if rep.get(c, "") != "" else "-" for c in cols] for r, rep in enumerate(reports)]
    return format_table(["rank", "host", "local", "numa", "cpus", "threads", "mempolicy", "device", "ssd_dir", "nic",
                         "nic_env", "notes"], rows)


def placement_dict(p: Placement) -> dict[str, Any]:
    d = asdict(p)
    d["cpus"] = format_cpulist(p.cpus)
    d["allowed_at_start"] = format_cpulist(p.allowed_at_start)
    return d
