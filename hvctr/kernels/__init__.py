"""The hot loops in C (``native``: built once per machine, loaded with ctypes) and the key
deduplication every window, exchange and store runs (``unique``).

    from hvctr.kernels import native, unique_in_order
    lib = native.lib()          # None where no compiler is found: callers use torch/numpy
"""

from hvctr.kernels import native
from hvctr.kernels.unique import hash_table_bits, unique_in_order

__all__ = ["hash_table_bits", "native", "unique_in_order"]
