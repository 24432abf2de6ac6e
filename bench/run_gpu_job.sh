#!/usr/bin/env bash
# ONE device call for issue 11's first measurements (one H200, about 8 minutes):
#   deepseek-slice: tokamax `full` vs capacity `full` at batch 4, each offload recipe's host bytes vs the plan
#   (tokamax), the plain-JAX anchor's `full` beside it; main-job-8b: `python -m recipes.train` (AdamW) beside the
#   SGD bench of the same model.
# Usage (GPU machine, repo root; carry .whl):
#   bash bench/run_gpu_job.sh ANCHOR_SCRIPT OUT_DIR            # ANCHOR_SCRIPT: a copy of plain_jax_deepseek.py
#   bash bench/run_gpu_job.sh ANCHOR_SCRIPT OUT_DIR --smoke    # tiny shapes on the CPU: checks the scripts only
# Writes OUT_DIR/gpu-job.jsonl (one record per configuration, DESIGN section 8), OUT_DIR/main-job-8b.log and
# OUT_DIR/main-job-8b-metrics.jsonl. Every process runs under `timeout`, cut further so that the whole call ends
# within BUDGET seconds (default 540); a configuration skipped for time leaves a record saying so.
set -u
anchor=$1; outdir=$2; smoke=${3:-}
mkdir -p "$outdir"
out="$outdir/gpu-job.jsonl"
export BENCH_OUT=$out PYTHONUNBUFFERED=1
export XLA_FLAGS="${XLA_FLAGS:---xla_gpu_enable_latency_hiding_scheduler=true}"
budget=${BUDGET:-540}
py=${PYTHON:-python3}

# tokamax and its pure-Python dependencies travel as wheels in .whl; xprof (imported by tokamax only for its own
# benchmarking) is replaced by bench/shims/xprof where it is not installed.
if ls .whl/*.whl >/dev/null 2>&1; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
$py -c "import xprof" 2>/dev/null || export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/bench/shims"
$py -c "import tokamax, sys; print('tokamax', tokamax.__version__)" || echo "tokamax does not import: tokamax rows will say so"

if [ "$smoke" = --smoke ]; then
  s=(--smoke); export SMALL=1 JAX_PLATFORMS=cpu; dsb=2; seq8b=""
else
  s=(); dsb=4
fi

left() { echo $(( budget - SECONDS )); }
cap() {  # cap SECONDS: the smaller of SECONDS and the time left
  local l; l=$(left); [ "$1" -lt "$l" ] && echo "$1" || echo "$l"
}
skipped() {  # bench impl recipe backend
  echo "{\"bench\": \"$1\", \"impl\": \"$2\", \"recipe\": \"$3\", \"backend\": \"$4\", \"error\": \"skipped: the call's time budget ($budget s) was spent\"}" >> "$out"
}
failed() {  # bench impl recipe backend rc (124: the process's timeout)
  local why="crash (exit $5)"; [ "$5" = 124 ] && why="timeout"
  echo "{\"bench\": \"$1\", \"impl\": \"$2\", \"recipe\": \"$3\", \"backend\": \"$4\", \"error\": \"$why\"}" >> "$out"
}
ds() {  # recipe backend limit
  local t; t=$(cap "$3"); if [ "$t" -lt 30 ]; then skipped deepseek-slice zoo "$1" "$2"; return; fi
  timeout "$t" $py -m bench.deepseek_slice "$1" --backend "$2" --batch $dsb --steps 4 "${s[@]}" ||
    failed deepseek-slice zoo "$1" "$2" $?
}
ds_anchor() {  # policy limit
  local t; t=$(cap "$2"); if [ "$t" -lt 30 ]; then skipped deepseek-slice anchor "$1" ragged_dot; return; fi
  if E=16 NL=3 timeout "$t" $py "$anchor" "$1" $dsb > "$outdir/anchor.json"; then
    $py -m bench.anchor_record deepseek-slice "$outdir/anchor.json" --S 4096 "${s[@]}"
  else
    failed deepseek-slice anchor "$1" ragged_dot $?
  fi
}
main8b() {  # limit
  local t; t=$(cap "$1"); if [ "$t" -lt 60 ]; then skipped main-job-8b zoo-main-job qkv_offload none; return; fi
  $py -m bench.main_job_8b main --recipe qkv_offload --steps 12 --workdir "$outdir/mj" --timeout $(( t - 20 )) "${s[@]}"
  cp "$outdir/mj/train.log" "$outdir/main-job-8b.log" 2>/dev/null
  cp "$outdir/mj/metrics.jsonl" "$outdir/main-job-8b-metrics.jsonl" 2>/dev/null
  rm -rf "$outdir/mj"
}
sgd8b() {  # limit
  local t; t=$(cap "$1"); if [ "$t" -lt 30 ]; then skipped main-job-8b zoo-sgd-bench qkv_offload none; return; fi
  timeout "$t" $py -m bench.main_job_8b sgd --recipe qkv_offload "${s[@]}" || failed main-job-8b zoo-sgd-bench qkv_offload none $?
}

# Most important first: the dropless-vs-capacity comparison, the study's recipe, the main job, then the rest.
ds full tokamax 100
ds full capacity 90
ds mla_moe_offload tokamax 90
main8b 180
sgd8b 80
ds_anchor full 90
ds lowrank_wa_offload tokamax 90
ds lowrank_offload tokamax 90   # the rest of the recipes, while time is left
ds save_mla_moe tokamax 90
echo "done in $SECONDS s; records in $out"
