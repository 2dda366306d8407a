#!/usr/bin/env bash
# The GPU checks, for a session that is lent a GPU machine: environment report, the GPU tests
# (NCCL, CUDA kernels vs torch, a real engine step), then the CUDA kernel benchmark.
# Outputs land in $OUT (the device tool's folder) or ./gpu-check.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check}"
mkdir -p "$out"
make setup > "$out/setup.log" 2>&1 || { tail -50 "$out/setup.log"; exit 1; }
.venv/bin/flowtrain report > "$out/report.txt" 2>&1; cat "$out/report.txt"
.venv/bin/python -m pytest -q tests/test_gpu.py tests/test_comm.py 2>&1 | tee "$out/pytest.txt" | tail -20
.venv/bin/python benchmarks/gpu_kernels.py --quick 2>&1 | tee "$out/gpu_kernels.txt"
