#!/usr/bin/env bash
# Idempotent set-up for a Debian 12 machine: apt packages, .venv, torch, Horovod built from its
# sdist with the C++17 fix (cached outside the repository), and hvctr itself in editable mode.
# Fast when everything is already there: each step checks before it works.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
CACHE=${HVCTR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvctr}
HOROVOD_VERSION=0.28.1
TORCH_VERSION=2.13.0
APT_PACKAGES="openmpi-bin libopenmpi-dev libpmix-dev hwloc numactl hdf5-tools slurm-wlm munge shellcheck"

log() { printf '[setup] %s\n' "$*"; }

# --- apt ---------------------------------------------------------------------------------
missing=""
for p in $APT_PACKAGES; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  log "installing apt packages:$missing"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing
fi

# --- venv and Python packages -------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip wheel setuptools
fi
VPY="$VENV/bin/python"
have() { "$VPY" -c "import importlib.metadata as m, sys; sys.exit(0 if m.version('$1').startswith('$2') else 1)" 2>/dev/null; }

if ! have torch "$TORCH_VERSION"; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    log "CUDA GPU found: installing torch==$TORCH_VERSION (CUDA build)"
  else
    log "installing torch==$TORCH_VERSION (CPU wheel)"
  fi
  "$VENV/bin/pip" install -q "torch==$TORCH_VERSION"
fi
for spec in numpy h5py mpi4py pytest psutil cloudpickle pyyaml packaging matplotlib scikit-learn; do
  "$VPY" -c "import importlib.metadata as m; m.version('$spec')" 2>/dev/null || NEED="${NEED:-} $spec"
done
if [ -n "${NEED:-}" ]; then
  log "installing:${NEED}"
  "$VENV/bin/pip" install -q ${NEED}
fi

# --- Horovod from source, cached ----------------------------------------------------------
torch_tag=$("$VPY" -c "import torch; print(torch.__version__.replace('+', '_'))")
WHEEL_DIR="$CACHE/wheels/horovod-$HOROVOD_VERSION-torch$torch_tag-py$("$VPY" -c 'import sys; print("%d%d" % sys.version_info[:2])')"
if ! have horovod "$HOROVOD_VERSION"; then
  if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
    log "building Horovod $HOROVOD_VERSION from its sdist (about 5 minutes on 2 cores)"
    build=$(mktemp -d)
    trap 'rm -rf "$build"' EXIT
    "$VENV/bin/pip" download -q --no-deps --no-binary :all: -d "$build" "horovod==$HOROVOD_VERSION"
    tar -xzf "$build"/horovod-$HOROVOD_VERSION.tar.gz -C "$build"
    src="$build/horovod-$HOROVOD_VERSION"
    # Horovod 0.28.1 asks for C++14; torch >= 2.1 headers need C++17 (fixed upstream after the release).
    sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt" || { echo "C++17 patch did not apply" >&2; exit 1; }
    mkdir -p "$WHEEL_DIR.tmp"
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
      "$VENV/bin/pip" wheel -q --no-build-isolation --no-deps -w "$WHEEL_DIR.tmp" "$src"
    rm -rf "$WHEEL_DIR" && mv "$WHEEL_DIR.tmp" "$WHEEL_DIR"
  fi
  log "installing Horovod from $WHEEL_DIR"
  "$VENV/bin/pip" install -q --no-deps "$WHEEL_DIR"/horovod-*.whl
fi

# --- hvctr itself -------------------------------------------------------------------------
if ! [ -x "$VENV/bin/hvctr" ] || ! "$VPY" -c "import importlib.metadata as m; m.version('hvctr')" 2>/dev/null; then
  log "installing hvctr (editable)"
  "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e .
fi
log "ready: $("$VPY" -c 'import torch, horovod, h5py, mpi4py; print("torch", torch.__version__, "horovod", horovod.__version__, "h5py", h5py.__version__, "mpi4py", mpi4py.__version__)')"
