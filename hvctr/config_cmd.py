"""``hvctr config``: shows the configuration a run would use, and checks it."""

from __future__ import annotations

import argparse

from hvctr.config import load_config, to_toml


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file (see slurm/configs/)")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    print(to_toml(load_config(args.config, overrides)), end="")
    return 0
