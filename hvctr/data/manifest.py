"""The data directory's manifest.json (what ``python -m data_prep`` writes last): one reader for
data_prep's resume (a manifest of an unfinished run) and for everything that reads finished data
(the shard reader, the planner, preflight, the run identity)."""

from __future__ import annotations

import hashlib
import os

from hvctr.formats import FORMAT, SUPPORTED_VERSIONS
from hvctr.formats.textfile import read_json

MANIFEST_NAME = "manifest.json"


def read_manifest(path: str, *, complete: bool = True) -> dict | None:
    """The manifest at ``path``, checked to be a data_prep manifest of a version this reader
    takes. ``complete``: it must record a finished run (a missing file is an error); otherwise
    a missing file is None (data_prep's first session) and an unfinished run is returned as it is."""
    if not os.path.isfile(path):
        if not complete:
            return None
        data_dir = os.path.dirname(path) or "."
        raise ValueError(f"{path}: no data_prep manifest (is {data_dir} a data_prep output directory?)")
    try:
        m = read_json(path, "data manifest")
    except ValueError as e:  # not UTF-8, not JSON, unreadable: the file, line and column named
        hint = "" if complete else "; delete the directory to start over"
        raise ValueError(f"{e}{hint}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ValueError(f"{path}: not a data_prep manifest (format {m.get('format') if isinstance(m, dict) else None!r})")
    if m.get("format_version") not in SUPPORTED_VERSIONS:
        raise ValueError(f"{path}: format {m.get('format')!r} version {m.get('format_version')!r}; "
                         f"this reader takes {FORMAT!r} versions {SUPPORTED_VERSIONS}")
    if complete and m.get("state") != "complete":
        raise ValueError(f"{path}: data_prep has not finished (state {m.get('state')!r}); "
                         "run the same data_prep command again to complete it")
    return m


def load_manifest(data_dir: str) -> dict:
    """The manifest of a complete data_prep output directory."""
    m = read_manifest(os.path.join(data_dir, MANIFEST_NAME), complete=True)
    assert m is not None
    return m


def manifest_digest(data_dir: str) -> str:
    """sha256 of the manifest file's bytes (what a verification stamp is checked against)."""
    with open(os.path.join(data_dir, MANIFEST_NAME), "rb") as f:
        return "sha256:" + hashlib.sha256(f.read()).hexdigest()


def keys_per_row(data_dir: str, fields: int) -> float:
    """Keys a train row holds on average: ``fields`` (one a field) unless the data has multi-valued
    fields (format version 2: its shard records count their keys); ``fields`` where the manifest
    cannot be read (the reader names that problem where it matters)."""
    try:
        m = load_manifest(data_dir)
        records = m["shards"]["train"]
        if m.get("format_version") == 1 or not records or any("keys" not in r for r in records):
            return float(fields)
        return sum(int(r["keys"]) for r in records) / max(sum(int(r["rows"]) for r in records), 1)
    except (ValueError, KeyError, TypeError):
        return float(fields)
