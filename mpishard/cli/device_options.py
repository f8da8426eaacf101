"""The device, precision and GPU-communication flags of every command that builds an engine.

train, bench, infer, generate and serve take `--device`, `--cuda-aware`, `--timeout`,
`--compute-dtype`, `--tf32` and `--gpu-comm`; `engine_options` turns them into make_engine's
keywords, refusing a contradictory combination with one UsageError that names the flags (no
MPI: the same on every rank, before any collective). plan and inspect, which build no engine,
take `--compute-dtype`, `--tf32` and `--device cpu|gpu` (`add_held_arguments`) to price the
run's memory.

How `--gpu-comm` and `--cuda-aware` relate (docs/gpus.md, "Choosing the GPU communication
path"): `--cuda-aware` is the MPI path's detail. `yes` is the mpi path (device arrays straight
to MPI), `no` is the staged path (through host memory), `auto` asks the library. Given with
`--gpu-comm auto`, `yes`/`no` choose that path; `--gpu-comm mpi --cuda-aware no` and
`--gpu-comm staged --cuda-aware yes` contradict each other. Under nccl, `--cuda-aware` says how
the device arrays NCCL does not carry (uneven blocks, all_to_all_v, dtypes NCCL lacks) reach
MPI.
"""
from __future__ import annotations

import numpy as np

from ..comm.backend import GPU_COMM
from ..costs.storage import storage_for
from ..health.watchdog import DEFAULT_TIMEOUT
from ..parallel.precision import COMPUTE_DTYPES, LOW
from .usage import UsageError

CUDA_AWARE = {"yes": True, "no": False, "auto": None}
"""--cuda-aware: hand device arrays to MPI directly (yes), stage through the host (no), or ask
the MPI library (auto, the default; see `inspect --env`)."""

CUDA_AWARE_FITS = {"auto": (None, True, False), "mpi": (None, True), "staged": (None, False),
                   "nccl": (None, True, False)}
"""The --cuda-aware answers (CUDA_AWARE values) that agree with each --gpu-comm path."""


def add_held_arguments(add) -> None:
    """plan's and inspect's --compute-dtype, --tf32 and --device through `add`: how the
    planned step holds its arrays (costs/storage.py), on the host that plans."""
    add("--compute-dtype", choices=COMPUTE_DTYPES, default=None,
        help="the run's --compute-dtype: a 16-bit one saves matmul inputs in 2 bytes on a GPU, "
        "and adds rounded float32 copies on the CPU (default: --dtype)")
    add("--tf32", action="store_true", help="the run's --tf32: on the CPU its rounded "
        "float32 copies")
    add("--device", choices=("cpu", "gpu"), default="cpu",
        help="where the run's arrays live (cpu, default): on a GPU, with a 16-bit "
        "--compute-dtype, 2-byte matmul inputs and the attention's log-sum-exp (plan's "
        "limit stays this host's memory unless --max-memory gives the GPU's)")


def held_compute(args) -> str:
    """The compute dtype a run's flags price (costs/storage.py): 'tf32' with --tf32, else
    --compute-dtype (None: --dtype's own)."""
    return "tf32" if getattr(args, "tf32", False) else getattr(args, "compute_dtype", None)


def held_storage(args, dtype, device: str):
    """costs/storage.py's Storage of a run of `dtype` with `args`' --compute-dtype or --tf32
    on `device`, after check_compute_flags (the flags' own UsageError first)."""
    check_compute_flags(getattr(args, "compute_dtype", None), getattr(args, "tf32", False),
                        np.dtype(dtype).name)
    return storage_for(dtype, held_compute(args), device)


def add_device_arguments(add, default="auto"):
    """--device, --cuda-aware, --timeout, --compute-dtype, --tf32 and --gpu-comm through `add`
    (a parser's or a group's add_argument); `default=None` leaves the defaults to the caller
    (train's --config merge)."""
    add("--device", choices=("auto", "cpu", "gpu"), default=default,
        help="arrays on cupy when a GPU is visible (auto, default), or forced")
    add("--cuda-aware", choices=tuple(CUDA_AWARE), default=default,
        help="the mpi path's detail: device arrays straight to MPI (yes, i.e. --gpu-comm mpi), "
        "staged through the host (no, i.e. --gpu-comm staged), or ask the MPI library (auto, "
        "default)")
    add("--timeout", type=float, metavar="SECONDS", default=None if default is None else
        DEFAULT_TIMEOUT, help="the longest any collective or receive may wait before every "
        f"waiting rank stops the job naming the late ranks ({DEFAULT_TIMEOUT:g}; 0: off)")
    add("--compute-dtype", choices=COMPUTE_DTYPES, default=None,
        help="matmul inputs and outputs, the activations saved for backward and the KV "
        "cache in 16 bits (bfloat16, or float16 with dynamic loss scaling in training), "
        "softmax, norms and the loss in --dtype float32, as torch.autocast: on a GPU 16-bit "
        "arrays and tensor-core GEMMs, on the CPU emulated (the numerics; float32's speed, and "
        "a little more than float32's memory: rounded copies; default: --dtype)")
    add("--tf32", action="store_true", default=None if default is None else False,
        help="float32 layer matmuls in TF32, PyTorch allow_tf32's numerics (on a GPU cuBLAS's "
        "TF32 tensor cores around each layer matmul only, on the CPU inputs rounded to TF32: "
        "docs/gpus.md; needs --dtype float32 and no 16-bit --compute-dtype; off by default)")
    add("--gpu-comm", choices=GPU_COMM, default=default,
        help="how device arrays travel between GPUs: nccl (opt-in, docs/gpus.md), mpi (a "
        "CUDA-aware MPI), staged (through host memory), or auto (default: mpi where the MPI "
        "is CUDA-aware, else staged)")


PRECISION_DTYPES = ("float32", "float64", "bfloat16", "float16")


def add_precision_arguments(add) -> None:
    """--param-dtype and --comm-dtype through `add` (train's model group, bench's parser);
    their defaults stay None: the run's --dtype (check_precision_flags)."""
    for flag, what in (("--param-dtype", "parameter storage (fsdp: all-gather)"),
                       ("--comm-dtype", "gradient communication (sums stay fp32)")):
        add(flag, choices=PRECISION_DTYPES, help=f"{what} dtype: bfloat16 or float16 (with "
            "--dtype float32; float16: dynamic loss scaling), or the run's --dtype (default)")


def check_precision_flags(param_dtype, comm_dtype, dtype: str) -> None:
    """UsageError unless each of --param-dtype/--comm-dtype is unset, the run's --dtype, or a
    16-bit dtype beside --dtype float32 (no MPI)."""
    for flag, value in (("--param-dtype", param_dtype), ("--comm-dtype", comm_dtype)):
        if value in (None, dtype):
            continue
        if value in ("float32", "float64"):
            raise UsageError(f"{flag} {value} must be bfloat16, float16 or the run's --dtype "
                             f"({dtype})")
        if dtype != "float32":
            raise UsageError(f"{flag} {value} needs --dtype float32, got --dtype {dtype}")


def gpu_comm_choice(gpu_comm: str, cuda_aware: str) -> tuple:
    """(gpu_comm, cuda_aware) for make_engine from --gpu-comm and --cuda-aware: with
    --gpu-comm auto, --cuda-aware yes/no picks the mpi/staged path; the staged path never
    hands device arrays to MPI. UsageError when the two contradict each other."""
    aware = CUDA_AWARE[cuda_aware]
    if aware not in CUDA_AWARE_FITS[gpu_comm]:
        raise UsageError(f"--gpu-comm {gpu_comm} contradicts --cuda-aware {cuda_aware}: "
                         f"--cuda-aware is the mpi path's detail (yes: --gpu-comm mpi, no: "
                         f"--gpu-comm staged); leave out one of them")
    if gpu_comm == "auto" and aware is not None:
        gpu_comm = "mpi" if aware else "staged"
    return gpu_comm, False if gpu_comm == "staged" else aware


def check_compute_flags(compute_dtype, tf32, dtype) -> None:
    """UsageError, naming the flags, unless --compute-dtype and --tf32 suit the run's dtype
    (`dtype`: --dtype, or the checkpoint's): the rules of parallel/precision.py's Precision."""
    dtype = np.dtype(dtype).name
    if compute_dtype not in (None, dtype) and dtype != "float32":
        raise UsageError(f"--compute-dtype {compute_dtype} needs --dtype float32 (master "
                         f"weights in float32, as under torch.autocast); the run's dtype is "
                         f"{dtype}")
    if tf32 and (dtype != "float32" or compute_dtype in LOW):
        raise UsageError(f"--tf32 applies to float32 matmuls: it needs --dtype float32 and no "
                         f"16-bit --compute-dtype; the run's dtype is {dtype}"
                         + (f", --compute-dtype {compute_dtype}" if compute_dtype else ""))


def engine_options(args, dtype) -> dict:
    """make_engine's device, communication and compute keywords from the flags in `args`,
    checked against the run's `dtype` (UsageError naming the flags; no MPI); `device_rank`
    where the command set args.device_rank (serve: a replica's rank among the job's)."""
    check_compute_flags(args.compute_dtype, args.tf32, dtype)
    gpu_comm, cuda_aware = gpu_comm_choice(args.gpu_comm, args.cuda_aware)
    return {"device": args.device, "cuda_aware": cuda_aware, "gpu_comm": gpu_comm,
            "compute_dtype": args.compute_dtype, "tf32": bool(args.tf32),
            "timeout": args.timeout, "device_rank": getattr(args, "device_rank", None)}


def precision_line(precision):
    """The log line of an engine whose matmuls do not compute in its dtype, else None."""
    if precision.matmul is not None:
        return (f"compute dtype {precision.matmul.name}: matmul inputs and outputs and the "
                f"activations saved for backward; softmax, norms and the loss in "
                f"{precision.compute.name}")
    return "tf32: float32 matmuls in TF32 (allow_tf32)" if precision.tf32 else None


def compute_text(precision) -> str:
    """How an engine's matmuls compute, for a log or report line: '' when in its dtype,
    ', compute bfloat16' for 16-bit matmuls, ', tf32' for TF32 ones."""
    if precision.matmul is not None:
        return f", compute {precision.matmul.name}"
    return ", tf32" if precision.tf32 else ""
