"""Resealed manifests with a key missing or of another type, and hvctr score's own arguments and
output (issue 28, item 9).

Anyone can reseal a manifest (its checksum is of its own content), so a crafted one passes that
check and its readers then indexed it: KeyError and TypeError tracebacks. Now every key a reader
uses is checked first (hvctr.formats.fields): an export's manifest is refused by ``hvctr score``
naming the key; a checkpoint's is passed over with a warning naming the file and the key (export,
reshard and resume take the newest checkpoint before it that loads). Also: ``hvctr score --threads 0`` is one
message (a RuntimeError traceback from torch), and ``hvctr score ... | head`` ends quietly with
128 + SIGPIPE, as Unix tools do (it printed "--out None: cannot write it: Broken pipe", rc 2).

The export and checkpoints are made with the library's writers (tests.unit.test_offline_trust).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from data_prep.synth import generate
from hvctr.cli import main
from hvctr.formats.fields import Exact, OneOf, Opt, field_problem
from hvctr.offline.export import export
from hvctr.offline.reader import CheckpointReader
from hvctr.offline.score import ExportedModel
from tests.conftest import REPO
from tests.unit.test_offline_trust import KEYS, _propagate, exported, reseal, run_dir, write_checkpoint  # noqa: F401


def _drop(*path):
    def edit(m):
        for key in path[:-1]:
            m = m[key]
        del m[path[-1]]
    return edit


def _set(value, *path):
    def edit(m):
        for key in path[:-1]:
            m = m[key]
        m[path[-1]] = value
    return edit


@pytest.mark.parametrize("edit, problem", [
    (_drop("unseen_keys"), "key 'unseen_keys' is missing"),
    (_drop("model"), "key 'model' is missing"),
    (_drop("unseen_keys", "init_scale"), "key 'unseen_keys.init_scale' is missing"),
    (_set("8", "model", "dim"), "key 'model.dim': expected an integer, got '8' (a string)"),
    (_set("x", "batch_size"), "key 'batch_size': expected an integer, got 'x' (a string)"),
    (_set(5, "dense"), "key 'dense': expected a list, got 5 (an integer)"),
    (_set(7, "model", "hidden"), "key 'model.hidden': expected a list, got 7 (an integer)"),
    (_set("zzz", "model", "arch"),
     "key 'model.arch': 'zzz' is not one of ['dnn', 'deepfm', 'wdl', 'dlrm', 'dcnv2', 'dlrm-dcnv2']"),
    (_set([0], "model", "hidden"), "key 'model.hidden': 0 is below 1"),
    (_set("3", "model", "cross_rank"), "key 'model.cross_rank': expected an integer, got '3' (a string)"),
    (_set(-1, "model", "cross_rank"), "key 'model.cross_rank': -1 is below 0"),
    (_set([8, 0], "model", "bottom_mlp"), "key 'model.bottom_mlp': 0 is below 1"),
    (_set(float("nan"), "unseen_keys", "init_scale"),
     "key 'unseen_keys.init_scale': expected a finite number, got nan (a number)"),
])
def test_a_resealed_export_manifest_with_a_bad_key_is_refused_naming_it(exported, edit, problem):
    reseal(exported / "manifest.json", edit)
    with pytest.raises(ValueError) as e:
        ExportedModel(exported)
    assert str(e.value) == f"{exported / 'manifest.json'}: {problem}: damaged or not written by hvctr export"


@pytest.mark.parametrize("edit, problem", [
    (_drop("state"), "key 'state' is missing"),
    (_set("5", "state", "step"), "key 'state.step': expected an integer, got '5' (a string)"),
    (_set({"step": 1}, "state"), "key 'state.epoch' is missing"),
    (_set({**{k: 0 for k in ("epoch", "batch", "window", "step", "samples")}, "x": 1}, "state"),
     "key 'state': unknown key(s) ['x']; it holds ['batch', 'epoch', 'samples', 'step', 'window']"),
    (_set("zz", "kind"), "key 'kind': 'zz' is not one of ['base', 'delta']"),
    (_set([0, "1"], "chain"), "key 'chain[1]': expected an integer, got '1' (a string)"),
])
def test_a_resealed_checkpoint_manifest_with_a_bad_key_is_passed_over_naming_it(run_dir, tmp_path, caplog, edit,
                                                                               problem):
    ckdir = run_dir / "checkpoints"
    write_checkpoint(ckdir, 1, 2, KEYS)
    manifest = ckdir / "ckpt-000001" / "manifest.json"
    reseal(manifest, edit)
    assert CheckpointReader(run_dir).seq == 0  # the newest complete checkpoint before it
    export(run_dir, tmp_path / "E")  # and export goes on from it, where it raised KeyError('state')
    assert (f"{ckdir}: skipped checkpoint 1: {manifest}: {problem}: damaged or not written by hvctr; using "
            f"checkpoint 0") in caplog.text


def test_the_field_check_says_what_is_wrong_and_passes_what_is_right():
    spec = {"a": int, "b": [float], "c": Opt(str), "d": Exact({"x": bool}), "e": OneOf((1, 2))}
    assert field_problem({"a": 1, "b": [1, 2.5], "d": {"x": True}, "e": 2}, spec) == ""
    assert field_problem({"a": True, "b": [], "d": {"x": True}, "e": 1}, spec) == \
        "key 'a': expected an integer, got True (a boolean)"
    assert field_problem({"a": 1, "b": [float("inf")], "d": {"x": True}, "e": 1}, spec) == \
        "key 'b[0]': expected a finite number, got inf (a number)"
    assert field_problem({"a": 1, "b": [], "c": 3, "d": {"x": True}, "e": 1}, spec) == \
        "key 'c': expected a string, got 3 (an integer)"
    assert field_problem([1], spec) == "the record: expected an object, got [1] (a list)"


@pytest.fixture
def criteo_rows(tmp_path):
    path = tmp_path / "in.tsv"
    generate(20_000, seed=5, out=str(path))
    return path


def test_score_with_no_threads_is_one_message(exported, criteo_rows, capsys):
    for flag, value, want in (("--threads", "0", "--threads 0: the torch threads to score with, at least 1"),
                              ("--threads", "-2", "--threads -2: the torch threads to score with, at least 1"),
                              ("--batch-size", "-1", "--batch-size -1: rows per forward pass, at least 1")):
        rc = main(["score", "--model", str(exported), "--input", str(criteo_rows), flag, value])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith(f"hvctr score: error: {want}") and "Traceback" not in err, err


def test_score_into_a_pipe_closed_early_ends_quietly(exported, criteo_rows):
    r = subprocess.run(f"{sys.executable} -m hvctr score --model {exported} --input {criteo_rows} | head -3; "
                       f"echo rc=${{PIPESTATUS[0]}}", shell=True, executable="/bin/bash", cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    lines = r.stdout.splitlines()
    assert len(lines) == 4 and all(0 < float(p) < 1 for p in lines[:3]), r.stdout
    assert lines[3] == "rc=141" and r.stderr == "", r.stderr  # 128 + SIGPIPE, nothing printed


def test_an_export_from_before_dlrm_and_dcnv2_loads_without_their_keys(exported):
    """Exports written before model.bottom_mlp, cross_layers and cross_rank existed lack them;
    their archs do not read them, so the export loads as it did."""
    reseal(exported / "manifest.json", lambda m: [m["model"].pop(k) for k in ("bottom_mlp", "cross_layers",
                                                                              "cross_rank")])
    assert ExportedModel(exported).model is not None
