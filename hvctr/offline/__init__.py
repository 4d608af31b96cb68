"""Offline tools over saved models, run as single processes (no ranks, no Horovod).

Owns:
- ``reader``: one complete checkpoint read without ranks: its manifests, the checksums of the
  files of its chain, and each rank's final rows (base plus deltas, the newest value of a key).
- ``export`` (``hvctr export``): the serving model without optimiser state: per-rank HDF5
  tables key -> (w, w1) with sorted keys (float32, or compressed: ``--rows fp16 | int8``), the dense parameters as named tensors, the model's
  config and a manifest with checksums.
- ``keysort``: a rank's rows in key order, each key's newest copy along the chain, within a memory
  budget (sorted runs through a temporary file, then a merge): what export writes.
- ``score`` (``hvctr score``): a reference scorer that predicts from an export alone and
  gives the trainer's predictions, bit for bit.
- ``reshard`` (``hvctr reshard``): a checkpoint rewritten for another number of ranks by
  moving whole virtual buckets between rank files (a new bucket table).

::

    run dir / checkpoints / ckpt-N (W rank files: rows + optimiser state, dense, admission, TTL)
        |-- hvctr reshard --> ckpt-N for W2 ranks (same rows, buckets re-dealt) --> hvctr train --resume
        `-- hvctr export  --> sparse/rank-*.h5 (sorted keys, w|w1), dense.h5, manifest.json
                                  `-- hvctr score --input FILE.tsv --> one probability per row
"""
