"""What each config key means, read from the comments beside its field in hvctr/config/__init__.py.

The comments in hvctr/config/__init__.py are the one place a key is documented: the line comment after
a field and the comment lines right above it. This module reads them back, so that
``hvctr config --describe`` (each key, its default and its doc) and docs/configuration.md
(``hvctr config --markdown``, checked by tests/unit/test_cli_options.py) say the same.

    describe()        # text, one block per key
    markdown()        # the whole of docs/configuration.md
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import io
import tokenize
import typing

from hvctr import config as _config

# One line per section: what it configures and which component receives it.
SECTION_DOCS = {
    "topology": "Where each rank runs: the hardware map, CPU and memory binding, threads (hvctr.topo).",
    "storage": "The embedding table: the SSD shard, the CPU cache, admission and eviction of keys (hvctr.storage).",
    "merge": "How ranks combine their models: k-step model merging or synchronous Adam, and the rules that "
             "keep accuracy at many ranks (hvctr.train.merger, hvctr.train.lr; docs/merging.md).",
    "model": "The network on top of the embeddings (hvctr.models).",
    "data": "The data_prep output to read, and the batch (hvctr.train.feed).",
    "train": "The run: its directory, epochs, optimiser, device, time-outs (hvctr.train).",
    "checkpoint": "When checkpoints are written and how many are kept (hvctr.checkpoint.format).",
    "metrics": "Progress lines, metrics.jsonl and validation during training (hvctr.train.meter, hvctr.metrics).",
}

HEADER = """# Configuration reference

Generated from the comments in `hvctr/config/__init__.py` by `hvctr config --markdown > docs/configuration.md`
(`make docs`); do not edit by hand: `tests/unit/test_cli_options.py` fails when it is out of date.
`hvctr config --describe` prints the same on a terminal.

A run's configuration is one TOML file of `[section]` tables (presets: `slurm/configs/`), and
flags that override it on any `hvctr` command, spelled `--section.key=value` or
`--section.key value`. Precedence: flags > file > the defaults below. An unknown section or key,
or a value of the wrong type, is an error that lists what is valid. `hvctr config --config F
[flags]` prints the resolved configuration; `hvctr train` writes it to `<run_dir>/config.toml`.
"""


def _comments(cls: type) -> dict[str, str]:
    """{name: doc} for the assignments in ``cls``'s body, from the comment lines right above
    each and its trailing comment."""
    source = inspect.getsource(cls)
    by_line: dict[int, list[tokenize.TokenInfo]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            by_line.setdefault(tok.start[0], []).append(tok)
    docs: dict[str, str] = {}
    above: list[str] = []
    for n, line in enumerate(source.splitlines(), start=1):
        toks = by_line.get(n, [])
        if not toks:  # a blank line ends a comment block that belonged to nothing
            above = []
            continue
        if toks[0].type == tokenize.COMMENT:
            above.append(toks[0].string.lstrip("#").strip())
            continue
        if toks[0].type == tokenize.NAME and len(toks) > 1 and toks[1].string in (":", "="):
            trailing = [t.string.lstrip("#").strip() for t in toks if t.type == tokenize.COMMENT]
            docs[toks[0].string] = " ".join(above + trailing).strip()
        above = []
    return docs


def _sections() -> dict[str, type]:
    return typing.get_type_hints(_config.Config)


def _type_name(typ: typing.Any) -> str:
    if isinstance(typ, type) and issubclass(typ, enum.Enum):
        return "one of " + " | ".join(m.value for m in typ)
    if typing.get_origin(typ) is tuple:
        return f"list of {typing.get_args(typ)[0].__name__}"
    return {int: "integer", float: "number", bool: "true | false", str: "string"}.get(typ, str(typ))


def _choices(typ: typing.Any) -> list[tuple[str, str]]:
    """(value, doc) of an enum's members; empty for other types."""
    if not (isinstance(typ, type) and issubclass(typ, enum.Enum)):
        return []
    docs = _comments(typ)
    return [(m.value, docs.get(m.name, "")) for m in typ]


def _default(value: typing.Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, tuple):
        value = list(value)
    return _config._toml_value(value)


@dataclasses.dataclass(frozen=True)
class Key:
    section: str
    name: str
    type: str
    default: str
    doc: str
    choices: list[tuple[str, str]]

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"


def keys() -> list[Key]:
    """Every config key, in the order of hvctr/config/__init__.py, with its type, default and doc."""
    out = []
    for section, cls in _sections().items():
        docs, types, defaults = _comments(cls), typing.get_type_hints(cls), cls()
        for f in dataclasses.fields(cls):
            out.append(Key(section, f.name, _type_name(types[f.name]), _default(getattr(defaults, f.name)),
                           docs.get(f.name, ""), _choices(types[f.name])))
    return out


def describe() -> str:
    """Text for a terminal: each section's line, then each key with default, type and doc."""
    lines: list[str] = []
    current = ""
    for k in keys():
        if k.section != current:
            current = k.section
            lines += ["" if lines else None, f"[{k.section}]  {SECTION_DOCS.get(k.section, '')}"]
            lines = [x for x in lines if x is not None]
        lines.append(f"  {k.dotted} = {k.default}    ({k.type})")
        if k.doc:
            lines.append(f"      {k.doc}")
        lines += [f"      {value}: {doc}" for value, doc in k.choices if doc]
    return "\n".join(lines) + "\n"


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """docs/configuration.md: the header, then one table per section."""
    parts = [HEADER]
    current = ""
    for k in keys():
        if k.section != current:
            current = k.section
            parts += [f"\n## [{k.section}]\n", SECTION_DOCS.get(k.section, ""), "",
                      "| key | default | type | meaning |", "|---|---|---|---|"]
        doc = k.doc + "".join(f"<br>`{v}`: {d}" for v, d in k.choices if d)
        parts.append(f"| `{k.dotted}` | `{_md(k.default)}` | {_md(k.type)} | {_md(doc)} |")
    return "\n".join(parts) + "\n"
