"""The automatic recipe: each tag's placement, the sequence tiles and the layers per group chosen for an HBM budget, a
host budget, a host link and a FLOP rate. `choose_structure` (what `zoo.plan.plan(cfg, "auto", ...)` runs) tries the
candidate structures (`structures`) through the placer (`zoo.plan.placer`, on the figures of `zoo.plan.costs`) and
says why each tag landed where it did: the wording of the placer's decisions is here, and only here (`notes`)
(docs/internals.md, "The automatic recipe").
"""
from __future__ import annotations

from zoo.plan.costs import Transfer
from zoo.plan.placer import Choice, Decision, choose
from zoo.plan.types import ModelState, fmt_bytes, fmt_flops
from zoo.recipe import TOGETHER

# Sequence tiles: the most of these that leaves each tile this many positions or more (smaller tiles run small
# matmuls, and more of them save no more: a tile's tensors are already small beside a layer's).
MIN_TILE = 8192
TILES = (4, 8, 16, 32)
GROUPS = (1, 2, 4, 8)


def subgroup_of(group: int) -> int:
    """The layers per subgroup that leave a group's backward the fewest layer inputs at once (group / s + s - 1, the
    larger s on a tie).

    Args:
        group: layers per group.

    Returns:
        the layers per subgroup; 1 (none) where subgroups save no input over the group's own.
    """
    best = min((s for s in range(2, group) if group % s == 0), key=lambda s: (group // s + s - 1, -s), default=1)
    return best if group // best + best - 1 < group else 1


def structures(model, seq: int) -> list[tuple[int, int, tuple[str, ...], int]]:
    """The (sequence tiles, layers per group, tags a group's layers keep while its backward runs, layers per subgroup)
    `choose_structure` tries for `model` at `seq`, simplest first: one tile, and the most of `TILES` that divides the
    sequence into tiles of at least `MIN_TILE` positions; each of `GROUPS` that divides every main stack's layers, its
    layers keeping the attention kernel's residuals (one attention forward fewer) or nothing (nothing when the model
    makes them one query tile at a time, `attention_tiles`); then each of those groups in subgroups (`subgroup_of`:
    three-level checkpoints, one more forward pass of the group for fewer layer inputs held), which
    `choose_structure` tries only where no structure before them fits."""
    tiles = [1] + [t for t in TILES if seq % t == 0 and seq // t >= MIN_TILE][-1:]
    layers = [model.stacks()[n].num_layers for n in model.stack_names]
    groups = [g for g in GROUPS if all(n % g == 0 and n // g >= 1 for n in layers)]
    keeps = [()] if model.config.attention_tiles > 1 else [tuple(t for g in TOGETHER for t in g), ()]
    two = [(t, g, k, 1) for g in groups for k in (keeps if g > 1 else [()]) for t in tiles]
    return two + [(t, g, k, subgroup_of(g)) for t, g, k, _ in two if subgroup_of(g) > 1]


def choose_structure(layout_of, *, candidates, state: ModelState, shard: int, hbm_budget: int,
                     host_budget: int | None, link: float, rate: float, overlap, reserve
                     ) -> tuple[Choice, dict[str, str]]:
    """What the placer chooses (`zoo.plan.placer.choose`: the structure (tiles, group) of `candidates` that costs
    least, recompute and exposed copies in seconds per step, among those whose placement fits the budgets; the first
    candidate's (one tile, no groups) where none fits), as its `Choice` (`.recipe`), and why each tag landed where it
    did (`notes`). Structures in subgroups are tried only where none of two levels fits: their one more forward pass
    of each group is priced, how XLA keeps their layer inputs on a GPU is not yet measured.

    Args:
        layout_of: `layout_of(tiles, group, keep, subgroup)`: the planner's `Layout` of a structure.
        candidates: the structures to try, (tiles, group, keep, subgroup) each, simplest first (`structures`).
        state: the model state (in HBM whatever the placement).
        shard: devices the batch and the tags are split over.
        hbm_budget: the HBM budget per device, bytes.
        host_budget: the host memory offloaded tags may take per device, bytes (None: unbounded).
        link: the host link, bytes per second per direction.
        rate: the FLOP rate recompute is priced at, FLOP/s.
        overlap: the fraction of copy time hidden under compute (a number, a (d2h, h2d) pair or an `Overlap`).
        reserve: `reserve(layout, recipe)`: HBM the step needs beside the plan's saved bytes (the loss's logits, one
            group's backward).

    Returns:
        (the placer's `Choice`, {tag: why it landed where it did}).
    """
    def best_of(structures):
        return choose(layout_of, candidates=structures, state=state, shard=shard, hbm_budget=hbm_budget,
                      host_budget=host_budget, link=link, rate=rate, overlap=overlap, reserve=reserve)
    best = best_of([c for c in candidates if c[3] == 1])
    three = [c for c in candidates if c[3] > 1]
    if not best.fits and three:
        deeper = best_of(three)
        best = deeper if deeper.fits else best
    return best, notes(best)


def notes(choice: Choice) -> dict[str, str]:
    """Why each tag of a choice landed where it did, in words.

    Args:
        choice: what the placer chose (`zoo.plan.placer.Choice`).

    Returns:
        {tag: its note}, in the order the tags were first placed (a later decision on a tag replaces its note).
    """
    out: dict[str, str] = {}
    for d in choice.decisions:
        for t in d.tags:
            out[t] = _note(d, t)
    return out


def _note(d: Decision, tag: str) -> str:
    """The words for decision `d`, as `tag`'s note."""
    if d.why == "useless":
        return "recomputed: keeping it alone saves no recompute, given the tags already kept"
    if d.why.startswith("carry"):
        return _carry_note(d)
    if d.why == "kept":
        tile = " (tile by tile)" if d.tiled else ""
        note = f"kept in HBM{tile}: {fmt_bytes(d.size)} fits ({fmt_bytes(d.left)} left); " + _gain(d.size, d.value)
    elif d.why == "tiled":
        note = f"recomputed tile by tile: {fmt_bytes(d.size)} does not fit in HBM and a tiled tag is not offloaded"
    elif d.why == "offloaded":
        note = (f"offloaded: {fmt_bytes(d.size)} does not fit in HBM ({fmt_bytes(max(d.left, 0))} left); "
                f"{_transfer_words(d.transfer)}; {_gain(d.size, d.value)}")
    else:
        reason = (f"the host budget is full ({fmt_bytes(d.host_used)} used)" if d.host_full
                  else _transfer_words(d.transfer))
        note = (f"recomputed: {fmt_bytes(d.size)} does not fit in HBM ({fmt_bytes(max(d.left, 0))} left) "
                f"and {reason}")
    others = ", ".join(o for o in d.tags if o != tag)
    if d.how == "together":
        return f"with {others} (they pay together): {note}"
    if d.how == "pair":
        return f"together with {others} (alone it saves nothing): {note}"
    return note


def _carry_note(d: Decision) -> str:
    """The words for where the scan carry went."""
    if d.why == "carry first":
        return (f"scan carry offloaded: leaves HBM to tags that save recompute; its transfers add "
                f"{1e3 * d.transfer.added:.1f} ms per step")
    if d.why == "carry kept":
        return f"scan carry kept in HBM: fits ({fmt_bytes(d.left)} left of the budget)"
    if d.why == "carry offloaded":
        return f"scan carry offloaded: does not fit in HBM; its transfers add {1e3 * d.transfer.added:.1f} ms per step"
    return "scan carry kept in HBM although over budget: it cannot be recomputed and " + (
        "the host budget is full" if d.host_full else _transfer_words(d.transfer))


def _gain(size: int, value: float) -> str:
    return f"saves {fmt_flops(value)} of recompute per step ({value / size:.0f} FLOP/byte)"


def _transfer_words(t: Transfer) -> str:
    """Why offloading pays or not: its transfer hides, or what it adds beside the recompute it saves."""
    if t.worst is None:
        return "nothing to move"
    extra, saved, link, overlap = t.added, t.saved, t.link, t.overlap
    per_layer = (f"{1e3 * t.per_layer:.2f} ms per layer {'<=' if t.per_layer <= t.forward else '>'} forward "
                 f"{1e3 * t.forward:.2f} ms at {link / 1e9:g} GB/s")
    if min(overlap.d2h, overlap.h2d) >= 1:
        if extra <= 0:
            return f"its transfer hides: {per_layer}"
        if extra < saved:
            return (f"its transfer hides only in part in {t.worst}: {per_layer}, adding {1e3 * extra:.1f} ms "
                    f"per step < {1e3 * saved:.1f} ms of recompute")
        return f"its transfer would not hide in {t.worst}: {per_layer}"
    how = f"overlap {overlap}: " + ("copies serialised with compute" if max(overlap.d2h, overlap.h2d) == 0
                                   else "partly hidden")
    if extra < saved:
        return (f"its transfers add {1e3 * extra:.1f} ms per step ({how}, {link / 1e9:g} GB/s) < "
                f"{1e3 * saved:.1f} ms of recompute saved")
    return (f"its transfers would add {1e3 * extra:.1f} ms per step ({how}, {link / 1e9:g} GB/s) >= "
            f"{1e3 * saved:.1f} ms of recompute it saves")
