#!/usr/bin/env bash
# GPU check of the 4D-parallel backend; adapts to the GPUs present, <= ~10 minutes, JSON on stdout.
#   0 GPUs : {"gpus": 0, "status": "no_gpu", ...}, exit 0
#   1 GPU  : bf16 MFU of the 1b preset, and the (1,1,1,1) parallel path on NCCL against plain transformers
#   >=2    : NCCL grids against the serial model, blocking against overlapped collectives
# Usage: bash benchmarks/gpu_check.sh [--budget-s 540] [--peak-tflops 989]
# PYTHON selects the interpreter (default: python3 on PATH).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "${PYTHON:-python3}" "$here/gpu_check.py" "$@"
