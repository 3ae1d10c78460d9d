#!/bin/bash
# Shared by the slurm/ job scripts (sourced, not run): the rendezvous address, the container
# launch, the dry run and the requeue on preemption. Settings, all optional:
#   IMAGE           container image for srun --container-image (pyxis/enroot); unset: no container
#   MOUNTS          extra --container-mounts, e.g. /lustre:/lustre
#   GPUS_PER_NODE   default 8
#   DRY_RUN=1       print megaloop-train --dry-run (config, rank layout, memory) and exit; works
#                   outside an allocation, e.g. `DRY_RUN=1 NODES=16 bash slurm/asymloop_7b.sh`
#   NODES           node count for DRY_RUN outside an allocation (default 1)

GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
MEGALOOP_ROOT="${MEGALOOP_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
cd "$MEGALOOP_ROOT" || exit 1

# srun [--container-*] ...: runs a command on every task of the allocation.
megaloop_srun() {
  local container=()
  if [ -n "${IMAGE:-}" ]; then
    container=(--container-image="$IMAGE" --container-workdir=/workspace/megaloop
               --container-mounts="$MEGALOOP_ROOT:/workspace/megaloop${MOUNTS:+,$MOUNTS}")
  fi
  srun "${container[@]}" --kill-on-bad-exit=1 "$@"
}

# megaloop_train ARGS...: one task per GPU runs megaloop.train with ARGS; with DRY_RUN=1 one
# local process prints the dry run instead. SIGUSR1 from SLURM (--signal) is forwarded to the
# tasks, which save a checkpoint and exit 75; the job is then requeued and resumes.
megaloop_train() {
  if [ "${DRY_RUN:-0}" = 1 ]; then
    local nodes="${SLURM_NNODES:-${NODES:-1}}"
    python -m megaloop.train --dry-run --world-size "$((nodes * GPUS_PER_NODE))" "$@"
    return
  fi
  MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
  export MASTER_ADDR
  export MASTER_PORT="${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
  export CUDA_DEVICE_MAX_CONNECTIONS=1  # tensor-parallel communication overlap in megatron-core
  export NCCL_IB_TIMEOUT=22 TORCH_NCCL_ASYNC_ERROR_HANDLING=1
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
  # megaloop reads SLURM_PROCID / SLURM_STEP_NUM_TASKS / SLURM_LOCALID itself.
  megaloop_srun python -m megaloop.train "$@" &
  local srun_pid=$! rc=0
  trap 'kill -USR1 "$srun_pid" 2>/dev/null' USR1
  while kill -0 "$srun_pid" 2>/dev/null; do
    wait "$srun_pid" && rc=0 || rc=$?
  done
  if [ "$rc" -eq 75 ]; then  # stopped early with a checkpoint saved: continue in a new allocation
    scontrol requeue "$SLURM_JOB_ID"
    return 0
  fi
  return "$rc"
}
