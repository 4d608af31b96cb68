"""install/hvctr.def, the Apptainer/Singularity image (docs/install.md, path c), read without
building it: Debian 12 has no apptainer or singularity-container package, so no test here can
build the image. What can be checked: every %files source exists in a clean clone, the image's
set-up is hvctr's own in its site setting, and the scripts parse."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tests.conftest import REPO

DEF = REPO / "install" / "hvctr.def"


def _sections() -> tuple[dict[str, str], dict[str, str]]:
    """(header key -> value, section name -> body) of the definition file."""
    header, sections, current = {}, {}, None
    for line in DEF.read_text().splitlines():
        m = re.match(r"^%(\w+)\s*$", line)
        if m:
            current = m.group(1)
            sections[current] = ""
        elif current is not None:
            sections[current] += line + "\n"
        elif line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition(":")
            header[key.strip()] = value.strip()
    return header, sections


def test_header_bootstraps_debian_12_from_debian():
    header, sections = _sections()
    assert header == {"Bootstrap": "debootstrap", "OSVersion": "bookworm",
                      "MirrorURL": "http://deb.debian.org/debian"}
    assert {"files", "post", "environment", "runscript", "test", "help"} <= set(sections)


def test_files_exist_in_the_checkout():
    _, sections = _sections()
    # what a clean clone has: a tracked file, or a directory holding tracked files (a copy of
    # the checkout without .git, as tests/e2e/test_install.py runs these tests in, has no index)
    git = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    tracked = git.stdout.splitlines() if git.returncode == 0 and (REPO / ".git").exists() else None
    for line in filter(str.strip, sections["files"].splitlines()):
        src, dest = line.split()
        assert (REPO / src).exists(), src
        assert dest == f"/opt/hvctr/{src}", line
        if tracked is not None:
            assert src in tracked or any(t.startswith(src + "/") for t in tracked), src


def test_post_runs_hvctr_set_up_in_its_site_setting():
    _, sections = _sections()
    post = sections["post"]
    assert "HVCTR_SETUP=site" in post and "bash .ci/setup.sh" in post
    for pkg in ("openmpi-bin", "libopenmpi-dev", "python3-venv", "python3-dev", "build-essential"):
        assert pkg in post, pkg
    # the site setting must not reach for apt or Slurm itself: apt runs before it, here, only
    assert "slurm" not in post.lower()


@pytest.mark.parametrize("section", ["post", "test", "environment"])
def test_sections_parse_as_sh(section, tmp_path):
    _, sections = _sections()
    script = tmp_path / f"{section}.sh"
    script.write_text(sections[section])
    subprocess.run(["sh", "-n", str(script)], check=True)
    if shutil.which("shellcheck"):
        r = subprocess.run(["shellcheck", "-s", "sh", "-e", "SC2016", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout
