# hvctr: `make demo` runs the main job on built-in synthetic data; `make test` runs every test tier.
# Both run `make setup` first (apt packages, .venv, Horovod built once and cached).

PY      := .venv/bin/python
# Several ranks on 2 cores: oversubscribe, and yield when idle so a waiting rank gives its core away.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMPI_MCA_mpi_yield_when_idle := 1
export OMPI_MCA_btl_vader_single_copy_mechanism := none
export OMPI_MCA_rmaps_base_oversubscribe := 1
MPIRUN  := mpirun --bind-to none
PYTEST  := $(PY) -m pytest -q -p no:cacheprovider
DEMO_DIR ?= runs/demo

.PHONY: setup test test-unit test-mpi test-e2e demo clean

setup:
	@bash .ci/setup.sh

test: setup
	$(MAKE) --no-print-directory test-unit test-mpi test-e2e

test-unit:
	$(PYTEST) tests/unit

# The MPI tier runs twice: 2 ranks, and 3 so that uneven remainders show.
test-mpi:
	$(MPIRUN) -np 2 $(PY) -m mpi4py -m pytest -q -p no:cacheprovider --color=no tests/mpi
	$(MPIRUN) -np 3 $(PY) -m mpi4py -m pytest -q -p no:cacheprovider --color=no tests/mpi

test-e2e:
	$(PYTEST) tests/e2e

demo: setup
	@bash slurm/demo.sh $(DEMO_DIR)

clean:
	rm -rf runs build *.egg-info
