"""A rank's checkpoints during training: write one at a window boundary (every rank flushes and
writes its file, rank 0 the manifest last), find the newest complete one, verify and load it,
keep ``checkpoint.keep`` and compact a new base every ``checkpoint.compact_every``. The files and
the manifest are hvctr.checkpoint.format's.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import h5py
import numpy as np

from hvctr.checkpoint.format import (
    _LOAD_CHUNK, _PREFIX, FORMAT_VERSION, CheckpointWriteError, TrainState, _rank_file, _seq_of,
    check_rank_file, checkpoint_path, file_sha256, kernel_path_change, manifest_problem, rank_file_path,
    read_bucket_owner, read_manifests,
    write_manifest, write_reserved,
)
from hvctr.distributed.world import AgreedError, group_errors, raise_agreed
from hvctr.formats import SparseOptimizer, safefile
from hvctr.formats.space import remedy
from hvctr.kernels import native
from hvctr.log import get_logger

if TYPE_CHECKING:
    import torch

    from hvctr.distributed.protocol import Comm

log = get_logger(__name__)


class CheckpointManager:
    """Writes, finds, verifies and loads checkpoints for one rank (collectives through comm)."""

    def __init__(self, directory: str | Path, comm: Comm, keep: int, compact_every: int,
                 guard: Callable[[], None] | None = None) -> None:
        self.dir = Path(directory)
        self.comm = comm
        # before each checkpoint: a ValueError from it (rank 0's RunLock.check_in_place: the run
        # directory is gone) stops every rank, agreed, before any rank writes a byte of it
        self.guard = guard
        self.keep = keep
        self.compact_every = compact_every
        if comm.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
        self._last: dict[str, Any] | None = None  # manifest of the newest checkpoint written or loaded
        self._force_base = False  # set after compaction: dropped rows live on in the old base

    def last_manifest(self) -> dict[str, Any] | None:
        """The manifest of the newest checkpoint written or loaded (None before either)."""
        return self._last

    def force_base(self) -> None:
        """Makes the next checkpoint a base (every rank must call it at the same point)."""
        self._force_base = True

    # --- writing ------------------------------------------------------------------------

    def save(self, store, dense: dict[str, torch.Tensor], state: TrainState, extra: dict[str, Any]) -> Path:
        """Writes checkpoint seq+1 (collective: every rank calls it at the same boundary)."""
        seq = 0 if self._last is None else self._last["seq"] + 1
        is_base = self._last is None or self._force_base or (seq - self._last["base_seq"]) >= self.compact_every
        base_seq = seq if is_base else self._last["base_seq"]
        chain = [seq] if is_base else self._last["chain"] + [seq]
        ckdir = self.dir / f"{_PREFIX}{seq:06d}"
        path = ckdir / _rank_file(self.comm.rank)
        # comm: rank 0's word (it holds the run directory's lock) that the run directory is still
        # there, before any rank writes: one message, every rank stops (a broadcast, as it is rank 0's)
        gone = self.comm.broadcast_object(self._check_guard(seq), root=0, name=f"ckpt{seq}.rundir")
        if gone:
            raise AgreedError(gone, report=self.comm.rank == 0)
        try:
            rows_written = self._write_rank_file(path, seq, "base" if is_base else "delta", dense, store)
            mine = {"file": path.name, "sha256": file_sha256(path), "bytes": path.stat().st_size,
                    "rows": rows_written}
        except CheckpointWriteError as e:  # this rank's disk: the others learn it in the allgather
            mine = {"error": str(e)}
        # comm: allgather of every rank's file record or error (also the barrier before the manifest)
        files = self.comm.allgather_object(mine, name=f"ckpt{seq}.files")
        raise_agreed(group_errors([f.get("error") for f in files]), self.comm.rank, self.comm.size)
        store.mark_checkpoint()
        self._force_base = False
        manifest = {"format_version": FORMAT_VERSION, "seq": seq, "kind": "base" if is_base else "delta",
                    "base_seq": base_seq, "chain": chain, "world_size": self.comm.size,
                    "state": asdict(state), "files": files, "kernels": native.kernel_path(), **extra}
        # comm: agree on rank 0's manifest write (also the barrier: no rank runs ahead of it)
        written = self.comm.agree(lambda: self._write_manifest(ckdir, seq, manifest), name=f"ckpt{seq}.manifest")
        self._last = written if self.comm.rank == 0 else manifest
        return ckdir

    def _check_guard(self, seq: int) -> str | None:
        """The guard's error for checkpoint ``seq`` (None: none, or no guard on this rank)."""
        if self.guard is not None:
            try:
                self.guard()
            except ValueError as e:
                return f"checkpoint {seq}: {e}"
        return None

    def _write_manifest(self, ckdir: Path, seq: int, manifest: dict[str, Any]) -> dict[str, Any]:
        """Rank 0: the manifest, then pruning; where it cannot be written, the checkpoint's
        directory goes (every rank's file: the checkpoint is not kept, and its space is free)."""
        if self.comm.rank != 0:
            return manifest
        try:
            manifest = write_manifest(ckdir / "manifest.json", manifest)
        except OSError as e:
            shutil.rmtree(ckdir, ignore_errors=True)
            raise self._write_error(seq, ckdir / "manifest.json", e) from None
        self._prune(manifest)
        return manifest

    def _write_rank_file(self, path: Path, seq: int, kind: str, dense: dict[str, torch.Tensor], store) -> int:
        """This rank's file of checkpoint ``seq`` (a base: every row; a delta: rows written since
        the last mark), streamed from the store; returns its row count."""
        n = store.count_rows(delta_only=kind == "delta")
        attrs = {"format_version": FORMAT_VERSION, "seq": seq, "kind": kind, "rank": self.comm.rank,
                 "world_size": self.comm.size, "pass_index": store.pass_index,
                 "sparse_optimizer": store.layout.optimizer.value, "row_columns": store.layout.columns()}
        arrays = {f"dense/{name}": t.detach().cpu().numpy() for name, t in dense.items()}
        admission = store.admission_state()
        if admission is not None:
            arrays["admission"] = admission
        arrays["bucket_owner"] = store.shard.bucket_owner
        try:
            # the checkpoint's directory is made, never followed: a link planted there is refused
            safefile.make_dir(path.parent)
            # Stream the rows: a base holds the whole shard, far more than memory.
            write_reserved(path, attrs, n, store.layout.width,
                           store.iter_rows(delta_only=kind == "delta", with_last_seen=True), arrays)
        except safefile.PlantedPathError as e:  # every rank learns it in the allgather, as a full disk
            raise CheckpointWriteError(f"checkpoint {seq}: {e}") from None
        except OSError as e:
            raise self._write_error(seq, path, e) from None
        return n

    def _write_error(self, seq: int, path: Path, e: OSError) -> CheckpointWriteError:
        last = f"checkpoint {self._last['seq']}" if self._last else "none yet"
        return CheckpointWriteError(
            f"checkpoint {seq}: cannot write {path}: {e.strerror or e}; nothing of it was kept, the newest "
            f"complete checkpoint is {last}: {remedy(e, self.dir)} (or set checkpoint.dir elsewhere), "
            f"then run again with --resume")

    def _prune(self, newest: dict[str, Any]) -> None:
        """Keeps the newest ``keep`` complete checkpoints and the bases and deltas they need."""
        complete = self._complete_manifests()
        needed: set[int] = set()
        for m in complete[: self.keep]:
            needed.update(m["chain"])
        needed.update(newest["chain"])
        for path in sorted(self.dir.glob(f"{_PREFIX}*")):
            try:
                seq = _seq_of(path)
            except ValueError:
                continue
            if seq not in needed and seq < newest["seq"]:
                shutil.rmtree(path, ignore_errors=True)

    # --- finding and loading ------------------------------------------------------------

    def has_checkpoints(self) -> bool:
        return self.dir.is_dir() and any(self.dir.glob(f"{_PREFIX}*/manifest.json"))

    def _complete_manifests(self) -> list[dict[str, Any]]:
        """Manifests found on disk, newest first (a directory without one is ignored)."""
        return read_manifests(self.dir)

    def _verify_mine(self, manifest: dict[str, Any], by_seq: dict[int, dict[str, Any]]) -> str:
        """'' when this rank's files of the chain exist and match their checksums, else why not."""
        problem = manifest_problem(self.dir, manifest)  # every key load() uses, of its type
        if problem:
            return problem
        if manifest["world_size"] != self.comm.size:
            return (f"checkpoint {manifest['seq']} was written by {manifest['world_size']} ranks, this run "
                    f"has {self.comm.size}: reshard it first (hvctr reshard --checkpoint "
                    f"{checkpoint_path(self.dir, manifest['seq'])} --world-size {self.comm.size} --out DIR)")
        chain = manifest.get("chain")
        if not (isinstance(chain, list) and chain and all(type(s) is int for s in chain)
                and chain[-1] == manifest["seq"] and all(a < b for a, b in zip(chain, chain[1:]))):
            return f"checkpoint {manifest['seq']}: its chain {chain!r} is not a list of checkpoints ending in it"
        width = None
        for seq in chain:
            m = by_seq.get(seq)
            if m is None:
                return f"checkpoint {seq} (in the chain of {manifest['seq']}) has no manifest"
            if m.get("world_size") != manifest["world_size"]:
                return (f"checkpoint {seq} (in the chain of {manifest['seq']}) was written by "
                        f"{m.get('world_size')!r} ranks, checkpoint {manifest['seq']} by {manifest['world_size']}")
            # the file load() opens: listed under its name, a plain file, its checksum, its
            # world size and rank, its datasets' shapes against its size, its bucket table
            problem, width, _ = check_rank_file(self.dir, m, self.comm.rank, True, width)
            if problem:
                return problem
        return ""

    def find_latest(self, seq: int | None = None) -> dict[str, Any] | None:
        """The newest checkpoint every rank can load (collective), or None; ``seq``: only that one."""
        manifests = self._complete_manifests() if self.dir.is_dir() else []
        if seq is not None:
            manifests = [m for m in manifests if m["seq"] == seq]
        by_seq = {m["seq"]: m for m in manifests}
        # comm: rank 0's candidate list, so every rank tries the same checkpoints in the same order
        candidates = self.comm.broadcast_object([m["seq"] for m in manifests], root=0, name="ckpt.candidates")
        for seq in candidates or []:
            m = by_seq.get(seq)
            problem = "no manifest on this rank's view of the directory" if m is None else self._verify_mine(m, by_seq)
            if problem and m is not None and m["world_size"] != self.comm.size:
                raise AgreedError(f"{self.dir}: {problem}", report=self.comm.rank == 0)
            if problem:
                log.warning(f"rank {self.comm.rank}: skipping checkpoint {seq}: {problem}")
            # comm: allreduce (Min) of 'my files are good', so that all ranks fall back together
            (ok,) = self.comm.allreduce_min_int([0 if problem else 1], name=f"ckpt.verify.{seq}")
            if ok:
                return m
        return None

    def set_aside_newer(self, manifest: dict[str, Any]) -> None:
        """Moves the checkpoints newer than the one resumed from into ``rejected/`` (collective).

        They failed verification (or were never completed), and this run writes new ones under
        the same numbers: a stale delta left beside a new base would verify, and load the
        abandoned run's rows. Moved rather than deleted, for whoever wants to look at them.
        """
        if self.comm.rank == 0:
            newer = [p for p in self.dir.glob(f"{_PREFIX}*") if p.name[len(_PREFIX):].isdigit()
                     and _seq_of(p) > manifest["seq"]]
            for path in sorted(newer):
                dest = self.dir / "rejected" / path.name
                dest.parent.mkdir(exist_ok=True)
                shutil.rmtree(dest, ignore_errors=True)
                os.replace(path, dest)
                os.utime(dest)  # the time it was set aside: the newest are kept (_prune_rejected)
            if newer:
                log.warning(f"checkpoints {', '.join(p.name for p in sorted(newer))} are newer than checkpoint "
                            f"{manifest['seq']} but cannot be loaded: moved to {self.dir / 'rejected'}")
            self._prune_rejected()
        # comm: barrier: no rank writes its next checkpoint before the old ones are out of the way
        self.comm.barrier()

    def _prune_rejected(self) -> None:
        """rejected/ keeps the ``keep`` checkpoints set aside last: each resume after a crash
        may add some, and a long run's restarts would otherwise fill the disk with them."""
        rejected = self.dir / "rejected"
        if not rejected.is_dir():
            return
        entries = sorted(rejected.iterdir(), key=lambda p: (p.stat().st_mtime, p.name), reverse=True)
        for old in entries[self.keep:]:
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)
        if len(entries) > self.keep:
            log.info(f"{rejected}: kept the {self.keep} checkpoints set aside last (checkpoint.keep), removed "
                     f"{len(entries) - self.keep} older")

    def bucket_owner(self, manifest: dict[str, Any]) -> np.ndarray:
        """The bucket table of a checkpoint: build the store with it before ``load``."""
        return read_bucket_owner(self.dir, manifest, self.comm.rank)

    def load(self, manifest: dict[str, Any], store) -> dict[str, np.ndarray]:
        """Rebuilds ``store`` (a freshly created shard) from the chain; returns the dense state.

        Rows come back with the TTL pass they were last written in, and the store gets the
        checkpoint's pass clock and admission counters.
        """
        change = kernel_path_change(manifest, checkpoint_path(self.dir, manifest["seq"]))
        if change:
            log.warning(change)
        dense: dict[str, np.ndarray] = {}
        admission = None
        for seq in manifest["chain"]:
            path = rank_file_path(self.dir, seq, self.comm.rank)
            with h5py.File(path, "r") as f:
                kds, rds = f["keys"], f["rows"]
                # no attribute: a checkpoint from before row-wise optimisers, Adam's rows
                saved = str(f.attrs.get("sparse_optimizer", SparseOptimizer.ADAM.value))
                if saved != store.layout.optimizer.value:
                    raise ValueError(f"{path}: rows of train.sparse_optimizer = {saved}, this run's are "
                                     f"{store.layout.optimizer.value}: the rows carry their optimiser's states; "
                                     f"continue from it with --train.sparse_optimizer={saved}")
                if rds.shape[1] != store.layout.width:
                    raise ValueError(f"{path}: rows of width {rds.shape[1]}, this run's rows have "
                                     f"{store.layout.width} (storage.dim differs)")
                sds = f["last_seen"] if "last_seen" in f else None
                for start in range(0, kds.shape[0], _LOAD_CHUNK):
                    stop = start + _LOAD_CHUNK
                    store.load_rows(kds[start:stop], rds[start:stop], None if sds is None else sds[start:stop])
                if seq == manifest["seq"]:
                    dense = {name: ds[...] for name, ds in f["dense"].items()}
                    admission = f["admission"][...] if "admission" in f else None
                    store.set_pass_index(int(f.attrs.get("pass_index", store.pass_index)))
        store.load_admission_state(admission)
        store.mark_checkpoint()
        self._last = manifest
        return dense
