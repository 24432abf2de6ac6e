"""Summarise a JAX profiler trace (`*.trace.json.gz`): where a step's time goes on each GPU stream.

    python -m bench.trace_summary TRACE_DIR_OR_FILE [--steps N]

For every device stream: busy time (the union of its events), events, and the largest kernels; for the copies
between device and host: their count, bytes (from the event arguments where the profiler records them), time,
the bandwidth reached while a copy runs, which stream they run on, and how much of their time overlaps a compute
kernel on another stream. The compute stream's idle time inside the traced window is what the step loses to
waiting (for copies, for the host, for launches).
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re

_BYTES = re.compile(r"(?:num_bytes|bytes|size)[\"']?\s*[:=]\s*(\d+)", re.IGNORECASE)


def load(path: str) -> dict:
    """A trace's events as JSON: the file at `path`, or the newest `*.trace.json.gz` under a folder `path` (what
    `jax.profiler` writes).

    Args:
        path: a `.trace.json.gz` file or a folder holding one.
    """
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "**", "*.trace.json.gz"), recursive=True), key=os.path.getmtime)
        if not files:
            raise SystemExit(f"no *.trace.json.gz under {path}")
        path = files[-1]
    with gzip.open(path) as f:
        return json.load(f)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def copy_direction(name: str, args: dict) -> str | None:
    """'D2H', 'H2D', 'D2D' for a copy event, None for a kernel."""
    text = (name + " " + json.dumps(args)).lower()
    if "memcpy" not in text and "copy" not in name.lower():
        return None
    for key, direction in (("dtoh", "D2H"), ("d2h", "D2H"), ("htod", "H2D"), ("h2d", "H2D"), ("dtod", "D2D"),
                           ("d2d", "D2D"), ("ptod", "H2D"), ("dtop", "D2H")):
        if key in text:
            return direction
    return None


def summarise(trace: dict, steps: int = 1, top: int = 4) -> dict:
    """Per device stream: busy and compute ms and the `top` kernels by total time; per copy direction: events,
    bytes, busy ms, bandwidth while copying and the share overlapped with compute; the traced window."""
    names: dict[int, str] = {}
    threads: dict[tuple[int, int], str] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            names[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    devices = {pid for pid, n in names.items() if "/device:" in n}
    per_stream: dict[tuple[int, int], list] = collections.defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("pid") in devices and "dur" in e:
            per_stream[(e["pid"], e["tid"])].append(e)
    out: dict = {"streams": [], "copies": {}}
    busy: dict[tuple[int, int], list] = {}
    copy_iv: dict[str, list] = collections.defaultdict(list)
    copy_stats: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    copy_streams: dict[str, set] = collections.defaultdict(set)
    compute_iv: dict[tuple[int, int], list] = {}
    window = [float("inf"), 0.0]
    for key, evs in per_stream.items():
        ivs = [(e["ts"], e["ts"] + e["dur"]) for e in evs]
        busy[key] = _union(ivs)
        window = [min(window[0], busy[key][0][0]), max(window[1], busy[key][-1][1])]
        by_name = collections.Counter()
        kernels = []
        for e in evs:
            d = copy_direction(e["name"], e.get("args", {}))
            if d:
                copy_iv[d].append((e["ts"], e["ts"] + e["dur"]))
                copy_stats[d]["events"] += 1
                copy_stats[d]["us"] += e["dur"]
                m = _BYTES.search(json.dumps(e.get("args", {})))
                if m:
                    copy_stats[d]["bytes"] += int(m.group(1))
                copy_streams[d].add(threads.get(key, str(key[1])))
            else:
                kernels.append((e["ts"], e["ts"] + e["dur"]))
                by_name[e["name"][:60]] += e["dur"]
        compute_iv[key] = _union(kernels)
        out["streams"].append({"device": names[key[0]], "stream": threads.get(key, str(key[1])), "events": len(evs),
                               "busy_ms": round(_length(busy[key]) / 1e3, 2),
                               "compute_ms": round(_length(compute_iv[key]) / 1e3, 2),
                               "top": [(n, round(t / 1e3, 2)) for n, t in by_name.most_common(top)]})
    span = window[1] - window[0] if window[1] > window[0] else 0.0
    out["window_ms"] = round(span / 1e3, 2)
    out["window_ms_per_step"] = round(span / 1e3 / steps, 2)
    if compute_iv:
        main = max(compute_iv, key=lambda k: _length(compute_iv[k]))
        out["compute_stream"] = threads.get(main, str(main[1]))
        out["compute_busy_ms_per_step"] = round(_length(compute_iv[main]) / 1e3 / steps, 2)
        out["compute_idle_ms_per_step"] = round((span - _length(compute_iv[main])) / 1e3 / steps, 2)
        all_compute = _union([iv for ivs in compute_iv.values() for iv in ivs])
        for d, ivs in copy_iv.items():
            u = _union(ivs)
            st = copy_stats[d]
            ms = _length(u) / 1e3
            out["copies"][d] = {
                "events_per_step": st["events"] / steps, "GiB_per_step": round(st["bytes"] / 2**30 / steps, 3),
                "busy_ms_per_step": round(ms / steps, 2),
                "GB_per_s_while_copying": round(st["bytes"] / 1e9 / (ms / 1e3), 1) if ms and st["bytes"] else None,
                "overlapped_with_compute": round(_overlap(u, all_compute) / _length(u), 3) if u else None,
                "streams": sorted(copy_streams[d])}
    return out


def _device_events(trace: dict):
    """(events per device stream, the stream names, the main compute stream's key)."""
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    devices = {pid for pid, n in names.items() if "/device:" in n}
    per_stream: dict[tuple[int, int], list] = collections.defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("pid") in devices and "dur" in e:
            per_stream[(e["pid"], e["tid"])].append(e)
    kernels = {k: [e for e in evs if not copy_direction(e["name"], e.get("args", {}))] for k, evs in per_stream.items()}
    main = max(kernels, key=lambda k: sum(e["dur"] for e in kernels[k]), default=None)
    return per_stream, threads, main


def gaps(trace: dict, steps: int = 1, bins: int = 24, top: int = 12) -> dict:
    """Where the copies stay exposed: the traced window cut into `bins` equal slices (per slice: compute busy ms
    and, per direction, copy ms and copy ms with no compute running), and the `top` longest idle gaps of the
    compute stream with the copies in flight during each and the kernels on either side."""
    per_stream, threads, main = _device_events(trace)
    if main is None:
        return {}   # no device streams in the trace (the CPU)
    comp = sorted((e for e in per_stream[main] if not copy_direction(e["name"], e.get("args", {}))),
                  key=lambda e: e["ts"])
    all_kernels = _union([(e["ts"], e["ts"] + e["dur"]) for evs in per_stream.values() for e in evs
                          if not copy_direction(e["name"], e.get("args", {}))])
    copies = collections.defaultdict(list)
    for evs in per_stream.values():
        for e in evs:
            d = copy_direction(e["name"], e.get("args", {}))
            if d:
                copies[d].append((e["ts"], e["ts"] + e["dur"]))
    t0 = min(iv[0] for iv in all_kernels)
    t1 = max(iv[1] for iv in all_kernels)
    width = (t1 - t0) / bins
    out_bins = []
    for i in range(bins):
        lo, hi = t0 + i * width, t0 + (i + 1) * width

        def clip(ivs, lo=lo, hi=hi):
            return [(max(a, lo), min(b, hi)) for a, b in ivs if b > lo and a < hi]
        row = {"t_ms": round((lo - t0) / 1e3, 1), "compute_ms": round(_length(clip(all_kernels)) / 1e3, 1)}
        for d, ivs in copies.items():
            u = clip(_union(ivs))
            row[d + "_ms"] = round(_length(u) / 1e3, 1)
            row[d + "_exposed_ms"] = round((_length(u) - _overlap(u, clip(all_kernels))) / 1e3, 1)
        out_bins.append(row)
    idle = [(comp[i]["ts"] + comp[i]["dur"], comp[i + 1]["ts"], i) for i in range(len(comp) - 1)
            if comp[i + 1]["ts"] > comp[i]["ts"] + comp[i]["dur"]]
    idle.sort(key=lambda g: g[0] - g[1])
    out_gaps = []
    for a, b, i in idle[:top]:
        inflight = {d: round(_overlap([(a, b)], _union(ivs)) / 1e3, 2) for d, ivs in copies.items()}
        out_gaps.append({"at_ms": round((a - t0) / 1e3, 1), "idle_ms": round((b - a) / 1e3, 2),
                         "copies_in_flight_ms": inflight, "before": comp[i]["name"][:50],
                         "after": comp[i + 1]["name"][:50]})
    return {"window_ms": round((t1 - t0) / 1e3, 1), "steps": steps, "bins": out_bins, "gaps": out_gaps,
            "compute_stream": threads.get(main, str(main[1]))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="a *.trace.json.gz file, or a profiler log directory (its newest trace)")
    ap.add_argument("--steps", type=int, default=1, help="steps inside the traced window (figures per step)")
    ap.add_argument("--gaps", action="store_true", help="where the copies stay exposed (see `gaps`)")
    a = ap.parse_args()
    trace = load(a.path)
    print(json.dumps(gaps(trace, a.steps) if a.gaps else summarise(trace, a.steps), indent=1))


if __name__ == "__main__":
    main()
