"""``hvctr export --run-dir R --out DIR``: the model for serving, without optimiser state.

    DIR/manifest.json           format, model config, unseen-key rule, files with sha256 and bytes
    DIR/dense.h5                the dense parameters, one float32 dataset per named tensor
                                (the model's state_dict names, e.g. mlp.0.weight)
    DIR/sparse/rank-NNNNN.h5    one per training rank: keys uint64 [n], ascending; weights
                                float32 [n, dim + 1] = w (dim) | w1; bucket_owner int32 [4096]

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

from hvctr.train.checkpoint import file_sha256, write_manifest
from hvctr.config import Config, load_config, to_dict
from hvctr.dist.log import get_logger
from hvctr.offline.reader import CheckpointReader

log = get_logger(__name__)

FORMAT = "hvctr-export"
FORMAT_VERSION = 1
_H5 = dict(libver=("v110", "v110"), track_order=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", required=True, help="a run directory written by hvctr train (its config.toml)")
    p.add_argument("--checkpoint", help="a checkpoint of that run other than its newest (a ckpt-NNNNNN directory)")
    p.add_argument("--out", required=True, help="directory to create for the export (must not exist)")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    manifest = export(args.run_dir, args.out, args.checkpoint, overrides)
    src = manifest["source"]
    print(f"hvctr export: checkpoint {src['seq']} of {src['checkpoint']} ({src['world_size']} ranks) -> {args.out}: "
          f"{manifest['rows']:,} rows of dim {manifest['model']['dim']}, {len(manifest['dense'])} dense tensors")
    return 0


def run_config(run_dir: str | Path, overrides: list[str] = ()) -> Config:
    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        raise ValueError(f"{run_dir} is not a run directory: {path} is missing")
    return load_config(path, overrides)


def export(run_dir: str | Path, out: str | Path, checkpoint: str | Path | None = None,
           overrides: list[str] = ()) -> dict[str, Any]:
    """Writes the export of a run's newest complete checkpoint (or ``checkpoint``); returns its manifest."""
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
    files, rows = [], []
    for rank in range(reader.world_size):
        name = f"sparse/rank-{rank:05d}.h5"
        rows.append(_write_sparse(tmp / name, reader, rank, dim, owner))
        files.append(_record(tmp, name, rows=rows[-1]))
    dense_names = _write_dense(tmp / "dense.h5", cfg, reader.dense(0))
    files.append(_record(tmp, "dense.h5"))
    manifest = _manifest(cfg, reader, files, dense_names, sum(rows))
    manifest = write_manifest(tmp / "manifest.json", manifest)  # with the sha256 of its own content
    os.replace(tmp, out)  # the export appears whole or not at all
    return manifest


def _write_sparse(path: Path, reader: CheckpointReader, rank: int, dim: int, owner: np.ndarray) -> int:
    """Rank ``rank``'s model columns, sorted by key."""
    parts = [(k, r[:, :dim + 1]) for k, r, _ in reader.rows(rank)]
    keys = np.concatenate([k for k, _ in parts]) if parts else np.zeros(0, np.uint64)
    weights = np.concatenate([w for _, w in parts]) if parts else np.zeros((0, dim + 1), np.float32)
    order = np.argsort(keys, kind="stable")
    with h5py.File(path, "w", **_H5) as f:
        f.attrs.update({"format": FORMAT, "format_version": FORMAT_VERSION, "rank": rank,
                        "world_size": reader.world_size, "dim": dim, "columns": f"w[{dim}] w1[1]"})
        # Contiguous (no chunks): a reader may map them by file offset.
        f.create_dataset("keys", data=keys[order], track_times=False)
        f.create_dataset("weights", data=np.ascontiguousarray(weights[order], dtype=np.float32), track_times=False)
        f.create_dataset("bucket_owner", data=owner, track_times=False)
    return int(keys.shape[0])


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
