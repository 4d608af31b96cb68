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

from bench.architecture import LAYER, REPO as ARCH_REPO, imports_of, module_imports as modules, package_of
from tests.conftest import REPO

DATA_PREP_MAY_IMPORT = ("hvctr.formats", "hvctr.data.manifest", "hvctr.log", "hvctr.distributed.protocol")


def violations(package: str, forbidden, root=REPO) -> list[str]:
    return [f"{f} imports {m}" for f, names in modules(package, root).items() for m in sorted(names)
            if forbidden(f, m)]


def _under(m: str, pkg: str) -> bool:
    return m == pkg or m.startswith(pkg + ".")


def upward(f: str, m: str) -> bool:
    """An import of a package of the same or a higher layer (a package's own modules excepted)."""
    a, b = package_of(f), package_of(m)
    if a is None or b is None or a == b or not b.startswith("hvctr"):
        return False
    return LAYER[b] >= LAYER[a]


def test_every_package_of_the_runtime_has_a_layer():
    assert ARCH_REPO == REPO
    boxes = {package_of(f) for f in modules("hvctr")} - {None}
    assert sorted(boxes - set(LAYER)) == []


def test_nothing_imports_upward_so_there_is_no_circle():
    assert violations("hvctr", upward) == []


def test_offline_plan_sweep_and_bench_import_no_train_module():
    for top in ("hvctr/offline", "hvctr/plan", "hvctr/sweep", "bench"):
        assert violations(top, lambda f, m: _under(m, "hvctr.train")) == [], top


def test_nothing_is_named_hvctr_dist():
    assert not (REPO / "hvctr" / "dist").exists()
    for top in ("hvctr", "data_prep", "bench", "tests"):
        assert violations(top, lambda f, m: _under(m, "hvctr.dist")) == [], top


def test_the_runtime_never_imports_the_workshop_or_data_prep():
    assert violations("hvctr", lambda f, m: _under(m, "bench") or _under(m, "data_prep")) == []


def test_formats_is_a_leaf():
    # `from hvctr import formats` names the package "hvctr" too: allowed (hvctr/__init__ is its version alone)
    assert violations("hvctr/formats", lambda f, m: _under(m, "hvctr") and not _under(m, "hvctr.formats")
                      and m != "hvctr") == []


def test_data_prep_takes_only_the_formats_manifest_logger_and_protocol_from_hvctr():
    assert violations("data_prep", lambda f, m: _under(m, "hvctr") and m not in ("hvctr", "hvctr.data", "hvctr.distributed")
                      and not any(_under(m, ok) for ok in DATA_PREP_MAY_IMPORT)) == []


def test_models_import_neither_storage_nor_dist():
    assert violations("hvctr/models", lambda f, m: _under(m, "hvctr.storage") or _under(m, "hvctr.distributed")) == []


def test_only_dist_talks_to_horovod_and_mpi():
    bad = violations("hvctr", lambda f, m: (_under(m, "horovod") or _under(m, "mpi4py"))
                     and not f.startswith("hvctr/distributed/"))
    assert bad == []


def test_the_checker_sees_function_level_and_from_imports(tmp_path):
    # The rules above are only as good as imports_of: it must see a lazy import in a function,
    # and an upward one must be caught. Probed on a copy of the layout, never inside the checkout.
    probe = tmp_path / "hvctr" / "formats" / "_probe_for_test.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("def g():\n    from hvctr.train import loop\n    import torch\n")
    low = tmp_path / "hvctr" / "storage" / "up.py"
    low.parent.mkdir(parents=True)
    low.write_text("from ..train import trainer\n")
    names = imports_of(probe, tmp_path)
    assert {"hvctr.train", "hvctr.train.loop", "torch"} <= names
    assert violations("hvctr/formats", lambda _, m: _under(m, "hvctr") and not _under(m, "hvctr.formats"), tmp_path)
    assert violations("hvctr", upward, tmp_path) == ["hvctr/formats/_probe_for_test.py imports hvctr.train",
                                                      "hvctr/formats/_probe_for_test.py imports hvctr.train.loop",
                                                      "hvctr/storage/up.py imports hvctr.train",
                                                      "hvctr/storage/up.py imports hvctr.train.trainer"]


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
