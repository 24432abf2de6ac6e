#!/usr/bin/env bash
# Issue 11's first call of 2026-11-30, on two H200 side by side (one single-GPU runner each):
#   part tiles (GPU 0): bench.tokamax_tiles (tile configurations of tokamax's grouped matmul for the deepseek-slice's
#     problems), then deepseek-slice `full` with the fastest tiles, with tokamax's own choice, and with capacity
#     dispatch, in one call;
#   part job (GPU 1): bench.step_cost (the main job's step by guard variant, one process each), main-job-8b (the
#     main job and its SGD twin), and the plain-JAX 8B anchor (8 layers, no embedding or head).
#   part ds (second call): deepseek-slice with the built-in tiles: full (tokamax, capacity, tokamax's own choice),
#     the recipe `auto` picks and the other recipes (tokamax);
#   part job2 (second call): the main job after its data prefetch (qkv_offload, then MJ_SECOND) with their SGD
#     twins, then the capacity sweep of the recipes in SWEEP (bench/run_capacity.sh).
# Usage (GPU machine, repo root; carry .whl and .anchor):  bash bench/run_issue11.sh tiles|job|ds|job2 OUT_DIR [--smoke]
set -u
part=$1; outdir=$2; smoke=${3:-}
mkdir -p "$outdir"
export BENCH_OUT="$outdir/$part.jsonl" PYTHONUNBUFFERED=1
export XLA_FLAGS="${XLA_FLAGS:---xla_gpu_enable_latency_hiding_scheduler=true}"
budget=${BUDGET:-540}
py=${PYTHON:-python3}
if [ -d /tmp/site ]; then export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"; fi
$py -c "import xprof" 2>/dev/null || export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/bench/shims"
s=(); [ "$smoke" = --smoke ] && { s=(--smoke); export SMALL=1; }
cap() { local l=$(( budget - SECONDS )); [ "$1" -lt "$l" ] && echo "$1" || echo "$l"; }
run() {  # limit label command...
  local t; t=$(cap "$1"); shift; local label=$1; shift
  if [ "$t" -lt 30 ]; then echo "{\"bench\": \"$label\", \"error\": \"skipped: the call's budget ($budget s) was spent\"}" >> "$BENCH_OUT"; return; fi
  timeout "$t" "$@" || echo "{\"bench\": \"$label\", \"error\": \"exit $? (124: timeout)\", \"command\": \"$*\"}" >> "$BENCH_OUT"
}
if [ "$part" = tiles ]; then
  if [ -z "$smoke" ]; then
    run 240 tokamax-tiles $py -m bench.tokamax_tiles --out "$outdir/tiles.json"
  fi
  ds() { run "$1" deepseek-slice $py -m bench.deepseek_slice "$2" --backend "$3" --batch 4 --steps 4 "${s[@]}"; }
  [ -f "$outdir/tiles.json" ] && ZOO_TOKAMAX_TILES="$outdir/tiles.json" ds 100 full tokamax
  ds 90 full capacity
  ds 100 full tokamax
  [ -f "$outdir/tiles.json" ] && ZOO_TOKAMAX_TILES="$outdir/tiles.json" ds 100 lowrank_offload tokamax
elif [ "$part" = ds ]; then
  # deepseek-slice with the zoo's measured tiles (built in), beside capacity dispatch and tokamax's own choice,
  # then the recipe `auto` picks and the others it is compared with (same backend, same call).
  ds() { run "$1" deepseek-slice $py -m bench.deepseek_slice "$2" --backend "$3" --batch 4 --steps 4 "${s[@]}"; }
  echo '{}' > "$outdir/no-tiles.json"
  ds 150 full tokamax
  ds 130 full capacity
  ds 150 auto tokamax
  for r in ${DS_RECIPES:-save_mla_moe lowrank_offload mla_moe_offload lowrank_wa_offload}; do ds 130 "$r" tokamax; done
  [ -n "${DS_NO_TILES:-}" ] && ZOO_TOKAMAX_TILES="$outdir/no-tiles.json" ds 130 full tokamax
elif [ "$part" = job2 ]; then
  mj() {  # recipe limit
    run "$2" main-job-8b $py -m bench.main_job_8b main --recipe "$1" --steps 12 --workdir "$outdir/mj" --timeout $(( $2 - 10 )) "${s[@]}"
    cp "$outdir/mj/train.log" "$outdir/main-job-8b-$1.log" 2>/dev/null; rm -rf "$outdir/mj"
  }
  for r in ${MJ_RECIPES:-qkv_offload}; do
    mj "$r" 170
    [ "$r" != auto ] && run 90 main-job-8b $py -m bench.main_job_8b sgd --recipe "$r" "${s[@]}"
  done
  if [ -n "${SWEEP:-}" ]; then
    BUDGET=$(( budget - SECONDS )) bash bench/run_capacity.sh $SWEEP
  fi
else
  for v in guard_lr guard_exact no_guard; do
    run 110 step-cost $py -m bench.step_cost --recipe qkv_offload --variants $v "${s[@]}"
  done
  run 200 main-job-8b $py -m bench.main_job_8b main --recipe qkv_offload --steps 12 --workdir "$outdir/mj" --timeout 180 "${s[@]}"
  cp "$outdir/mj/train.log" "$outdir/main-job-8b.log" 2>/dev/null
  cp "$outdir/mj/metrics.jsonl" "$outdir/main-job-8b-metrics.jsonl" 2>/dev/null; rm -rf "$outdir/mj"
  run 90 main-job-8b $py -m bench.main_job_8b sgd --recipe qkv_offload "${s[@]}"
  if [ -z "$smoke" ]; then
    for pol in full offload_qkv; do
      if SHAPE=8b NL=8 timeout "$(cap 80)" $py .anchor/plain_jax_llama.py $pol 2 > "$outdir/anchor.json"; then
        $py -m bench.anchor_record llama8b-slice "$outdir/anchor.json" --S 8192 --backend none || true
      fi
    done
  fi
fi
echo "part $part done in $SECONDS s"
