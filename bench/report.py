"""Render benchmark records (`bench.run`'s OUT/results.jsonl, or bench/results/*.jsonl) as Markdown.

    python -m bench.report FILE...                    # every table below
    python -m bench.report --table throughput FILE... # one of: twins, throughput, profiles

`twins`: step-time ratios against the same shape's save-on-device twin under the impl's base setting (`minimal` for
`minimal_offload`, `save_qkv` for `qkv_offload`; > 1 is faster), and peak HBM against `full`'s.
`throughput`: model TFLOP/s and MFU, and the step against full remat of the same implementation, backend and
batch. `profiles`: the traces' copy timelines, compiled-op counts and loss curves some records carry.
"""
from __future__ import annotations

import argparse
import json

from bench import records

TWIN = {"minimal_offload": "minimal", "qkv_offload": "save_qkv", "offload_minimal": "minimal",
        "offload_qkv": "save_qkv", "mla_moe_offload": "save_mla_moe", "lowrank_wa_offload": "save_mla_moe"}
BASE_SETTING = {"zoo": "zoo", "anchor": "lhs"}   # the twin is measured under the impl's default setting
MFU_PEAK_TFLOPS = 800   # the H200's measured bf16 matmul rate (docs/benchmarks/index.md)


def rows(path: str) -> list[dict]:
    """The records of a .jsonl file, each with its extras beside its fields (`bench.records.flat`)."""
    with open(path) as f:
        return [records.flat(json.loads(line)) for line in f if line.strip()]


def _shape(r: dict) -> str:
    return f"{r.get('bench', '?')} L{r.get('L')} B{r.get('B')}"


def _num(x, fmt: str = ".2f") -> str:
    return "" if x is None else format(x, fmt)


def _note(r: dict) -> str:
    return str(r.get("error") or r.get("skipped") or r.get("message") or "")[:90]


def twins(recs: list[dict]) -> str:
    base = {}
    for r in recs:
        if "step_s" in r and r.get("setting") == BASE_SETTING.get(r.get("impl")):
            base[(_shape(r), r.get("impl"), r.get("recipe"))] = r
    out = ["| bench | impl | setting | recipe | step (s) | vs twin | peak HBM (GiB) | vs full's peak | "
           "host (GiB) | planned host | planned step (s) | note |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in recs:
        key = (_shape(r), r.get("impl"))
        if r.get("bench") == "loss-curve":
            continue
        if r.get("step_s") is None:
            out.append(f"| {_shape(r)} | {r.get('impl')} | {r.get('setting')} | "
                       f"{r.get('recipe')} | | | | | | | | {_note(r)} |")
            continue
        t = base.get(key + (TWIN.get(r.get("recipe")),))
        f = base.get(key + ("full",))
        ratio = f"{t['step_s'] / r['step_s']:.3f}x" if t else ""
        peak = f"{r['peak_gib'] / f['peak_gib'] - 1:+.1%}" if f and f.get("peak_gib") and r.get("peak_gib") else ""
        out.append(f"| {_shape(r)} | {r.get('impl')} | {r.get('setting')} | {r.get('recipe')} | "
                   f"{r['step_s']:.3f} | {ratio} | {r.get('peak_gib')} | {peak} | {r.get('host_temp_gib')} | "
                   f"{r.get('planned_host_gib', '')} | {r.get('planned_step_s', '')} | {r.get('job', '')} |")
    return "\n".join(out)


def throughput(recs: list[dict]) -> str:
    def key(r):  # compare with full remat of the same implementation, dispatch backend and batch
        return r.get("impl", "plain JAX anchor"), r.get("backend"), r.get("B")

    base = {key(r): r["step_s"] for r in recs
            if r.get("recipe", r.get("policy")) == "full" and r.get("step_s") and not r.get("error")}
    out = [f"| implementation | recipe | batch | step (s) | model TFLOP/s | vs full remat | MFU ({MFU_PEAK_TFLOPS}) "
           "| peak HBM (GiB) | host (GiB) | S(5) in HLO |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in recs:
        impl = (r.get("impl") or "plain JAX anchor") + (f" ({r['backend']})" if r.get("backend") else "")
        recipe = r.get("recipe", r.get("policy"))
        if r.get("error") or r.get("step_s") is None or r.get("tflops") is None:
            out.append(f"| {impl} | {recipe} | {r.get('B')} | {_note(r)[:60]} | | | | | | |")
            continue
        speed = f"{base[key(r)] / r['step_s'] - 1:+.1%}" if key(r) in base else ""
        out.append(f"| {impl} | {recipe} | {r.get('B')} | {r['step_s']:.3f} | {r['tflops']:.1f} | {speed} | "
                   f"{r['tflops'] / MFU_PEAK_TFLOPS:.1%} | {_num(r.get('peak_gib'))} | "
                   f"{_num(r.get('host_temp_gib'))} | {r.get('has_S5')} |")
    return "\n".join(out)


def profiles(recs: list[dict]) -> str:
    out = []
    for r in recs:
        p = r.get("profile")
        if p:
            out.append(f"- {r.get('job')}: traced step {r.get('traced_step_s')} s; compute stream "
                       f"{p.get('compute_stream')} busy {p.get('compute_busy_ms_per_step')} ms, idle "
                       f"{p.get('compute_idle_ms_per_step')} ms per step")
            for d, c in (p.get("copies") or {}).items():
                out.append(f"  - {d}: {c.get('GiB_per_step')} GiB in {c.get('events_per_step')} copies, "
                           f"{c.get('busy_ms_per_step')} ms, {c.get('GB_per_s_while_copying')} GB/s, streams "
                           f"{c.get('streams')}, overlapped with compute {c.get('overlapped_with_compute')}")
            out.append(f"  - streams (busy ms): {p.get('streams')}")
        if r.get("hlo"):
            out.append(f"- {r.get('job')} HLO: {json.dumps(r['hlo'])}")
        if r.get("bench") == "loss-curve":
            out.append(f"- {r.get('job')}: " + json.dumps({k: r.get(k) for k in (
                "mechanism", "recipe", "max_rel_diff", "last_rel_diff", "same_within_bf16", "error")}))
    return "\n".join(out)


TABLES = {"twins": ("Step time against the save-on-device twin", twins),
          "throughput": ("Throughput against full remat", throughput),
          "profiles": ("Profiles, compiled ops, loss curves", profiles)}


def summary(recs: list[dict]) -> str:
    return "\n\n".join(f"## {title}\n\n{fn(recs)}" for title, fn in TABLES.values()) + "\n"


def write_summary(path: str, dest: str) -> None:
    recs = rows(path)
    with open(dest, "w") as f:
        f.write(f"# {path}\n\n" + summary(recs))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--table", choices=list(TABLES), default=None, help="one table only (default: all)")
    a = ap.parse_args(argv)
    recs = [r for p in a.files for r in rows(p)]
    print(TABLES[a.table][1](recs) if a.table else summary(recs))


if __name__ == "__main__":
    main()
