#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (two H200s, NVLink): sharded training against the plain-JAX FSDP anchor.
# Usage (repo root):  bash bench/run_fsdp.sh ANCHOR_DIR OUT_FILE [--smoke]
#   ANCHOR_DIR holds plain_jax_llama_fsdp.py (../shared/anchor); OUT_FILE gets one JSON line per configuration.
#   --smoke: tiny shapes on the CPU with 2 fake devices (checks the scripts only; the anchor with SMALL=1).
# Order (most important first; each process has a timeout, and a run that would pass the call's budget of
# BUDGET_S seconds, default 530, is skipped with an error record):
#   1. anchor plain_jax_llama_fsdp.py, SHAPE=405b NL=3, batch 2 per GPU: full, save_qkv, offload_qkv
#   2. zoo llama405b-slice --mesh fsdp=2 --batch 4 (global; 2 per GPU): full, save_qkv, qkv_offload
#   3. zoo deepseek-slice --mesh ep=2 --experts 32 --batch 8 (16 experts and 4 sequences per GPU, as on one GPU),
#      capacity backend: full, mla_moe_offload
#   4. zoo llama405b-slice full on ONE GPU of the same machine (CUDA_VISIBLE_DEVICES=0, --mesh fsdp=1, batch 2):
#      weak scaling, same code path as the sharded runs
set -u
anchor=$1; out=$2; smoke=${3:-}
export BENCH_OUT=$out PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
budget=${BUDGET_S:-530}
if [ "$smoke" = --smoke ]; then
  export XLA_FLAGS="--xla_force_host_platform_device_count=2" JAX_PLATFORMS=cpu SMALL=1
  S="--smoke"; SEQ_L="--seq 64"; SEQ_D="--seq 64"; EXPERTS=16
else
  export XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true"
  S=""; SEQ_L=""; SEQ_D=""; EXPERTS=32
fi
PY=${PYTHON:-python3}

fail() {  # bench recipe mesh why
  echo "{\"bench\": \"$1\", \"impl\": \"zoo\", \"recipe\": \"$2\", \"mesh\": \"$3\", \"gpus\": 2, \"error\": \"$4\"}" >> "$out"
}
slot() {  # wanted seconds -> the timeout to use, or 0 when the call's budget is spent
  local left=$((budget - SECONDS))
  if [ "$left" -lt 40 ]; then echo 0; elif [ "$left" -lt "$1" ]; then echo "$left"; else echo "$1"; fi
}

for p in full save_qkv offload_qkv; do
  t=$(slot 75); [ "$t" = 0 ] && { fail plain-jax-llama-fsdp "$p" fsdp=2 "skipped: budget"; continue; }
  SHAPE=405b NL=3 timeout "$t" $PY "$anchor/plain_jax_llama_fsdp.py" "$p" 2 > "$out.anchor" ||
    echo "{\"policy\": \"$p\", \"gpus\": 2, \"error\": \"timeout or crash\"}" >> "$out.anchor"
  # the anchor's line in the records' schema (bench/anchor_record.py; run on the CPU: it only writes JSON)
  JAX_PLATFORMS=cpu $PY -m bench.anchor_record llama405b-slice "$out.anchor" --S 8192 --backend none --mesh fsdp=2 $S
done
for r in full save_qkv qkv_offload; do
  t=$(slot 100); [ "$t" = 0 ] && { fail llama405b-slice "$r" fsdp=2 "skipped: budget"; continue; }
  timeout "$t" $PY -m bench.llama_slice "$r" --mesh fsdp=2 --batch 4 --steps 4 $S $SEQ_L ||
    fail llama405b-slice "$r" fsdp=2 "timeout or crash"
done
for r in full mla_moe_offload; do
  t=$(slot 80); [ "$t" = 0 ] && { fail deepseek-slice "$r" ep=2 "skipped: budget"; continue; }
  timeout "$t" $PY -m bench.deepseek_slice "$r" --mesh ep=2 --experts $EXPERTS --batch 8 --backend capacity \
    --steps 4 $S $SEQ_D || fail deepseek-slice "$r" ep=2 "timeout or crash"
done
t=$(slot 100)
if [ "$t" = 0 ]; then
  fail llama405b-slice full fsdp=1 "skipped: budget (one-GPU weak-scaling run)"
elif [ "$smoke" = --smoke ]; then
  XLA_FLAGS="--xla_force_host_platform_device_count=1" timeout "$t" $PY -m bench.llama_slice full --mesh fsdp=1 \
    --batch 2 --steps 4 $S $SEQ_L || fail llama405b-slice full fsdp=1 "timeout or crash"
else
  CUDA_VISIBLE_DEVICES=0 timeout "$t" $PY -m bench.llama_slice full --mesh fsdp=1 --batch 2 --steps 4 ||
    fail llama405b-slice full fsdp=1 "timeout or crash"
fi
rm -f "$out.anchor"
echo "run_fsdp.sh: done in ${SECONDS}s" >&2
