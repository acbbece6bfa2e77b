#!/usr/bin/env bash
# Build, check and time squash's FFI GPU kernels on this machine's CUDA or ROCm GPU; well under
# 5 minutes on one GPU (timing stops at --budget seconds, 270 by default).
#
#   benchmarks/gpu_check.sh [--budget SECONDS] [--no-timing] [--out DIR]
#
# Exit codes: 0 all GPU correctness checks passed; 1 a correctness check failed; 2 the native
# GPU kernels did not build or load; 3 no CUDA/ROCm GPU present (CPU path checked and passed).
# The table goes to benchmarks/results/gpu_<device>.md. Details: docs/gpu.md.
set -uo pipefail
cd "$(dirname "$0")/.."
exec python benchmarks/gpu_check.py "$@"
