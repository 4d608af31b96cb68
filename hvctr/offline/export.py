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

One rank's rows are sorted in memory: about (dim + 3) * 4 bytes per row of that rank.
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
from hvctr.formats.space import check_free_space
from hvctr.log import get_logger
from hvctr.offline.reader import CheckpointReader

log = get_logger(__name__)

FORMAT = "hvctr-export"
FORMAT_VERSION = 1
ROW_FORMATS = ("float32", "float16", "int8")  # --rows; manifest "row_format" (absent: float32)
_ROWS_ALIASES = {"fp32": "float32", "fp16": "float16", "float32": "float32", "float16": "float16", "int8": "int8"}
_H5 = dict(libver=("v110", "v110"), track_order=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", required=True, help="a run directory written by hvctr train (its config.toml)")
    p.add_argument("--checkpoint", help="a checkpoint of that run other than its newest (a ckpt-NNNNNN directory)")
    p.add_argument("--out", required=True, help="directory to create for the export (must not exist)")
    p.add_argument("--rows", default="fp32", choices=sorted(_ROWS_ALIASES),
                   help="how the rows (w | w1) are stored: fp32 (exact), fp16, int8 (rowwise, a float16 scale "
                        "and bias per row, as fbgemm): default fp32")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    manifest = export(args.run_dir, args.out, args.checkpoint, overrides, rows=args.rows)
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
           overrides: list[str] = (), rows: str = "float32") -> dict[str, Any]:
    """Writes the export of a run's newest complete checkpoint (or ``checkpoint``); returns its manifest."""
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
            n, nbytes = _write_sparse(tmp / name, reader, rank, dim, owner, row_format)
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
                         f"removed): free space there, or choose an --out on a larger disk") from None
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
                  row_format: str = "float32") -> tuple[int, int]:
    """Rank ``rank``'s model columns, sorted by key, in ``row_format``: (rows, bytes of rows)."""
    layout = RowLayout(dim)
    parts = [(k, r[:, layout.model]) for k, r, _ in reader.rows(rank)]
    keys = np.concatenate([k for k, _ in parts]) if parts else np.zeros(0, np.uint64)
    weights = np.concatenate([w for _, w in parts]) if parts else np.zeros((0, layout.model_width), np.float32)
    order = np.argsort(keys, kind="stable")
    weights = np.ascontiguousarray(weights[order], dtype=np.float32)
    if row_format == "int8":
        stored = dict(zip(("weights", "scale_bias"), quantize_int8_rowwise(weights)))
    else:
        stored = {"weights": weights.astype(np.float16 if row_format == "float16" else np.float32)}
    _write_h5(path, {"format": FORMAT, "format_version": FORMAT_VERSION, "rank": rank,
                     "world_size": reader.world_size, "dim": dim, "columns": f"w[{dim}] w1[1]",
                     "row_format": row_format},
              {"keys": keys[order], **stored, "bucket_owner": np.asarray(owner)})
    return int(keys.shape[0]), sum(int(a.nbytes) for a in stored.values())


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


def _write_h5(path: Path, attrs: dict[str, Any], datasets: dict[str, np.ndarray]) -> None:
    """A new HDF5 file of contiguous datasets (a reader may map them by file offset), written
    as the checkpoint's rank files are (hvctr.formats.h5alloc): free space checked, HDF5 writes
    the skeleton, every block reserved (posix_fallocate), the data by pwrite. So a full disk is
    an OSError before any data is written, never a failed write inside HDF5 (which crashes)."""
    arrays = {name: np.ascontiguousarray(a) for name, a in datasets.items()}
    check_free_space(str(path.parent), sum(a.nbytes for a in arrays.values()) + (64 << 10))
    with h5py.File(path, "x", **_H5) as f:  # exclusive: never through a planted link
        f.attrs.update(attrs)
        offsets = {name: create_early(f, name, a.shape, a.dtype).id.get_offset() for name, a in arrays.items()}
    with reserved(path) as fd:
        for name, a in arrays.items():
            if a.size:
                pwrite_all(fd, a, offsets[name])


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
        "world_size": reader.world_size, "rows": rows, "files": files,
        "source": {"checkpoint": str(reader.path.resolve()), "seq": m["seq"], "world_size": m["world_size"],
                   "state": m["state"], "train_dir": m.get("train_dir"), "init_from": m.get("init_from")},
    }
