"""The automatic recipe: each tag's placement chosen for an HBM budget, a host link and a FLOP rate.

`choose` is what `zoo.plan(cfg, "auto", ...)` runs; it says why each tag landed where it did.
"""
from __future__ import annotations

import heapq
import itertools

from zoo.plan.measure import LayerCost
from zoo.plan.measure import nbytes as sds_nbytes
from zoo.plan.types import CARRY, ModelState, ceil_div, fmt_bytes, fmt_flops
from zoo.recipe import Recipe


def choose(shapes, needed, costs: dict[str, LayerCost], state: ModelState, shard: int, hbm_budget: int,
           host_budget: int | None, link: float, rate: float) -> tuple[Recipe, dict[str, str]]:
    """Choose each tag's placement to minimise the estimated step time within the HBM budget.

    A recipe names a tag once for every stack, so each decision weighs all stacks (bytes and FLOPs times their
    layers). The scan carry is saved whatever the recipe: it stays in HBM if it fits, else it is offloaded if
    its transfer hides. Every other tag the backward pass needs is taken in order of value, the recompute
    FLOPs it saves per byte given the tags kept so far (a lazy greedy: values only fall as more is kept):

    1. keep it on the device if it fits in what is left of the HBM budget;
    2. else offload it if its transfer, added to the transfers already chosen, hides under the forward pass of
       every layer that emits it (device-to-host during the forward; host-to-device has the longer backward)
       at the given link speed, and fits the host budget (if one is given);
    3. else recompute it.

    A tag whose saving alone is zero (the norm of a kept tensor; MLA's key and value, two slices of one
    up-projection) is then tried in pairs with the other such tags, and a pair that saves FLOPs goes through the
    same three steps. Hidden transfers are taken as free, so on a fast link everything that hides is offloaded;
    `host_gib` bounds that.
    """
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

    def hides(group) -> tuple[bool, str]:
        worst = ""
        for s in shapes:
            b = nbytes(group, s)
            if b and moved[s] + b / link > window[s]:
                return False, (f"its transfer would not hide in {s}: {1e3 * (moved[s] + b / link):.2f} ms per "
                               f"layer > forward {1e3 * window[s]:.2f} ms at {link / 1e9:g} GB/s")
            if b:
                worst = (f"its transfer hides: {1e3 * (moved[s] + b / link):.2f} ms per layer <= forward "
                         f"{1e3 * window[s]:.2f} ms at {link / 1e9:g} GB/s")
        return True, worst

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
            ok, why = hides(group)
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
        ok, why = hides([CARRY])
        if carry <= hbm_left:
            device.append(CARRY)
            notes[CARRY] = f"scan carry kept in HBM: fits ({fmt_bytes(hbm_left)} left of the budget)"
            hbm_left -= carry
        elif ok and (host_budget is None or carry <= host_budget):
            offload.append(CARRY)
            for s in shapes:
                moved[s] += nbytes([CARRY], s) / link
            host_used += carry
            notes[CARRY] = f"scan carry offloaded: does not fit in HBM; {why}"
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
