"""``hvctr bench --quick`` writes its results where it is told (its work directory) and leaves
the checkout as it was: BENCHMARKS.md, bench/*.png and the planner's default rates
(hvctr/plan/rates.toml) change only with --write-benchmarks. The whole quick suite runs
(about 4 minutes on 2 cores): every part, the plots, for real."""

import os
import subprocess

from tests.conftest import REPO, VENV_PY, mpi_env

SKIP_DIRS = {".git", ".venv", "__pycache__", "runs", "build", ".pytest_cache"}


def snapshot() -> dict[str, tuple[int, int]]:
    """(mtime_ns, size) of every file of the checkout outside caches, the venv and run output."""
    out = {}
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for name in files:
            p = os.path.join(root, name)
            st = os.stat(p)
            out[os.path.relpath(p, REPO)] = (st.st_mtime_ns, st.st_size)
    return out


def test_quick_bench_leaves_the_checkout_unchanged(tmp_path):
    before = snapshot()
    work = tmp_path / "bench"
    r = subprocess.run([VENV_PY, "-m", "hvctr", "bench", "--quick", "--work-dir", str(work)], cwd=REPO,
                       env=mpi_env(), capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    after = snapshot()
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    assert changed == [], f"hvctr bench --quick changed the checkout: {changed}"
    md = (work / "BENCHMARKS.md").read_text()
    for heading in ("## Preprocessing", "## Embedding store", "## Sparse path", "## Placement", "## Training",
                    "## Planner", "## Plots"):
        assert heading in md, heading
    assert sorted(p.name for p in (work / "plots").glob("*.png")) == ["cache_hit.png", "k_sweep.png", "time_split.png"]
    assert (work / "rates.toml").read_text().count("[[rates]]") >= 1
