# shellcheck shell=bash
# Cluster specifics for hvctr's batch scripts (slurm/*.sbatch source this file at job start).
# Edit it for your site, or copy it to slurm/env/<site>.sh and submit with HVCTR_ENV=<site>.
# Every setting is a default: a variable already set in the submitting shell wins (sbatch
# exports the environment of the shell that submits, unless --export says otherwise).

# --- software ----------------------------------------------------------------------------
# Module systems (Lmod / environment modules): load what the venv was built against.
# module purge
# module load gcc/12 openmpi/4.1 pmix/4.2 hdf5/1.12
# module load cuda/12.4            # GPU nodes
#
# The Python that has hvctr, Horovod and mpi4py: the checkout's venv (`make setup`).
HVCTR_VENV=${HVCTR_VENV:-$HVCTR_HOME/.venv}
HVCTR_PYTHON=${HVCTR_PYTHON:-$HVCTR_VENV/bin/python}

# --- MPI / Horovod -----------------------------------------------------------------------
# srun starts the ranks through PMIx (Debian's OpenMPI has no PMI-2; `srun --mpi=list` shows
# what a cluster offers). Horovod takes rank and size from MPI, so nothing else is needed.
# Binding: exactly one layer binds. srun runs with --cpu-bind=none and hvctr pins each rank
# in-process from the hardware map (HVCTR_HWMAP below).
export HOROVOD_LOG_LEVEL=${HOROVOD_LOG_LEVEL:-warning}
# A rank that waits for a collective gives its core away: needed when ranks share cores
# (small test machines, oversubscribed nodes); costs a little latency on dedicated cores. On
# this project's 2-core VM, 2 ranks ran at 41k samples/s without it and 63k with it (their waits spin).
# export OMPI_MCA_mpi_yield_when_idle=1
# Containers without cross-memory attach (ptrace restrictions) need:
# export OMPI_MCA_btl_vader_single_copy_mechanism=none
# Bit-reproducible runs (resume equal to an uninterrupted run) pin OpenMPI's allreduce algorithm:
# export OMPI_MCA_coll_tuned_use_dynamic_rules=1 OMPI_MCA_coll_tuned_allreduce_algorithm=4

# --- node layout -------------------------------------------------------------------------
# The hardware map of this partition's node type (slurm/hwmaps/*.toml; `hvctr topo --out F`
# writes one). Empty: no placement; each rank runs its share of the node's cpus in torch threads
# (the cpus the job may use / tasks on the node, at most --cpus-per-task). "auto": discover at start.
HVCTR_HWMAP=${HVCTR_HWMAP:-}

# NIC hook: MPI and Horovod connect before hvctr's placement runs, so the NIC of each rank's
# plan is exported by a per-rank wrapper that srun starts in front of python. With a map
# file, slurm/hwmaps/rank_env.sh exports OMPI_MCA_btl_tcp_if_include, HOROVOD_GLOO_IFACE,
# NCCL_SOCKET_IFNAME, UCX_NET_DEVICES and NCCL_IB_HCA from the plan. Set HVCTR_RANK_WRAPPER=
# (empty) to switch it off, or to a script of your own (it gets the python command line to exec).
if [ -z "${HVCTR_RANK_WRAPPER+set}" ]; then
  HVCTR_RANK_WRAPPER=""
  if [ -n "$HVCTR_HWMAP" ] && [ "$HVCTR_HWMAP" != auto ]; then
    HVCTR_RANK_WRAPPER=$HVCTR_HOME/slurm/hwmaps/rank_env.sh
    export HVCTR_HWMAP
  fi
fi

# --- checks ------------------------------------------------------------------------------
if [ ! -x "$HVCTR_PYTHON" ]; then
  echo "slurm/env: $HVCTR_PYTHON not found: run \`make setup\` in $HVCTR_HOME or set HVCTR_VENV/HVCTR_PYTHON" >&2
  exit 2
fi
