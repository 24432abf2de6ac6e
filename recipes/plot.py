"""`python -m recipes.plan ... --plot FILE.png`: what each recipe of a family keeps where, at a glance.

For each recipe, two stacked bars per device: HBM (the model state, then each tag's saved bytes over all layers,
then the residuals JAX saves beyond the tags) and pinned host memory (each offloaded tag's bytes), with the HBM
budget and the pinned pool as lines. The bytes are the planner's (`zoo.plan`, before XLA's temporaries).
Needs matplotlib (`pip install -e ".[watch]"`).
"""
from __future__ import annotations

import zoo
from zoo.plan.types import GiB


def tag_bytes(p: zoo.plan.Plan) -> tuple[dict[str, int], dict[str, int]]:
    """({part: HBM bytes}, {tag: host bytes}) per device over all stacks and layers of the plan `p`."""
    hbm = {"model state": p.state.total}
    host: dict[str, int] = {}
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


def recipes_chart(plans: dict[str, zoo.plan.Plan], path: str, *, title: str) -> None:
    """Write the chart of `plans` ({recipe name: plan}) to `path` (any format matplotlib writes)."""
    try:
        import matplotlib
        matplotlib.use("Agg")   # a file, never a window
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install -e \".[watch]\"") from None
    parts = {name: tag_bytes(p) for name, p in plans.items()}
    tags = list(dict.fromkeys(k for hbm, host in parts.values() for k in [*hbm, *host]))
    colors = dict(zip(tags, plt.get_cmap("tab20").colors * 3))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(plans)), 5.5))
    width = 0.38
    for i, (hbm, host) in enumerate(parts.values()):
        for x, where in ((i - width / 2, hbm), (i + width / 2, host)):
            bottom = 0.0
            for tag in tags:
                if where.get(tag):
                    ax.bar(x, where[tag] / GiB, width, bottom=bottom, color=colors[tag], edgecolor="white",
                           linewidth=0.5)
                    bottom += where[tag] / GiB
    tallest = max(sum(d.values()) for pair in parts.values() for d in pair) / GiB
    any_plan = next(iter(plans.values()))
    for value, label, style in ((any_plan.hbm_budget, "HBM budget", dict(color="crimson", linestyle="--")),
                                (any_plan.host_pool, "pinned host pool", dict(color="gray", linestyle=":"))):
        if not value:
            continue
        if value / GiB <= 3 * tallest:   # a line far above every bar would flatten them: named instead
            ax.axhline(value / GiB, label=f"{label} {value / GiB:.1f} GiB", **style)
        else:
            title += f"; {label} {value / GiB:.1f} GiB (off the chart)"
    ax.set_xticks(range(len(plans)), [f"{n}\nHBM | host" for n in plans], fontsize=8)
    ax.set_ylabel("GiB per device (before XLA's temporaries)")
    ax.set_title(title, fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[t]) for t in tags]
    lines, names = ax.get_legend_handles_labels()
    ax.legend(handles + lines, tags + names, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
