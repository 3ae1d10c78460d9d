#!/bin/bash
# The paper's LLaMA-family runs (60M, 135M, 350M, 1B; sequence 1024, global batch 512, the step
# counts of He et al.'s LLR repository, AdamW 0.9/0.95, weight decay 0.1, clip 1.0, 10% warmup,
# cosine to 0.1 of the peak LR 1e-3) on one node of 8 GPUs, data parallel. Submit from the
# repository root, one job per size and architecture:
#
#   export DATA=/lustre/fwe/fwe_text_document TOKENIZER=/lustre/tok/t5.model
#   for preset in 60M 135M 350M 1B; do
#     for arch in dense fullloop asymloop; do
#       sbatch --job-name="$arch-$preset" slurm/train_paper.sh "$preset" "$arch"
#     done
#   done
#
# AsymLoop runs K=3 and Full Loop R=2 (effective depth 2L). A depth-matched Dense baseline doubles
# the layers, ALRS adds `train.use_alrs=true`, each in a run directory of its own (RUN_DIR; the
# default, runs/ARCH_PRESET, is the loop's run's):
#
#   RUN_DIR=runs/dense24_135M sbatch slurm/train_paper.sh 135M dense model.num_layers=24
#   RUN_DIR=runs/asymloop_alrs_135M sbatch slurm/train_paper.sh 135M asymloop train.use_alrs=true
#
# Extra arguments are megaloop-train overrides (not data.path, data.tokenizer_model or
# train.out_dir, which DATA, TOKENIZER and RUN_DIR set). DRY_RUN=1 prints what the job would run.
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
# 8 tasks x 12 CPUs = 96 of a DGX H100's 112 cores (2 x 56; SLURM allocates cores where it
# counts cores, not threads): 16 each (128) never scheduled; 14 (all 112) would not either on a
# cluster that keeps cores for its own daemons (CoreSpecCount).
#SBATCH --cpus-per-task=12
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@600
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
set -euo pipefail

# sbatch runs a copy of this script: the checkout is found from the directory it was submitted from.
ROOT="${MEGALOOP_ROOT:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}}"
[ -f "$ROOT/slurm/common.sh" ] || { echo "error: $ROOT/slurm/common.sh not found: submit from the megaloop" \
  "checkout (cd megaloop && sbatch slurm/...), or set MEGALOOP_ROOT to it" >&2; exit 2; }
# shellcheck source=slurm/common.sh
source "$ROOT/slurm/common.sh"
if [ $# -lt 2 ]; then
  echo "error: usage: train_paper.sh PRESET(60M|135M|350M|1B) ARCH(dense|fullloop|asymloop) [overrides]" >&2
  exit 2
fi
PRESET="$1" ARCH="$2"
shift 2
megaloop_require DATA "set DATA to the dataset prefix from tools/preprocess_data.py"
megaloop_require TOKENIZER "set TOKENIZER to the SentencePiece model (T5, vocabulary 32128 padded)"

declare -A STEPS=([60M]=3200 [135M]=5200 [350M]=13600 [1B]=40000)
declare -A MICRO_BATCH=([60M]=32 [135M]=32 [350M]=16 [1B]=8)
if [ -z "${STEPS[$PRESET]:-}" ]; then
  echo "error: PRESET=$PRESET: one of ${!STEPS[*]}" >&2
  exit 2
fi
megaloop_from_start_dir RUN_DIR TOKENIZER --blend DATA
megaloop_run_dir "runs/${ARCH}_${PRESET}" "$PRESET $ARCH" "$@"
megaloop_mounted DATA TOKENIZER RUN_DIR

MODEL_ARGS=(--preset "$PRESET" model.arch="$ARCH")
TRAINING_ARGS=(
  train.global_batch_size=512 train.micro_batch_size="${MICRO_BATCH[$PRESET]}"
  train.train_steps="${STEPS[$PRESET]}" train.lr=1e-3 train.min_lr_ratio=0.1
  train.warmup_fraction=0.1 train.weight_decay=0.1 train.clip_grad=1.0
  train.eval_interval=500
)
if [ "$ARCH" != dense ]; then  # Dense has no test-time depth (the config refuses eval_depths)
  TRAINING_ARGS+=(train.eval_depths="[1,3,5]")
fi
DATA_ARGS=(data.path="[$DATA]" data.tokenizer_model="$TOKENIZER")
OUTPUT_ARGS=(train.out_dir="$RUN_DIR" checkpoint.save_interval=500)

megaloop_train "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
