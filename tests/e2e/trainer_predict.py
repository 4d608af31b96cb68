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

from hvctr.data.bags import Bags
from hvctr.formats.lines import RowFormat, parse_block
from hvctr.optim.pooling import embed_batch
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
    mv = trainer.data.multi_valued  # the training data's multi-valued fields: parsed as data_prep parsed them
    blk = parse_block(Path(args.input).read_bytes(), RowFormat.tsv(), multi_valued=tuple(mv["fields"]) if mv else (),
                      value_sep=mv["separator"].encode() if mv else b",")
    assert not blk.bad and trainer.state.step > 0
    bags = Bags(blk.keys, blk.lengths) if blk.lengths is not None else None
    dim, b = cfg.storage.dim, args.batch_size
    out = []
    trainer.model.eval()
    with torch.no_grad():
        for i, start in enumerate(range(0, blk.labels.shape[0], b)):
            stop = min(start + b, blk.labels.shape[0]) if comm.rank == 0 else start
            if bags is not None:  # the pooled bags of the batch's rows (hvctr.optim.pooling)
                keys = bags.rows_slice(start, stop)
                uniq, inv = np.unique(keys.values, return_inverse=True)
            else:
                keys = blk.keys[start:stop]
                uniq, inv = np.unique(keys.reshape(-1), return_inverse=True)
            # comm: alltoall pair of a read-only pull: every rank serves the keys it owns
            rows = trainer.table.read_only(uniq, name=f"ref.{i}")
            if comm.rank == 0:
                dense = torch.from_numpy(blk.dense[start:stop]).to(device)
                if bags is not None:
                    emb, w1 = embed_batch(rows, keys.with_values(inv), trainer.pooling, dim)
                else:
                    g = rows[torch.from_numpy(inv.reshape(keys.shape)).to(device)]
                    emb, w1 = g[..., :dim], g[..., dim]
                out.append(torch.sigmoid(trainer.model(dense, emb, w1)).cpu().numpy())
    trainer.close()
    if comm.rank == 0:
        np.save(args.out, np.concatenate(out))
    comm.barrier()  # comm: barrier: the output exists before any rank exits
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
