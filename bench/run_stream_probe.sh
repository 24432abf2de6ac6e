#!/usr/bin/env bash
# One device call: bench/stream_probe.py's variants under XLA's stream options (one process each).
# Usage (GPU machine, repo root): bash bench/run_stream_probe.sh OUT_FILE
set -u
export BENCH_OUT=$1 PYTHONUNBUFFERED=1
ANN="--xla_gpu_experimental_stream_annotation=true"
SEL="--xla_gpu_experimental_enable_selective_memcpy_overlap=true"
r() { XLA_FLAGS="$1" timeout 90 python3 -m bench.stream_probe "$2" > /dev/null 2>&1 || echo "{\"bench\": \"stream-probe\", \"variant\": \"$2\", \"flags\": \"$1\", \"error\": \"timeout or crash\"}" >> "$BENCH_OUT"; }
r "" device; r "" plain; r "" stream; r "$ANN" plain; r "$ANN" stream; r "$SEL" plain; r "$ANN $SEL" stream
