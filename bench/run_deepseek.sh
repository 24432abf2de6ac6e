#!/usr/bin/env bash
# Device calls for deepseek-slice. Usage (GPU machine, repo root):
#   bash bench/run_deepseek.sh ragged ANCHOR_DIR OUT_FILE    # zoo (ragged_dot) beside the plain-JAX anchor
#   bash bench/run_deepseek.sh capacity ANCHOR_DIR OUT_FILE  # zoo with capacity dispatch (batched einsum)
#   bash bench/run_deepseek.sh side_by_side ANCHOR_DIR OUT_FILE  # capacity dispatch beside the anchor
# Expert parallelism on two GPUs (32 experts, batch 8: each GPU's share as on one GPU; carry .whl for tokamax):
#   bash bench/run_deepseek.sh ep2 - OUT_FILE      # --mesh ep=2: capacity full, dropless (tokamax, ragged_a2a)
#                                                  # full and mla_moe_offload
#   bash bench/run_deepseek.sh ep2_one - OUT_FILE  # the same model and batch, dropless, on GPU 0 alone (the loss
#                                                  # the ep=2 dropless runs should equal)
set -u
mode=$1; anchor=$2; out=$3
export BENCH_OUT=$out PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true"
if ls .whl/*.whl >/dev/null 2>&1; then  # tokamax, as bench/run_gpu_job.sh
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  python3 -c "import xprof" 2>/dev/null || export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/bench/shims"
fi
zoo() {  # recipe backend batch [more deepseek_slice arguments]
  local r=$1 b=$2 n=$3; shift 3
  timeout "${TIMEOUT:-110}" python3 -m bench.deepseek_slice "$r" --backend "$b" --batch "$n" --steps 4 "$@" ||
    echo "{\"bench\": \"deepseek-slice\", \"impl\": \"zoo\", \"backend\": \"$b\", \"recipe\": \"$r\", \"B\": $n, \"args\": \"$*\", \"error\": \"timeout or crash\"}" >> "$out"
}
anchor() {  # policy batch
  E=16 NL=3 timeout 110 python3 "$anchor/plain_jax_deepseek.py" "$1" "$2" | tee -a "$out"
}
if [ "$mode" = ep2 ]; then
  TIMEOUT=180
  zoo full capacity 8 --mesh ep=2 --experts 32
  zoo full tokamax 8 --mesh ep=2 --experts 32 --ep-dispatch ragged_a2a
  zoo mla_moe_offload tokamax 8 --mesh ep=2 --experts 32 --ep-dispatch ragged_a2a
elif [ "$mode" = ep2_one ]; then
  export CUDA_VISIBLE_DEVICES=0; TIMEOUT=300
  zoo full tokamax 8 --experts 32
elif [ "$mode" = side_by_side ]; then  # capacity dispatch beside the anchor, in one call
  anchor full 4; zoo full capacity 4; zoo mla_moe_offload capacity 4
elif [ "$mode" = ragged ]; then
  anchor full 4; zoo full ragged_dot 4
  anchor mla_moe_offload 4; zoo mla_moe_offload ragged_dot 4
  zoo lowrank_wa_offload ragged_dot 4; anchor lowrank_offload 4
else
  zoo full capacity 4; zoo mla_moe_offload capacity 4; zoo lowrank_wa_offload capacity 4
  zoo save_mla_moe capacity 4; zoo mla_moe_offload capacity 8; zoo full ragged_dot 2
fi
