"""The package diagram of docs/architecture.md, drawn from the code: every import statement of
every module (those inside functions included), folded to packages.

    python -m bench.architecture --out docs/architecture.png

The layers it shows are the ones tests/unit/test_layers.py holds the code to.
"""

from __future__ import annotations

import argparse
import ast
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOPS = ("hvctr", "data_prep", "bench")
# The layers, lowest first: a package imports only packages of a lower layer (tests/unit/test_layers.py
# holds the code to it, so there is no import circle and nothing imports upward). A new package
# gets a layer here before it is imported anywhere. The drawing puts layer 0 at the bottom.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("hvctr.formats", "hvctr.log", "hvctr.memcg", "hvctr.heap", "hvctr.determinism"),
    ("hvctr.config", "hvctr.kernels", "hvctr.data", "hvctr.metrics"),
    ("hvctr.distributed", "hvctr.models", "hvctr.optim", "hvctr.rundir", "hvctr.topo"),
    ("hvctr.storage", "hvctr.checkpoint"),
    ("hvctr.plan",),
    ("hvctr.train",),
    ("hvctr.sim", "hvctr.offline", "hvctr.sweep"),
    ("hvctr.cli",),
)
LAYER = {p: i for i, names in enumerate(LAYERS) for p in names}
# Outside the runtime: data_prep (beside layer 2: it takes formats, data and log) and the workshop.
OUTSIDE = {"data_prep": (0.0, 2), "bench": (9.0, 5)}


def _positions() -> dict[str, tuple[float, int]]:
    """(column, row) of every box, row 0 at the top: the runtime's layers from the top down."""
    top = len(LAYERS) - 1
    pos: dict[str, tuple[float, int]] = {}
    for i, names in enumerate(LAYERS):
        width = 1.9 * (len(names) - 1)
        for j, p in enumerate(names):
            pos[p] = (4.5 - width / 2 + 1.9 * j, top - i)
    for p, (c, layer) in OUTSIDE.items():
        pos[p] = (c, top - layer)
    return pos


POSITION = _positions()
ROLE = {
    "hvctr.cli": "the hvctr command", "hvctr.sim": "W ranks in one process", "data_prep": "raw logs -> shards",
    "hvctr.train": "the window loop", "hvctr.offline": "export, score, reshard", "hvctr.plan": "sizes and times",
    "hvctr.sweep": "hyperparameter search", "hvctr.topo": "hardware maps", "bench": "the workshop",
    "hvctr.models": "DNN, DeepFM, W&D", "hvctr.optim": "sparse + dense Adam", "hvctr.storage": "SSD / cache / exchange",
    "hvctr.checkpoint": "base + deltas, manifests", "hvctr.distributed": "Horovod, MPI, watchdog",
    "hvctr.rundir": "run dir: lock, identity", "hvctr.kernels": "C hot loops", "hvctr.config": "run config, resolved",
    "hvctr.data": "data shards, manifest", "hvctr.metrics": "AUC, logloss, COPC", "hvctr.log": "rank-aware logs", "hvctr.memcg": "the job's memory cgroup", "hvctr.heap": "glibc malloc settings", "hvctr.determinism": "deterministic torch",
    "hvctr.formats": "data, key, row (the leaf)",
}


def imports_of(path: Path, root: Path = REPO) -> set[str]:
    """Every module an import in the file names (absolute; relative imports resolved against the
    file's place under ``root``); ``from a import b`` names both a and a.b (b may be a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = path.relative_to(root).with_suffix("").parts[:-1]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = list(package[:len(package) - node.level + 1]) if node.level else []
            base = ".".join(parts + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def module_imports(top: str, root: Path = REPO) -> dict[str, set[str]]:
    """{file relative to ``root`` (the checkout): modules it imports} for every module under ``top``."""
    return {str(p.relative_to(root)): imports_of(p, root) for p in sorted((root / top).rglob("*.py"))}


def package_of(name: str) -> str | None:
    """The box a module belongs to: hvctr's subpackages, hvctr.cli (with __main__), or a top package."""
    parts = name.replace("/", ".").removesuffix(".py").split(".")
    if parts[0] not in TOPS:
        return None
    if parts[0] != "hvctr":
        return parts[0]
    if len(parts) == 1:
        return None  # the package itself: its version string
    box = "hvctr." + parts[1]
    return "hvctr.cli" if box in ("hvctr.__main__", "hvctr.__init__") else box


def package_edges(root: Path = REPO) -> Counter:
    """(importer, imported) package pairs, counted by import statements' names."""
    edges: Counter = Counter()
    for top in TOPS:
        for f, names in module_imports(top, root).items():
            a = package_of(f)
            for m in names:
                b = package_of(m)
                if a and b and a != b:
                    edges[(a, b)] += 1
    return edges


def dispatch_edges() -> list[tuple[str, str]]:
    """The cli's commands, named as strings and imported only when run (hvctr.cli.COMMANDS)."""
    from hvctr.cli import COMMANDS

    return sorted({("hvctr.cli", package_of(module)) for module, _ in COMMANDS.values()} - {("hvctr.cli", "hvctr.cli")})


def draw(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(14, 8))
    xy = {p: (c * 2.1, -r * 1.45) for p, (c, r) in POSITION.items()}
    edges, dispatch = package_edges(), dispatch_edges()
    missing = sorted({p for e in list(edges) + dispatch for p in e} - set(xy))
    if missing:
        raise SystemExit(f"packages without a place in the drawing: {missing}: add them to POSITION")
    for (a, b), n in sorted(edges.items()):
        (x0, y0), (x1, y1) = xy[a], xy[b]
        ax.annotate("", xy=(x1, y1 + 0.28), xytext=(x0, y0 - 0.28),
                    arrowprops=dict(arrowstyle="->", color="#555", lw=0.6 + 0.25 * min(n, 12) ** 0.5,
                                    alpha=0.75, shrinkA=4, shrinkB=4, connectionstyle="arc3,rad=0.06"))
    for a, b in dispatch:
        (x0, y0), (x1, y1) = xy[a], xy[b]
        ax.annotate("", xy=(x1, y1 + 0.28), xytext=(x0, y0 - 0.28),
                    arrowprops=dict(arrowstyle="->", color="#1f77b4", lw=1.0, ls="--", shrinkA=4, shrinkB=4))
    for i in range(len(LAYERS)):
        ax.text(-1.1, -(len(LAYERS) - 1 - i) * 1.45, f"layer {i}", ha="left", va="center", fontsize=7, color="#888")
    for p, (x, y) in xy.items():
        colour = "#fdebd0" if p in ("bench", "data_prep") else ("#d5f5e3" if p == "hvctr.formats" else "#eaf2f8")
        ax.text(x, y, f"{p}\n{ROLE[p]}", ha="center", va="center", fontsize=8.5,
                bbox=dict(boxstyle="round,pad=0.4", fc=colour, ec="#444"))
    ax.set_xlim(-1.2, 22.0)
    ax.set_ylim(-len(LAYERS) * 1.45 + 0.6, 0.8)
    ax.axis("off")
    ax.set_title("hvctr packages: an arrow is an import (thicker: more of them); dashed: the cli dispatches "
                 "by name, importing only the command run", fontsize=9)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.architecture", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/architecture.png")
    args = p.parse_args(argv)
    draw(Path(args.out))
    for (a, b), n in sorted(package_edges().items()):
        print(f"{a} -> {b} ({n})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
