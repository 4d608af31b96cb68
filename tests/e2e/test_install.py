"""Installing: `pip install .` into a fresh venv (Horovod from install/horovod-wheel.sh's cached
wheel, versions from install/constraints.txt) passes the unit tests; `pip install -e .` builds
the kernels in place; and training never runs a compiler (the C kernels are built at install
time), while the checkpoint records the kernel path and a resume on the other path says that
bit-equality is not kept."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import VENV_PY
from tests.e2e.helpers import copy_checkout, job_env, make_dataset, train_cmd

COMPILERS = ["cc", "gcc", "g++", "c++", "cpp", "clang", "clang++", "ld", "as", "x86_64-linux-gnu-gcc",
             "x86_64-linux-gnu-gcc-12", "gcc-12", "nvcc"]


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{cmd} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


def test_pip_install_into_a_fresh_venv_then_the_unit_tests_pass(tmp_path):
    src = copy_checkout(tmp_path / "src")
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", None) or shutil.which("python3")
    _run([base, "-m", "venv", str(venv)])
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "HVCTR_NATIVE")}
    # The documented two lines (docs/install.md, Installing with pip anywhere): the Horovod wheel (cached by make setup), then pip.
    wheels = _run([str(src / "install" / "horovod-wheel.sh"), str(py)], env=env, timeout=900).stdout.strip()
    _run([str(py), "-m", "pip", "install", "-q", "-c", "install/constraints.txt", "--find-links", wheels,
          ".[horovod,test]"],
         cwd=src, env=env, timeout=900)
    # hvctr comes from the venv, its kernels built by the install, not from the source tree
    probe = ("from hvctr.kernels import native; import hvctr, horovod.torch; "
             "print(hvctr.__file__); print(native.library_path()); print(native.kernel_path())")
    out = _run([str(py), "-c", probe], cwd=tmp_path, env=env).stdout.split()
    site = venv / "lib"
    assert out[0].startswith(str(site)) and out[1].startswith(str(site)) and out[2] == "native", out
    # The unit tests against the installed package: --import-mode=append puts the venv's hvctr
    # before the source tree's; the workshop (bench) reads the repository, so it comes from there.
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "bench").symlink_to(src / "bench")
    r = subprocess.run([str(venv / "bin" / "pytest"), "-q", "-p", "no:cacheprovider", "--import-mode=append",
                        "tests/unit"], cwd=src, env={**env, "PYTHONPATH": str(shim)},
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout, r.stdout[-500:]
    # pip install -e . builds the kernels in place, beside their sources
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "-e", "."], cwd=src, env=env, timeout=600)
    out = _run([str(py), "-c", probe], cwd=tmp_path, env=env).stdout.split()
    assert out[1].startswith(str(src / "hvctr" / "kernels" / "_hv_kernels")) and out[2] == "native", out


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory)


def test_without_horovod_pip_install_trains_2_ranks_on_torch_distributed(dataset, tmp_path):
    """Horovod is an extra: `pip install .` leaves it out, hvctr trains on distributed.backend =
    torch, and a job that asks for Horovod stops at start saying how to get it or go without."""
    src = copy_checkout(tmp_path / "src")
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", None) or shutil.which("python3")
    _run([base, "-m", "venv", str(venv)])
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "HVCTR_NATIVE",
                                                               "HVCTR_BACKEND")}
    _run([str(py), "-m", "pip", "install", "-q", "-c", "install/constraints.txt", "."], cwd=src, env=env, timeout=900)
    r = subprocess.run([str(py), "-c", "import horovod"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode != 0 and "No module named 'horovod'" in r.stderr
    cmd = train_cmd(2, tmp_path / "run", dataset, "--train.max_steps=8", "--distributed.backend=torch")
    cmd[cmd.index(VENV_PY)] = str(py)
    r = subprocess.run(cmd, env={**job_env(), **env}, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["eval"]["auc"] > 0.5
    cmd = train_cmd(2, tmp_path / "run-hvd", dataset, "--train.max_steps=8")
    cmd[cmd.index(VENV_PY)] = str(py)
    r = subprocess.run(cmd, env={**job_env(), **env}, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode != 0
    assert ("distributed.backend = horovod, but Horovod cannot be imported" in r.stdout + r.stderr
            and "--distributed.backend=torch" in r.stdout + r.stderr), r.stdout[-2000:] + r.stderr[-2000:]


def _recorder(tmp_path: Path) -> tuple[Path, Path]:
    """A bin directory whose cc, gcc, ... record their call and fail; the record file."""
    bin_dir, record = tmp_path / "nocc", tmp_path / "compiler-calls.txt"
    bin_dir.mkdir()
    for name in COMPILERS:
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\necho "{name} $*" >> {record}\nexit 1\n')
        shim.chmod(0o755)
    return bin_dir, record


def _manifests(run: Path) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in (run / "checkpoints").glob("ckpt-*/manifest.json")),
                  key=lambda m: m["seq"])


def test_training_never_runs_a_compiler_and_a_resume_on_the_torch_path_says_so(dataset, tmp_path):
    bin_dir, record = _recorder(tmp_path)
    path = f"{bin_dir}:{os.environ['PATH']}"
    for name in ("cc", "gcc", "c++"):  # the job finds no compiler but the recorder
        assert shutil.which(name, path=path) == str(bin_dir / name)
    env = {**job_env(), "CC": str(bin_dir / "cc"), "CXX": str(bin_dir / "c++"), "PATH": path,
           "HVCTR_NATIVE_DIR": str(tmp_path / "native-cache")}  # where the old loader compiled to
    env.pop("HVCTR_NATIVE", None)
    run = tmp_path / "run"
    flags = ["--merge.every_k_steps=2", "--checkpoint.every_windows=2", "--train.max_steps=8"]
    r = subprocess.run(train_cmd(2, run, dataset, *flags), env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert not record.exists(), f"a compiler ran during training: {record.read_text()}"
    assert not (tmp_path / "native-cache").exists()
    manifests = _manifests(run)
    assert manifests and all(m["kernels"] == "native" for m in manifests)
    # The same run resumed on the torch path: it trains on, and says bit-equality is not kept.
    env["HVCTR_NATIVE"] = "0"
    r = subprocess.run(train_cmd(2, run, dataset, "--merge.every_k_steps=2", "--checkpoint.every_windows=2",
                                 "--train.max_steps=12", resume=True),
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    logs = r.stdout + r.stderr + "".join(p.read_text() for p in (run / "logs").glob("*.log"))
    assert "bit-equality with the uninterrupted run is not kept" in logs, logs[-3000:]
    assert "the torch path (HVCTR_NATIVE=0)" in logs
    assert _manifests(run)[-1]["kernels"] == "torch"
    assert not record.exists(), f"a compiler ran during training: {record.read_text()}"
