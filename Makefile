# mpishard: build, demo and test entry points.
#
#   make demo          train a small byte-level GPT on 4 MPI ranks (dp=2,tp=2), then sample from it
#   make demo-digits   train an MLP on scikit-learn digits on 4 MPI ranks (dp=2,tp=2)
#   make test          serial tests, then the MPI tests at 1, 2, 4 and 8 ranks
#   make soak          a long dp=2 run with checkpoints: memory flat, no request or fd leaked
#
# Every variable below can be overridden on the command line, for example
#   make test MPIEXEC=mpiexec MPIEXEC_FLAGS="-f hostfiles/localhost-mpich"
#   make test-4 MPIEXEC=mpirun MPIEXEC_FLAGS=--oversubscribe       # Open MPI
#   make test TEST_SIZES="1 2" TIMEOUT=300

PYTHON        ?= python3
VENV          ?= .venv
PY             = $(VENV)/bin/python
MPIEXEC       ?= $(VENV)/bin/mpiexec
MPIEXEC_FLAGS ?=
# Ranks for `make demo` and `make demo-digits`; the product of the --layout sizes in DEMO_ARGS
# (and DIGITS_ARGS) must equal NP.
NP            ?= 4
# Seconds allowed for each mpiexec / pytest run; killed 10 s after that if still alive.
TIMEOUT       ?= 900
TIMEOUT_CMD   ?= timeout -k 10 $(TIMEOUT)
# World sizes that `make test` runs the MPI tests at (each one is also a target: test-N).
TEST_SIZES    ?= 1 2 4 8
# One BLAS/OpenMP thread per rank: ranks share the cores, extra threads only oversubscribe.
BLAS_THREADS  ?= 1
BENCH_EXTRAS  ?= dev,bench
BENCH_TIMEOUT ?= 3600
# `make soak`: benchmarks/soak.py on SOAK_NP ranks (dp), not part of `make test`.
SOAK_NP       ?= 2
SOAK_ARGS     ?= --steps 10000 --checkpoint-every 500

# `make demo`: a GPT on the Python standard library's source (read from this interpreter,
# never downloaded), sized for about 2.5 minutes on 2 shared cores; then SAMPLE_ARGS on one rank.
DEMO_CKPT ?= demo-ckpt
DEMO_ARGS ?= train --model gpt --gpt d_model=96,n_heads=4,n_layers=3,seq_len=64 \
             --layout dp=2,tp=2 --optimizer adamw --lr 0.003 --schedule cosine --warmup 20 \
             --batch 32 --steps 400 --log-every 25 --no-progress \
             --checkpoint-dir $(DEMO_CKPT) --metrics-json demo-metrics.json
SAMPLE_ARGS ?= generate --checkpoint $(DEMO_CKPT) --prompt 'def ' --max-new-tokens 200 \
               --temperature 0.8 --top-k 40 --seed 0
# `make demo-digits`: the MLP on scikit-learn digits (a few seconds).
DIGITS_ARGS ?= train --dataset digits --layout dp=2,tp=2 --model 64,128,128,10 \
               --optimizer adamw --lr 0.003 --batch 64 --epochs 12 --clip 1.0 \
               --metrics-json demo-metrics.json

export OMP_NUM_THREADS      = $(BLAS_THREADS)
export OPENBLAS_NUM_THREADS = $(BLAS_THREADS)
export MKL_NUM_THREADS      = $(BLAS_THREADS)

STAMP     = $(VENV)/.installed
MPI_TESTS = $(addprefix test-,$(TEST_SIZES))
LINT_DIRS = $(wildcard mpishard tests examples benchmarks)

.PHONY: help venv install demo demo-digits test test-serial $(MPI_TESTS) soak bench lint clean

help:
	@echo "make venv | install   create $(VENV) and pip install -e '.[dev]' (MPICH wheel included)"
	@echo "make demo             $(NP)-rank GPT training (DEMO_ARGS), then a sample (SAMPLE_ARGS); metrics in demo-metrics.json"
	@echo "make demo-digits      $(NP)-rank MLP training on digits (DIGITS_ARGS), metrics in demo-metrics.json"
	@echo "make test             test-serial, then $(MPI_TESTS)"
	@echo "make test-serial      tests not marked mpi, plain pytest"
	@echo "make test-N           MPI tests on N ranks, N in TEST_SIZES=\"$(TEST_SIZES)\""
	@echo "make soak             benchmarks/soak.py on $(SOAK_NP) ranks (SOAK_ARGS): RSS growth, pending requests, fds"
	@echo "make bench            benchmarks/run_all.py"
	@echo "make lint             ruff check"
	@echo "make clean            remove $(VENV), build artefacts, caches and demo outputs"
	@echo "variables: PYTHON VENV MPIEXEC MPIEXEC_FLAGS NP TIMEOUT TEST_SIZES BLAS_THREADS DEMO_ARGS SAMPLE_ARGS DEMO_CKPT DIGITS_ARGS SOAK_NP SOAK_ARGS"

# --- environment -----------------------------------------------------------------------
$(STAMP): setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $@

venv: $(STAMP)

install: $(STAMP)

# --- demo ------------------------------------------------------------------------------
demo: $(STAMP)
	@echo "==> demo: $(NP) ranks: mpishard $(DEMO_ARGS)"
	$(TIMEOUT_CMD) $(MPIEXEC) $(MPIEXEC_FLAGS) -n $(NP) $(PY) -m mpi4py -m mpishard $(DEMO_ARGS)
	@echo "==> demo: a sample from the trained model: mpishard $(SAMPLE_ARGS)"
	$(TIMEOUT_CMD) $(MPIEXEC) $(MPIEXEC_FLAGS) -n 1 $(PY) -m mpi4py -m mpishard $(SAMPLE_ARGS)

demo-digits: $(STAMP)
	@echo "==> demo-digits: $(NP) ranks: mpishard $(DIGITS_ARGS)"
	$(TIMEOUT_CMD) $(MPIEXEC) $(MPIEXEC_FLAGS) -n $(NP) $(PY) -m mpi4py -m mpishard $(DIGITS_ARGS)

# --- tests -----------------------------------------------------------------------------
# Runs every stage even after a failure, then fails if any stage failed.
test: $(STAMP)
	@failed=""; \
	for stage in test-serial $(MPI_TESTS); do \
	    $(MAKE) --no-print-directory $$stage || failed="$$failed $$stage"; \
	done; \
	if [ -n "$$failed" ]; then echo "==> FAILED:$$failed"; exit 1; fi; \
	echo "==> all test stages passed: test-serial $(MPI_TESTS)"

test-serial: $(STAMP)
	@echo "==> test-serial: pytest without MPI (tests not marked mpi)"
	$(TIMEOUT_CMD) $(PY) -m pytest -q -m "not mpi" tests

# test-1, test-2, ...: -p no:cacheprovider keeps the ranks from racing on .pytest_cache.
$(MPI_TESTS): test-%: $(STAMP)
	@echo "==> test-$*: MPI tests on $* rank(s), timeout $(TIMEOUT) s"
	$(TIMEOUT_CMD) $(MPIEXEC) $(MPIEXEC_FLAGS) -n $* $(PY) -m mpi4py -m pytest -q --with-mpi -m mpi -p no:cacheprovider tests

# --- soak (not in `make test`) ---------------------------------------------------------
soak: $(STAMP)
	@echo "==> soak: $(SOAK_NP) ranks: benchmarks/soak.py $(SOAK_ARGS)"
	$(TIMEOUT_CMD) $(MPIEXEC) $(MPIEXEC_FLAGS) -n $(SOAK_NP) $(PY) -m mpi4py benchmarks/soak.py $(SOAK_ARGS)

# --- benchmarks and lint ---------------------------------------------------------------
bench: $(STAMP)
	$(PY) -m pip install -q -e '.[$(BENCH_EXTRAS)]'
ifneq ($(wildcard benchmarks/run_all.py),)
	@echo "==> bench: benchmarks/run_all.py, timeout $(BENCH_TIMEOUT) s"
	timeout -k 10 $(BENCH_TIMEOUT) $(PY) benchmarks/run_all.py --mpiexec "$(MPIEXEC) $(MPIEXEC_FLAGS)"
else
	@echo "==> bench: benchmarks/run_all.py not found, nothing to run"
endif

lint: $(STAMP)
	$(PY) -m ruff check $(LINT_DIRS)

# --- cleaning --------------------------------------------------------------------------
clean:
	rm -rf $(VENV) build dist .eggs *.egg-info .pytest_cache .ruff_cache
	rm -f demo-metrics.json
	rm -rf $(DEMO_CKPT) $(DEMO_CKPT).old
	find . -path ./.git -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +
	find . -path ./.git -prune -o -type d -name '*.egg-info' -prune -exec rm -rf {} +
