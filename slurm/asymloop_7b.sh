#!/bin/bash
# AsymLoop at LLaMA-2-7B dimensions on H100 nodes: 8 GPUs per node, TP=8 + sequence parallel inside
# a node, data parallel across nodes, Transformer Engine FP8, ALRS. Submit from the repository root:
#
#   DATA=/lustre/fwe/fwe_text_document TOKENIZER=/lustre/tok/tokenizer.model \
#   IMAGE=/lustre/images/megaloop.sqsh MOUNTS=/lustre:/lustre sbatch --nodes 16 slurm/asymloop_7b.sh
#
# Check first what it would do (config, which rank holds what, memory per GPU; no GPU needed):
#
#   DRY_RUN=1 NODES=16 DATA=x TOKENIZER=x bash slurm/asymloop_7b.sh
#
# Time limits: SLURM sends SIGUSR1 10 minutes before the time limit (--signal); megaloop saves a
# checkpoint at the end of the current step and exits with 75, on which the job is requeued; the
# next run resumes from its checkpoint directory. --requeue also covers node failures. Preemption
# sends SIGTERM, on which srun kills the tasks without a save (the requeued job resumes from the
# last periodic checkpoint) unless the cluster sends --signal on preemption (PreemptParameters=
# send_user_signal). `scancel --batch --signal=USR1 JOBID` stops the job with a save and a requeue.
# Extra arguments are megaloop-train overrides (section.field=value; not data.path,
# data.tokenizer_model or train.out_dir, which DATA, TOKENIZER and RUN_DIR set), a variant of the
# run, in a run directory of its own (RUN_DIR; the default, runs/asymloop_7b, is the run's without
# them), e.g. K=2 loop iterations rather than 3:
#
#   DATA=/lustre/fwe/fwe_text_document TOKENIZER=/lustre/tok/tokenizer.model \
#   IMAGE=/lustre/images/megaloop.sqsh MOUNTS=/lustre:/lustre RUN_DIR=runs/asymloop_7b_k2 \
#   sbatch --nodes 16 slurm/asymloop_7b.sh model.iterations=2
#SBATCH --job-name=asymloop-7b
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
# 8 tasks x 12 CPUs = 96 of a DGX H100's 112 cores (2 x 56; SLURM allocates cores where it
# counts cores, not threads): 16 each (128) never scheduled; 14 (all 112) would not either on a
# cluster that keeps cores for its own daemons (CoreSpecCount).
#SBATCH --cpus-per-task=12
#SBATCH --time=48:00:00
#SBATCH --exclusive
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
megaloop_require DATA "set DATA to the dataset prefix from tools/preprocess_data.py"
megaloop_require TOKENIZER "set TOKENIZER to the SentencePiece model"
megaloop_from_start_dir RUN_DIR TOKENIZER --blend DATA
megaloop_run_dir runs/asymloop_7b "7B AsymLoop" "$@"
megaloop_mounted DATA TOKENIZER RUN_DIR

TRAIN_ARGS=(
  --preset 7B --config examples/configs/asymloop_7b.yaml
  data.path="[$DATA]" data.tokenizer_model="$TOKENIZER"
  train.out_dir="$RUN_DIR"
)
megaloop_train "${TRAIN_ARGS[@]}" "$@"
