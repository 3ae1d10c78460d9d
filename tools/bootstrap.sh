#!/usr/bin/env bash
# Creates (or refreshes) ./.venv for CPU machines, then runs the given command inside it.
#   bash tools/bootstrap.sh python -m megaloop.quickstart
#   bash tools/bootstrap.sh python -m pytest tests
# torch is pinned to 2.13.0 and megatron-core to 0.16.1, the last release for Python 3.11;
# setup.py itself keeps open ranges. pip takes torch's CPU build (2.13.0+cpu) where its indexes
# have one, as this project's machines do (a local wheel, PIP_FIND_LINKS); else PyPI's, on Linux a
# CUDA build, several GB with its nvidia-* packages (it runs on the CPU too), which the script
# says in one line before installing it. The CPU build from PyTorch's own index:
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu bash tools/bootstrap.sh ...
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
  # The torch pip would install (none where the venv has it), by the report of a dry run (the
  # wheel's metadata only, where the index serves it, as PyPI does; else the wheel, which pip's
  # cache keeps for the install): a build that requires nvidia-* packages is a CUDA one.
  cuda_torch="$("$venv/bin/pip" install --dry-run --no-deps -q --report - "$torch" 2>/dev/null |
    "$venv/bin/python" -c 'import json, sys
try:
    item = json.load(sys.stdin)["install"][0]
except (ValueError, LookupError):
    sys.exit()
if any(r.startswith("nvidia-") for r in item["metadata"].get("requires_dist") or []):
    print(item["metadata"]["version"], item["download_info"]["url"])' 2>/dev/null)" || cuda_torch=
  if [ -n "$cuda_torch" ]; then
    echo "bootstrap: installing torch ${cuda_torch% *}, a CUDA build (several GB with its" \
         "nvidia-* packages), from ${cuda_torch#* }: pip found no CPU build; for one, set" \
         "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu" >&2
  fi
  pipq "$torch" "megatron-core==0.16.1"
  pipq -e "${root}[test,mpi,hf,eval]" "$torch"  # the pin again: nothing may move torch
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
cd "$root"
if [ "$#" -gt 0 ]; then
  exec "$@"
fi
