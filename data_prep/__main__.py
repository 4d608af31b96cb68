"""``python -m data_prep COMMAND``: criteo (raw logs -> data shards), synth (synthetic logs)."""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.command is None:
        parser.print_help()
        return 2
    return importlib.import_module(COMMANDS[args.command][0]).run(args)


if __name__ == "__main__":
    raise SystemExit(main())
