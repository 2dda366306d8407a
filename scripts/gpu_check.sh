#!/usr/bin/env bash
# The GPU checks, for a session that is lent a GPU machine: environment report, the GPU tests
# (NCCL, CUDA kernels vs torch, the flat optimizer step on CUDA tensors, real engine steps in
# fp32/fp16/bf16), then the CUDA kernel benchmark and the engine's optimizer step against torch's
# fused AdamW on the GPU.
# First, benchmarks/gpu_calibrate.py measures the GPU's GEMMs, attention, memory-bound ops and
# whole layers for the simulator's kernel figures.
# Outputs land in $OUT (the device tool's folder) or ./gpu-check.
# PYTHON=python3 uses that interpreter as it is (a machine with no package index: its torch plus
# the project's other dependencies carried as wheels on PYTHONPATH) instead of `make setup`.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check}"
mkdir -p "$out"
if [ -z "${PYTHON:-}" ]; then
    make setup > "$out/setup.log" 2>&1 || { tail -50 "$out/setup.log"; exit 1; }
    PYTHON=.venv/bin/python
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
$PYTHON -m flowtrain.cli report > "$out/report.txt" 2>&1; cat "$out/report.txt"
timeout 150 $PYTHON benchmarks/gpu_calibrate.py --json "$out/gpu_calibrate.json" 2>&1 \
    | tee "$out/gpu_calibrate.txt" | cut -c1-160 | tail -30
timeout 150 $PYTHON -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_comm.py 2>&1 \
    | tee "$out/pytest.txt" | tail -20
timeout 45 $PYTHON benchmarks/gpu_kernels.py --quick 2>&1 | tee "$out/gpu_kernels.txt"
timeout 60 $PYTHON benchmarks/optim_step.py --device cuda --precision fp32 bf16 fp16 --rounds 21 2>&1 \
    | tee "$out/optim_step.txt"
