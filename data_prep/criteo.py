"""``python -m data_prep criteo``: Criteo TSV / DeepCTR CSV -> S HDF5 data shards + manifest.json.

    mpirun -np 4 --bind-to none python -m mpi4py -m data_prep criteo \\
        --input day_0.gz day_1.gz --out data/criteo --shards 64 --valid-fraction 0.05
    # Criteo Terabyte as DLRM and MLPerf split it: train on days 0-22, validate on day 23
    python -m data_prep criteo --input day_{0..22}.gz --valid-input day_23.gz --out data/tb --shards 256
    # multi-valued fields: C3 and C21 hold 0..n values each, "a,b,c" (format version 2)
    python -m data_prep criteo --input logs.tsv --out data/mv --shards 8 --multi-valued C3,C21

Two phases, both parallel over processes, the output independent of their number:
1. parse: each process parses its units (sources.py) into pieces under OUT/_work (pieces.py);
   every finished unit is reported to rank 0, which records it in manifest.json.
2. assemble: once all line counts are known, shard s (train and valid) is written by process
   s mod P from one slice of every piece; rank 0 records each finished shard with checksums.
Resume: the same command after a kill redoes only what manifest.json does not record as done
(the manifest, not the existence of a file, is the record). The job it records (options, and each
input's path, size and mtime) must match: an input modified since is refused, not "complete";
shard files in --out without a manifest are refused, not overwritten. Everything is written under a
temporary name and renamed when complete; the manifest is rewritten the same way. A piece the
manifest records is checked on resume (its size, its HDF5 metadata): a damaged one is named and
its unit parsed again. One job per --out: rank 0 holds ``<out>/data_prep.lock`` (a flock, as
hvctr train's run directory lock) and a second job is refused at once, naming the holder.

Multi-valued fields (--multi-valued C3,C21, --value-separator): their text is cut at the value
separator and each value keyed as a one-valued one is; the shards are then format version 2
(``lengths``, ``offsets``, flat ``keys``: hvctr.formats) and the manifest names the fields. Without
them the output is version 1, as it always was.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import h5py
import numpy as np

import data_prep
from hvctr import formats
from data_prep.mpi import Comm, get_comm
from hvctr.formats.lines import RowFormat, check_value_sep, parse_block
from data_prep.pieces import (FILE_OVERHEAD, KEY_BYTES, MULTI_ROW_BYTES, ROW_BYTES, PieceBuilder, ShardWriter,
                              piece_path, piece_problem, piece_shard_counts, write_error)
from hvctr.formats.dirlock import DirLock
from hvctr.data.manifest import read_manifest
from hvctr.formats.space import check_free_space
from hvctr.formats import NUM_DENSE, NUM_FIELDS, SPLITS, KeySketch
from hvctr.formats import safefile
from hvctr.formats.sources import (Source, Unit, assign_units, count_lines, iter_blocks, line_start_at,
                               make_units, nth_newline, open_sources)
from hvctr.log import get_logger, setup_logging

log = get_logger("data_prep")
MANIFEST = "manifest.json"
WORK = "_work"
LOCK = "data_prep.lock"  # flock held by rank 0 for the job's life: one job per --out (hvctr.formats.dirlock)
SPLIT_RULE = ("global line index g over all inputs in the order given, --valid-input files last (data lines "
              "only, rejected lines included); shard = g mod S; validation = every line of the --valid-input "
              "files and the last round(F * L) of the L lines of the --input files")
SHARD_BATCH = 32  # output files one process keeps open at once in phase 2
AUTO_CHUNKS = 256  # auto chunk size: enough units to balance many processes, few enough to record
REPORT_SECONDS = 1.0  # how often a worker reports progress to rank 0
_CSV = RowFormat.from_header(",".join(formats.COLUMN_NAMES).encode())  # --format csv's column separator


@dataclass(frozen=True)
class Job:
    inputs: tuple[str, ...]
    out: str
    shards: int
    valid_fraction: float = 0.0
    strict: bool = False
    format: str = "auto"
    chunk_bytes: int = 0  # 0: auto (see auto_chunk_bytes)
    piece_lines: int = 1 << 19
    progress_seconds: float = 10.0
    valid_inputs: tuple[str, ...] = ()  # every line of these is validation (Criteo Terabyte's day_23)
    multi_valued: tuple[int, ...] = ()  # 0-based categorical fields that hold 0..n values (format version 2)
    value_separator: str = ","  # between the values of a multi-valued field

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise ValueError(f"--shards must be >= 1, got {self.shards}")
        if not 0.0 <= self.valid_fraction < 1.0:
            raise ValueError(f"--valid-fraction must be in [0, 1), got {self.valid_fraction}")
        if self.chunk_bytes and self.chunk_bytes < 1 << 16:
            raise ValueError(f"--chunk-mb must be at least 1/16, got {self.chunk_bytes / 2**20}")
        if self.piece_lines < 1:
            raise ValueError(f"--piece-lines must be >= 1, got {self.piece_lines}")
        if list(self.multi_valued) != sorted(set(self.multi_valued)) or \
                not all(0 <= f < NUM_FIELDS for f in self.multi_valued):
            raise ValueError(f"--multi-valued: fields must be distinct and sorted in 0..{NUM_FIELDS - 1}, "
                             f"got {list(self.multi_valued)}")
        if self.multi_valued:  # a named format's column separator is known now; auto's: per file, in the plan
            check_value_sep(self.value_sep, {"csv": _CSV, "tsv": RowFormat.tsv()}.get(self.format))

    @property
    def value_sep(self) -> bytes:
        return self.value_separator.encode("utf-8")

    @property
    def work_dir(self) -> str:
        return os.path.join(self.out, WORK)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", nargs="+", required=True, metavar="FILE",
                   help="Criteo TSV (plain or gzip) or CSV with a header row; in time order. A UTF-8 BOM is "
                        "skipped; a TSV first line of names (label, I1..I13, C1..C26) is read as a header")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="output directory (shards + manifest.json); shard files there without a manifest "
                        "are refused, never overwritten")
    p.add_argument("--shards", type=int, required=True, metavar="S",
                   help="data shards per split; training rank r reads the shards s with s %% W == r")
    p.add_argument("--valid-fraction", type=float, default=0.0, metavar="F",
                   help="the last F of the --input lines form the validation split (default 0)")
    p.add_argument("--valid-input", nargs="+", default=[], metavar="FILE",
                   help="files whose every line is validation (plain or gzip), after the --input files: "
                        "Criteo Terabyte's day_23, as DLRM and MLPerf split it")
    p.add_argument("--strict", action="store_true", help="stop at the first malformed line")
    p.add_argument("--format", choices=("auto", "tsv", "csv"), default="auto",
                   help="input format (auto: tabs -> TSV, else CSV with a header)")
    p.add_argument("--chunk-mb", type=float, default=0.0,
                   help="a plain input is split into byte ranges of this size (the unit of work and of resume); "
                        "default: the plain inputs' size / 256, between 4 and 64")
    p.add_argument("--piece-lines", type=int, default=1 << 19,
                   help="lines per intermediate piece: a process holds one piece in memory (~300 bytes a line; "
                        "with --multi-valued, 8 bytes more for each key beyond one a field)")
    p.add_argument("--progress-seconds", type=float, default=10.0, help="progress line interval on rank 0")
    p.add_argument("--multi-valued", default="", metavar="FIELDS",
                   help="categorical fields that hold 0..n values each, by name: e.g. C3,C21 (user history, "
                        "tags). Their text is split at --value-separator, empty values dropped, each value keyed "
                        "as a one-valued value of that field is; the shards are then format version 2 "
                        "(docs/data.md). Default: none (one value per field, format version 1)")
    p.add_argument("--value-separator", default=None, metavar="SEP",
                   help="the character between the values of a --multi-valued field (default ','; it must "
                        "differ from the input's column separator: pass another for CSV input, e.g. '|')")


def parse_fields(text: str, option: str = "--multi-valued") -> tuple[int, ...]:
    """'C3,C21' -> (2, 20): categorical field names (any case), distinct, sorted 0-based indices."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    by_name = {n.lower(): i for i, n in enumerate(formats.CAT_NAMES)}
    unknown = [n for n in names if n.lower() not in by_name]
    if unknown:
        raise ValueError(f"{option}: unknown field {unknown[0]!r}: name categorical fields "
                         f"{formats.CAT_NAMES[0]}..{formats.CAT_NAMES[-1]}, comma-separated (e.g. C3,C21)")
    if text.strip() and not names:
        raise ValueError(f"{option}: no field named in {text!r}")
    return tuple(sorted({by_name[n.lower()] for n in names}))


def run(args: argparse.Namespace) -> int:
    comm = get_comm()
    setup_logging(rank=comm.rank, world_size=comm.size)
    try:
        try:  # the same arguments fail the same way on every process
            if args.value_separator is not None and not args.multi_valued:
                raise ValueError(f"--value-separator {args.value_separator!r} without --multi-valued: it separates "
                                 f"the values of multi-valued fields; name them (e.g. --multi-valued C3,C21)")
            job = Job(tuple(args.input), os.path.abspath(args.out), args.shards, args.valid_fraction,
                      args.strict, args.format, int(args.chunk_mb * (1 << 20)), args.piece_lines,
                      args.progress_seconds, tuple(args.valid_input), parse_fields(args.multi_valued),
                      "," if args.value_separator is None else args.value_separator)
        except ValueError as e:
            raise _SharedError(str(e)) from e
        return run_job(comm, job)
    except _SharedError as e:  # every process knows; rank 0 says it
        if comm.rank == 0:
            print(f"data_prep criteo: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"data_prep criteo: error: {e}", file=sys.stderr)
        if comm.size > 1:
            comm.abort(2)
        return 2


class _SharedError(ValueError):
    """An error every process has received from rank 0 (no abort needed)."""


@dataclass
class Plan:
    sources: list[Source]
    units: list[Unit]
    pending: list[int]
    session: int
    complete: bool = False


@dataclass
class Assembly:
    pieces: list[tuple[str, int, int, np.ndarray]]  # (path, global offset, lines, bad local indices)
    cutoff: int
    rows: dict[str, list[int]]  # split -> rows per shard
    todo: list[int]  # shards without a complete record for both splits


def output_lock(out: str) -> DirLock:
    """The lock of an output directory: rank 0 holds ``<out>/data_prep.lock`` from the plan to the
    end of the job; a second job on that --out is refused at once, naming the holder."""
    return DirLock(out, LOCK, "data_prep criteo", key="--out", option="--out", kind="output directory")


def run_job(comm: Comm, job: Job) -> int:
    tracker = Tracker(comm, job) if comm.rank == 0 else None
    try:
        return _run_job(comm, job, tracker)
    finally:
        if tracker is not None and tracker.lock is not None:
            tracker.lock.release()


def _run_job(comm: Comm, job: Job, tracker: "Tracker | None") -> int:
    t0, work_cpu = time.monotonic(), 0.0  # CPU seconds inside units and shards, waits excluded
    plan, err = None, None
    if tracker is not None:
        try:
            plan = tracker.plan()
        except ValueError as e:
            err = str(e)
    plan, err = comm.broadcast_object((plan, err), 0, "plan")
    if err:
        raise _SharedError(err)
    if plan.complete:
        log.info(f"{job.out}: already complete (manifest.json); nothing to do")
        return 0
    mine = assign_units([plan.units[i] for i in plan.pending], comm.size)[comm.rank]
    progress = Progress(comm, tracker)
    for unit in mine:
        c = time.process_time()
        rec = process_unit(plan.sources[unit.source], unit, job, plan.session, progress.tick)
        work_cpu += time.process_time() - c
        comm.post(("unit", rec))
    _end_phase(comm, tracker, progress)
    asm, err = None, None
    if comm.rank == 0:
        try:
            asm = tracker.assembly()
        except ValueError as e:
            err = str(e)
    asm, err = comm.broadcast_object((asm, err), 0, "assembly")
    if err:
        raise _SharedError(err)
    progress.start_phase("assemble", sum(sum(asm.rows[s][i] for s in SPLITS) for i in asm.todo))
    for batch in _batches([s for s in asm.todo if s % comm.size == comm.rank], SHARD_BATCH):
        c = time.process_time()
        recs = assemble_shards(job, asm, batch, progress.tick)
        work_cpu += time.process_time() - c
        for rec in recs:
            comm.post(("shard", rec))
    _end_phase(comm, tracker, progress)
    cpu = comm.allgather_object(work_cpu, "work_cpu")  # comm: each process's CPU seconds of work, for the record
    if comm.rank == 0:
        tracker.manifest["sessions"][-1]["work_cpu_s"] = [round(c, 3) for c in cpu]
        tracker.finish(t0)
    comm.barrier()
    return 0


def _end_phase(comm: Comm, tracker: "Tracker | None", progress: "Progress") -> None:
    comm.post(("progress", comm.rank, progress.bytes, progress.rows))  # the final count, then done
    comm.post(("done", comm.rank))
    if tracker is not None:
        tracker.wait_done()
    comm.flush_posts()
    comm.barrier()


def _batches(items: list[int], n: int) -> list[list[int]]:
    return [items[i:i + n] for i in range(0, len(items), n)]


# ----------------------------------------------------------------------------------------
# phase 1: a unit -> pieces


def process_unit(src: Source, unit: Unit, job: Job, session: int, tick: Callable[[int, int], None]) -> dict:
    pieces: list[dict] = []
    multi = bool(job.multi_valued)
    cur = PieceBuilder(job.shards, multi)
    for data, nbytes in iter_blocks(src, unit):
        rows = 0
        while data:
            room = job.piece_lines - cur.lines
            if data.count(b"\n") > room:  # the piece fills up inside this block: cut there
                cut = nth_newline(data, room) + 1
                head, data = data[:cut], data[cut:]
            else:
                head, data = data, b""
            blk = parse_block(head, src.fmt, job.multi_valued, job.value_sep)
            if blk.bad and job.strict:
                line = job.piece_lines * len(pieces) + cur.lines + blk.bad[0][0]
                raise ValueError(f"{src.path}:{_file_line(src, unit, line)}: {blk.bad[0][1]}")
            rows += len(blk.labels)
            cur.add(blk)
            if cur.lines == job.piece_lines:
                pieces.append(cur.write(piece_path(job.work_dir, unit.id, len(pieces))))
                cur = PieceBuilder(job.shards, multi)
        tick(nbytes, rows)
    if cur.lines:
        pieces.append(cur.write(piece_path(job.work_dir, unit.id, len(pieces))))
    return {"unit": unit.id, "source": unit.source, "begin": unit.begin, "end": unit.end,
            "lines": sum(p["lines"] for p in pieces), "session": session, "pieces": pieces}


def _file_line(src: Source, unit: Unit, line_in_unit: int) -> int:
    """1-based line number in the file of a unit's line (counts the lines before the unit)."""
    before = 0
    if not src.gzip and unit.begin > 0:
        with open(src.path, "rb") as f:
            start = max(line_start_at(f, unit.begin, src.size), src.data_start)
        before = count_lines(src.path, src.data_start, start)
    return src.header_lines + before + line_in_unit + 1


# ----------------------------------------------------------------------------------------
# phase 2: pieces -> shards


def assemble_shards(job: Job, asm: Assembly, batch: list[int], tick: Callable[[int, int], None]) -> list[dict]:
    """Writes the train and valid files of the shards in ``batch``; returns their records."""
    S = job.shards
    writers: dict[tuple[str, int], ShardWriter] = {}
    # multi-valued fields: a shard's keys dataset is sized when created, so its keys are counted first
    keys = _shard_keys(job, asm, batch) if job.multi_valued else None
    try:
        try:  # the space first: HDF5 cannot always close a file whose write failed for lack of it
            if keys is None:
                need = sum(asm.rows[split][s] * ROW_BYTES + FILE_OVERHEAD for s in batch for split in SPLITS)
            else:
                need = sum((asm.rows[split][s] + 1) * MULTI_ROW_BYTES + keys[split, s] * KEY_BYTES + FILE_OVERHEAD
                           for s in batch for split in SPLITS)
            check_free_space(job.out, need)
        except OSError as e:
            raise write_error(os.path.join(job.out, formats.shard_name(SPLITS[0], batch[0])), e) from None
        for s in batch:
            for split in SPLITS:
                writers[split, s] = ShardWriter(os.path.join(job.out, formats.shard_name(split, s)),
                                                asm.rows[split][s], split, s, S,
                                                None if keys is None else keys[split, s])
        for path, offset, lines, bad in asm.pieces:
            train, valid = piece_shard_counts(offset, lines, bad, S, asm.cutoff)
            if not any(train[s] + valid[s] for s in batch):
                continue
            with _open_piece(path) as f:
                goff = f.attrs["goff"]
                by_residue = (train + valid)[(offset + np.arange(S)) % S]
                if not np.array_equal(np.diff(goff), by_residue):
                    raise ValueError(f"{path}: piece does not match manifest.json; "
                                     f"delete {job.work_dir} and run again")
                n = 0
                for s in batch:
                    t, v = int(train[s]), int(valid[s])
                    if t + v == 0:
                        continue
                    g = (s - offset) % S
                    head, tail = _read_group(f, path, int(goff[g]), g, t, v, keys is not None)
                    writers["train", s].write(*head)
                    writers["valid", s].write(*tail)
                    n += t + v
            tick(0, n)
        return [writers[split, s].close() for s in batch for split in SPLITS]
    except OSError as e:  # a full disk under a shard: one message naming it, its .tmp removed
        for w in writers.values():
            if w.file.id.valid:
                w.abandon()
        raise write_error(e.filename or os.path.join(job.out, "*.h5"), e) from None
    except BaseException:
        for w in writers.values():
            if w.file.id.valid:
                w.abandon()
        raise


def _open_piece(path: str) -> h5py.File:
    try:
        return h5py.File(path, "r")
    except OSError as e:  # not the disk's space: the piece, damaged since it was written
        raise ValueError(_damaged_piece(path, e)) from None


def _read_group(f: h5py.File, path: str, a: int, g: int, t: int, v: int, multi: bool) -> tuple[tuple, tuple]:
    """Group g of a piece (rows a.., its t training rows, then its v validation rows) as the arguments of
    ShardWriter.write for the train and for the valid shard. With multi-valued fields the keys of
    the group are the slice kgoff[g]:kgoff[g + 1], cut where the training rows' keys end."""
    try:
        lab, den = f["labels"][a:a + t + v], f["dense"][a:a + t + v]
        if not multi:
            key = f["keys"][a:a + t + v]
            return (lab[:t], den[:t], key[:t]), (lab[t:], den[t:], key[t:])
        kgoff = f.attrs["kgoff"]
        lengths = f["lengths"][a:a + t + v]
        key = f["keys"][int(kgoff[g]):int(kgoff[g + 1])]
    except (OSError, KeyError) as e:
        raise ValueError(_damaged_piece(path, e)) from None
    kt = int(lengths[:t].sum(dtype=np.int64))
    if len(key) != int(lengths.sum(dtype=np.int64)):
        raise ValueError(_damaged_piece(path, ValueError("its keys do not match its lengths")))
    return (lab[:t], den[:t], key[:kt], lengths[:t]), (lab[t:], den[t:], key[kt:], lengths[t:])


def _shard_keys(job: Job, asm: Assembly, batch: list[int]) -> dict[tuple[str, int], int]:
    """Keys of each shard of ``batch`` in each split, from the pieces' group key offsets (and, in a
    group that the split cuts, its training rows' lengths); reads no keys."""
    S = job.shards
    keys = {(split, s): 0 for s in batch for split in SPLITS}
    for path, offset, lines, bad in asm.pieces:
        train, valid = piece_shard_counts(offset, lines, bad, S, asm.cutoff)
        if not any(train[s] + valid[s] for s in batch):
            continue
        with _open_piece(path) as f:
            try:
                goff, kgoff = f.attrs["goff"], f.attrs["kgoff"]
                for s in batch:
                    g = (s - offset) % S
                    t, v = int(train[s]), int(valid[s])
                    total = int(kgoff[g + 1] - kgoff[g])
                    if t and v:
                        a = int(goff[g])
                        kt = int(f["lengths"][a:a + t].sum(dtype=np.int64))
                    else:
                        kt = total if t else 0
                    keys["train", s] += kt
                    keys["valid", s] += total - kt
            except (OSError, KeyError) as e:
                raise ValueError(_damaged_piece(path, e)) from None
    return keys


def _damaged_piece(path: str, e: Exception) -> str:
    return (f"{path}: cannot read this piece ({e}): damaged since it was written; run the same data_prep "
            f"command again: it checks every piece it recorded and parses the unit of a damaged one again")


# ----------------------------------------------------------------------------------------
# rank 0: the manifest and progress


class Progress:
    """Counts bytes and rows; workers report to rank 0 about once a second, rank 0 serves."""

    def __init__(self, comm: Comm, tracker: "Tracker | None") -> None:
        self.comm, self.tracker = comm, tracker
        self.bytes = self.rows = 0
        self.last = 0.0

    def start_phase(self, name: str, total_rows: int) -> None:
        self.bytes = self.rows = 0
        if self.tracker is not None:
            self.tracker.start_phase(name, total_rows)

    def tick(self, nbytes: int, rows: int) -> None:
        self.bytes += nbytes
        self.rows += rows
        now = time.monotonic()
        if self.tracker is not None:
            self.comm.post(("progress", 0, self.bytes, self.rows))
            self.tracker.service()
        elif now - self.last >= REPORT_SECONDS:
            self.last = now
            self.comm.post(("progress", self.comm.rank, self.bytes, self.rows))


@dataclass
class Tracker:
    """Rank 0's state: the manifest in memory, flushed to disk as records arrive."""
    comm: Comm
    job: Job
    manifest: dict = field(default_factory=dict)
    phase: str = "parse"
    total: float = 0.0  # bytes (parse) or rows (assemble) this session must do
    done_ranks: int = 0
    seen: dict = field(default_factory=dict)  # rank -> (bytes, rows)
    t_phase: float = 0.0
    t_flush: float = 0.0
    t_log: float = 0.0
    flush_cost: float = 0.0
    dirty: bool = False
    lock: DirLock | None = None  # <out>/data_prep.lock, held from the plan on

    @property
    def path(self) -> str:
        return os.path.join(self.job.out, MANIFEST)

    def plan(self) -> Plan:
        job = self.job
        sources = open_sources([*job.inputs, *job.valid_inputs], job.format)
        if job.multi_valued:
            for src in sources:
                check_value_sep(job.value_sep, src.fmt, where=f"{src.path}: ")
        _check_shards_fit(job, sources[:len(job.inputs)])  # before anything is written
        _prepare_out_dir(job.out)
        self.lock = output_lock(job.out).acquire()  # before the manifest is read: one job per --out
        if self.lock.stale:
            log.warning(self.lock.stale)
        chunk = job.chunk_bytes or auto_chunk_bytes(sources)
        units = make_units(sources, chunk)
        ident = _identity(job, sources, chunk, len(units))
        old = read_manifest(self.path, complete=False)
        if old is not None and _comparable(old.get("job"), ident) != old.get("job"):
            raise ValueError(f"{job.out} holds the output of a different job ({_diff(old.get('job'), ident)}); "
                             "use another --out or delete it")
        if old is None:
            _refuse_stray_shards(job.out)
        elif [r.get("header") for r in old.get("sources", [])] != [list(s.fmt.header) or None for s in sources]:
            raise ValueError(f"{job.out} holds the output of a different job (inputs' header lines read otherwise: "
                             "made before TSV header lines were read as column names); use another --out or delete it")
        for s in sources:
            if s.fmt.kind == "tsv" and s.fmt.header:
                log.info(f"{s.path}:1: a header line ({', '.join(s.fmt.header[:3])}, ...): "
                         "read as the column names, not as data")
        if old is not None and old.get("state") == "complete":
            self.manifest = old
            shutil.rmtree(job.work_dir, ignore_errors=True)  # a kill after the manifest, before cleanup
            return Plan(sources, units, [], 0, complete=True)
        m = old if old is not None else _new_manifest(ident, sources, len(units), job.shards, job)
        _forget_unfinished(m, job)
        os.makedirs(job.work_dir, exist_ok=True)
        for stale in glob.glob(os.path.join(job.out, "*.h5.tmp")) + glob.glob(os.path.join(job.work_dir, "*.tmp")):
            os.remove(stale)
        session = len(m["sessions"]) + 1
        m["sessions"].append({"session": session, "processes": self.comm.size,
                              "started": time.strftime("%Y-%m-%dT%H:%M:%S")})
        self.manifest = m
        pending = [u.id for u in units if m["units"][u.id] is None]
        done = len(units) - len(pending)
        if old is not None:
            log.info(f"resuming {job.out}: {done} of {len(units)} units recorded as parsed, "
                     f"{sum(r is not None for r in m['shards']['train'])} of {job.shards} shards written")
        self.start_phase("parse", sum(units[i].size for i in pending))
        return Plan(sources, units, pending, session)

    def start_phase(self, name: str, total: float) -> None:
        now = time.monotonic()
        if self.t_phase:  # the phase that ends now: its duration goes into this session's record
            self.manifest["sessions"][-1].setdefault("phase_s", {})[self.phase] = round(now - self.t_phase, 3)
        self.phase, self.total, self.done_ranks, self.seen = name, total, 0, {}
        self.t_phase = self.t_log = now
        self.manifest["phase"] = name
        self.flush()

    def service(self) -> None:
        for msg in self.comm.drain():
            kind = msg[0]
            if kind == "progress":
                self.seen[msg[1]] = (msg[2], msg[3])
            elif kind == "done":
                self.done_ranks += 1
            elif kind == "unit":
                self.manifest["units"][msg[1]["unit"]] = msg[1]
                self.dirty = True
            elif kind == "shard":
                self.manifest["shards"][msg[1]["split"]][msg[1]["shard"]] = msg[1]
                self.dirty = True
        now = time.monotonic()
        # rewriting a big manifest often would cost more than the work it protects
        if self.dirty and now - self.t_flush >= max(0.5, 50 * self.flush_cost):
            self.flush()
        if now - self.t_log >= self.job.progress_seconds:
            self.t_log = now
            log.info(self.progress_line(now))

    def wait_done(self) -> None:
        while True:
            self.service()
            if self.done_ranks >= self.comm.size:
                break
            time.sleep(0.01)
        self.flush()
        log.info(self.progress_line(time.monotonic()))

    def progress_line(self, now: float) -> str:
        nbytes = sum(b for b, _ in self.seen.values())
        rows = sum(r for _, r in self.seen.values())
        dt = max(now - self.t_phase, 1e-9)
        done = nbytes if self.phase == "parse" else rows
        frac = done / self.total if self.total else 1.0
        eta = (self.total - done) / (done / dt) if done else float("nan")
        what = (f"{_gb(nbytes)} of {_gb(self.total)} read" if self.phase == "parse"
                else f"{_num(rows)} of {_num(self.total)} written")
        speed = f"{_num(rows / dt)} rows/s" + (f", {nbytes / dt / 1e6:.0f} MB/s" if self.phase == "parse" else "")
        return f"{self.phase}: {_num(rows)} rows, {what} ({100 * frac:.0f}%), {speed}, ETA {_hms(eta)}"

    def flush(self) -> None:
        t = time.monotonic()
        _write_json(self.path, self.manifest)
        self.t_flush = time.monotonic()
        self.flush_cost = self.t_flush - t
        self.dirty = False

    def assembly(self) -> Assembly:
        try:
            return _assembly(self.manifest, self.job)
        except TooManyShards:
            # no shard was written; what this job parsed is of no use to another --shards (its
            # pieces are cut by it): removed, so that the same --out takes the next attempt
            shutil.rmtree(self.job.work_dir, ignore_errors=True)
            safefile.remove_quietly(self.path)
            raise

    def finish(self, t0: float) -> None:
        """Totals, then the complete manifest (the job's elapsed time ends there), then cleanup."""
        self.manifest["sessions"][-1].setdefault("phase_s", {})[self.phase] = round(time.monotonic() - self.t_phase, 3)
        _finish(self.manifest, self.job)
        elapsed = time.monotonic() - t0
        self.manifest["sessions"][-1]["elapsed_s"] = round(elapsed, 3)
        self.flush()
        shutil.rmtree(self.job.work_dir, ignore_errors=True)
        t = self.manifest["totals"]
        log.info(f"done: {t['rows']} rows ({t['train']['rows']} train, {t['valid']['rows']} valid) "
                 f"in {self.job.shards} shards per split, {t['bad_lines']} bad lines, "
                 f"{elapsed:.1f} s ({_num(t['rows'] / max(elapsed, 1e-9))} rows/s); {self.path}")


def _num(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e4 else f"{n:.0f}"


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _hms(s: float) -> str:
    if s != s:
        return "?"
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _prepare_out_dir(out: str) -> None:
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, f".write-test-{os.getpid()}")
        with open(probe, "wb"):
            pass
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"{out}: output directory is not writable ({e.strerror})") from e


def auto_chunk_bytes(sources: list[Source]) -> int:
    """Plain inputs / AUTO_CHUNKS, in whole MiB between 4 and 64: the output never depends on it
    (only resume does), so it can follow the input's size."""
    plain = sum(s.size for s in sources if not s.gzip)
    return min(64, max(4, plain // AUTO_CHUNKS >> 20)) << 20


def _identity(job: Job, sources: list[Source], chunk_bytes: int, num_units: int) -> dict:
    ident = {"shards": job.shards, "valid_fraction": job.valid_fraction, "strict": job.strict,
             "valid_inputs": len(job.valid_inputs),
             "chunk_bytes": chunk_bytes, "piece_lines": job.piece_lines, "units": num_units,
             "inputs": [{"path": s.path, "size": s.size, "mtime_ns": os.stat(s.path).st_mtime_ns}
                        for s in sources]}
    if job.multi_valued:  # absent without: a one-valued job's identity is what it always was
        ident["multi_valued"] = _multi_valued(job)
    return ident


def _multi_valued(job: Job) -> dict:
    """The manifest's (and the job identity's) record of the multi-valued fields."""
    return {"fields": list(job.multi_valued), "separator": job.value_separator}


def _comparable(old: dict | None, new: dict) -> dict:
    """``new`` as a manifest written before inputs' mtimes were recorded would hold it (those
    are compared on path and size alone)."""
    olds = old.get("inputs") if isinstance(old, dict) else None
    if isinstance(olds, list) and olds and all(isinstance(i, dict) and "mtime_ns" not in i for i in olds):
        return {**new, "inputs": [{k: v for k, v in i.items() if k != "mtime_ns"} for i in new["inputs"]]}
    return new


def _diff(old: dict | None, new: dict) -> str:
    if not isinstance(old, dict):
        return "no job recorded"
    new = _comparable(old, new)
    keys = [k for k in new if old.get(k) != new[k]] + [k for k in old if k not in new]
    return ", ".join(f"{k}: {old.get(k)} -> {new.get(k)}" if k != "inputs" else _inputs_diff(old.get(k), new[k])
                     for k in keys)


def _inputs_diff(old, new: list[dict]) -> str:
    if not isinstance(old, list) or [i.get("path") for i in old] != [i["path"] for i in new]:
        return "other input files"
    out = []
    for o, n in zip(old, new):
        if o.get("size") != n["size"]:
            out.append(f"{n['path']}: size {o.get('size')} -> {n['size']}")
        elif o.get("mtime_ns") != n.get("mtime_ns"):
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(n["mtime_ns"] / 1e9))
            out.append(f"{n['path']}: modified since (at {when}; the size is the same)")
    return "; ".join(out) or "inputs differ"


def _refuse_stray_shards(out: str) -> None:
    """Shard files without a manifest are not this job's (a job records every shard it writes):
    they would be overwritten, or mixed with ours. Named, never touched."""
    stray = sorted(glob.glob(os.path.join(out, "*-[0-9][0-9][0-9][0-9][0-9].h5")))
    if stray:
        more = f" and {len(stray) - 1} more" if len(stray) > 1 else ""
        raise ValueError(f"{stray[0]}{more}: shard files in {out} without a {MANIFEST} (not this job's output, "
                         "or its manifest was lost); they would be overwritten: use another --out or delete them")


def _new_manifest(ident: dict, sources: list[Source], num_units: int, shards: int, job: Job) -> dict:
    multi = bool(job.multi_valued)
    m = {
        "format": formats.FORMAT,
        "format_version": formats.MULTI_VALUED_VERSION if multi else formats.FORMAT_VERSION,
        "state": "in_progress",
        "created_by": f"data_prep {data_prep.__version__}", "job": ident, "schema": _schema(multi),
        "sources": [{"path": s.path, "size": s.size, "format": s.fmt.kind, "gzip": s.gzip,
                     "header": list(s.fmt.header) or None} for s in sources],
        "sessions": [], "phase": "parse",
        "units": [None] * num_units,
        "shards": {split: [None] * shards for split in SPLITS},
    }
    if multi:
        m["multi_valued"] = _multi_valued(job)
    return m


def _schema(multi: bool = False) -> dict:
    if multi:
        keys = {"lengths": {"dtype": "uint16", "shape": ["N", NUM_FIELDS], "columns": formats.CAT_NAMES,
                            "what": "keys of each field of each row (1 in a one-valued field)"},
                "offsets": {"dtype": "int64", "shape": ["N + 1"],
                            "what": "row r's keys are keys[offsets[r]:offsets[r + 1]]; offsets[0] = 0"},
                "keys": {"dtype": "uint64", "shape": ["offsets[N]"],
                         "what": "row by row; in a row field by field (C1 first); in a field in line order"}}
    else:
        keys = {"keys": {"dtype": "uint64", "shape": ["N", NUM_FIELDS], "columns": formats.CAT_NAMES}}
    return {
        "columns": formats.COLUMN_NAMES,
        "datasets": {"labels": {"dtype": "float32", "shape": ["N"]},
                     "dense": {"dtype": "float32", "shape": ["N", NUM_DENSE],
                               "columns": formats.DENSE_NAMES, "transform": "log1p(max(x, 0)); missing -> 0"},
                     **keys,
                     "key_sketch": {"dtype": "uint8", "shape": [NUM_FIELDS, 1 << formats.SKETCH_BITS],
                                    "what": "HyperLogLog registers per field"}},
        "key_rule": ("hex value of 1..16 digits: mix64((f << 56) ^ int(v, 16)); other values: "
                     "mix64(fnv1a64(b'%d\\x1f' % f + v)); missing: the empty value; f = 0 for C1; "
                     "EMPTY_KEY remapped (hvctr.formats)"),
        "split_rule": SPLIT_RULE,
        "checksums": "sha256 of each dataset's contents, C order, little-endian",
        "hdf5": {"libver": list(formats.HDF5_LIBVER), "track_times": False, "layout": "contiguous"},
    }


def _forget_unfinished(m: dict, job: Job) -> None:
    """Keeps only records whose files are there (a record is only written after its file), and
    of a unit only when each of its pieces is as recorded (size, datasets: ``piece_problem``): a
    damaged piece (truncated, overwritten) is named and its unit parsed again."""
    for i, rec in enumerate(m["units"]):
        if not rec:
            continue
        for k, prec in enumerate(rec["pieces"]):
            path = piece_path(job.work_dir, i, k)
            why = piece_problem(path, prec, job.shards)
            if why:
                src = m["sources"][rec["source"]]["path"] if rec["source"] < len(m["sources"]) else "?"
                log.warning(f"{path}: recorded in {MANIFEST} as parsed, but {why}: unit {i} ({src}) is parsed again")
                m["units"][i] = None
                break
    for split in SPLITS:
        for s, rec in enumerate(m["shards"][split]):
            if rec and not os.path.exists(os.path.join(job.out, rec["file"])):
                m["shards"][split][s] = None


def _write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _assembly(m: dict, job: Job) -> Assembly:
    """After phase 1: piece offsets, the split cutoff, the rows of every shard; bad lines named."""
    assert all(m["units"]), "every unit is recorded after phase 1"
    pieces, offset, input_lines = [], 0, 0
    for u in m["units"]:
        for k, p in enumerate(u["pieces"]):
            bad = np.array([b[0] for b in p["bad"]], dtype=np.int64)
            pieces.append((piece_path(job.work_dir, u["unit"], k), offset, p["lines"], bad))
            offset += p["lines"]
            if u["source"] < len(job.inputs):  # --valid-input files come after every --input file
                input_lines += p["lines"]
    total_lines = offset
    cutoff = input_lines - int(job.valid_fraction * input_lines + 0.5)
    rows = {split: np.zeros(job.shards, dtype=np.int64) for split in SPLITS}
    for _, o, n, bad in pieces:
        train, valid = piece_shard_counts(o, n, bad, job.shards, cutoff)
        rows["train"] += train
        rows["valid"] += valid
    m["bad_lines"] = _bad_lines(m)
    empty = int((rows["train"] == 0).sum())
    if empty and rows["train"].sum():
        train = int(rows["train"].sum())
        raise TooManyShards(f"--shards {job.shards:,}: the input holds {train:,} training rows, so {empty:,} of the "
                            f"{job.shards:,} train shards would be empty (a training rank reads whole shards): "
                            f"no shard was written; use --shards {min(job.shards, train):,} or fewer")
    if rows["train"].sum() + rows["valid"].sum() == 0:
        raise ValueError(f"no valid rows in the input: {len(m['bad_lines'])} lines, all rejected"
                         + (f" (first: {_fmt_bad(m['bad_lines'][0])})" if m["bad_lines"] else ""))
    _report_bad(m["bad_lines"])
    m["split"] = {"rule": SPLIT_RULE, "valid_fraction": job.valid_fraction,
                  "valid_inputs": list(job.valid_inputs), "lines": total_lines, "cutoff_line": cutoff}
    todo = [s for s in range(job.shards) if not all(m["shards"][sp][s] for sp in SPLITS)]
    return Assembly(pieces, cutoff, {k: [int(x) for x in v] for k, v in rows.items()}, todo)


class TooManyShards(ValueError):
    """More train shards than training rows: some would be empty files."""


MIN_LINE_BYTES = formats.NUM_COLS + 1  # a label, 39 empty fields: 40 characters and a newline


def _check_shards_fit(job: Job, inputs: list[Source]) -> None:
    """Refuses, before anything is parsed or written, a --shards that plain --input files cannot
    fill: they hold at most size / MIN_LINE_BYTES lines (gzip inputs: known after the parse)."""
    if not inputs or any(s.gzip for s in inputs):
        return
    most = sum(max(s.size - s.data_start, 0) for s in inputs) // MIN_LINE_BYTES
    if most and job.shards > most:  # (none: not one line fits; the parse says what is wrong with it)
        size = sum(s.size for s in inputs)
        raise ValueError(f"--shards {job.shards:,}: the --input files ({size:,} bytes) hold at most {most:,} lines "
                         f"(a line is at least {MIN_LINE_BYTES} bytes), so most train shards would be empty (a "
                         f"training rank reads whole shards): use --shards {max(most, 1):,} or fewer")


def _bad_lines(m: dict) -> list[dict]:
    """Every rejected line as file + 1-based line number, from the units' line counts."""
    out, before = [], {}
    for u in m["units"]:
        src = m["sources"][u["source"]]
        base = (1 if src["header"] else 0) + before.get(u["source"], 0)
        k0 = 0
        for p in u["pieces"]:
            out += [{"file": src["path"], "line": base + k0 + i + 1, "reason": why} for i, why in p["bad"]]
            k0 += p["lines"]
        before[u["source"]] = before.get(u["source"], 0) + u["lines"]
    return out


def _fmt_bad(b: dict) -> str:
    return f"{b['file']}:{b['line']}: {b['reason']}"


def _report_bad(bad: list[dict], first: int = 10) -> None:
    if not bad:
        return
    for b in bad[:first]:
        log.warning(f"skipped {_fmt_bad(b)}")
    log.warning(f"{len(bad)} bad lines skipped in all (every one is listed in {MANIFEST})")


def _finish(m: dict, job: Job) -> None:
    """Totals, key counts, label rates; the manifest becomes 'complete'."""
    sketch = KeySketch()
    for split in SPLITS:
        for rec in m["shards"][split]:
            with h5py.File(os.path.join(job.out, rec["file"]), "r") as f:
                sketch.merge(KeySketch(f["key_sketch"][...]))
    missing = np.sum([p["missing"] for u in m["units"] for p in u["pieces"]] or [np.zeros(NUM_DENSE + NUM_FIELDS)], axis=0)
    distinct = sketch.estimate()
    split_tot = {}
    for split in SPLITS:
        rows = sum(r["rows"] for r in m["shards"][split])
        pos = sum(r["positives"] for r in m["shards"][split])
        split_tot[split] = {"rows": rows, "positives": pos, "label_rate": pos / rows if rows else None}
    rows = split_tot["train"]["rows"] + split_tot["valid"]["rows"]
    pos = split_tot["train"]["positives"] + split_tot["valid"]["positives"]
    m["totals"] = {
        "lines": m["split"]["lines"], "rows": rows, "bad_lines": len(m["bad_lines"]), "positives": pos,
        "label_rate": pos / rows, **split_tot,
        "missing": dict(zip(formats.DENSE_NAMES + formats.CAT_NAMES, (int(x) for x in missing))),
        "distinct_keys_estimate": dict(zip(formats.CAT_NAMES, (int(round(x)) for x in distinct))),
        "distinct_keys_estimate_total": int(round(distinct.sum())),
        "keys": sum(r["keys"] for split in SPLITS for r in m["shards"][split]) if job.multi_valued
        else rows * NUM_FIELDS,
    }
    m["state"], m["phase"] = "complete", "complete"
