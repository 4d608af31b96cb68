"""hvctr's C kernels, built at install time (`pip install .`, `pip install -e .`); the rest of
the metadata is in setup.cfg.

hvctr/kernels/hv_kernels.c (with hv_row.h, the row layout generated from hvctr.formats) becomes
a plain shared library, hvctr/kernels/_hv_kernels*.so, that hvctr.kernels.native loads with
ctypes: nothing is compiled at run time. Flags: -O3 -Wall; -ffp-contract=off and no -march, so
every build rounds the same way whatever machine builds it. CC and CFLAGS are honoured as
setuptools honours them.

A failed build fails the install, naming the two ways on: a C compiler, or HVCTR_NATIVE=0 at
install time, which installs without the kernels (every run then needs HVCTR_NATIVE=0 and takes
the slower torch path).
"""

import hashlib
import os
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
KERNELS = Path("hvctr") / "kernels"
SOURCES = ("hv_kernels.c", "hv_row.h")
CFLAGS = ["-O3", "-Wall", "-std=c99", "-ffp-contract=off", "-fno-math-errno"]


def source_sha256() -> str:
    """sha256 of hv_kernels.c, a NUL, hv_row.h: what the library reports and native.py checks."""
    h = hashlib.sha256()
    for i, name in enumerate(SOURCES):
        h.update(b"\0" if i else b"")
        h.update((HERE / KERNELS / name).read_bytes())
    return h.hexdigest()


class BuildKernels(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as e:  # CompileError, LinkError, a missing compiler
            raise SystemExit(
                f"hvctr: building the C kernels ({KERNELS / SOURCES[0]}) failed: {e}\n"
                f"hvctr: install a C compiler (CC names it), or install without the kernels with "
                f"HVCTR_NATIVE=0 pip install ... and run with HVCTR_NATIVE=0 (the torch path, about 4x "
                f"slower on the sparse path)") from e

    def get_export_symbols(self, ext):  # a ctypes library, not a Python module: no PyInit_
        return ext.export_symbols

    def copy_file(self, infile, outfile, *args, **kwargs):
        # An in-place build (pip install -e .) replaces the library, never rewrites it: running
        # processes keep the file they mapped (rewriting it under them is a SIGBUS).
        if str(outfile).endswith(".so") and os.path.isfile(outfile):
            os.unlink(outfile)
        return super().copy_file(infile, outfile, *args, **kwargs)


native = os.environ.get("HVCTR_NATIVE", "1") != "0"
ext_modules = [
    Extension(
        "hvctr.kernels._hv_kernels",
        sources=[str(KERNELS / SOURCES[0])],
        depends=[str(KERNELS / s) for s in SOURCES],
        include_dirs=[str(KERNELS)],
        define_macros=[("HV_SOURCE_SHA256", f'"{source_sha256()}"')],
        extra_compile_args=CFLAGS + ["-pthread"],
        extra_link_args=["-pthread"],
        libraries=["m"],
    )
] if native else []

setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildKernels})
