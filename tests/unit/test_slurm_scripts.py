"""The batch scripts' conventions (STYLE.md 14), checked statically; tests/e2e/test_slurm.py runs them."""

import re
import shutil
import subprocess

import pytest

from tests.conftest import REPO

SCRIPTS = sorted((REPO / "slurm").glob("*.sbatch"))
LAUNCH = "srun --mpi=pmix --cpu-bind=none --kill-on-bad-exit=1"


def srun_command(text: str) -> str:
    """The script's srun command line, its continuation lines joined."""
    lines = iter(text[text.index("\nsrun ") + 1:].splitlines())
    parts = [next(lines)]
    while parts[-1].endswith("\\"):
        parts[-1] = parts[-1][:-1].strip()
        parts.append(next(lines).strip())
    return " ".join(parts)


def test_the_scripts_exist():
    assert [p.name for p in SCRIPTS] == ["eval.sbatch", "prep.sbatch", "sweep.sbatch", "train.sbatch"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_conventions(script):
    text = script.read_text()
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert "set -euo pipefail" in text
    assert re.search(rf"\bsbatch\b[^\n]* slurm/{script.name}", text), "the header says how to submit"
    assert 'source "$env_file"' in text and "slurm/env/${HVCTR_ENV:-default}.sh" in text
    # One launch, through PMIx, unbound (hvctr binds), aborting the job when a rank fails.
    if "\nsrun " not in text:  # sweep.sbatch: hvctr sweep starts each trial's ranks with this srun
        assert LAUNCH in text and '"$@" &' in text
        return
    launch = srun_command(text)
    assert launch.startswith(LAUNCH) and "-m mpi4py -m" in launch
    assert launch.endswith('"$@" &' if script.name == "train.sbatch" else '"$@"'), launch  # overrides forwarded
    # Counts only in #SBATCH lines: srun takes the job's task count, never its own.
    assert not re.search(r"\s(-n|-N|--ntasks\S*|--nodes)[\s=]", launch), launch
    sbatch_lines = [l for l in lines if l.startswith("#SBATCH")]
    assert any("--ntasks-per-node" in l for l in sbatch_lines) and any("--time" in l for l in sbatch_lines)
    assert all(l.startswith("#") or "#SBATCH" not in l for l in lines)


def test_train_script_signal_and_requeue_contract():
    text = (REPO / "slurm" / "train.sbatch").read_text()
    assert "#SBATCH --signal=B:USR1@" in text and "#SBATCH --requeue" in text
    assert "trap forward_usr1 USR1" in text and 'kill -USR1 "$srun_pid"' in text
    assert '[ "$rc" = 75 ]' in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert "--resume" in text and "runs/$SLURM_JOB_NAME-$SLURM_JOB_ID" in text


@pytest.mark.parametrize("script", [*SCRIPTS, REPO / "slurm" / "env" / "default.sh"], ids=lambda p: p.name)
def test_bash_parses_it(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (make setup installs it)")
def test_shellcheck_clean():
    r = subprocess.run(["shellcheck", "-x", "-s", "bash", *map(str, SCRIPTS), "slurm/env/default.sh"],
                       cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_read_only_hvctr_prefixed_variables(script):
    # sbatch exports the submitting shell's environment: an unprefixed name set there for
    # something else would steer the job. Every script refuses the old names first.
    text = script.read_text()
    assert f"hvctr_refuse_old_names {script.name}" in text
    assert text.index("hvctr_refuse_old_names") < text.index('source "$env_file"')
    for old in ("DATA", "CONFIG", "OUT", "INPUT", "PYTHON", "HWMAP", "RUN_DIR", "SHARDS", "SPLIT"):
        # never read from the environment (a default or a required value); the scripts' own
        # shell variables of these names are set from the HVCTR_ ones
        assert not re.search(r"\$\{" + old + r"[:?+-]", text), (script.name, old)


def test_old_names_are_refused_with_the_new_ones_named():
    names = REPO / "slurm" / "names.sh"
    env = {"PATH": "/usr/bin:/bin", "OUT": "/x", "PYTHON": "/usr/bin/python3"}
    r = subprocess.run(["bash", "-c", f'source "{names}"; hvctr_refuse_old_names prep.sbatch; echo reached'],
                       env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "reached" not in r.stdout
    assert "OUT -> HVCTR_OUT" in r.stderr and "PYTHON -> HVCTR_PYTHON" in r.stderr
    ok = subprocess.run(["bash", "-c", f'source "{names}"; hvctr_refuse_old_names prep.sbatch; echo reached'],
                        env={"PATH": "/usr/bin:/bin", "HVCTR_OUT": "/x"}, capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.strip() == "reached"
