#!/usr/bin/env bash
# Prints install/constraints.txt for the environment of PYTHON (default .venv/bin/python): its
# pip freeze, less hvctr itself, with torch's local label (+cpu) and Horovod's local wheel path
# dropped so that the pins hold for any build of the same version.
#   install/constraints.sh .venv/bin/python > install/constraints.txt
set -euo pipefail
PY=${1:-.venv/bin/python}
cat <<'HEAD'
# What the tests ran with (make test on Debian 12, Python 3.11): pip install -c install/constraints.txt ...
# torch==2.13.0 matches its CPU (+cpu) and CUDA builds. horovod has no wheel on PyPI: build it
# once with install/horovod-wheel.sh and pass the directory it prints to pip as --find-links.
# Regenerate from a venv that passed make test: install/constraints.sh .venv/bin/python > install/constraints.txt
HEAD
"$PY" -m pip freeze --exclude-editable | grep -v -E '^#|^-e |^hvctr( |=|$)' \
  | sed -E -e 's/^(torch==[^+]*)\+.*/\1/' -e 's|^horovod @ .*/horovod-([0-9.]+)-.*|horovod==\1|' | LC_ALL=C sort -f
