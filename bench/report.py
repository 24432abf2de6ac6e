"""Render benchmark JSON lines as a Markdown table: `python -m bench.report bench/results/FILE.jsonl`."""
from __future__ import annotations

import json
import sys


def rows(path: str):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def table(records: list[dict]) -> str:
    def key(r):  # compare with full remat of the same implementation, dispatch backend and batch
        return r.get("impl", "plain JAX anchor"), r.get("backend"), r.get("B")

    base = {key(r): r["step_s"] for r in records
            if r.get("recipe", r.get("policy")) == "full" and "error" not in r}
    out = ["| implementation | recipe | batch | step (s) | model TFLOP/s | vs full remat | MFU (800) | peak HBM (GiB) "
           "| host (GiB) | S(5) in HLO |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        impl = r.get("impl", "plain JAX anchor") + (f" ({r['backend']})" if r.get("backend") else "")
        recipe = r.get("recipe", r.get("policy"))
        if "error" in r:
            out.append(f"| {impl} | {recipe} | {r.get('B')} | {r['error'][:60]} | | | | | | |")
            continue
        speed = f"{base[key(r)] / r['step_s'] - 1:+.1%}" if key(r) in base else ""
        out.append(f"| {impl} | {recipe} | {r['B']} | {r['step_s']:.3f} | {r['tflops']:.1f} | {speed} | "
                   f"{r['tflops'] / 800:.1%} | {r['peak_gib']:.2f} | {r['host_temp_gib']:.2f} | {r['has_S5']} |")
    return "\n".join(out)


if __name__ == "__main__":
    print(table([r for p in sys.argv[1:] for r in rows(p)]))
