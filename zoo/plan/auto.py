"""The automatic recipe: each tag's placement chosen for an HBM budget, a host link and a FLOP rate.

`choose` is what `zoo.plan(cfg, "auto", ...)` runs; it says why each tag landed where it did.
"""
from __future__ import annotations

import heapq
import itertools

from zoo.plan.links import Overlap
from zoo.plan.measure import LayerCost
from zoo.plan.measure import nbytes as sds_nbytes
from zoo.plan.types import CARRY, ModelState, ceil_div, fmt_bytes, fmt_flops
from zoo.recipe import Recipe


def choose(shapes, needed, costs: dict[str, LayerCost], state: ModelState, shard: int, hbm_budget: int,
           host_budget: int | None, link: float, rate: float, overlap: Overlap | float = 0.0
           ) -> tuple[Recipe, dict[str, str]]:
    """Choose each tag's placement to minimise the estimated step time within the HBM budget.

    A recipe names a tag once for every stack, so each decision weighs all stacks (bytes and FLOPs times their
    layers). The scan carry is saved whatever the recipe: it stays in HBM if it fits, else it is offloaded if
    its transfer hides. Every other tag the backward pass needs is taken in order of value, the recompute
    FLOPs it saves per byte given the tags kept so far (a lazy greedy: values only fall as more is kept):

    1. keep it on the device if it fits in what is left of the HBM budget;
    2. else offload it if the step time its transfers add is less than the recompute time it saves, and it fits
       the host budget (if one is given);
    3. else recompute it.

    The link model (`zoo.plan.links`): a transfer of T seconds per layer each way (device-to-host in the
    forward pass, host-to-device in the backward) adds `(1 - overlap) * T` to the step in each direction (the
    overlap measured per direction), plus, for the part that overlaps, whatever does not fit under the layer's
    compute (forward; backward: twice the forward). With `overlap=1` a transfer that hides under the forward pass
    is free; with `overlap=0` every offloaded byte costs its link time twice, so a tag is offloaded only where
    recomputing it would take longer. In between (the H200 over PCIe: 0.63 of the stores and 0.48 of the reloads
    hide) a tag is offloaded where its exposed part costs less than its recompute, and once a layer's copies
    outgrow its compute the rest is recomputed: on a slow link only a subset of a layer's tags is offloaded.

    A tag whose saving alone is zero (the norm of a kept tensor; MLA's key and value, two slices of one
    up-projection) is then tried in pairs with the other such tags, and a pair that saves FLOPs goes through the
    same three steps. Hidden transfers are taken as free, so on a fast link everything that hides is offloaded;
    `host_gib` bounds that.
    """
    overlap = Overlap.of(overlap)
    notes: dict[str, str] = {}
    device: list[str] = []
    offload: list[str] = []
    window = {s: costs[s].forward_flops / shard / rate for s in shapes}  # seconds per layer, per device
    moved = {s: 0.0 for s in shapes}  # seconds of transfer per layer already chosen

    def nbytes(group, s: str) -> int:
        return sum(ceil_div(sds_nbytes(shapes[s].tags[t]), shard) for t in group
                   if t in shapes[s].tags and t in needed[s])

    def total(group) -> int:
        return sum(shapes[s].num_layers * nbytes(group, s) for s in shapes)

    def exposed(s: str, moved_s: float) -> float:  # seconds per layer the transfers add to the step
        fwd = window[s]
        return ((1 - overlap.d2h) * moved_s + overlap.d2h * max(0.0, moved_s - fwd)
                + (1 - overlap.h2d) * moved_s + overlap.h2d * max(0.0, moved_s - 2 * fwd))

    def cost(group) -> float:  # seconds per step that offloading `group` adds
        return sum(shapes[s].num_layers * (exposed(s, moved[s] + nbytes(group, s) / link) - exposed(s, moved[s]))
                   for s in shapes)

    def hides(group, value: float = 0.0) -> tuple[bool, str]:
        """(offloading `group` pays: its added step time < the recompute time it saves, and why)."""
        extra, saved = cost(group), value / rate
        worst = max((s for s in shapes if nbytes(group, s)), key=lambda s: moved[s] + nbytes(group, s) / link
                    - window[s], default=None)
        if worst is None:
            return True, "nothing to move"
        per_layer = (f"{1e3 * (moved[worst] + nbytes(group, worst) / link):.2f} ms per layer "
                     f"{'<=' if moved[worst] + nbytes(group, worst) / link <= window[worst] else '>'} forward "
                     f"{1e3 * window[worst]:.2f} ms at {link / 1e9:g} GB/s")
        if min(overlap.d2h, overlap.h2d) >= 1:
            if extra <= 0:
                return True, f"its transfer hides: {per_layer}"
            if extra < saved:
                return True, (f"its transfer hides only in part in {worst}: {per_layer}, adding {1e3 * extra:.1f} ms "
                              f"per step < {1e3 * saved:.1f} ms of recompute")
            return False, f"its transfer would not hide in {worst}: {per_layer}"
        how = f"overlap {overlap}: " + ("copies serialised with compute" if max(overlap.d2h, overlap.h2d) == 0
                                       else "partly hidden")
        if extra < saved:
            return True, (f"its transfers add {1e3 * extra:.1f} ms per step ({how}, {link / 1e9:g} GB/s) < "
                          f"{1e3 * saved:.1f} ms of recompute saved")
        return False, (f"its transfers would add {1e3 * extra:.1f} ms per step ({how}, {link / 1e9:g} GB/s) >= "
                       f"{1e3 * saved:.1f} ms of recompute it saves")

    def saving(group, kept: frozenset) -> int:  # recompute FLOPs per step per device that keeping `group` saves
        return sum(shapes[s].num_layers * ceil_div(costs[s].remat_flops(kept) - costs[s].remat_flops(kept | set(group)),
                                                    shard) for s in shapes if any(t in needed[s] for t in group))

    hbm_left = hbm_budget - state.total
    host_used = 0
    kept = frozenset()

    def place(group, value: int, what: str) -> None:
        nonlocal hbm_left, host_used, kept
        size = total(group)
        gain = f"saves {fmt_flops(value)} of recompute per step ({value / size:.0f} FLOP/byte)"
        if size <= hbm_left:
            device.extend(group)
            hbm_left -= size
            kept |= set(group)
            note = f"kept in HBM: {fmt_bytes(size)} fits ({fmt_bytes(hbm_left + size)} left); {gain}"
        else:
            ok, why = hides(group, value)
            if ok and (host_budget is None or host_used + size <= host_budget):
                offload.extend(group)
                for s in shapes:
                    moved[s] += nbytes(group, s) / link
                host_used += size
                kept |= set(group)
                note = (f"offloaded: {fmt_bytes(size)} does not fit in HBM ({fmt_bytes(max(hbm_left, 0))} left); "
                        f"{why}; {gain}")
            else:
                reason = why if not ok else f"the host budget is full ({fmt_bytes(host_used)} used)"
                note = (f"recomputed: {fmt_bytes(size)} does not fit in HBM ({fmt_bytes(max(hbm_left, 0))} left) "
                        f"and {reason}")
        for t in group:
            notes[t] = what + note

    # the scan carry: saved whatever the recipe says, so the only question is where
    carry = total([CARRY])
    if carry:
        ok, why = hides([CARRY], float("inf"))   # it cannot be recomputed: offloading is the only alternative
        if carry <= hbm_left:
            device.append(CARRY)
            notes[CARRY] = f"scan carry kept in HBM: fits ({fmt_bytes(hbm_left)} left of the budget)"
            hbm_left -= carry
        elif ok and (host_budget is None or carry <= host_budget):
            offload.append(CARRY)
            notes[CARRY] = (f"scan carry offloaded: does not fit in HBM; its transfers add "
                            f"{1e3 * cost([CARRY]):.1f} ms per step")
            for s in shapes:
                moved[s] += nbytes([CARRY], s) / link
            host_used += carry
        else:
            device.append(CARRY)
            hbm_left -= carry
            notes[CARRY] = "scan carry kept in HBM although over budget: it cannot be recomputed and " + (
                why if not ok else "the host budget is full")

    # single tags, by value
    candidates = [t for t in dict.fromkeys(t for s in shapes for t in shapes[s].tags)
                  if t != CARRY and any(t in needed[s] for s in shapes)]
    order = {t: i for i, t in enumerate(candidates)}
    heap = [(-saving([t], kept) / total([t]), order[t], t) for t in candidates]
    heapq.heapify(heap)
    alone_useless: list[str] = []
    while heap:
        _, i, tag = heapq.heappop(heap)
        value = saving([tag], kept)
        if heap and -value / total([tag]) > heap[0][0] + 1e-12:  # stale: its value fell below the next one's
            heapq.heappush(heap, (-value / total([tag]), i, tag))
        elif value <= 0:
            alone_useless.append(tag)
            notes[tag] = "recomputed: keeping it alone saves no recompute, given the tags already kept"
        else:
            place([tag], value, "")

    # tags that only pay off together, in pairs, by value
    while len(alone_useless) > 1:
        pairs = [(saving(pair, kept), pair) for pair in itertools.combinations(alone_useless, 2)]
        pairs = [(v / total(pair), v, pair) for v, pair in pairs if v > 0]
        if not pairs:
            break
        _, value, pair = max(pairs, key=lambda p: (p[0], -order[p[2][0]], -order[p[2][1]]))
        place(list(pair), value, "")
        for t, other in (pair, pair[::-1]):
            notes[t] = f"together with {other} (alone it saves nothing): {notes[t]}"
            alone_useless.remove(t)
    return Recipe("auto", offload=tuple(offload), device=tuple(device),
                  description="chosen by zoo.plan for an HBM budget, a link and a FLOP rate"), notes
