# shellcheck shell=bash
# The environment variables of hvctr's batch scripts all start with HVCTR_. sbatch exports the
# whole environment of the shell that submits, so a plain DATA, OUT or PYTHON set there for
# something else would silently steer a job. The unprefixed names of earlier versions are
# refused, naming the new one; slurm/*.sbatch source this file before anything else.

# old name -> new name
HVCTR_RENAMED=(
  DATA=HVCTR_DATA CONFIG=HVCTR_CONFIG RUN_DIR=HVCTR_RUN_DIR HWMAP=HVCTR_HWMAP
  MAX_REQUEUES=HVCTR_MAX_REQUEUES SPLIT=HVCTR_SPLIT INPUT=HVCTR_INPUT OUT=HVCTR_OUT
  SHARDS=HVCTR_SHARDS VALID_FRACTION=HVCTR_VALID_FRACTION VENV=HVCTR_VENV PYTHON=HVCTR_PYTHON
  RANK_WRAPPER=HVCTR_RANK_WRAPPER
)

# hvctr_refuse_old_names <script>: exits 2 when any old name is set, listing each with its new name.
hvctr_refuse_old_names() {
  local pair old found=()
  for pair in "${HVCTR_RENAMED[@]}"; do
    old=${pair%%=*}
    if [ -n "${!old+set}" ]; then found+=("$old -> ${pair#*=}"); fi
  done
  if [ "${#found[@]}" -gt 0 ]; then
    echo "$1: these variables are set but are no longer read; the scripts read HVCTR_-prefixed names:" >&2
    printf '  %s\n' "${found[@]}" >&2
    echo "$1: rename them (or unset them if they were meant for something else), and submit again" >&2
    exit 2
  fi
}
