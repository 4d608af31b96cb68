"""The training loop in windows of k steps.

    for window in windows:                      # the prefetch thread prepares window t+1
        rows = table.pull(window.exchange)      # working set [U, row] from the owners
        for batch in window: local step         # gather -> model -> loss -> backward -> lazy/dense Adam
        merger.merge(dense params, Adam moments, flags)   # one grouped allreduce
        table.push(window.exchange, rows)       # owners average each row over its contributors
                                                # (storage.push_behind: the next window is taken first,
                                                # and only the rows it holds go now, the rest from the
                                                # prefetch thread after its pull; storage.defer_writes:
                                                # all go, owners write the rest after that pull)
        maybe checkpoint; stop if any rank asked

A window arrives routed (its keys' owners, computed once where it was built, in its
WindowExchange) and with each batch's unique positions: the steps and exchanges never hash or
sort its keys again. Its keys go to their owners once, in the prefetch thread's warm or else
in the pull; the push sends rows only.

``merge.mode = sync`` is the baseline: windows of one step, dense gradients averaged before
every Adam step, sparse gradients pushed to the owners, which apply one Adam step.
"""

from __future__ import annotations

import contextlib
import functools
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from hvctr.checkpoint.format import TrainState, checkpoint_path, locate
from hvctr.checkpoint.manager import CheckpointManager
from hvctr.config import Compression, Config, MergeMode, PushBehind, SparseRule
from hvctr.distributed.world import AgreedError
from hvctr import memcg
from hvctr.formats import RowLayout, default_bucket_owner
from hvctr.heap import HeapTrimmer, trim_wanted
from hvctr.log import get_logger
from hvctr.metrics import EvalAccumulator
from hvctr.models import build_model
from hvctr.data.bags import Bags, field_pooling_mask
from hvctr.optim import (adam_step_count, apply_step_to_rows, gather_embeddings, get_adam_states, set_adam_states,
                         sparse_step, sum_embedding_grads)
from hvctr.optim.pooling import embed_batch, gather_pooled, sum_pooled_grads
from hvctr.storage import EmbeddingStore, ShardedTable, shard_path
from hvctr.train.feed import TrainData
from hvctr.train.lr import LearningRates
from hvctr.config.resolve import batch_growth, pushes_behind, resolve_merge
from hvctr.train.merger import KStepMerger, SyncGradients
from hvctr.train.meter import Meter
from hvctr.train.prefetch import Schedule, WindowSource
from hvctr.train.row_sync import SharedRowSync
from hvctr.rundir import private_scratch_dir, working_shard_place
from hvctr.storage.cache import entries_for_budget
from hvctr.topo.bind import rank_cpus
from hvctr.train.stop import StopRequest
from hvctr.train.window import Window

if TYPE_CHECKING:
    from hvctr.distributed.protocol import Comm

log = get_logger(__name__)

STOP, CHECKPOINT = 0, 1  # indices of the control flags carried by the merge
_NOT_TAKEN = object()  # _train_window did not take the next window from the source


class Trainer:
    def __init__(self, cfg: Config, comm: Comm, device: torch.device, run_dir: Path, resume: bool,
                 init_from: str | None = None, stop: StopRequest | None = None, ssd_dir: str = "",
                 guard: Callable[[], None] | None = None) -> None:
        """``guard``: checked before each checkpoint (rank 0's RunLock.check_in_place: the run
        directory deleted or moved mid-run stops every rank there, CheckpointManager)."""
        self.cfg, self.comm, self.device, self.run_dir = cfg, comm, device, run_dir
        if cfg.storage.rows_per_rank == 0:  # hvctr train's preflight sized it; other callers size it here
            from hvctr.train.preflight import size_shard

            cfg, sizing = size_shard(cfg, comm.size, init_from, check=False)
            self.cfg = cfg
            log.info(sizing)
        self.shard_dir, self.shard_dir_source, self.shard_scratch = working_shard_place(cfg, run_dir, ssd_dir)
        self.dim = cfg.storage.dim
        # the columns of a row (train.sparse_optimizer's states): what the sparse step and evaluation read
        self.layout = RowLayout(self.dim, cfg.train.sparse_optimizer)
        # multi-valued fields: 1 where a field's bag is pooled by its mean, 0 by its sum (model.pooling)
        self.pooling = torch.from_numpy(field_pooling_mask(cfg.model.pooling, cfg.model.num_fields))
        self.model = build_model(cfg.model, self.dim, seed=cfg.train.seed).to(device)
        t = cfg.train
        # merge.lr_scaling, merge.adam_scaling: the rates of each step and Adam's constants at W ranks
        self.lr = LearningRates(t, cfg.merge, batch_growth(cfg.data, comm.size))
        # merge's auto settings at this world size, for this optimiser's rows
        self.merge_cfg = resolve_merge(cfg.merge, comm.size, cfg.train.sparse_optimizer)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=t.dense_lr, betas=(self.lr.beta1, self.lr.beta2),
                                          eps=self.lr.eps)
        self.data = TrainData(cfg.data, comm, run_dir=run_dir)
        self.ckpt = CheckpointManager(cfg.checkpoint.dir or run_dir / "checkpoints", comm,
                                      cfg.checkpoint.keep, cfg.checkpoint.compact_every, guard=guard)
        start = self._find_start(resume, init_from)
        # The bucket table travels with the checkpoint (hvctr reshard rewrites it); a fresh
        # model deals the buckets round robin.
        owner = start[0].bucket_owner(start[1]) if start else default_bucket_owner(comm.size)
        self.store, self.table = self._build_table(owner)
        self.reducer = self._build_reducer()
        self.state = TrainState()
        self.lineage: dict[str, Any] | None = None  # the checkpoint this model was initialised from
        self.meter = Meter(comm.rank, run_dir / "metrics.jsonl", cfg.metrics.log_every_steps,
                           cfg.data.batch_size_per_rank, comm.size,
                           tensorboard_dir=run_dir / "tensorboard" if cfg.metrics.tensorboard else None)
        self.stop = stop or StopRequest()  # carried by the next merge as [stop, checkpoint] flags
        self.heap = self._build_heap_trimmer()
        self._ws_rows = 0  # rows of the last window's working set
        self._merge_ms = 0.0  # dense merge + sparse push of the last window
        self._shared_rows_synced = 0  # merge.shared_rows: rows synchronised, summed over windows
        self._shared_bytes = [0, 0]  # and the bytes this rank sent and received for them
        self.preempted = False
        self._checkpointed_step: int | None = None  # the step the newest checkpoint holds (this run's)
        if start:
            self._load(*start)
        self._samples_at_start = self.state.samples

    # --- building ------------------------------------------------------------------------

    def _build_table(self, owner: np.ndarray) -> tuple[EmbeddingStore, ShardedTable]:
        # Always a fresh working shard: on resume it is rebuilt from the checkpoint's chain.
        def create() -> EmbeddingStore:
            try:
                if self.shard_scratch:  # a shared, often world-writable place: a directory of this user alone
                    private_scratch_dir(self.shard_dir)
                else:
                    self.shard_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                where = ("the hardware map's ssd path" if self.shard_dir_source == "the hardware map's SSD"
                         else self.shard_dir_source)
                raise ValueError(f"cannot create the working-shard directory {self.shard_dir} ({where}): "
                                 f"{e.strerror or e}") from None
            return EmbeddingStore(self.cfg.storage, shard_path(self.shard_dir, self.comm.rank), rank=self.comm.rank,
                                  world_size=self.comm.size, bucket_owner=owner, create=True,
                                  optimizer=self.cfg.train.sparse_optimizer)

        # comm: allgather of shard-creation errors (a full disk is one rank's: no rank waits alone)
        store = self.comm.agree(create, name="shard.create")
        return store, ShardedTable(self.comm, store, owner, self.device, self.merge_cfg.sparse_rule,
                                   defer_writes=self.cfg.storage.defer_writes,
                                   shared_rows=self.merge_cfg.shared_rows,
                                   pull_ahead=self.cfg.storage.pull_ahead and self.cfg.data.prefetch,
                                   push_behind=self._push_behind(store))

    def _push_behind(self, store: EmbeddingStore) -> bool:
        """storage.push_behind resolved, alike on every rank (it decides what the collectives
        send): auto is hvctr.config.resolve.pushes_behind on every rank."""
        s = self.cfg.storage
        if (s.push_behind is PushBehind.OFF or not (s.pull_ahead and self.cfg.data.prefetch)
                or self.cfg.merge.mode is not MergeMode.KSTEP):
            return False
        if s.push_behind is PushBehind.ON:
            return True
        cpus, why = rank_cpus(self.comm.local_size)
        cache_rows = entries_for_budget(store.layout.width, s.cpu_cache_bytes)
        cached = cache_rows / max(store.shard.capacity, 1)
        spare = pushes_behind(cpus, torch.get_num_threads(), self.device.type == "cuda", cache_rows,
                              store.shard.capacity)
        # comm: allreduce (Min) of whether each rank would push behind (one off: all off)
        (every,) = self.comm.allreduce_min_int([int(spare)], name="push_behind.spare")
        if self.comm.rank == 0:
            log.info(f"storage.push_behind auto: {'on' if every else 'off'} (rank 0: {why}, "
                     f"{torch.get_num_threads()} torch thread(s), device {self.device.type}, "
                     f"a cache of {cached:.1%} of its shard's rows"
                     + ("" if every == spare else "; off on another rank") + ")")
        return bool(every)

    def _build_heap_trimmer(self) -> HeapTrimmer:
        """storage.heap_trim: the C heaps' free pages back to the system after each window."""
        limit = memcg.current()
        heap = HeapTrimmer(trim_wanted(self.cfg.storage.heap_trim.value, limit is not None))
        if heap.enabled and self.comm.rank == 0:
            why = (f"a memory limit of {limit.limit / 2**30:,.2f} GiB" if limit is not None
                   else "storage.heap_trim = window")
            log.info(f"heap: freed memory handed back to the system after each window ({why}; hvctr.heap)")
        return heap

    def _build_reducer(self) -> KStepMerger | SyncGradients:
        params = list(self.model.parameters())
        hier = self.cfg.topology.hierarchical_allreduce
        reducer = (SyncGradients(self.comm, self.merge_cfg, params, hier) if self.cfg.merge.mode is MergeMode.SYNC
                   else KStepMerger(self.comm, self.merge_cfg, params, hier, seed=self.cfg.train.seed))
        nodes = f"{self.comm.num_nodes} node(s) {self.comm.node_ranks}"
        if reducer.hierarchical:
            log.info(f"dense merge: hierarchical over {nodes}: inside each node, then node leaders only")
        elif hier:
            log.info(f"dense merge: flat (topology.hierarchical_allreduce asked for, but {nodes}: no hierarchy)")
        return reducer

    def _schedule(self) -> Schedule:
        k = 1 if self.cfg.merge.mode is MergeMode.SYNC else self.cfg.merge.every_k_steps
        return Schedule(batches_per_epoch=self.data.batches_per_epoch, epochs=self.cfg.train.epochs,
                        every_k_steps=k, max_working_set_rows=self.cfg.storage.max_working_set_rows,
                        max_steps=self.cfg.train.max_steps,
                        k_warmup_steps=0 if k == 1 else self.cfg.merge.k_warmup_steps)

    # --- the loop ------------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        schedule = self._schedule()
        total = schedule.total_steps()
        if isinstance(self.reducer, KStepMerger):
            self.reducer.mark_start()  # the outer step's start: the model as loaded or initialised
        source = WindowSource(self.data.reader_for_epoch, schedule, self.comm, self.table.warm,
                              (self.state.epoch, self.state.batch, self.state.window),
                              self.cfg.data.prefetch, self.cfg.train.queue_timeout_s,
                              route=functools.partial(self.table.route, trusted=True),
                              before_window=self.table.settle_push)
        log.info(f"training: {total} steps per rank, {schedule.batches_per_epoch} batches per epoch "
                 f"({self.data.dropped_batches} remainder batches dropped on this rank), "
                 f"merge {self.cfg.merge.mode.value} k={schedule.every_k_steps}"
                 + (f", dense every {self.merge_cfg.dense_every_steps} steps"
                    + (" (fp16 moves)" if self.merge_cfg.compression is Compression.FP16 else "")
                    if self.merge_cfg.dense_every_steps else "")
                 + (f" (from 1 over the first {schedule.k_warmup_steps} steps)" if schedule.k_warmup_steps else "")
                 + (f", dense gradients averaged every step (powersgd, rank {self.merge_cfg.powersgd_rank})"
                    if getattr(self.reducer, "powersgd", None) is not None else "")
                 + (f", {self.merge_cfg.shared_rows:,} shared rows a window synchronised every step"
                    if self.cfg.merge.mode is MergeMode.KSTEP and self.merge_cfg.shared_rows else "")
                 + (f", owners' rule {self.merge_cfg.sparse_rule.value}"
                    if self.cfg.merge.mode is MergeMode.KSTEP and self.merge_cfg.sparse_rule is not SparseRule.AVERAGE
                    else "")
                 + f"; {self.lr.describe()}")
        every = self.cfg.checkpoint.every_windows
        eval_every = self.cfg.metrics.eval_every_windows
        self.meter.start(self.state.step)
        try:
            window = source.next()
            while window is not None:
                flags, following = self._train_window(window, source)
                if following is _NOT_TAKEN and self.table.pull_ahead:
                    # the window the prefetch thread is preparing (asked for at this window's pull;
                    # after a stop too): its pull ahead adds rows to the store, so it ends before
                    # whatever reads the store whole next (a checkpoint, a pass's end, validation).
                    # Taken, it lets no window after it start before its own pull.
                    following = source.next(prepare_following=False)
                self._advance(window, schedule)
                if self.state.batch == 0:
                    self._end_pass()
                if flags[CHECKPOINT] or (every and self.state.window % every == 0):
                    self.save_checkpoint()
                if flags[STOP]:
                    self.preempted = True
                    log.warning(f"stop requested: stopped after window {window.index}, step {self.state.step}")
                    break
                if eval_every and self.state.window % eval_every == 0 and self.state.step < total:
                    self.validate()  # every rank alike: the window count is agreed
                with self.meter.phase("merge"):  # the window's end: its freed arrays
                    self.heap.trim()
                self.meter.maybe_log(self.state.step, total, self._progress_extra())
                window = source.next() if following is _NOT_TAKEN else following
        except BaseException:
            # the prefetch thread's warm may wait for rows a push deferred: store them, so that
            # it ends and the thread stops (the error raised is the one that stopped training)
            with contextlib.suppress(Exception):
                self.store.settle()
            raise
        finally:
            source.close()
        self.meter.seconds["io"] += source.read_seconds if not self.cfg.data.prefetch else 0.0
        if not self.preempted and self.state.step != self._checkpointed_step:  # not twice at one step
            self.save_checkpoint()
        return self.summary(prefetch_read_s=source.read_seconds)

    def train_and_evaluate(self) -> dict[str, Any]:
        """The job of `hvctr train` (and of each rank of `hvctr simulate`): train, then, unless
        preempted, the validation metrics as the summary's "eval"; the trainer is closed after."""
        try:
            summary = self.train()
            if not self.preempted:
                summary["eval"] = self.validate(final=True)
        finally:
            self.close()
        return summary

    def _advance(self, window: Window, schedule: Schedule) -> None:
        s = self.state
        s.window = window.index + 1
        s.step += window.num_batches
        s.samples += window.num_batches * self.cfg.data.batch_size_per_rank * self.comm.size
        s.batch = window.first_batch + window.num_batches
        s.epoch = window.epoch
        if s.batch >= schedule.batches_per_epoch:
            s.epoch, s.batch = s.epoch + 1, 0

    def _end_pass(self) -> None:
        """A pass over the data ended: the TTL clock advances and, with storage.ttl_passes,
        each rank drops its rows unseen for that many passes. Those rows live on in the
        current checkpoint base, so the next checkpoint is a new base (on every rank alike)."""
        with self.meter.phase("io"):
            self.table.settle_push()  # the rows the last push left behind, before the pass's end
            self.store.end_pass()
            dropped = self.store.compact()
        if self.cfg.storage.ttl_passes:
            self.ckpt.force_base()
            log.info(f"pass {self.store.pass_index} done: rank {self.comm.rank} dropped {dropped} rows "
                     f"unseen for {self.cfg.storage.ttl_passes} passes")

    def _train_window(self, w: Window, source: WindowSource) -> tuple[list[int], Window | None | object]:
        """Window w's pull, local steps, merge and push: (the merge's flags, the next window where
        it was taken before the push, else _NOT_TAKEN)."""
        with self.meter.phase("pull"):
            rows = self.table.pull(w.exchange_keys, name=f"window{w.index}.pull")  # sends no keys after a warm
        source.prepare_following()  # w was taken before the last push: its following warm starts now
        self._ws_rows = int(rows.shape[0])
        if self.cfg.merge.mode is MergeMode.SYNC:
            return self._sync_step(w, rows), _NOT_TAKEN
        every = self.merge_cfg.dense_every_steps
        shared = self._shared_rows(w, rows)
        for i in range(w.num_batches):
            with self.meter.phase("compute"):
                self._local_step(w, i, rows, shared)
            if every and (i + 1) % every == 0 and i + 1 < w.num_batches:
                with self.meter.phase("merge"):  # the dense model alone, inside the window
                    self.reducer.merge(self._moments(), [0, 0], name=f"window{w.index}.dense{i + 1}")
        if shared is not None:
            self._shared_bytes = [self._shared_bytes[0] + shared.bytes_sent, self._shared_bytes[1] + shared.bytes_received]
        with self.meter.phase("merge"):
            t0 = time.perf_counter()
            moments = self._moments()
            flags = self.reducer.merge(moments, self._flags(), name=f"window{w.index}.merge")
            merge_s = time.perf_counter() - t0
        # The next window, taken before the push where the rows it does not hold may go to their
        # owners after its pull (storage.push_behind) or be written then (storage.defer_writes):
        # its warm sent its keys to them. Not
        # after a stop: the prefetch thread then starts no window past the next (prefetch.py);
        # the one after it, not before its pull (prepare_following above).
        following: Window | None | object = _NOT_TAKEN
        if (self.table.defer_writes or self.table.push_behind) and self.cfg.data.prefetch and not flags[STOP]:
            following = source.next(prepare_following=False)
        ahead = following.exchange if isinstance(following, Window) else None
        with self.meter.phase("merge"):
            t0 = time.perf_counter()
            # rows only: the owners kept the keys; steps: what merge.sparse_rule = matched reads
            self.table.push(w.exchange_keys, rows, name=f"window{w.index}.push", steps=w.num_batches, ahead=ahead)
            self._merge_ms = 1e3 * (merge_s + time.perf_counter() - t0)
        return flags, following

    def _flags(self) -> list[int]:
        return [self.stop.requested, self.stop.requested]  # a stop always checkpoints first

    def _moments(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        m_v = get_adam_states(self.optimizer, ("exp_avg", "exp_avg_sq"))
        return m_v[0::2], m_v[1::2]

    def _forward_backward(self, w: Window, i: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch i's step up to its gradients: (distinct positions, summed gradient of each)."""
        if w.bags is not None:  # multi-valued fields: each (row, field) bag pooled (hvctr.optim.pooling)
            pos, off = (torch.from_numpy(a).to(self.device) for a in w.bags[i])
            emb, w1 = gather_pooled(rows, pos, off, self.pooling, self.cfg.model.num_fields, self.dim)
        else:
            pos = torch.from_numpy(w.positions[i]).to(self.device)
            # two contiguous leaves, [B, F, D] and [B, F]: the model reads them without a copy and
            # its backward writes their gradients whole (gather_rows' [B, F, D+1] would be sliced)
            emb, w1 = gather_embeddings(rows, pos, self.dim)
        dense = torch.from_numpy(w.dense[i]).to(self.device)
        labels = torch.from_numpy(w.labels[i]).to(self.device)
        logits = self.model(dense, emb, w1)
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.meter.add_loss(float(loss.detach()))
        if w.bags is not None:
            return sum_pooled_grads(pos, off, self.pooling, emb.grad, w1.grad, self._batch_unique(w, i))
        return sum_embedding_grads(pos, emb.grad, w1.grad, self._batch_unique(w, i))

    def _shared_rows(self, w: Window, rows: torch.Tensor) -> SharedRowSync | None:
        """The rows window w's steps synchronise (merge.shared_rows; the pull chose them)."""
        shared = w.exchange.shared if w.exchange is not None else None
        if shared is None or shared.total == 0:  # the same on every rank: the allgathered total
            return None
        touched = [w.batch_unique[i][0] for i in range(w.num_batches)]  # each step's distinct positions
        sync = SharedRowSync(self.comm, shared, rows, self.layout, touched, name=f"window{w.index}.shared",
                             bf16=self.merge_cfg.shared_rows_bf16)
        self._shared_rows_synced += shared.total
        return sync

    def _local_step(self, w: Window, i: int, rows: torch.Tensor, shared: SharedRowSync | None = None) -> None:
        step = self.state.step + i  # this step's index: the same on every rank, and on resume
        idx, g = self._forward_backward(w, i, rows)
        lr = self.lr.sparse(step)
        if shared is not None:  # comm: the shared rows' gradients to their owners, values back (SharedRowSync)
            idx, g = shared.split_step(rows, i, idx, g, lr, self.lr.beta1, self.lr.beta2, self.lr.eps,
                                       name=f"window{w.index}.shared{i}")
        sparse_step(self.layout, rows, idx, g, lr, self.lr.beta1, self.lr.beta2, self.lr.eps)
        if getattr(self.reducer, "powersgd", None) is not None:
            self.reducer.average_gradients(name=f"window{w.index}.step{i}")  # comm: two grouped allreduces
        self._set_dense_lr(step)
        self.optimizer.step()

    def _set_dense_lr(self, step: int) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr.dense(step)

    def _batch_unique(self, w: Window, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch i's unique positions and inverse (computed with the window) on the device."""
        uniq, inverse = w.batch_unique[i]
        return uniq.to(self.device), inverse.to(self.device)

    @staticmethod
    def _touched_keys(w: Window, idx: np.ndarray):
        """The keys at working-set positions ``idx`` (increasing), routed from the window's
        routing: a one-batch window touches all its keys, so that is the window's own."""
        return w.routing.subset(idx) if w.routing is not None else w.unique_keys[idx]

    def _sync_step(self, w: Window, rows: torch.Tensor) -> list[int]:
        with self.meter.phase("compute"):
            idx, g = self._forward_backward(w, 0, rows)
        with self.meter.phase("merge"):
            t0 = time.perf_counter()
            flags = self.reducer.average(self._flags(), name=f"window{w.index}.grads")
            apply = functools.partial(apply_step_to_rows, self.layout, lr=self.lr.sparse(self.state.step),
                                      beta1=self.lr.beta1, beta2=self.lr.beta2, eps=self.lr.eps)
            touched = self._touched_keys(w, idx.cpu().numpy())
            self.table.push_gradients(touched, g, apply, name=f"window{w.index}.sgrads")
            self._merge_ms = 1e3 * (time.perf_counter() - t0)
        with self.meter.phase("compute"):
            self._set_dense_lr(self.state.step)
            self.optimizer.step()
        return flags

    # --- evaluation ----------------------------------------------------------------------

    def validate(self, final: bool = False) -> dict[str, float]:
        """The validation metrics now, into metrics.jsonl and the log; the time it takes is left
        out of samples/s and the ETA. Read-only: training continues from the same state."""
        t0 = time.perf_counter()
        result = self.evaluate("valid")
        seconds = time.perf_counter() - t0
        self.meter.exclude(seconds)
        self.meter.log_eval(self.state.step, self.state.samples, result, seconds, final=final)
        return result

    @torch.no_grad()
    def evaluate(self, split: str = "valid") -> dict[str, float]:
        """AUC, logloss, NE, COPC over every row of ``split``, from histograms summed over ranks."""
        self.table.settle_push()  # the rows the last push left behind: read below
        self.model.eval()
        reader = self.data.eval_reader(split)
        # comm: allreduce (Max) of the number of eval batches; ranks out of data send empty pulls
        (n,) = self.comm.allreduce_max_int([reader.num_batches], name=f"eval.{split}.batches")
        acc = EvalAccumulator(self.cfg.metrics.auc_buckets)
        for b in range(n):
            labels, dense, keys = reader.batch(b) if b < reader.num_batches else reader.empty()
            uniq, inv = np.unique(keys.values if isinstance(keys, Bags) else keys.reshape(-1), return_inverse=True)
            rows = self.table.read_only(uniq, name=f"eval.{split}.{b}")
            if labels.shape[0] == 0:
                continue
            if isinstance(keys, Bags):  # multi-valued fields: pooled as training pools them
                emb, w1 = embed_batch(rows, keys.with_values(inv), self.pooling, self.dim)
            else:  # views of the full-width rows (hvctr score reads them through the same strides)
                g = rows[torch.from_numpy(inv.reshape(keys.shape)).to(self.device)]
                emb, w1 = g[..., self.layout.w], g[..., self.layout.w1]
            logits = self.model(torch.from_numpy(dense).to(self.device), emb, w1)
            acc.add_logits(logits, torch.from_numpy(labels))
        # comm: one grouped allreduce (Sum) of the evaluation histograms and sums
        summed = self.comm.allreduce_sum(acc.tensors(), name=f"eval.{split}.hist")
        self.model.train()
        return EvalAccumulator.from_tensors(summed).result()

    # --- checkpoints ---------------------------------------------------------------------

    def _dense_state(self) -> dict[str, torch.Tensor]:
        out = {f"param.{i:03d}": p for i, p in enumerate(self.model.parameters())}
        m, v = self._moments()
        out.update({f"exp_avg.{i:03d}": t for i, t in enumerate(m)})
        out.update({f"exp_avg_sq.{i:03d}": t for i, t in enumerate(v)})
        out["adam_step"] = torch.tensor([adam_step_count(self.optimizer)], dtype=torch.int64)
        out.update({f"outer_u.{i:03d}": u for i, u in enumerate(getattr(self.reducer, "momentum", []))})
        return out

    def save_checkpoint(self) -> None:
        t0 = time.monotonic()
        with self.meter.phase("io"):
            self.table.settle_push()  # the rows the last push left behind: in this checkpoint
            path = self.ckpt.save(self.store, self._dense_state(), self.state,
                                  extra={"mode": self.cfg.merge.mode.value, "train_dir": self._train_dir(),
                                         "init_from": self.lineage,
                                         "batch_size_per_rank": self.cfg.data.batch_size_per_rank,
                                         # the data's multi-valued fields: how hvctr score parses text for it
                                         "multi_valued": self.data.multi_valued})
        self._checkpointed_step = self.state.step
        kind = (self.ckpt.last_manifest() or {}).get("kind", "?")
        log.info(f"checkpoint {path.name} ({kind}) written at step {self.state.step} in {time.monotonic() - t0:.1f} s")

    def _train_dir(self) -> str:
        return str(Path(self.cfg.data.train_dir).resolve())

    def _find_start(self, resume: bool, init_from: str | None) -> tuple[CheckpointManager, dict, str] | None:
        """(manager, manifest, "resume" | "init") of the checkpoint to start from; None: fresh.

        --resume continues this run from its newest checkpoint. --init-from starts a new pass
        over data.train_dir from another model (yesterday's run). Both, as a requeued job of a
        day chain passes them: resume if this run holds a checkpoint written on this data,
        else init. Collective (find_latest), and every rank takes the same branch.
        """
        own = self.ckpt.find_latest() if resume else None
        if own is not None and (init_from is None or own.get("train_dir") == self._train_dir()):
            self.ckpt.set_aside_newer(own)
            return self.ckpt, own, "resume"
        if init_from is None:
            if resume and self.ckpt.has_checkpoints():  # never start over on top of checkpoints
                raise AgreedError(f"--resume: no checkpoint in {self.ckpt.dir} can be loaded (see the warnings "
                                  f"above); move that directory away to start afresh", report=self.comm.rank == 0)
            if resume:
                log.info("resume: no complete checkpoint found; starting fresh")
            elif self.ckpt.has_checkpoints():
                raise ValueError(f"{self.ckpt.dir} already holds checkpoints: pass --resume to continue that run, "
                                 f"or choose a new train.run_dir")
            return None
        src_dir, seq = locate(init_from)
        same = src_dir.resolve() == self.ckpt.dir.resolve()
        if not same and self.ckpt.has_checkpoints():
            raise ValueError(f"{self.ckpt.dir} already holds checkpoints of other data than {self._train_dir()}: "
                             f"choose a new train.run_dir for --init-from {init_from}")
        src = self.ckpt if same else CheckpointManager(src_dir, self.comm, self.cfg.checkpoint.keep,
                                                        self.cfg.checkpoint.compact_every)
        manifest = src.find_latest(seq)
        if manifest is None:
            raise ValueError(f"--init-from {init_from}: no complete checkpoint in {src_dir}")
        return src, manifest, "init"

    def _load(self, src: CheckpointManager, manifest: dict[str, Any], how: str) -> None:
        """Model, optimiser state, admission counts and TTL clock from a checkpoint. "resume"
        also takes its place in the data; "init" starts a new pass (epoch 0, batch 0), and
        its first checkpoint is a base unless it shares the source's checkpoint directory."""
        t0 = time.monotonic()
        with self.meter.phase("io"):
            dense = src.load(manifest, self.store)
        params = list(self.model.parameters())
        with torch.no_grad():
            for i, p in enumerate(params):
                saved = dense.get(f"param.{i:03d}")
                if saved is None or saved.shape != tuple(p.shape):
                    raise ValueError(f"checkpoint {checkpoint_path(src.dir, manifest['seq'])}: dense parameter {i} "
                                     f"has shape {None if saved is None else saved.shape}, this model's "
                                     f"{tuple(p.shape)} (model.* or storage.dim differ)")
                p.copy_(torch.from_numpy(saved))
        n = len(params)
        states = [torch.from_numpy(dense[f"{name}.{i:03d}"]) for i in range(n) for name in ("exp_avg", "exp_avg_sq")]
        set_adam_states(self.optimizer, states, ("exp_avg", "exp_avg_sq"))
        for s in self.optimizer.state.values():
            s["step"] = torch.tensor(float(dense["adam_step"][0]), dtype=torch.float32)
        with torch.no_grad():  # the outer step's momentum (merge.outer_momentum), where the run keeps one
            for i, u in enumerate(getattr(self.reducer, "momentum", [])):
                if f"outer_u.{i:03d}" in dense:
                    u.copy_(torch.from_numpy(dense[f"outer_u.{i:03d}"]))
        where = checkpoint_path(src.dir, manifest["seq"])
        if how == "resume":
            self.state = TrainState(**manifest["state"])
            if isinstance(manifest.get("resharded_from"), dict):  # the epoch's samples, in this size's batches
                self.state.batch, note = self.data.resharded_position(manifest["resharded_from"], self.state.batch,
                                                                      self.state.epoch)
                if note:
                    log.warning(note)
            if self.state.batch >= self.data.batches_per_epoch:  # a resharded position past this size's epoch
                self.state.epoch, self.state.batch = self.state.epoch + 1, 0
            self.lineage = manifest.get("init_from")
            self._checkpointed_step = self.state.step if src is self.ckpt else None
            log.info(f"resumed from checkpoint {manifest['seq']} at step {self.state.step} "
                     f"(epoch {self.state.epoch}, batch {self.state.batch}) in {time.monotonic() - t0:.1f} s")
            return
        self.lineage = {"checkpoint": str(where.resolve()), "seq": manifest["seq"], "state": manifest["state"]}
        log.info(f"initialised from {where} (dense Adam step {int(dense['adam_step'][0])}, "
                 f"TTL pass {self.store.pass_index}): a new pass over {self._train_dir()}")

    # --- reporting -----------------------------------------------------------------------

    def _progress_extra(self) -> dict[str, Any]:
        st = self.store.stats()
        return {"cache_hit_rate": round(st["cache_hit_rate"], 4), "working_set_rows": self._ws_rows,
                "merge_ms": round(self._merge_ms, 2)}

    def summary(self, prefetch_read_s: float = 0.0) -> dict[str, Any]:
        elapsed = self.meter.elapsed()
        ts = self.table.stats()
        sparse_bytes = sum(v for k, v in ts.items() if k.endswith("bytes_sent") and not k.startswith("read_only"))
        samples = max(self.state.samples, 1)
        return {
            "steps": self.state.step, "samples": self.state.samples, "seconds": round(elapsed, 3),
            # this process's share of the run: a resumed run counts only what it trained itself
            "samples_per_s": round((self.state.samples - self._samples_at_start) / max(elapsed, 1e-9), 1),
            "time_split_s": {k: round(v, 3) for k, v in self.meter.seconds.items()},
            "prefetch_read_s": round(prefetch_read_s, 3),
            "validation_s": round(self.meter.excluded_s, 3),  # metrics.eval_every_windows' passes, not in seconds
            "dense_merge_bytes": self.reducer.bytes_sent, "dense_merge_calls": self.reducer.calls,
            "dense_merge": "hierarchical" if self.reducer.hierarchical else "flat",
            "nodes": self.comm.node_ranks,  # ranks of each node (host, or topology.ranks_per_virtual_node)
            "dense_bytes_per_sample": self.reducer.bytes_sent * self.comm.size / samples,
            "sparse_exchange_bytes": int(sparse_bytes),
            "sparse_bytes_per_sample": sparse_bytes * self.comm.size / samples,
            # merge.shared_rows: rows synchronised every step (summed over windows), bytes to and from other ranks
            "shared_rows": {"rows": self._shared_rows_synced, "bytes_sent": self._shared_bytes[0],
                            "bytes_received": self._shared_bytes[1]},
            "store": {k: v for k, v in self.store.stats().items() if isinstance(v, (int, float))},
            # the shard's rows and index blocks read, system calls and bytes, by what asked for them
            "shard_traffic": self.store.shard_traffic(),
            # per table operation (pull, push, warm, ...): calls, seconds split into exchange,
            # cache, shard and other, bytes to and from other ranks
            "exchange": {k: round(v, 4) for k, v in self.table.stats().items()},
            "heap_trim": {"calls": self.heap.calls, "seconds": round(self.heap.seconds, 3)},
            "preempted": self.preempted,
        }

    def close(self) -> None:
        self.meter.close()
        self.store.close()
        if self.shard_scratch:
            # Scratch on a node's SSD or local disk, rebuilt from the checkpoint by every start:
            # nothing of value is lost, and the next job on the node gets its disk back.
            Path(self.store.path).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self.shard_dir.rmdir()  # other ranks of the node may still hold theirs
