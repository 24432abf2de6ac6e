#!/usr/bin/env bash
# Issue 14, one device call (repo root on the GPU machine): bash bench/run_overlap.sh ANCHOR_DIR OUT_DIR [DEADLINE_S]
# Every job is one process on one GPU (all GPUs present are used); see bench/run_overlap.py for the job list.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 -m bench.run_overlap "$1" "$2" --deadline "${3:-540}"
