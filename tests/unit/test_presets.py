"""The presets in slurm/configs/ load, and open with how to launch them and how long they take."""

import pytest

from hvctr.config import load_config
from tests.conftest import REPO

PRESETS = sorted((REPO / "slurm" / "configs").glob("*.toml"))


def test_the_criteo_presets_exist():
    assert {"criteo-kaggle.toml", "criteo-terabyte.toml", "demo.toml"} <= {p.name for p in PRESETS}


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_preset_loads_and_opens_with_launch_and_duration(preset):
    load_config(preset)  # unknown keys or bad values raise
    header = []
    for line in preset.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    text = "\n".join(header)
    assert "hvctr train" in text or "sbatch" in text, "the header says how to launch it"
    assert "minute" in text or "not yet measured" in text, "the header says how long it takes"


def test_terabyte_preset_validates_on_day_23():
    text = (REPO / "slurm" / "configs" / "criteo-terabyte.toml").read_text()
    assert "HVCTR_VALID_INPUT=/data/criteo/day_23.gz" in text
    assert load_config(REPO / "slurm" / "configs" / "criteo-terabyte.toml").metrics.eval_every_windows > 0
