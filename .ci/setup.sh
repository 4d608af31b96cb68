#!/usr/bin/env bash
# Idempotent set-up for a Debian 12 machine: apt packages, .venv, torch and the rest pinned by
# install/constraints.txt, Horovod built from its sdist with the C++17 fix by
# install/horovod-wheel.sh (cached outside the repository), and hvctr itself in editable mode
# (which builds its C kernels). Fast when everything is already there: each step checks first.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
export HVCTR_CACHE=${HVCTR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvctr}  # install/horovod-wheel.sh caches there
CONSTRAINTS=install/constraints.txt
HOROVOD_VERSION=$(sed -n 's/^horovod==//p' "$CONSTRAINTS")
TORCH_VERSION=$(sed -n 's/^torch==//p' "$CONSTRAINTS")
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
  "$VENV/bin/pip" install -q -c "$CONSTRAINTS" "torch==$TORCH_VERSION"
fi
for spec in numpy h5py mpi4py pytest psutil cloudpickle pyyaml packaging matplotlib scikit-learn; do
  "$VPY" -c "import importlib.metadata as m; m.version('$spec')" 2>/dev/null || NEED="${NEED:-} $spec"
done
if [ -n "${NEED:-}" ]; then
  log "installing:${NEED}"
  "$VENV/bin/pip" install -q -c "$CONSTRAINTS" ${NEED}
fi

# --- GPU: Horovod with NCCL where a GPU, the CUDA toolkit and NCCL's headers are all here ---
# Needs: nvidia-smi listing a GPU; the CUDA toolkit (nvcc on PATH or CUDA_HOME); nccl.h under
# NCCL_HOME/include, CUDA_HOME/include, /usr/include or /usr/local/cuda/include, with libnccl.so
# beside it (Debian/Ubuntu: libnccl-dev; clusters: module load nccl; the nvidia-nccl wheel torch
# brings has no libnccl.so to link against). Then HOROVOD_GPU_OPERATIONS=NCCL and where NCCL is
# go to install/horovod-wheel.sh. A HOROVOD_GPU_OPERATIONS you set wins.
nccl_home() {
  local d
  for d in "${NCCL_HOME:-}" "${CUDA_HOME:-}" /usr /usr/local/cuda; do
    [ -n "$d" ] && [ -f "$d/include/nccl.h" ] && { echo "$d"; return 0; }
  done
  return 1
}
if [ -z "${HOROVOD_GPU_OPERATIONS:-}" ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  if ! { command -v nvcc >/dev/null 2>&1 || [ -n "${CUDA_HOME:-}" ]; }; then
    log "GPU found, but no CUDA toolkit (nvcc on PATH or CUDA_HOME): Horovod is built without NCCL (module load cuda, then HVCTR_HOROVOD_REBUILD=1 make setup)"
  elif NCCL_DIR=$(nccl_home); then
    nccl_so=$(find "$NCCL_DIR"/lib* "$NCCL_DIR"/lib/*-linux-gnu -maxdepth 1 -name 'libnccl.so*' 2>/dev/null | head -n1 || true)
    export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_INCLUDE="$NCCL_DIR/include"
    [ -z "$nccl_so" ] || export HOROVOD_NCCL_LIB="${nccl_so%/*}"
    log "GPU, CUDA toolkit and NCCL ($NCCL_DIR) found: Horovod is built with HOROVOD_GPU_OPERATIONS=NCCL"
  else
    log "GPU found, but no nccl.h (NCCL_HOME, CUDA_HOME, /usr, /usr/local/cuda): Horovod is built without NCCL; install NCCL (libnccl-dev, or module load nccl and set NCCL_HOME), then HVCTR_HOROVOD_REBUILD=1 make setup"
  fi
fi

# --- Horovod from source, cached (install/horovod-wheel.sh: the one place that knows the fix) ---
if ! have horovod "$HOROVOD_VERSION" || [ "${HVCTR_HOROVOD_REBUILD:-0}" = 1 ]; then
  WHEEL_DIR=$(install/horovod-wheel.sh "$VPY")
  log "installing Horovod from $WHEEL_DIR"
  "$VENV/bin/pip" install -q --no-deps --force-reinstall "$WHEEL_DIR"/horovod-*.whl
fi

# --- hvctr itself -------------------------------------------------------------------------
# The editable install builds the C kernels in place (setup.py); a checkout whose kernel sources
# changed since (a stale or missing library: native.lib() raises) installs again.
if ! [ -x "$VENV/bin/hvctr" ] || ! "$VPY" -c "import importlib.metadata as m; m.version('hvctr')" 2>/dev/null \
   || ! "$VPY" -c "from hvctr.kernels import native; native.lib()" 2>/dev/null; then
  log "installing hvctr (editable; builds its C kernels)"
  "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e .
fi
log "ready: $("$VPY" -c 'import torch, horovod, h5py, mpi4py; print("torch", torch.__version__, "horovod", horovod.__version__, "h5py", h5py.__version__, "mpi4py", mpi4py.__version__)')"
