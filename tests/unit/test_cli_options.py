"""One spelling per concept: overrides as --section.key=value or --section.key value, every
option documented, and the configuration reference generated from hvctr/config/__init__.py."""

from __future__ import annotations

import argparse

import pytest

import data_prep.__main__ as data_prep_main
from hvctr import cli
from hvctr.config import docs as config_docs
from tests.conftest import REPO


def test_override_value_may_follow_as_the_next_word():
    assert cli.join_override_values(["train", "--merge.every_k_steps", "8", "--storage.dim=4", "--resume"]) == \
        ["train", "--merge.every_k_steps=8", "--storage.dim=4", "--resume"]
    # argparse's own options (no dot) and a dotted flag with no value after it are left alone
    assert cli.join_override_values(["eval", "--run-dir", "runs/a.b", "--x.y"]) == ["eval", "--run-dir", "runs/a.b", "--x.y"]
    assert cli.join_override_values(["config", "--a.b", "--c.d=1"]) == ["config", "--a.b", "--c.d=1"]


def test_both_spellings_reach_the_config(capsys):
    assert cli.main(["config", "--merge.every_k_steps", "8", "--storage.dim=4"]) == 0
    out = capsys.readouterr().out
    assert "every_k_steps = 8" in out and "dim = 4" in out


def _options(parser: argparse.ArgumentParser, prefix: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, f"{prefix} {name}")
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield f"{prefix} {'/'.join(action.option_strings) or action.dest}", action.help


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_hvctr_option_has_help_text(command):
    missing = [name for name, help_ in _options(cli.build_parser(command), "hvctr") if not help_]
    assert not missing, f"options without help text: {missing}"


def test_every_data_prep_option_has_help_text():
    missing = [name for name, help_ in _options(data_prep_main.build_parser(), "data_prep") if not help_]
    assert not missing, f"options without help text: {missing}"


def test_every_config_key_is_described():
    keys = config_docs.keys()
    assert len(keys) > 50 and not [k.dotted for k in keys if not k.doc]
    text = config_docs.describe()
    for k in keys:
        assert f"  {k.dotted} = {k.default}" in text and k.doc in text
    # the doc is the field's comments: the line above and the trailing one
    by_key = {k.dotted: k for k in keys}
    assert by_key["storage.rows_per_rank"].doc.startswith("capacity of each rank's SSD shard, in rows; 0: sized")
    assert by_key["storage.dim"].doc == ("embedding dimension D; a row holds 3 * (D + 1) + 1 float32 with Adam "
                                         "(train.sparse_optimizer)")
    assert by_key["merge.mode"].choices[0] == ("kstep", by_key["merge.mode"].choices[0][1])
    assert by_key["metrics.eval_every_windows"].default == "0"


def test_config_describe_command(capsys):
    assert cli.main(["config", "--describe"]) == 0
    out = capsys.readouterr().out
    assert "[merge]" in out and "  merge.every_k_steps = 4" in out


def test_docs_configuration_md_is_current():
    path = REPO / "docs" / "configuration.md"
    assert path.read_text() == config_docs.markdown(), \
        "docs/configuration.md is out of date: run `make docs` (hvctr config --markdown > docs/configuration.md)"
