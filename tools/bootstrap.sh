#!/usr/bin/env bash
# Creates (or refreshes) ./.venv for CPU machines, then runs the given command inside it.
#   bash tools/bootstrap.sh python -m megaloop.quickstart
#   bash tools/bootstrap.sh python -m pytest tests
# torch is pinned to the local CPU wheel (an unpinned torch pulls a multi-GB CUDA build) and
# megatron-core to 0.16.1, the last release for Python 3.11. setup.py itself keeps open ranges.
# MEGALOOP_TORCH=2.11.0 (with a MEGALOOP_VENV of its own) builds a venv on another torch to test
# megaloop against it: PyPI's torch for Linux is a CUDA build, a download of 2-4 GB.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${MEGALOOP_VENV:-$root/.venv}"
# Absolute: the command runs from $root, where a relative venv's bin on PATH would name another
# directory, or none, and the command would run on the system's python without a word.
case "$venv" in /*) ;; *) venv="$PWD/$venv" ;; esac
stamp="$venv/.megaloop-stamp"
torch="torch==2.13.0"
if [ -n "${MEGALOOP_TORCH:-}" ]; then torch="torch==$MEGALOOP_TORCH"; fi
want="$( (cat "$root/setup.py" "$root/tools/bootstrap.sh"; echo "$torch") | sha256sum | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  pipq() {  # pip, minus the noise of this machine's unused local index entries; fails loudly
    local log rc=0; log="$(mktemp)"
    "$venv/bin/pip" install -q "$@" >"$log" 2>&1 || rc=$?
    grep -v "is ignored: it is neither" "$log" || true; rm -f "$log"; return "$rc"
  }
  pipq --upgrade pip
  pipq "$torch" "megatron-core==0.16.1"
  pipq -e "${root}[test,mpi,hf,eval]" "$torch"  # the pin again: nothing may move torch
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
cd "$root"
if [ "$#" -gt 0 ]; then
  exec "$@"
fi
