import pytest

from hvctr.config import (CachePolicy, MergeMode, MergeStates, load_config, replace, to_toml,
                          write_toml)


def test_defaults_load_and_validate():
    cfg = load_config()
    assert cfg.merge.mode is MergeMode.KSTEP
    assert cfg.merge.every_k_steps == 4
    assert cfg.storage.cache_policy is CachePolicy.LFU


def test_precedence_flags_over_file_over_defaults(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('[merge]\nevery_k_steps = 2\nstates = "params"\n[storage]\ndim = 8\n')
    cfg = load_config(f, ["--merge.every_k_steps=8", "--storage.cpu_cache_bytes=1e9"])
    assert cfg.merge.every_k_steps == 8  # flag beats file
    assert cfg.merge.states is MergeStates.PARAMS  # file beats default
    assert cfg.storage.dim == 8
    assert cfg.storage.cpu_cache_bytes == 1_000_000_000
    assert cfg.train.epochs == 1  # default


def test_misspelled_key_names_key_and_valid_keys(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text("[merge]\nevery_k_step = 8\n")
    with pytest.raises(ValueError) as e:
        load_config(f)
    msg = str(e.value)
    assert "merge.every_k_step" in msg and str(f) in msg
    assert "every_k_steps" in msg and "compression" in msg  # the valid keys are listed


def test_unknown_section_and_flag():
    with pytest.raises(ValueError, match="unknown config section 'mrege'.*merge"):
        load_config(None, ["--mrege.every_k_steps=8"])
    with pytest.raises(ValueError, match="expected --section.key=value"):
        load_config(None, ["--every_k_steps=8"])


@pytest.mark.parametrize("flag,needle", [
    ("--merge.every_k_steps=0", "merge.every_k_steps"),
    ("--merge.every_k_steps=abc", "expected an integer"),
    ("--merge.mode=async", "['kstep', 'sync']"),
    ("--merge.states=params+w", "params+m+v"),
    ("--data.prefetch=maybe", "true or false"),
    ("--storage.max_working_set_rows=100", "smaller than one batch"),
])
def test_bad_values_name_the_key(flag, needle):
    with pytest.raises(ValueError) as e:
        load_config(None, [flag])
    assert needle in str(e.value)


def test_toml_round_trip(tmp_path):
    cfg = load_config(None, ["--model.hidden=64,32", "--merge.compression=fp16", "--train.run_dir=a\"b"])
    path = tmp_path / "resolved.toml"
    write_toml(cfg, path)
    assert load_config(path) == cfg
    assert "[merge]" in to_toml(cfg)


def test_replace_keeps_validation():
    cfg = replace(load_config(), merge={"every_k_steps": 16})
    assert cfg.merge.every_k_steps == 16
    with pytest.raises(ValueError, match="every_k_steps"):
        replace(cfg, merge={"every_k_steps": -1})
