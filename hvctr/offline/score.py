"""``hvctr score --model DIR --input FILE.tsv``: click probabilities from an export alone.

    hvctr score --model exports/day3 --input day4.tsv --out day4.pred     # one probability per line

A reference for serving code: it reads only the export (hvctr export), parses the input with
data_prep's parser and key rule (Criteo TSV, or CSV with a header; gzip too), and computes
what the trainer's evaluation computes for the same rows, bit for bit:

- a key found in the tables reads its (w, w1), widened to float32 from the export's row
  format (float16, or int8 rows times their scale plus their bias: bit for bit the trainer's
  only for float32); a key in none reads the row the trainer's
  evaluation gives it: its init row from the key, or the shared zero row when admission is on;
- the rows sit in a full-width row buffer, as in the trainer, so the model reads them through
  the same strides;
- batches of the trainer's evaluation size (``--batch-size``, default the run's
  data.batch_size_per_rank), one torch thread, deterministic algorithms: a matrix product's
  result for a row depends on the batch's row count and on the thread count.

Every line must parse (the output has one line per input line); the first bad one is an
error naming its file and line.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Iterator

import h5py
import numpy as np
import torch

from hvctr.determinism import deterministic_torch
from hvctr.formats import safefile
from hvctr.formats.fields import OneOf, Opt, field_problem
from hvctr.formats.lines import parse_block
from hvctr.formats.sources import Unit, iter_blocks, open_sources
from hvctr.checkpoint.format import check_bucket_owner, check_datasets, file_sha256, plain_file, read_manifest
from hvctr.config import ModelArch, ModelConfig
from hvctr.metrics import EvalAccumulator
from hvctr.models import build_model
from hvctr.offline.export import FORMAT, FORMAT_VERSION, ROW_FORMATS, dequantize_int8_rowwise
from hvctr.formats import NUM_FIELDS, RowLayout, init_rows, owner_of
from hvctr.data.bags import Bags, concat_bags, field_pooling_mask
from hvctr.optim.pooling import embed_batch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="an export directory (hvctr export)")
    p.add_argument("--input", required=True, help="Criteo TSV (or CSV with a header; .gz too), labels included")
    p.add_argument("--out", help="where to write one probability per input line (default: stdout)")
    p.add_argument("--batch-size", type=int, default=0, help="rows per forward pass (default, or 0: the run's "
                   "data.batch_size_per_rank, as the trainer's evaluation)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the trainer's default is 1)")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise ValueError(f"hvctr score takes no config overrides, got {overrides}")
    if args.threads < 1:
        raise ValueError(f"--threads {args.threads}: the torch threads to score with, at least 1 (the trainer's "
                         f"evaluation uses 1: the same threads give the same probabilities, bit for bit)")
    if args.batch_size < 0:
        raise ValueError(f"--batch-size {args.batch_size}: rows per forward pass, at least 1 (0: the run's "
                         f"data.batch_size_per_rank)")
    torch.set_num_threads(args.threads)
    deterministic_torch()
    model = ExportedModel(args.model)
    acc = EvalAccumulator()
    tmp = ""
    try:  # a fresh temporary file beside --out (O_EXCL | O_NOFOLLOW): never through a planted link
        if args.out:
            fd, tmp = safefile.create_temp(args.out)
            out = os.fdopen(fd, "w")
        else:
            out = sys.stdout
    except OSError as e:
        raise ValueError(f"--out {args.out}: cannot write it: {e.strerror or e}") from None
    try:
        for labels, logits in score_file(model, args.input, args.batch_size or model.batch_size):
            np.savetxt(out, torch.sigmoid(logits).numpy(), fmt="%.9g")  # 9 digits: float32 round-trips
            acc.add_logits(logits, torch.from_numpy(labels))
        if args.out:
            out.close()
            os.replace(tmp, args.out)
    except OSError as e:  # a full disk under --out: nothing half-written is left
        if not args.out:  # stdout: a closed pipe ends the command quietly (hvctr.cli), another error is named
            if isinstance(e, BrokenPipeError):
                raise
            raise ValueError(f"cannot write the probabilities to stdout: {e.strerror or e}") from None
        raise ValueError(f"--out {args.out}: cannot write it: {e.strerror or e}") from None
    finally:
        if args.out:
            out.close()
            safefile.remove_quietly(tmp)  # ours (a fresh name); gone already once renamed
    r = acc.result()
    print(f"hvctr score: {r['count']:,} rows  AUC {r['auc']:.4f}  logloss {r['logloss']:.4f}  "
          f"NE {r['ne']:.4f}  COPC {r['copc']:.3f}",
          file=sys.stderr)
    return 0


# What ExportedModel reads of an export's manifest (files and world_size: _check_files).
EXPORT_FIELDS = {
    "world_size": int, "files": [dict], "dense": [str], "batch_size": int, "row_format": Opt(str),
    # bottom_mlp, cross_layers, cross_rank: exports from before dlrm and dcnv2 lack them (their archs do not read them)
    "model": {"arch": OneOf(tuple(a.value for a in ModelArch)), "dim": int, "hidden": [int], "num_dense": int,
              "num_fields": int, "bottom_mlp": Opt([int]), "cross_layers": Opt(int), "cross_rank": Opt(int),
              "pooling": Opt([str])},
    # the training data's multi-valued fields (0-based) and their value separator; exports from before lack it
    "multi_valued": Opt({"fields": [int], "separator": str}),
    "unseen_keys": {"row": OneOf(("init", "default")), "init_scale": float, "seed": int},
}


def _range_problem(m: dict) -> str:
    mc = m["model"]

    def given(key: str, absent: object) -> object:  # keys older exports lack
        return absent if mc.get(key) is None else mc[key]

    for key, value, low in (("model.dim", mc["dim"], 1), ("batch_size", m["batch_size"], 1),
                            ("model.num_fields", mc["num_fields"], 1), ("model.num_dense", mc["num_dense"], 0),
                            ("model.hidden", min(mc["hidden"], default=1), 1),
                            ("model.bottom_mlp", min(given("bottom_mlp", [1]), default=1), 1),
                            ("model.cross_layers", given("cross_layers", 1), 1),
                            ("model.cross_rank", given("cross_rank", 0), 0)):
        if value < low:
            return f"key {key!r}: {value} is below {low}"
    return ""


class ExportedModel:
    """An export loaded for scoring: the dense model, the sparse tables, the unseen-key rule.

    The tables are read into memory (the reference scorer's simplification; a server maps them).
    """

    def __init__(self, model_dir: str | Path, verify: bool = True) -> None:
        self.dir = Path(model_dir)
        path = self.dir / "manifest.json"
        if not path.is_file():
            raise ValueError(f"{self.dir} is not an hvctr export: {path} is missing")
        m = read_manifest(path)  # ValueError naming the file when damaged
        if m.get("format") != FORMAT or m.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path}: format {m.get('format')!r} version {m.get('format_version')!r}, "
                             f"this hvctr reads {FORMAT!r} version {FORMAT_VERSION}")
        problem = field_problem(m, EXPORT_FIELDS) or _range_problem(m)
        if problem:  # resealed with a key missing or of another type: named before any is used
            raise ValueError(f"{path}: {problem}: damaged or not written by hvctr export")
        self._check_files(m, path, verify)
        self.row_format = m.get("row_format", "float32")  # exports before --rows: float32
        if self.row_format not in ROW_FORMATS:
            raise ValueError(f"{path}: row_format {self.row_format!r} is not one this hvctr reads "
                             f"({', '.join(ROW_FORMATS)}): score it with the hvctr that exported it")
        self.manifest = m
        self.dim = int(m["model"]["dim"])
        self.layout = RowLayout(self.dim)
        self.batch_size = int(m["batch_size"])
        self.unseen = m["unseen_keys"]
        self.model = self._load_dense(m)
        self.multi_valued = m.get("multi_valued")  # {"fields", "separator"}: parse the input as data_prep did
        try:
            self.pooling = field_pooling_mask(m["model"].get("pooling") or ["sum"], int(m["model"]["num_fields"]))
        except ValueError as e:
            raise ValueError(f"{path}: {e}: damaged or crafted") from None
        if self.multi_valued is not None and not all(0 <= f < NUM_FIELDS for f in self.multi_valued["fields"]):
            raise ValueError(f"{path}: multi_valued fields {self.multi_valued['fields']} outside [0, {NUM_FIELDS}): "
                             f"damaged or crafted")
        self.keys, self.weights = [], []
        for rank in range(m["world_size"]):
            with h5py.File(self.dir / "sparse" / f"rank-{rank:05d}.h5", "r") as f:
                owner = self._check_sparse(f, rank, m)  # before anything of it is read
                self.keys.append(f["keys"][...])
                self.weights.append(self._read_weights(f))
                if rank == 0:
                    self.bucket_owner = owner
                elif not np.array_equal(owner, self.bucket_owner):
                    raise ValueError(f"{f.filename}: its bucket table differs from rank 0's: damaged or crafted")

    def _check_files(self, m: dict, path: Path, verify: bool) -> None:
        """Every file this reader opens is listed in the manifest (dense.h5 and one sparse file
        a rank), a plain file inside the export (no '..', no absolute path, no link), and
        (``verify``) of its listed size and sha256. A ValueError naming the file otherwise."""
        ws = m.get("world_size")
        if type(ws) is not int or ws < 1:
            raise ValueError(f"{path}: world_size {ws!r} is not a number of ranks: damaged or crafted")
        files = m.get("files") if isinstance(m.get("files"), list) else []
        listed = {rec.get("file"): rec for rec in files if isinstance(rec, dict)}
        opened = ["dense.h5"] + [f"sparse/rank-{rank:05d}.h5" for rank in range(ws)]
        for name in opened:
            if name not in listed:
                raise ValueError(f"{self.dir / name} is not listed in {path}: damaged or crafted")
        stray = sorted(str(n) for n in listed if n not in opened)
        if stray or len(files) != len(opened):
            raise ValueError(f"{path} lists {stray or 'files twice'} beside the {len(opened)} files of an export "
                             f"of {ws} ranks: damaged or crafted")
        self._listed = listed
        for name in opened:
            rec, f = listed[name], self.dir / name
            problem = plain_file(self.dir, name)
            if problem:
                raise ValueError(f"{problem} (listed in {path})")
            if verify and (f.stat().st_size != rec.get("bytes") or file_sha256(f) != rec.get("sha256")):
                raise ValueError(f"{f} is missing or does not match its checksum in {path}")

    def _check_sparse(self, f: h5py.File, rank: int, m: dict) -> np.ndarray:
        """Rank ``rank``'s sparse file agrees with the manifest (rank, world size, shapes that
        fit the file) before its rows are read; returns its bucket table, checked."""
        ws = m["world_size"]
        a = f.attrs
        for key, want in (("rank", rank), ("world_size", ws)):
            if key in a and int(a[key]) != want:
                raise ValueError(f"{f.filename}: written with {key} {int(a[key])}, the manifest says {want} "
                                 f"(world size {ws}): damaged or crafted")
        problem = check_datasets(f)
        if problem:
            raise ValueError(problem)
        n = f["keys"].shape[0] if "keys" in f and len(f["keys"].shape) == 1 else -1
        want = {"weights": (n, self.dim + 1), **({"scale_bias": (n, 2)} if self.row_format == "int8" else {})}
        got = {k: f[k].shape if k in f else None for k in want}
        listed = self._listed[f"sparse/rank-{rank:05d}.h5"].get("rows")
        if n < 0 or got != want or "bucket_owner" not in f or (type(listed) is int and listed != n):
            raise ValueError(f"{f.filename}: datasets of shapes {got} for {n} keys (the manifest lists {listed} "
                             f"rows), an export of dim {self.dim} has {want} and a bucket table: damaged or crafted")
        return check_bucket_owner(f["bucket_owner"][...], ws, f.filename)

    def _read_weights(self, f: h5py.File) -> np.ndarray:
        """The file's rows as float32 [n, dim + 1], whatever the row format."""
        stored = f.attrs.get("row_format", "float32")
        if stored != self.row_format:
            raise ValueError(f"{f.filename}: row_format {stored!r}, the manifest says {self.row_format!r}")
        w = f["weights"][...]
        if self.row_format == "int8":
            return dequantize_int8_rowwise(w, f["scale_bias"][...])
        return w.astype(np.float32)  # float16 widens exactly; float32 as stored

    def _load_dense(self, m: dict) -> torch.nn.Module:
        mc = m["model"]
        later = {k: tuple(v) if isinstance(v, list) else v for k in ("bottom_mlp", "cross_layers", "cross_rank")
                 if (v := mc.get(k)) is not None}
        cfg = ModelConfig(arch=ModelArch(mc["arch"]), hidden=tuple(mc["hidden"]), num_dense=mc["num_dense"],
                          num_fields=mc["num_fields"], **later)
        try:
            model = build_model(cfg, self.dim)
        except ValueError as e:  # a bottom MLP that does not end at dim
            raise ValueError(f"{self.dir / 'manifest.json'}: its model cannot be built ({e}): damaged or crafted") from None
        with h5py.File(self.dir / "dense.h5", "r") as f:
            problem = check_datasets(f)
            want = {name: tuple(p.shape) for name, p in model.named_parameters()}
            got = {name: f[name].shape if isinstance(f.get(name), h5py.Dataset) else None for name in m["dense"]}
            if problem or got != want:
                raise ValueError(problem or f"{f.filename}: dense tensors {got}, the manifest's model has {want}: "
                                 f"damaged or crafted")
            state = {name: torch.from_numpy(f[name][...]) for name in m["dense"]}
        model.load_state_dict(state, strict=True)
        return model.eval()

    def rows(self, keys: np.ndarray) -> np.ndarray:
        """Full-width rows [n, width] of unique keys: w | w1 filled, optimiser columns zero."""
        out = np.zeros((keys.shape[0], self.layout.width), dtype=np.float32)
        found = np.zeros(keys.shape[0], dtype=bool)
        owner = owner_of(keys, self.bucket_owner)
        for rank, (tk, tw) in enumerate(zip(self.keys, self.weights)):  # one vectorised search per table
            sel = np.flatnonzero(owner == rank)
            if sel.size == 0 or tk.size == 0:
                continue
            pos = np.minimum(np.searchsorted(tk, keys[sel]), tk.size - 1)
            hit = tk[pos] == keys[sel]
            out[sel[hit], self.layout.model] = tw[pos[hit]]
            found[sel[hit]] = True
        if self.unseen["row"] == "init":  # else: the shared zero row, as out already holds
            miss = np.flatnonzero(~found)
            out[miss] = init_rows(keys[miss], self.layout, self.unseen["init_scale"], self.unseen["seed"])
        return out

    @torch.no_grad()
    def logits(self, dense: np.ndarray, keys: np.ndarray | Bags) -> torch.Tensor:
        """Logits [B] of a batch: dense float32 [B, 13], keys uint64 [B, 26] (or the Bags of its
        rows, multi-valued fields pooled by the model's pooling); as Trainer.evaluate."""
        uniq, inv = np.unique(keys.values if isinstance(keys, Bags) else keys.reshape(-1), return_inverse=True)
        rows = torch.from_numpy(self.rows(uniq))
        if isinstance(keys, Bags):
            emb, w1 = embed_batch(rows, keys.with_values(inv), self.pooling, self.dim)
            return self.model(torch.from_numpy(dense), emb, w1)
        g = rows[torch.from_numpy(inv.reshape(keys.shape))]
        return self.model(torch.from_numpy(dense), g[..., : self.dim], g[..., self.dim])


def read_rows(path: str, multi_valued: dict | None = None) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | Bags]]:
    """(labels, dense, keys) of every line of a Criteo file, in order, block by block; with
    ``multi_valued`` ({"fields", "separator"} of the data manifest) keys are Bags."""
    src = open_sources([path])[0]
    lines_before = 0
    fields = tuple(multi_valued["fields"]) if multi_valued else ()
    sep = multi_valued["separator"].encode() if multi_valued else b","
    for data, _ in iter_blocks(src, Unit(0, 0, 0, src.size)):
        blk = parse_block(data, src.fmt, multi_valued=fields, value_sep=sep)
        if blk.bad:
            index, reason = blk.bad[0]
            raise ValueError(f"{path}:{src.header_lines + lines_before + index + 1}: {reason} "
                             f"(hvctr score needs every line well formed)")
        lines_before += blk.num_lines
        yield blk.labels, blk.dense, (Bags(blk.keys, blk.lengths) if blk.lengths is not None else blk.keys)


def _take(keys: np.ndarray | Bags, lo: int, hi: int | None) -> np.ndarray | Bags:
    if isinstance(keys, Bags):
        return keys.rows_slice(lo, keys.rows if hi is None else hi)
    return keys[lo:hi]


def _cat(parts: list) -> np.ndarray | Bags:
    return concat_bags(parts) if isinstance(parts[0], Bags) else np.concatenate(parts)


def score_file(model: ExportedModel, path: str, batch_size: int) -> Iterator[tuple[np.ndarray, torch.Tensor]]:
    """(labels, logits) of consecutive batches of ``batch_size`` rows (the last may be short)."""
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    held = 0
    for part in read_rows(path, model.multi_valued):
        pending.append(part)
        held += part[0].shape[0]
        while held >= batch_size:
            labels, dense, keys = (_cat(list(c)) for c in zip(*pending))
            yield labels[:batch_size], model.logits(dense[:batch_size], _take(keys, 0, batch_size))
            pending = [(labels[batch_size:], dense[batch_size:], _take(keys, batch_size, None))]
            held -= batch_size
    if held:
        labels, dense, keys = (_cat(list(c)) for c in zip(*pending))
        yield labels, model.logits(dense, keys)
