#!/usr/bin/env bash
# One device call (one H200, about 8 minutes): main-job-8b with the optimizer state on the host.
#   1. the 8B preset, all 32 layers, seq 8192, batch 4, state in HBM: expected refused before launch (exit 2),
#      its refusal naming --opt-state host; only the log is kept.
#   2. the same with --opt-state host --grad-accum 4 (micro-batches of 1): a record.
#   3. the 8-layer cut, batch 2, state in HBM (the usual main-job-8b record) beside it.
# Usage (GPU machine, repo root): bash bench/run_opt_state.sh OUT_DIR
# Records (DESIGN section 8, with L, opt_state, grad_accum) go to OUT_DIR/opt-state.jsonl, logs beside them.
# Both runs get the same allocator share and pinned pool: float32 parameters, gradients and their float32 sums
# take 90 GiB of HBM at 32 layers, and AdamW's moments 60 GiB of pinned host memory (64 GiB pool by default).
set -u
outdir=$1
mkdir -p "$outdir"
export BENCH_OUT="$outdir/opt-state.jsonl" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-.95}
export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=${XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB:-80}
py=${PYTHON:-python3}

timeout 200 $py -m recipes.train --preset llama3_1_8b --seq 8192 --batch 4 --recipe qkv_offload --steps 1 \
  > "$outdir/refused-32-layers-in-hbm.log" 2>&1
echo "32 layers, state in HBM: exit $? (2: refused before launch); $(grep -o 'error: .*' "$outdir/refused-32-layers-in-hbm.log" | cut -c1-400)"
$py -m bench.main_job_8b main --layers 32 --batch 4 --grad-accum 4 --opt-state host --steps 8 --timeout 300 \
  --workdir "$outdir/mj32"
$py -m bench.main_job_8b main --layers 8 --batch 2 --steps 12 --timeout 150 --workdir "$outdir/mj8"
echo "done in $SECONDS s; records in $BENCH_OUT"
