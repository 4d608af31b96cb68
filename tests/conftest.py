import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TEST_DATA = REPO / "tests" / "data"  # real Criteo rows the tests read (a clone alone has them)
VENV_PY = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable

# Environment for child mpirun jobs started by e2e tests (root, oversubscribed 2-core machine).
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_mpi_yield_when_idle": "1",
    "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
}


def mpi_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(MPI_ENV)
    env.update(extra)
    return env


def mount_tmpfs(path: Path, size_bytes: int) -> Path:
    """Mounts a fresh tmpfs of ``size_bytes`` at ``path`` (created): a small disk to fill up.

    Needs root (mount -t tmpfs); skips the calling test, with the reason, where mounting is
    not permitted. Undo with ``unmount``.
    """
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size_bytes)}", "tmpfs", str(path)],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill up (needs root and CAP_SYS_ADMIN): {r.stderr.strip()}")
    return path


def unmount(path: Path) -> None:
    subprocess.run(["umount", "--lazy", str(path)], capture_output=True, timeout=30)


@pytest.fixture
def tmpfs(tmp_path):
    """``mount(size_bytes) -> Path``: a fresh tmpfs of that size, unmounted at teardown."""
    mounted: list[Path] = []

    def mount(size_bytes: int) -> Path:
        mounted.append(mount_tmpfs(tmp_path / f"tmpfs{len(mounted)}", size_bytes))
        return mounted[-1]

    yield mount
    for path in mounted:
        unmount(path)


def shard_checksums(manifest: dict) -> dict:
    """Each split's per-shard checksums from a data_prep manifest: equal outputs, equal dicts."""
    from hvctr import formats

    return {split: [r["checksums"] for r in manifest["shards"][split]] for split in formats.SPLITS}


def run_data_prep(inputs, out: Path, shards: int, **job) -> dict:
    """data_prep criteo in this process (one rank), asserting success; the manifest it wrote."""
    import json

    from data_prep.criteo import Job, run_job
    from data_prep.mpi import Comm

    assert run_job(Comm(), Job(tuple(str(p) for p in inputs), str(out), shards, **job)) == 0
    return json.loads((out / "manifest.json").read_text())


def synth_shards(root: Path, rows: int, shards: int = 2, seed: int = 3, valid_fraction: float = 0.1) -> Path:
    """``rows`` rows of ``data_prep synth`` (root/in.tsv) preprocessed by ``data_prep criteo`` into
    root/shards, both run as a user runs them; the shards' directory."""
    subprocess.run([VENV_PY, "-m", "data_prep", "synth", "--rows", str(rows), "--seed", str(seed), "--out",
                    str(root / "in.tsv")], check=True, capture_output=True, timeout=300)
    subprocess.run([VENV_PY, "-m", "data_prep", "criteo", "--input", str(root / "in.tsv"), "--out",
                    str(root / "shards"), "--shards", str(shards), "--valid-fraction", str(valid_fraction)],
                   check=True, capture_output=True, timeout=300)
    return root / "shards"
