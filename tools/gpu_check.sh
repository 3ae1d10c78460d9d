#!/usr/bin/env bash
# One short script for a lent GPU (run it once, from the repo root, on the device machine):
#   1. the GPU test marker set (Transformer Engine specs, CUDA flash joint attention parity),
#   2. the joint-attention and step-time benchmarks on CUDA.
# Results go to $OUT (or ./gpu_check_out) as text and JSON.
set -uo pipefail
out="${OUT:-gpu_check_out}"; mkdir -p "$out"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
python - > "$out/env.txt" 2>&1 <<'PY'
import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
try:
    import transformer_engine as te; print("transformer_engine", te.__version__)
except Exception as e: print("no transformer_engine:", e)
import megatron.core as m; print("megatron-core", m.__version__)
PY
pip install -q --no-deps -e . >> "$out/env.txt" 2>&1
timeout 400 python -m pytest -q -m gpu tests/models/test_gpu.py tests/training/test_gpu_training.py > "$out/pytest_gpu.txt" 2>&1; echo "pytest rc=$?" >> "$out/pytest_gpu.txt"
timeout 120 python tools/bench/step_time.py > "$out/step_time.json" 2>"$out/step_time.err"
cat "$out"/env.txt "$out"/pytest_gpu.txt | tail -40
