"""``hvctr plan`` as users run it, and the calibration that feeds it."""

import json
import subprocess

import h5py
import numpy as np
import pytest

from hvctr.plan.model import rows_per_rank, shard_bytes
from hvctr.plan.rates import load_rates
from tests.conftest import REPO, VENV_PY, mpi_env
from tests.e2e.helpers import make_dataset

DGX = ["--map", str(REPO / "slurm/hwmaps/dgx-a100.toml"), "--rates", str(REPO / "slurm/rates/dgx-a100-assumed.toml")]


def hvctr(*args, timeout=120):
    return subprocess.run([VENV_PY, "-m", "hvctr", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=mpi_env())


def test_plan_of_a_terabyte_table_on_16_dgx_nodes():
    r = hvctr("plan", *DGX, "--nodes", "16", "--keys", "1e11", "--dim", "8", "--batch", "4096",
              "--every-k-steps", "8", "--cpu-cache-bytes", "48e9", "--ssd-bytes", "15e12", "--nic-gbps", "100")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "16 node(s) x 8 ranks = 128 ranks on dgx-a100" in out
    assert "781,250,000 rows (storage.rows_per_rank)" in out
    assert "network 100 Gb/s per node" in out
    lines = {line.split()[0]: line for line in out.split("what fits")[1].splitlines() if line.strip()}
    assert "fits" in lines["SSD"] and "fits" in lines["GPU"]


def test_plan_json_figures_are_the_closed_forms():
    r = hvctr("plan", *DGX, "--nodes", "16", "--keys", "1e11", "--dim", "8", "--every-k-steps", "8",
              "--nic-gbps", "200", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    f = got["figures"]
    assert f["world_size"] == 128 and f["shard_capacity_rows"] == rows_per_rank(10**11, 128) == 781_250_000
    assert f["shard_bytes"] == shard_bytes(781_250_000, 8, 0.8)["total"]
    assert f["row_bytes"] == 4 * (3 * 9 + 1)
    assert {x["where"]: x["status"] for x in got["fits"]}["SSD"] == "unknown"  # no --ssd-bytes, /raid is not here
    assert f["step_s"] > 0 and f["bound_by"] in ("compute", "pull", "merge", "prefetch")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_dataset(tmp_path_factory)


def test_plan_with_data_measures_its_key_curve(data, tmp_path):
    rates = tmp_path / "r.toml"
    rates.write_text((REPO / "slurm/rates/dgx-a100-assumed.toml").read_text().replace("ranks_per_node = 8",
                                                                                       "ranks_per_node = 1"))
    r = hvctr("plan", "--map", str(REPO / "slurm/hwmaps/vm-2cpu.toml"), "--ranks-per-node", "2", "--data", str(data),
              "--batch", "256", "--every-k-steps", "4", "--rates", str(rates), "--json")
    assert r.returncode == 0, r.stderr
    f = json.loads(r.stdout)["figures"]
    manifest = json.loads((data / "manifest.json").read_text())
    keys = []
    for rec in manifest["shards"]["train"]:
        with h5py.File(data / rec["file"], "r") as h:
            keys.append(h["keys"][...])
    keys = np.concatenate(keys)
    assert f["table_keys"] == np.unique(keys).shape[0]  # the whole train split, counted exactly
    # windows of 4 x 256 rows: the mean distinct count over the first 16 such windows
    want = np.mean([np.unique(keys[i * 1024:(i + 1) * 1024]).shape[0] for i in range(16)])
    assert f["working_set_rows"] == pytest.approx(want)


def test_plan_user_errors():
    r = hvctr("plan", *DGX, "--nodes", "2")
    assert r.returncode == 2 and "--keys is required without --data" in r.stderr
    r = hvctr("plan", "--map", str(REPO / "slurm/hwmaps/vm-2cpu.toml"), "--nodes", "2", "--keys", "1e6",
              "--rates", str(REPO / "slurm/rates/dgx-a100-assumed.toml").replace("dgx-a100-assumed", "nope"))
    assert r.returncode == 2 and "rates file" in r.stderr and "does not exist" in r.stderr
    r = hvctr("plan", *DGX, "--ranks-per-node", "9", "--keys", "1e9")
    assert r.returncode == 2 and "run at most one rank per GPU" in r.stderr


def test_calibration_writes_a_rates_file_plan_reads(tmp_path):
    rates = tmp_path / "rates.toml"
    r = subprocess.run([VENV_PY, "-m", "bench.calibrate", "--ranks", "1", "--quick", "--rates", str(rates),
                        "--work-dir", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=REPO,
                       env=mpi_env())
    assert r.returncode == 0, r.stderr
    entry = load_rates(rates).for_ranks(1)
    assert entry.ranks_per_node == 1 and entry.compute_flops_per_s > 1e8 and entry.disk_rows_per_s > 0
    r = hvctr("plan", "--map", str(REPO / "slurm/hwmaps/vm-2cpu.toml"), "--keys", "1e6", "--rates", str(rates))
    assert r.returncode == 0, r.stderr
    assert "entry measured with 1 rank(s) per node" in r.stdout
