#!/usr/bin/env bash
# Issue 14's first question, where the offload time goes: one device call on two GPUs (nvidia-h200-x2), each GPU
# running its own sequence of single-GPU processes (one configuration per process). GPU 0: the plain-JAX anchor's
# `minimal` / `offload_minimal` and profiles of the zoo's `minimal_offload` and `minimal` (405B-shaped, 3 layers,
# batch 2, seq 8192, latency-hiding scheduler); GPU 1: the anchor's `offload_minimal` under XLA's own overlap
# options, and a profile of the zoo under pipelined host offloading.
# Usage (GPU machine, repo root): bash bench/run_probe.sh ANCHOR_DIR OUT_DIR
set -u
anchor=$1; out=$2
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
LHS="--xla_gpu_enable_latency_hiding_scheduler=true"
a() {  # gpu flags policy
  CUDA_VISIBLE_DEVICES=$1 XLA_FLAGS="$2" SHAPE=405b NL=3 timeout 150 python3 "$anchor/plain_jax_llama.py" "$3" 2 \
    | sed "s/^{/{\"bench\": \"llama405b-slice\", \"impl\": \"anchor\", \"gpu_index\": $1, /" >> "$out/gpu$1.jsonl"
}
p() {  # gpu flags recipe
  CUDA_VISIBLE_DEVICES=$1 XLA_FLAGS="$2" BENCH_OUT="$out/gpu$1.jsonl" timeout 170 python3 -m bench.profile_step "$3" \
    --shape 405b --layers 3 --out "/tmp/prof-$1-$3" > /dev/null || echo "profile $3 failed on gpu $1"
}
(a 0 "$LHS" minimal; a 0 "$LHS" offload_minimal; p 0 "$LHS" minimal_offload; p 0 "$LHS" minimal) > "$out/gpu0.log" 2>&1 &
(a 1 "$LHS --xla_gpu_enable_pipelined_host_offloading=true" offload_minimal
 a 1 "$LHS --xla_gpu_enable_while_loop_double_buffering=true" offload_minimal
 p 1 "$LHS --xla_gpu_enable_pipelined_host_offloading=true" minimal_offload) > "$out/gpu1.log" 2>&1 &
wait
cat "$out"/gpu0.jsonl "$out"/gpu1.jsonl | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line); p = r.pop('profile', None)
    print({k: r.get(k) for k in ('impl', 'gpu_index', 'policy', 'recipe', 'flags', 'step_s', 'traced_step_s', 'tflops', 'peak_gib', 'host_temp_gib', 'error')})
    if p: print('   ', json.dumps({k: p.get(k) for k in ('window_ms_per_step', 'compute_stream', 'compute_busy_ms_per_step', 'compute_idle_ms_per_step', 'copies')}))
"
