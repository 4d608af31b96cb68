#!/usr/bin/env bash
# Idempotent set-up: .venv, torch and the rest pinned by install/constraints.txt, Horovod built
# from its sdist with the C++17 fix by install/horovod-wheel.sh (cached outside the repository),
# and hvctr itself in editable mode (which builds its C kernels). Fast when everything is
# already there: each step checks first. Two settings (docs/install.md):
#
#   debian  root on Debian 12 (this project's CI): apt installs OpenMPI, PMIx, hwloc, numactl,
#           HDF5 tools, Slurm and munge first. Chosen when run as root where dpkg and apt-get exist.
#   site    anything else (no root, another distribution, a cluster login node): no apt, no sudo.
#           The site's MPI is the one whose mpicc is on PATH (after `module load`); mpi4py and
#           Horovod are built against it; Slurm is the site's own and is never installed. What
#           is missing (mpicc, mpirun, a C or C++ compiler, Python's venv) is named, then exit 1.
#
# HVCTR_SETUP=debian|site forces a setting (debian as non-root uses sudo). VENV (default .venv)
# and PYTHON (default python3) say where the venv goes and which Python builds it.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
export HVCTR_CACHE=${HVCTR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvctr}  # install/horovod-wheel.sh caches there
CONSTRAINTS=install/constraints.txt
HOROVOD_VERSION=$(sed -n 's/^horovod==//p' "$CONSTRAINTS")
PINNED_TORCH=$(sed -n 's/^torch==//p' "$CONSTRAINTS")
# HVCTR_TORCH=<version>: another torch than the pinned one (a GPU site's CUDA, the newest
# release): everything else stays pinned; Horovod is built against it (docs/install.md).
TORCH_VERSION=${HVCTR_TORCH:-$PINNED_TORCH}
APT_PACKAGES="openmpi-bin libopenmpi-dev libpmix-dev hwloc numactl hdf5-tools slurm-wlm munge shellcheck fio"

log() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }
# Any other failing step (pip, apt, a build) says where it stopped; its own output is above.
on_error() { printf '[setup] error: .ci/setup.sh stopped at line %s (exit %s): %s; its output is above\n' "$2" "$1" "$3" >&2; }
trap 'on_error $? $LINENO "$BASH_COMMAND"' ERR

if [ "$TORCH_VERSION" != "$PINNED_TORCH" ]; then
  CONSTRAINTS=$(mktemp)
  trap 'rm -f "$CONSTRAINTS"' EXIT
  grep -v '^torch==' install/constraints.txt > "$CONSTRAINTS"
  log "torch $TORCH_VERSION (HVCTR_TORCH), not the pinned $PINNED_TORCH"
fi

# --- which setting -------------------------------------------------------------------------
MODE=${HVCTR_SETUP:-}
if [ -z "$MODE" ]; then
  if [ "$(id -u)" -eq 0 ] && command -v dpkg-query >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    MODE=debian
  else
    MODE=site
  fi
fi
case "$MODE" in
  debian|site) log "setting: $MODE (HVCTR_SETUP=debian|site chooses)" ;;
  *) die "HVCTR_SETUP=$MODE: expected debian (apt packages; root on Debian 12) or site (the site's MPI and Slurm; no apt)" ;;
esac

# --- debian: apt packages ------------------------------------------------------------------
if [ "$MODE" = debian ]; then
  { command -v dpkg-query >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; } \
    || die "HVCTR_SETUP=debian needs dpkg-query and apt-get (Debian 12); elsewhere use HVCTR_SETUP=site"
  missing=""
  for p in $APT_PACKAGES; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
  done
  if [ -n "$missing" ]; then
    log "installing apt packages:$missing"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing
  fi
fi

# --- site: what the site must provide, all named at once -----------------------------------
if [ "$MODE" = site ]; then
  problems=()
  if ! command -v "$PY" >/dev/null 2>&1; then
    problems+=("Python '$PY' not found: load your site's Python module (module load python/3.11) or set PYTHON=/path/to/python3 (3.11 or newer)")
  elif ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    problems+=("$PY is Python $("$PY" -c 'import platform; print(platform.python_version())' 2>/dev/null || echo '?'); hvctr needs 3.11 or newer: load a newer Python module or set PYTHON")
  elif [ ! -x "$VENV/bin/python" ] && ! "$PY" -c 'import venv, ensurepip' 2>/dev/null; then
    problems+=("$PY cannot create a venv (no venv/ensurepip module): use a Python with them (Debian/Ubuntu: python3-venv)")
  fi
  if ! command -v mpicc >/dev/null 2>&1; then
    problems+=("mpicc not found on PATH: load your site's MPI module (module load openmpi) or install OpenMPI >= 4 with its compiler wrappers")
  else
    # The wrapper must build and link an MPI program: a module whose compiler is not loaded fails here.
    probe=$(mktemp -d)
    printf '#include <mpi.h>\nint main(int c, char **v) { MPI_Init(&c, &v); MPI_Finalize(); return 0; }\n' > "$probe/p.c"
    if ! out=$(mpicc "$probe/p.c" -o "$probe/p" 2>&1); then
      problems+=("mpicc ($(command -v mpicc)) cannot build an MPI program: ${out:0:400} (load the compiler module your MPI module was built with)")
    fi
    rm -rf "$probe"
  fi
  command -v mpirun >/dev/null 2>&1 || command -v mpiexec >/dev/null 2>&1 \
    || problems+=("mpirun not found on PATH: load your site's MPI module (module load openmpi), the one whose mpicc builds the venv")
  command -v "${CC:-cc}" >/dev/null 2>&1 \
    || problems+=("C compiler '${CC:-cc}' not found on PATH (hvctr's kernels and mpi4py build with it): module load gcc, or set CC")
  command -v "${CXX:-c++}" >/dev/null 2>&1 \
    || problems+=("C++ compiler '${CXX:-c++}' not found on PATH (Horovod builds with it): module load gcc, or set CXX")
  if [ ${#problems[@]} -gt 0 ]; then
    for p in "${problems[@]}"; do printf '[setup] missing: %s\n' "$p" >&2; done
    die "site set-up stops: ${#problems[@]} thing(s) missing (above); nothing was installed"
  fi
  log "MPI: $(command -v mpicc) ($(mpirun --version 2>/dev/null | head -n1 || echo 'version unknown'))"
  command -v cmake >/dev/null 2>&1 || log "no cmake on PATH: Horovod's build fetches one from PyPI (or: module load cmake)"
  if command -v srun >/dev/null 2>&1; then
    log "Slurm: the site's ($(command -v srun); $(srun --version 2>/dev/null || echo 'version unknown')); nothing installed"
  else
    log "no srun on PATH: jobs run under mpirun; for sbatch, load the site's Slurm (module load slurm). Slurm is never installed here"
  fi
fi

# --- venv and Python packages -------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
  # A venv left without the new pip and setuptools would be taken as made by the next run.
  "$VENV/bin/pip" install -q --upgrade pip wheel setuptools \
    || { rm -rf "$VENV"; die "could not install pip, wheel and setuptools into the new $VENV from PyPI (output above); removed it"; }
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
  TORCH_CHANGED=1  # a Horovod built against another torch would not load: installed again below
fi
# The site setting compiles mpi4py with the site's mpicc (never PyPI's binary wheel, which brings
# its own idea of the MPI library), once per MPI: install/mpi4py-wheel.sh caches it.
if [ "$MODE" = site ] && ! "$VPY" -c "import importlib.metadata as m; m.version('mpi4py')" 2>/dev/null; then
  MPI4PY_DIR=$(install/mpi4py-wheel.sh "$VPY")
  log "installing mpi4py built against $(command -v mpicc) from $MPI4PY_DIR"
  "$VENV/bin/pip" install -q --no-deps "$MPI4PY_DIR"/mpi4py-*.whl
fi
for spec in numpy h5py mpi4py pytest psutil cloudpickle pyyaml packaging matplotlib scikit-learn; do
  "$VPY" -c "import importlib.metadata as m; m.version('$spec')" 2>/dev/null || NEED="${NEED:-} $spec"
done
if [ -n "${NEED:-}" ]; then
  log "installing:${NEED}"
  # shellcheck disable=SC2086
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
if ! have horovod "$HOROVOD_VERSION" || [ "${HVCTR_HOROVOD_REBUILD:-0}" = 1 ] || [ "${TORCH_CHANGED:-0}" = 1 ]; then
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
if [ "$MODE" = site ]; then  # what the venv was built against: the site's MPI, under Horovod too
  "$VPY" -c "import horovod.torch as hvd, sys; sys.exit(0 if hvd.mpi_built() else 1)" \
    || die "Horovod in $VENV was built without MPI: check mpicc (module load openmpi), then HVCTR_HOROVOD_REBUILD=1 bash .ci/setup.sh"
  # Asked without MPI_Init: a login node may forbid it, and Open MPI's singleton init needs ssh.
  log "MPI library under mpi4py: $("$VPY" -c 'import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; print(MPI.Get_library_version().replace(chr(0), "").splitlines()[0].strip())')"
fi
log "ready: $("$VPY" -c 'import torch, horovod, h5py, mpi4py; print("torch", torch.__version__, "horovod", horovod.__version__, "h5py", h5py.__version__, "mpi4py", mpi4py.__version__)')"
