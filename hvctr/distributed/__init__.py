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


def __getattr__(name: str) -> Any:
    if name in __all__:
        from hvctr.distributed import comm

        return getattr(comm, name)
    raise AttributeError(f"module 'hvctr.distributed' has no attribute {name!r}")
