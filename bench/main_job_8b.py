"""main-job-8b: the main job itself (`python -m recipes.train`) on the Llama 3.1 8B preset cut to 8 layers, batch 2,
seq 8192, AdamW, beside the SGD bench of the same model (bench.common's step), one process each.

    python -m bench.main_job_8b main --recipe qkv_offload --steps 12 --workdir /tmp/mj   # the main job
    python -m bench.main_job_8b sgd --recipe qkv_offload                                  # the SGD bench
    python -m bench.main_job_8b main --layers 32 --batch 4 --grad-accum 4 --opt-state host   # all 32 layers

`--layers`, `--batch`, `--opt-state` and `--grad-accum` (main mode) change the shape and where the optimizer
state lives; every record carries `L`, `B`, `opt_state` and `grad_accum`.

`main` runs the real command line in a child process (its own XLA flag set, `--metrics` file, one line per step)
and turns the metrics into one record: median step time and model TFLOP/s of the steps after the first two,
peak HBM and host bytes as the job reports them, dropped copies. The parent plans on the CPU only (it never
touches the GPU the child uses). Both modes count the same model FLOPs (the `llama3` family's `flops_per_token`),
so their TFLOP/s compare. `--smoke`: the tiny preset on any device (checks the script only).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from bench import trace_summary
from zoo.opt_state import PARAMS_PLACES

MODEL = dict(model="llama3", preset="llama3_1_8b", layers=8, batch=2, seq=8192)
SMOKE = dict(model="llama3", preset="tiny", layers=2, batch=2, seq=64)


def _args():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["main", "sgd"])
    ap.add_argument("--recipe", default="qkv_offload")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--workdir", default="/tmp/main-job-8b", help="main: where the metrics file and log go")
    ap.add_argument("--timeout", type=int, default=240, help="main: seconds the child job may take")
    ap.add_argument("--layers", type=int, default=None, help="layers of the preset kept (default: 8; smoke: 2)")
    ap.add_argument("--batch", type=int, default=None, help="global batch (default: 2)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: 8192; smoke: 64)")
    ap.add_argument("--opt-state", choices=("device", "host"), default="device",
                    help="main: where the AdamW moments live between steps (recipes.train --opt-state)")
    ap.add_argument("--grad-accum", type=int, default=1, help="main: micro-batches per update (recipes.train)")
    ap.add_argument("--opt-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="main: dtype of AdamW's moments (recipes.train --opt-dtype)")
    ap.add_argument("--param-dtype", choices=("float32", "bfloat16"), default=None,
                    help="main: the parameters' dtype (default: the preset's, float32)")
    ap.add_argument("--params", choices=PARAMS_PLACES, default="device",
                    help="main: where the parameters live (recipes.train --params)")
    ap.add_argument("--train-arg", action="append", default=[], metavar="ARG",
                    help="main: one more argument for recipes.train (repeat; e.g. --train-arg=--loss-chunk=0)")
    ap.add_argument("--profile", action="store_true",
                    help="main: trace the run's second step (recipes.train --profile) and put the trace's summary "
                         "(bench.trace_summary) in the record")
    ap.add_argument("--smoke", action="store_true")
    return ap.parse_args()


def _shape(a) -> dict:
    m = dict(SMOKE if a.smoke else MODEL)
    m.update({k: v for k, v in (("layers", a.layers), ("batch", a.batch), ("seq", a.seq)) if v is not None})
    return m


def run_main(a) -> None:
    m = _shape(a)
    os.makedirs(a.workdir, exist_ok=True)
    metrics, log = os.path.join(a.workdir, "metrics.jsonl"), os.path.join(a.workdir, "train.log")
    trace = os.path.join(a.workdir, "trace")
    cmd = [sys.executable, "-m", "recipes.train", "--model", m["model"], "--preset", m["preset"],
           "--set", f"num_layers={m['layers']}", "--recipe", a.recipe, "--steps", str(a.steps),
           "--batch", str(m["batch"]), "--seq", str(m["seq"]), "--log-every", "1", "--metrics", metrics,
           "--opt-state", a.opt_state, "--grad-accum", str(a.grad_accum), "--opt-dtype", a.opt_dtype,
           "--params", a.params, *(("--set", f"param_dtype={a.param_dtype}") if a.param_dtype else ()),
           *(("--profile", trace) if a.profile else ()), *a.train_arg]
    if a.smoke and a.recipe == "auto":   # the CPU has no memory limit, measured link or FLOP table
        cmd += ["--hbm-limit", "1", "--link", "10", "--peak-tflops", "1"]
    # The parent plans and records on the CPU: the GPU stays the child's.
    os.environ["JAX_PLATFORMS"] = "cpu"
    child_env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    if os.path.exists(metrics):
        os.remove(metrics)
    ident = dict(bench="main-job-8b", impl="zoo", program="main-job", recipe=a.recipe, optimizer="adamw",
                 B=m["batch"], S=m["seq"], L=m["layers"], opt_state=a.opt_state, grad_accum=a.grad_accum,
                 opt_dtype=a.opt_dtype, params=a.params, command=" ".join(cmd[1:]))
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env, timeout=a.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    import zoo
    from bench.common import emit

    # the job's own lines beside the record (its work folder does not always travel back; the bench's log does)
    print("".join(line for line in open(log) if not line.startswith("step ")), end="", flush=True)
    rows = [json.loads(line) for line in open(metrics)] if os.path.exists(metrics) else []
    timed = [r for r in rows if r["step"] > 2] or [r for r in rows if r["step"] > 1] or rows   # past the warm-up
    if rc != 0 or not timed:
        tail = open(log).read()[-400:]
        emit({**ident, "error": f"rc={rc}, {len(rows)} steps logged; log tail: {tail}"})
        return
    step_s = statistics.median(m["batch"] * m["seq"] / r["tokens_per_s"] for r in timed)
    cfg = zoo.models.LlamaConfig.preset("tiny" if a.smoke else "llama3_1_8b", num_layers=m["layers"],
                                        **({"param_dtype": a.param_dtype} if a.param_dtype else {}))
    peak = [r["peak_hbm_bytes"] for r in rows if r.get("peak_hbm_bytes")]
    kernels = [line.strip() for line in open(log) if line.startswith(("attention:", "moe backend:"))]
    chosen = [line.strip() for line in open(log) if line.startswith(("recipe auto for", "auto: "))]
    emit({**ident, "backend": None, "param_dtype": cfg.param_dtype, "dtype": cfg.dtype,
          "step_s": round(step_s, 4), "tflops": round(statistics.median(r["model_tflops"] for r in timed), 1),
          "mfu_datasheet": timed[-1]["mfu"], "peak_gib": round(max(peak) / 2**30, 2) if peak else None,
          "host_temp_gib": None if timed[-1]["host_bytes"] is None else round(timed[-1]["host_bytes"] / 2**30, 2),
          "dropped": timed[-1].get("dropped"), "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"],
          "steps": len(rows), "step_s_each": [round(m["batch"] * m["seq"] / r["tokens_per_s"], 3) for r in rows],
          "kernels": kernels, **({"auto_choice": chosen} if chosen else {}),
          # the job's own prediction: its step compiled for the GPU before it launched (recipes.train.step.fit)
          **({"planned_peak_gib": round(rows[0]["planned_peak_bytes"] / 2**30, 2),
              "planned_peak_source": rows[0].get("planned_peak_source")} if rows[0].get("planned_peak_bytes") else {}),
          # what ran and what the job predicted for it before it launched
          "recipe_run": rows[0].get("recipe"), "loss_chunk": rows[0].get("loss_chunk"),
          "planned_step_s": rows[0].get("planned_step_s"),
          **({"planned_host_gib": round(rows[0]["planned_host_bytes"] / 2**30, 2)}
             if rows[0].get("planned_host_bytes") is not None else {}),
          **(_profile(trace) if a.profile else {})})


def _profile(trace: str) -> dict:
    """The traced step's summary per kernel and copy direction, and where the compute stream waited."""
    t = trace_summary.load(trace)
    return {"profile": trace_summary.summarise(t, 1, top=16), "profile_gaps": trace_summary.gaps(t, 1, bins=48)}


def run_sgd(a) -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import zoo
    from bench.common import guarded, measure, planned
    from recipes.llama3 import RECIPES
    from zoo.layers.attention_kernel import resolve_impl
    from zoo.models.llama3 import flops_per_token as llama_flops_per_token

    m = _shape(a)
    cfg = zoo.models.LlamaConfig.preset("tiny" if a.smoke else "llama3_1_8b", num_layers=m["layers"],
                                        param_dtype="bfloat16", dtype="bfloat16")  # the benches' dtypes
    recipe = RECIPES[a.recipe]

    def run():
        attention = str(resolve_impl(cfg))
        model = zoo.models.llama3(cfg, recipe=recipe, rngs=nnx.Rngs(0))
        tokens = jax.random.randint(jax.random.key(1), (m["batch"], m["seq"]), 0, cfg.vocab_size, jnp.int32)
        flops = llama_flops_per_token(cfg, model, m["seq"]) * m["batch"] * m["seq"]
        return dict(measure(model, tokens, flops_per_step=flops, steps=5, warmup=2, recipe=recipe), attention=attention,
                    param_dtype=cfg.param_dtype,
                    **planned(cfg, recipe, batch=m["batch"], seq=m["seq"], optimizer="sgd"))

    guarded(run, bench="main-job-8b", impl="zoo", program="sgd-bench", recipe=a.recipe, optimizer="sgd", backend=None,
            B=m["batch"], S=m["seq"], L=m["layers"], opt_state="device", grad_accum=1)


def main():
    a = _args()
    run_main(a) if a.mode == "main" else run_sgd(a)


if __name__ == "__main__":
    main()
