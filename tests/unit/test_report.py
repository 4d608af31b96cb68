"""hvctr report: metrics.jsonl and summary.json -> report.png and the printed summary."""

import json

from hvctr import cli
from hvctr.train.report import read_metrics


def _run_dir(tmp_path, summary=True):
    run = tmp_path / "run"
    run.mkdir()
    lines = []
    for step in range(4, 41, 4):
        lines.append({"event": "progress", "step": step, "samples": step * 512, "samples_per_s": 1000.0 + step,
                      "loss": 0.6 - step / 400, "cache_hit_rate": step / 50, "working_set_rows": 10})
        if step % 16 == 0:
            lines.append({"event": "eval", "step": step, "samples": step * 512, "final": False, "auc": 0.6 + step / 400,
                          "logloss": 0.55, "ne": 0.95, "copc": 1.02})
    lines.append({"event": "progress", "step": 8, "samples": 8 * 512, "samples_per_s": 5.0, "loss": 0.1})  # resumed
    lines.append({"event": "eval", "step": 40, "samples": 40 * 512, "final": True, "auc": 0.71, "logloss": 0.5,
                  "ne": 0.9, "copc": 1.01})
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    if summary:
        (run / "summary.json").write_text(json.dumps({
            "eval": {"auc": 0.71, "logloss": 0.5, "ne": 0.9, "copc": 1.01, "count": 1000}, "samples_per_s": 1000.0,
            "samples": 20480, "steps": 40, "seconds": 20.0,
            "time_split_s": {"compute": 10.0, "pull": 3.0, "merge": 2.0, "io": 1.0},
            "dense_bytes_per_sample": 40.0, "sparse_bytes_per_sample": 600.0,
            "store": {"cache_hit_rate": 0.8, "shard_rows": 1000}}))
    return run


def test_records_sorted_and_a_rewritten_step_keeps_its_last_record(tmp_path):
    progress, evals = read_metrics(_run_dir(tmp_path))
    assert [r["step"] for r in progress] == list(range(4, 41, 4))
    assert next(r for r in progress if r["step"] == 8)["samples_per_s"] == 5.0
    assert [(r["step"], r["final"]) for r in evals] == [(16, False), (32, False), (40, True)]


def test_report_writes_the_picture_and_prints_the_summary(tmp_path, capsys):
    run = _run_dir(tmp_path)
    assert cli.main(["report", "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert (run / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (run / "report.png").stat().st_size > 20_000
    assert "AUC 0.7100" in out and "NE 0.9000" in out and "validation during training:" in out and "(final)" in out


def test_report_of_an_unfinished_run(tmp_path, capsys):
    run = _run_dir(tmp_path, summary=False)
    assert cli.main(["report", "--run-dir", str(run), "--out", str(tmp_path / "r.png")]) == 0
    assert (tmp_path / "r.png").is_file() and "has not finished" in capsys.readouterr().out
