#!/usr/bin/env bash
# The GPU checks, for a session that is lent a GPU machine: environment report, the GPU tests
# (NCCL, CUDA kernels vs torch, the flat optimizer step on CUDA tensors, real engine steps in
# fp32/fp16/bf16), then the CUDA kernel benchmark and the engine's optimizer step against torch's
# fused AdamW on the GPU.
# Outputs land in $OUT (the device tool's folder) or ./gpu-check.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check}"
mkdir -p "$out"
make setup > "$out/setup.log" 2>&1 || { tail -50 "$out/setup.log"; exit 1; }
.venv/bin/flowtrain report > "$out/report.txt" 2>&1; cat "$out/report.txt"
.venv/bin/python -m pytest -q tests/test_gpu.py tests/test_comm.py 2>&1 | tee "$out/pytest.txt" | tail -20
.venv/bin/python benchmarks/gpu_kernels.py --quick 2>&1 | tee "$out/gpu_kernels.txt"
.venv/bin/python benchmarks/optim_step.py --device cuda --precision fp32 bf16 --rounds 21 2>&1 \
    | tee "$out/optim_step.txt"
