#!/usr/bin/env bash
# The one-command device run of benchmarks/gpu_profile.py (one process, no mpiexec).
#
#   GPU_WHEELS=../.gpu-wheels bash benchmarks/gpu_profile.sh    # GPU node: $OUT/gpu-profile
#   GPU_PROFILE_STANDIN=1 PYTHON=.venv/bin/python bash benchmarks/gpu_profile.sh   # stand-in
#
# Installs the pure-Python wheels mpishard imports late (threadpoolctl, pytest-mpi) from
# GPU_WHEELS (default .gpu-wheels; skipped when absent) into a scratch folder that leads
# PYTHONPATH, then runs the profile (its first part: the fused kernels' float64 exactness
# tests) under `timeout GPU_PROFILE_TIMEOUT` (default 290 s) with --budget GPU_PROFILE_BUDGET
# (default 200 s), teeing everything to gpu_profile.log next to the JSON lines in
# GPU_PROFILE_OUT (default $OUT/gpu-profile where OUT is set, else gpu-profile-out).
# mpi4py is the Python's own (MPI's singleton init: one rank, no launcher); where that does
# not start (or GPU_PROFILE_MPIEXEC is set), all the carried wheels are installed and the
# profile runs under their mpiexec -n 1.
set -u
cd "$(dirname "$0")/.."
out=${GPU_PROFILE_OUT:-${OUT:+$OUT/gpu-profile}}
out=${out:-gpu-profile-out}
mkdir -p "$out"
py=${PYTHON:-$(command -v /opt/torch/.venv/bin/python3 || command -v python3)}
wheels=${GPU_WHEELS:-.gpu-wheels}
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
if compgen -G "$wheels/threadpoolctl-*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --target "$site" "$wheels"/threadpoolctl-*.whl \
        $(compgen -G "$wheels/pytest_mpi-*.whl") || echo "wheels: not installed (going on)"
fi
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
launch=()
if [ -n "${GPU_PROFILE_MPIEXEC:-}" ] ||
        ! timeout 60 "$py" -c "from mpi4py import MPI" >/dev/null 2>&1; then
    # no singleton MPI: the carried MPICH and its mpi4py (else the Python's) under mpiexec -n 1
    echo "gpu_profile: no singleton MPI from mpi4py: mpiexec -n 1"
    mpi="$site/mpi"
    "$py" -m pip install -q --no-index --no-deps --prefix "$mpi" "$wheels"/*.whl ||
        echo "gpu_profile: the wheels did not install"
    sp=$("$py" -c 'import sys; print("lib/python%d.%d/site-packages" % sys.version_info[:2])')
    export PYTHONPATH="$mpi/$sp:$PYTHONPATH"
    export LD_LIBRARY_PATH="$mpi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    mpiexec="$mpi/bin/mpiexec"
    [ -x "$mpiexec" ] || mpiexec=$(PATH="$(dirname "$py"):$PATH" command -v mpiexec)
    launch=("$mpiexec" -n 1 ${GPU_CHECK_MPIEXEC_FLAGS:-})
fi
echo "gpu_profile: python $py, out $out, $(date -u +%FT%TZ)" | tee "$out/gpu_profile.log"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null |
    tee -a "$out/gpu_profile.log"
timeout "${GPU_PROFILE_TIMEOUT:-290}" "${launch[@]}" "$py" benchmarks/gpu_profile.py --out "$out" \
    --budget "${GPU_PROFILE_BUDGET:-200}" ${GPU_PROFILE_STANDIN:+--standin} 2>&1 \
    | tee -a "$out/gpu_profile.log"
rc=${PIPESTATUS[0]}
echo "gpu_profile: exit $rc" | tee -a "$out/gpu_profile.log"
exit "$rc"
