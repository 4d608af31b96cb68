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
import shutil
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hvctr.checkpoint.format import file_sha256, write_manifest
from hvctr.config import Config, load_config, to_dict
from hvctr.formats import RowLayout
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


def run_config(run_dir: str | Path, overrides: list[str] = ()) -> Config:
    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        raise ValueError(f"{run_dir} is not a run directory: {path} is missing")
    return load_config(path, overrides)


def export(run_dir: str | Path, out: str | Path, checkpoint: str | Path | None = None,
           overrides: list[str] = (), rows: str = "float32") -> dict[str, Any]:
    """Writes the export of a run's newest complete checkpoint (or ``checkpoint``); returns its manifest."""
    if rows not in _ROWS_ALIASES:
        raise ValueError(f"--rows {rows!r}: not one of {sorted(_ROWS_ALIASES)}")
    row_format = _ROWS_ALIASES[rows]
    cfg = run_config(run_dir, overrides)
    reader = CheckpointReader(checkpoint or cfg.checkpoint.dir or Path(run_dir) / "checkpoints")
    out = Path(out)
    if out.exists():
        raise ValueError(f"--out {out} exists: exports are written once, choose a new directory")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "sparse").mkdir(parents=True)
    dim = cfg.storage.dim
    owner = reader.bucket_owner()
    files, counts, row_bytes = [], [], 0
    for rank in range(reader.world_size):
        name = f"sparse/rank-{rank:05d}.h5"
        n, nbytes = _write_sparse(tmp / name, reader, rank, dim, owner, row_format)
        counts.append(n)
        row_bytes += nbytes
        files.append(_record(tmp, name, rows=n, row_bytes=nbytes))
    dense_names = _write_dense(tmp / "dense.h5", cfg, reader.dense(0))
    files.append(_record(tmp, "dense.h5"))
    manifest = _manifest(cfg, reader, files, dense_names, sum(counts))
    manifest.update(row_format=row_format, row_bytes=row_bytes)
    manifest = write_manifest(tmp / "manifest.json", manifest)  # with the sha256 of its own content
    os.replace(tmp, out)  # the export appears whole or not at all
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
    with h5py.File(path, "w", **_H5) as f:
        f.attrs.update({"format": FORMAT, "format_version": FORMAT_VERSION, "rank": rank,
                        "world_size": reader.world_size, "dim": dim, "columns": f"w[{dim}] w1[1]",
                        "row_format": row_format})
        # Contiguous (no chunks): a reader may map them by file offset.
        f.create_dataset("keys", data=keys[order], track_times=False)
        for name, data in stored.items():
            f.create_dataset(name, data=data, track_times=False)
        f.create_dataset("bucket_owner", data=owner, track_times=False)
    return int(keys.shape[0]), sum(int(a.nbytes) for a in stored.values())


def _write_dense(path: Path, cfg: Config, saved: dict[str, np.ndarray]) -> list[str]:
    """The dense parameters under the model's own names (checkpoints number them)."""
    from hvctr.models import build_model  # torch: only where it is needed

    named = list(build_model(cfg.model, cfg.storage.dim).named_parameters())
    with h5py.File(path, "w", **_H5) as f:
        for i, (name, p) in enumerate(named):
            t = saved.get(f"param.{i:03d}")
            if t is None or t.shape != tuple(p.shape):
                raise ValueError(f"checkpoint parameter {i} ({name}) has shape {None if t is None else t.shape}, "
                                 f"the run's config builds {tuple(p.shape)}: config.toml and checkpoint disagree")
            f.create_dataset(name, data=t.astype(np.float32), track_times=False)
    return [name for name, _ in named]


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
