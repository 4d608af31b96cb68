#!/usr/bin/env bash
# Builds Horovod 0.28.1 as a wheel for pip, once, and prints the directory that holds it (the
# last line of stdout; everything else goes to stderr):
#
#   pip install -c install/constraints.txt --find-links "$(install/horovod-wheel.sh)" .
#
# Why: Horovod 0.28.1, its last release, does not build against torch >= 2.1 as released (its
# CMakeLists ask for C++14, torch's headers need C++17, and C++20 from torch 2.15; C++17 was
# fixed upstream after the release), and PyPI has no Horovod wheels. This script downloads the
# sdist from PyPI, sets the C++ standard the installed torch's headers ask for in both
# CMakeLists.txt, and builds it with PyTorch, MPI and Gloo against the torch installed for
# PYTHON (pip --no-build-isolation: Horovod links against that torch).
#
#   install/horovod-wheel.sh [PYTHON]     PYTHON: default python3 on PATH (an activated venv)
#
# - PYTHON's environment gets what the build needs where it is missing: torch (the version in
#   install/constraints.txt), setuptools, wheel, packaging.
# - The wheel is cached per Horovod version, torch build and Python version, in
#   $HVCTR_CACHE/wheels (default ~/.cache/hvctr/wheels), which make setup shares: the second
#   call takes a second. HVCTR_HOROVOD_REBUILD=1 builds again.
# - Needs a C++ compiler, cmake >= 3.13 (else Horovod's setup fetches one from PyPI) and an MPI
#   with mpicc on PATH (the site's, after `module load`, is what Horovod will use). Any
#   HOROVOD_* build variable you set is passed on: for GPUs, HOROVOD_GPU_OPERATIONS=NCCL with a
#   CUDA build of torch (cached apart from the CPU build: the two are never mixed up).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${1:-python3}
HOROVOD_VERSION=0.28.1
CONSTRAINTS="$HERE/constraints.txt"
CACHE=${HVCTR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvctr}

log() { printf '[horovod-wheel] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

command -v "$PY" >/dev/null 2>&1 || die "no Python '$PY' (pass the venv's python as the first argument)"
pip_() { "$PY" -m pip "$@" >&2; }

if ! "$PY" -c "import torch" 2>/dev/null; then
  log "installing torch into $("$PY" -c 'import sys; print(sys.prefix)') (Horovod builds against it)"
  pip_ install -q -c "$CONSTRAINTS" torch
fi
torch_tag=$("$PY" -c "import torch; print(torch.__version__.replace('+', '_'))")
py_tag=$("$PY" -c 'import sys; print("%d%d" % sys.version_info[:2])')
# A GPU build (HOROVOD_GPU_OPERATIONS=NCCL) is cached apart from the CPU one: never reused for the other.
gpu_tag=""; [ -n "${HOROVOD_GPU_OPERATIONS:-}" ] && gpu_tag="-$(echo "$HOROVOD_GPU_OPERATIONS" | tr 'A-Z' 'a-z')"
WHEEL_DIR="$CACHE/wheels/horovod-$HOROVOD_VERSION-torch$torch_tag-py$py_tag$gpu_tag"

# The MPI a wheel was built against (mpicc -show: its include and library paths) is recorded
# beside it; a cached wheel from another MPI (another module loaded) is built again.
mpi_id=$(mpicc -show 2>/dev/null || true)
if [ -n "$mpi_id" ] && [ -f "$WHEEL_DIR/mpi.txt" ] && [ "$(cat "$WHEEL_DIR/mpi.txt")" != "$mpi_id" ]; then
  log "the cached wheel was built against another MPI ($(cat "$WHEEL_DIR/mpi.txt")): building for this one ($mpi_id)"
  HVCTR_HOROVOD_REBUILD=1
fi
if [ "${HVCTR_HOROVOD_REBUILD:-0}" = 1 ] || ! ls "$WHEEL_DIR"/horovod-$HOROVOD_VERSION-*.whl >/dev/null 2>&1; then
  command -v mpicc >/dev/null 2>&1 || die "no mpicc on PATH: install an MPI with its compiler wrappers (Debian: apt-get install libopenmpi-dev openmpi-bin; a cluster: module load openmpi or your site's MPI)"
  command -v "${CXX:-c++}" >/dev/null 2>&1 || die "no C++ compiler (${CXX:-c++}) on PATH"
  missing=""
  for m in setuptools wheel packaging; do "$PY" -c "import $m" 2>/dev/null || missing="$missing $m"; done
  # shellcheck disable=SC2086
  [ -z "$missing" ] || { log "installing the build's own needs:$missing"; pip_ install -q -c "$CONSTRAINTS" $missing; }
  # A CUDA build of torch (PyPI's only build of torch >= 2.14) makes Horovod's torch plugin a
  # CUDA one, whatever HOROVOD_GPU_OPERATIONS says: it needs the CUDA toolkit's headers and
  # cudart where torch looks (CUDA_HOME), and CMake's FindCUDAToolkit (CUDAToolkit_ROOT).
  torch_cuda=$("$PY" -c 'import torch; print(torch.version.cuda or "")' 2>/dev/null)
  if [ -n "$torch_cuda" ]; then
    cuda_home=$("$PY" -c 'from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME or "")' 2>/dev/null)
    [ -f "$cuda_home/include/cuda_runtime.h" ] || die "torch $torch_tag is a CUDA build (CUDA $torch_cuda), so Horovod's torch plugin needs the CUDA toolkit's headers and cudart, and ${cuda_home:-CUDA_HOME (unset)} has no include/cuda_runtime.h: load a toolkit (module load cuda) or set CUDA_HOME and CUDAToolkit_ROOT to one (docs/install.md, 'Another torch'), or install torch's CPU build"
    log "torch is a CUDA build (CUDA $torch_cuda): Horovod's torch plugin builds against the toolkit at $cuda_home"
  fi
  log "building Horovod $HOROVOD_VERSION against torch $torch_tag (about 5 minutes on 2 cores)"
  build=$(mktemp -d)
  trap 'rm -rf "$build" "$WHEEL_DIR.tmp.$$"' EXIT
  pip_ download -q --no-deps --no-binary :all: -d "$build" "horovod==$HOROVOD_VERSION"
  tar -xzf "$build/horovod-$HOROVOD_VERSION.tar.gz" -C "$build"
  src="$build/horovod-$HOROVOD_VERSION"
  # The fix: Horovod 0.28.1 asks for C++14; torch's headers need C++17 (torch >= 2.1) or C++20
  # (torch 2.15: ATen.h says which, "#error C++NN or later compatible compiler is required").
  aten=$("$PY" -c 'import torch.utils.cpp_extension as e, os; print(os.path.join(e.include_paths()[0], "ATen", "ATen.h"))' 2>/dev/null)
  cxx_std=$(grep -o 'C++[0-9]* or later' "$aten" 2>/dev/null | head -1 | tr -dc '0-9')
  case "$cxx_std" in 17|20|23) ;; *) cxx_std=17 ;; esac
  log "C++$cxx_std, as torch $torch_tag's headers need"
  sed -i "s/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD $cxx_std/" "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
  for f in "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"; do
    grep -q "CMAKE_CXX_STANDARD $cxx_std" "$f" || die "the C++$cxx_std patch did not apply to $f"
  done
  mkdir -p "$WHEEL_DIR.tmp.$$"
  # CMAKE_POLICY_VERSION_MINIMUM: CMake >= 4 refuses the cmake_minimum_required(< 3.5) of the
  # gloo Horovod vendors unless told which policies to assume (older CMake ignores it).
  # GCC >= 13 no longer includes <cstdint>, <string> and <stdexcept> through other standard
  # headers, which Horovod's sources relied on (group_table.h, common.h): included up front.
  CXXFLAGS="${CXXFLAGS:-} -include cstdint -include string -include stdexcept" \
  CMAKE_POLICY_VERSION_MINIMUM=${CMAKE_POLICY_VERSION_MINIMUM:-3.5} \
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
  HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="${MAKEFLAGS:--j$(nproc)}" \
    pip_ wheel -q --no-build-isolation --no-deps -w "$WHEEL_DIR.tmp.$$" "$src"
  printf '%s\n' "$mpi_id" > "$WHEEL_DIR.tmp.$$/mpi.txt"
  # Publish the directory whole (rename), so that a concurrent or interrupted build never
  # leaves a half-written wheel where pip looks.
  rm -rf "$WHEEL_DIR" && mv "$WHEEL_DIR.tmp.$$" "$WHEEL_DIR"
  log "built $(ls "$WHEEL_DIR")"
fi
echo "$WHEEL_DIR"
