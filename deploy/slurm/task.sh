#!/bin/bash
# One SLURM task of a flexpar job; flexpar.sbatch and join.sbatch start it with srun:
#
#   srun deploy/slurm/task.sh SCRIPT [SCRIPT ARGUMENTS...]
#
# FLEXPAR_ROLE=auto (the default): task 0 (SLURM_PROCID 0) runs the job on its node with
#   `flexpar run`, listening on FLEXPAR_PORT; every other task joins it at the allocation's first
#   node, FLEXPAR_ADDRESS=HEAD:FLEXPAR_PORT. With one task per node, task 0 runs on that node.
# FLEXPAR_ROLE=join: every task joins the running job at FLEXPAR_ADDRESS (join.sbatch).
#
# Settings (environment; these names are read by these scripts, flexpar itself reads only
# FLEXPAR_ADDRESS and FLEXPAR_SECRET_FILE of them):
#   FLEXPAR_SECRET_FILE       the job's secret, on a filesystem every node sees (required)
#   FLEXPAR_PORT              the coordinator's port (flexpar.sbatch: 20000 + job id % 10000)
#   FLEXPAR_DEVICES_PER_TASK  devices each task adds (default: the node's GPUs, else 1)
#   FLEXPAR_MAX_DEVICES       the most devices the job may grow to (default 16)
#   FLEXPAR_CHECKPOINT_DIR    checkpoints, on a shared filesystem (default: none)
#   FLEXPAR_CHECKPOINT_EVERY  steps between checkpoints (default 100)
#   FLEXPAR_METRICS           the metrics file (default: metrics.jsonl in FLEXPAR_CHECKPOINT_DIR, so that
#                             a requeued job continues it; without a checkpoint directory, under runs/)
#   FLEXPAR_JOIN_WAIT         seconds a joining task waits for the job's port (default 600, 0: none)
#
#   FLEXPAR_RESUME            1: continue the run whose checkpoints FLEXPAR_CHECKPOINT_DIR holds, even
#                             another job's (default: only this job's own, see below)
#
# Task 0 records the job's identity (SLURM's job id) in FLEXPAR_CHECKPOINT_DIR/.flexpar-job when it
# starts or resumes a run there. If the folder already holds a checkpoint (step-*.pt), it adds
# --resume only when that file names this job (a requeued job keeps its SLURM_JOB_ID) or
# FLEXPAR_RESUME=1: a new job sent into a folder that holds another job's checkpoints runs without
# --resume, and `flexpar run` refuses it as it refuses any fresh run there (one line first says why).
#
# SIGTERM (SLURM's preemption or time-limit notice, see --signal in flexpar.sbatch) reaches
# flexpar directly (SLURM signals every process of a task): to a joining task it is a planned leave
# at the next step boundary; to task 0 it stops the job at the next step boundary with a final
# checkpoint. When task 0's `flexpar run` ends, it sends SIGTERM to the step's other tasks.
set -eu

if [ "$#" -lt 1 ]; then
    echo "usage: srun $0 SCRIPT [SCRIPT ARGUMENTS...]" >&2
    exit 2
fi
script=$1
: "${FLEXPAR_SECRET_FILE:?set FLEXPAR_SECRET_FILE to the file holding the job secret, on a shared filesystem}"
port=${FLEXPAR_PORT:-29500}
devices=${FLEXPAR_DEVICES_PER_TASK:-${SLURM_GPUS_ON_NODE:-1}}
role=${FLEXPAR_ROLE:-auto}

if [ "$role" = auto ] && [ "${SLURM_PROCID:-0}" = 0 ]; then
    # flexpar's flags first, then the script and its own arguments (as with torchrun).
    flags=(--host 0.0.0.0 --port "$port" --devices "$devices"
           --max-devices "${FLEXPAR_MAX_DEVICES:-16}" --secret-file "$FLEXPAR_SECRET_FILE")
    if [ -n "${FLEXPAR_CHECKPOINT_DIR:-}" ]; then
        flags+=(--checkpoint-every "${FLEXPAR_CHECKPOINT_EVERY:-100}" --checkpoint-dir "$FLEXPAR_CHECKPOINT_DIR")
        flags+=(--metrics "${FLEXPAR_METRICS:-$FLEXPAR_CHECKPOINT_DIR/metrics.jsonl}")
        identity_file="$FLEXPAR_CHECKPOINT_DIR/.flexpar-job"
        identity="slurm ${SLURM_JOB_ID:-}"
        if ! compgen -G "$FLEXPAR_CHECKPOINT_DIR/step-*.pt" >/dev/null; then
            mkdir -p "$FLEXPAR_CHECKPOINT_DIR" && printf '%s\n' "$identity" >"$identity_file"
        elif [ "${FLEXPAR_RESUME:-}" = 1 ] || { [ -n "${SLURM_JOB_ID:-}" ] &&
            [ "$(cat "$identity_file" 2>/dev/null)" = "$identity" ]; }; then
            flags+=(--resume)
            printf '%s\n' "$identity" >"$identity_file"
        else
            recorded=$(cat "$identity_file" 2>/dev/null || true)
            echo "$0: $FLEXPAR_CHECKPOINT_DIR holds the checkpoints of ${recorded:-a job that recorded no identity}," \
                "not of this job (${identity}): not resumed (FLEXPAR_RESUME=1 continues that run)" >&2
        fi
    elif [ -n "${FLEXPAR_METRICS:-}" ]; then
        flags+=(--metrics "$FLEXPAR_METRICS")
    fi
    # Not exec: when the job ends (finished, failed, stopped), the step's other tasks end too. One
    # still waiting for the job's port would otherwise hold the allocation for FLEXPAR_JOIN_WAIT
    # seconds after a script that fails at once; devices that outlived a crashed driver have written
    # its last committed step by then, and leave on SIGTERM (on SLURM no driver comes back to them but
    # a requeue's). flexpar gets SIGTERM from SLURM itself, which signals every process of a task:
    # this shell only outlives it (the trap) to clean up after.
    trap : TERM
    status=0
    flexpar run "${flags[@]}" "$@" || status=$?
    if [ "${SLURM_NTASKS:-1}" -gt 1 ] && [ -n "${SLURM_STEP_ID:-}" ]; then
        scancel --quiet --signal=TERM "$SLURM_JOB_ID.$SLURM_STEP_ID" || true
    fi
    exit "$status"
fi

if [ "$role" = auto ]; then
    head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
    export FLEXPAR_ADDRESS="$head:$port"
elif [ "$role" != join ]; then
    echo "$0: FLEXPAR_ROLE must be auto or join, not '$role'" >&2
    exit 2
fi
: "${FLEXPAR_ADDRESS:?set FLEXPAR_ADDRESS=HOST:PORT of the running job}"
# Task 0 may still be importing torch and the script: wait (FLEXPAR_JOIN_WAIT seconds, default
# 600; 0 to not wait) until the coordinator's port accepts connections, rather than fail the join.
wait_s=${FLEXPAR_JOIN_WAIT:-600}
deadline=$((SECONDS + wait_s))
while [ "$wait_s" -gt 0 ] && ! (exec 3<>"/dev/tcp/${FLEXPAR_ADDRESS%:*}/${FLEXPAR_ADDRESS##*:}") 2>/dev/null; do
    if [ "$SECONDS" -ge "$deadline" ]; then
        echo "$0: $FLEXPAR_ADDRESS did not answer within $wait_s s; trying to join anyway" >&2
        break
    fi
    sleep 1
done
# No address argument: flexpar join reads FLEXPAR_ADDRESS.
exec flexpar join --devices "$devices" --secret-file "$FLEXPAR_SECRET_FILE" --script "$script"
