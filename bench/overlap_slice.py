"""A Llama slice under one recipe and one offload mechanism, one process per configuration.

    XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true \
        python -m bench.overlap_slice minimal_offload --shape 405b --layers 3 [--profile DIR]

Shapes: `405b` (the 405B preset cut to --layers, batch 2, seq 8192: the llama405b-slice), `8b` (the 8B preset cut to
--layers; the 8B-shaped slice), `tiny` (CPU smoke test, with --smoke). SGD step (as the plain-JAX anchors),
bf16, cuDNN attention on a GPU; 2 warm-up steps, median of --steps timed steps. Offloads move by JAX's checkpoint
offload (the record's `mechanism` is "xla"). With --profile, two more steps run under `jax.profiler.trace` and
`bench.trace_summary` reads where the copies ran (stream, bytes, bandwidth, overlap with compute); with --hlo, the
compiled program's asynchronous ops (copy-start, dynamic-(update-)slice-start, calls on another stream) are counted.
Prints one JSON record (`bench.records`; `mechanism`, `profile`, `hlo` in its extras).
"""
from __future__ import annotations

import argparse
import collections
import datetime
import os
import re
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

import zoo
from bench.common import guarded, llama_step_flops, profile_guided, sgd_step_fn, step_options
from recipes.llama3 import RECIPES
from zoo.plan import peak as peak_lib

PRESETS = {"405b": "llama3_1_405b", "8b": "llama3_1_8b", "tiny": "tiny"}  # --shape -> LlamaConfig preset
BENCH = {"405b": "llama405b-slice", "8b": "llama8b-slice", "tiny": "llama-tiny-smoke"}


def hlo_summary(text: str) -> dict:
    """Asynchronous and host-memory ops of a compiled program (what XLA made of the copies)."""
    ops = collections.Counter()
    queues = collections.Counter()
    for line in text.splitlines():
        m = re.search(r"= \S+ ([a-z-]+-(?:start|done))\(", line)
        if not m:
            m = re.search(r"= \S+ (copy|dynamic-update-slice|dynamic-slice|custom-call)\(", line)
            if not (m and "S(5)" in line):
                continue
        op = m.group(1) + (" [S(5)]" if "S(5)" in line else "")
        ops[op] += 1
        q = re.search(r'operation_queue_id"?\s*:\s*"?(\d+)', line)
        if q:
            queues[f"{m.group(1)}@queue{q.group(1)}"] += 1
    return {"ops": dict(ops), "queues": dict(queues), "S5_buffers": text.count("S(5)"),
            "stream_annotations": text.count("_xla_stream_annotation")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", choices=sorted(RECIPES))
    ap.add_argument("--shape", choices=sorted(PRESETS), default="405b")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile", default=None, metavar="DIR", help="trace 2 more steps here and summarise them")
    ap.add_argument("--hlo", action="store_true", help="count the compiled program's async / host-memory ops")
    ap.add_argument("--pgle", action="store_true",
                    help="then compile again with profile-guided latency estimation (bench.common."
                         "profile_guided) and time that too (step_s_pgle)")
    ap.add_argument("--mlp-chunks", type=int, default=1,
                    help="the MLP in this many sequence chunks (LMConfig.mlp_seq_chunks: earlier gate/up copies)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on any device (checks the script only)")
    a = ap.parse_args()
    on_gpu = jax.devices()[0].platform == "gpu"
    shape = "tiny" if a.smoke else a.shape
    kw = dict(num_layers=a.layers, param_dtype="bfloat16", dtype="bfloat16", mlp_seq_chunks=a.mlp_chunks)
    if on_gpu:
        kw["attention_impl"] = "cudnn"
    cfg = zoo.models.LlamaConfig.preset(PRESETS[shape], **kw)
    batch, seq = (2, 64) if a.smoke else (a.batch, a.seq)
    recipe = RECIPES[a.recipe]

    def run():
        model = zoo.models.llama3(cfg, recipe=recipe, rngs=nnx.Rngs(0))
        tokens = jax.random.randint(jax.random.key(1), (batch, seq), 0, cfg.vocab_size, jnp.int32)
        flops = llama_step_flops(cfg, model, batch, seq)
        try:
            planned = round(zoo.plan.plan(cfg, recipe, batch=batch, seq=seq, peak=None).host_bytes / 2**30, 3)
        except Exception as e:  # the plan is a comparison, not a precondition
            planned = f"{type(e).__name__}: {str(e)[:80]}"
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        del model
        t0 = time.perf_counter()
        options = step_options(recipe)
        compiled = sgd_step_fn(graphdef).lower(params, rest, tokens).compile(compiler_options=options)
        compile_s = time.perf_counter() - t0
        ma = compiled.memory_analysis()
        text = compiled.as_text()
        for _ in range(a.warmup):
            (loss, dropped), params = compiled(params, rest, tokens)
        loss.block_until_ready()
        times = []
        for _ in range(a.steps):
            t = time.perf_counter()
            (loss, dropped), params = compiled(params, rest, tokens)
            loss.block_until_ready()
            times.append(time.perf_counter() - t)
        step_s = statistics.median(times)
        pgle = {}
        if a.pgle:
            state = {"params": params}

            def one(c):
                (loss_, _), state["params"] = c(state["params"], rest, tokens)
                loss_.block_until_ready()

            lowered = sgd_step_fn(graphdef).lower(params, rest, tokens)
            again, path = profile_guided(lowered, options, one)
            for _ in range(a.warmup):
                one(again)
            ptimes = []
            for _ in range(a.steps):
                t = time.perf_counter()
                one(again)
                ptimes.append(time.perf_counter() - t)
            params = state["params"]
            pgle = dict(step_s_pgle=round(statistics.median(ptimes), 4), pgle_profile=path,
                        tflops_pgle=round(flops / statistics.median(ptimes) / 1e12, 1))
        stats = jax.devices()[0].memory_stats() or {}
        out = dict(step_s=round(step_s, 4), step_s_spread=round(max(times) - min(times), 4),
                   tflops=round(flops / step_s / 1e12, 1),
                   peak_gib=round(stats.get("peak_bytes_in_use", 0) / 2**30, 2),
                   planned_peak_gib=round(peak_lib.from_compiled(compiled).bytes / 2**30, 2),
                   temp_gib=round(ma.temp_size_in_bytes / 2**30, 2),
                   host_temp_gib=round(getattr(ma, "host_temp_size_in_bytes", 0) / 2**30, 2),
                   planned_host_gib=planned, has_S5="S(5)" in text, compile_s=round(compile_s, 1),
                   loss=float(loss), dropped=int(dropped), compile_options=options, **pgle)
        if a.hlo:
            out["hlo"] = hlo_summary(text)
            if os.environ.get("BENCH_HLO_OUT"):   # the optimized program, for reading where the copies went
                with open(os.environ["BENCH_HLO_OUT"], "w") as f:
                    f.write(text)
        if a.profile:
            from bench import trace_summary

            t = time.perf_counter()
            with jax.profiler.trace(a.profile):
                for _ in range(2):
                    (loss, dropped), params = compiled(params, rest, tokens)
                loss.block_until_ready()
            out["traced_step_s"] = round((time.perf_counter() - t) / 2, 4)
            trace = trace_summary.load(a.profile)
            p = trace_summary.summarise(trace, 2)
            out["gaps"] = trace_summary.gaps(trace, 2)
            out["profile"] = {k: p.get(k) for k in ("window_ms_per_step", "compute_stream", "compute_busy_ms_per_step",
                                                    "compute_idle_ms_per_step", "copies")}
            out["profile"]["streams"] = [(s["stream"], s["busy_ms"]) for s in p["streams"]]
        return out

    guarded(run, bench=BENCH[shape], impl="zoo", mechanism="xla", recipe=a.recipe, backend=None, gpus=1,
            mesh=None, B=batch, S=seq, L=a.layers, mlp_seq_chunks=a.mlp_chunks,
            date=datetime.date.today().isoformat(), device=str(jax.devices()[0].device_kind))


if __name__ == "__main__":
    main()
