"""Profile a few training steps of a zoo Llama slice under one recipe and summarise where the time goes.

    XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true \
        python -m bench.profile_step minimal_offload --shape 405b --layers 3 --out /tmp/prof

Same step as bench/llama_slice.py (SGD, bf16, cuDNN attention on a GPU); with `--loss-chunk`, its loss is the
training step's (`zoo.train_step.eval_loss`: the head and the cross-entropy in chunks of that many positions, or
"auto"), which long sequences need. After `--warmup` steps (default 2), `--steps` steps run under
`jax.profiler.trace`; `bench.trace_summary` then reads the trace: per stream busy time, the host copies
(bytes, time, bandwidth while copying, overlap with compute) and the compute stream's idle time per step.
Prints one JSON line (the summary under "profile").
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import time

import jax
import jax.numpy as jnp
from flax import nnx

from bench import trace_summary
from bench.common import emit, sgd_step_fn
from recipes.registry import recipes_of
from zoo.models.registry import family

FAMILY = family("llama3")
RECIPES = recipes_of(FAMILY)
SHAPES = {"405b": "llama3_1_405b", "8b": "llama3_1_8b", "tiny": "tiny"}  # --shape -> the family's preset


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", choices=sorted(RECIPES))
    ap.add_argument("--shape", choices=sorted(SHAPES), default="405b")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=2, help="steps inside the trace")
    ap.add_argument("--out", default="/tmp/zoo-profile", help="profiler log directory")
    ap.add_argument("--warmup", type=int, default=2, help="steps before the trace")
    ap.add_argument("--top", type=int, default=4, help="kernels listed per stream (by their total time)")
    ap.add_argument("--loss-chunk", help="the training step's loss in chunks of this many positions (or auto)")
    ap.add_argument("--attention", default="cudnn", choices=("cudnn", "mosaic_cudnn"),
                    help="the attention kernel on a GPU (the CPU runs the XLA kernel)")
    ap.add_argument("--passes", metavar="TARGET",
                    help="compile only, with XLA's module dumped after every pass: report each pass after which "
                         "the number of TARGET custom calls (or of every target, with 'all') changed")
    a = ap.parse_args()
    dump = os.path.join(a.out, "hlo-passes") if a.passes else None
    if dump:   # read when the backend starts (the first jax.devices() below)
        os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text "
                                   f"--xla_dump_hlo_pass_re=.* --xla_dump_hlo_module_re=jit_step").strip()
    on_gpu = jax.devices()[0].platform == "gpu"
    preset = SHAPES[a.shape]
    longest = FAMILY.config(preset).max_seq_len   # None: no limit
    cfg = FAMILY.config(preset, num_layers=a.layers, param_dtype="bfloat16", dtype="bfloat16",
                        attention_impl=a.attention if on_gpu else "xla",
                        max_seq_len=longest and max(a.seq, longest))
    model = FAMILY.build(cfg, recipe=RECIPES[a.recipe], rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (a.batch, a.seq + bool(a.loss_chunk)), 0, cfg.vocab_size,
                                jnp.int32)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    del model
    chunk = a.loss_chunk if a.loss_chunk in (None, "auto") else int(a.loss_chunk)
    if chunk:
        tokens = {"tokens": tokens, "weights": jnp.ones((a.batch, a.seq), jnp.float32)}
    compiled = sgd_step_fn(graphdef, loss_chunk=chunk).lower(params, rest, tokens).compile()
    census = custom_calls(compiled.as_text())
    if dump:
        emit(dict(bench="profile", impl="zoo", recipe=a.recipe, shape=a.shape, B=a.batch, S=a.seq, L=a.layers,
                  attention=cfg.attention_impl, custom_calls=census, passes=pass_changes(dump, a.passes)))
        return
    untraced = []
    for _ in range(a.warmup):
        t = time.perf_counter()
        (loss, _), params = compiled(params, rest, tokens)
        loss.block_until_ready()
        untraced.append(round(time.perf_counter() - t, 4))
    t = time.perf_counter()
    with jax.profiler.trace(a.out):
        for _ in range(a.steps):
            (loss, _), params = compiled(params, rest, tokens)
        loss.block_until_ready()
    traced_s = time.perf_counter() - t
    summary = trace_summary.summarise(trace_summary.load(a.out), a.steps, top=a.top)
    emit(dict(bench="profile", impl="zoo", recipe=a.recipe, shape=a.shape, B=a.batch, S=a.seq, L=a.layers,
              attention=cfg.attention_impl, untraced_step_s=untraced, traced_step_s=round(traced_s / a.steps, 4),
              custom_calls=census, profile=summary))


def pass_changes(dump: str, target: str) -> list[dict]:
    """From a dump of the module after every pass (`--xla_dump_hlo_pass_re=.*`, files numbered in pass order), each
    pass after which the count of `target` custom calls (every target: "all") differs from the pass before."""
    numbered = ((re.search(r"jit_step\.(\d+)\.", os.path.basename(f)), f)
                for f in glob.glob(os.path.join(dump, "*jit_step*.after_*.txt")))
    files = [f for m, f in sorted(((m, f) for m, f in numbered if m), key=lambda mf: int(mf[0].group(1)))]
    changes, last = [], None
    for f in files:
        census = custom_calls(open(f).read())
        now = census if target == "all" else census.get(target, 0)
        if now != last:
            changes.append({"after": os.path.basename(f).split(".after_")[-1][:-4], "file": os.path.basename(f),
                            "count": now})
            last = now
    return changes


def custom_calls(hlo_text: str) -> dict[str, int]:
    """How many custom calls of each target the compiled program's text holds (a loop's body counted once): which
    kernels the step runs besides XLA's own, e.g. two attention forwards where one was expected."""
    return dict(collections.Counter(re.findall(r'custom_call_target="([^"]+)"', hlo_text)))


if __name__ == "__main__":
    main()
