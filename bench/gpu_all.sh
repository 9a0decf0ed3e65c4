#!/usr/bin/env bash
# Every GPU check of this project in one call, for a machine with one NVIDIA GPU:
#   bash bench/gpu_all.sh            (logs under $OUT, else ./gpu-out)
# bench/gpu_check.py (GEMM sweep, LLaMA stack, the executor's LLaMA step beside torch
# eager, peak memory), then bench/executor_profile.py (where the executor's step goes).
# About 3 minutes on one H200 (docs/benchmarks.md, "On a GPU").
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader \
    | tee "$out/gpu.txt"
python3 -c "import torch, transformers, onnx; print(torch.__version__, transformers.__version__, onnx.__version__)" \
    | tee -a "$out/gpu.txt"
timeout 300 python3 bench/gpu_check.py --module-steps 10 2>&1 | tee "$out/gpu_check.log"
timeout 200 python3 bench/executor_profile.py --top 25 2>&1 | grep -v '^USDT' > "$out/profile.log"
grep -E '^== |^device busy' "$out/profile.log"
