#!/usr/bin/env bash
# The GPU check without make (docs/gpus.md, "GPU check"): bash benchmarks/gpu_check.sh
# GPU_CHECK=standin runs it on the CPU stand-in; GPU_CHECK_OUT names the output folder;
# PYTHON the interpreter (python3). The whole run is killed after GPU_CHECK_TIMEOUT seconds
# (540: the check budgets itself 480, GPU_CHECK_BUDGET).
cd "$(dirname "$0")/.." || exit 1
exec timeout -k 10 "${GPU_CHECK_TIMEOUT:-540}" "${PYTHON:-python3}" benchmarks/gpu_check.py "$@"
