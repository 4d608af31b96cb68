"""``hvctr topo``: discover this node's hardware map, print a placement plan, or a rank's NIC exports.

    hvctr topo --out slurm/hwmaps/mynode.toml          # discover, write an editable map
    hvctr topo --plan --local-size 8 --map slurm/hwmaps/dgx-a100.toml
    hvctr topo --from-nvidia-smi capture.txt --name dgx-a100 --out dgx-a100.toml
    eval "$(hvctr topo --exports --map M --local-rank 3 --local-size 8)"   # in a per-rank wrapper
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from hvctr.config import load_config
from hvctr.topo.hwmap import HardwareMap, load_map, to_toml, write_map


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="write the discovered map here (default: print it)")
    p.add_argument("--map", help="hardware map to plan with (default: topology.hwmap, else discover)")
    p.add_argument("--config", help="TOML config; its [topology] section supplies hwmap and oversubscribe")
    p.add_argument("--plan", action="store_true", help="print the placement of --local-size ranks")
    p.add_argument("--exports", action="store_true",
                   help="print `export` lines naming --local-rank's NIC for MPI, Gloo, UCX and NCCL")
    p.add_argument("--local-size", type=int, default=0, help="ranks on the node (default: one per GPU, else 1)")
    p.add_argument("--local-rank", type=int, default=0, help="the rank on the node whose --exports to print (default 0)")
    p.add_argument("--from-nvidia-smi", metavar="FILE", help="build the map from a saved `nvidia-smi topo -m`")
    p.add_argument("--name", default="", help="the map's name (default: the host name)")
    p.add_argument("--sysfs-only", action="store_true", help="discover from sysfs alone, without lstopo/nvidia-smi")


def _the_map(args: argparse.Namespace, hwmap_cfg: str) -> HardwareMap:
    from hvctr.topo import discover

    if args.from_nvidia_smi:
        path = Path(args.from_nvidia_smi)
        if not path.is_file():
            raise ValueError(f"--from-nvidia-smi {path}: no such file")
        return discover.map_from_nvidia_smi(path.read_text(), args.name or path.stem,
                                            source=f"nvidia-smi topo -m capture {path.name}")
    path = args.map or (hwmap_cfg if hwmap_cfg != "auto" else "")
    if path:
        return load_map(path)
    return discover.discover(use_tools=not args.sysfs_only, name=args.name)


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from hvctr.topo.bind import nic_exports
    from hvctr.topo.plan import format_plan, plan_node

    topo_cfg = load_config(args.config, overrides).topology
    hwmap = _the_map(args, topo_cfg.hwmap)
    local_size = args.local_size or max(1, len(hwmap.gpus))
    if args.exports:
        # The NIC does not depend on cpus: an oversubscribed node still gets its exports.
        plan = plan_node(hwmap, local_size, oversubscribe=True)
        if not 0 <= args.local_rank < local_size:
            raise ValueError(f"--local-rank {args.local_rank} is outside 0..{local_size - 1}")
        for k, v in nic_exports(plan[args.local_rank].nic, plan[args.local_rank].nic_hca).items():
            print(f"export {k}={shlex.quote(v)}")
        return 0
    if args.plan:
        table = format_plan(plan_node(hwmap, local_size, oversubscribe=topo_cfg.oversubscribe))
        print(f"# placement on {hwmap.path or hwmap.name} ({hwmap.source}), {local_size} ranks per node")
        print(table)
        return 0
    header = [f"discovered by `hvctr topo` from {hwmap.source}"] if not args.from_nvidia_smi else []
    if args.out:
        write_map(hwmap, args.out, header)
        print(f"wrote {args.out}: {len(hwmap.numa)} NUMA nodes, {len(hwmap.gpus)} GPUs, "
              f"{len(hwmap.nics)} NICs, {len(hwmap.ssds)} SSDs")
    else:
        print(to_toml(hwmap, header), end="")
    return 0
