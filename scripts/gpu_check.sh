#!/usr/bin/env bash
# The checks that need CUDA, in one run: the CUDA-only tests and the benchmarks.
# Usage (on a GPU machine, from the repo root): bash scripts/gpu_check.sh [OUT_DIR]
# Results land in OUT_DIR (default: $OUT, else ./gpu_check_out): pytest output and one JSON line per bench.
set -uo pipefail
out="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$out"
py="${PYTHON:-python}"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
export HF_HUB_OFFLINE=1
"$py" -m pytest tests -q -m cuda -p no:cacheprovider 2>&1 | tail -40 > "$out/pytest_cuda.txt"
# the CPU suite's exactness tests, on a CUDA machine (tensors on CPU, the rest of the stack real)
"$py" -m pytest tests/test_streaming.py -q -x -p no:cacheprovider 2>&1 | tail -5 > "$out/pytest_streaming.txt"
# the memory model on this GPU: coefficients fitted to the allocator's counters, and how the CPU fit does here
timeout 300 "$py" scripts/calibrate_memory.py --device cuda --quick --out "$out/coef_cuda.json" 2>"$out/calibrate.err" \
  | tail -1 > "$out/calibrate_cuda.json"
for bench in stream reference prefix quant disk ranks; do
  timeout 300 "$py" scripts/bench.py "$bench" 2>"$out/bench_$bench.err" | tail -1 > "$out/bench_$bench.json"
done
cat "$out"/pytest_cuda.txt "$out"/bench_*.json
