"""``python -m data_prep COMMAND``: criteo (raw logs -> data shards), synth (synthetic logs)."""

from __future__ import annotations

import argparse
import ctypes
import importlib
import sys

import data_prep

# name -> (module, one-line help). The module provides add_arguments(parser) and run(args) -> int.
COMMANDS: dict[str, tuple[str, str]] = {
    "criteo": ("data_prep.criteo", "Criteo TSV / DeepCTR CSV -> HDF5 data shards and manifest.json"),
    "synth": ("data_prep.synth", "write Criteo-format TSV from a known logistic model, with the truth"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m data_prep", description=data_prep.__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"data_prep {data_prep.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        importlib.import_module(module).add_arguments(p)
    return parser


def keep_freed_memory() -> None:
    """Asks glibc to keep freed memory instead of handing it back to the kernel.

    By default every large numpy temporary is a fresh mmap whose pages fault in again (and a
    small heap is trimmed back): about a fifth of this job's CPU time on the 2-core machine
    type. Blocks up to 32 MiB (glibc's cap for this setting) then come from a heap that is not
    trimmed below 1 GiB. Harmless where glibc is not the allocator: the call is skipped."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD; setting it also ends its dynamic growth
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD (alone it would make things worse)
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    keep_freed_memory()
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.command is None:
        parser.print_help()
        return 2
    return importlib.import_module(COMMANDS[args.command][0]).run(args)


if __name__ == "__main__":
    raise SystemExit(main())
