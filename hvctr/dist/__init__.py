"""Everything that talks to other ranks: the only package that imports horovod or mpi4py.

Training-path collectives go through Horovod (it matches them by name, so a collective issued
from a helper thread cannot pair with the wrong one); mpi4py is never called from two threads.
Every call site of a collective carries a ``# comm:`` comment: ``grep -rn '# comm:' hvctr``
lists every point where ranks wait for each other.
"""

from hvctr.dist.comm import Comm, init_comm

__all__ = ["Comm", "init_comm"]
