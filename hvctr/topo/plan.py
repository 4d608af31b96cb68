"""The placement plan: (hardware map, local rank, local size) -> GPU, NUMA node, cpus, SSD, NIC.

    local rank i -> gpu i -> gpu.numa_node -> a fair share of that node's cpus
                 -> the SSD and the NIC on that node (the GPU's own nearest NIC first)

Without GPUs in the map, ranks are spread over the NUMA nodes that have cpus, in blocks
(ranks 0..k-1 on the first node). A pure function of its arguments: every rank computes the
whole node's plan and takes its row, so ranks agree without talking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from hvctr.topo.hwmap import UNKNOWN, HardwareMap, Nic, Ssd, cpu_ranges, format_cpulist


@dataclass(frozen=True)
class RankPlan:
    local_rank: int
    gpu: int  # the map's GPU index; -1 without GPUs
    gpu_pci_bus_id: str
    numa_node: int
    cpus: tuple[int, ...]
    ssd_dir: str  # "" when the map names no SSD
    nic: str  # network interface; "" when the map names none
    nic_hca: str
    notes: tuple[str, ...] = ()  # what is less than ideal (a remote SSD, shared cpus)


def _rank_nodes(hwmap: HardwareMap, local_size: int) -> list[tuple[int, int]]:
    """(gpu index or -1, NUMA node) for every local rank."""
    where = f"hardware map {hwmap.path or hwmap.name}"
    if hwmap.gpus:
        if local_size > len(hwmap.gpus):
            raise ValueError(f"{where}: {local_size} ranks per node but the map has {len(hwmap.gpus)} GPUs; "
                             "run at most one rank per GPU")
        cpu_nodes = [n.node for n in hwmap.numa if n.cpus]
        out = []
        for g in hwmap.gpus[:local_size]:
            node = g.numa_node
            if node == UNKNOWN:
                if len(cpu_nodes) > 1:
                    raise ValueError(f"{where}: gpu {g.index} has numa_node = -1 (unknown) and the map has "
                                     f"{len(cpu_nodes)} NUMA nodes with cpus; write its node into the map")
                node = cpu_nodes[0]  # one node: unknown cannot be wrong
            if not hwmap.node(node).cpus:
                raise ValueError(f"{where}: gpu {g.index} is on NUMA node {node}, which has no cpus")
            out.append((g.index, node))
        return out
    nodes = [n.node for n in hwmap.numa if n.cpus]
    # Blocks, not round robin: neighbouring ranks (who exchange the most in a ring) share a node.
    return [(-1, nodes[r * len(nodes) // local_size]) for r in range(local_size)]


def share_cpus(cpus: Sequence[int], parts: int, index: int) -> tuple[int, ...]:
    """Part ``index`` of ``parts`` fair shares of a node's cpus.

    Each run of consecutive cpus is split on its own, so with Linux's usual numbering of
    hyperthreads as a second run ("48-63,176-191") a rank gets whole cores: 48-55,176-183.
    Empty when the node has fewer cpus than parts.
    """
    runs = cpu_ranges(cpus)
    shares = [run[len(run) * index // parts: len(run) * (index + 1) // parts] for run in runs]
    own = tuple(c for s in shares for c in s)
    if all(len(run) >= parts for run in runs):
        return own
    flat = sorted(cpus)  # short runs (a cgroup's leftovers): split the whole list instead
    return tuple(flat[len(flat) * index // parts: len(flat) * (index + 1) // parts])


def _pick(items: Sequence, node: int, slot: int, kind: str, one_node: bool) -> tuple[object | None, str]:
    """The slot-th item on ``node`` (spread), else one of unknown locality, else any (remote).

    On a map with one NUMA node unknown locality cannot be wrong and earns no note.
    """
    unknown_note = "" if one_node else f"{kind} of unknown NUMA node"
    for group, note in (([i for i in items if i.numa_node == node], ""),
                        ([i for i in items if i.numa_node == UNKNOWN], unknown_note),
                        (list(items), f"{kind} on another NUMA node")):
        if group:
            return group[slot % len(group)], note
    return None, ""


def plan_node(hwmap: HardwareMap, local_size: int, allowed_cpus: Iterable[int] | None = None,
              oversubscribe: bool = False) -> list[RankPlan]:
    """The plan of every local rank. ``allowed_cpus``: the cpus the job may use (a cgroup)."""
    where = f"hardware map {hwmap.path or hwmap.name}"
    if local_size < 1:
        raise ValueError(f"local size must be >= 1, got {local_size}")
    allowed = set(allowed_cpus) if allowed_cpus is not None else None
    placed = _rank_nodes(hwmap, local_size)
    one_node = sum(1 for n in hwmap.numa if n.cpus) == 1
    plans = []
    for rank, (gpu, node) in enumerate(placed):
        peers = [r for r, (_, n) in enumerate(placed) if n == node]  # ranks sharing this node
        slot = peers.index(rank)
        node_cpus = [c for c in hwmap.node(node).cpus if allowed is None or c in allowed]
        notes = []
        if not node_cpus:
            raise ValueError(f"{where}: NUMA node {node} (local rank {rank}) has none of the allowed cpus "
                             f"{format_cpulist(allowed or ())}; the job's cpus are on other nodes")
        cpus = share_cpus(node_cpus, len(peers), slot)
        if len(peers) > len(node_cpus):
            if not oversubscribe:
                raise ValueError(
                    f"{where}: {len(peers)} ranks on NUMA node {node} but only {len(node_cpus)} cpus "
                    f"({format_cpulist(node_cpus)}); run fewer ranks or set topology.oversubscribe = true")
            cpus = (node_cpus[slot % len(node_cpus)],)
            notes.append("cpus shared (oversubscribed)")
        g = hwmap.gpus[gpu] if gpu >= 0 else None
        nic, nic_note = (hwmap.find_nic(g.nic), "") if g is not None and g.nic else (None, "")
        if nic is None:
            nic, nic_note = _pick(hwmap.nics, node, slot, "NIC", one_node)
        ssd, ssd_note = _pick(hwmap.ssds, node, slot, "SSD", one_node)
        notes += [n for n in (ssd_note, nic_note) if n]
        assert nic is None or isinstance(nic, Nic)
        assert ssd is None or isinstance(ssd, Ssd)
        plans.append(RankPlan(
            local_rank=rank, gpu=gpu, gpu_pci_bus_id=g.pci_bus_id if g else "", numa_node=node, cpus=cpus,
            ssd_dir=ssd.path if ssd else "", nic=nic.name if nic else "", nic_hca=nic.hca if nic else "",
            notes=tuple(notes)))
    return plans


def plan_rank(hwmap: HardwareMap, local_rank: int, local_size: int, allowed_cpus: Iterable[int] | None = None,
              oversubscribe: bool = False) -> RankPlan:
    if not 0 <= local_rank < local_size:
        raise ValueError(f"local rank {local_rank} is outside 0..{local_size - 1}")
    return plan_node(hwmap, local_size, allowed_cpus, oversubscribe)[local_rank]


def format_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def format_plan(plans: Sequence[RankPlan]) -> str:
    """The table ``hvctr topo --plan`` prints."""
    rows = []
    for p in plans:
        nic = f"{p.nic} ({p.nic_hca})" if p.nic_hca and p.nic_hca != p.nic else p.nic
        rows.append([p.local_rank, f"gpu{p.gpu}" if p.gpu >= 0 else "-", p.gpu_pci_bus_id or "-", p.numa_node,
                     format_cpulist(p.cpus), len(p.cpus), p.ssd_dir or "-", nic or "-", "; ".join(p.notes)])
    return format_table(["local_rank", "gpu", "pci_bus_id", "numa", "cpus", "ncpus", "ssd_dir", "nic", "notes"],
                        rows)
