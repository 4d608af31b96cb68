"""Set-up in the site setting (.ci/setup.sh; docs/install.md, path b): a user without root, on
a PATH that has no apt, dpkg, sudo or Slurm, only the tools a cluster login node has after
`module load` (a directory of symlinks to them), against the OpenMPI installed here. The set-up
builds a venv in a temporary directory against the MPI whose mpicc is on PATH: mpi4py compiled
by that mpicc, Horovod built against it. Both come from cached wheels (install/mpi4py-wheel.sh,
install/horovod-wheel.sh; root's cache copied where the user can read it), so the test does
not compile for 10 minutes. Without mpicc on PATH the set-up names what is missing and exits
non-zero, having installed nothing.

Needs root (useradd, and running the set-up as that user); skipped, with the reason, otherwise.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, VENV_PY
from tests.e2e.helpers import copy_checkout

USER = "hvctr-site"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BASE_PYTHON = "/usr/bin/python3.11"  # the distribution's Python: the user cannot read root's pyenv
MPI_TOOLS = ["mpicc", "mpicxx", "mpic++", "mpirun", "mpiexec", "orterun", "orted", "ompi_info"]
# What a login node offers besides the MPI module: a shell and its utilities, compilers, cmake.
TOOLS = ["bash", "sh", "env", "cat", "sed", "grep", "head", "tail", "ls", "mkdir", "rm", "rmdir", "mv", "cp",
         "ln", "mktemp", "dirname", "basename", "id", "tr", "find", "tar", "gzip", "uname", "nproc", "sort",
         "cut", "wc", "readlink", "chmod", "touch", "date", "sleep", "true", "false", "expr", "which",
         "ssh",  # Open MPI 4's mpirun wants its rsh agent even on one node
         "cc", "gcc", "c++", "g++", "cpp", "as", "ld", "ar", "ranlib", "strip", "make", "cmake", "pkg-config",
         "gcc-12", "g++-12", "x86_64-linux-gnu-gcc", "x86_64-linux-gnu-gcc-12", "x86_64-linux-gnu-g++",
         "x86_64-linux-gnu-g++-12", "x86_64-linux-gnu-ld", "x86_64-linux-gnu-as"]
HIDDEN = ["apt", "apt-get", "apt-cache", "dpkg", "dpkg-query", "sudo", "srun", "sbatch", "slurmd", "munged"]
PASS_ENV = ("PIP_", "http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")


@pytest.fixture(scope="module")
def site_user():
    """(uid, gid) of a user without root, created here if absent (and removed again)."""
    if os.geteuid() != 0:
        pytest.skip("creating a non-root user and running the set-up as that user needs root (make test runs as root)")
    for tool in ("useradd", "userdel"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not found: cannot create the non-root user for the site set-up test")
    if not Path(BASE_PYTHON).is_file():
        pytest.skip(f"{BASE_PYTHON} not found: the non-root user needs a Python it can read")
    if shutil.which("mpicc", path=SYSTEM_PATH) is None:
        pytest.skip("no mpicc under /usr: make setup installs OpenMPI (libopenmpi-dev)")
    created = False
    try:
        pw = pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/bin/sh", USER], check=True,
                       capture_output=True, timeout=60)
        pw, created = pwd.getpwnam(USER), True
    try:
        yield pw.pw_uid, pw.pw_gid
    finally:
        if created:
            subprocess.run(["userdel", USER], capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def site_home(site_user):
    """A directory the user owns (not under pytest's root-only tmp): its HOME, the checkout, the venv."""
    root = Path(tempfile.mkdtemp(prefix="hvctr-site-"))
    try:
        (root / "home").mkdir()
        (root / "tmp").mkdir()
        copy_checkout(root / "src")
        _chown(root, *site_user)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _bin_dir(root: Path, name: str, *, mpi: bool) -> Path:
    """A PATH directory of symlinks to the login node's tools; MPI's among them when ``mpi``."""
    d = root / name
    d.mkdir()
    (d / "python3").symlink_to(BASE_PYTHON)
    for tool in TOOLS + (MPI_TOOLS if mpi else []):
        found = shutil.which(tool, path=SYSTEM_PATH)
        if found:
            (d / tool).symlink_to(found)
    for tool in HIDDEN:
        assert shutil.which(tool, path=str(d)) is None, tool
    assert (shutil.which("mpicc", path=str(d)) is not None) == mpi
    return d


def _chown(path: Path, uid: int, gid: int) -> None:
    for p in [path, *path.rglob("*")]:
        os.lchown(p, uid, gid)


def _env(root: Path, bin_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.startswith(PASS_ENV)}
    env.update(PATH=str(bin_dir), HOME=str(root / "home"), TMPDIR=str(root / "tmp"), LANG="C.UTF-8",
               USER=USER, LOGNAME=USER, VENV=str(root / "venv"), HVCTR_CACHE=str(root / "cache"))
    env.update(extra)
    return env


def _as_user(site_user, cmd, env, cwd, timeout) -> subprocess.CompletedProcess:
    uid, gid = site_user
    return subprocess.run(cmd, env=env, cwd=cwd, user=uid, group=gid, extra_groups=[], capture_output=True,
                          text=True, timeout=timeout)


def test_without_mpicc_the_set_up_names_it_and_installs_nothing(site_user, site_home):
    bin_dir = _bin_dir(site_home, "bin-nompi", mpi=False)
    env = _env(site_home, bin_dir, VENV=str(site_home / "venv-nompi"))
    r = _as_user(site_user, ["bash", ".ci/setup.sh"], env, site_home / "src", timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "setting: site" in out, out
    assert ("mpicc not found on PATH: load your site's MPI module (module load openmpi) "
            "or install OpenMPI >= 4") in out, out
    assert "mpirun not found on PATH" in out, out
    assert "nothing was installed" in out, out
    assert not (site_home / "venv-nompi").exists()


def _torch_version(python: str) -> str:
    return subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('torch').split('+')[0])"],
                          capture_output=True, text=True, check=True).stdout.strip()


def _pinned(package: str) -> str:
    lines = (REPO / "install" / "constraints.txt").read_text().splitlines()
    return next(line.split("==", 1)[1] for line in lines if line.startswith(f"{package}=="))


def test_site_set_up_as_a_user_without_root_or_apt(site_user, site_home):
    uid, gid = site_user
    # The wheels the set-up would otherwise compile for 5 minutes each on 2 cores, where the user
    # can read them: Horovod's (make setup built it) and mpi4py's against this mpicc (built here
    # the first time, then cached in root's ~/.cache/hvctr like Horovod's).
    for script in ("horovod-wheel.sh", "mpi4py-wheel.sh"):
        r = subprocess.run([str(REPO / "install" / script), VENV_PY], capture_output=True, text=True, timeout=1200)
        assert r.returncode == 0, r.stdout + r.stderr
        wheels = Path(r.stdout.strip().splitlines()[-1])
        shutil.copytree(wheels, site_home / "cache" / "wheels" / wheels.name)
    bin_dir = _bin_dir(site_home, "bin", mpi=True)
    _chown(site_home, uid, gid)
    env = _env(site_home, bin_dir)
    src, venv = site_home / "src", site_home / "venv"

    t0 = time.monotonic()
    r = _as_user(site_user, ["bash", ".ci/setup.sh"], env, src, timeout=900)
    first_s = time.monotonic() - t0
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "setting: site" in out and "apt packages" not in out, out
    assert "Slurm is never installed" in out, out
    assert "building mpi4py" not in out, f"a cached wheel was not used:\n{out[-3000:]}"
    # The set-up installs the pinned torch; the cached Horovod wheel is for this venv's torch,
    # the same unless the suite runs on another (HVCTR_TORCH): then the set-up builds its own.
    if _torch_version(VENV_PY) == _pinned("torch"):
        assert "building Horovod" not in out, f"a cached wheel was not used:\n{out[-3000:]}"
    assert "installing mpi4py built against" in out, out
    assert "MPI library under mpi4py: Open MPI" in out, out

    probe = ("import horovod.torch as hvd, hvctr, mpi4py; from hvctr.kernels import native; "
             "print(hvctr.__file__); print(native.kernel_path()); print(hvd.mpi_built())")
    r = _as_user(site_user, [str(venv / "bin" / "python"), "-c", probe], env, site_home, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    hvctr_file, kernels, mpi_built = r.stdout.split()
    assert hvctr_file.startswith(str(src)) and kernels == "native" and mpi_built == "True", r.stdout
    # mpi4py was compiled here against mpicc's MPI, not taken as PyPI's binary wheel.
    tags = [line for p in (venv / "lib").glob("python3*/site-packages/mpi4py-*.dist-info/WHEEL")
            for line in p.read_text().splitlines() if line.startswith("Tag:")]
    assert tags and all("manylinux" not in t for t in tags), tags

    # The venv runs a Horovod job under the site's mpirun, as that user.
    job = ("import horovod.torch as hvd, torch; hvd.init(); "
           "print('sum', hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item())")
    mpi = {"OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_mpi_yield_when_idle": "1",
           "OMPI_MCA_btl_vader_single_copy_mechanism": "none"}
    r = _as_user(site_user, ["mpirun", "-np", "2", "--bind-to", "none", str(venv / "bin" / "python"), "-c", job],
                 {**env, **mpi}, site_home, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split().count("sum") == 2 and "3.0" in r.stdout, r.stdout

    # Again: everything is there, so it only checks.
    t0 = time.monotonic()
    r = _as_user(site_user, ["bash", ".ci/setup.sh"], env, src, timeout=300)
    again_s = time.monotonic() - t0
    assert r.returncode == 0 and "installing" not in r.stdout, r.stdout + r.stderr
    print(f"site set-up: first {first_s:.0f} s, again {again_s:.1f} s")
    assert again_s < 60, again_s
