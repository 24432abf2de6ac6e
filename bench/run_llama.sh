#!/usr/bin/env bash
# One device call: the zoo's llama405b-slice under three recipes and the plain-JAX anchor beside it.
# Usage (on the GPU machine, repo root): bash bench/run_llama.sh ANCHOR_DIR OUT_FILE
set -u
anchor=$1; out=$2
export BENCH_OUT=$out PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true"
for r in full save_qkv qkv_offload; do
  timeout 170 python3 -m bench.llama_slice "$r" --batch 2 || echo "{\"bench\": \"llama405b-slice\", \"impl\": \"zoo\", \"recipe\": \"$r\", \"error\": \"timeout or crash\"}" >> "$out"
done
for p in full offload_qkv; do
  SHAPE=405b NL=3 timeout 150 python3 "$anchor/plain_jax_llama.py" "$p" 2 | tee -a "$out"
done
