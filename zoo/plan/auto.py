"""The automatic recipe: each tag's placement chosen for an HBM budget, a host link and a FLOP rate.

`choose` is what `zoo.plan.plan(cfg, "auto", ...)` runs; it says why each tag landed where it did.
"""
from __future__ import annotations

import dataclasses
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
    chooser = _Chooser(shapes, needed, costs, shard, host_budget, link, rate, Overlap.of(overlap),
                       hbm_left=hbm_budget - state.total)
    chooser.place_carry()
    alone_useless = chooser.place_singles()
    chooser.place_pairs(alone_useless)
    return Recipe("auto", offload=tuple(chooser.offload), device=tuple(chooser.device),
                  description="chosen by zoo.plan for an HBM budget, a link and a FLOP rate"), chooser.notes


@dataclasses.dataclass
class _Chooser:
    """`choose`'s inputs and what it has decided so far: the tags placed, HBM and host memory left, the transfer
    time per layer already chosen, and why each tag landed where it did. Each step (`place_carry`,
    `place_singles`, `place_pairs`) places tags through `place`."""
    shapes: dict
    needed: dict
    costs: dict[str, LayerCost]
    shard: int
    host_budget: int | None
    link: float
    rate: float
    overlap: Overlap
    hbm_left: int
    host_used: int = 0
    kept: frozenset = frozenset()
    device: list[str] = dataclasses.field(default_factory=list)
    offload: list[str] = dataclasses.field(default_factory=list)
    notes: dict[str, str] = dataclasses.field(default_factory=dict)
    window: dict[str, float] = dataclasses.field(init=False)   # seconds of forward per layer, per device
    moved: dict[str, float] = dataclasses.field(init=False)    # seconds of transfer per layer already chosen
    candidates: list[str] = dataclasses.field(init=False)      # the needed tags but the carry, first seen first
    order: dict[str, int] = dataclasses.field(init=False)

    def __post_init__(self):
        self.window = {s: self.costs[s].forward_flops / self.shard / self.rate for s in self.shapes}
        self.moved = {s: 0.0 for s in self.shapes}
        self.candidates = [t for t in dict.fromkeys(t for s in self.shapes for t in self.shapes[s].tags)
                           if t != CARRY and any(t in self.needed[s] for s in self.shapes)]
        self.order = {t: i for i, t in enumerate(self.candidates)}

    def nbytes(self, group, s: str) -> int:
        return sum(ceil_div(sds_nbytes(self.shapes[s].tags[t]), self.shard) for t in group
                   if t in self.shapes[s].tags and t in self.needed[s])

    def total(self, group) -> int:
        return sum(self.shapes[s].num_layers * self.nbytes(group, s) for s in self.shapes)

    def exposed(self, s: str, moved_s: float) -> float:
        """Seconds per layer that `moved_s` seconds of transfer each way add to the step."""
        fwd, overlap = self.window[s], self.overlap
        return ((1 - overlap.d2h) * moved_s + overlap.d2h * max(0.0, moved_s - fwd)
                + (1 - overlap.h2d) * moved_s + overlap.h2d * max(0.0, moved_s - 2 * fwd))

    def cost(self, group) -> float:
        """Seconds per step that offloading `group` adds."""
        return sum(self.shapes[s].num_layers * (self.exposed(s, self.moved[s] + self.nbytes(group, s) / self.link)
                                                - self.exposed(s, self.moved[s])) for s in self.shapes)

    def hides(self, group, value: float = 0.0) -> tuple[bool, str]:
        """(offloading `group` pays: its added step time < the recompute time it saves, and why)."""
        shapes, moved, window, link, overlap = self.shapes, self.moved, self.window, self.link, self.overlap
        extra, saved = self.cost(group), value / self.rate
        worst = max((s for s in shapes if self.nbytes(group, s)),
                    key=lambda s: moved[s] + self.nbytes(group, s) / link - window[s], default=None)
        if worst is None:
            return True, "nothing to move"
        per_layer = (f"{1e3 * (moved[worst] + self.nbytes(group, worst) / link):.2f} ms per layer "
                     f"{'<=' if moved[worst] + self.nbytes(group, worst) / link <= window[worst] else '>'} forward "
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

    def saving(self, group) -> int:
        """Recompute FLOPs per step per device that keeping `group` saves, given the tags kept so far."""
        kept = self.kept
        return sum(self.shapes[s].num_layers * ceil_div(self.costs[s].remat_flops(kept)
                                                        - self.costs[s].remat_flops(kept | set(group)), self.shard)
                   for s in self.shapes if any(t in self.needed[s] for t in group))

    def _move(self, group, size: int) -> None:
        """Count `group`'s transfers per layer and its `size` bytes of host memory."""
        for s in self.shapes:
            self.moved[s] += self.nbytes(group, s) / self.link
        self.host_used += size

    def place(self, group, value: int) -> None:
        """Keep `group` in HBM if it fits, else offload it if that pays and fits the host budget, else recompute it."""
        size = self.total(group)
        gain = f"saves {fmt_flops(value)} of recompute per step ({value / size:.0f} FLOP/byte)"
        if size <= self.hbm_left:
            self.device.extend(group)
            self.hbm_left -= size
            self.kept |= set(group)
            note = f"kept in HBM: {fmt_bytes(size)} fits ({fmt_bytes(self.hbm_left + size)} left); {gain}"
        else:
            ok, why = self.hides(group, value)
            if ok and (self.host_budget is None or self.host_used + size <= self.host_budget):
                self.offload.extend(group)
                self._move(group, size)
                self.kept |= set(group)
                note = (f"offloaded: {fmt_bytes(size)} does not fit in HBM ({fmt_bytes(max(self.hbm_left, 0))} left); "
                        f"{why}; {gain}")
            else:
                reason = why if not ok else f"the host budget is full ({fmt_bytes(self.host_used)} used)"
                note = (f"recomputed: {fmt_bytes(size)} does not fit in HBM ({fmt_bytes(max(self.hbm_left, 0))} left) "
                        f"and {reason}")
        for t in group:
            self.notes[t] = note

    def place_carry(self) -> None:
        """The scan carry: saved whatever the recipe says, so the only question is where."""
        carry = self.total([CARRY])
        if not carry:
            return
        ok, why = self.hides([CARRY], float("inf"))   # it cannot be recomputed: offloading is the only alternative
        if carry <= self.hbm_left:
            self.device.append(CARRY)
            self.notes[CARRY] = f"scan carry kept in HBM: fits ({fmt_bytes(self.hbm_left)} left of the budget)"
            self.hbm_left -= carry
        elif ok and (self.host_budget is None or carry <= self.host_budget):
            self.offload.append(CARRY)
            self.notes[CARRY] = (f"scan carry offloaded: does not fit in HBM; its transfers add "
                                 f"{1e3 * self.cost([CARRY]):.1f} ms per step")
            self._move([CARRY], carry)
        else:
            self.device.append(CARRY)
            self.hbm_left -= carry
            self.notes[CARRY] = "scan carry kept in HBM although over budget: it cannot be recomputed and " + (
                why if not ok else "the host budget is full")

    def place_singles(self) -> list[str]:
        """Every other needed tag alone, by value (recompute FLOPs saved per byte, a lazy greedy: values only fall
        as more is kept). Returns the tags whose saving alone is zero, in the order they came up."""
        heap = [(-self.saving([t]) / self.total([t]), self.order[t], t) for t in self.candidates]
        heapq.heapify(heap)
        alone_useless: list[str] = []
        while heap:
            _, i, tag = heapq.heappop(heap)
            value = self.saving([tag])
            if heap and -value / self.total([tag]) > heap[0][0] + 1e-12:  # stale: its value fell below the next one's
                heapq.heappush(heap, (-value / self.total([tag]), i, tag))
            elif value <= 0:
                alone_useless.append(tag)
                self.notes[tag] = "recomputed: keeping it alone saves no recompute, given the tags already kept"
            else:
                self.place([tag], value)
        return alone_useless

    def place_pairs(self, alone_useless: list[str]) -> None:
        """Tags that only pay off together, in pairs, by value (ties: the pair that came up first)."""
        alone_useless = list(alone_useless)
        while len(alone_useless) > 1:
            pairs = [(self.saving(pair), pair) for pair in itertools.combinations(alone_useless, 2)]
            pairs = [(v / self.total(pair), v, pair) for v, pair in pairs if v > 0]
            if not pairs:
                break
            _, value, pair = max(pairs, key=lambda p: (p[0], -self.order[p[2][0]], -self.order[p[2][1]]))
            self.place(list(pair), value)
            for t, other in (pair, pair[::-1]):
                self.notes[t] = f"together with {other} (alone it saves nothing): {self.notes[t]}"
                alone_useless.remove(t)
