"""Everything that talks to other ranks: the only package that imports horovod or mpi4py.

Training-path collectives go through Horovod (it matches them by name, so a collective issued
from a helper thread cannot pair with the wrong one); mpi4py is never called from two threads.
Every call site of a collective carries a ``# comm:`` comment: ``grep -rn '# comm:' hvctr``
lists every point where ranks wait for each other, and every one of them runs under the
collective watchdog (``hvctr.distributed.watchdog``: a wait of ``train.stall_timeout_s`` ends the job).

``hvctr.distributed.world`` (mpi4py only) serves the checks before Horovod starts; ``Comm`` and
``init_comm`` load Horovod (and torch) on first use, not when the package is imported.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Comm", "init_comm"]


def init_comm(ranks_per_virtual_node: int = 0, stall_timeout_s: float = 0.0, program: str = "hvctr",
              backend: str | None = None) -> Any:
    """The job's communicator over ``backend`` (distributed.backend: "horovod" or "torch";
    None: HVCTR_BACKEND, else horovod): hvctr.distributed.comm.init_comm or
    hvctr.distributed.torch_comm.init_torch_comm. Only the chosen engine is imported."""
    import os

    backend = backend or os.environ.get("HVCTR_BACKEND") or "horovod"
    if backend == "torch":
        from hvctr.distributed.torch_comm import init_torch_comm

        return init_torch_comm(ranks_per_virtual_node, stall_timeout_s, program)
    if backend != "horovod":
        raise ValueError(f"config key 'distributed.backend': {backend!r} is not one of ['horovod', 'torch']")
    try:
        from hvctr.distributed import comm
    except ImportError as e:
        raise ValueError(f"distributed.backend = horovod, but Horovod cannot be imported ({e}): build it "
                         f"(make setup) or train with --distributed.backend=torch") from None
    return comm.init_comm(ranks_per_virtual_node, stall_timeout_s, program)


def __getattr__(name: str) -> Any:
    if name == "Comm":
        from hvctr.distributed import comm

        return comm.Comm
    raise AttributeError(f"module 'hvctr.distributed' has no attribute {name!r}")
