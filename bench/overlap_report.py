"""Issue 14's summary of `bench.run_overlap`'s records: `python -m bench.overlap_report OUT/results.jsonl`.

Ratios are step-time ratios against the same shape's save-on-device twin under JAX's mechanism and the
latency-hiding scheduler alone (`minimal` for `minimal_offload`, `save_qkv` for `qkv_offload`; > 1 is faster),
and peak HBM against `full`'s (the issue asks for >= 0.95x and within 5%)."""
from __future__ import annotations

import json
import sys


def rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _shape(r: dict) -> str:
    return f"{r.get('bench', '?')} L{r.get('L')} B{r.get('B')}"


BASE_SETTING = {"zoo": "zoo", "anchor": "lhs"}   # the twin is measured under the impl's default setting


def table(recs: list[dict]) -> str:
    twin = {"minimal_offload": "minimal", "qkv_offload": "save_qkv", "offload_minimal": "minimal",
            "offload_qkv": "save_qkv", "mla_moe_offload": "save_mla_moe", "lowrank_wa_offload": "save_mla_moe"}
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
        if "step_s" not in r:
            note = r.get("error") or r.get("skipped") or ""
            out.append(f"| {_shape(r)} | {r.get('impl')} | {r.get('setting')} | "
                       f"{r.get('recipe')} | | | | | | | | {str(note)[:90]} |")
            continue
        t = base.get(key + (twin.get(r.get("recipe")),))
        f = base.get(key + ("full",))
        ratio = f"{t['step_s'] / r['step_s']:.3f}x" if t else ""
        peak = f"{r['peak_gib'] / f['peak_gib'] - 1:+.1%}" if f and f.get("peak_gib") else ""
        out.append(f"| {_shape(r)} | {r.get('impl')} | {r.get('setting')} | {r.get('recipe')} | "
                   f"{r['step_s']:.3f} | {ratio} | {r.get('peak_gib')} | {peak} | {r.get('host_temp_gib')} | "
                   f"{r.get('planned_host_gib', '')} | {r.get('planned_step_s', '')} | {r.get('job', '')} |")
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


def write_summary(path: str, dest: str) -> None:
    recs = rows(path)
    with open(dest, "w") as f:
        f.write("# Offload overlap: one device call\n\n" + table(recs)
                + "\n\n## Profiles, compiled ops, loss curves\n\n"
                + profiles(recs) + "\n")


if __name__ == "__main__":
    recs = [r for p in sys.argv[1:] for r in rows(p)]
    print(table(recs) + "\n\n" + profiles(recs))
