"""The planner's arithmetic: sizes from the formats, bytes from the exchange code, time from rates.

Every size is the closed form of what the code allocates or sends (tests check each against
the code), per rank unless it says otherwise:

    W = nodes * ranks_per_node, k = merge.every_k_steps (1 for sync), B = batch per rank
    row = 4 * (3 * (D + 1) + 1) bytes (w, w1, m, v, step: Adam states included)
    U   = D(k B)           distinct keys of a window: the working set, rows on the device
    U_o = D(W k B) / W     distinct keys an owner answers per window (the ranks' union)
    f   = (W - 1) / W      the share of a rank's keys that other ranks own

    pull  keys out U f 8, rows out (answering others) U f row    counted by ShardedTable
    warm  keys out U f 8                                          (prefetch thread)
    push  keys and rows out U f (8 + row)                         kstep
    push_gradients  U f (8 + 4 (D + 1))                           sync
    shared rows  2 t f 4 (D + 1) + 8 t f a step, t <= min(N, D(B))  (merge.shared_rows; bf16: 2 for 4)
    dense payload per merge: (P + P [m] + P [v]) * wire bytes + 8 (the flags)   kstep
                             P * wire bytes + 8                                  sync
    merge.dense_gradients = powersgd: every step 4 (sum of r (out + in) over the factored weights
                             + the rest whole), in two allreduces; 8 (the flags) at the window's end

Time per window is the sum of per-item costs at the measured rates (hvctr.plan.rates):

    prep    (prefetch thread) read k B data rows, sort the window's keys twice, warm:
            route, send keys, bring the owner's shard misses into its cache; with
            storage.pull_ahead, the pull of the rows the window before does not hold
    pull    route, send keys, store reads (hits, new rows), rows back, scatter; with
            storage.pull_ahead only the rows the window before holds (rows_held_over)
    compute k * (dense forward/backward + dense Adam + gather/grad-sum of B F keys
            + lazy Adam of D(B) rows + per-step overhead)
    merge   the grouped allreduce, then push: pack, send, merge by key, cache writes
            (sync: the gradient push, store reads, Adam on the owner's rows, writes); with
            storage.push_behind only the rows the next window holds (rows_held_over, as
            they leave), the rest in prep, on the prefetch thread

The prefetch thread overlaps the main thread when the rank has a core to spare for it
(more cpus than torch threads), else its time adds. On a CPU, a rank's torch threads share
the dense model's matrix products (rates are one thread's; assumed to scale linearly). More ranks than cpus stretch every CPU
time by ranks / cpus. A collective's time is latency + payload copies + wire bytes over the
node's links (ring allreduce: 2 (W - 1) / W of the payload; across nodes the node's NIC
carries its ranks' share).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from hvctr.config import (BOTTOM_MLP_ARCHS, CROSS_ARCHS, Compression, MergeMode, MergeStates, ModelArch, ModelConfig,
                          PushBehind, SparseRule, WriteBehind)
from hvctr.config.resolve import pushes_behind
from hvctr.formats import NUM_BUCKETS, SAMPLE_BYTES
from hvctr.plan.gpus import GpuRates, gpu_rates
from hvctr.plan.keyfreq import KeyCurve
from hvctr.plan.rates import Rates
from hvctr.storage.cache import entries_for_budget
from hvctr.formats import RowLayout, SparseOptimizer
from hvctr.storage.shard import (INDEX_DTYPE, META_DTYPE, PENDING_PER_BLOCK, SLOTS_PER_BLOCK, memory_bytes,
                                 num_slots_for, pending_bytes_for, pending_capacity, recent_positions_for)

KEY_BYTES = 8
INDEX_BLOCKS_PER_ROW_READ = 1.0  # a known key's probe reads its home block (linear probing rarely leaves it)
# 4 KiB pages (of rows and of row meta) a written-back row costs, each read, changed and written:
# the rows a window lets go share pages (a shard appends rows in the order their keys came, and a
# window's cold rows came together), though the cache lets them go over several batches (among
# rows that came in one operation it takes the lowest shard positions first). Measured by the run
# summaries' write-back bytes: 0.375 a row on a 2.1 GB table (1.9M rows of data_prep synth
# --unique-fields 8, 2 ranks, 2 passes, 14.4M rows written back; 0.42 before the cache's tie-break
# by position, 0.41 on the 16.7 GB table then; BENCHMARKS.md, "A table larger than memory"). The
# probe's random rows cost one page each.
WRITEBACK_PAGES_PER_ROW = 0.375
FITS, NO_FIT, UNKNOWN, INFO = "fits", "DOES NOT FIT", "unknown", "info"
# A rank's memory besides the cache, the window buffers and the shard's filter: Python, torch
# (with torch._dynamo, which torch.optim imports), h5py, Horovod and its 16 MiB fusion buffer
# (hvctr.distributed.world). Measured RSS of a CPU rank right after start-up on this machine
# type was 400 MiB with Horovod's own fusion buffer of 128 MiB: an assumption elsewhere.
BASE_RANK_BYTES = 290 << 20


@dataclass(frozen=True)
class Job:
    """What is planned (the training config's numbers)."""

    nodes: int
    ranks_per_node: int
    keys: int  # distinct keys in the table
    dim: int
    batch_size_per_rank: int
    every_k_steps: int
    mode: MergeMode = MergeMode.KSTEP
    states: MergeStates = MergeStates.PARAMS_M_V
    compression: Compression = Compression.NONE
    dense_every_steps: int = 0  # merge.dense_every_steps: dense merges inside a window too
    powersgd_rank: int = 0  # merge.dense_gradients = powersgd: its rank r (0: local dense steps, merged)
    shared_rows: int = 0  # merge.shared_rows: rows synchronised every step (hvctr.storage.shared_rows)
    shared_rows_bf16: bool = False  # merge.shared_rows_bf16: their gradients and values as bfloat16
    # a pass after the first over the same data, with storage.position_log: the cold rows' index
    # blocks come from the log of the same window of the last pass (hvctr.storage.position_log)
    logged_pass: bool = False
    sparse_rule: SparseRule = SparseRule.AVERAGE  # resolved: every rule but average keeps the owner's pulled rows to the push
    cpu_cache_bytes: int = 256 << 20
    max_load_factor: float = 0.8
    model: ModelConfig = field(default_factory=ModelConfig)
    pass_rows: int = 0  # rows of a first pass, whose new keys are created as it goes; 0: all keys known
    prefetch: bool = True
    # storage.pull_ahead (with prefetch): the prefetch thread pulls the next window's rows no rank
    # holds now; the window's end pulls the rest (rows_held_over)
    pull_ahead: bool = True
    # storage.push_behind (with pull_ahead, kstep): the window's push sends the rows the next window
    # holds; the prefetch thread the rest (the same rows_held_over, as they leave). auto: on where
    # the rank has a core to spare beside its threads, a GPU computes or the cache holds at most a
    # tenth of the shard's rows, as the trainer decides
    push_behind: PushBehind = PushBehind.AUTO
    write_behind: WriteBehind = WriteBehind.AUTO  # storage.write_behind (auto: on where the node's memory is a limit)
    sparse_optimizer: SparseOptimizer = SparseOptimizer.ADAM  # train.sparse_optimizer: the rows' states
    # keys a sample holds: 0 is model.num_fields (one a field); multi-valued fields (data format
    # version 2) hold more or fewer, their mean measured on the data (KeyCurve.fields)
    keys_per_row: float = 0.0

    @property
    def row_keys(self) -> float:
        """Keys a sample looks up: what the gather, the gradient sum and the window's dedup walk."""
        return self.keys_per_row or float(self.model.num_fields)

    @property
    def layout(self) -> RowLayout:
        """A row's columns: storage.dim's model and train.sparse_optimizer's states."""
        return RowLayout(self.dim, self.sparse_optimizer)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def k(self) -> int:
        return 1 if self.mode is MergeMode.SYNC else self.every_k_steps

    def dense_merges(self, steps: int) -> int:
        """Dense reductions in a window of ``steps`` steps: one at its end, and one every
        merge.dense_every_steps steps before it (kstep)."""
        e = self.dense_every_steps
        if self.mode is MergeMode.SYNC or e <= 0:
            return 1
        return (steps - 1) // e + 1


@dataclass(frozen=True)
class NodeInfo:
    """What the hardware map (and the user) say about one node; 0 means unknown."""

    name: str
    cpus: int  # cpus of the NUMA nodes the ranks run on
    threads_per_rank: int  # torch threads each rank runs
    host_memory_bytes: float = 0.0  # per node
    gpus: int = 0
    gpu_memory_bytes: float = 0.0  # per GPU
    gpu_model: str = ""  # the map's name of its GPUs (hvctr.plan.gpus reads the datasheet from it)
    ssd_bytes: float = 0.0  # per rank's SSD directory (its file system)
    ranks_per_ssd: int = 1  # ranks whose shards share one SSD
    memory_limited: bool = False  # host_memory_bytes is a limit that counts page cache (a cgroup's, Slurm's --mem)
    notes: tuple[str, ...] = ()


# --- closed forms ---------------------------------------------------------------------


def top_in_features(model: ModelConfig, dim: int) -> int:
    """Width of the MLP that outputs the logit: [emb | dense], DLRM's [bottom output | dot
    products of every pair], DLRM-DCNv2's [bottom output | emb] (a cross network keeps its width)."""
    F = model.num_fields
    if model.arch is ModelArch.DLRM:
        return dim + (F + 1) * F // 2
    if model.arch is ModelArch.DLRM_DCNV2:
        return (F + 1) * dim
    return F * dim + model.num_dense


def linear_layers(model: ModelConfig, dim: int) -> list[tuple[int, int, bool]]:
    """(in, out, has a bias) of every nn.Linear of hvctr.models' architecture ``model.arch``."""
    N = model.num_dense
    layers: list[tuple[int, int, bool]] = []
    if model.arch in BOTTOM_MLP_ARCHS:  # on the dense features, to one more "embedding"
        widths = [N, *model.bottom_mlp]
        layers += [(i, o, True) for i, o in zip(widths[:-1], widths[1:])]
    top_in = top_in_features(model, dim)
    if model.arch in CROSS_ARCHS:
        r = model.cross_rank  # full rank: W (with b); low rank: V^T (no bias), then U (with b)
        layers += ([(top_in, top_in, True)] if r == 0 else [(top_in, r, False), (r, top_in, True)]) * model.cross_layers
    widths = [top_in, *model.hidden, 1]
    layers += [(i, o, True) for i, o in zip(widths[:-1], widths[1:])]
    if model.arch in (ModelArch.DEEPFM, ModelArch.WDL):
        layers.append((N, 1, True))  # the linear term on the dense features
    return layers


def dense_params(model: ModelConfig, dim: int) -> int:
    """Dense parameters P: weights and biases of the model's linear layers (every dense parameter
    of every arch is an nn.Linear's, DCN's cross layers included)."""
    return sum(i * o + (o if bias else 0) for i, o, bias in linear_layers(model, dim))


def dense_flops_per_sample(model: ModelConfig, dim: int) -> int:
    """Forward 2 in out + backward 4 in out per linear layer (the input's gradient is needed:
    it is the embeddings'), except the bottom MLP's first layer, whose input (the dense
    features) needs none: 4 in out. DLRM's interaction is a batched GEMM of the F + 1 vectors
    with themselves: forward 2 (F + 1)^2 D, backward twice that. Element-wise terms, O(F D) a
    layer (DeepFM's FM, the cross layers' x0 * (.) + x_l), are left out."""
    layers = linear_layers(model, dim)
    flops = sum(6 * i * o for i, o, _ in layers)
    if model.arch in BOTTOM_MLP_ARCHS:
        flops -= 2 * layers[0][0] * layers[0][1]
    if model.arch is ModelArch.DLRM:
        flops += 6 * (model.num_fields + 1) ** 2 * dim
    return flops


def activations_per_sample(model: ModelConfig, dim: int) -> int:
    """Floats the forward keeps per sample for the backward: the embeddings and dense features,
    every linear layer's output and, for DLRM, the stacked vectors and their (F + 1)^2 products."""
    F, D = model.num_fields, dim
    act = F * D + model.num_dense + sum(o for _, o, _ in linear_layers(model, dim))
    if model.arch is ModelArch.DLRM:
        act += (F + 1) * D + (F + 1) ** 2
    if model.arch in CROSS_ARCHS:  # x0 and each layer's x_l (the Linear's output is counted above)
        act += (model.cross_layers + 1) * top_in_features(model, dim)
    return act


def rows_per_rank(keys: int, world_size: int) -> int:
    """Rows of the fullest shard: buckets are dealt round robin, ceil(4096 / W) on some ranks."""
    return math.ceil(keys * math.ceil(NUM_BUCKETS / world_size) / NUM_BUCKETS)


def shard_bytes(capacity: int, dim: int, max_load_factor: float,
                optimizer: SparseOptimizer = SparseOptimizer.ADAM) -> dict[str, int]:
    """Bytes of one SSD shard file (hvctr.storage.shard), allocated in full at creation."""
    index = num_slots_for(capacity, max_load_factor) * INDEX_DTYPE.itemsize
    rows = capacity * RowLayout(dim, optimizer).row_bytes
    meta = capacity * META_DTYPE.itemsize
    return {"index": index, "rows": rows, "meta": meta, "total": index + rows + meta}


def powersgd_step_bytes(model: ModelConfig, dim: int, rank: int) -> tuple[int, int]:
    """Bytes one rank puts into each of PowerSGD's two allreduces a step (hvctr.train.merger.
    PowerSGD): an out x in weight whose factors are smaller travels as P (out x r), then Q
    (in x r); biases and the weights it would not shrink travel whole with P (float32)."""
    first = second = 0
    for i, o, bias in linear_layers(model, dim):
        if rank * (o + i) < o * i:
            first, second = first + o * rank, second + i * rank
        else:
            first += o * i
        first += o if bias else 0
    return 4 * first, 4 * second


def shared_row_step_bytes(job: "Job", step_rows: float) -> int:
    """Bytes one rank sends other ranks a step for the shared rows (merge.shared_rows, hvctr.train.
    row_sync), at most: of the t <= min(N, step_rows) shared rows its step touches (``step_rows``:
    a batch's distinct rows), the share f others own: their gradients out, as many values served
    to the others as their owner (the model columns, float32 or merge.shared_rows_bf16's bfloat16),
    and their schedule (an int64)."""
    if not job.shared_rows or job.mode is not MergeMode.KSTEP:
        return 0
    W = job.world_size
    touched = min(float(job.shared_rows), float(step_rows)) * (W - 1) / W
    wire = 2 if job.shared_rows_bf16 else 4
    return int(touched * (2 * wire * job.layout.model_width + 8))


def dense_payload_bytes(params: int, mode: MergeMode, states: MergeStates, compression: Compression) -> int:
    """Bytes one rank puts into the dense merge's grouped allreduce (what KStepMerger and
    SyncGradients count): parameters and m at the wire's width, v always float32, 2 flags."""
    wire = 2 if compression is Compression.FP16 else 4
    flags = 2 * 4
    if mode is MergeMode.SYNC:
        return params * wire + flags
    m = params * wire if states is MergeStates.PARAMS_M_V else 0
    v = params * 4 if states in (MergeStates.PARAMS_V, MergeStates.PARAMS_M_V) else 0
    return params * wire + m + v + flags


def sparse_bytes_per_window(u: float, world_size: int, dim: int, mode: MergeMode,
                            prefetch: bool, optimizer: SparseOptimizer = SparseOptimizer.ADAM) -> dict[str, float]:
    """Bytes a rank sends to other ranks per window: pull (keys out, unless the warm sent them;
    rows answered), warm (the keys), push (k-step: rows only, the owners kept the window's keys
    from its warm or pull, hvctr.storage.exchange.WindowExchange; sync: keys and gradients)."""
    row = RowLayout(dim, optimizer).row_bytes
    f = (world_size - 1) / world_size
    out = {"pull": u * f * ((0 if prefetch else KEY_BYTES) + row), "warm": u * f * KEY_BYTES if prefetch else 0.0}
    if mode is MergeMode.SYNC:
        out["push"] = u * f * (KEY_BYTES + 4 * RowLayout(dim).model_width)
    else:
        out["push"] = u * f * row
    return out


def shard_traffic_per_window(u_o: float, new_o: float, hit: float, cache_entries: float,
                             recent_entries: float = 0.0, logged: bool = False,
                             pending_per_block: float = PENDING_PER_BLOCK) -> dict[str, float]:
    """What one owner's shard does in a window (hvctr.storage.store; the run summary's
    shard_traffic counts the same by cause), rows and 4 KiB index blocks:

    - rows_read: the window's known rows the cache lacks, read by the warm or the pull;
    - index_blocks_read: one a row read (a known key's home block; the key filter spares the
      probes of keys the shard never held, most of a first pass's);
    - rows_written: rows the cache lets go, one a row it takes in (a full cache), each dirty (the
      push wrote it): WRITEBACK_PAGES_PER_ROW pages read, changed and written (the time charges
      pages; this count is rows);
    - new_rows_written: rows created this window that reach the shard the same way, at
      positions one after another (coalesced: written at the flush's rate);
    - push_index_blocks: the push's lookups of rows the pull read but the cache did not keep to
      the push: the warm holds at most half the cache for the pull, and past that the LFU keeps
      older, hotter rows in place of the window's fresh ones; the shard's recent positions
      (``recent_entries`` a generation, hvctr.storage.shard.RecentPositions) answer them where
      they hold the lookups since the window's warm: about two windows' cold rows;
    - index_blocks_written: new rows' index entries, which wait in memory until a block has
      about ``pending_per_block`` of them (PENDING_PER_BLOCK, fewer with a small cache:
      hvctr.storage.shard.pending_capacity), then go to the file a block at a time (read,
      changed, written).

    ``logged``: a pass after the first over the same data with the position log: the window's
    cold rows were looked up by the same window last pass, so neither the reads nor the push's
    lookups read an index block (the log's own reads and writes are 16 sequential bytes a row).
    """
    cold = max(u_o - new_o, 0.0) * (1.0 - hit)
    beyond = max(u_o - cache_entries / 2, 0.0) / u_o if u_o else 0.0
    kept = min(1.0, recent_entries / (2.0 * cold)) if cold else 1.0
    blocks = 0.0 if logged else INDEX_BLOCKS_PER_ROW_READ
    return {"rows_read": cold, "index_blocks_read": cold * blocks, "rows_written": cold,
            "new_rows_written": new_o * (1.0 - hit),
            "push_index_blocks": cold * beyond * (1.0 - kept) * blocks,
            "index_blocks_written": new_o / pending_per_block}


@dataclass(frozen=True)
class ShardRates:
    """Rows (or index blocks) a second one rank gets from its shard: rows read, index blocks
    read, rows written back at random places, rows written one after another; ``cpu``: whether
    the row reads are page-cache rates (CPU work, stretched by oversubscription like other CPU
    times) or the device's."""

    read: float
    index: float
    write: float
    sequential_write: float
    cpu: bool
    where: str  # a person's words for where the row reads come from


def shard_rates(rates: Rates, in_page_cache: bool, write_behind: bool, ranks_per_ssd: int) -> ShardRates:
    """The rates of one rank's shard: from the page cache where the node's shards fit in the
    memory the ranks leave free, else from the device, whose rates (one process alone) the
    ranks on one SSD share. Written back behind (storage.write_behind on, as under a memory
    limit), every written page is flushed to the device and dropped: the rows come back from the
    device (the write's read of its page is mostly a page-cache hit: the pull read the row in the
    same window or the one before); the index, whose pages a later pass does not write, stays in
    the page cache where it fits."""
    share = max(ranks_per_ssd, 1)
    disk_read = rates.disk_rows_per_s / share
    disk_write = (rates.disk_write_rows_per_s or rates.disk_rows_per_s / 2) / share
    seq = rates.flush_rows_per_s or rates.shard_rows_per_s
    index = rates.shard_rows_per_s if in_page_cache else disk_read
    if in_page_cache and not write_behind:
        return ShardRates(rates.shard_rows_per_s, index, rates.shard_write_rows_per_s or rates.shard_rows_per_s / 2,
                          seq, True, "the page cache")
    if write_behind:
        return ShardRates(disk_read, index, disk_write, seq, False,
                          f"the device ({share} rank(s) a device; written pages flushed and dropped)")
    return ShardRates(disk_read, index, disk_read, seq, False, f"the device ({share} rank(s) a device)")


# --- time -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Costs:
    """Per-item seconds from one Rates entry, with the oversubscription stretch applied."""

    r: Rates
    cpu: float  # stretch of CPU times (ranks / cpus when oversubscribed)
    nodes: int
    ranks_per_node: int

    def unique(self, n: float) -> float:
        return self.cpu * n / self.r.unique_keys_per_s

    def copy(self, nbytes: float) -> float:
        return self.cpu * nbytes / self.r.memcpy_bytes_per_s if self.r.memcpy_bytes_per_s else 0.0

    def _links(self, nbytes_intra: float, nbytes_nic: float) -> float:
        t = nbytes_intra / self.r.intra_node_bytes_per_s if self.r.intra_node_bytes_per_s else 0.0
        if nbytes_nic:
            t += nbytes_nic / self.r.nic_bytes_per_s
        return t

    def alltoall(self, out_bytes: float) -> float:
        """Latency + the rank's bytes to other ranks; those to other nodes share the node's NIC."""
        w = self.nodes * self.ranks_per_node
        if w == 1:
            return self.r.alltoall_latency_s
        off = out_bytes * (w - self.ranks_per_node) / (w - 1)
        return (self.r.alltoall_latency_s + self.copy(out_bytes)
                + self._links(out_bytes - off, off * self.ranks_per_node))

    def allreduce(self, payload: float) -> float:
        """Latency + fusion-buffer copies + a ring inside the node, then a ring over the nodes."""
        rpn, n = self.ranks_per_node, self.nodes
        intra = 2 * (rpn - 1) / rpn * payload if rpn > 1 else 0.0
        nic = 2 * (n - 1) / n * payload if n > 1 else 0.0
        return self.r.allreduce_latency_s + self.copy(2 * payload) + self._links(intra, nic)


def rows_held_over(job: "Job", curve: KeyCurve) -> tuple[float, float]:
    """With storage.pull_ahead, the rows a window's pull still answers at the window's end:
    those the window before holds on some rank (their values wait for its push). Keys drawn
    independently from ``curve``, D(n) distinct in n draws: (of a rank's D(k B) working-set
    rows, those among the D(W k B) keys of the whole window before: D(k B) + D(W k B) -
    D((W + 1) k B); of an owner's D(W k B) / W rows, those in both windows: (2 D(W k B) -
    D(2 W k B)) / W)."""
    W, kB = job.world_size, job.k * job.batch_size_per_rank
    u, whole = curve(kB), curve(W * kB)
    holder = max(u + whole - curve((W + 1) * kB), 0.0)
    owner = max(2 * whole - curve(2 * W * kB), 0.0) / W
    return min(holder, u), min(owner, whole / W)


def gpu_kernels_per_step(model: ModelConfig, dim: int) -> int:
    """The kernels one training step runs on a GPU, as torch.profiler counted them on an H200
    (bench.gpu_step): about 108 whatever the model (loss, the sparse path, Adam, zero_grad), 7 a
    linear layer, 3 more a cross layer, 6 DLRM's interaction (129, 159 and 180 for the default
    dnn, dcnv2 and dlrm-dcnv2; counted 130, 161 and 187)."""
    kernels = 108 + 7 * len(linear_layers(model, dim))
    kernels += 3 * model.cross_layers if model.arch in CROSS_ARCHS else 0
    return kernels + (6 if model.arch is ModelArch.DLRM else 0)


def gpu_step_s(job: Job, g: GpuRates, batch_rows: float) -> float:
    """One step's device time on a GPU: the dense model's FLOPs, the sparse path's batch keys
    (the gather of B F rows, its gradient sum per row and lazy Adam of the batch's rows, in
    torch on the device: sorts and index kernels, which the keys, not the bytes, set), dense
    Adam's bytes, and the step's kernels one after another (gpu_kernels_per_step: eager
    PyTorch's dispatch on the host, not the GPU, sets a small model's step). ``batch_rows`` (the
    batch's distinct rows) is kept for callers; their lazy Adam is in the keys' rate."""
    B, F = job.batch_size_per_rank, job.row_keys
    P = dense_params(job.model, job.dim)
    flops = dense_flops_per_sample(job.model, job.dim) * B
    moved = 28 * P  # dense Adam: p, g, m, v read, p, m, v written
    kernels = gpu_kernels_per_step(job.model, job.dim)
    return flops / g.flops_per_s + B * F / g.sparse_keys_per_s + moved / g.bytes_per_s + kernels * g.kernel_s


def _window_times(job: Job, c: _Costs, curve: KeyCurve, hit: float, new_o: float, io: ShardRates,
                  cache_entries: float, on_device: bool, threads: int, gpu: GpuRates | None = None) -> dict[str, float]:
    """Seconds of each phase of one window on one rank (see the module docstring)."""
    r, W, k, B, D = c.r, job.world_size, job.k, job.batch_size_per_rank, job.dim
    F = job.row_keys  # keys a sample: the batch's gather and gradient sum, the window's dedup
    row = job.layout.row_bytes
    f = (W - 1) / W
    u, u_b = curve(k * B), curve(B)
    u_o = curve(W * k * B) / W
    slots = num_slots_for(rows_per_rank(job.keys, W), job.max_load_factor)
    pending = pending_capacity(rows_per_rank(job.keys, W), slots, pending_bytes_for(job.cpu_cache_bytes))
    traffic = shard_traffic_per_window(u_o, new_o, hit, cache_entries, recent_positions_for(job.cpu_cache_bytes),
                                       job.logged_pass, pending / max(slots // SLOTS_PER_BLOCK, 1))
    stretch = c.cpu if io.cpu else 1.0  # page-cache reads are CPU work; the device's are not
    # the warm's and the pull's reads of rows the cache lacks, each with its index block
    shard_read = stretch * (traffic["rows_read"] / io.read + traffic["index_blocks_read"] / io.index)
    # write-back of the rows the cache lets go, the push's index lookups, new rows' writes and
    # their index entries (a block read and written, as a row's page is)
    shard_write = stretch * ((traffic["rows_written"] * WRITEBACK_PAGES_PER_ROW + traffic["index_blocks_written"]) / io.write
                             + traffic["push_index_blocks"] / io.index + traffic["new_rows_written"] / io.sequential_write)
    warm = (2 * c.unique(u) + c.alltoall(u * f * KEY_BYTES) + c.cpu * u_o / r.cache_rows_per_s + shard_read
            if job.prefetch else 0.0)
    prep = c.cpu * k * B / r.data_rows_per_s + c.unique(2 * k * B * F) + r.allreduce_latency_s + warm
    link = r.device_bytes_per_s or (gpu.host_link_bytes_per_s if gpu else 0.0)

    def answer(rows: float, owned: float, new: float) -> float:
        """An owner's store reads of ``owned`` rows (``new`` of them created), the rows' alltoall
        and the scatter of a rank's ``rows``, and their copy to the device."""
        store = c.cpu * (max(owned - new, 0.0) / r.cache_rows_per_s + new / max(r.new_rows_per_s, 1e-9))
        dev = (rows * row / link) if on_device and link else 0.0
        return store + c.alltoall(rows * f * row) + c.copy(rows * row) + dev

    keys_out = 2 * c.unique(u) + c.alltoall(u * f * KEY_BYTES)
    held, held_o = rows_held_over(job, curve) if job.prefetch and job.pull_ahead else (u, u_o)
    if job.prefetch and job.pull_ahead:
        # the warm answers the rows the window before holds on no rank (and a byte a key says
        # which are held over); the window's end answers those, after the push
        prep += answer(u - held, u_o - held_o, new_o) + c.alltoall(u * f)
        pull = keys_out + answer(held, held_o, 0.0)
    else:
        pull = keys_out + answer(u, u_o, new_o) + (0.0 if job.prefetch else shard_read)
    dev = (u * row / link) if on_device and link else 0.0
    P = dense_params(job.model, D)
    flops = dense_flops_per_sample(job.model, D) * B
    cpu_compute = 1.0 if on_device else c.cpu  # an accelerator is not shared with other ranks' threads
    # Rates are one thread's; on the CPU, torch's threads share the matrix products (assumed linear).
    dense_threads = 1 if on_device else max(threads, 1)
    if on_device and gpu is not None:
        step = gpu_step_s(job, gpu, u_b)
    else:
        step = (cpu_compute * (flops / (r.compute_flops_per_s * dense_threads) + P / r.dense_adam_params_per_s
                               + B * F / r.sparse_keys_per_s + u_b / r.sparse_rows_per_s + r.step_overhead_s))
    compute = k * step
    one = dense_payload_bytes(P, job.mode, job.states, job.compression)
    dense_merge = job.dense_merges(k) * c.allreduce(one)  # each a grouped allreduce of its own
    if job.powersgd_rank:  # the gradients' two allreduces every step; the window's end sums the flags alone
        first, second = powersgd_step_bytes(job.model, D, job.powersgd_rank)
        dense_merge = k * (c.allreduce(first) + c.allreduce(second)) + c.allreduce(8)
    shared = shared_row_step_bytes(job, u_b)
    if shared:  # two alltoalls every step: gradients to the owners, values back
        dense_merge += k * 2 * c.alltoall(shared / 2)
    if job.mode is MergeMode.SYNC:
        grad_bytes = KEY_BYTES + 4 * job.layout.model_width
        merge = (dense_merge + 2 * c.unique(u) + c.copy(u * grad_bytes) + c.alltoall(u * f * grad_bytes)
                 + c.cpu * u_o * (1 / r.cache_rows_per_s + 1 / r.sparse_rows_per_s + 1 / r.cache_write_rows_per_s)
                 + shard_write)
    else:
        def push(rows: float, owned: float) -> float:
            """A rank's ``rows`` sent and merged by key, an owner's ``owned`` rows written (and
            their share of the shard's writes)."""
            return (2 * c.unique(rows) + c.copy(rows * (row + KEY_BYTES)) + c.alltoall(rows * f * (row + KEY_BYTES))
                    + c.cpu * owned / r.cache_write_rows_per_s + shard_write * (owned / u_o if u_o else 1.0))

        if job.prefetch and job.pull_ahead and job.push_behind is PushBehind.ON:
            # a window's rows the next window holds (as many as it holds of this one's, in a
            # steady stream of windows) now; the rest, and a byte a key saying which, on the prefetch thread
            merge = dense_merge + push(held, held_o) + dev
            prep += push(u - held, u_o - held_o) + c.alltoall(u * f)
        else:
            merge = dense_merge + push(u, u_o) + dev
    return {"prep": prep, "pull": pull, "compute": compute, "merge": merge, "shard_read": shard_read,
            "shard_write": shard_write, "shard_traffic": traffic}


# --- the plan -------------------------------------------------------------------------


@dataclass
class Plan:
    job: Job
    node: NodeInfo
    rates: Rates
    curve: KeyCurve
    figures: dict[str, float | str]  # named numbers (bytes, rows, seconds), per rank unless named per node
    fits: list[tuple[str, str, str]]  # (where, FITS | NO_FIT | UNKNOWN | INFO, why)
    notes: list[str]


def plan(job: Job, node: NodeInfo, rates: Rates, curve: KeyCurve) -> Plan:
    """Sizes, bytes per step and time per step of ``job`` on ``node`` (see the module docstring)."""
    _check_job(job)
    if job.nodes > 1 and not rates.nic_bytes_per_s:
        raise ValueError(f"{job.nodes} nodes, but the rates have no network figure (nic_bytes_per_s = 0): "
                         "measured on one node; give the network's bandwidth")
    W, k, B, D = job.world_size, job.k, job.batch_size_per_rank, job.dim
    layout = job.layout
    notes: list[str] = list(node.notes)
    table_keys = min(job.keys, round(curve(job.pass_rows))) if job.pass_rows else job.keys
    capacity = rows_per_rank(job.keys, W)
    shard = shard_bytes(capacity, D, job.max_load_factor, job.sparse_optimizer)
    cache_entries = entries_for_budget(layout.width, job.cpu_cache_bytes)
    keys_per_rank = table_keys / W
    hit = _hit_rate(job, curve, cache_entries, keys_per_rank)
    if hit < 1.0:
        notes.append(f"cache holds {cache_entries / keys_per_rank:.1%} of a rank's rows: hit rate "
                     f"{hit:.3f} for an ideal frequency cache (LFU with aging comes close on power-law keys)")
    u, u_b, u_o = curve(k * B), curve(B), curve(W * k * B) / W
    new_o = _new_keys_per_window(job, curve)
    P = dense_params(job.model, D)
    on_device = node.gpus > 0
    # Page cache: host memory the ranks leave free holds shard pages; a shard that does not
    # fit is read from the device at disk_rows_per_s.
    if job.push_behind is PushBehind.AUTO:  # as the trainer resolves it (the shard's capacity: rows_per_rank)
        on = pushes_behind(node.cpus / job.ranks_per_node, node.threads_per_rank, on_device, cache_entries,
                           rows_per_rank(job.keys, W))
        job = dataclasses.replace(job, push_behind=PushBehind.ON if on else PushBehind.OFF)
    behind = 0.0
    if job.prefetch and job.pull_ahead and job.push_behind is PushBehind.ON and job.mode is MergeMode.KSTEP:
        behind = u - rows_held_over(job, curve)[0]  # the rows a push leaves behind, until the prefetch thread sends them
    host_rank = _host_bytes_per_rank(job, u, P, behind)
    windows_owned = 2 if job.prefetch and job.pull_ahead else 1  # this window's and, pulled ahead, the next's
    host_rank += u_o * 8 * windows_owned  # where the owner's pull found its rows, kept for the push's write
    if job.sparse_rule is not SparseRule.AVERAGE or job.shared_rows:  # the owner's rows as pulled, kept for the push
        # (and, with storage.pull_ahead, the next window's too, from its warm to its pull)
        host_rank += u_o * layout.row_bytes * windows_owned
    free = node.host_memory_bytes - job.ranks_per_node * host_rank
    shard_in_ram = node.host_memory_bytes > 0 and free >= job.ranks_per_node * shard["total"]
    behind = job.write_behind is WriteBehind.ON or (job.write_behind is WriteBehind.AUTO and node.memory_limited)
    io = shard_rates(rates, shard_in_ram, behind, node.ranks_per_ssd)
    cpu = _stretch(job, node, rates)
    gpu = (gpu_rates(node.gpu_model, rates.gpu_flops_per_s, rates.gpu_bytes_per_s, rates.gpu_kernel_s,
                     rates.gpu_sparse_keys_per_s)
           if on_device else None)
    if on_device:
        notes.append(f"GPU compute: {gpu.source}" if gpu else
                     f"GPU compute: the GPU {node.gpu_model!r} is not one hvctr.plan.gpus knows and the rates file "
                     "has no gpu_flops_per_s: the step's compute comes from the rates file's compute figures")
    costs = _Costs(rates, cpu, job.nodes, job.ranks_per_node)
    t = _window_times(job, costs, curve, hit, new_o, io, cache_entries, on_device, node.threads_per_rank, gpu)
    traffic = t.pop("shard_traffic")
    spare_core = node.cpus / job.ranks_per_node >= node.threads_per_rank + 1
    main = t["pull"] + t["compute"] + t["merge"]
    overlapped = job.prefetch and spare_core
    window = _window_s(t, overlapped)
    # What to make faster: the prefetch thread when it outlasts the main thread, else the
    # largest phase of the main thread (all four when nothing overlaps).
    phases = {"compute": t["compute"], "pull": t["pull"], "merge": t["merge"]}
    if not overlapped or t["prep"] > main:
        phases["prefetch"] = t["prep"]
    if job.prefetch and not spare_core:
        notes.append("no spare core per rank for the prefetch thread: its time adds to the step")
    sparse = sparse_bytes_per_window(u if job.mode is MergeMode.KSTEP else u_b, W, D, job.mode, job.prefetch,
                                     job.sparse_optimizer)
    payload = dense_payload_bytes(P, job.mode, job.states, job.compression) * job.dense_merges(k)
    if job.powersgd_rank:
        payload = k * sum(powersgd_step_bytes(job.model, D, job.powersgd_rank)) + 8
    dev_bytes = _device_bytes(job, u, P)
    figures = {
        "world_size": W, "dense_params": P, "row_bytes": layout.row_bytes,
        "table_keys": table_keys, "shard_capacity_rows": capacity, "shard_index_bytes": shard["index"],
        "shard_rows_bytes": shard["rows"], "shard_meta_bytes": shard["meta"], "shard_bytes": shard["total"],
        "checkpoint_base_bytes": capacity * (KEY_BYTES + layout.row_bytes + 4),
        "cache_bytes": job.cpu_cache_bytes, "cache_rows": cache_entries, "cache_hit_rate": hit,
        "host_bytes": host_rank,
        # the end of a pass writes every dirty cached row back (as does a checkpoint)
        "end_of_pass_s": (min(cache_entries, keys_per_rank) / rates.flush_rows_per_s
                          if rates.flush_rows_per_s else 0.0),
        "working_set_rows": u, "batch_unique_rows": u_b, "owner_rows_per_window": u_o,
        "new_rows_per_window": new_o, "device_bytes": dev_bytes,
        "pull_bytes_per_step": sparse["pull"] / k, "warm_bytes_per_step": sparse["warm"] / k,
        "push_bytes_per_step": sparse["push"] / k, "dense_payload_bytes_per_step": payload / k,
        "dense_wire_bytes_per_step": payload / k * 2 * (W - 1) / W,
        "sparse_bytes_per_step": sum(sparse.values()) / k,
        "shared_row_bytes_per_step": shared_row_step_bytes(job, u_b),
        **{f"{name}_s_per_step": v / k for name, v in t.items()},
        **{f"shard_{name}_per_window": v for name, v in traffic.items()},
        "shard_reads_from": io.where, "shard_write_behind": behind,
        "step_s": window / k, "bound_by": max(phases, key=phases.get),
        # time of the main thread's step that is not compute: the pull of the rows held over (the
        # rest came ahead, storage.pull_ahead), the dense merge and the push
        "exposed_non_compute_s_per_step": (window - t["compute"]) / k,
        "compute_source": gpu.source if gpu else ("the rates file (GPU unknown)" if on_device else "the rates file"),
        "samples_per_s_per_rank": B * k / window, "samples_per_s": W * B * k / window,
    }
    if not io.cpu:
        note = _storage_bound_note(job, node, rates, curve, costs, t, io, new_o, shard_in_ram, behind, gpu,
                                   keys_per_rank, hit, cache_entries, overlapped)
        if note:
            notes.append(note)
    p = Plan(job, node, rates, curve, figures, [], notes)
    p.fits = _fits(p, shard_in_ram)
    return p


def _hit_rate(job: Job, curve: KeyCurve, cache_entries: float, keys_per_rank: float) -> float:
    """An owner's cache hit rate: an ideal frequency cache of ``cache_entries`` rows a rank."""
    if cache_entries >= keys_per_rank:
        return 1.0
    W = job.world_size
    return curve.hit_rate(W * job.k * job.batch_size_per_rank, cache_entries * W)


def _window_s(t: dict[str, float], overlapped: bool) -> float:
    """A window's seconds: the main thread's phases, and the prefetch thread's beside them where
    it has a core of its own (else after them)."""
    main = t["pull"] + t["compute"] + t["merge"]
    return max(main, t["prep"]) if overlapped else main + t["prep"]


def _storage_bound_note(job: Job, node: NodeInfo, rates: Rates, curve: KeyCurve, costs: "_Costs",
                        t: dict[str, float], io: ShardRates, new_o: float, in_ram: bool, behind: bool,
                        gpu: GpuRates | None, keys_per_rank: float, hit: float, cache_entries: float,
                        overlapped: bool) -> str:
    """Where the SSD's reads and writes outlast the step's compute, what would make the step
    compute-bound, each with the step it would give: a larger cache per rank (the job's doubled
    until it does, or holds the rank's whole table), an SSD of its own for every rank, or a
    faster device."""
    shard = t["shard_read"] + t["shard_write"]
    if shard <= t["compute"]:
        return ""
    k = job.k

    def window(j: Job, r: ShardRates, h: float, entries: float) -> tuple[float, float]:
        w = _window_times(j, costs, curve, h, new_o, r, entries, node.gpus > 0, node.threads_per_rank, gpu)
        return _window_s(w, overlapped), w["shard_read"] + w["shard_write"]

    ms = lambda sec: f"{1e3 * sec / k:,.1f} ms"
    parts = [f"the SSD bounds the step: its reads and writes take {ms(shard)} a step against {ms(t['compute'])} "
             f"of compute ({io.where})"]
    width = job.layout.width
    cache = job.cpu_cache_bytes
    while cache < 2 ** 50:
        cache *= 2
        entries = entries_for_budget(width, cache)
        h = _hit_rate(job, curve, entries, keys_per_rank)
        step, sh = window(dataclasses.replace(job, cpu_cache_bytes=cache), io, h, entries)
        if sh <= t["compute"] or entries >= keys_per_rank:
            parts.append(f"a cache of {cache / 2**30:,.2f} GiB a rank (storage.cpu_cache_bytes, hit rate {h:.3f}) "
                         f"would make it {ms(step)}")
            break
    per_ssd = node.ranks_per_ssd
    if per_ssd > 1:  # the same job with an SSD of its own for every rank
        step, sh = window(job, shard_rates(rates, in_ram, behind, 1), hit, cache_entries)
        parts.append(f"one SSD a rank ({job.ranks_per_node} a node, not {max(job.ranks_per_node // per_ssd, 1)}) "
                     f"would make it {ms(step)}" + (" (still bound by the SSD)" if sh > t["compute"] else ""))
    # a rank's device time scales with 1 / the device's rate: the rate that would match the compute
    parts.append(f"an SSD {shard / max(t['compute'], 1e-12):,.1f}x as fast (random reads at "
                 f"depth: disk_rows_per_s {rates.disk_rows_per_s:,.0f} here) would make the compute bound it")
    return "; ".join(parts)


def _check_job(job: Job) -> None:
    for name in ("nodes", "ranks_per_node", "keys", "dim", "batch_size_per_rank", "every_k_steps"):
        if getattr(job, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(job, name)}")
    if not 0.05 <= job.max_load_factor <= 0.95:
        raise ValueError(f"storage.max_load_factor must be in [0.05, 0.95], got {job.max_load_factor}")


def _new_keys_per_window(job: Job, curve: KeyCurve) -> float:
    """New rows an owner creates per window after the first, in a first pass of job.pass_rows
    rows (the first window's are all new, and left out: the planner sizes the steady state)."""
    if not job.pass_rows:
        return 0.0
    span = job.world_size * job.k * job.batch_size_per_rank  # rows of one window, all ranks
    windows = job.pass_rows / span
    if windows <= 1:
        return curve(span) / job.world_size
    total = min(curve(job.pass_rows), job.keys)
    return max(total - curve(span), 0.0) / job.world_size / (windows - 1)


def _stretch(job: Job, node: NodeInfo, rates: Rates) -> float:
    """CPU times stretch by ranks / cpus when there are more ranks (times threads) than cpus,
    relative to the oversubscription the rates were measured under."""
    want = max(1.0, job.ranks_per_node * node.threads_per_rank / node.cpus)
    had = max(1.0, rates.ranks_per_node / node.cpus)
    return max(want / had, 1.0)


def _host_bytes_per_rank(job: Job, u: float, params: int, behind: float = 0.0) -> float:
    """Cache budget + working set and its messages (and the next window's, pulled ahead, and the
    ``behind`` rows a push left behind) + two windows of data + dense state + the shard's key
    filter, waiting index entries and recent positions + base."""
    row = job.layout.row_bytes
    # a sample's label, dense and keys, and a position (int64) a key; multi-valued: 2 bytes a field's length
    extra = 0 if not job.keys_per_row else 8 * (job.row_keys - job.model.num_fields) + 2 * job.model.num_fields
    window_data = 2 * job.k * job.batch_size_per_rank * (SAMPLE_BYTES + 8 * job.row_keys + extra)
    shard = memory_bytes(rows_per_rank(job.keys, job.world_size), job.max_load_factor, job.cpu_cache_bytes)
    ahead = u * row if job.prefetch and job.pull_ahead else 0.0  # storage.pull_ahead: the next window's rows
    return (job.cpu_cache_bytes + 3 * u * row + ahead + behind * row + window_data + 8 * params * 4 + shard
            + BASE_RANK_BYTES)


def _device_bytes(job: Job, u: float, params: int) -> float:
    """Working set rows + the batch's gathered rows and their gradient + dense params, grads,
    Adam's m and v + activations and their gradients (float32)."""
    B, D, F = job.batch_size_per_rank, job.dim, job.row_keys
    act = B * activations_per_sample(job.model, D)
    layout = job.layout
    return u * layout.row_bytes + 2 * B * F * layout.model_width * 4 + 4 * params * 4 + 2 * act * 4


def _fits(p: Plan, shard_in_ram: bool) -> list[tuple[str, str, str]]:
    fg, node, job = p.figures, p.node, p.job
    gib = lambda b: f"{b / 2**30:,.2f} GiB"
    yes = lambda ok: FITS if ok else NO_FIT
    out: list[tuple[str, str, str]] = []
    ssd_need = fg["shard_bytes"] * node.ranks_per_ssd
    if node.ssd_bytes:
        out.append(("SSD", yes(ssd_need <= node.ssd_bytes),
                    f"{node.ranks_per_ssd} shard(s) of {gib(fg['shard_bytes'])} on one SSD of {gib(node.ssd_bytes)}"))
    else:
        out.append(("SSD", UNKNOWN, f"{node.ranks_per_ssd} shard(s) of {gib(fg['shard_bytes'])} per SSD; "
                                    "SSD size unknown (--ssd-bytes)"))
    host_need = fg["host_bytes"] * job.ranks_per_node
    if node.host_memory_bytes:
        out.append(("host memory", yes(host_need <= node.host_memory_bytes),
                    f"{job.ranks_per_node} ranks x {gib(fg['host_bytes'])} (cache {gib(fg['cache_bytes'])}) "
                    f"of {gib(node.host_memory_bytes)} per node"))
        out.append(("page cache", INFO,
                    "the node's shards fit in the memory the ranks leave free: shard reads at page-cache speed"
                    if shard_in_ram else "the node's shards exceed the memory the ranks leave free: a cache miss "
                                         "is a read from the SSD"))
    else:
        out.append(("host memory", UNKNOWN, f"{gib(host_need)} per node; node memory unknown (map's memory_gib)"))
    if node.gpus:
        if node.gpu_memory_bytes:
            out.append(("GPU memory", yes(fg["device_bytes"] <= node.gpu_memory_bytes),
                        f"working set {fg['working_set_rows']:,.0f} rows + batch + dense state = "
                        f"{gib(fg['device_bytes'])} of {gib(node.gpu_memory_bytes)}"))
        else:
            out.append(("GPU memory", UNKNOWN, f"{gib(fg['device_bytes'])} needed; GPU memory unknown "
                                               "(--gpu-memory-bytes)"))
        if job.ranks_per_node > node.gpus:
            out.append(("GPUs", NO_FIT, f"{job.ranks_per_node} ranks per node, {node.gpus} GPUs: one rank per GPU"))
    if job.ranks_per_node * node.threads_per_rank > node.cpus:
        out.append(("cpus", NO_FIT, f"{job.ranks_per_node} ranks x {node.threads_per_rank} threads on {node.cpus} "
                                    "cpus: oversubscribed, every CPU time stretches"))
    return out
