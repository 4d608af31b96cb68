#!/bin/bash
# GPU smoke test: the CUDA path on a machine with one GPU, in under 5 minutes.
#
#   tests/gpu/smoke.sh            (from the checkout; PYTHON= another interpreter [.venv/bin/python])
#
# Runs tests/gpu/test_cuda.py: the sparse optimiser's ops and a model step with device cuda
# (deterministic: CUBLAS_WORKSPACE_CONFIG=:4096:8), the trainer on cuda (hvctr simulate, 2 ranks),
# and 2 ranks of `hvctr train` under mpirun on the one GPU with a small table, killed after a
# checkpoint and resumed: bit-equal to an uninterrupted run; then bench.gpu_step, the planner's GPU
# step against this GPU's (BENCHMARKS.md, "The GPU step"). Where no CUDA GPU is visible it
# prints one line, "skipped: no CUDA GPU ...", and exits 0.
#
# Needs: torch with CUDA, Horovod built against that torch (with NCCL for GPU tensors:
# `make setup` builds it so where a GPU, the CUDA toolkit and nccl.h are found; without NCCL
# hvctr reduces GPU tensors through host memory), OpenMPI's mpirun.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}

if ! why=$("$PY" - <<'PYEOF' 2>&1
import sys
try:
    import torch
except Exception as e:  # no torch at all
    print(f"torch does not import ({e})"); sys.exit(1)
if not torch.cuda.is_available():
    print(f"torch {torch.__version__} sees none (CUDA build: {torch.version.cuda or 'no'})"); sys.exit(1)
print(torch.cuda.get_device_name(0))
PYEOF
); then
  echo "skipped: no CUDA GPU ($why)"
  exit 0
fi
echo "tests/gpu/smoke.sh: $why"
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
export OMPI_ALLOW_RUN_AS_ROOT=${OMPI_ALLOW_RUN_AS_ROOT:-1} OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-1}
start=$SECONDS
timeout 290 "$PY" -m pytest -q -p no:cacheprovider -rs tests/gpu/test_cuda.py
echo "tests/gpu/smoke.sh: passed in $((SECONDS - start)) s"
timeout 200 "$PY" -m bench.gpu_step --reps 30
