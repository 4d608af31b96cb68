"""bench.accuracy's rules, sizing and table (the runs themselves take minutes each: by hand)."""

import json

from bench.accuracy import mode_flags, parse_rules, render, rows_per_rank


def test_rules_and_modes_become_flags():
    assert parse_rules("defaults=;none=--merge.lr_scaling=none --merge.adam_scaling=none") == {
        "defaults": [], "none": ["--merge.lr_scaling=none", "--merge.adam_scaling=none"]}
    assert mode_flags("sync") == ["--merge.mode=sync"]
    assert mode_flags("8") == ["--merge.mode=kstep", "--merge.every_k_steps=8"]


def test_shard_size_follows_the_distinct_keys_and_w(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"totals": {"distinct_keys_estimate_total": 1_000_000}}))
    assert rows_per_rank(str(tmp_path), 1) == 1_600_000
    assert rows_per_rank(str(tmp_path), 16) == 100_000
    assert rows_per_rank(str(tmp_path), 4096) == 1 << 15  # never below a floor


def _r(how, w, mode, auc, batch=4096):
    return {"how": how, "data": "d", "batch": batch, "ranks": w, "mode": mode, "auc": auc, "logloss": 0.47}


def test_the_table_gives_each_gap_to_one_rank_of_the_same_data():
    results = {"sim|d|none|8|1": _r("sim", 1, "8", 0.7700), "sim|d|defaults|8|8": _r("sim", 8, "8", 0.7690),
               "real|d|defaults|8|8": _r("real", 8, "8", 0.7690), "sim|d|defaults|sync|8": _r("sim", 8, "sync", 0.7650)}
    text = render(results, "python -m bench.accuracy ...")
    rows = {line.split("|")[2].strip() + "/" + line.split("|")[3].strip() + "/" + line.split("|")[4].strip(): line
            for line in text.splitlines() if line.startswith("| d, B=4096")}
    assert "0.7690 (-0.0010), 0.4700" in rows["defaults/k=8/sim"]  # W = 1 of another rule: the same model
    assert "0.7690 (-0.0010)" in rows["defaults/k=8/real"]
    assert "0.7650 (-0.0050)" in rows["defaults/sync/sim"]  # at W = 1 sync and k-step are one rank's Adam
    assert "- defaults: the defaults" in text and "- none:" in text
