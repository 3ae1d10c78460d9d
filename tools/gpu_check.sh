#!/usr/bin/env bash
# The GPU check (issue 12): what reading the GPU path cannot settle, in one short run (< 5 minutes
# on one H100/H200). For a bare CUDA machine without network: Python 3.12 with torch (CUDA),
# transformers, sentencepiece, safetensors, tensorboard, rich, psutil and pyarrow, but no
# megatron-core, zarr or Transformer Engine. Run from the repository root:
#
#   bash tools/gpu_check.sh            # results under $OUT (default: gpu_check_out in the checkout)
#
# What is missing comes from the checkout's wheels/ (or MEGALOOP_WHEELS; gitignored, about 36 MB;
# the device tool carries it with carry=["wheels"]), filled beforehand on a machine that reaches PyPI, at the versions CPU CI tests:
#
#   pip download -d wheels --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
#     --platform manylinux2014_x86_64 \
#     megatron-core==0.16.1 packaging==26.4 pyyaml==6.0.4 zstandard==0.25.0 \
#     nvidia-ml-py==13.615.71 pytest==9.2.0 pytest-timeout==2.4.0 pluggy==1.7.0 \
#     iniconfig==2.3.1 pygments==2.21.0 zarr==3.1.6 numcodecs==0.16.6 google-crc32c==1.9.0 \
#     donfig==0.8.1.post1 typing-extensions==4.16.0 numpy==2.4.6
#
# Steps (each one's output is a file in $OUT; the script exits non-zero if any step failed):
#   1. environment: GPU, torch/CUDA, Transformer Engine (if any), megaloop commit;
#   2. offline install of what is missing (megatron-core for cp312, pytest, ...);
#   3. does megaloop import without zarr? (zarr is installed only if it does not);
#   4. the GPU-marked tests: fused joint attention on megatron-core's layouts and the local-spec
#      model against float64 references, causality, host syncs per step, one-GPU NCCL training
#      with save and exact resume, MoE's alltoall dispatch against the reference; with
#      Transformer Engine also the TE spec (causality, parity), grouped-GEMM experts, FP8
#      recompute, the Global K/V projection in FP8, delayed-scaling amax against scales, and
#      local <-> TE checkpoints.
#      Measured numbers: gpu_record.jsonl;
#   5. benches: fused vs masked joint attention on CUDA; tokens/s and MFU of the 1B preset;
#      cached decoding of AsymLoop against Dense of equal depth (60M, Hugging Face model).
set -uo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
# A relative OUT or MEGALOOP_WHEELS is the caller's, as typed, not the checkout's the script moves to.
out="$(realpath -m "${OUT:-$root/gpu_check_out}")"
wheels="$(realpath -m "${MEGALOOP_WHEELS:-$root/wheels}")"
cd "$root" || exit 1
mkdir -p "$out"
# What is missing goes to its own directory, not into the image's environment (which may be
# read-only), and only what is missing: a carried copy of a package the image has would shadow it.
site="${TMPDIR:-/tmp}/megaloop-gpu-check-site"
export PYTHONPATH="$root:$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# CUDA images often have only python3 (no python).
py="$(command -v python3 || command -v python)"
export MEGALOOP_GPU_RECORD="$out/gpu_record.jsonl"
rm -f "$MEGALOOP_GPU_RECORD"
failed=()

step() {  # step NAME SECONDS COMMAND...: runs COMMAND with a time limit, output to $out/NAME.txt
  local name="$1" limit="$2"; shift 2
  local start=$SECONDS
  if timeout "$limit" "$@" > "$out/$name.txt" 2>&1; then
    echo "ok     $name ($((SECONDS - start)) s)"
  else
    echo "FAILED $name ($((SECONDS - start)) s): see $name.txt"; failed+=("$name")
  fi
}

# --no-deps: the lists below name every dependency the machine lacks; the ones it has (torch and
# its own) are left alone.
pip_offline=("$py" -m pip install --no-index --find-links "$wheels" --no-deps
             --disable-pip-version-check --upgrade --target "$site")

# 1. environment
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$py" - <<'PY'
import importlib.util, sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE")
for name in ("transformer_engine", "megatron.core", "zarr", "numpy"):
    found = importlib.util.find_spec(name.split(".")[0]) is not None
    print(f"{name}: {'present' if found else 'absent'}")
PY
  git -C "$root" log -1 --format='megaloop %h %s' 2>/dev/null || echo "megaloop (no git)"
} > "$out/environment.txt" 2>&1
cat "$out/environment.txt"

# 2. what is missing, from the carried wheels (no index: a missing wheel fails loudly)
missing=()
for module_requirement in megatron.core=megatron-core==0.16.1 "packaging=packaging>=24.2" \
    yaml=pyyaml zstandard=zstandard pynvml=nvidia-ml-py pytest=pytest pytest_timeout=pytest-timeout \
    pluggy=pluggy iniconfig=iniconfig "pygments=pygments>=2.15"; do
  "$py" -c "import ${module_requirement%%=*}" 2> /dev/null || missing+=("${module_requirement#*=}")
done
if ((${#missing[@]})); then
  step install 120 "${pip_offline[@]}" "${missing[@]}"
else
  echo "skip   install (nothing missing)"
fi

# 3. megaloop without zarr (only ALRS logging needs it)
if "$py" -c "import zarr" 2> /dev/null; then
  echo "zarr was preinstalled: importing without it not checked" > "$out/import_without_zarr.txt"
  echo "skip   import_without_zarr (zarr preinstalled)"
else
  step import_without_zarr 60 "$py" -c \
    "import megaloop.config, megaloop.models.model, megaloop.training.trainer; print('imported')"
  if [[ " ${failed[*]} " == *" import_without_zarr "* ]]; then  # install it so the rest can run
    step install_zarr 60 "${pip_offline[@]}" zarr==3.1.6 numcodecs==0.16.6 google-crc32c donfig \
      "typing-extensions>=4.12" "numpy>=2"
  fi
fi

# 4. GPU-marked tests
step pytest_gpu 270 "$py" -m pytest -q -m gpu -rA -p no:cacheprovider --timeout 150 \
  --durations 15 tests/models/test_gpu.py tests/models/test_moe_gpu.py \
  tests/training/test_gpu_training.py
if ! grep -qE "[0-9]+ passed" "$out/pytest_gpu.txt"; then  # all skipped (no CUDA device) is no check
  echo "FAILED pytest_gpu_ran: no GPU-marked test passed"; failed+=(pytest_gpu_ran)
fi

# 5. benches (JSON on stdout)
step bench_joint_attention_n1024 45 "$py" tools/bench/joint_attention.py --device cuda \
  --seq 1024 --heads 4 --head-dim 64 --repeats 10
step bench_joint_attention_n4096 45 "$py" tools/bench/joint_attention.py --device cuda \
  --batch 4 --seq 4096 --heads 16 --head-dim 128 --repeats 5
step bench_step_time_1B 140 "$py" tools/bench/step_time.py --preset 1B --batch 8 --repeats 5 \
  --profile 20
step bench_generate_60M 60 "$py" tools/bench/generate.py --preset 60M --repeats 3

echo "--- tests"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$out/pytest_gpu.txt" | tail -80
echo "--- measured (gpu_record.jsonl, bench JSON)"
cat "$MEGALOOP_GPU_RECORD" 2> /dev/null
for bench in "$out"/bench_*.txt; do
  echo "$(basename "$bench" .txt):"; tail -n 60 "$bench"
done
if ((${#failed[@]})); then
  echo "gpu_check: FAILED steps: ${failed[*]}"
  exit 1
fi
echo "gpu_check: all steps passed"
