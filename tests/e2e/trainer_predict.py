"""The trainer's own predictions for the rows of a Criteo file: the reference of the export test.

    mpirun -np W python -m mpi4py tests/e2e/trainer_predict.py --run-dir R --input F.tsv --batch-size B --out P.npy

Runs under mpirun with the run's world size: a Trainer rebuilt from the run's newest
checkpoint (as ``hvctr eval`` builds it), whose table answers read-only pulls for the keys of
rank 0's batches exactly as Trainer.evaluate does (stored rows, init rows, or the default
row under admission), and whose model computes the logits the same way, in batches of B
rows. The rows come from data_prep's parser, read here directly, not through hvctr score.
Scratch files (logs, working shards) go to a directory beside the output.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from hvctr.formats.lines import RowFormat, parse_block
from hvctr.config import load_config, replace
from hvctr.train.cmd import _start
from hvctr.train.trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--input", required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    run = Path(args.run_dir)
    scratch = Path(args.out).with_suffix(".scratch")
    cfg = load_config(run / "config.toml")
    cfg = replace(cfg, checkpoint={"dir": str(run / "checkpoints")}, storage={"shard_dir": str(scratch / "shards")})
    comm, device, _ = _start(cfg, scratch, "predict")
    trainer = Trainer(cfg, comm, device, scratch, resume=True)
    blk = parse_block(Path(args.input).read_bytes(), RowFormat.tsv())
    assert not blk.bad and trainer.state.step > 0
    dim, b = cfg.storage.dim, args.batch_size
    out = []
    trainer.model.eval()
    with torch.no_grad():
        for i, start in enumerate(range(0, blk.labels.shape[0], b)):
            keys = blk.keys[start:start + b] if comm.rank == 0 else np.zeros((0, blk.keys.shape[1]), np.uint64)
            uniq, inv = np.unique(keys.reshape(-1), return_inverse=True)
            # comm: alltoall pair of a read-only pull: every rank serves the keys it owns
            rows = trainer.table.read_only(uniq, name=f"ref.{i}")
            if comm.rank == 0:
                g = rows[torch.from_numpy(inv.reshape(keys.shape)).to(device)]
                dense = torch.from_numpy(blk.dense[start:start + b]).to(device)
                out.append(torch.sigmoid(trainer.model(dense, g[..., :dim], g[..., dim])).cpu().numpy())
    trainer.close()
    if comm.rank == 0:
        np.save(args.out, np.concatenate(out))
    comm.barrier()  # comm: barrier: the output exists before any rank exits
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
