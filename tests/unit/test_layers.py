"""The import layers the architecture promises (docs/architecture.md), read from the source:
every import statement, those inside functions included, of every module.

- the runtime (hvctr) never imports the workshop (bench) or data_prep;
- hvctr.formats imports nothing of hvctr outside itself: it is the leaf every side agrees on;
- data_prep imports nothing of hvctr but hvctr.formats;
- the models import neither the table (storage) nor the collectives (dist);
- only hvctr.distributed imports horovod or mpi4py.
Then: the commands that only read configs and maps never load torch.
"""

import subprocess
import sys

import pytest

from bench.architecture import imports_of, module_imports as modules
from tests.conftest import REPO


def violations(package: str, forbidden) -> list[str]:
    return [f"{f} imports {m}" for f, names in modules(package).items() for m in sorted(names) if forbidden(f, m)]


def _under(m: str, pkg: str) -> bool:
    return m == pkg or m.startswith(pkg + ".")


def test_the_runtime_never_imports_the_workshop_or_data_prep():
    assert violations("hvctr", lambda f, m: _under(m, "bench") or _under(m, "data_prep")) == []


def test_formats_is_a_leaf():
    # `from hvctr import formats` names the package "hvctr" too: allowed (hvctr/__init__ is its version alone)
    assert violations("hvctr/formats", lambda f, m: _under(m, "hvctr") and not _under(m, "hvctr.formats")
                      and m != "hvctr") == []


def test_data_prep_takes_only_the_formats_from_hvctr():
    assert violations("data_prep", lambda f, m: _under(m, "hvctr") and not _under(m, "hvctr.formats")
                      and m != "hvctr") == []


def test_models_import_neither_storage_nor_dist():
    assert violations("hvctr/models", lambda f, m: _under(m, "hvctr.storage") or _under(m, "hvctr.distributed")) == []


def test_only_dist_talks_to_horovod_and_mpi():
    bad = violations("hvctr", lambda f, m: (_under(m, "horovod") or _under(m, "mpi4py"))
                     and not f.startswith("hvctr/distributed/"))
    assert bad == []


def test_the_checker_sees_function_level_and_from_imports(tmp_path, monkeypatch):
    # The rules above are only as good as imports_of: it must see a lazy import in a function.
    f = REPO / "hvctr" / "formats" / "_probe_for_test.py"
    f.write_text("def g():\n    from hvctr.train import loop\n    import torch\n")
    try:
        names = imports_of(f)
        assert {"hvctr.train", "hvctr.data.reader", "torch"} <= names
        assert violations("hvctr/formats", lambda _, m: _under(m, "hvctr") and not _under(m, "hvctr.formats"))
    finally:
        f.unlink()


@pytest.mark.parametrize("argv", [
    ["config"],
    ["topo", "--plan", "--map", "slurm/hwmaps/vm-2cpu.toml", "--local-size", "2"],
    ["plan", "--map", "slurm/hwmaps/vm-2cpu.toml", "--keys", "1000000"],
    ["sweep", "--help"],
    ["--help"],
])
def test_light_commands_never_load_torch(argv):
    code = ("import sys\nfrom hvctr.cli import main\n"
            "try:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n    rc = e.code\n"
            "print('LOADED', [m for m in ('torch', 'horovod') if m in sys.modules], 'RC', rc)\n")
    r = subprocess.run([sys.executable, "-c", code, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "LOADED [] RC 0" in r.stdout, (r.stdout[-2000:], r.stderr[-2000:])
