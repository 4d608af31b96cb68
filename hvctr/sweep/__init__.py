"""Hyperparameter search as batch jobs: ``hvctr sweep run | report | best``, on Optuna.

Owns:
- ``space``: the search space (TOML: ranges or choices for any config key), checked against
  hvctr.config so a typo fails before any trial runs;
- ``study``: the study directory on the shared file system: Optuna's journal (a file, no
  database server), the settings every worker of the study must share, the worker lock, the
  leases that tell a live trial from one whose worker died;
- ``worker`` (``hvctr sweep run``): asks for a trial, trains it as a normal hvctr run
  directory in chunks of ``train.max_steps`` (each chunk resumes the last and ends with a
  validation pass), reports each validation AUC to the pruner, stops a trial it prunes;
- ``report`` (``hvctr sweep report``, ``hvctr sweep best``): the table of trials, PNG plots,
  the best trial's config for the full training stage.

::

    S.toml --> hvctr sweep run (one worker per process or Slurm array task, any number)
                 |  lock: reap dead workers' trials (FAIL + a retry that resumes their run dir), ask
                 |  trial N: DIR/trials/trial-NNNN = an hvctr run directory
                 |    hvctr train --train.max_steps=s1 --resume -> summary.json: AUC -> report(1)
                 |    ... (pruned: stop)                          ... AUC -> report(E) -> tell
                 v
    DIR/journal.log (Optuna JournalStorage) --> hvctr sweep report (table, PNG) / best --out C.toml
                                                                        `--> hvctr train --config C.toml

Optuna is an optional extra (``pip install 'hvctr[sweep]'``): nothing else in hvctr imports it.
"""
