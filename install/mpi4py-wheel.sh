#!/usr/bin/env bash
# Builds mpi4py (the version in install/constraints.txt) from its source release against the MPI
# whose mpicc is on PATH, once, and prints the directory that holds the wheel (the last line of
# stdout; everything else goes to stderr):
#
#   pip install --no-deps "$(install/mpi4py-wheel.sh .venv/bin/python)"/mpi4py-*.whl
#
# Why: PyPI's mpi4py wheels bring their own idea of which MPI library to load; on a cluster
# mpi4py should be compiled by the site's mpicc (after `module load`), as Horovod is. The C
# source is large: the build takes several minutes on 2 cores, hence the cache.
#
#   install/mpi4py-wheel.sh [PYTHON]     PYTHON: default python3 on PATH (an activated venv)
#
# - The wheel is cached per mpi4py version, Python version and MPI (a hash of `mpicc -show`, so
#   another MPI module gets its own build) in $HVCTR_CACHE/wheels (default
#   ~/.cache/hvctr/wheels), beside Horovod's. HVCTR_MPI4PY_REBUILD=1 builds again.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${1:-python3}
CONSTRAINTS="$HERE/constraints.txt"
CACHE=${HVCTR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvctr}
MPI4PY_VERSION=$(sed -n 's/^mpi4py==//p' "$CONSTRAINTS")

log() { printf '[mpi4py-wheel] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[ -n "$MPI4PY_VERSION" ] || die "no mpi4py==... line in $CONSTRAINTS"
command -v "$PY" >/dev/null 2>&1 || die "no Python '$PY' (pass the venv's python as the first argument)"
command -v mpicc >/dev/null 2>&1 || die "mpicc not found on PATH: load your site's MPI module (module load openmpi) or install OpenMPI >= 4 with its compiler wrappers"
mpi_id=$(mpicc -show 2>/dev/null) || die "mpicc -show failed: $(command -v mpicc) is not a working MPI compiler wrapper"
mpi_tag=$("$PY" -c 'import hashlib, sys; print(hashlib.sha256(sys.argv[1].encode()).hexdigest()[:12])' "$mpi_id")
py_tag=$("$PY" -c 'import sys; print("%d%d" % sys.version_info[:2])')
WHEEL_DIR="$CACHE/wheels/mpi4py-$MPI4PY_VERSION-py$py_tag-mpi$mpi_tag"

if [ "${HVCTR_MPI4PY_REBUILD:-0}" = 1 ] || ! ls "$WHEEL_DIR"/mpi4py-"$MPI4PY_VERSION"-*.whl >/dev/null 2>&1; then
  log "building mpi4py $MPI4PY_VERSION with $(command -v mpicc) ($mpi_id); several minutes on 2 cores"
  tmp="$WHEEL_DIR.tmp.$$"
  trap 'rm -rf "$tmp"' EXIT
  mkdir -p "$tmp"
  MPICC=$(command -v mpicc) "$PY" -m pip wheel -q --no-deps --no-binary=mpi4py -w "$tmp" "mpi4py==$MPI4PY_VERSION" >&2 \
    || die "building mpi4py $MPI4PY_VERSION against $(command -v mpicc) failed (output above)"
  printf '%s\n' "$mpi_id" > "$tmp/mpi.txt"
  # Published whole (rename): a concurrent or interrupted build never leaves half a wheel.
  rm -rf "$WHEEL_DIR" && mv "$tmp" "$WHEEL_DIR"
  log "built $(ls "$WHEEL_DIR"/*.whl)"
fi
echo "$WHEEL_DIR"
