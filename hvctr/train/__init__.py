"""Training: the window loop, the prefetch thread, the k-step merger, the run's reporting.

Owns the order of operations of one window (pull, k local steps, merge, push) and what the
user sees of a run. Models live in hvctr.models, optimiser kernels in hvctr.optim, the table
in hvctr.storage, collectives in hvctr.distributed; this package wires them together.
"""
