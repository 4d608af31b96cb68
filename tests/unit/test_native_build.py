"""The C kernels as built at install time (setup.py): their header is hvctr.formats' row layout,
the loaded library matches its sources and RowLayout, the ctypes signatures match the C
prototypes, the source compiles without warnings, and a missing, damaged or stale library is an
error that names HVCTR_NATIVE=0."""

import ctypes
import re
import shutil
import subprocess

import pytest

from hvctr.formats import c_header
from hvctr.kernels import native

C_TYPES = {"void": None, "int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64, "int32_t": ctypes.c_int32,
           "double": ctypes.c_double, "float": ctypes.c_float, "const char *": ctypes.c_char_p}


@pytest.fixture
def fresh_load():
    """lib() loads again inside the test and after it (the real library)."""
    native._reset()
    yield
    native._reset()


def test_the_row_header_is_hvctr_formats_c_header():
    text = (native.HERE / "hv_row.h").read_text()
    assert text == c_header(), ("hvctr/kernels/hv_row.h differs from hvctr.formats.c_header(): regenerate it with "
                                "python -c 'import hvctr.formats as f; print(f.c_header(), end=\"\")' "
                                "> hvctr/kernels/hv_row.h, then rebuild (pip install -e .)")


def test_the_installed_library_loads_and_matches_its_sources(fresh_load):
    lib = native.lib()
    assert lib is not None and native.kernel_path() == "native"
    assert native.library_path().parent == native.HERE
    assert lib.hv_source_sha256().decode() == native.source_sha256()
    with native.disabled():
        assert native.lib() is None and native.kernel_path() == "torch"


def _prototypes(source: str) -> dict[str, tuple[str, list[str]]]:
    """Exported (non-static) function definitions of hv_kernels.c: name -> (return type, arg types)."""
    out = {}
    pattern = r"^(?!static)((?:const )?\w+(?: \*)?)\s*(hv_\w+)\(([^)]*)\)\s*\{"
    for ret, name, args in re.findall(pattern, source, flags=re.M):
        types = []
        for arg in (a.strip() for a in args.replace("\n", " ").split(",")):
            if arg in ("", "void"):
                continue
            arg = re.sub(r"\s+", " ", arg)
            types.append("ptr" if "*" in arg else arg.rsplit(" ", 1)[0].replace("const ", ""))
        out[name] = (ret.strip(), types)
    return out


def test_ctypes_signatures_match_the_c_prototypes(fresh_load):
    protos = _prototypes((native.HERE / "hv_kernels.c").read_text())
    lib = native.lib()
    assert len(protos) >= 10
    for name, (ret, args) in protos.items():
        f = getattr(lib, name)
        want_args = [ctypes.c_void_p if a == "ptr" else C_TYPES[a] for a in args]
        assert f.argtypes == want_args, name
        assert f.restype == C_TYPES[ret], name


def test_the_kernels_compile_without_warnings(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler on this machine")
    r = subprocess.run([cc, "-O3", "-Wall", "-Wextra", "-Werror", "-std=c99", "-ffp-contract=off", "-fPIC", "-shared",
                        "-o", str(tmp_path / "k.so"), str(native.HERE / "hv_kernels.c"), "-lm"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_a_missing_library_is_an_error_naming_hvctr_native_0(fresh_load, monkeypatch):
    monkeypatch.setattr(native, "library_path", lambda: None)
    with pytest.raises(native.NativeKernelsError, match="HVCTR_NATIVE=0"):
        native.lib()
    with pytest.raises(native.NativeKernelsError, match="not built"):  # and again, not a silent None
        native.kernel_path()
    monkeypatch.setenv("HVCTR_NATIVE", "0")
    assert native.lib() is None and native.kernel_path() == "torch"


def test_a_damaged_library_is_an_error(fresh_load, monkeypatch, tmp_path):
    whole = native.library_path().read_bytes()
    bad = tmp_path / "_hv_kernels.so"
    monkeypatch.setattr(native, "library_path", lambda: bad)
    for damaged, why in [(whole[:len(whole) // 2], "truncated"), (b"\0" * 4096, "not an ELF"),
                         (whole[:64] + b"\0" * (len(whole) - 64), "cannot be loaded")]:
        bad.write_bytes(damaged)
        native._reset()
        with pytest.raises(native.NativeKernelsError, match=f"{why}.*HVCTR_NATIVE=0"):
            native.lib()


def test_a_stale_build_is_an_error(fresh_load, monkeypatch, tmp_path):
    so = tmp_path / native.library_path().name
    shutil.copy(native.library_path(), so)
    shutil.copy(native.HERE / "hv_row.h", tmp_path / "hv_row.h")
    (tmp_path / "hv_kernels.c").write_text((native.HERE / "hv_kernels.c").read_text() + "\n/* edited */\n")
    monkeypatch.setattr(native, "library_path", lambda: so)
    with pytest.raises(native.NativeKernelsError, match="stale build.*HVCTR_NATIVE=0"):
        native.lib()
