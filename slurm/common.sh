#!/bin/bash
# Shared by the slurm/ job scripts (sourced, not run): the rendezvous address, the container
# launch, the dry run and the requeue on preemption. Settings, all optional:
#   IMAGE           container image for srun --container-image (pyxis/enroot); unset: no container
#                   (training and conversion; preprocess.sh runs mpiexec and refuses it)
#   MOUNTS          extra --container-mounts, e.g. /lustre:/lustre
#   GPUS_PER_NODE   GPUs per node in DRY_RUN's world size and rank table (default 8); a job's
#                   own come from sbatch --ntasks-per-node / --gpus-per-node, one task per GPU
#   DRY_RUN=1       print megaloop-train --dry-run (config, rank layout, memory) and exit; works
#                   outside an allocation, e.g.
#                   `DRY_RUN=1 NODES=16 DATA=x TOKENIZER=x bash slurm/asymloop_7b.sh`
#                   (training scripts; preprocess.sh and convert.sh refuse it)
#   NODES           node count for DRY_RUN outside an allocation (default 1)

# Any other DRY_RUN (true, yes) would be read as "not a dry run" and start the real job.
case "${DRY_RUN:-0}" in
  0 | 1) ;;
  *) echo "error: DRY_RUN=$DRY_RUN: set DRY_RUN=1 for a dry run, or 0 (or unset) for the job" >&2
     exit 2 ;;
esac
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
MEGALOOP_ROOT="${MEGALOOP_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
cd "$MEGALOOP_ROOT" || exit 1

# srun's container options (pyxis/enroot), none without IMAGE.
CONTAINER=()
if [ -n "${IMAGE:-}" ]; then
  CONTAINER=(--container-image="$IMAGE" --container-workdir=/workspace/megaloop
             --container-mounts="$MEGALOOP_ROOT:/workspace/megaloop${MOUNTS:+,$MOUNTS}")
fi

# megaloop_srun [SRUN OPTIONS] COMMAND...: runs a command on every task of the allocation.
megaloop_srun() {
  srun ${CONTAINER[@]+"${CONTAINER[@]}"} "$@"
}

# megaloop_require NAME HOW: exits 2, the status of bad input, with one line saying HOW to set NAME
# when it is unset or empty (bash's ${NAME:?HOW} exits 1, naming the script's line).
megaloop_require() {
  if [ -z "${!1:-}" ]; then
    echo "error: $1 is not set: $2" >&2
    exit 2
  fi
}

# megaloop_no_dry_run: for the scripts without a dry run, so that DRY_RUN=1 never starts a real job.
megaloop_no_dry_run() {
  if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "error: DRY_RUN=1: $(basename "$0") has no dry run (the training scripts have one)" >&2
    exit 2
  fi
}

# megaloop_train ARGS...: one task per GPU runs megaloop.train with ARGS; with DRY_RUN=1 one
# local process prints the dry run instead. SIGUSR1 from SLURM (--signal) is forwarded to the
# tasks, which save a checkpoint and exit 75; the job is then requeued and resumes.
megaloop_train() {
  if [ "${DRY_RUN:-0}" = 1 ]; then
    local nodes="${SLURM_NNODES:-${NODES:-1}}"
    LOCAL_WORLD_SIZE="$GPUS_PER_NODE" \
      python -m megaloop.train --dry-run --world-size "$((nodes * GPUS_PER_NODE))" "$@"
    return
  fi
  if [ -z "${SLURM_JOB_NODELIST:-}" ]; then
    echo "error: not in a SLURM allocation (no SLURM_JOB_NODELIST): submit with sbatch, or set" \
         "DRY_RUN=1 to print the dry run" >&2
    exit 2
  fi
  MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
  export MASTER_ADDR
  export MASTER_PORT="${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
  export CUDA_DEVICE_MAX_CONNECTIONS=1  # tensor-parallel communication overlap in megatron-core
  export NCCL_IB_TIMEOUT=22 TORCH_NCCL_ASYNC_ERROR_HANDLING=1
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
  # megaloop reads SLURM_PROCID / SLURM_STEP_NUM_TASKS / SLURM_LOCALID itself.
  # Not --kill-on-bad-exit: after a stop signal every task exits 75 once the checkpoint is saved,
  # and srun would kill the tasks still exiting when the first one does; it then reports their
  # signal (128 + n, above 75) and the job would not be requeued. --wait ends the step this long
  # after its first task ends instead (a crashed rank's peers would otherwise hang in NCCL).
  # srun itself in the background, not megaloop_srun: $! would be the subshell running the
  # function, which SIGUSR1 kills (exit 138, srun orphaned, the tasks never told, no requeue).
  srun ${CONTAINER[@]+"${CONTAINER[@]}"} --kill-on-bad-exit=0 --wait=120 \
    python -m megaloop.train "$@" &
  local srun_pid=$! rc=0 interrupted=0
  trap 'interrupted=1; kill -USR1 "$srun_pid" 2>/dev/null' USR1
  while :; do  # wait returns early (128 + 10) when the trap runs: then wait again
    interrupted=0
    wait "$srun_pid" && rc=0 || rc=$?
    [ "$interrupted" = 1 ] || break
  done
  if [ "$rc" -eq 75 ]; then  # stopped early with a checkpoint saved: continue in a new allocation
    scontrol requeue "$SLURM_JOB_ID"
    return 0
  fi
  return "$rc"
}
