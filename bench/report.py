"""BENCHMARKS.md is assembled from sections, one per benchmark; each replaces only its own.

    write_section("BENCHMARKS.md", "## Training", text)   # text starts with the same heading
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path


def write_section(path: str | Path, heading: str, text: str) -> None:
    """Replaces the section that starts with ``heading`` (a "## " line) or appends it."""
    path = Path(path)
    if not text.startswith(heading + "\n"):
        raise ValueError(f"section text must start with its heading {heading!r}")
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    start = old.find("\n" + heading + "\n")
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n"
    else:
        end = old.find("\n## ", start + 1 + len(heading))
        new = old[: start + 1] + text.rstrip("\n") + "\n" + (old[end:] if end >= 0 else "")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(new)
    os.replace(tmp, path)


def machine_line() -> str:
    """One line of machine facts for a benchmark's header."""
    try:
        model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                      if line.startswith("model name")), platform.processor())
    except OSError:
        model = platform.processor()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    load = os.getloadavg()[0]
    return (f"{os.cpu_count()} cpus ({model}), {mem:.0f} GiB, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, load average {load:.1f} at the start")


def data_set_specs(parser, specs: list[str]) -> list[tuple[int, Path]]:
    """``--data-set SEED=DIR`` values -> [(seed, directory)], each directory made; a bad one is
    the parser's error naming it."""
    out = []
    for spec in specs:
        seed, _, where = spec.partition("=")
        if not seed.isdigit() or not where:
            parser.error(f"--data-set {spec!r}: expected SEED=DIR")
        Path(where).mkdir(parents=True, exist_ok=True)
        out.append((int(seed), Path(where)))
    return out


def publish(text: str, t0: float, benchmarks: str, heading: str) -> None:
    """A benchmark's section with its wall time, printed and, where ``benchmarks`` names a
    markdown file, written into it under ``heading``."""
    text += f"\nWall time of the benchmark: {(time.time() - t0) / 60:.1f} min.\n"
    print(text)
    if benchmarks:
        write_section(benchmarks, heading, text)
