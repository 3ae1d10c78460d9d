#!/bin/bash
# AsymLoop at LLaMA-2-7B dimensions on H100 nodes: 8 GPUs per node, TP=8 inside a node, data
# parallel across nodes, Transformer Engine FP8, ALRS. Submit from the repository root:
#
#   DATA=/lustre/fwe/fwe_text_document TOKENIZER=/lustre/tok/tokenizer.model \
#   IMAGE=/lustre/images/megaloop.sqsh sbatch --nodes 16 slurm/asymloop_7b.sh
#
# Preemption and time limits: SLURM sends SIGUSR1 10 minutes before the time limit (--signal);
# megaloop saves a checkpoint at the end of the current step and exits with 75, on which this
# script requeues the job; the next run resumes from checkpoint.dir automatically. --requeue also
# covers node failures and scheduler preemption.
#SBATCH --job-name=asymloop-7b
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=16
#SBATCH --time=48:00:00
#SBATCH --exclusive
#SBATCH --requeue
#SBATCH --signal=B:USR1@600
#SBATCH --output=%x-%j.out
set -euo pipefail

: "${DATA:?set DATA to the dataset prefix (or a blend file) from tools/preprocess_data.py}"
: "${TOKENIZER:?set TOKENIZER to the SentencePiece model}"
IMAGE="${IMAGE:-megaloop:latest}"
RUN_DIR="${RUN_DIR:-runs/asymloop_7b}"
mkdir -p "$RUN_DIR"

export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
export MASTER_PORT="${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
export CUDA_DEVICE_MAX_CONNECTIONS=1   # TP communication overlap in megatron-core
export NCCL_IB_TIMEOUT=22 TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export OMP_NUM_THREADS=8

# One task per GPU; megaloop reads SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID itself.
srun --container-image="$IMAGE" --container-mounts="$PWD:/workspace/megaloop,/lustre:/lustre" \
     --container-workdir=/workspace/megaloop --kill-on-bad-exit=1 \
  python -m megaloop.train --preset 7B --config examples/configs/asymloop_7b.yaml \
    data.path="[$DATA]" data.tokenizer_model="$TOKENIZER" \
    train.out_dir="$RUN_DIR" "$@" &
srun_pid=$!
# Forward SLURM's preemption signal to the tasks, then keep waiting until they have saved.
trap 'kill -USR1 "$srun_pid" 2>/dev/null' USR1
rc=0
while kill -0 "$srun_pid" 2>/dev/null; do
  wait "$srun_pid" && rc=0 || rc=$?
done
if [ "$rc" -eq 75 ]; then  # stopped early with a checkpoint: continue in a new allocation
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$rc"
