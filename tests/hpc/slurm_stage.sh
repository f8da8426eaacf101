#!/usr/bin/env bash
# `make test-slurm`: a throwaway one-node Slurm runs the shipped examples/hpc/train.slurm.
#
#   tests/hpc/slurm_stage.sh VENV        (VENV: the venv the job activates, e.g. .venv)
#
# 1. Needs slurmctld, slurmd, sbatch and munged; when missing and running as root with apt-get,
#    installs Debian's `slurm-wlm munge` (no recommends). Otherwise it prints one line and exits
#    77: the stage is SKIPPED, never passed.
# 2. Everything lives in a fresh directory under /tmp: a random munge key, munged on its own
#    socket, a generated slurm.conf (own ports, state and spool directories, one node with
#    CPUs=8 and SlurmdParameters=config_overrides so 8 tasks fit on 2 cores). SLURM_CONF points
#    the clients at it; /etc/slurm and /etc/munge are never read or written.
# 3. Submits examples/hpc/train.slurm with sbatch, overriding only what the script documents
#    (sbatch -N 1 --ntasks-per-node=8, MPISHARD_VENV), waits with a deadline and checks the
#    job's metrics JSON (8 ranks, layout dp=2,tp=4, test accuracy > 0.9).
# 4. Submits a long run of the same script (MPISHARD_ARGS="--epochs 100000"), waits until its 8
#    ranks train, scancels it (SIGTERM: the ranks save a checkpoint and exit 75, no requeue)
#    and checks that no process of the job (ranks, srun, the batch shell) and no new,
#    unmapped /dev/shm/mpich_shm_* segment is left.
# 5. The preemption cycle: a 2-rank float64 job of the same script (MPISHARD_ARGS: a tiny model,
#    every step recorded) gets SIGUSR1 mid-run as Slurm's --signal=B:USR1 sends it (`scancel
#    --signal=USR1 --batch`); the batch shell forwards it, the ranks save and exit 75, the shell
#    requeues the job, and the requeued job (same id, `--resume auto`) completes: its losses
#    equal an uninterrupted run's (mpiexec -n 2, same arguments) bit for bit, its metrics JSON
#    lines hold every step once, its log shows the stop, the requeue and the resume.
# 6. Stops munged, slurmctld and slurmd by their pid files and removes the directory (trap).
# Exit 0: passed; 77: skipped (the reason on one line); anything else: failed.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VENV=$(cd "$ROOT" && cd "${1:-.venv}" 2>/dev/null && pwd) || {
    echo "==> test-slurm: FAILED: venv '${1:-.venv}' not found (make venv)"; exit 1; }
SCRIPT="$ROOT/examples/hpc/train.slurm"
JOB_DEADLINE=${SLURM_JOB_DEADLINE:-600}       # seconds from sbatch to the end of the first job
CANCEL_DEADLINE=${SLURM_CANCEL_DEADLINE:-60}  # seconds from scancel to no process left

say() { echo "==> test-slurm: $*"; }
skip() { say "SKIPPED: $*"; exit 77; }
fail() { say "FAILED: $*"; exit 1; }

# -- 1. the packages ----------------------------------------------------------------------------
need=(slurmctld slurmd sbatch squeue scancel scontrol sinfo munged)
missing() { local c; for c in "${need[@]}"; do command -v "$c" >/dev/null || return 0; done; return 1; }
if missing; then
    [ "$(id -u)" = 0 ] || skip "slurm-wlm/munge not installed and not root (cannot apt-get install them)"
    command -v apt-get >/dev/null || skip "slurm-wlm/munge not installed and no apt-get"
    say "installing slurm-wlm munge with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -q --no-install-recommends slurm-wlm munge >/tmp/mpishard-apt.log 2>&1; then
        apt-get update -q >>/tmp/mpishard-apt.log 2>&1
        apt-get install -y -q --no-install-recommends slurm-wlm munge >>/tmp/mpishard-apt.log 2>&1 \
            || skip "apt-get install slurm-wlm munge failed (see /tmp/mpishard-apt.log)"
    fi
    missing && skip "slurm-wlm/munge installed but a command is still missing: ${need[*]}"
fi
[ "$(id -u)" = 0 ] || skip "slurmd must run as root to start jobs; not root"

# -- 2. the throwaway cluster -------------------------------------------------------------------
TMP=$(mktemp -d /tmp/mpishard-slurm.XXXXXX)
chmod 700 "$TMP"
mkdir -p "$TMP"/{state,spool,log,job}
alive() {       # pid $1 exists and is not a zombie (an unreaped daemon counts as gone)
    local state
    state=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
    [ -n "$state" ] && [ "$state" != Z ]
}
stop_daemons() {
    local name pid i
    for name in slurmd slurmctld munged; do
        [ -s "$TMP/$name.pid" ] || continue
        pid=$(cat "$TMP/$name.pid")
        kill "$pid" 2>/dev/null || continue
        for i in $(seq 100); do alive "$pid" || break; sleep 0.1; done
        alive "$pid" && kill -9 "$pid" 2>/dev/null
    done
    if [ "${KEEP_SLURM_TMP:-0}" = 1 ]; then say "kept $TMP"; else rm -rf "$TMP"; fi
}
trap stop_daemons EXIT
trap 'exit 130' INT TERM

free_port() { "$VENV/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
CTLD_PORT=$(free_port); SLURMD_PORT=$(free_port)
while [ "$SLURMD_PORT" = "$CTLD_PORT" ]; do SLURMD_PORT=$(free_port); done
HOST=$(hostname -s)
NODE=mpishard-node

head -c 1024 /dev/urandom >"$TMP/munge.key"
chmod 400 "$TMP/munge.key"
munged --key-file="$TMP/munge.key" --socket="$TMP/munge.socket" --pid-file="$TMP/munged.pid" \
       --log-file="$TMP/log/munged.log" --seed-file="$TMP/munge.seed" --force \
    || fail "munged did not start: $(tail -n 3 "$TMP/log/munged.log" 2>/dev/null)"

export SLURM_CONF="$TMP/slurm.conf"
cat >"$SLURM_CONF" <<EOF
# Generated by tests/hpc/slurm_stage.sh: a throwaway one-node cluster, removed afterwards.
ClusterName=mpishard-test
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$TMP/munge.socket
StateSaveLocation=$TMP/state
SlurmdSpoolDir=$TMP/spool
SlurmctldPidFile=$TMP/slurmctld.pid
SlurmdPidFile=$TMP/slurmd.pid
SlurmctldLogFile=$TMP/log/slurmctld.log
SlurmdLogFile=$TMP/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
KillWait=10
InactiveLimit=0
MinJobAge=600
SlurmdParameters=config_overrides
NodeName=$NODE NodeHostname=$HOST NodeAddr=127.0.0.1 CPUs=8 Sockets=1 CoresPerSocket=8 ThreadsPerCore=1 RealMemory=1000 State=UNKNOWN
PartitionName=mpishard Nodes=$NODE Default=YES MaxTime=60 State=UP OverSubscribe=NO
EOF

slurmctld -f "$SLURM_CONF" -c || fail "slurmctld did not start: $(tail -n 5 "$TMP/log/slurmctld.log")"
slurmd -f "$SLURM_CONF" -N "$NODE" || fail "slurmd did not start: $(tail -n 5 "$TMP/log/slurmd.log")"
ready=0
for _ in $(seq 120); do
    state=$(sinfo -h -n "$NODE" -o %T 2>/dev/null | head -n 1)
    case "$state" in idle*) ready=1; break ;; esac
    sleep 0.5
done
[ "$ready" = 1 ] || fail "node not idle after 60 s (state '$state'): $(tail -n 5 "$TMP/log/slurmd.log")"
say "Slurm $(sinfo -V | awk '{print $2}') up in $TMP (ctld port $CTLD_PORT, node $NODE, CPUs=8 on $(getconf _NPROCESSORS_ONLN) cores)"

# -- helpers ------------------------------------------------------------------------------------
job_pids() {     # processes that belong to job $1 (SLURM_JOB_ID in their environment)
    local env pid
    for env in /proc/[0-9]*/environ; do
        pid=${env#/proc/}; pid=${pid%/environ}
        { tr '\0' '\n' <"$env" | grep -qx "SLURM_JOB_ID=$1"; } 2>/dev/null && echo "$pid"
    done
}
job_state() { scontrol show job "$1" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2; }
shm_new() {     # MPICH segments created since file $1 that no process maps (jobs beside this
    local seg   # stage, still running, hold theirs)
    find /dev/shm -maxdepth 1 -name 'mpich_shm_*' -newer "$1" 2>/dev/null | while read -r seg; do
        grep -qsF "$seg" /proc/[0-9]*/maps || echo "$seg"
    done
}
submit() {       # extra sbatch options...; prints the job id
    (cd "$TMP/job" && sbatch --parsable -N 1 --ntasks-per-node=8 \
        --export=ALL,MPISHARD_VENV="$VENV" "$@" "$SCRIPT") | cut -d';' -f1
}

# -- 3. the shipped script, to completion -------------------------------------------------------
t0=$(date +%s.%N)
job=$(submit) || fail "sbatch failed"
[ -n "$job" ] || fail "sbatch printed no job id"
say "job $job submitted: sbatch -N 1 --ntasks-per-node=8 --export=ALL,MPISHARD_VENV=$VENV examples/hpc/train.slurm"
state=
while :; do
    state=$(job_state "$job")
    case "$state" in COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL) break ;; esac
    if (( $(date +%s) - ${t0%.*} > JOB_DEADLINE )); then scancel "$job"; fail "job $job not done after $JOB_DEADLINE s (state $state)"; fi
    sleep 1
done
t_done=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
out="$TMP/job/slurm-$job.out"
if [ "$state" != COMPLETED ]; then
    cat "$out" 2>/dev/null | tail -n 30
    fail "job $job ended $state ($(scontrol show job "$job" | grep -o 'ExitCode=[0-9:]*'))"
fi
grep '^mpishard: MPI library' "$out"
metrics="$TMP/job/metrics-$job.json"
[ -s "$metrics" ] || fail "job $job COMPLETED but wrote no $metrics"
"$VENV/bin/python" - "$metrics" <<'EOF' || fail "metrics check failed for job $job"
import json, sys
m = json.load(open(sys.argv[1]))
print(f"==> test-slurm: metrics: world_size {m['world_size']}, layout {m['layout']}, "
      f"epochs {m['epochs']}, test accuracy {m['test_accuracy']:.4f}, final loss {m['final_loss']:.4f}")
assert m["world_size"] == 8 and m["layout"] == "dp=2,tp=4", m
assert m["test_accuracy"] > 0.9, m["test_accuracy"]
EOF
say "job $job: sbatch to COMPLETED in $t_done s"

# -- 4. a long run, cancelled -------------------------------------------------------------------
marker="$TMP/shm-marker"; touch "$marker"; sleep 1
# The documented MPISHARD_ARGS override, in the job's environment only.
job=$(MPISHARD_ARGS="--epochs 100000" submit --job-name=mpishard-cancel) \
    || fail "sbatch (long job) failed"
t_sub=$(date +%s)
ranks=0
while :; do
    ranks=0
    for pid in $(job_pids "$job"); do
        grep -qa 'mpishard' "/proc/$pid/cmdline" 2>/dev/null \
            && grep -qa -- '--epochs' "/proc/$pid/cmdline" && [ "$(head -c 6 "/proc/$pid/comm")" = python ] \
            && ranks=$((ranks + 1))
    done
    [ "$ranks" -ge 8 ] && [ -s "$TMP/job/slurm-$job.out" ] && break
    (( $(date +%s) - t_sub > JOB_DEADLINE )) && { scancel "$job"; fail "long job $job: $ranks of 8 ranks after $JOB_DEADLINE s"; }
    sleep 0.5
done
# Into training: the metrics stream's file appears at its first step (a SIGTERM inside MPI_Init,
# before any handler, would kill a rank the default way, leaving its segment).
while [ ! -e "$TMP/job/ckpt-$job.metrics.jsonl" ]; do
    (( $(date +%s) - t_sub > JOB_DEADLINE )) && { scancel "$job"; fail "long job $job: not training after $JOB_DEADLINE s"; }
    sleep 0.2
done
before=$(job_pids "$job" | wc -l)
t1=$(date +%s.%N)
scancel "$job" || fail "scancel $job failed"
gone=0
while :; do
    left=$(job_pids "$job")
    if [ -z "$left" ] && [ -z "$(squeue -h -j "$job" 2>/dev/null)" ]; then gone=1; break; fi
    (( $(date +%s) - ${t1%.*} > CANCEL_DEADLINE )) && break
    sleep 0.2
done
t_gone=$(awk -v a="$t1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
if [ "$gone" != 1 ]; then
    ps -o pid,args -p "$(echo "$left" | tr '\n' ',' | sed 's/,$//')" 2>/dev/null
    fail "job $job: processes left $CANCEL_DEADLINE s after scancel: $(echo "$left" | tr '\n' ' ')"
fi
sleep 1
leftover=$(shm_new "$marker")
if [ -n "$leftover" ]; then
    ls -l $leftover
    fail "job $job: /dev/shm segments left after scancel: $leftover"
fi
say "job $job: $before processes ($ranks ranks) running; scancel to all gone in $t_gone s; no rank, launcher or /dev/shm segment left"
# -- 5. preempted, requeued, resumed: bit for bit --------------------------------------------
# The script's own train arguments, then these (a later option wins): 2 ranks, a tiny float64
# model, every step recorded. The reference is the same command line under mpiexec, uninterrupted.
CYCLE_ARGS="--layout dp=2 --dataset synthetic-regression --model 16,32,1 --n-train 2048 --batch 64 --epochs 30 --dtype float64 --log-every 1 --no-progress"
# shellcheck disable=SC2086
(cd "$TMP/job" && OMP_NUM_THREADS=1 timeout 300 "$VENV/bin/mpiexec" -n 2 "$VENV/bin/python" -m mpi4py \
    -m mpishard train --dataset digits --layout dp=2,tp=4 --model 64,128,128,10 --epochs 10 \
    $CYCLE_ARGS --metrics-json "$TMP/job/reference.json" >"$TMP/job/reference.log" 2>&1) \
    || fail "the uninterrupted reference run failed: $(tail -n 5 "$TMP/job/reference.log")"
t_cycle=$(date +%s)
job=$(MPISHARD_ARGS="$CYCLE_ARGS" submit -N 1 --ntasks-per-node=2 --job-name=mpishard-requeue) \
    || fail "sbatch (requeue job) failed"
jsonl="$TMP/job/ckpt-$job.metrics.jsonl"        # the default beside the script's ckpt-$JOB_ID
last_step() { tail -n 1 "$jsonl" 2>/dev/null | "$VENV/bin/python" -c 'import json, sys
try: print(json.loads(sys.stdin.read())["step"])
except Exception: print(0)'; }
while [ "$(last_step)" -lt 60 ]; do
    (( $(date +%s) - t_cycle > JOB_DEADLINE )) && { scancel "$job"; fail "requeue job $job: no step 60 after $JOB_DEADLINE s (state $(job_state "$job"))"; }
    sleep 0.2
done
t_sig=$(date +%s.%N)
scancel --signal=USR1 --batch "$job" || fail "scancel --signal=USR1 --batch $job failed"
say "job $job: SIGUSR1 to the batch shell at step $(last_step) (as --signal=B:USR1@120 sends it)"
while :; do
    state=$(job_state "$job")
    restarts=$(scontrol show job "$job" 2>/dev/null | grep -o 'Restarts=[0-9]*' | cut -d= -f2)
    [ "$state" = COMPLETED ] && break
    case "$state" in FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL)
        tail -n 30 "$TMP/job/slurm-$job.out"; fail "requeue job $job ended $state" ;; esac
    (( $(date +%s) - t_cycle > JOB_DEADLINE )) && { scancel "$job"; tail -n 30 "$TMP/job/slurm-$job.out"; fail "requeue job $job not done after $JOB_DEADLINE s (state $state, restarts ${restarts:-?})"; }
    sleep 0.5
done
t_requeued=$(awk -v a="$t_sig" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
out="$TMP/job/slurm-$job.out"
grep -E 'SIGUSR1|stopped by|scontrol requeue|resumed from' "$out" | sed 's/^/    /'
[ "${restarts:-0}" = 1 ] || fail "requeue job $job: Restarts=${restarts:-?}, expected 1"
grep -q 'stopped by SIGUSR1 at step' "$out" || fail "requeue job $job: no 'stopped by SIGUSR1' line"
grep -q "scontrol requeue $job" "$out" || fail "requeue job $job: the batch shell did not requeue"
grep -q 'resumed from' "$out" || fail "requeue job $job: the requeued run did not resume"
"$VENV/bin/python" - "$TMP/job/reference.json" "$TMP/job/metrics-$job.json" "$jsonl" <<'EOF' \
    || fail "requeue job $job: not equal to the uninterrupted run"
import json, sys
ref, got = (json.load(open(p)) for p in sys.argv[1:3])
steps = [json.loads(s)["step"] for s in open(sys.argv[3]) if '"train"' in s]
n = len(ref["loss_history"])
assert got["loss_history"] == ref["loss_history"], "losses differ"      # float64, bit for bit
assert got["test_loss"] == ref["test_loss"] and got["steps"] == n == ref["steps"]
assert steps == list(range(1, n + 1)), f"metrics lines: {len(steps)} records, {len(set(steps))} steps"
print(f"==> test-slurm: requeued run == uninterrupted run: {n} float64 losses bit for bit, "
      f"final loss {got['final_loss']!r}, {n} metrics records, one per step")
EOF
say "job $job: SIGUSR1 -> checkpoint, exit 75, scontrol requeue -> resumed, COMPLETED $t_requeued s after the signal (Restarts=1)"
say "passed: sbatch-to-completion $t_done s, scancel-to-gone $t_gone s, signal-requeue-resume $t_requeued s"
