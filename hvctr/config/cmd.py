"""``hvctr config``: the configuration a run would use (defaults < file < flags) as TOML, checked;
``--describe`` / ``--markdown``: every key's reference, from the comments in hvctr/config/__init__.py."""

from __future__ import annotations

from hvctr.config import load_config, to_toml


def add_arguments(p) -> None:
    p.add_argument("--config", help="TOML file (see slurm/configs/); --section.key=value flags override it")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--describe", action="store_true",
                      help="print every key with its default, type and meaning (the comments in hvctr/config/__init__.py)")
    what.add_argument("--markdown", action="store_true",
                      help="print docs/configuration.md, the same reference as Markdown (make docs writes it)")


def run(args, overrides: list[str]) -> int:
    cfg = load_config(args.config, overrides)  # checked even when only the reference is printed
    if args.describe or args.markdown:
        from hvctr.config import docs

        print(docs.describe() if args.describe else docs.markdown(), end="")
        return 0
    print(to_toml(cfg), end="")
    return 0
