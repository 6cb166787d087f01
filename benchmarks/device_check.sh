#!/usr/bin/env bash
# The CUDA/NCCL path checked in one command, on a machine with one CUDA GPU:
# wrap == DDP and the primitives on GPU tensors (Gloo 2 ranks, NCCL world 1), bench/tune/auto under NCCL,
# `collective-ops bench --backend nccl`, and ddp_compare on the GPU. Prints one table (and writes
# $OUT/device_check.md when OUT is set). Within 8 minutes, or it stops. Never part of CI.
#   bash benchmarks/device_check.sh              # on the GPU machine: python3 with torch+CUDA, no install
#   bash benchmarks/device_check.sh --device cpu # the same checks on Gloo/CPU, to try the script without a GPU
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
exec timeout 480 "${PYTHON:-python3}" benchmarks/device_check.py "$@"
