"""Optimisers: lazy Adam with per-row steps on embedding rows, and the dense Adam's state order.

- ``sparse_adam``: rows laid out as hvctr.formats.RowLayout (docs/storage.md), ``[w (D) | w1 | m (D+1) | v (D+1) | step]``
  float32; one Adam step on the rows a batch touched, each with its own step count (a row seen
  for the first time gets a bias-corrected first step, as Paddle's sparse Adam keeps beta
  powers per row). Also the batch's gather of rows and the sum of its gradients per row.
- ``sparse_rowwise``: the row-wise optimisers, and ``sparse_step``, one step of
  train.sparse_optimizer's optimiser on rows of its layout (adam above, rowwise_adam,
  rowwise_adagrad), and ``apply_step_to_rows``, its pure form for an owner applying gradients.
- ``dense``: the dense parameters use ``torch.optim.Adam`` (one global step); helpers read and
  write its moments in a fixed parameter order, for the k-step merger.
- the hot loops run as C kernels (``hvctr.kernels.native``, built at install time, loaded with
  ctypes); the torch code is the reference, and the path taken under ``HVCTR_NATIVE=0``.
"""

from hvctr.optim.dense import get_adam_states, set_adam_states, adam_step_count
from hvctr.optim.sparse_adam import (apply_adam_to_rows, batch_unique, gather_embeddings, gather_rows, row_width,
                                     dim_of_width, sparse_adam_step, sum_embedding_grads, sum_rows_grad)
from hvctr.optim.sparse_rowwise import apply_step_to_rows, sparse_step

__all__ = ["adam_step_count", "apply_adam_to_rows", "apply_step_to_rows", "batch_unique", "dim_of_width",
           "gather_embeddings", "gather_rows", "get_adam_states", "row_width", "set_adam_states", "sparse_adam_step",
           "sparse_step", "sum_embedding_grads", "sum_rows_grad"]
