#!/usr/bin/env bash
# Item 6: GPU benchmarks for a machine with ONE CUDA GPU; about 5 minutes in all.
#   bash scripts/bench/gpu.sh            (from anywhere; uses the active Python environment)
# 1. The small config's inner loop on the GPU (run_peer's code path against a bare bf16-autocast AdamW loop on the
#    same model, batch and device; A/B/A/B blocks of 50 steps; tokens/s, MFU and peak GPU memory of both sides):
#    results/gpu_inner.json. Set BENCH_PEAK_TFLOPS for a GPU that inner.py's table does not know (MFU needs it).
# 2. A 2-peer swarm sharing the GPU (two run_peer processes on 127.0.0.1, small config at its own batch, H=100 and
#    H=500, 3 rounds each): compute utilisation and per-round communication: results/gpu_swarm.json.
# Then BENCHMARKS.md is re-rendered with the GPU rows. Every step has its own time limit.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu.sh: torch sees no CUDA device')"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
start=$(date +%s)
timeout 120 "$PY" scripts/bench/inner.py --device cuda --threads 4 --steps 50 --pairs 5 \
  --case "small:configs/small.yaml" --case "small_b32:configs/small.yaml:data.batch_size=32"
timeout 170 "$PY" scripts/bench/utilisation.py --item gpu_swarm --peers 2 --h 100 500 --rounds 3 --timeout 80 \
  --case "small:configs/small.yaml" --set model.device=cuda
"$PY" scripts/bench/render.py
echo "gpu.sh: done in $(( $(date +%s) - start ))s"
