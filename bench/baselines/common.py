"""What the plain-JAX baselines share: the offload policy helper, the timing loop and the JSON line they print."""
from __future__ import annotations

import json
import os
import time

import jax

cp = jax.checkpoint_policies


def offload(names: list[str]):
    """Offload exactly `names` to pinned host memory and recompute the rest (JAX's own policy)."""
    return cp.save_and_offload_only_these_names(names_which_can_be_saved=[], names_which_can_be_offloaded=names,
                                                offload_src="device", offload_dst="pinned_host")


def measure(step, params, x, *, warmup: int = 2, timed: int = 5) -> dict:
    """Compile `step(params, x) -> (loss, params)` once, run `warmup` steps, then time `timed` steps. Returns the
    figures every baseline reports: step seconds, peak HBM, XLA's temporaries and host temporaries, whether the
    compiled HLO places anything in host memory (`S(5)`), the last loss and the compiled text."""
    compiled = step.lower(params, x).compile()
    analysis = compiled.memory_analysis()
    text = compiled.as_text()
    for _ in range(warmup):
        loss, params = compiled(params, x)
        loss.block_until_ready()
    t = time.perf_counter()
    for _ in range(timed):
        loss, params = compiled(params, x)
    loss.block_until_ready()
    seconds = (time.perf_counter() - t) / timed
    stats = jax.devices()[0].memory_stats() or {}
    return dict(step_s=round(seconds, 4), peak_gib=round(stats.get("peak_bytes_in_use", 0) / 2**30, 2),
                temp_gib=round(analysis.temp_size_in_bytes / 2**30, 2),
                host_temp_gib=round(getattr(analysis, "host_temp_size_in_bytes", 0) / 2**30, 2),
                has_S5="S(5)" in text, loss=float(loss), hlo=text)


def report(fields: dict, run) -> None:
    """Print `fields` with what `run()` measured as one JSON line; an exception (out of memory, a refused
    compile) is reported in the line instead, so a sweep goes on."""
    try:
        got = run()
    except Exception as e:
        got = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    print(json.dumps({**fields, "flags": os.environ.get("XLA_FLAGS", ""), **got}))
