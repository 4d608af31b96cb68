"""Checkpoint manifests carry the sha256 of their own content: damage that leaves valid JSON
is found, and the checkpoint is then treated as incomplete."""

import json

import pytest

from hvctr.checkpoint.format import MANIFEST_CHECKSUM, read_manifest, read_manifests, write_manifest


def _write(directory, seq, step):
    ck = directory / f"ckpt-{seq:06d}"
    ck.mkdir(parents=True)
    return write_manifest(ck / "manifest.json", {"seq": seq, "state": {"step": step}, "files": []})


def test_a_changed_value_that_keeps_the_json_valid_is_found(tmp_path, caplog):
    _write(tmp_path, 1, 8)
    sealed = _write(tmp_path, 2, 16)
    assert read_manifest(tmp_path / "ckpt-000002" / "manifest.json") == sealed
    path = tmp_path / "ckpt-000002" / "manifest.json"
    text = path.read_text()
    assert '"step": 16' in text
    path.write_text(text.replace('"step": 16', '"step": 17'))  # one flipped bit: '6' -> '7'
    with pytest.raises(ValueError, match="does not match its own checksum"):
        read_manifest(path)
    assert [m["seq"] for m in read_manifests(tmp_path)] == [1]  # checkpoint 2 is incomplete now
    assert "ignoring checkpoint manifest" in caplog.text and "ckpt-000002" in caplog.text


def test_manifests_from_before_the_checksum_still_load(tmp_path):
    ck = tmp_path / "ckpt-000003"
    ck.mkdir()
    (ck / "manifest.json").write_text(json.dumps({"seq": 3, "files": []}))
    assert [m["seq"] for m in read_manifests(tmp_path)] == [3]
    assert MANIFEST_CHECKSUM not in read_manifest(ck / "manifest.json")


def test_a_manifest_that_is_not_json_is_named(tmp_path):
    path = tmp_path / "manifest.json"
    path.write_text('{"seq": 4, "files": [')
    with pytest.raises(ValueError, match="not JSON"):
        read_manifest(path)


def test_a_checkpoint_on_the_other_kernel_path_says_bit_equality_is_not_kept(monkeypatch):
    from hvctr.kernels import native
    from hvctr.checkpoint.format import kernel_path_change
    assert native.kernel_path() == "native"
    assert kernel_path_change({"seq": 3, "kernels": "native"}) is None
    assert kernel_path_change({"seq": 3}) is None  # written before the field: nothing to compare
    note = kernel_path_change({"seq": 3, "kernels": "torch"}, "run/ckpt-000003")
    assert "run/ckpt-000003" in note and "HVCTR_NATIVE=0" in note and "bit-equality" in note
    monkeypatch.setenv("HVCTR_NATIVE", "0")
    assert kernel_path_change({"seq": 3, "kernels": "torch"}) is None
    assert "not kept" in kernel_path_change({"seq": 3, "kernels": "native"})
