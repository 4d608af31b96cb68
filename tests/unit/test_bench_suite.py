"""``hvctr bench``'s argument handling, section order and plots (the suite itself is not run:
it takes minutes; ``hvctr bench --quick`` is run by hand)."""

import pytest

from bench import plots as bench_plots

from bench import suite as bench_suite
from hvctr.cli import main


def test_dry_run_lists_every_part_in_order(capsys):
    assert main(["bench", "--dry-run", "--work-dir", "/tmp/w"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == list(bench_suite.PARTS)
    assert "-m bench.train --work-dir /tmp/w/training" in out[4]


def test_quick_uses_the_quick_arguments(capsys):
    assert main(["bench", "--quick", "--dry-run", "--only", "training,planner", "--work-dir", "/tmp/w"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and "--quick" in out[0] and "--ranks 1,2" in out[1]


def test_skip_and_unknown_parts(capsys):
    assert bench_suite.selected("", "placement,sparse") == ["preprocessing", "store", "training", "planner"]
    assert main(["bench", "--only", "trainig", "--dry-run"]) == 2
    assert "unknown benchmark part(s) ['trainig']" in capsys.readouterr().err


def test_calibrate_dry_run_names_the_rates_file(capsys, tmp_path):
    assert main(["bench", "--calibrate", "--dry-run", "--rates", str(tmp_path / "r.toml")]) == 0
    assert str(tmp_path / "r.toml") in capsys.readouterr().out


def test_sections_are_put_in_the_suite_order(tmp_path):
    md = tmp_path / "B.md"
    md.write_text("# Benchmarks\n\n## Plots\n\np\n\n## Other\n\no\n\n## Training\n\nt\n\n## Preprocessing\n\nx\n")
    bench_suite.order_sections(md)
    heads = [line for line in md.read_text().splitlines() if line.startswith("## ")]
    assert heads == ["## Preprocessing", "## Training", "## Plots", "## Other"]
    assert md.read_text().startswith("# Benchmarks\n\n## Preprocessing\n\nx\n")


def _run(system, sps, auc, flags, split=None):
    return {"system": system, "samples_per_s": sps, "auc": auc, "flags": flags,
            "time_split_s": split or {"compute": 5.0, "pull": 1.0, "merge": 0.5, "io": 0.1}}


def test_plots_are_written(tmp_path):
    train = {"rows": 1000, "bayes_auc": 0.8, "rounds": [[
        _run("hvctr_sync", 50.0, 0.77, ["--merge.mode=sync"]), _run("hvctr_k8", 60.0, 0.76, ["--merge.every_k_steps=8"]),
        {"system": "pytorch_plain", "samples_per_s": 55.0, "auc": 0.77},
        {"system": "mlp_ceiling", "samples_per_s": 90.0, "auc": None}]],
        "sweep": [_run(f"hvctr_k{k}", 50.0 + k, 0.77 - k / 1000, [f"--merge.every_k_steps={k}"]) for k in (1, 4, 16)]}
    check = {"results": [{"ranks": 2, "mode": m, "measured": {"steps": 10, "step_s": 0.1,
                                                                    "time_split_s": {"compute": 1.0, "pull": 0.2}},
                          "predicted": {"split_s": {"compute": 0.1, "pull": 0.02, "merge": 0.01, "prep": 0.0}}}
                         for m in ("sync", "8")]}
    bench_plots.plot_k_sweep(train, tmp_path / "k.png")
    bench_plots.plot_time_split(train, check, tmp_path / "t.png")
    policy = [{"cache_frac": f, "lru": f, "lfu": f + 0.1, "static_top_keys": f + 0.2} for f in (0.01, 0.1)]
    bench_plots.plot_cache_hits(policy, [(0.01, 0.3), (0.1, 0.6)], 1000, tmp_path / "c.png")
    for name in ("k.png", "t.png", "c.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv", [["bench", "--quick", "--calibrate", "--dry-run"], ["bench", "--dry-run"]])
def test_arguments_parse(argv, capsys):
    assert main(argv) == 0


def test_plots_only_needs_the_results_directory(capsys):
    assert main(["bench", "--plots-only"]) == 2
    assert "--plots-only needs --work-dir" in capsys.readouterr().err
