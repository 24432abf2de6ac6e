"""The benchmark pages' plots, drawn from the committed records (bench/results/) into docs/benchmarks/img/.

    python -m bench.plots            # writes offload_cost.png, capacity.png, planner.png, scaling.png
    python -m bench.plots --out DIR  # elsewhere

Each plot reads records through `bench.records` (every figure is a record's) and says in its title which file it
comes from; a record without a step time (an error, a skipped job) is left out.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics

from bench import records

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
OUT = ROOT / "docs" / "benchmarks" / "img"


def _load(name: str) -> list[dict]:
    return [r for r in records.load_flat(RESULTS / name) if r.get("step_s") and not r.get("error")]


def offload_cost(plt, out: pathlib.Path) -> None:
    """Step time of each recipe relative to full remat (the median over the calls), zoo's own setting."""
    recs = [r for r in _load("offload-pays_2026-12-01.jsonl") if r["impl"] == "zoo" and r.get("setting") == "zoo"]
    panels = (("llama405b-slice", 3, "Llama 405B-shaped slice, 3 layers, batch 2, seq 8192"),
              ("deepseek-slice", 4, "DeepSeek-V3 slice, 1 dense + 3 MoE layers, batch 4, seq 4096"))
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, (bench, layers, title) in zip(axes, panels):
        mine = [r for r in recs if r["bench"] == bench and r["L"] == layers]
        by = {}
        for r in mine:
            by.setdefault(r["recipe"], []).append(r["step_s"])
        full = statistics.median(by.pop("full"))
        names = sorted(by, key=lambda n: statistics.median(by[n]))
        speed = [full / statistics.median(by[n]) for n in names]
        ax.barh(names, speed, color=["tab:green" if s >= 1 else "tab:red" for s in speed])
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xlabel("speed relative to full remat (higher is faster)")
        ax.set_title(title, fontsize=9)
        for y, s in enumerate(speed):
            ax.text(s, y, f" {s:.3f}x", va="center", fontsize=8)
        ax.set_xlim(0.6, max(speed) * 1.15)
    fig.suptitle("What offload costs: one H200 (bench/results/offload-pays_2026-12-01.jsonl)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "offload_cost.png", dpi=110)


def capacity(plt, out: pathlib.Path) -> None:
    """The largest batch each recipe ran (the next power of two ran out of memory), and the planner's answer."""
    recs = records.load_flat(RESULTS / "capacity-sweep_2026-11-30.jsonl")
    best, planned = {}, {}
    for r in recs:
        planned[r["recipe"]] = r.get("planned_largest")
        if r.get("fits"):
            best[r["recipe"]] = max(best.get(r["recipe"], 0), r["B"])
    names = sorted(best, key=best.get)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.barh(names, [best[n] for n in names], color="tab:blue", label="ran (the next batch ran out of memory)")
    ax.scatter([planned[n] for n in names], names, color="k", marker="x", zorder=3, label="planner's largest batch")
    ax.set_xlabel("largest batch that fits (seq 4096)")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("DeepSeek-V3 slice on one H200 (bench/results/capacity-sweep_2026-11-30.jsonl)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "capacity.png", dpi=110)


def planner(plt, out: pathlib.Path) -> None:
    """Planned against measured, every zoo record with both figures: the peak HBM (the planner's compiled peak
    where the record's device planned it, else its estimate) and the host bytes."""
    recs = [r for path in sorted(RESULTS.glob("*.jsonl")) for r in _load(path.name) if r["impl"] == "zoo"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (measured, planned, label) in zip((a, b), (("peak_gib", "planned_peak_gib", "peak HBM (GiB)"),
                                                       ("host_temp_gib", "planned_host_gib", "host memory (GiB)"))):
        pairs = [(r[measured], r[planned]) for r in recs if r.get(measured) is not None and r.get(planned) is not None]
        compiled = [str(r.get("planned_peak_source", "")).startswith("compiled") for r in recs
                    if r.get(measured) is not None and r.get(planned) is not None]
        ax.scatter(*zip(*pairs), s=14, c=["tab:blue" if c else "tab:orange" for c in compiled])
        top = max(max(p) for p in pairs) * 1.05
        ax.plot([0, top], [0, top], "k", lw=0.8)
        ax.set_xlabel(f"measured {label}")
        ax.set_ylabel(f"planned {label}")
        ax.set_title(f"{label}: {len(pairs)} records (blue: peak compiled by the planner)", fontsize=9)
    fig.suptitle("How the planner predicts: every zoo record of bench/results/ with both figures", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "planner.png", dpi=110)


def scaling(plt, out: pathlib.Path) -> None:
    """Model TFLOP/s per GPU of the 405B-shaped slice: one GPU, and FSDP over two."""
    one = [r for r in _load("llama405b-slice_2026-11-29.jsonl") if r["B"] == 2 and r["L"] == 3]
    two = [r for r in _load("fsdp-2xh200_2026-11-29.jsonl") if r["bench"] == "llama405b-slice" and r.get("tflops")]
    recipe = {"offload_qkv": "qkv_offload"}   # the baseline's policy names the same tensors
    rows = {}
    for gpus, recs in ((1, one), (2, two)):
        for r in recs:
            rows.setdefault((r["impl"], recipe.get(r["recipe"], r["recipe"])), {})[gpus] = r["tflops"]
    keys = sorted(k for k, v in rows.items() if 1 in v and 2 in v)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    width = 0.38
    for i, gpus in enumerate((1, 2)):
        ax.bar([j + (i - 0.5) * width for j in range(len(keys))], [rows[k][gpus] for k in keys], width,
               label=f"{gpus} GPU" + ("s (fsdp=2)" if gpus == 2 else ""))
    ax.set_xticks(range(len(keys)), [f"{'plain JAX' if k[0] == 'anchor' else 'zoo'}\n{k[1]}" for k in keys],
                  fontsize=8)
    ax.set_ylabel("model TFLOP/s per GPU")
    ax.set_ylim(0, 650)
    ax.legend(fontsize=8, loc="upper left", ncols=2)
    ax.set_title("Llama 405B-shaped slice, 3 layers, batch 2 per GPU (llama405b-slice, fsdp-2xh200)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=OUT, help="the folder the PNGs go to (default %(default)s)")
    out = ap.parse_args(argv).out
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    for draw in (offload_cost, capacity, planner, scaling):
        draw(plt, out)
        plt.close("all")
        print(f"wrote {out / draw.__name__}.png")


if __name__ == "__main__":
    main()
