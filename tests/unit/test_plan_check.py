"""The predicted-vs-measured check's bookkeeping: windows, the measured step time, the verdicts."""

import json

import pytest

from bench.plan_check import measured, render, windows_of


def test_windows_of_a_run():
    assert windows_of(33, 8) == [8, 8, 8, 8, 1]
    assert windows_of(16, 8) == [8, 8]
    assert windows_of(5, 1) == [1] * 5


def _run_dir(tmp_path, records):
    (tmp_path / "summary.json").write_text(json.dumps({
        "steps": records[-1][0], "sparse_exchange_bytes": 10, "dense_merge_bytes": 20, "samples_per_s": 1.0,
        "time_split_s": {"compute": 1.0}}))
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"event": "progress", "step": s, "time": t}) + "\n" for s, t in records)
        + json.dumps({"event": "eval"}) + "\n")
    return tmp_path


def test_step_time_is_the_fastest_full_window_after_the_first(tmp_path):
    # windows of 8 ending at steps 8, 16, 24, 32 and a short one at 33 (after the end of the pass)
    m = measured(_run_dir(tmp_path, [(8, 100.0), (16, 101.6), (24, 108.0), (32, 112.0), (33, 115.0)]))
    assert m["window_step_s"] == pytest.approx([0.2, 0.8, 0.5])  # the last window is left out
    assert m["step_s"] == pytest.approx(0.2)  # a window slowed by load from elsewhere does not count
    assert m["median_step_s"] == pytest.approx(0.5)
    assert not m["last_only"]


def test_a_lone_window_is_timed_with_its_end_of_pass(tmp_path):
    m = measured(_run_dir(tmp_path, [(8, 10.0), (16, 14.0)]))
    assert m["step_s"] == pytest.approx(0.5) and m["last_only"] and m["last_steps"] == 8


def _result(ranks, meas_ms, pred_ms, sparse=(100.0, 105.0)):
    return {"ranks": ranks, "mode": "8", "oversubscribed": ranks > 2, "load": [1.0, 1.5],
            "measured": {"steps": 10, "sparse_bytes": sparse[0], "dense_bytes": 50.0, "step_s": meas_ms / 1e3},
            "predicted": {"sparse_bytes": sparse[1], "dense_bytes": 50.0, "step_s": pred_ms / 1e3}}


def test_render_applies_the_bounds():
    res = {"rows": 1000, "curve": "c", "rates_source": "r", "results": [
        _result(1, 100, 125), _result(2, 100, 135), _result(2, 100, 100, sparse=(100.0, 111.0)),
        _result(3, 100, 300)]}
    rows = [line for line in render(res, "cmd", "machine").splitlines() if line.startswith("| ") and "---" not in line]
    verdicts = [r.rstrip(" |").rsplit("| ", 1)[1] for r in rows[1:]]
    assert verdicts == ["yes", "NO", "NO", "bytes yes, time reported (oversubscribed)"]
    assert "+25.0%" in rows[1] and "+5.0%" in rows[1]
