#!/bin/bash
# Convert a training run's checkpoint (any tensor/pipeline layout) to a Hugging Face directory, for
# the LM Evaluation Harness or the Hub. One CPU task is enough (the 7B model needs about 60 GB of
# host memory). Submit from the repository root:
#
#   CHECKPOINT=runs/asymloop_7b/checkpoints OUT=hf/asymloop_7b sbatch slurm/convert.sh
#
# The looped models export with their modeling code (load with trust_remote_code=True); Dense
# exports to a native transformers class. Extra arguments go to tools/convert_checkpoint.py to-hf
# (e.g. --tokenizer FILE, or --no-tokenizer).
#SBATCH --job-name=convert
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=16
#SBATCH --mem=128G
#SBATCH --time=02:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

# sbatch runs a copy of this script: the checkout is found from the directory it was submitted from.
ROOT="${MEGALOOP_ROOT:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}}"
[ -f "$ROOT/slurm/common.sh" ] || { echo "error: $ROOT/slurm/common.sh not found: submit from the megaloop" \
  "checkout (cd megaloop && sbatch slurm/...), or set MEGALOOP_ROOT to it" >&2; exit 2; }
# shellcheck source=slurm/common.sh
source "$ROOT/slurm/common.sh"
megaloop_require CHECKPOINT "set CHECKPOINT to the checkpoint directory of a run, or one iter_NNNNNNN"
megaloop_require OUT "set OUT to the Hugging Face output directory"
megaloop_no_dry_run
megaloop_from_start_dir CHECKPOINT OUT
megaloop_mounted CHECKPOINT OUT

megaloop_srun python tools/convert_checkpoint.py to-hf "$CHECKPOINT" "$OUT" "$@"
