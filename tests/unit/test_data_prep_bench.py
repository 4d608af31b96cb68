"""bench.preprocess writes only its own section of BENCHMARKS.md."""

from bench.preprocess import SECTION, render
from bench.report import write_section

RES = dict(rows=2_000_000, tsv_bytes=486_000_000, shards=8, repeat=2, p1_job_rows_per_s=3e5,
           p2_job_rows_per_s=5.7e5, p1_wall_rows_per_s=2.5e5, p2_wall_rows_per_s=4e5, p1_cpu_rows_per_s=4e5,
           p2_cpu_rows_per_s=3.9e5, synth_rows_per_s=3e5, synth_auc=0.8, speedup_job=1.9,
           speedup_wall=1.6, loadavg=(0.3, 1.9))


def test_section_is_replaced_and_others_kept(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text("# Benchmarks\n\n## Training\n\nfigures\n")
    write_section(path, SECTION, render(RES, "python -m bench.preprocess"))
    first = path.read_text()
    assert first.startswith("# Benchmarks\n\n## Training\n\nfigures\n") and SECTION in first
    assert "**1.90x**" in first and "python -m bench.preprocess" in first
    path.write_text(first + "\n## Storage\n\nmore figures\n")
    write_section(path, SECTION, render({**RES, "speedup_job": 1.8}, "python -m bench.preprocess"))
    text = path.read_text()
    assert text.count(SECTION) == 1 and "**1.80x**" in text and "**1.90x**" not in text
    assert "## Training\n\nfigures\n" in text and text.rstrip().endswith("## Storage\n\nmore figures")
