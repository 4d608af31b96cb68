"""The ``hvctr`` command: parses, then hands over to the module that owns the subcommand.

    mpirun -np 2 --bind-to none python -m mpi4py -m hvctr train --config run.toml --merge.every_k_steps=8

Each subcommand is a module with ``add_arguments(parser)`` and ``run(args, overrides)`` (an
exit code). Only the module of the command being run is imported, when its arguments are
added: ``hvctr config``, ``topo`` and ``plan`` never load torch (a test holds them to that).
Config overrides are the ``--section.key=value`` (or ``--section.key value``) flags argparse
did not consume.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Callable

import hvctr
from hvctr.distributed.world import AgreedError, abort_job, report_error

# name -> (module, one-line help). The module provides add_arguments(parser) and run(args, overrides).
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("hvctr.train.cmd", "train a CTR model (under mpirun/srun: python -m mpi4py -m hvctr train ...)"),
    "eval": ("hvctr.train.eval_cmd", "evaluate a run's newest checkpoint on its validation split"),
    "report": ("hvctr.train.report", "draw a run's report.png (loss, validation AUC/NE, samples/s, cache, time) and print its summary"),
    "simulate": ("hvctr.sim.cmd", "W ranks of hvctr train in one process, in turn (quality at many ranks on one machine)"),
    "config": ("hvctr.config.cmd", "print the resolved configuration (defaults < file < flags) as TOML"),
    "topo": ("hvctr.topo.cmd", "discover the node's hardware map (TOML), or print the placement plan of its ranks"),
    "plan": ("hvctr.plan.cmd", "how much SSD, host and GPU memory a table needs per rank, bytes and time per step"),
    "bench": ("bench.suite", "run every benchmark: BENCHMARKS.md and its plots (--quick: 5 min; --calibrate: rates for plan)"),
    "export": ("hvctr.offline.export", "write a run's model for serving: sorted key -> (w, w1) tables, dense tensors, manifest"),
    "score": ("hvctr.offline.score", "predict click probabilities for a Criteo file from an export alone"),
    "reshard": ("hvctr.offline.reshard", "rewrite a checkpoint for another number of ranks (moves whole buckets)"),
    "sweep": ("hvctr.sweep.cmd", "hyperparameter search over hvctr train (Optuna, an optional extra): run | report | best"),
}


def _command_module(name: str):
    module = COMMANDS[name][0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if module.startswith("bench.") and e.name in ("bench", module):
            raise SystemExit(f"hvctr {name}: the benchmarks (the bench/ package of the hvctr source checkout) "
                             f"are not installed: run it from a checkout, e.g. `python -m hvctr {name}`") from None
        raise


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``command``, that subcommand's arguments too (importing its module only)."""
    parser = argparse.ArgumentParser(
        prog="hvctr",
        description="Terabyte-scale CTR training: SSD/CPU/GPU embedding tiers, k-step Adam merging over Horovod.",
        epilog="Config overrides: any --section.key=value or --section.key value flag, e.g. "
               "--merge.every_k_steps=8 (`hvctr config --describe` lists every key).",
    )
    parser.add_argument("--version", action="version", version=f"hvctr {hvctr.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == command:
            _command_module(name).add_arguments(p)
    return parser


def join_override_values(argv: list[str]) -> list[str]:
    """``--section.key value`` -> ``--section.key=value``, so both spellings reach argparse as
    one token (a dotted name is never one of argparse's own options)."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        dotted = a.startswith("--") and "=" not in a and "." in a[2:]
        if dotted and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out.append(f"{a}={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def _requested_command(argv: list[str]) -> str | None:
    """The subcommand named in argv (its first word that is not an option), if any."""
    for a in argv:
        if not a.startswith("-"):
            return a if a in COMMANDS else None
    return None


def _horovod_shut_down(e: BaseException | None) -> bool:
    """Whether ``e`` or an exception it was raised from (the prefetch thread's, re-raised in
    the main thread) is Horovod's HorovodInternalError (horovod is not imported here)."""
    while e is not None:
        if type(e).__name__ == "HorovodInternalError":
            return True
        e = e.__cause__
    return False


EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a command SIGPIPE ended (`yes | head`)


def _discard_stdout() -> None:
    """stdout onto /dev/null: what is still buffered for the closed pipe goes nowhere, and the
    interpreter's flush at exit raises no second BrokenPipeError."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError):
        pass


def main(argv: list[str] | None = None) -> int:
    argv = join_override_values(sys.argv[1:] if argv is None else list(argv))
    parser = build_parser(_requested_command(argv))
    args, rest = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    bad = [a for a in rest if not (a.startswith("--") and "." in a.split("=", 1)[0] and "=" in a)]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)} (config overrides are --section.key=value "
                     f"or --section.key value)")
    run: Callable[[argparse.Namespace, list[str]], int] = _command_module(args.command).run
    try:
        return run(args, rest)
    except ValueError as e:  # user errors: bad config, bad input; a message, not a traceback
        agreed = isinstance(e, AgreedError)  # every rank raised it: rank 0 alone prints it
        if not agreed or e.report:  # another rank's error alone: once per job (report_error's gate)
            report_error(f"hvctr {args.command}: error: {e}")
        if not agreed:
            abort_job(2)  # this rank's error alone: other ranks may wait in a collective
        return 2
    except BrokenPipeError:  # stdout's reader stopped reading (`hvctr score ... | head`): quietly, as Unix tools
        _discard_stdout()
        return EXIT_BROKEN_PIPE
    except OSError as e:  # a file the command did not turn into a message of its own: its path, once
        if e.filename is None:
            raise
        report_error(f"hvctr {args.command}: error: {e.filename}: {e.strerror or e}")
        abort_job(2)
        return 2
    except Exception as e:
        if not _horovod_shut_down(e):
            raise
        # Horovod shut down under this rank's collective: another rank failed inside Horovod.
        report_error(f"hvctr {args.command}: error: Horovod shut down while this rank was in a collective "
                     f"({e.__class__.__name__}): another rank failed; its log (<run_dir>/logs) says why. "
                     f"--resume continues from the last complete checkpoint.", secondary=True)
        abort_job(3)
        return 3


if __name__ == "__main__":
    raise SystemExit(main())
