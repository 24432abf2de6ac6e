"""plan-probe: the planner's compiled answer for the longest contexts, without running a step. The main job's training
step (zoo.train_step) for Llama 3.1 8B, all 32 layers, batch 1, bf16 parameters with their float32 master and AdamW's
moments (bf16) in pinned host memory, compiled on abstract inputs for the GPU present, one record per recipe and
length: the compiled peak HBM and host bytes beside the planner's estimate and predicted step time.

    python -m bench.plan_probe --seq 262144 --recipe long_context --recipe auto   # one record each
    python -m bench.plan_probe --longest 524288 --recipe auto                      # zoo.plan.longest_seq's answer
    python -m bench.plan_probe --seq 1048576 --params stream --attention-tiles 16  # a million, streamed, query tiles

`--smoke`: the tiny preset on the CPU (checks the script only).
"""
from __future__ import annotations

import argparse
import os
import time


def _args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, action="append", default=[], help="a length to compile (repeat)")
    ap.add_argument("--recipe", action="append", default=[],
                    help="a Llama recipe name, auto, or carry:TILES:GROUP[:SUBGROUP] (the layer input of every "
                         "GROUP-th layer offloaded, everything else recomputed, TILES sequence tiles: what auto "
                         "chooses at 1M; SUBGROUP: layers per subgroup, three-level checkpoints) (repeat)")
    ap.add_argument("--attention-impl", default=None, help="the config's attention_impl (default: auto's choice)")
    ap.add_argument("--longest", type=int, default=None, metavar="CAP",
                    help="instead: the longest power-of-two length up to CAP that fits (zoo.plan.longest_seq)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--params", choices=("host", "stream"), default="host",
                    help="the parameters' float32 master on the host (host), or also the bf16 parameters streamed a "
                         "layer at a time (stream)")
    ap.add_argument("--attention-tiles", type=int, default=1, metavar="N",
                    help="attention over N query tiles (the config's attention_tiles)")
    ap.add_argument("--smoke", action="store_true")
    return ap.parse_args()


def _recipe(name: str, recipes):
    """auto, a recipe of the set, or carry:TILES:GROUP[:SUBGROUP]."""
    if name.startswith("carry:"):
        import zoo
        tiles, group, *sub = (int(n) for n in name.split(":")[1:])
        return zoo.Recipe(name, offload=("decoder_layer_input",), seq_tiles=tiles, group=group,
                          subgroup=sub[0] if sub else 1)
    return "auto" if name == "auto" else recipes[name]


def main():
    a = _args()
    if a.smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    import zoo
    from bench.common import emit
    from recipes.llama3 import RECIPES
    from recipes.train.watching import meter
    from zoo.plan.peak import allocator_limit

    device = jax.devices()[0]
    seqs = a.seq or ([256] if a.smoke else [262144])
    cfg = zoo.models.LlamaConfig.preset("tiny" if a.smoke else "llama3_1_8b", num_layers=2 if a.smoke else a.layers,
                                        param_dtype="bfloat16", max_seq_len=max(seqs + [a.longest or 0]),
                                        attention_tiles=a.attention_tiles, attention_impl=a.attention_impl)
    limit = allocator_limit(device)
    hbm_gib = limit / 2**30 if limit else 1.0
    hardware = zoo.plan.Hardware(hbm_gib=hbm_gib, tflops=meter.peak_tflops(device, None)[0] or 1.0,
                                 **({"link_gbps": 10.0} if device.platform == "cpu" else {}))
    training = zoo.plan.Training(opt_dtype="bfloat16", opt_state="host", params=a.params, loss_chunk="auto")
    ident = dict(bench="plan-probe", impl="zoo", backend=None, B=1, L=cfg.num_layers, optimizer="adamw",
                 opt_state="host", params=a.params, opt_dtype="bfloat16", param_dtype="bfloat16",
                 attention_tiles=a.attention_tiles)
    if a.longest:
        for name in a.recipe or ["auto"]:
            recipe = "auto" if name == "auto" else RECIPES[name]
            t0 = time.perf_counter()
            found = zoo.plan.longest_seq(cfg, recipe, hardware=hardware, training=training, cap=a.longest)
            emit({**ident, "recipe": name, "S": found.seq, "step_s": None, "tflops": None, "peak_gib": None,
                  "planned_peak_gib": None, "host_temp_gib": None, "planned_host_gib": None, "dropped": 0,
                  "longest": found.to_dict(), "wall_s": round(time.perf_counter() - t0, 1)})
        return
    for seq in seqs:
        for name in a.recipe or ["auto"]:
            recipe = _recipe(name, RECIPES)
            t0 = time.perf_counter()
            est = zoo.plan.plan(cfg, recipe, batch=1, seq=seq, hardware=hardware, training=training, peak="estimate")
            row = dict(ident, recipe=name, S=seq, step_s=None, tflops=None, peak_gib=None, dropped=0,
                       recipe_run=str(est.recipe), loss_chunk=est.loss_chunk,
                       estimated_peak_gib=round(est.peak_bytes / 2**30, 2),
                       planned_step_s=round(est.step_time()["total_s"], 3), planned_host_gib=round(
                           est.host_total / 2**30, 2))
            try:
                p = zoo.plan.plan(cfg, est.recipe, batch=1, seq=seq, hardware=hardware,
                                  training=zoo.plan.Training(opt_dtype="bfloat16", opt_state="host", params=a.params,
                                                             loss_chunk=est.loss_chunk), peak="compile")
                d = p.peak.detail
                row.update(planned_peak_gib=round(p.peak_bytes / 2**30, 2), planned_peak_source=p.peak_source,
                           host_temp_gib=round(d.get("host_temp", 0) / 2**30, 2),
                           host_state_gib=round(d.get("host_argument", 0) / 2**30, 2),
                           compile_s=round(time.perf_counter() - t0, 1), fits=p.peak_bytes <= (limit or p.peak_bytes))
            except Exception as e:   # a program XLA cannot compile (out of memory at compile time) is data too
                row.update(planned_peak_gib=None, host_temp_gib=None, error=f"{type(e).__name__}: {str(e)[:300]}")
            emit(row)


if __name__ == "__main__":
    main()
