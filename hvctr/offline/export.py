"""``hvctr export --run-dir R --out DIR``: the model for serving, without optimiser state.

    DIR/manifest.json           format, model config, unseen-key rule, files with sha256 and bytes
    DIR/dense.h5                the dense parameters, one float32 dataset per named tensor
                                (the model's state_dict names, e.g. mlp.0.weight)
    DIR/sparse/rank-NNNNN.h5    one per training rank: keys uint64 [n], ascending; weights
                                [n, dim + 1] = w (dim) | w1 in the manifest's row_format;
                                bucket_owner int32 [4096]

Row formats (``--rows``, recorded as the manifest's ``row_format`` and each file's attribute):

    float32   weights float32 [n, dim + 1]: the trained values, bit for bit (the default)
    float16   weights float16 [n, dim + 1]: half the bytes, IEEE round to nearest
    int8      weights uint8 [n, dim + 1] and scale_bias float16 [n, 2]: rowwise 8-bit
              quantisation as fbgemm's FloatToFused8BitRowwiseQuantizedSBHalf (the layout of its
              TBE inference tables): per row bias = min, scale = (max - min) / 255, both rounded
              to float16 first and then used to quantise, q = round((x - bias) / scale);
              x ~ q * scale + bias. (dim + 5) bytes a row against 4 * (dim + 1)

A reader that meets a row_format it does not know stops (hvctr score names it).

Datasets are contiguous and uncompressed, so a server can binary-search the sorted keys or
map them by file offset and build its own index. A key belongs to the file
``bucket_owner[bucket(key)]`` (hvctr.formats); a key in no file is one training never stored:
it reads its init row (hvctr.formats.init_rows with the manifest's seed and scale) or,
when admission is on (storage.admit_after > 1), the shared zero row, as the trainer's
evaluation does. No pickle: HDF5 and JSON only.

Memory is bounded by ``--memory-mib`` (default 1024), whatever the table's size: a rank's rows
are sorted by key in runs of that size written to a temporary file in the export's directory,
then merged into the output in key order (hvctr.offline.keysort); a rank whose copies fit in
one run is sorted in memory, with no file. The peak is that budget plus the interpreter's own
(numpy, h5py, torch for the dense names: about 0.25 GiB). The temporary file takes (dim + 3) * 4
bytes for every copy of a row along the checkpoint's chain, on the export's disk, while its
rank is written; it is removed before the next rank's (and on any error).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hvctr.checkpoint.format import file_sha256, write_manifest
from hvctr.config import Config, load_config, parse_overrides, to_dict
from hvctr.formats import RowLayout
from hvctr.formats import safefile
from hvctr.formats.h5alloc import create_early, pwrite_all, reserved
from hvctr.formats.space import check_free_space, remedy
from hvctr.log import get_logger
from hvctr.kernels import diskio
from hvctr.offline.keysort import SortedRows
from hvctr.offline.reader import CheckpointReader

log = get_logger(__name__)

FORMAT = "hvctr-export"
FORMAT_VERSION = 1
ROW_FORMATS = ("float32", "float16", "int8")  # --rows; manifest "row_format" (absent: float32)
_ROWS_ALIASES = {"fp32": "float32", "fp16": "float16", "float32": "float32", "float16": "float16", "int8": "int8"}
_H5 = dict(libver=("v110", "v110"), track_order=True)
DEFAULT_MEMORY_MIB = 1024
_WRITE_ROWS = 1 << 16  # rows converted and written at a time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", required=True, help="a run directory written by hvctr train (its config.toml)")
    p.add_argument("--checkpoint", help="a checkpoint of that run other than its newest (a ckpt-NNNNNN directory)")
    p.add_argument("--out", required=True, help="directory to create for the export (must not exist)")
    p.add_argument("--rows", default="fp32", choices=sorted(_ROWS_ALIASES),
                   help="how the rows (w | w1) are stored: fp32 (exact), fp16, int8 (rowwise, a float16 scale "
                        "and bias per row, as fbgemm): default fp32")
    p.add_argument("--memory-mib", type=int, default=DEFAULT_MEMORY_MIB,
                   help="memory for sorting a rank's rows, in MiB, whatever the table's size (more is sorted in "
                        f"runs through a temporary file beside --out): default {DEFAULT_MEMORY_MIB}")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.memory_mib < 1:
        raise ValueError(f"--memory-mib {args.memory_mib}: must be at least 1")
    manifest = export(args.run_dir, args.out, args.checkpoint, overrides, rows=args.rows,
                      memory_bytes=args.memory_mib << 20)
    src = manifest["source"]
    print(f"hvctr export: checkpoint {src['seq']} of {src['checkpoint']} ({src['world_size']} ranks) -> {args.out}: "
          f"{manifest['rows']:,} rows of dim {manifest['model']['dim']} as {manifest['row_format']} "
          f"({manifest['row_bytes']:,} bytes of rows), {len(manifest['dense'])} dense tensors")
    return 0


# The keys that define the trained model (its shape, its rows, the rule of a key in no table):
# an export takes them from the run, never from the command line.
MODEL_KEYS = ("storage.dim", "storage.seed", "storage.init_scale", "storage.admit_after", "model.*")


def run_config(run_dir: str | Path, overrides: list[str] = ()) -> Config:
    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        raise ValueError(f"{run_dir} is not a run directory: {path} is missing")
    cfg = load_config(path, overrides)
    if overrides:
        held, now = to_dict(load_config(path)), to_dict(cfg)
        for section, key, value in parse_overrides(overrides):
            name = f"{section}.{key}"
            if (name in MODEL_KEYS or f"{section}.*" in MODEL_KEYS) and now[section][key] != held[section][key]:
                raise ValueError(f"--{name}={value}: {name} defines the trained model and cannot be overridden at "
                                 f"export: the checkpoint was trained with {name} = {held[section][key]!r} ({path})")
    return cfg


def export(run_dir: str | Path, out: str | Path, checkpoint: str | Path | None = None,
           overrides: list[str] = (), rows: str = "float32",
           memory_bytes: int = DEFAULT_MEMORY_MIB << 20) -> dict[str, Any]:
    """Writes the export of a run's newest complete checkpoint (or ``checkpoint``); returns its
    manifest. ``memory_bytes``: the sort's budget (module docstring)."""
    if rows not in _ROWS_ALIASES:
        raise ValueError(f"--rows {rows!r}: not one of {sorted(_ROWS_ALIASES)}")
    row_format = _ROWS_ALIASES[rows]
    cfg = run_config(run_dir, overrides)
    reader = CheckpointReader(checkpoint or cfg.checkpoint.dir or Path(run_dir) / "checkpoints")
    out = Path(out)
    if os.path.lexists(out):  # a dangling link too: nothing is written through it
        raise ValueError(f"--out {out} exists: exports are written once, choose a new directory")
    # X.tmp: made here and marked as hvctr's; a leftover there is removed only when it is a
    # killed export's (it carries the marker), anything else is refused, naming it (safefile)
    tmp = safefile.make_temp_dir(out.with_name(out.name + ".tmp"), "hvctr export")
    current = tmp
    try:
        safefile.make_dir(tmp / "sparse", parents=False)
        dim = cfg.storage.dim
        owner = reader.bucket_owner()
        files, counts, row_bytes = [], [], 0
        for rank in range(reader.world_size):
            name = f"sparse/rank-{rank:05d}.h5"
            current = tmp / name
            n, nbytes = _write_sparse(tmp / name, reader, rank, dim, owner, row_format, memory_bytes)
            counts.append(n)
            row_bytes += nbytes
            files.append(_record(tmp, name, rows=n, row_bytes=nbytes))
        current = tmp / "dense.h5"
        dense_names = _write_dense(tmp / "dense.h5", cfg, reader.dense(0))
        files.append(_record(tmp, "dense.h5"))
        manifest = _manifest(cfg, reader, files, dense_names, sum(counts))
        manifest.update(row_format=row_format, row_bytes=row_bytes)
        current = tmp / "manifest.json"
        manifest = write_manifest(tmp / "manifest.json", manifest)  # with the sha256 of its own content
        current = out
        safefile.publish_temp_dir(tmp, out)  # the export appears whole or not at all
    except OSError as e:  # a full disk: one message naming the file, nothing of the export left
        safefile.remove_temp_dir(tmp)
        raise ValueError(f"cannot write {current}: {e.strerror or e}; nothing of the export was kept ({tmp} "
                         f"removed): {remedy(e, tmp.parent)}, or choose another --out") from None
    except BaseException:
        safefile.remove_temp_dir(tmp)
        raise
    return manifest


def quantize_int8_rowwise(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fbgemm's 8-bit rowwise quantisation with a float16 scale and bias: (uint8 [n, d],
    float16 [n, 2] = scale | bias). Vectorised over rows; exact for constant rows."""
    x = np.asarray(x, dtype=np.float32)
    lo = x.min(axis=1, initial=np.inf) if x.shape[1] else np.zeros(x.shape[0], np.float32)
    hi = x.max(axis=1, initial=-np.inf) if x.shape[1] else np.zeros(x.shape[0], np.float32)
    bias = lo.astype(np.float16)  # rounded first, then quantised against: what a reader sees
    # (x - bias) spans at most hi - bias; the scale covers it in 255 levels (0 for a constant row: 1)
    scale = ((hi - bias.astype(np.float32)) / np.float32(255)).astype(np.float16)
    scale[scale == 0] = 1  # a constant row (or one whose span rounds to 0): every q is 0 or near
    s32, b32 = scale.astype(np.float32)[:, None], bias.astype(np.float32)[:, None]
    q = np.clip(np.rint((x - b32) / s32), 0, 255).astype(np.uint8)
    return q, np.stack([scale, bias], axis=1)


def dequantize_int8_rowwise(q: np.ndarray, scale_bias: np.ndarray) -> np.ndarray:
    """float32 [n, d] = q * scale + bias (the row's float16 scale and bias, in float32)."""
    sb = scale_bias.astype(np.float32)
    return q.astype(np.float32) * sb[:, :1] + sb[:, 1:2]


def _write_sparse(path: Path, reader: CheckpointReader, rank: int, dim: int, owner: np.ndarray,
                  row_format: str = "float32", memory_bytes: int = DEFAULT_MEMORY_MIB << 20) -> tuple[int, int]:
    """Rank ``rank``'s model columns, sorted by key, in ``row_format``: (rows, bytes of rows).
    Streamed in key order from a sort within ``memory_bytes`` (hvctr.offline.keysort)."""
    layout = RowLayout(dim)
    width = layout.model_width
    parts = lambda chunk_rows: reader.copies(rank, layout.model, chunk_rows)  # noqa: E731
    with SortedRows(parts, reader.copy_count(rank), width, memory_bytes, path.with_suffix(".sort")) as rows:
        n = rows.count
        stored = {"weights": ((n, width), np.uint8 if row_format == "int8" else
                              np.float16 if row_format == "float16" else np.float32)}
        if row_format == "int8":
            stored["scale_bias"] = ((n, 2), np.float16)
        owner = np.asarray(owner)
        out = _ReservedH5(path, {"format": FORMAT, "format_version": FORMAT_VERSION, "rank": rank,
                                 "world_size": reader.world_size, "dim": dim, "columns": f"w[{dim}] w1[1]",
                                 "row_format": row_format},
                          {"keys": ((n,), np.uint64), **stored, "bucket_owner": (owner.shape, owner.dtype)})
        with out:
            out.write("bucket_owner", owner, 0)
            at = 0
            for keys, weights in rows.batches():
                for s0 in range(0, keys.shape[0], _WRITE_ROWS):
                    w = weights[s0:s0 + _WRITE_ROWS]
                    out.write("keys", keys[s0:s0 + _WRITE_ROWS], at)
                    if row_format == "int8":
                        q, sb = quantize_int8_rowwise(w)
                        out.write("weights", q, at)
                        out.write("scale_bias", sb, at)
                    else:
                        out.write("weights", w.astype(stored["weights"][1]), at)
                    at += w.shape[0]
        if at != n:
            raise AssertionError(f"{path}: {at} rows written, {n} counted: the checkpoint changed")
    return n, sum(int(np.prod(shape)) * np.dtype(dt).itemsize for shape, dt in stored.values())


def _write_dense(path: Path, cfg: Config, saved: dict[str, np.ndarray]) -> list[str]:
    """The dense parameters under the model's own names (checkpoints number them)."""
    from hvctr.models import build_model  # torch: only where it is needed

    named = list(build_model(cfg.model, cfg.storage.dim).named_parameters())
    tensors = {}
    for i, (name, p) in enumerate(named):
        t = saved.get(f"param.{i:03d}")
        if t is None or t.shape != tuple(p.shape):
            raise ValueError(f"checkpoint parameter {i} ({name}) has shape {None if t is None else t.shape}, "
                             f"the run's config builds {tuple(p.shape)}: config.toml and checkpoint disagree")
        tensors[name] = t.astype(np.float32)
    _write_h5(path, {}, tensors)
    return [name for name, _ in named]


class _ReservedH5:
    """A new HDF5 file of contiguous datasets (a reader may map them by file offset), written
    as the checkpoint's rank files are (hvctr.formats.h5alloc): free space checked, HDF5 writes
    the skeleton, every block reserved (posix_fallocate), the data by pwrite at the datasets'
    offsets, ``write(name, rows, first_row)`` a chunk at a time, flushed and dropped behind. So
    a full disk is an OSError before any data is written, never a failed write inside HDF5
    (which crashes). ``specs``: {name: (shape, dtype)}, created in that order."""

    def __init__(self, path: Path, attrs: dict[str, Any], specs: dict[str, tuple[Any, Any]]) -> None:
        self.path = path
        self.specs = {name: (tuple(shape), np.dtype(dt)) for name, (shape, dt) in specs.items()}
        need = sum(int(np.prod(shape)) * dt.itemsize for shape, dt in self.specs.values())
        check_free_space(str(path.parent), need + (64 << 10))
        with h5py.File(path, "x", **_H5) as f:  # exclusive: never through a planted link
            f.attrs.update(attrs)
            self.offsets = {name: create_early(f, name, shape, dt).id.get_offset()
                            for name, (shape, dt) in self.specs.items()}
        self._reserved = reserved(path)

    def __enter__(self) -> "_ReservedH5":
        self._fd = self._reserved.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._reserved.__exit__(*exc)

    def write(self, name: str, a: np.ndarray, first_row: int) -> None:
        shape, dt = self.specs[name]
        a = np.ascontiguousarray(a, dtype=dt)
        if a.size:
            at = self.offsets[name] + first_row * dt.itemsize * int(np.prod(shape[1:]))
            pwrite_all(self._fd, a, at)
            diskio.write_behind(self._fd, str(self.path), at, a.nbytes)


def _write_h5(path: Path, attrs: dict[str, Any], datasets: dict[str, np.ndarray]) -> None:
    """A new HDF5 file of ``datasets`` whole (_ReservedH5)."""
    arrays = {name: np.ascontiguousarray(a) for name, a in datasets.items()}
    with _ReservedH5(path, attrs, {name: (a.shape, a.dtype) for name, a in arrays.items()}) as f:
        for name, a in arrays.items():
            f.write(name, a, 0)


def _record(root: Path, name: str, **extra: Any) -> dict[str, Any]:
    path = root / name
    return {"file": name, "sha256": file_sha256(path), "bytes": path.stat().st_size, **extra}


def _manifest(cfg: Config, reader: CheckpointReader, files: list[dict], dense_names: list[str],
              rows: int) -> dict[str, Any]:
    s = cfg.storage
    m = reader.manifest
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "model": {**to_dict(cfg)["model"], "dim": s.dim},
        "dense": dense_names,
        # What a key in no table reads: what hvctr.storage.EmbeddingStore.read_only gives it.
        "unseen_keys": {"row": "default" if s.admit_after > 1 else "init", "init_scale": s.init_scale,
                        "seed": s.seed},
        "batch_size": cfg.data.batch_size_per_rank,  # the trainer's evaluation batches
        # the training data's multi-valued fields ({"fields", "separator"}; None: one key a field):
        # hvctr score parses its input as data_prep parsed the training data
        "multi_valued": m.get("multi_valued"),
        "world_size": reader.world_size, "rows": rows, "files": files,
        "source": {"checkpoint": str(reader.path.resolve()), "seq": m["seq"], "world_size": m["world_size"],
                   "state": m["state"], "train_dir": m.get("train_dir"), "init_from": m.get("init_from")},
    }
