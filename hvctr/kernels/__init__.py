"""The hot loops in C (``native``: hv_kernels.c and hv_row.h, built at install time by setup.py,
loaded with ctypes), the key deduplication every window, exchange and store runs (``unique``), and
new rows' initial values (``init_rows``, hvctr.formats.init_rows's bits).

    from hvctr.kernels import native, unique_in_order
    lib = native.lib()          # None under HVCTR_NATIVE=0: callers use torch/numpy
"""

from hvctr.kernels import native
from hvctr.kernels.init import init_rows
from hvctr.kernels.unique import hash_table_bits, unique_in_order

__all__ = ["hash_table_bits", "init_rows", "native", "unique_in_order"]
