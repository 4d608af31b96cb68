"""data_prep: offline preprocessing, run as MPI jobs before training.

    python -m data_prep criteo --input day_0.gz day_1.gz --out data/criteo --shards 64
    mpirun -np 16 --bind-to none python -m mpi4py -m data_prep criteo --input train.txt --out data/kaggle --shards 64
    python -m data_prep synth --rows 2000000 --seed 1 --out synth.tsv --truth-out synth.truth

It turns raw click logs into the trainer's data shards. The formats themselves (field
names, the key rule, the shard layout, the line parser and input sources) live in
``hvctr.formats``, the one module of hvctr that data_prep imports:
- ``criteo``, ``pieces``: the preprocessing job (byte ranges or whole gzip files per process,
  intermediate pieces, S output shards, a manifest that makes it resumable).
- ``synth``: a generator of Criteo-format TSV from a known logistic model with interactions.
- ``mpi``: the only module here that imports mpi4py; a single process runs without it.

The trainer reads the output through ``hvctr.data.reader``.
"""

__version__ = "0.1.0"
