"""Where a rank's working shard goes: storage.shard_dir, else the hardware map's SSD, else the run."""

from pathlib import Path

from hvctr.config import load_config
from hvctr.rundir import working_shard_dir


def test_shard_dir_setting_then_the_maps_ssd_then_the_run_directory(tmp_path):
    run = tmp_path / "runs" / "day1"
    plain = load_config(None, [])
    assert working_shard_dir(plain, run) == run / "shards"
    on_ssd = working_shard_dir(plain, run, ssd_dir="/nvme1")
    assert on_ssd.parent == Path("/nvme1/hvctr-shards") and on_ssd.name.startswith("day1-")
    # another run of the same name elsewhere never shares the directory
    assert working_shard_dir(plain, tmp_path / "other" / "day1", ssd_dir="/nvme1") != on_ssd
    assert working_shard_dir(plain, run, ssd_dir="/nvme1") == on_ssd  # stable for --resume
    chosen = load_config(None, [f"--storage.shard_dir={tmp_path / 'mine'}"])
    assert working_shard_dir(chosen, run, ssd_dir="/nvme1") == tmp_path / "mine"
