"""Progress lines and metrics.jsonl: the ETA, the date, validation records."""

import json
import logging

from hvctr.train.meter import Meter, eta_seconds, format_eta


def test_eta_from_the_mean_rate_so_far():
    assert eta_seconds(10, 30, 20.0) == 60.0  # 2 s a step, 30 steps left
    assert eta_seconds(0, 30, 5.0) is None and eta_seconds(5, 30, 0.0) is None


def test_eta_names_the_date_and_time_it_ends():
    now = 1_796_000_000.0  # a fixed instant; the text is local time, as the log's stamps
    import datetime
    end = datetime.datetime.fromtimestamp(now + 3725)
    assert format_eta(3725, now=now) == f"eta 1:02:05 ({end:%Y-%m-%d %H:%M})"
    assert format_eta(None) == "eta -"


def test_progress_and_eval_records(tmp_path, caplog):
    m = Meter(0, tmp_path / "metrics.jsonl", log_every_steps=1, batch_size_per_rank=4, world_size=2)
    m.start(10)  # a resumed run: rates count from step 10
    m.add_loss(0.5)
    with caplog.at_level(logging.INFO, logger="hvctr"):
        m.maybe_log(12, 20, {"cache_hit_rate": 0.5, "working_set_rows": 7, "merge_ms": 1.0})
        m.log_eval(12, 96, {"auc": 0.7, "logloss": 0.45, "ne": 0.9, "copc": 1.1}, 0.25)
    m.exclude(2.0)
    assert m.excluded_s == 2.0
    m.close()
    progress, ev = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert progress["event"] == "progress" and progress["step"] == 12 and progress["eta_s"] >= 0
    assert ev == {**ev, "event": "eval", "split": "valid", "step": 12, "samples": 96, "final": False, "ne": 0.9}
    assert "eta " in caplog.text and "NE 0.9000" in caplog.text


def test_tensorboard_is_an_optional_extra(tmp_path):
    import importlib.util

    import pytest

    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(ValueError, match=r"metrics.tensorboard.*pip install 'hvctr\[tensorboard\]'"):
            Meter(0, tmp_path / "m.jsonl", 1, 4, 2, tensorboard_dir=tmp_path / "tb")
        Meter(1, None, 1, 4, 2, tensorboard_dir=tmp_path / "tb").close()  # other ranks never open it
        return
    m = Meter(0, tmp_path / "m.jsonl", 1, 4, 2, tensorboard_dir=tmp_path / "tb")
    m.add_loss(0.5)
    m.maybe_log(1, 2, {"cache_hit_rate": 0.5})
    m.log_eval(1, 8, {"auc": 0.7, "logloss": 0.45, "ne": 0.9, "copc": 1.1}, 0.1)
    m.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
