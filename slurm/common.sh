#!/bin/bash
# Shared by the slurm/ job scripts (sourced, not run): the rendezvous address, the container
# launch, the dry run and the requeue on preemption. Settings, all optional:
#   IMAGE           container image for srun --container-image (pyxis/enroot); unset: no container
#                   (training and conversion; preprocess.sh runs mpiexec and refuses it)
#   MOUNTS          extra --container-mounts, e.g. /lustre:/lustre; the job's absolute paths
#                   (DATA, TOKENIZER, RUN_DIR, ...) must lie under one (megaloop_mounted)
#   GPUS_PER_NODE   GPUs per node in DRY_RUN's world size and rank table (default 8); a job's
#                   own come from sbatch --ntasks-per-node / --gpus-per-node, one task per GPU
#                   (a job given another GPUS_PER_NODE, or other counts of the two, is refused)
#   DRY_RUN=1       print megaloop-train --dry-run (config, rank layout, memory) and exit; works
#                   outside an allocation, e.g.
#                   `DRY_RUN=1 NODES=16 DATA=x TOKENIZER=x bash slurm/asymloop_7b.sh`
#                   (training scripts; preprocess.sh and convert.sh refuse it); with IMAGE, in
#                   the image inside an allocation, on the host's interpreter outside one
#   NODES           node count for DRY_RUN (default: the allocation's, outside one 1); a job
#                   given another than its allocation's (sbatch --nodes) is refused
# Relative paths in the scripts' variables (DATA, RUN_DIR, OUT, ...) are read from the directory
# the script started in (a job's submit directory), those among extra arguments from the checkout.

# Any other DRY_RUN (true, yes) would be read as "not a dry run" and start the real job.
case "${DRY_RUN:-0}" in
  0 | 1) ;;
  *) echo "error: DRY_RUN=$DRY_RUN: set DRY_RUN=1 for a dry run, or 0 (or unset) for the job" >&2
     exit 2 ;;
esac
GPUS_PER_NODE_GIVEN="${GPUS_PER_NODE:-}"  # a job checks it against its allocation
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
# Absolute: it is the container's mount source.
MEGALOOP_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
# Where the script was started (a job: sbatch's submit directory, or its --chdir), which the
# relative paths a user gives are read from (megaloop_from_start_dir); the commands run from the
# checkout. Both physical (pwd -P): a checkout reached through a link is still the checkout.
MEGALOOP_START_DIR="$(pwd -P)"
cd "$MEGALOOP_ROOT" || exit 1

# srun's container options (pyxis/enroot), none without IMAGE. MEGALOOP_CONTAINER_MOUNTS, the
# mount points inside the container (the checkout's, MOUNTS' destinations: SRC[:DST[:FLAGS]]),
# colon-separated, goes to the tasks: there megaloop-train refuses a run directory, such as one a
# --config file names, on the container's root or a tmpfs (megaloop.training.run_dir, which reads
# the container's mounts, the site's too); megaloop_mounted checks the script's against MOUNTS.
CONTAINER=()
if [ -n "${IMAGE:-}" ]; then
  CONTAINER=(--container-image="$IMAGE" --container-workdir=/workspace/megaloop
             --container-mounts="$MEGALOOP_ROOT:/workspace/megaloop${MOUNTS:+,$MOUNTS}")
  MEGALOOP_CONTAINER_MOUNTS=/workspace/megaloop
  IFS=, read -ra MEGALOOP_ENTRIES <<< "${MOUNTS:-}"
  for MEGALOOP_ENTRY in ${MEGALOOP_ENTRIES[@]+"${MEGALOOP_ENTRIES[@]}"}; do
    IFS=: read -r MEGALOOP_SRC MEGALOOP_DST _ <<< "$MEGALOOP_ENTRY"
    MEGALOOP_DST="${MEGALOOP_DST:-$MEGALOOP_SRC}"
    MEGALOOP_CONTAINER_MOUNTS+=":${MEGALOOP_DST%/}"
  done
  export MEGALOOP_CONTAINER_MOUNTS
else  # one from the submitting shell (sbatch exports it) would refuse the host's run directories
  unset MEGALOOP_CONTAINER_MOUNTS
fi

# The job's CPUs per task (#SBATCH --cpus-per-task) for its srun steps: since Slurm 22.05 srun no
# longer takes them from the job (SLURM_CPUS_PER_TASK), and each task got one CPU, its threads and
# data loader workers on one core without a word.
TASK_CPUS=()
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
  TASK_CPUS=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
fi

# megaloop_srun [SRUN OPTIONS] COMMAND...: runs a command on every task of the allocation.
megaloop_srun() {
  megaloop_python_ready
  srun ${CONTAINER[@]+"${CONTAINER[@]}"} ${TASK_CPUS[@]+"${TASK_CPUS[@]}"} "$@"
}

# megaloop_python_ready [--host]: without IMAGE the tasks run the interpreter on this node's PATH
# (srun passes the job's environment on), and so does a dry run outside an allocation whatever
# IMAGE (--host): exits 2 in one line when it cannot import torch, megatron-core and megaloop, as
# when IMAGE was forgotten, rather than a ModuleNotFoundError from every task.
megaloop_python_ready() {
  [ -z "${IMAGE:-}" ] || [ "${1:-}" = --host ] || return 0
  if ! python -c 'import importlib.util as u, sys
sys.exit(not all(u.find_spec(m) for m in ("torch", "megatron.core", "megaloop")))' 2>/dev/null
  then
    local found
    found="$(command -v python)" || found=none
    if [ -n "${IMAGE:-}" ]; then
      echo "error: DRY_RUN=1 outside an allocation runs the PATH's python, $found, not IMAGE's," \
           "and it cannot import torch, megatron.core and megaloop: run the dry run in an" \
           "allocation (salloc), or activate the environment megaloop is installed in" >&2
    else
      echo "error: IMAGE is not set, and the PATH's python, $found," \
           "cannot import torch, megatron.core and megaloop: set IMAGE to the megaloop container" \
           "image (e.g. IMAGE=/lustre/images/megaloop.sqsh), or activate the environment" \
           "megaloop is installed in before sbatch" >&2
    fi
    exit 2
  fi
}

# megaloop_whole_number NAME...: exits 2 in one line when a variable NAME is set to other than a
# whole number of at least 1 (bash's arithmetic would read NODES=x as an unset variable, exit 1).
megaloop_whole_number() {
  local name
  for name in "$@"; do
    if [ -n "${!name:-}" ] && ! [[ "${!name}" =~ ^[1-9][0-9]*$ ]]; then
      echo "error: $name=${!name}: a whole number, at least 1" >&2
      exit 2
    fi
  done
}

# megaloop_node_cpus: sets NODE_CPUS to the CPUs of the allocation's smallest node
# (SLURM_JOB_CPUS_PER_NODE, e.g. "72(x2),36"); outside an allocation, this machine's (nproc, which
# answers OMP_NUM_THREADS when it is set: a shell's OMP_NUM_THREADS=1 is no CPU count).
megaloop_node_cpus() {
  local entries entry
  NODE_CPUS=
  IFS=, read -ra entries <<< "${SLURM_JOB_CPUS_PER_NODE:-}"
  for entry in ${entries[@]+"${entries[@]}"}; do
    entry="${entry%%(*}"
    if [ -z "$NODE_CPUS" ] || [ "$entry" -lt "$NODE_CPUS" ]; then NODE_CPUS="$entry"; fi
  done
  NODE_CPUS="${NODE_CPUS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}"
}

# megaloop_task_threads: the default OMP_NUM_THREADS of a training task: its CPUs (the job's
# --cpus-per-task; without it, its node's share), at most 8. More threads than the task's CPUs
# share them (before: 8 whatever the CPUs, two threads a CPU with --cpus-per-task=4); a GPU
# task's CPU work gains little beyond 8, and NCCL's and the checkpoint writer's threads need CPUs.
megaloop_task_threads() {
  local cpus="${SLURM_CPUS_PER_TASK:-}"
  if [ -z "$cpus" ]; then
    megaloop_node_cpus
    cpus=$(( NODE_CPUS / ${SLURM_NTASKS_PER_NODE:-1} ))
  fi
  if [ "$cpus" -gt 8 ]; then cpus=8; elif [ "$cpus" -lt 1 ]; then cpus=1; fi
  echo "$cpus"
}

# megaloop_require NAME HOW: exits 2, the status of bad input, with one line saying HOW to set NAME
# when it is unset or empty (bash's ${NAME:?HOW} exits 1, naming the script's line).
megaloop_require() {
  if [ -z "${!1:-}" ]; then
    echo "error: $1 is not set: $2" >&2
    exit 2
  fi
}

# megaloop_set_by_variables OPTION:NAME... -- ARGS...: exits 2 in one line when an extra argument
# (ARGS) gives an OPTION that the script sets from the variable NAME (train.out_dir from RUN_DIR,
# --output-prefix from OUTPUT): the command reads the later one, so NAME would be ignored without a
# word, and a path given so would escape megaloop_mounted.
megaloop_set_by_variables() {
  local pairs=() pair option arg
  while [ "$1" != -- ]; do pairs+=("$1"); shift; done
  shift
  for arg in "$@"; do
    for pair in "${pairs[@]}"; do
      option="${pair%:*}"
      if [ "$arg" = "$option" ] || [ "${arg#"$option"=}" != "$arg" ]; then
        echo "error: $arg among the extra arguments: $(basename "$0") sets $option from" \
             "${pair##*:}, which it would replace; set ${pair##*:} instead" >&2
        exit 2
      fi
    done
  done
}

# megaloop_run_dir DEFAULT RUN ARGS...: sets RUN_DIR, DEFAULT unless given, for a training script
# whose extra ARGS (megaloop-train overrides) make a variant of RUN. Exits 2 in one line when ARGS
# come without a RUN_DIR: in DEFAULT, RUN's run directory, the variant would resume RUN's checkpoint
# (one warning line), be refused there, or hold its lock. ARGS may not set what the script sets
# from its variables (megaloop_set_by_variables).
megaloop_run_dir() {
  local default="$1" run="$2"
  shift 2
  megaloop_set_by_variables train.out_dir:RUN_DIR data.path:DATA \
    data.tokenizer_model:TOKENIZER -- "$@"
  if [ $# -gt 0 ] && [ -z "${RUN_DIR:-}" ]; then
    local typed="$default"  # as a RUN_DIR given where the script was started names it
    [ "$MEGALOOP_START_DIR" = "$MEGALOOP_ROOT" ] || typed="$MEGALOOP_ROOT/$default"
    echo "error: overrides ($*) without RUN_DIR: the default, $typed, is the run directory of" \
         "the $run run without them; set RUN_DIR to one of their own, e.g." \
         "RUN_DIR=${typed}_variant (or RUN_DIR=$typed to continue that run with them)" >&2
    exit 2
  fi
  RUN_DIR="${RUN_DIR:-$default}"
}

# megaloop_from_start_dir NAME... [--blend NAME...]: a relative path in a variable NAME is read
# from where the script was started (MEGALOOP_START_DIR), as the user typed it, not from the
# checkout the commands run in (submitted from elsewhere with MEGALOOP_ROOT, runs/x was the
# checkout's). A path in the checkout, absolute or not, becomes relative to it: the container's
# workdir, where the checkout is mounted (IMAGE); another becomes absolute. After --blend, a
# comma-separated list of prefixes, with weights before them ("0.3,a,0.7,b"), as megaloop reads
# data.path. The scripts' defaults (RUN_DIR's) are the checkout's: call this before filling them.
megaloop_from_start_dir() {
  local name blend=0 words index weighted lead path resolved
  for name in "$@"; do
    if [ "$name" = --blend ]; then blend=1; continue; fi
    [ -n "${!name:-}" ] || continue
    if [ "$blend" = 1 ]; then IFS=, read -ra words <<< "${!name}"; else words=("${!name}"); fi
    weighted=0  # weights at even positions: an even count, the first a number
    if [ "$blend" = 1 ] && [ $(( ${#words[@]} % 2 )) = 0 ] &&
       [[ "${words[0]// /}" =~ ^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?$ ]]; then
      weighted=1
    fi
    for index in "${!words[@]}"; do
      [ "$weighted" = 0 ] || [ $(( index % 2 )) = 1 ] || continue
      lead="${words[$index]%%[! ]*}"  # blanks after a comma, as in DATA='a, b'
      path="${words[$index]#"$lead"}"
      [ -n "$path" ] || continue
      case "$path" in /*) ;; *) path="${MEGALOOP_START_DIR%/}/$path" ;; esac
      # Its . and .. resolved: "../x" from the checkout leaves it (not mounted with it), and
      # "/lustre/../x" leaves /lustre. A trailing / kept: OUTPUT=dir/ is a prefix in dir.
      resolved="$(realpath -ms -- "$path")"
      case "$path" in */) [ "$resolved" = / ] || resolved="$resolved/" ;; esac
      path="$resolved"
      case "$path" in
        "$MEGALOOP_ROOT") path=. ;;
        "$MEGALOOP_ROOT"/*) path="${path#"$MEGALOOP_ROOT"/}" ;;
      esac
      words[index]="$lead$path"
    done
    printf -v "$name" '%s' "$(IFS=,; printf '%s' "${words[*]}")"
  done
}

# megaloop_mounted NAME...: with IMAGE, exits 2 naming the first variable holding an absolute path
# (DATA may hold several, comma-separated) outside the container's mounts: the checkout
# at /workspace/megaloop and MOUNTS' destinations (SRC[:DST[:FLAGS]]). Inside, such a path does
# not exist: data would be "not found" although the host shows it, and a run directory would be
# made in the container's own file system, its checkpoints lost when the job ends, so that every
# requeued job would start over from step 0.
megaloop_mounted() {
  [ -n "${IMAGE:-}" ] || return 0
  local targets name words word target
  IFS=: read -ra targets <<< "$MEGALOOP_CONTAINER_MOUNTS"
  for name in "$@"; do
    IFS=, read -ra words <<< "${!name:-}"
    for word in ${words[@]+"${words[@]}"}; do
      word="${word#"${word%%[! ]*}"}"  # leading blanks, as in DATA='/a/x, /b/y'
      [ "${word:0:1}" = / ] || continue  # relative: inside the checkout, the container's workdir
      for target in "${targets[@]}"; do
        if [ "$word" = "$target" ] || [ "${word#"$target"/}" != "$word" ]; then
          continue 2
        fi
      done
      echo "error: $name=${!name}: $word is not mounted in the container (IMAGE): add its file" \
           "system to MOUNTS (now '${MOUNTS:-}'), e.g. MOUNTS=/lustre:/lustre, or use a path" \
           "in the checkout (mounted at /workspace/megaloop)" >&2
      exit 2
    done
  done
}

# megaloop_no_dry_run: for the scripts without a dry run, so that DRY_RUN=1 never starts a real job.
megaloop_no_dry_run() {
  if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "error: DRY_RUN=1: $(basename "$0") has no dry run (the training scripts have one)" >&2
    exit 2
  fi
}

# megaloop_one_task_per_gpu: exits 2 when a job's tasks per node (--ntasks-per-node) differ from
# its GPUs per node (--gpus-per-node), or from a GPUS_PER_NODE given for it (read by the dry run
# only). Every task takes the GPU of its local rank: with more tasks than GPUs two ranks share
# one, which NCCL refuses only once the process group is up, in a traceback per rank.
megaloop_one_task_per_gpu() {
  local tasks="${SLURM_NTASKS_PER_NODE:-}" gpus="${SLURM_GPUS_ON_NODE:-}"
  [ -n "$tasks" ] || return 0
  if [ -n "$gpus" ] && [ "$gpus" != "$tasks" ]; then
    echo "error: $tasks tasks per node (--ntasks-per-node) for $gpus GPUs per node" \
         "(SLURM_GPUS_ON_NODE): megaloop runs one task per GPU; submit with" \
         "--ntasks-per-node=$gpus --gpus-per-node=$gpus" >&2
    exit 2
  fi
  if [ -n "$GPUS_PER_NODE_GIVEN" ] && [ "$GPUS_PER_NODE_GIVEN" != "$tasks" ]; then
    echo "error: GPUS_PER_NODE=$GPUS_PER_NODE_GIVEN is read by DRY_RUN only, and this job runs" \
         "$tasks tasks per node: submit with --ntasks-per-node=$GPUS_PER_NODE_GIVEN" \
         "--gpus-per-node=$GPUS_PER_NODE_GIVEN, or unset GPUS_PER_NODE" >&2
    exit 2
  fi
}

# megaloop_nodes_as_given: exits 2 when a job is given a NODES (read by the dry run only) other
# than its allocation's node count: NODES=4 with the script's #SBATCH --nodes=16 ran on 16.
megaloop_nodes_as_given() {
  if [ -n "${NODES:-}" ] && [ "$NODES" != "${SLURM_NNODES:-1}" ]; then
    echo "error: NODES=$NODES is read by DRY_RUN only, and this job runs on" \
         "${SLURM_NNODES:-1} node(s): submit with sbatch --nodes $NODES, or unset NODES" >&2
    exit 2
  fi
}

# The tasks run python -I -S -c "$MEGALOOP_STOP_SIGNALS_BLOCKED" -m megaloop.train ..., which is
# python -m megaloop.train ... started with SIGTERM and SIGUSR1 blocked (the -I -S interpreter
# takes about 10 ms), for megaloop.train's handlers to take once installed
# (megaloop.training.signals): a signal during the seconds of the interpreter's start and imports
# before them waits for them and stops set-up (exit 75, requeued), rather than killing the task
# (138: no requeue, no word). Not `env --block-signal`: coreutils 8.30 (RHEL 8) lacks it.
MEGALOOP_STOP_SIGNALS_BLOCKED='import os, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGUSR1))
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])'

# megaloop_dry_run ARGS...: megaloop-train --dry-run with ARGS in one process. With IMAGE it runs
# in the image, as the job's tasks do (srun, one task), inside an allocation; outside one srun
# would queue a job of its own, so this host's interpreter runs it, and a line says so.
megaloop_dry_run() {
  # NODES first: a dry run in a small allocation (salloc, for IMAGE) is of the job NODES says.
  megaloop_whole_number NODES GPUS_PER_NODE
  local nodes="${NODES:-${SLURM_NNODES:-1}}"
  local command=(python -m megaloop.train --dry-run --world-size "$((nodes * GPUS_PER_NODE))" "$@")
  export LOCAL_WORLD_SIZE="$GPUS_PER_NODE"
  if [ -n "${IMAGE:-}" ] && [ -n "${SLURM_JOB_ID:-}" ]; then
    srun --nodes=1 --ntasks=1 "${CONTAINER[@]}" "${command[@]}"
    return
  fi
  if [ -n "${IMAGE:-}" ]; then
    local found
    found="$(command -v python)" || found=none
    echo "megaloop: DRY_RUN=1 outside an allocation: the dry run uses this host's python," \
         "$found, not IMAGE=$IMAGE; run it in an allocation (salloc) to use the image" >&2
  fi
  megaloop_python_ready --host
  "${command[@]}"
}

# megaloop_train ARGS...: one task per GPU runs megaloop.train with ARGS; with DRY_RUN=1 one
# process prints the dry run instead (megaloop_dry_run). SIGUSR1 from SLURM (--signal) is
# forwarded to the tasks, which save a checkpoint and exit 75; the job is then requeued and
# resumes.
megaloop_train() {
  if [ "${DRY_RUN:-0}" = 1 ]; then
    megaloop_dry_run "$@"
    return
  fi
  if [ -z "${SLURM_JOB_NODELIST:-}" ]; then
    echo "error: not in a SLURM allocation (no SLURM_JOB_NODELIST): submit with sbatch, or set" \
         "DRY_RUN=1 to print the dry run" >&2
    exit 2
  fi
  megaloop_one_task_per_gpu
  megaloop_nodes_as_given
  megaloop_python_ready
  # sed reads every line: head would exit after the first, and scontrol, still writing a long
  # node list, would die of SIGPIPE, which pipefail and set -e turn into a silent exit 141.
  MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"
  export MASTER_ADDR
  export MASTER_PORT="${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
  export CUDA_DEVICE_MAX_CONNECTIONS=1  # tensor-parallel communication overlap in megatron-core
  export NCCL_IB_TIMEOUT=22 TORCH_NCCL_ASYNC_ERROR_HANDLING=1
  OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(megaloop_task_threads)}"
  export OMP_NUM_THREADS
  # Where each run of the job starts in its log, which a requeued job appends to.
  local restart="${SLURM_RESTART_COUNT:+, requeued (restart $SLURM_RESTART_COUNT)}"
  echo "$(date '+%F %T') megaloop: job $SLURM_JOB_ID$restart: ${SLURM_NNODES:-1} node(s) x" \
       "${SLURM_NTASKS_PER_NODE:-?} tasks, rendezvous $MASTER_ADDR:$MASTER_PORT" >&2
  # megaloop reads SLURM_PROCID / SLURM_STEP_NUM_TASKS / SLURM_LOCALID itself.
  # Not --kill-on-bad-exit: after a stop signal every task exits 75 once the checkpoint is saved,
  # and srun would kill the tasks still exiting when the first one does; it then reports their
  # signal (128 + n, above 75) and the job would not be requeued. --wait ends the step this long
  # after its first task ends instead (a crashed rank's peers would otherwise hang in NCCL).
  # srun itself in the background, not megaloop_srun: $! would be the subshell running the
  # function, which SIGUSR1 kills (exit 138, srun orphaned, the tasks never told, no requeue).
  # The tasks start with the stop signals blocked (MEGALOOP_STOP_SIGNALS_BLOCKED, above).
  srun ${CONTAINER[@]+"${CONTAINER[@]}"} ${TASK_CPUS[@]+"${TASK_CPUS[@]}"} --kill-on-bad-exit=0 --wait=120 \
    python -I -S -c "$MEGALOOP_STOP_SIGNALS_BLOCKED" -m megaloop.train "$@" &
  local srun_pid=$! rc=0 interrupted=0
  trap 'interrupted=1; kill -USR1 "$srun_pid" 2>/dev/null' USR1
  while :; do  # wait returns early (128 + 10) when the trap runs: then wait again
    interrupted=0
    wait "$srun_pid" && rc=0 || rc=$?
    [ "$interrupted" = 1 ] || break
  done
  if [ "$rc" -eq 75 ]; then  # stopped early with a checkpoint saved: continue in a new allocation
    echo "megaloop: the tasks stopped early and exited 75 (resumable): requeueing job" \
         "$SLURM_JOB_ID; it resumes from the run's latest checkpoint, if it saved one" >&2
    if ! scontrol requeue "$SLURM_JOB_ID"; then
      echo "error: scontrol requeue $SLURM_JOB_ID failed: submit the job again to resume" >&2
      return 75
    fi
    return 0
  fi
  return "$rc"
}
