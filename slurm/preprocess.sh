#!/bin/bash
# Tokenize FineWeb-Edu (parquet or jsonl) into Megatron .bin/.idx files over MPI: every rank reads
# its share of the input files and the ranks merge one output, byte-identical to a single-process
# run. Submit from the repository root (CPU nodes suffice):
#
#   INPUT='/lustre/fineweb-edu/sample/10BT/*.parquet' OUTPUT=/lustre/fwe/fwe \
#   TOKENIZER=/lustre/tok/t5.model sbatch --nodes 4 slurm/preprocess.sh
#
# writes $OUTPUT_text_document.bin/.idx. mpiexec (the `mpi` extra's MPICH, or the system's) starts
# TASKS_PER_NODE ranks per node of the allocation (default: its tasks per node, --ntasks-per-node);
# each runs WORKERS tokenizer processes (default: its share of the node's CPUs, those of the
# allocation's smallest node divided by TASKS_PER_NODE). More workers in all than a node's CPUs
# are refused. Four ranks of 8 workers on each node of 32 CPUs:
#
#   INPUT='/lustre/fineweb-edu/sample/10BT/*.parquet' OUTPUT=/lustre/fwe/fwe \
#   TOKENIZER=/lustre/tok/t5.model sbatch --nodes 4 --ntasks-per-node 4 --cpus-per-task 8 \
#   slurm/preprocess.sh
#
# Extra arguments go to tools/preprocess_data.py (e.g. --min-int-score 3; --overwrite to replace the
# output of an earlier run, which is refused otherwise), but for those the variables above set
# (--input, --output-prefix, --tokenizer-model, --workers), which are refused.
#SBATCH --job-name=preprocess
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=32
#SBATCH --time=12:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

# sbatch runs a copy of this script: the checkout is found from the directory it was submitted from.
ROOT="${MEGALOOP_ROOT:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}}"
[ -f "$ROOT/slurm/common.sh" ] || { echo "error: $ROOT/slurm/common.sh not found: submit from the megaloop" \
  "checkout (cd megaloop && sbatch slurm/...), or set MEGALOOP_ROOT to it" >&2; exit 2; }
# shellcheck source=slurm/common.sh
source "$ROOT/slurm/common.sh"
megaloop_require INPUT "set INPUT to files, directories or globs of .parquet/.jsonl"
megaloop_require OUTPUT "set OUTPUT to the output prefix"
megaloop_require TOKENIZER "set TOKENIZER to the SentencePiece model"
megaloop_no_dry_run
if [ -n "${IMAGE:-}" ]; then  # mpiexec starts the ranks on the nodes themselves, not in IMAGE
  echo "error: IMAGE=$IMAGE: preprocess.sh runs mpiexec on the nodes, outside any container;" \
       "unset IMAGE and run it where megaloop is installed" >&2
  exit 2
fi
megaloop_from_start_dir INPUT OUTPUT TOKENIZER
megaloop_set_by_variables --input:INPUT --output-prefix:OUTPUT --tokenizer-model:TOKENIZER \
  --workers:WORKERS -- "$@"
TASKS_PER_NODE="${TASKS_PER_NODE:-${SLURM_NTASKS_PER_NODE:-1}}"
megaloop_whole_number TASKS_PER_NODE WORKERS
# Every node runs TASKS_PER_NODE ranks: their share is of the smallest node's CPUs.
megaloop_node_cpus
NODE_SOURCE="${SLURM_JOB_CPUS_PER_NODE:+SLURM_JOB_CPUS_PER_NODE=$SLURM_JOB_CPUS_PER_NODE}"
NODE_SOURCE="${NODE_SOURCE:-nproc, outside an allocation}"
# Refused, not warned about: every worker holds a tokenizer and its chunks, so an oversubscribed
# node runs the hours-long job slower and can run out of memory, while the warning line would sit
# unread in the job's log; the job has done nothing yet.
if [ -z "${WORKERS:-}" ]; then
  WORKERS="$(( NODE_CPUS / TASKS_PER_NODE ))"
  if [ "$WORKERS" -eq 0 ]; then
    echo "error: TASKS_PER_NODE=$TASKS_PER_NODE ranks per node, more than a node's $NODE_CPUS" \
         "CPUs ($NODE_SOURCE): set TASKS_PER_NODE to at most $NODE_CPUS" >&2
    exit 2
  fi
elif [ "$(( WORKERS * TASKS_PER_NODE ))" -gt "$NODE_CPUS" ]; then
  echo "error: WORKERS=$WORKERS x TASKS_PER_NODE=$TASKS_PER_NODE =" \
       "$(( WORKERS * TASKS_PER_NODE )) tokenizer processes per node," \
       "more than a node's $NODE_CPUS CPUs ($NODE_SOURCE): set WORKERS to at most" \
       "$(( NODE_CPUS / TASKS_PER_NODE )), or unset it for the ranks' share of the CPUs" >&2
  exit 2
fi

PREPROCESS_ARGS=(
  --input "$INPUT" --output-prefix "$OUTPUT"
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER"
  --append-eod --workers "$WORKERS"
)
# Ranks per node: MPICH's (and Intel MPI's) Hydra takes -ppn, which Open MPI's mpiexec refuses
# ("unknown option"); it takes --map-by ppr:N:node instead (Open MPI 4's OpenRTE and 5's alike),
# and --bind-to none: by default it binds each rank to one core (2 ranks or fewer) or one socket,
# and the rank's tokenizer processes with it (WORKERS of them on one core). A binding policy the
# user set (Open MPI 4's OMPI_MCA_hwloc_base_binding_policy, 5's PRTE_MCA_hwloc_default_binding_
# policy, e.g. package for a rank per socket) holds: the command line would override it. MPICH's
# Hydra binds nothing; Intel MPI's pins each rank (I_MPI_PIN, on by default) to a core of its own
# unless told otherwise: off as for Open MPI, unless an I_MPI_PIN* setting of the user's says how.
MPIEXEC_VERSION="$(mpiexec --version 2>&1)" || true
case "$MPIEXEC_VERSION" in
  *"Intel(R) MPI"*)
    PER_NODE=(-ppn "$TASKS_PER_NODE")
    if [ -z "$(compgen -v I_MPI_PIN)" ]; then export I_MPI_PIN=off; fi ;;
  *"Open MPI"* | *OpenRTE*)
    PER_NODE=(--map-by "ppr:$TASKS_PER_NODE:node")
    if [ -z "${OMPI_MCA_hwloc_base_binding_policy:-}${PRTE_MCA_hwloc_default_binding_policy:-}" ]
    then
      PER_NODE+=(--bind-to none)
    fi ;;
  *) PER_NODE=(-ppn "$TASKS_PER_NODE") ;;
esac
# $INPUT stays quoted: the tool expands globs itself, on every rank alike.
mpiexec -n "$(( ${SLURM_NNODES:-1} * TASKS_PER_NODE ))" "${PER_NODE[@]}" \
  python tools/preprocess_data.py "${PREPROCESS_ARGS[@]}" "$@"
