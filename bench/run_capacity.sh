#!/usr/bin/env bash
# capacity-sweep on one H200 (issue 11, "the largest batch each deepseek-slice recipe fits equals the largest the
# planner says fits"): for each recipe given, `python3 -m bench.capacity_sweep RECIPE --start B`: the planner's
# largest power-of-two batch B* (the main job's SGD step compiled per batch against the allocator's bytes_limit),
# then the real step at B* (should run) and 2 B* (should run out of memory), each in its own process.
# Usage (GPU machine, repo root):
#   BENCH_OUT=out.jsonl bash bench/run_capacity.sh full mla_moe_offload      # one or two recipes per call
#   SMOKE=1 BENCH_OUT=/tmp/c.jsonl bash bench/run_capacity.sh full           # CPU, tiny preset: checks the scripts
# Env: BUDGET (seconds for the whole call, default 500), BACKEND (default capacity), PYTHON, XLA_FLAGS (default
# the latency-hiding scheduler, as the other deepseek-slice runners). Each recipe gets an equal share of the time
# left; a recipe left without time gets a record saying so. A recipe takes about 3-5 minutes on the H200: about
# 30-70 s a compile (it grows with the batch), three or four compiles, the state built, two steps.
set -u
[ $# -ge 1 ] || { echo "usage: bash bench/run_capacity.sh RECIPE..." >&2; exit 2; }
out=${BENCH_OUT:-bench/results/capacity-sweep_$(date +%F).jsonl}
export BENCH_OUT=$out PYTHONUNBUFFERED=1
export XLA_FLAGS="${XLA_FLAGS:---xla_gpu_enable_latency_hiding_scheduler=true}"
budget=${BUDGET:-500}
py=${PYTHON:-python3}
backend=${BACKEND:-capacity}

# The first batch the planner compiles, per recipe, so that the walk needs about two compiles (start: fits, 2 x
# start: does not). From the capacity backend's measured peaks at batch 4 (docs/benchmarks.md, bench SGD step):
# full 39.7 GiB, save_mla_moe 60.0, mla_moe_offload 47.6 (78.0 at batch 8), lowrank_wa_offload 52.8, with 19.5 GiB
# of parameters and gradients (zoo.plan) and a limit of about 104.9 GiB (75% of the H200): the per-sequence growth
# (peak - 19.5) / 4 gives full ~5.0 GiB -> 16, save_mla_moe ~10.1 -> 8, mla_moe_offload ~7.0 -> 8,
# lowrank_wa_offload ~8.3 -> 8; lowrank_offload (not measured with capacity dispatch) as lowrank_wa_offload; none
# (every intermediate kept) a guess. A wrong guess costs a compile: the walk goes down from a start that does not fit.
declare -A START=([full]=16 [save_mla_moe]=8 [mla_moe_offload]=8 [lowrank_wa_offload]=8 [lowrank_offload]=8
                  [none]=2)

if ls .whl/*.whl >/dev/null 2>&1; then  # tokamax for BACKEND=tokamax, as bench/run_gpu_job.sh
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  $py -c "import xprof" 2>/dev/null || export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/bench/shims"
fi
if [ -n "${SMOKE:-}" ]; then
  export JAX_PLATFORMS=cpu; s=(--smoke --hbm "${SMOKE_HBM:-0.01}")
else
  s=()
fi
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$(mktemp -d /tmp/capacity-jit.XXXX)}

left() { echo $(( budget - SECONDS )); }
record() {  # recipe error
  echo "{\"bench\": \"capacity-sweep\", \"impl\": \"zoo\", \"recipe\": \"$1\", \"backend\": \"$backend\", \"fits\": null, \"error\": \"$2\"}" >> "$out"
}
n=$#
for r in "$@"; do
  t=$(( $(left) / n )); n=$(( n - 1 ))
  if [ "$t" -lt 90 ]; then record "$r" "skipped: the call's time budget ($budget s) was spent"; continue; fi
  start=${START[$r]:-1}
  [ -n "${SMOKE:-}" ] && start=1
  echo "== $r: --start $start, $t s"
  timeout "$t" $py -m bench.capacity_sweep "$r" --start "$start" --backend "$backend" --deadline $(( t - 10 )) "${s[@]}"
  rc=$?
  if [ $rc = 124 ]; then record "$r" "timeout after $t s"; elif [ $rc != 0 ]; then record "$r" "crash (exit $rc)"; fi
done
echo "done in $SECONDS s; records in $out"
