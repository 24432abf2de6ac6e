"""What XLA's memory analysis says of a step's offloaded host buffers, and what its optimized HLO holds: the main
job's step (`zoo.train_step.compile_abstract`) for the 8B preset cut to a few layers under an offloading recipe, for
each optimizer-state placement and number of micro-batches. Prints, per compile, XLA's host temporaries, the number
of pinned-host (`S(5)`) mentions in the optimized HLO and the device temporaries, and writes each HLO to OUT.

    python -m bench.host_temps_probe OUT [--layers 2 --batch 4 --seq 2048 --recipe qkv_offload
                                          --opt-state device,host --grad-accum 1,4 --param-dtype float32]
"""
from __future__ import annotations

import argparse
import os
import time

from recipes.llama3 import RECIPES
from zoo.models.registry import config, family
from zoo.train_step import compile_abstract


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="folder for the optimized HLO of each compile")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--recipe", default="qkv_offload", choices=sorted(RECIPES))
    ap.add_argument("--opt-state", default="device,host", help="comma-separated placements of the moments")
    ap.add_argument("--grad-accum", default="1,4", help="comma-separated numbers of micro-batches")
    ap.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    fam = family("llama3")
    cfg = config("llama3", "llama3_1_8b", num_layers=a.layers, param_dtype=a.param_dtype, dtype="bfloat16")
    for where in a.opt_state.split(","):
        for k in map(int, a.grad_accum.split(",")):
            t = time.time()
            compiled, _, _ = compile_abstract(fam, cfg, RECIPES[a.recipe], batch=a.batch, seq=a.seq, grad_accum=k,
                                              opt_state=where)
            ma, text = compiled.memory_analysis(), compiled.as_text()
            with open(os.path.join(a.out, f"{a.recipe}-{where}-K{k}.hlo.txt"), "w") as f:
                f.write(text)
            print(f"{a.recipe} opt_state={where} K={k}: host temporaries "
                  f"{getattr(ma, 'host_temp_size_in_bytes', 0) / 2**20:.1f} MiB, S(5) mentions {text.count('S(5)')}, "
                  f"device temporaries {ma.temp_size_in_bytes / 2**30:.2f} GiB, compiled in {time.time() - t:.0f} s",
                  flush=True)


if __name__ == "__main__":
    main()
