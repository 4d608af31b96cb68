#!/usr/bin/env bash
# Per-rank wrapper: exports the NIC of this rank's placement plan, then runs the command.
# The NIC cannot be chosen inside the process (MPI and Horovod connect before hvctr's placement
# runs), so the launcher names it per rank. hvctr checks the variables against its plan and warns.
#
#   HVCTR_HWMAP=slurm/hwmaps/dgx-a100.toml \
#   mpirun -np 8 --bind-to none slurm/hwmaps/rank_env.sh .venv/bin/python -m mpi4py -m hvctr train \
#       --config run.toml --topology.hwmap=slurm/hwmaps/dgx-a100.toml
#   srun --cpu-bind=none slurm/hwmaps/rank_env.sh python -m mpi4py -m hvctr train ...
#
# Exports HOROVOD_GLOO_IFACE, OMPI_MCA_btl_tcp_if_include, NCCL_SOCKET_IFNAME, UCX_NET_DEVICES
# and NCCL_IB_HCA (see `hvctr topo --exports --help`). Binding itself is done in-process by hvctr:
# keep --bind-to none / --cpu-bind=none, exactly one layer binds.
set -euo pipefail
: "${HVCTR_HWMAP:?set HVCTR_HWMAP to the hardware map (slurm/hwmaps/*.toml)}"
local_rank=${OMPI_COMM_WORLD_LOCAL_RANK:-${SLURM_LOCALID:-0}}
tasks=${SLURM_TASKS_PER_NODE:-1}  # "4(x2)" or "4,3": this node's count comes first
local_size=${OMPI_COMM_WORLD_LOCAL_SIZE:-${SLURM_NTASKS_PER_NODE:-${tasks%%[(,]*}}}
python=${HVCTR_PYTHON:-$1}  # the wrapped command starts with the python that has hvctr
exports=$("$python" -m hvctr topo --exports --map "$HVCTR_HWMAP" --local-rank "$local_rank" --local-size "$local_size")
eval "$exports"
exec "$@"
