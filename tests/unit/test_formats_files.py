"""hvctr.formats.tomlfile (the one TOML reader) and hvctr.formats.h5alloc (allocate early, then pwrite)."""

import os

import h5py
import numpy as np
import pytest

from hvctr.config import load_config
from hvctr.formats.h5alloc import create_early, pwrite_all, reserved
from hvctr.formats.tomlfile import read_toml
from hvctr.plan.rates import load_rates
from hvctr.sweep.space import load_space
from hvctr.topo.hwmap import load_map


def test_read_toml_names_the_file_line_and_column_of_a_syntax_error(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[train]\nepochs = \n")
    with pytest.raises(ValueError, match=rf"^thing {p}: .*\(at line 2, column 10\)$"):
        read_toml(p, "thing")
    p.write_text("a = 1\nx = [\n")  # tomllib says only "at end of document": its line and column are named
    with pytest.raises(ValueError, match=rf"^thing {p}: .*\(at line 3, column 1: the end of the file\)$"):
        read_toml(p, "thing")
    assert read_toml(_good(tmp_path), "thing") == {"a": {"b": 1}}


def _good(tmp_path):
    p = tmp_path / "good.toml"
    p.write_text("[a]\nb = 1\n")
    return p


def test_read_toml_names_a_missing_or_unreadable_file(tmp_path):
    with pytest.raises(ValueError, match=rf"^thing {tmp_path}/nope.toml does not exist: see here$"):
        read_toml(tmp_path / "nope.toml", "thing", ": see here")
    p = tmp_path / "latin1.toml"
    p.write_bytes(b"a = '\xff'\n")
    with pytest.raises(ValueError, match=rf"^thing {p}: not UTF-8 text: byte 0xff at line 1, column 6 \(save it as UTF-8\)$"):
        read_toml(p, "thing")
    with pytest.raises(ValueError, match=rf"^thing {tmp_path} is a directory, not a file$"):
        read_toml(tmp_path, "thing")


@pytest.mark.parametrize("load, what", [(load_config, "config file"), (load_space, "search space"),
                                        (load_map, "hardware map"), (load_rates, "rates file")])
def test_the_four_toml_files_are_read_by_the_one_reader(tmp_path, load, what):
    p = tmp_path / "x.toml"
    p.write_text("x = [\n")
    with pytest.raises(ValueError, match=rf"^{what} {p}: .*\(at line \d+, column \d+(: the end of the file)?\)$"):
        load(p)
    with pytest.raises(ValueError, match=rf"^{what} {tmp_path}/missing.toml does not exist"):
        load(tmp_path / "missing.toml")


def test_datasets_allocated_early_are_written_by_pwrite_at_their_offsets(tmp_path):
    path = tmp_path / "f.h5"
    data = np.arange(4096 * 3, dtype=np.float32).reshape(-1, 3)
    with h5py.File(path, "w") as f:
        off = create_early(f, "a", data.shape, data.dtype).id.get_offset()
        create_early(f, "small", data=np.array([7], dtype=np.int64), fill_time=None)
    assert off is not None
    with reserved(path, fsync=True) as fd:
        pwrite_all(fd, data[:10], off)
        pwrite_all(fd, memoryview(data[10:]).cast("B"), off + 10 * data.strides[0])
    st = os.stat(path)
    assert st.st_blocks * 512 >= st.st_size
    with h5py.File(path, "r") as f:
        np.testing.assert_array_equal(f["a"][...], data)
        assert f["small"][0] == 7
