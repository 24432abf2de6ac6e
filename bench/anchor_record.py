"""Turn a plain-JAX anchor's JSON line (../shared/anchor/*.py print their own keys) into a record in the DESIGN
section 8 schema, appended to $BENCH_OUT by `bench.common.emit`.

    python -m bench.anchor_record deepseek-slice anchor.json --S 4096

The anchor's `policy` becomes `recipe`; its MoE dispatch is sort + jax.lax.ragged_dot (`backend` "ragged_dot").
Its planned figures are None: the planner plans zoo models only.
"""
from __future__ import annotations

import argparse
import json
import os


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bench")
    ap.add_argument("path")
    ap.add_argument("--S", type=int, required=True)
    ap.add_argument("--backend", default="ragged_dot")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--mesh", default=None, help="the anchor's mesh (e.g. fsdp=2 for plain_jax_llama_fsdp.py)")
    a = ap.parse_args()
    if a.smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from bench.common import emit

    text = open(a.path).read().strip().splitlines() if os.path.exists(a.path) else []
    try:
        got = json.loads(text[-1])
    except (IndexError, json.JSONDecodeError):
        got = {"error": f"the anchor printed no JSON line ({a.path})"}
    record = dict(bench=a.bench, impl="anchor", recipe=got.pop("policy", None),
                  backend=None if a.backend == "none" else a.backend,
                  B=got.pop("B", None), S=64 if a.smoke else a.S, L=got.pop("L", None),
                  planned_peak_gib=None, planned_host_gib=None, dropped=0)
    got.pop("flags", None)  # emit writes the flags of this process, which are the anchor's too
    if "tflops_per_device" in got:   # plain_jax_llama_fsdp.py: per device, batch per device
        got["tflops"] = got.pop("tflops_per_device")
        record["B"] = got.get("batch_per_device", 0) * got.get("gpus", 1)
    if a.mesh:
        record["mesh"] = a.mesh
    emit({**record, **got})


if __name__ == "__main__":
    main()
