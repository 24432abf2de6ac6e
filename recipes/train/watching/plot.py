"""`python -m recipes.train.plan ... --plot FILE.png`: what each recipe of a family keeps where, at a glance.

For each recipe, two stacked bars per device: HBM (the model state, then each tag's saved bytes over all layers,
then the residuals JAX saves beyond the tags) and pinned host memory (the model state kept there: `--opt-state
host`'s moments, `--params host`'s master; then each offloaded tag's bytes), with the HBM budget and the pinned pool
as lines. The bytes are the planner's (`zoo.plan`, before XLA's temporaries), of plans made as the printed one.

The y-axis is linear and sized for the ordinary bars and the HBM budget: a bar more than `OUTLIER` times the
median HBM bar (`none`'s, which saves every residual) would squash every other recipe into the bottom of the
chart, so it is cut at the top of the axis, drawn with a break (a zigzag) and its total written on it.
Needs matplotlib (`pip install -e ".[watch]"`).
"""
from __future__ import annotations

import os
import tempfile

import zoo
from zoo.plan.types import GiB

OUTLIER = 2.5   # a bar taller than this many times the median bar is cut (see the module docstring)


def check_output(path: str, stem: str) -> str:
    """The file `--plot PATH` writes, checked before anything is planned: PATH itself, or `PATH/<stem>.png` when
    PATH is a directory (or ends in a slash). ValueError in one line when matplotlib is missing, the parent folder
    does not exist or cannot be written, or the suffix is not a format matplotlib writes."""
    try:
        import matplotlib
        matplotlib.use("Agg")   # a file, never a window
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install -e \".[watch]\"") from None
    if os.path.isdir(path) or path.endswith(os.sep):
        path = os.path.join(path, f"{stem}.png".replace(" ", "_").replace(os.sep, "_"))
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise ValueError(f"--plot {path}: {parent} " + ("is not a folder" if os.path.exists(parent) else
                                                        "does not exist (create it, or choose another path)"))
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise ValueError(f"--plot {path}: matplotlib does not write .{suffix} files; use one of "
                         f"{', '.join('.' + f for f in sorted(formats))} (or no suffix: PNG)")
    if os.path.isdir(path):
        raise ValueError(f"--plot {path} is a folder")
    try:   # a real write, not os.access (which says yes to root on a read-only file system)
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".plot-check-"):
            pass
        if os.path.exists(path):
            with open(path, "ab"):
                pass
    except OSError as e:
        raise ValueError(f"--plot {path} cannot be written: {e.strerror or e}") from None
    return path


def tag_bytes(p: zoo.plan.Plan) -> tuple[dict[str, int], dict[str, int]]:
    """({part: HBM bytes}, {part: host bytes}) per device over all stacks and layers of the plan `p`."""
    hbm = {"model state": p.state.total}
    host: dict[str, int] = {"model state": p.state.host} if p.state.host else {}
    for stack in p.stacks:
        for t in stack.tags:
            if t.device_bytes:
                hbm[t.tag] = hbm.get(t.tag, 0) + stack.num_layers * t.device_bytes
            if t.host_bytes:
                host[t.tag] = host.get(t.tag, 0) + stack.num_layers * t.host_bytes
        other = stack.num_layers * stack.untagged_bytes + stack.invariant_bytes
        if other:
            hbm["untagged residuals"] = hbm.get("untagged residuals", 0) + other
    return hbm, host


def axis_top(hbm: list[float], others: list[float], budget: float | None) -> tuple[float, bool]:
    """(the y-axis' top in GiB, whether some bar is cut there) for HBM bars `hbm` and host bars `others`: room for
    every bar up to `OUTLIER` times the median HBM bar (every recipe's holds the model state: they compare) and for
    the HBM `budget` when it is near them."""
    ranked = sorted(hbm) or [1.0]
    median = ranked[len(ranked) // 2] or 1.0
    bars = [t for t in [*hbm, *others] if t > 0] or [1.0]
    ordinary = max([t for t in bars if t <= OUTLIER * median] or [median])
    top = 1.1 * max(ordinary, budget if budget and budget <= 3 * ordinary else 0.0)
    return top, max(bars) > top


def recipes_chart(plans: dict[str, zoo.plan.Plan], path: str, *, title: str) -> str:
    """Write the chart of `plans` ({recipe name: plan}) to `path` (its suffix's format; none: PNG). Returns a note
    for the user (the bars cut at the axis' top), or ""."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    parts = {name: tag_bytes(p) for name, p in plans.items()}
    tags = list(dict.fromkeys(k for hbm, host in parts.values() for k in [*hbm, *host]))
    colors = dict(zip(tags, plt.get_cmap("tab20").colors * 3))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(plans)), 5.5))
    width = 0.38
    any_plan = next(iter(plans.values()))
    budget = any_plan.hbm_budget / GiB if any_plan.hbm_budget else None
    top, cut = axis_top([sum(hbm.values()) / GiB for hbm, _ in parts.values()],
                        [sum(host.values()) / GiB for _, host in parts.values()], budget)
    clipped = []
    for i, (name, (hbm, host)) in enumerate(parts.items()):
        for x, where, side in ((i - width / 2, hbm, "HBM"), (i + width / 2, host, "host")):
            bottom = 0.0
            for tag in tags:
                if where.get(tag) and bottom < top:
                    height = min(where[tag] / GiB, top - bottom)
                    ax.bar(x, height, width, bottom=bottom, color=colors[tag], edgecolor="white", linewidth=0.5)
                bottom += where.get(tag, 0) / GiB
            if bottom > top:   # cut: a zigzag across the bar near the top, and its total written on it
                y = 0.93 * top
                zig = [x - width / 2 + k * width / 6 for k in range(7)]
                ax.fill_between(zig, [y + (0.012 if k % 2 else -0.012) * top for k in range(7)],
                                [y + (0.035 if k % 2 else 0.011) * top for k in range(7)], color="white", zorder=3)
                ax.text(x, 0.97 * top, f"{bottom:.0f} GiB", ha="center", va="top", fontsize=7, rotation=90,
                        color="black", zorder=4, bbox=dict(facecolor="white", edgecolor="none", pad=1, alpha=0.8))
                clipped.append(f"{name} ({side} {bottom:.1f} GiB)")
    for value, label, style in ((any_plan.hbm_budget, "HBM budget", dict(color="crimson", linestyle="--")),
                                (any_plan.host_pool, "pinned host pool", dict(color="gray", linestyle=":"))):
        if not value:
            continue
        if value / GiB <= top:
            ax.axhline(value / GiB, label=f"{label} {value / GiB:.1f} GiB", **style)
        else:   # a line far above every ordinary bar would flatten them: named instead
            title += f"; {label} {value / GiB:.1f} GiB (above the chart)"
    ax.set_ylim(0, top)
    ax.set_xticks(range(len(plans)), [f"{n}\nHBM | host" for n in plans], fontsize=8)
    ax.set_ylabel("GiB per device (before XLA's temporaries)")
    if cut:
        title += f"\nbars over {top:.0f} GiB are cut (zigzag), their totals written on them"
    ax.set_title(title, fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[t]) for t in tags]
    lines, names = ax.get_legend_handles_labels()
    ax.legend(handles + lines, tags + names, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120, format=os.path.splitext(path)[1].lstrip(".").lower() or "png")
    except OSError as e:
        raise ValueError(f"--plot {path} cannot be written: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return f"cut at {top:.0f} GiB: {', '.join(clipped)}" if clipped else ""
