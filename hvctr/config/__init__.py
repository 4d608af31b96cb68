"""Run configuration: one frozen dataclass per concern, loaded from TOML, overridden by flags.

Precedence is flags > TOML file > defaults. Every component receives only its own section
(``cfg.storage`` goes to the store, ``cfg.merge`` to the merger), so a section's fields are
the whole interface between the user and that component.

    cfg = load_config("run.toml", ["--merge.every_k_steps=8", "--storage.cpu_cache_bytes=1e9"])

Unknown sections or keys and values of the wrong type are a ValueError that names the key
and lists what would have been valid; nothing is silently ignored.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from hvctr.formats import SparseOptimizer
from hvctr.formats.tomlfile import read_toml


class MergeMode(str, enum.Enum):
    KSTEP = "kstep"  # local Adam, parameters (and the states merge.states names) averaged every k steps
    SYNC = "sync"  # synchronous Adam: gradients reduced every step; the baseline


class MergeStates(str, enum.Enum):
    PARAMS = "params"
    PARAMS_V = "params+v"
    PARAMS_M_V = "params+m+v"


class LrScaling(str, enum.Enum):
    NONE = "none"  # the learning rates as given, whatever the number of ranks
    LINEAR = "linear"  # both learning rates x W (Goyal et al., arXiv 1706.02677)
    SQRT = "sqrt"  # both learning rates x sqrt(W)


class AdamScaling(str, enum.Enum):
    NONE = "none"  # Adam's betas and eps as given
    SQRT = "sqrt"  # 1 - beta1, 1 - beta2 x sqrt(W), eps / W^(1/4): momentum over as many samples at W ranks


class SparseRule(str, enum.Enum):
    AUTO = "auto"  # kstep: sum for row-wise Adagrad; else matched from 4 ranks on, average below (hvctr.config.resolve)
    AVERAGE = "average"  # an owner keeps the mean of the contributors' copies of a row
    SUM = "sum"  # old + the sum of the contributors' moves (row-wise Adagrad: and of its accumulator's increments)
    SQRT = "sqrt"  # old + sqrt(contributors) x their mean move
    MATCHED = "matched"  # old + the mean move scaled to the move sync would have made (hvctr.storage.row_merge)


class DenseGradients(str, enum.Enum):
    AUTO = "auto"  # powersgd from 4 ranks on (kstep, the local merge's knobs left alone), local below (hvctr.config.resolve)
    LOCAL = "local"  # kstep: each rank's dense Adam steps on its own gradients; the model merged
    POWERSGD = "powersgd"  # kstep: the gradients averaged every step, low-rank (hvctr.train.merger.PowerSGD)


class Compression(str, enum.Enum):
    NONE = "none"
    FP16 = "fp16"


class CachePolicy(str, enum.Enum):
    LRU = "lru"
    LFU = "lfu"  # LFU with aging: counts halve every storage.lfu_aging_lookups lookups


class ShardIO(str, enum.Enum):
    PREAD = "pread"  # a pool of threads reads many rows at once; without write-behind the page cache's rows through a mapping
    MMAP = "mmap"  # the reference path: rows through np.memmap, one page fault at a time


class WriteBehind(str, enum.Enum):
    AUTO = "auto"  # on where the job runs under a memory limit (a memory cgroup's), off elsewhere
    ON = "on"  # every shard write flushed to the device, its pages dropped from the page cache
    OFF = "off"  # written pages left to the kernel (dirty, then clean and cached): no wait on the device


class PushBehind(str, enum.Enum):
    AUTO = "auto"  # on where every rank has a core to spare for the prefetch thread, a GPU, or a cache of <= 10% of its shard
    ON = "on"  # the push sends the rows the next window does not hold from the prefetch thread
    OFF = "off"  # every row at the window's end


class HeapTrim(str, enum.Enum):
    AUTO = "auto"  # after each window where the job runs under a memory limit (a memory cgroup's)
    WINDOW = "window"  # after each window, always
    OFF = "off"  # never: freed memory stays with the process until glibc reuses it


class Pooling(str, enum.Enum):
    SUM = "sum"  # a multi-valued field's embedding: the sum of its keys' rows
    MEAN = "mean"  # their mean (an empty field: 0 either way)


class ModelArch(str, enum.Enum):
    DNN = "dnn"
    DEEPFM = "deepfm"
    WDL = "wdl"  # Wide & Deep
    DLRM = "dlrm"  # Naumov et al.: bottom MLP on dense, pairwise dot products, top MLP
    DCNV2 = "dcnv2"  # Wang et al. (arXiv 2008.13535): cross network, then the MLP
    DLRM_DCNV2 = "dlrm-dcnv2"  # MLPerf Training's DLRM-DCNv2: bottom MLP, cross network, top MLP


class DataVerify(str, enum.Enum):
    FULL = "full"  # every start checks every shard of the rank against the manifest's checksums
    STAMP = "stamp"  # a full check once; later starts re-check only shards whose size or mtime changed
    OFF = "off"  # no checksums (shapes are still checked when the shards open)


class Device(str, enum.Enum):
    AUTO = "auto"  # cuda:<local GPU> when CUDA is available, else cpu
    CPU = "cpu"
    CUDA = "cuda"


class MemoryPolicy(str, enum.Enum):
    PREFERRED = "preferred"  # allocate on the rank's NUMA node, spill to others when it is full
    BIND = "bind"  # only the rank's NUMA node: an allocation beyond it fails (OOM) instead of going remote
    LOCAL = "local"  # the kernel default: first touch from the bound cpus lands on their node


class Backend(str, enum.Enum):
    HOROVOD = "horovod"  # Horovod over MPI (built from source by make setup)
    TORCH = "torch"  # torch.distributed with gloo (hvctr.distributed.torch_comm): no Horovod needed


@dataclass(frozen=True)
class DistributedConfig:
    # the engine that carries the collectives: horovod, or torch (torch.distributed, gloo; the
    # same sums in the same order: a model trains bit for bit alike under either, docs/architecture.md)
    backend: Backend = Backend.HOROVOD


@dataclass(frozen=True)
class TopologyConfig:
    hwmap: str = ""  # hardware map TOML (slurm/hwmaps/); "auto": discover at start; empty: no binding, no placement
    bind: bool = True  # apply the plan in-process (affinity, memory policy, threads)
    threads_per_rank: int = 0  # 0: the plan's share of the NUMA node's cpus
    hierarchical_allreduce: bool = False  # dense merge: reduce inside the node, then across nodes
    ranks_per_virtual_node: int = 0  # >0: group ranks into virtual nodes of this size (testing)
    memory_policy: MemoryPolicy = MemoryPolicy.PREFERRED  # how host memory is tied to the plan's NUMA node
    oversubscribe: bool = False  # allow more ranks on a NUMA node than it has cpus (they share); small test machines


@dataclass(frozen=True)
class StorageConfig:
    dim: int = 16  # embedding dimension D; a row holds 3 * (D + 1) + 1 float32 with Adam (train.sparse_optimizer)
    # working shards; empty: the hardware map's SSD for the rank, else node-local scratch
    # ($SLURM_TMPDIR, $TMPDIR: hvctr.rundir.working_shard_dir), else <run_dir>/shards
    shard_dir: str = ""
    # capacity of each rank's SSD shard, in rows; 0: sized at start from the data manifest's
    # distinct-key estimate and the rank count, with headroom (hvctr.train.preflight.size_shard)
    rows_per_rank: int = 0
    max_load_factor: float = 0.8  # the shard is full (an error) past this fraction of its slots
    cpu_cache_bytes: int = 256 << 20  # the CPU cache's budget of anonymous memory, per rank
    cache_policy: CachePolicy = CachePolicy.LFU  # which rows the CPU cache keeps when it is full
    # how the shard file is read and written: pread (the C kernels' I/O pool, at the device's queue
    # depth; a table many times the job's memory, a memory cgroup counting page cache) or mmap
    # (the reference path, and the one taken under HVCTR_NATIVE=0)
    shard_io: ShardIO = ShardIO.PREAD
    io_threads: int = 32  # reads in flight per rank on the pread path (this disk saturates near 32)
    # the pread path's shard writes (write-back, flushes, the index): flushed to the device as
    # they are written and their pages dropped (a memory cgroup counts page cache, and v1 does
    # not throttle a group's dirty pages: reclaim would wait on them), or left to the kernel's
    # page cache, where a row written in one window is still there when the next reads it;
    # on also reads through O_DIRECT (no page-cache pages to charge to the group and reclaim)
    write_behind: WriteBehind = WriteBehind.AUTO
    # kstep: an owner writes the merged rows the next window does not read while that window
    # trains (a thread beside it, from the end of its pull): the window's end waits for the
    # rows both windows hold alone. The same values (every other reader waits for them). Needs
    # data.prefetch (the next window's keys are at their owners before the push); not with
    # storage.admit_after > 1. Off: it needs a core to spare per rank (on 2 cores for 2 ranks,
    # 0.99x in memory and 0.97-1.00x out of core, docs/storage.md)
    defer_writes: bool = False
    # with data.prefetch: the prefetch thread's warm also pulls the next window's rows that no rank
    # holds in the window training now (their values cannot change before its pull), so the pull
    # at the window's end reads and sends only the rows both windows hold. The same values; a
    # working set more in memory a rank. Off with storage.admit_after > 1 or storage.ttl_passes > 0, and
    # for a run whose memory limit leaves a rank less than it needs with it (the preflight says so)
    pull_ahead: bool = True
    # with storage.pull_ahead, merge.mode = kstep: the window's push sends at once only the rows the
    # next window holds (its pull reads them); the prefetch thread sends and the owners merge the
    # rest while the next window trains (every other reader waits for them). The same values; the
    # rows left behind are a part of a working set more in memory a rank until then. auto: on
    # where every rank has a core beside its torch threads, trains on a GPU, or has a cache of at
    # most a tenth of its shard's rows (on 2 cores for 2 ranks of one thread: 0.95-0.99x all
    # cached, 1.02-1.05x with the cache at 10% of the table, docs/storage.md)
    push_behind: PushBehind = PushBehind.AUTO
    # pread path: the shard logs where each training window's rows were (16 bytes a key, two files
    # beside it) and the same window of the next pass reads that back instead of an index block per
    # cold key (a pass reads the data in the same order as the one before: hvctr.storage.position_log)
    position_log: bool = True
    # give the free pages of the C heaps back to the system (malloc_trim) after each window: the
    # window's freed arrays, otherwise kept by the process where a memory limit wants them for
    # the page cache (hvctr.heap)
    heap_trim: HeapTrim = HeapTrim.AUTO
    lfu_aging_lookups: int = 1 << 22  # LFU counts halve after this many key lookups
    max_working_set_rows: int = 1 << 21  # bound of a window's unique rows; the window shrinks to fit
    admit_after: int = 0  # a key seen fewer times is not stored: it reads the shared default row
    # Online counts of not-yet-admitted keys live in a count-min sketch (4 rows of uint16
    # counters; allocated only when admit_after > 1): more slots, fewer early admissions.
    admit_sketch_slots: int = 1 << 22
    ttl_passes: int = 0  # rows unseen for this many passes are dropped at compaction; 0: never
    init_scale: float = 0.01  # new rows: w, w1 uniform in [-init_scale, init_scale), from the key
    seed: int = 2024  # seeds of the slot hash and of row initialisation


@dataclass(frozen=True)
class MergeConfig:
    mode: MergeMode = MergeMode.KSTEP  # kstep: the paper's k-step model merging; sync: the baseline
    every_k_steps: int = 4  # k: local steps between merges (the window length)
    # kstep: the dense model also merges every this many local steps inside a window, the rows
    # still once a window; 0: at the window's end only; -1 (auto): 4 from 32 ranks on, with the
    # moves in fp16 (merge.compression), and 0 below (hvctr.config.resolve.resolve_merge)
    dense_every_steps: int = -1
    k_warmup_steps: int = 0  # kstep: windows grow from 1 step to k over this many steps (0: k from the start)
    # dense Adam states averaged with the parameters; params: same AUC as params+m+v in the k sweep
    # (BENCHMARKS.md, Training), a third of the bytes, better calibration; PaddleBox merges params too
    states: MergeStates = MergeStates.PARAMS
    compression: Compression = Compression.NONE  # fp16 on the wire (kstep: the moves since the last merge); never Adam's v
    # kstep's dense model: local (its own Adam steps on each rank, merged as above) or powersgd (the
    # gradients averaged every step as rank-r factors with error feedback, Vogels et al. arXiv
    # 1905.13727: every rank takes the same Adam step, the rows still merge every k steps); auto:
    # powersgd from 4 ranks on, chosen on two data sets (docs/merging.md), local below
    dense_gradients: DenseGradients = DenseGradients.AUTO
    powersgd_rank: int = 16  # merge.dense_gradients = powersgd: the rank r of each weight matrix's factors
    # kstep: about this many of a window's rows (ceil(N / W) an owner), those the most ranks touch
    # (at least 2), are synchronised every step like sync's: each step's gradients of the ones it
    # touched go to their owners, which sum them over the ranks, take the Adam step and serve the
    # values the next step reads (two alltoalls a step, D + 1 floats a touched row each way,
    # hvctr.train.row_sync); the owners keep their copies at the push. The rest merge every k
    # steps by sparse_rule. 0: off; -1 (auto): 32,768 from 32 ranks on (from 16 where k > 8), 0 below
    # (hvctr.config.resolve.resolve_merge)
    shared_rows: int = -1
    # kstep, shared rows: their gradients and values travel as bfloat16 (half the bytes); the owner
    # sums the gradients and keeps the rows in float32, and a holder reads the rounded values. The
    # same AUC as float32 to 0.0001 in 9 runs on two data sets at 16-64 ranks (docs/merging.md)
    shared_rows_bf16: bool = True
    # Accuracy at scale (docs/merging.md): W ranks each see 1/W of the data, so averaging
    # their models dilutes progress per sample unless the merge makes up for it.
    # sqrt: chosen by measurement (BENCHMARKS.md, Accuracy against ranks); none: the rates as given
    lr_scaling: LrScaling = LrScaling.SQRT  # dense_lr and sparse_lr x W (linear) or x sqrt(W), sync and kstep
    lr_warmup_steps: int = 0  # steps over which the scaled rates ramp up from the base rates (0: at once)
    adam_scaling: AdamScaling = AdamScaling.SQRT  # Adam's betas and eps for W ranks (hvctr.train.lr); none: as given
    # Dense outer step on the window's averaged move (SlowMo, arXiv 1910.00643): u = momentum * u
    # + (start - average); params = start - outer_lr * u. outer_lr 1, momentum 0: plain averaging
    outer_lr: float = 1.0
    outer_momentum: float = 0.0  # the outer step's momentum (SlowMo, above); 0: none
    # what an owner keeps of a row several ranks moved (kstep); auto: chosen on two data sets (docs/merging.md)
    sparse_rule: SparseRule = SparseRule.AUTO


# The archs with a bottom MLP (its output is one more "embedding") and those with a cross network.
BOTTOM_MLP_ARCHS = frozenset({ModelArch.DLRM, ModelArch.DLRM_DCNV2})
CROSS_ARCHS = frozenset({ModelArch.DCNV2, ModelArch.DLRM_DCNV2})


@dataclass(frozen=True)
class ModelConfig:
    arch: ModelArch = ModelArch.DNN  # dnn: an MLP on the concatenated embeddings and dense features (docs/models.md)
    # MLP hidden layers; the output layer (1) is added. dlrm, dlrm-dcnv2: the top MLP (over the
    # interaction); dcnv2: the deep part over the cross network's output
    hidden: tuple[int, ...] = (512, 256)
    # dlrm, dlrm-dcnv2: the bottom MLP on the dense features, Linear + ReLU per layer; its last
    # width is the width of an embedding (must equal storage.dim). Other archs: not read
    bottom_mlp: tuple[int, ...] = (512, 256, 16)
    cross_layers: int = 3  # dcnv2, dlrm-dcnv2: cross layers x_{l+1} = x0 * (W x_l + b) + x_l
    cross_rank: int = 0  # dcnv2, dlrm-dcnv2: W = U V^T of this rank; 0: a full-rank W
    num_dense: int = 13  # dense (numeric) features per row: Criteo's 13
    num_fields: int = 26  # categorical fields per row, one key each: Criteo's 26
    # multi-valued fields (data_prep --multi-valued): how a field's 0..n keys make one embedding,
    # sum or mean; one entry for every field, or one a field (model.num_fields). One-valued
    # fields are not affected (a bag of one is its row either way)
    pooling: tuple[Pooling, ...] = (Pooling.SUM,)


@dataclass(frozen=True)
class DataConfig:
    train_dir: str = ""  # data_prep output (its manifest.json and shards)
    valid_dir: str = ""  # empty: the validation split of train_dir
    batch_size_per_rank: int = 4096  # rows per step on each rank; the global batch is this x the ranks
    # > 0: the global batch, fixed whatever the rank count: each rank takes this / W rows per step
    # (replaces batch_size_per_rank), and merge.lr_scaling / adam_scaling see no batch growth
    global_batch_size: int = 0
    prefetch: bool = True  # read and warm window t+1 while window t trains
    # checksums of the train shards at start: full (every start), stamp (once per data set: a
    # stamp beside the manifest records sizes and mtimes; a changed shard is checked again), off
    verify: DataVerify = DataVerify.STAMP


@dataclass(frozen=True)
class TrainConfig:
    run_dir: str = "runs/default"  # config.toml, logs/, metrics.jsonl, checkpoints/, summary.json of the run
    epochs: int = 1  # passes over data.train_dir
    max_steps: int = 0  # stop after this many steps per rank; 0: run the epochs
    dense_lr: float = 1e-3  # Adam's learning rate of the MLP, at one rank (merge.lr_scaling scales it)
    sparse_lr: float = 1e-3  # Adam's learning rate of the embedding rows, at one rank (merge.lr_scaling)
    beta1: float = 0.9  # Adam's beta1, at one rank (merge.adam_scaling adapts it to W ranks)
    beta2: float = 0.999  # Adam's beta2, at one rank (merge.adam_scaling)
    eps: float = 1e-8  # Adam's epsilon, at one rank (merge.adam_scaling)
    # the embedding rows' optimiser, which fixes what a row stores beside its D + 1 model floats:
    # adam (m and v per column, 3 (D + 1) + 1 floats a row), rowwise_adam (m per column, one v a
    # row: 2 (D + 1) + 2) or rowwise_adagrad (one accumulator a row, TorchRec's fused optimiser and
    # MLPerf's: D + 3; its rate is sparse_lr, beta1 and beta2 unused). Shards and checkpoints
    # record it: a resume or an init_from with another one is refused
    sparse_optimizer: SparseOptimizer = SparseOptimizer.ADAM
    seed: int = 1234  # dense parameter init; identical on every rank
    device: Device = Device.AUTO  # where the model and the working set live
    threads: int = 0  # torch threads per rank; 0: the placement plan's, else the rank's cpus / ranks sharing them
    queue_timeout_s: float = 900.0  # prefetch queue waits; a hung reader becomes an error
    # a collective that waits this long for a rank that never comes (hung, stopped, stuck in I/O)
    # ends the job with an error naming it (hvctr.distributed.watchdog, on every rank); 0: wait forever.
    # Keep it under queue_timeout_s, so that a peer's hang is reported as one
    stall_timeout_s: float = 600.0


@dataclass(frozen=True)
class CheckpointConfig:
    every_windows: int = 0  # 0: only at the end of training
    keep: int = 3  # newest complete checkpoints kept
    compact_every: int = 4  # write a new base every this many checkpoints
    dir: str = ""  # empty: <run_dir>/checkpoints


@dataclass(frozen=True)
class MetricsConfig:
    log_every_steps: int = 20  # a progress line (and a metrics.jsonl record) every this many steps
    all_ranks: bool = False  # every rank prints, not only rank 0
    auc_buckets: int = 1 << 16  # histogram buckets for AUC (error well under 1e-3)
    # validation (AUC, logloss, NE, COPC: read-only, as hvctr eval) every this many windows,
    # into metrics.jsonl and the log; 0: only at the end. Each pass reads the whole validation split
    eval_every_windows: int = 0
    # also write the progress and validation scalars as TensorBoard event files in
    # <run_dir>/tensorboard (rank 0; x axis: samples trained). Needs the tensorboard extra
    tensorboard: bool = False


@dataclass(frozen=True)
class Config:
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    merge: MergeConfig = field(default_factory=MergeConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        _validate(self)


# Loading -------------------------------------------------------------------------------


def _sections() -> dict[str, type]:
    return typing.get_type_hints(Config)


def _field_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def _coerce(key: str, value: Any, typ: Any, text: bool = False) -> Any:
    """Turns a value into the field's type, or raises naming the key. ``text``: a command-line
    flag's string (``--storage.cpu_cache_bytes=1e9``, ``--metrics.all_ranks=yes``), read as a
    person types it; otherwise a TOML value (or a dict's), which must already be of the type:
    an integer key takes a TOML integer, a boolean key true or false, never a string or a float
    that looks like one (``dim = "16"``, ``dim = 16.0``, ``all_ranks = "yes"``)."""
    origin = typing.get_origin(typ)
    if isinstance(typ, type) and issubclass(typ, enum.Enum):
        valid = [m.value for m in typ]
        if isinstance(value, typ):
            return value
        if isinstance(value, str) and value in valid:
            return typ(value)
        raise ValueError(f"config key {key!r}: {value!r} is not one of {valid}")
    if typ is bool:
        if isinstance(value, bool):
            return value
        if text and isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ValueError(f"config key {key!r}: expected true or false, got {_shown(value, text)}")
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if text and isinstance(value, str):
            try:
                f = float(value.replace("_", ""))
            except ValueError:
                f = None
            if f is not None and f.is_integer():
                return int(f)  # 1e9 bytes, as a person types it on the command line
        hint = (" (write it as a TOML integer; large ones may use underscores: 1_000_000_000)"
                if isinstance(value, float) and not text else "")
        raise ValueError(f"config key {key!r}: expected an integer, got {_shown(value, text)}{hint}")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if text and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ValueError(f"config key {key!r}: expected a number, got {_shown(value, text)}")
    if typ is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"config key {key!r}: expected a string, got {_shown(value, text)}")
    if origin is tuple:
        (elem, _ellipsis) = typing.get_args(typ)
        if text and isinstance(value, str):
            value = [v.strip() for v in value.replace("[", "").replace("]", "").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"config key {key!r}: expected a list, got {_shown(value, text)}")
        return tuple(_coerce(key, v, elem, text) for v in value)
    raise TypeError(f"unsupported config type {typ} for {key}")  # a bug in this module


def _shown(value: Any, text: bool) -> str:
    """A value in an error, with what TOML made of it where that is the problem ("16": a string)."""
    if text:
        return repr(value)
    kind = {bool: "a boolean", int: "an integer", float: "a float", str: "a string"}.get(type(value), "")
    return f"{value!r} ({kind})" if kind else repr(value)


def _apply(tree: dict[str, dict[str, Any]], section: str, key: str, value: Any, where: str,
           text: bool = False) -> None:
    sections = _sections()
    if section not in sections:
        raise ValueError(f"{where}: unknown config section {section!r}; valid sections: {sorted(sections)}")
    types_ = _field_types(sections[section])
    if key not in types_:
        raise ValueError(
            f"{where}: unknown config key '{section}.{key}'; valid keys of [{section}]: {sorted(types_)}"
        )
    try:
        tree.setdefault(section, {})[key] = _coerce(f"{section}.{key}", value, types_[key], text)
    except ValueError as e:
        if where in ("config", "command line"):
            raise
        raise ValueError(f"{where}: {e}") from None  # the file it came from


def parse_overrides(flags: Iterable[str]) -> list[tuple[str, str, str]]:
    """``--merge.every_k_steps=8`` -> ("merge", "every_k_steps", "8")."""
    out = []
    for flag in flags:
        body = flag[2:] if flag.startswith("--") else flag
        if "=" not in body or "." not in body.split("=", 1)[0]:
            raise ValueError(f"config override {flag!r}: expected --section.key=value")
        dotted, value = body.split("=", 1)
        section, key = dotted.split(".", 1)
        out.append((section, key, value))
    return out


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> Config:
    tree: dict[str, dict[str, Any]] = {}
    if path:
        path = Path(path)
        raw = read_toml(path, "config file")
        for section, body in raw.items():
            if not isinstance(body, dict):
                raise ValueError(f"{path}: top-level key {section!r} must be a [section]; valid: {sorted(_sections())}")
            for key, value in body.items():
                _apply(tree, section, key, value, str(path))
    for section, key, value in parse_overrides(overrides):
        _apply(tree, section, key, value, "command line", text=True)
    return from_dict(tree)


def from_dict(tree: Mapping[str, Mapping[str, Any]]) -> Config:
    sections = _sections()
    checked: dict[str, dict[str, Any]] = {}
    for section, body in tree.items():
        for key, value in body.items():
            _apply(checked, section, key, value, "config")
    return Config(**{name: cls(**checked.get(name, {})) for name, cls in sections.items()})


def replace(cfg: Config, **sections: Mapping[str, Any]) -> Config:
    """A copy of cfg with some keys changed: ``replace(cfg, merge={"every_k_steps": 8})``."""
    tree = to_dict(cfg)
    for section, body in sections.items():
        tree.setdefault(section, {}).update(body)
    return from_dict(tree)


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    def plain(v: Any) -> Any:
        if isinstance(v, enum.Enum):
            return v.value
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        return v

    return {s.name: {k: plain(v) for k, v in dataclasses.asdict(getattr(cfg, s.name)).items()}
            for s in dataclasses.fields(cfg)}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    s = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{s}"'


def to_toml(cfg: Config) -> str:
    lines = ["# resolved hvctr configuration (defaults < file < flags)"]
    for section, body in to_dict(cfg).items():
        lines.append(f"\n[{section}]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in body.items())
    return "\n".join(lines) + "\n"


def write_toml(cfg: Config, path: str | Path) -> None:
    from hvctr.formats import safefile  # a fresh temporary file: never through a planted link

    path = Path(path)
    try:
        safefile.write_text(path, to_toml(cfg))
    except OSError as e:  # a full disk: nothing half-written left, one message naming the file
        raise ValueError(f"cannot write the resolved config {path}: {e.strerror or e}") from None


# Validation ----------------------------------------------------------------------------


def _require(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"config key {key!r}: {msg}")


def _require_finite(cfg: Config) -> None:
    """Every float key: a finite number (nan and inf pass comparisons like ``x > 0``, or fail
    them silently, and train to a loss of nan)."""
    for section in dataclasses.fields(cfg):
        body = getattr(cfg, section.name)
        for name, typ in _field_types(type(body)).items():
            if typ is float:
                value = getattr(body, name)
                _require(math.isfinite(value), f"{section.name}.{name}", f"must be a finite number, got {value}")


def _validate_model(mc: ModelConfig, dim: int) -> None:
    _require(all(h >= 1 for h in mc.hidden), "model.hidden", f"layer sizes must be >= 1, got {mc.hidden}")
    _require(mc.num_fields >= 1, "model.num_fields", f"must be >= 1, got {mc.num_fields}")
    _require(mc.num_dense >= 0, "model.num_dense", f"must be >= 0, got {mc.num_dense}")
    _require(all(h >= 1 for h in mc.bottom_mlp), "model.bottom_mlp", f"layer sizes must be >= 1, got {mc.bottom_mlp}")
    _require(mc.cross_layers >= 1, "model.cross_layers", f"must be >= 1, got {mc.cross_layers}")
    _require(mc.cross_rank >= 0, "model.cross_rank", f"must be >= 0 (0: full rank), got {mc.cross_rank}")
    _require(len(mc.pooling) in (1, mc.num_fields), "model.pooling",
             f"{len(mc.pooling)} entries: give one (every field) or one a field (model.num_fields = {mc.num_fields})")
    if mc.arch in BOTTOM_MLP_ARCHS:
        # The bottom MLP's output is dotted with (dlrm) or stacked beside (dlrm-dcnv2) the embeddings
        _require(len(mc.bottom_mlp) >= 1 and mc.bottom_mlp[-1] == dim, "model.bottom_mlp",
                 f"model.arch = {mc.arch.value!r} needs the bottom MLP's last layer to be storage.dim ({dim}), "
                 f"got {list(mc.bottom_mlp)}: change model.bottom_mlp's last width or storage.dim")
        _require(mc.num_dense >= 1, "model.num_dense",
                 f"model.arch = {mc.arch.value!r} runs its bottom MLP on the dense features: needs >= 1, got 0")


def _validate(cfg: Config) -> None:
    s, m, d, t = cfg.storage, cfg.merge, cfg.data, cfg.train
    topo = cfg.topology
    _require_finite(cfg)
    _require(s.init_scale >= 0, "storage.init_scale", f"must be >= 0, got {s.init_scale}")
    _require(t.queue_timeout_s > 0, "train.queue_timeout_s", f"must be > 0 seconds, got {t.queue_timeout_s}")
    _require(topo.threads_per_rank >= 0, "topology.threads_per_rank", f"must be >= 0, got {topo.threads_per_rank}")
    _require(topo.ranks_per_virtual_node >= 0, "topology.ranks_per_virtual_node",
             f"must be >= 0, got {topo.ranks_per_virtual_node}")
    _require(s.dim >= 1, "storage.dim", f"must be >= 1, got {s.dim}")
    _require(s.rows_per_rank == 0 or s.rows_per_rank >= 16, "storage.rows_per_rank",
             f"must be 0 (sized from the data) or >= 16, got {s.rows_per_rank}")
    _require(0.05 <= s.max_load_factor <= 0.95, "storage.max_load_factor", f"must be in [0.05, 0.95], got {s.max_load_factor}")
    _require(s.cpu_cache_bytes >= 0, "storage.cpu_cache_bytes", f"must be >= 0, got {s.cpu_cache_bytes}")
    _require(s.admit_after >= 0, "storage.admit_after", f"must be >= 0, got {s.admit_after}")
    _require(s.ttl_passes >= 0, "storage.ttl_passes", f"must be >= 0, got {s.ttl_passes}")
    _require(s.admit_sketch_slots >= 1024, "storage.admit_sketch_slots", f"must be >= 1024, got {s.admit_sketch_slots}")
    _require(m.every_k_steps >= 1, "merge.every_k_steps", f"must be >= 1, got {m.every_k_steps}")
    _require(m.dense_every_steps >= -1, "merge.dense_every_steps",
             f"must be -1 (auto), 0 (at the window's end) or a number of steps, got {m.dense_every_steps}")
    _require(m.lr_warmup_steps >= 0, "merge.lr_warmup_steps", f"must be >= 0, got {m.lr_warmup_steps}")
    _require(m.k_warmup_steps >= 0, "merge.k_warmup_steps", f"must be >= 0, got {m.k_warmup_steps}")
    _require(m.powersgd_rank >= 1, "merge.powersgd_rank", f"must be >= 1, got {m.powersgd_rank}")
    _require(m.shared_rows >= -1, "merge.shared_rows", f"must be >= -1 (0: off, -1: auto), got {m.shared_rows}")
    if m.shared_rows > 0:
        _require(m.mode is MergeMode.KSTEP, "merge.shared_rows",
                 "synchronises rows inside k-step windows; merge.mode = sync synchronises every row already")
    if m.dense_gradients is DenseGradients.POWERSGD:
        _require(m.mode is MergeMode.KSTEP, "merge.dense_gradients",
                 "powersgd is kstep mode's (sync mode averages the whole gradients every step)")
        _require(m.dense_every_steps <= 0 and m.compression is Compression.NONE, "merge.dense_gradients",
                 "powersgd averages the dense gradients every step (its factors in float32): the dense model is "
                 "never merged, so merge.dense_every_steps > 0 and merge.compression = fp16 do not apply")
        _require(m.outer_lr == 1.0 and m.outer_momentum == 0.0, "merge.dense_gradients",
                 "powersgd takes no outer step (merge.outer_lr, merge.outer_momentum): the dense model is never merged")
    _require(m.outer_lr > 0, "merge.outer_lr", f"must be > 0, got {m.outer_lr}")
    _require(0 <= m.outer_momentum < 1, "merge.outer_momentum", f"must be in [0, 1), got {m.outer_momentum}")
    _require(d.batch_size_per_rank >= 1, "data.batch_size_per_rank", f"must be >= 1, got {d.batch_size_per_rank}")
    _require(d.global_batch_size >= 0, "data.global_batch_size", f"must be >= 0, got {d.global_batch_size}")
    per_batch = d.batch_size_per_rank * cfg.model.num_fields
    _require(
        s.max_working_set_rows >= per_batch,
        "storage.max_working_set_rows",
        f"{s.max_working_set_rows} is smaller than one batch can touch "
        f"(data.batch_size_per_rank * model.num_fields = {per_batch}); raise it",
    )
    _validate_model(cfg.model, s.dim)
    _require(t.epochs >= 1, "train.epochs", f"must be >= 1, got {t.epochs}")
    _require(t.max_steps >= 0, "train.max_steps", f"must be >= 0, got {t.max_steps}")
    _require(t.stall_timeout_s == 0 or t.stall_timeout_s >= 2, "train.stall_timeout_s",
             f"must be 0 (off) or >= 2 seconds, got {t.stall_timeout_s}")
    for k in ("dense_lr", "sparse_lr", "eps"):
        _require(getattr(t, k) > 0, f"train.{k}", f"must be > 0, got {getattr(t, k)}")
    for k in ("beta1", "beta2"):
        _require(0 <= getattr(t, k) < 1, f"train.{k}", f"must be in [0, 1), got {getattr(t, k)}")
    _require(cfg.checkpoint.keep >= 1, "checkpoint.keep", f"must be >= 1, got {cfg.checkpoint.keep}")
    _require(cfg.storage.io_threads >= 1, "storage.io_threads", f"must be >= 1, got {cfg.storage.io_threads}")
    _require(cfg.storage.io_threads <= 256, "storage.io_threads", f"must be <= 256, got {cfg.storage.io_threads}")
    _require(cfg.checkpoint.every_windows >= 0, "checkpoint.every_windows", "must be >= 0")
    _require(cfg.checkpoint.compact_every >= 1, "checkpoint.compact_every", "must be >= 1")
    _require(cfg.metrics.log_every_steps >= 1, "metrics.log_every_steps", "must be >= 1")
    _require(cfg.metrics.eval_every_windows >= 0, "metrics.eval_every_windows",
             f"must be >= 0, got {cfg.metrics.eval_every_windows}")
