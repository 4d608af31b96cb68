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

.PHONY: setup bench-setup test test-unit test-mpi test-e2e demo docs clean

# Root on Debian: apt packages first; otherwise (no root, no apt) the site's MPI from `mpicc` on
# PATH, no apt, no sudo, no Slurm of its own. HVCTR_SETUP=debian|site forces one (docs/install.md).
setup:
	@bash .ci/setup.sh

# setup installed Slurm and munge: the Slurm tests (tests/e2e/test_slurm.py) must run, not skip.
test: setup
	HVCTR_REQUIRE_SLURM=1 $(MAKE) --no-print-directory test-unit test-mpi test-e2e

test-unit:
	$(PYTEST) tests/unit

# The MPI tier runs twice: 2 ranks, and 3 so that uneven remainders show. Then, with 4 ranks in
# 2 virtual nodes, the hierarchical dense merge against the flat allreduce. All of it once on
# each engine (distributed.backend: Horovod, then torch.distributed through HVCTR_BACKEND).
test-mpi:
	for backend in horovod torch; do \
	  HVCTR_BACKEND=$$backend $(MPIRUN) -np 2 -x HVCTR_BACKEND $(PY) -m mpi4py -m pytest -q -p no:cacheprovider --color=no tests/mpi && \
	  HVCTR_BACKEND=$$backend $(MPIRUN) -np 3 -x HVCTR_BACKEND $(PY) -m mpi4py -m pytest -q -p no:cacheprovider --color=no tests/mpi && \
	  HVCTR_BACKEND=$$backend $(MPIRUN) -np 4 -x HVCTR_BACKEND $(PY) -m mpi4py -m pytest -q -p no:cacheprovider --color=no tests/mpi/test_hierarchical.py \
	  || exit 1; \
	done

# Whole jobs, including the sbatch scripts on a real Slurm cluster started on this machine (root)
# and a 4-rank job on 2 nodes made of network and UTS namespaces (root; tests/e2e/test_two_nodes.py).
test-e2e:
	$(PYTEST) tests/e2e

# The main job on built-in synthetic data: generate, preprocess, train 2 ranks (k = 4), evaluate,
# then the run's picture, $(DEMO_DIR)/run/report.png.
demo: setup
	@rm -rf $(DEMO_DIR) && mkdir -p $(DEMO_DIR)/raw
	$(PY) -m data_prep synth --rows 600000 --seed 7 --out $(DEMO_DIR)/raw/synth.tsv --truth-out $(DEMO_DIR)/raw/truth.txt
	$(PY) -m data_prep criteo --input $(DEMO_DIR)/raw/synth.tsv --out $(DEMO_DIR)/data --shards 4 --valid-fraction 0.1
	$(MPIRUN) -np 2 $(PY) -m mpi4py -m hvctr train --config slurm/configs/demo.toml \
	    --data.train_dir=$(DEMO_DIR)/data --train.run_dir=$(DEMO_DIR)/run
	$(MPIRUN) -np 2 $(PY) -m mpi4py -m hvctr eval --run-dir $(DEMO_DIR)/run
	$(PY) -m hvctr report --run-dir $(DEMO_DIR)/run

# The peers bench.train and bench.baseline measure hvctr against (TorchRec on fbgemm's CPU build),
# as setup.cfg's bench extra says: torchrec itself without its dependencies, which name the CUDA build.
bench-setup: setup
	$(PY) -m pip install -q -c install/constraints.txt torch==$$($(PY) -c 'import torch; print(torch.__version__.split("+")[0])') \
	    $$($(PY) -c 'import configparser; c = configparser.ConfigParser(); c.read("setup.cfg"); print(" ".join(c["options.extras_require"]["bench"].split()))')
	$(PY) -m pip install -q --no-deps torchrec==1.8.0

# docs/configuration.md from the comments in hvctr/config/__init__.py (a unit test checks it is current).
docs:
	$(PY) -m hvctr config --markdown > docs/configuration.md

clean:
	rm -rf runs build *.egg-info
