"""``hvctr plan``: how much SSD, host and GPU memory a table needs, and how long a step takes.

    hvctr plan --map slurm/hwmaps/dgx-a100.toml --nodes 16 --ranks-per-node 8 --keys 1e11 --dim 8 \\
               --batch 4096 --every-k-steps 8 --rates slurm/rates/dgx-a100-assumed.toml

The model, merge and storage settings come from ``--config`` and ``--section.key=value``
flags like ``hvctr train``'s; the named flags above override them. Keys follow a Zipf law
(``--zipf``) unless ``--data`` points at a data_prep output, whose unique-key curve is
measured. Rates come from ``hvctr bench --calibrate`` (this machine) or a hand-written file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from pathlib import Path

from hvctr.config import (BOTTOM_MLP_ARCHS, CROSS_ARCHS, Compression, Config, DenseGradients, MergeMode, ModelConfig,
                          load_config)
from hvctr.plan.gpus import spec_for
from hvctr.plan.keyfreq import KeyCurve, data_curve, zipf_curve
from hvctr.plan.model import NO_FIT, Job, NodeInfo, Plan, plan
from hvctr.plan.rates import load_rates
from hvctr.config.resolve import resolve_merge
from hvctr.topo.hwmap import HardwareMap, format_cpulist, load_map
from hvctr.topo.plan import plan_node

DEFAULT_RATES = str(Path(__file__).resolve().parent / "rates.toml")  # this machine type; hvctr bench --calibrate measures yours


def _count(text: str) -> int:
    """100000, 100_000, 1e11 -> int."""
    t = text.replace("_", "")
    try:
        return int(t)
    except ValueError:
        pass
    try:
        v = float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v.is_integer() or v < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0")
    return int(v)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--map", metavar="HWMAP",
                   help="hardware map of one node (slurm/hwmaps/); default: the config's topology.hwmap")
    p.add_argument("--nodes", type=_count, default=1, help="nodes of the job (default 1)")
    p.add_argument("--ranks-per-node", type=_count, default=0, help="default: one per GPU of the map, else 1")
    p.add_argument("--keys", type=_count, default=0,
                   help="distinct keys in the table (default with --data: the data's)")
    p.add_argument("--dim", type=_count, help="storage.dim")
    p.add_argument("--batch", type=_count, help="data.batch_size_per_rank")
    p.add_argument("--every-k-steps", type=_count, help="merge.every_k_steps")
    p.add_argument("--mode", choices=[m.value for m in MergeMode], help="merge.mode")
    p.add_argument("--cpu-cache-bytes", type=_count, help="storage.cpu_cache_bytes")
    p.add_argument("--data", metavar="MANIFEST", help="a data_prep output (directory or its manifest.json): "
                                                      "measure its unique-key curve")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of key frequencies without --data")
    p.add_argument("--pass-rows", type=_count, default=None,
                   help="rows of a first pass over fresh keys (default with --data: its train rows; else 0: "
                        "a later pass, every key already in the table)")
    p.add_argument("--rates", default=DEFAULT_RATES, help="rates file (hvctr bench --calibrate writes one)")
    p.add_argument("--nic-gbps", type=float, default=0.0,
                   help="network bandwidth per node in Gb/s (overrides the rates file's nic_bytes_per_s)")
    p.add_argument("--threads-per-rank", type=_count, default=0,
                   help="torch threads per rank (default: the placement plan's cpus per rank, as a bound rank "
                        "runs; 1 for ranks started without a hardware map)")
    p.add_argument("--ssd-bytes", type=_count, default=0,
                   help="size of one SSD (default: its file system, when the map's SSD directory is on this machine)")
    p.add_argument("--gpu-memory-bytes", type=_count, default=0, help="default: read from the GPU model name (40GB)")
    p.add_argument("--memory-bytes", type=_count, default=0,
                   help="host memory the job may use on a node, page cache included (Slurm --mem, a memory cgroup's "
                        "limit); default: the map's NUMA memory")
    p.add_argument("--config", help="a training config TOML (model, storage, merge, data sections)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")


def _gpu_memory(hwmap: HardwareMap, given: int) -> tuple[float, str]:
    if given or not hwmap.gpus:
        return float(given), ""
    m = re.search(r"(\d+)\s*GB", hwmap.gpus[0].model, re.IGNORECASE)
    if not m:
        spec = spec_for(hwmap.gpus[0].model)
        if spec is None:
            return 0.0, ""
        return spec.memory_bytes, (f"GPU memory {spec.memory_bytes / 1e9:g} GB: the datasheet of the {spec.name} "
                                   f"(the map's model {hwmap.gpus[0].model!r})")
    return int(m.group(1)) * 1e9, f"GPU memory {m.group(1)} GB read from the map's model name {hwmap.gpus[0].model!r}"


def _ssd_size(path: str) -> float:
    """Size of the file system holding ``path`` on this machine; 0 when the path is not here
    (a map of another node type: its SSD is not this machine's)."""
    if not path or not os.path.isdir(path):
        return 0.0
    st = os.statvfs(path)
    return float(st.f_blocks * st.f_frsize)


def node_info(hwmap: HardwareMap, ranks_per_node: int, threads: int = 0, ssd_bytes: int = 0,
              gpu_memory_bytes: int = 0, memory_bytes: int = 0) -> NodeInfo:
    """One node as the planner sees it: cpus, memory, GPUs, SSD, from the map's placement plan.
    ``memory_bytes``: what the job may use (a limit that counts page cache), else the map's memory."""
    plans = plan_node(hwmap, ranks_per_node, oversubscribe=True)
    by_note: dict[str, list[int]] = {}
    for p in plans:
        for n in p.notes:
            if "oversubscribed" not in n:  # the plan's fits say that
                by_note.setdefault(n, []).append(p.local_rank)
    notes = [f"local rank(s) {format_cpulist(r)}: {n}" for n, r in sorted(by_note.items())]
    gpu_mem, gpu_note = _gpu_memory(hwmap, gpu_memory_bytes)
    ssd_dirs = [p.ssd_dir for p in plans]
    per_ssd = max(ssd_dirs.count(d) for d in ssd_dirs)
    ssd = float(ssd_bytes)
    if not ssd and (ssd := _ssd_size(ssd_dirs[0])):
        notes.append(f"SSD size: the file system of {ssd_dirs[0]} on this machine")
    cpus = sum(len(n.cpus) for n in hwmap.numa)
    if not threads:
        threads = 1 if not hwmap.gpus and ranks_per_node >= cpus else max(len(plans[0].cpus), 1)
    return NodeInfo(name=hwmap.name, cpus=cpus, threads_per_rank=threads,
                    host_memory_bytes=memory_bytes or sum(n.memory_gib for n in hwmap.numa) * 2**30,
                    gpus=len(hwmap.gpus),
                    gpu_memory_bytes=gpu_mem, gpu_model=hwmap.gpus[0].model if hwmap.gpus else "", ssd_bytes=ssd, ranks_per_ssd=per_ssd,
                    memory_limited=bool(memory_bytes),
                    notes=tuple(notes + ([gpu_note] if gpu_note else [])))


def job_from(cfg: Config, nodes: int, ranks_per_node: int, keys: int, pass_rows: int,
             keys_per_row: float = 0.0) -> Job:
    """``keys_per_row``: a sample's keys where fields are multi-valued (the curve's), 0: one a field."""
    s, m = cfg.storage, resolve_merge(cfg.merge, nodes * ranks_per_node, cfg.train.sparse_optimizer)
    return Job(nodes=nodes, ranks_per_node=ranks_per_node, keys=keys, dim=s.dim,
               batch_size_per_rank=(cfg.data.global_batch_size // (nodes * ranks_per_node) or 1
                                    if cfg.data.global_batch_size else cfg.data.batch_size_per_rank),
               every_k_steps=m.every_k_steps, mode=m.mode,
               states=m.states, compression=m.compression, dense_every_steps=m.dense_every_steps,
               powersgd_rank=m.powersgd_rank if m.dense_gradients is DenseGradients.POWERSGD else 0,
               shared_rows=m.shared_rows, shared_rows_bf16=m.shared_rows_bf16,
               # every key known, a job of several epochs: a later pass, whose windows the log of the last finds
               logged_pass=(s.position_log and s.shard_io.value == "pread" and not pass_rows
                            and cfg.train.epochs > 1),
               sparse_rule=m.sparse_rule,
               cpu_cache_bytes=s.cpu_cache_bytes,
               max_load_factor=s.max_load_factor, model=cfg.model, pass_rows=pass_rows, prefetch=cfg.data.prefetch,
               # as the exchange decides: no pulling ahead where keys are admitted by count or rows expire
               pull_ahead=s.pull_ahead and s.admit_after <= 1 and s.ttl_passes == 0, push_behind=s.push_behind,
               sparse_optimizer=cfg.train.sparse_optimizer,
               write_behind=s.write_behind,
               keys_per_row=keys_per_row if keys_per_row != cfg.model.num_fields else 0.0)


def _config(args: argparse.Namespace, overrides: list[str]) -> Config:
    named = {"dim": "storage.dim", "batch": "data.batch_size_per_rank", "every_k_steps": "merge.every_k_steps",
             "mode": "merge.mode", "cpu_cache_bytes": "storage.cpu_cache_bytes"}
    flags = list(overrides) + [f"--{key}={getattr(args, a)}" for a, key in named.items()
                               if getattr(args, a) is not None]
    return load_config(args.config, flags)


def _curve(args: argparse.Namespace, cfg: Config, keys: int) -> KeyCurve:
    if args.data:
        d = args.data[:-len("manifest.json")] if args.data.endswith("manifest.json") else args.data
        return data_curve(d or ".")
    if not keys:
        raise ValueError("--keys is required without --data (the number of distinct keys in the table)")
    return zipf_curve(keys, args.zipf, cfg.model.num_fields)


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    cfg = _config(args, overrides)
    map_path = args.map or (cfg.topology.hwmap if cfg.topology.hwmap != "auto" else "")
    if not map_path:
        raise ValueError("hvctr plan needs a hardware map: --map slurm/hwmaps/<node>.toml, or --topology.hwmap "
                         "in the config or as a flag (a file, not auto)")
    hwmap = load_map(map_path)
    rpn = args.ranks_per_node or max(len(hwmap.gpus), 1)
    curve = _curve(args, cfg, args.keys)
    keys = args.keys or int(round(curve.keys))
    pass_rows = args.pass_rows if args.pass_rows is not None else (int(curve.rows[-1]) if args.data else 0)
    rates = load_rates(args.rates)
    entry = rates.for_ranks(rpn)
    if args.nic_gbps:
        entry = dataclasses.replace(entry, nic_bytes_per_s=args.nic_gbps * 1e9 / 8)
    if args.nodes > 1 and not entry.nic_bytes_per_s:
        raise ValueError(f"{args.rates}: nic_bytes_per_s is 0 (not measured on one node): pass --nic-gbps for "
                         f"{args.nodes} nodes")
    node = node_info(hwmap, rpn, args.threads_per_rank, args.ssd_bytes, args.gpu_memory_bytes, args.memory_bytes)
    p = plan(job_from(cfg, args.nodes, rpn, keys, pass_rows, keys_per_row=curve.fields), node, entry, curve)
    if args.data and args.keys and curve.keys > args.keys:
        p.fits.append(("table", NO_FIT,
                       f"the data holds {curve.keys:,.0f} distinct keys, more than --keys {args.keys:,}"))
    if args.json:
        fits = [{"where": w, "status": st, "why": why} for w, st, why in p.fits]
        print(json.dumps({"figures": p.figures, "fits": fits, "notes": p.notes}, indent=1))
    else:
        nic = f"; network {args.nic_gbps:g} Gb/s per node (--nic-gbps)" if args.nic_gbps else ""
        print(format_plan(p, f"{rates.path} ({rates.name}: {rates.source}){nic}"))
    return 0


# --- the report -----------------------------------------------------------------------


def _b(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def _t(s: float) -> str:
    return f"{s * 1e3:,.1f} ms" if s < 10 else f"{s:,.1f} s"


def _model_text(m: ModelConfig) -> str:
    """``dlrm-dcnv2 bottom [512, 256, 128], 3 cross layers of rank 512, top [1024, ...]``."""
    parts = [m.arch.value]
    if m.arch in BOTTOM_MLP_ARCHS:
        parts.append(f"bottom {list(m.bottom_mlp)},")
    if m.arch in CROSS_ARCHS:
        rank = f"rank {m.cross_rank}" if m.cross_rank else "full rank"
        parts.append(f"{m.cross_layers} cross layers of {rank},")
    parts.append(f"top {list(m.hidden)}" if m.arch in BOTTOM_MLP_ARCHS else str(list(m.hidden)))
    return " ".join(parts)


def format_plan(p: Plan, rates_from: str) -> str:
    f, j, n = p.figures, p.job, p.node
    mode = "sync (gradients every step)" if j.mode is MergeMode.SYNC else f"kstep k = {j.k} ({j.states.value})"
    fp16 = ", fp16 on the wire" if j.compression is Compression.FP16 else ""
    if j.powersgd_rank:
        mode = f"kstep k = {j.k} (rows), dense gradients every step (powersgd, rank {j.powersgd_rank})"
    if f.get("shared_row_bytes_per_step"):
        mode += (f", {j.shared_rows:,} shared rows synchronised every step "
                 f"({f['shared_row_bytes_per_step'] / 1e6:.2f} MB a rank a step)")
    overlap = "overlapped" if "no spare core" not in " ".join(p.notes) else "added"
    lines = [
        f"hvctr plan: {j.nodes} node(s) x {j.ranks_per_node} ranks = {f['world_size']} ranks on {n.name} "
        f"({n.cpus} cpus, {n.gpus} GPUs per node, {n.threads_per_rank} thread(s) per rank)",
        f"  table {j.keys:,} keys, dim {j.dim}: a row is {f['row_bytes']} B "
        f"({j.layout.columns()}, train.sparse_optimizer = {j.sparse_optimizer.value}); "
        f"model {_model_text(j.model)}, {f['dense_params']:,} dense parameters",
        f"  batch {j.batch_size_per_rank:,} per rank, {mode}{fp16}; keys: {p.curve.source}"
        + (f"; {j.keys_per_row:.1f} keys a row (multi-valued fields)" if j.keys_per_row else ""),
        f"  rates: {rates_from}; entry measured with {p.rates.ranks_per_node} rank(s) per node",
        "",
        "per rank",
        f"  SSD shard          {_b(f['shard_bytes'])}: {f['shard_capacity_rows']:,} rows (storage.rows_per_rank) at "
        f"load factor {j.max_load_factor:g}: index {_b(f['shard_index_bytes'])}, rows {_b(f['shard_rows_bytes'])}, "
        f"meta {_b(f['shard_meta_bytes'])}",
        f"  checkpoint base    {_b(f['checkpoint_base_bytes'])} (keys, rows, TTL pass; where checkpoint.dir is); "
        f"the end of a pass writes the dirty cache back: {_t(f['end_of_pass_s'])}",
        f"  CPU cache          {_b(f['cache_bytes'])}: {f['cache_rows']:,} rows, hit rate {f['cache_hit_rate']:.3f}",
        f"  host memory        {_b(f['host_bytes'])} (cache, working set and its messages, two windows of data, "
        "dense state, ~400 MiB of runtime)",
        f"  working set        {f['working_set_rows']:,.0f} rows per window "
        f"({f['working_set_rows'] / (j.k * j.batch_size_per_rank):.2f} per sample), "
        f"{f['batch_unique_rows']:,.0f} per batch; device {_b(f['device_bytes'])}",
        f"  owner reads        {f['owner_rows_per_window']:,.0f} rows per window, "
        f"{f['new_rows_per_window']:,.0f} of them new",
        "",
        "per step, per rank (bytes to other ranks)",
        f"  pull               {_b(f['pull_bytes_per_step'])} (keys out, rows answered)",
        f"  warm               {_b(f['warm_bytes_per_step'])} (prefetch: keys to owners)",
        f"  push               {_b(f['push_bytes_per_step'])} "
        f"({'gradients' if j.mode is MergeMode.SYNC else 'rows'} to owners)",
        f"  dense merge        {_b(f['dense_payload_bytes_per_step'])} payload, {_b(f['dense_wire_bytes_per_step'])} "
        "on the wire (ring)",
        f"  time               compute {_t(f['compute_s_per_step'])}, pull {_t(f['pull_s_per_step'])}, merge "
        f"{_t(f['merge_s_per_step'])}, prefetch {_t(f['prep_s_per_step'])} ({overlap}; shard reads "
        f"{_t(f['shard_read_s_per_step'])} of it)",
        f"  step               {_t(f['step_s'])}: {f['samples_per_s_per_rank']:,.0f} samples/s per rank, "
        f"{f['samples_per_s']:,.0f} in all; bound by {f['bound_by']}",
        f"  exposed            {_t(f['exposed_non_compute_s_per_step'])} of the step is not compute "
        f"({f['exposed_non_compute_s_per_step'] / f['step_s']:.0%}: the main thread's pull and merge, and the prefetch where "
        f"it outlasts them); compute: {f['compute_source']}",
        "",
        "what fits",
    ]
    lines += [f"  {where:<18} {status:<13} {why}" for where, status, why in p.fits]
    if p.notes:
        lines += ["", "notes"] + [f"  - {x}" for x in p.notes]
    return "\n".join(lines)
