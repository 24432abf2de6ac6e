#!/usr/bin/env bash
# Device calls for deepseek-slice. Usage (GPU machine, repo root):
#   bash bench/run_deepseek.sh ragged ANCHOR_DIR OUT_FILE    # zoo (ragged_dot) beside the plain-JAX anchor
#   bash bench/run_deepseek.sh capacity ANCHOR_DIR OUT_FILE  # zoo with capacity dispatch (batched einsum)
#   bash bench/run_deepseek.sh side_by_side ANCHOR_DIR OUT_FILE  # capacity dispatch beside the anchor
set -u
mode=$1; anchor=$2; out=$3
export BENCH_OUT=$out PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true"
zoo() {  # recipe backend batch
  timeout 110 python3 -m bench.deepseek_slice "$1" --backend "$2" --batch "$3" --steps 4 ||
    echo "{\"bench\": \"deepseek-slice\", \"impl\": \"zoo\", \"backend\": \"$2\", \"recipe\": \"$1\", \"B\": $3, \"error\": \"timeout or crash\"}" >> "$out"
}
anchor() {  # policy batch
  E=16 NL=3 timeout 110 python3 "$anchor/plain_jax_deepseek.py" "$1" "$2" | tee -a "$out"
}
if [ "$mode" = side_by_side ]; then  # capacity dispatch beside the anchor, in one call
  anchor full 4; zoo full capacity 4; zoo mla_moe_offload capacity 4
elif [ "$mode" = ragged ]; then
  anchor full 4; zoo full ragged_dot 4
  anchor mla_moe_offload 4; zoo mla_moe_offload ragged_dot 4
  zoo lowrank_wa_offload ragged_dot 4; anchor lowrank_offload 4
else
  zoo full capacity 4; zoo mla_moe_offload capacity 4; zoo lowrank_wa_offload capacity 4
  zoo save_mla_moe capacity 4; zoo mla_moe_offload capacity 8; zoo full ragged_dot 2
fi
