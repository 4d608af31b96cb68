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


@pytest.mark.parametrize("flag,needle", [
    ("--storage.init_scale=nan", "must be a finite number"),
    ("--storage.init_scale=-1", "must be >= 0"),
    ("--storage.init_scale=inf", "must be a finite number"),
    ("--train.dense_lr=inf", "must be a finite number"),
    ("--train.sparse_lr=-inf", "must be a finite number"),
    ("--train.eps=inf", "must be a finite number"),
    ("--merge.outer_lr=inf", "must be a finite number"),
    ("--train.queue_timeout_s=nan", "must be a finite number"),
    ("--train.queue_timeout_s=0", "must be > 0"),
    ("--train.stall_timeout_s=inf", "must be a finite number"),
])
def test_every_float_key_is_finite_and_in_range(flag, needle):
    """nan, inf or a negative scale trained to loss nan with rc 0 (issue 28, item 7)."""
    key = flag[2:].split("=")[0]
    with pytest.raises(ValueError, match=rf"config key '{key}': {needle}"):
        load_config(None, [flag])


def test_no_float_key_escapes_the_finite_check():
    import dataclasses
    import typing

    from hvctr.config import Config
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.default_factory):
            if typing.get_type_hints(section.default_factory)[f.name] is float:
                with pytest.raises(ValueError, match=rf"config key '{section.name}.{f.name}': must be a finite"):
                    load_config(None, [f"--{section.name}.{f.name}=nan"])
