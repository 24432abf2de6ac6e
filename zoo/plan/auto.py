"""The automatic recipe: each tag's placement, the sequence tiles and the layers per group chosen for an HBM budget, a
host budget, a host link and a FLOP rate. `choose_structure` (what `zoo.plan.plan(cfg, "auto", ...)` runs) places the
tags of each candidate structure (`structures`, `_Chooser`) and takes the one that costs least among those that fit,
saying why each tag landed where it did (docs/internals.md, "The automatic recipe").
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools

from zoo.plan.links import Overlap
from zoo.plan.measure import LayerCost
from zoo.plan.measure import nbytes as sds_nbytes
from zoo.plan.types import CARRY, ModelState, ceil_div, fmt_bytes, fmt_flops
from zoo.recipe import TOGETHER, Recipe

# Sequence tiles: the most of these that leaves each tile this many positions or more (smaller tiles run small
# matmuls, and more of them save no more: a tile's tensors are already small beside a layer's).
MIN_TILE = 8192
TILES = (4, 8, 16, 32)
GROUPS = (1, 2, 4)
TIE = 0.005   # candidates are tried simplest first; a later one wins only if this much cheaper


def structures(model, seq: int) -> list[tuple[int, int, tuple[str, ...]]]:
    """The (sequence tiles, layers per group, tags a group's layers keep while its backward runs) `choose_structure`
    tries for `model` at `seq`: one tile, and the most of `TILES` that divides the sequence into tiles of at least
    `MIN_TILE` positions; each of `GROUPS` that divides every main stack's layers, its layers keeping the attention
    kernel's residuals (one attention forward fewer) or nothing."""
    tiles = [1] + [t for t in TILES if seq % t == 0 and seq // t >= MIN_TILE][-1:]
    layers = [model.stacks()[n].num_layers for n in model.stack_names]
    groups = [g for g in GROUPS if all(n % g == 0 and n // g >= 1 for n in layers)]
    keeps = [tuple(t for g in TOGETHER for t in g), ()]
    return [(t, g, k) for g in groups for k in (keeps if g > 1 else [()]) for t in tiles]


def choose_structure(layout_of, *, candidates, state: ModelState, shard: int, hbm_budget: int,
                     host_budget: int | None, link: float, rate: float, overlap, reserve
                     ) -> tuple[Recipe, dict[str, str]]:
    """The recipe `choose` makes for the structure (tiles, group) of `candidates` that costs least (recompute and
    exposed copies, seconds per step) among those whose choice fits the budgets; the first candidate's (one tile, no
    groups) where none fits. Once a structure that fits keeps every tag that saves recompute in HBM, the larger
    ones are not tried (they could only add recompute). `layout_of(tiles, group, keep)`: the planner's `Layout`;
    `reserve(layout, recipe)`: HBM the step needs beside the plan's saved bytes (the loss's logits, one group's
    backward)."""
    best, layouts = None, {}
    for (tiles, group, keep), carry_out in itertools.product(candidates, (False, True)):
        if best is not None and best[0] and not best[4]:
            break   # a simpler structure kept in HBM every tag that saves recompute: more tiles or layers only cost
        if (tiles, group, keep) not in layouts:
            layouts[(tiles, group, keep)] = layout_of(tiles, group, keep)
        lay = layouts[(tiles, group, keep)]
        # the reserve depends on what is kept (a kept tensor is not remade): start from keeping the tags that pay
        # together, then from the choice itself
        probe = Recipe("probe", device=tuple(t for g in TOGETHER for t in g), seq_tiles=tiles, group=group,
                       group_keep=keep)
        for _ in range(2):
            chooser = _Chooser(lay.shapes, lay.needed, lay.costs, shard, host_budget, link, rate, Overlap.of(overlap),
                               hbm_left=hbm_budget - state.total - reserve(lay, probe), groups=lay.groups)
            chooser.place_carry(offload_first=carry_out)
            chooser.place_pairs(chooser.place_singles())
            recipe = chooser.recipe(tiles, group, keep)
            if recipe == probe:
                break
            probe = recipe
        if carry_out and CARRY not in chooser.offload:
            continue   # the carry cannot go to the host: the first pass covered this structure
        cost = chooser.seconds()
        fits = chooser.over == 0
        # a larger structure must pay for itself: cheaper by more than TIE of the step's cost so far
        if best is None or (fits and (not best[0] or cost < best[1] * (1 - TIE) - 1e-3)):
            best = (fits, cost, recipe, chooser.notes, chooser.pressed)
    return best[2], best[3]


@dataclasses.dataclass
class _Chooser:
    """The placement of a structure's tags and what it has decided so far: the tags placed, HBM and host memory left,
    the transfer time per layer already chosen, and why each tag landed where it did. Each step (`place_carry`,
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
    groups: dict = None            # {stack: layers per group}: the scan carry is saved once per group
    host_used: int = 0
    over: int = 0                  # bytes kept in HBM over the budget (the carry, which cannot be recomputed)
    pressed: bool = False          # some tag that saves recompute found no room in HBM
    kept: frozenset = frozenset()
    device: list[str] = dataclasses.field(default_factory=list)
    offload: list[str] = dataclasses.field(default_factory=list)
    notes: dict[str, str] = dataclasses.field(default_factory=dict)
    window: dict[str, float] = dataclasses.field(init=False)   # seconds of forward per layer, per device
    moved: dict[str, float] = dataclasses.field(init=False)    # seconds of transfer per layer already chosen
    candidates: list[str] = dataclasses.field(init=False)      # the needed tags but the carry, first seen first
    order: dict[str, int] = dataclasses.field(init=False)

    def __post_init__(self):
        self.groups = self.groups or {s: 1 for s in self.shapes}
        self.over = max(0, -self.hbm_left)   # the model state and the reserve alone over the budget
        self.window = {s: self.costs[s].forward_flops / self.shard / self.rate for s in self.shapes}
        self.moved = {s: 0.0 for s in self.shapes}
        self.candidates = [t for t in dict.fromkeys(t for s in self.shapes for t in self.shapes[s].tags)
                           if t != CARRY and any(t in self.needed[s] for s in self.shapes)]
        self.order = {t: i for i, t in enumerate(self.candidates)}

    def nbytes(self, group, s: str) -> int:
        return sum(ceil_div(sds_nbytes(self.shapes[s].tags[t]), self.shard * (self.groups[s] if t == CARRY else 1))
                   for t in group if t in self.shapes[s].tags and t in self.needed[s])

    def recipe(self, tiles: int = 1, group: int = 1, keep: tuple[str, ...] = ()) -> Recipe:
        """The choice so far as a recipe (with the structure it was made for: `keep`, what a group's layers keep while
        its backward runs, less what the choice keeps anyway)."""
        keep = tuple(t for t in keep if t not in self.offload and t not in self.device)
        return Recipe("auto", offload=tuple(self.offload), device=tuple(self.device), seq_tiles=tiles, group=group,
                      group_keep=keep, description="chosen by zoo.plan for an HBM budget, a link and a FLOP rate")

    def seconds(self) -> float:
        """Seconds per step the choice costs: the recompute it leaves and its exposed copies."""
        kept = self.kept
        remat = sum(self.shapes[s].num_layers * ceil_div(self.costs[s].remat_flops(kept), self.shard)
                    for s in self.shapes) / self.rate
        return remat + sum(self.shapes[s].num_layers * self.exposed(s, self.moved[s]) for s in self.shapes)

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

    def _keep(self, group, size: int) -> None:
        """Keep `group` (`size` bytes) in HBM."""
        self.device.extend(group)
        self.hbm_left -= size
        self.kept |= set(group)

    def place(self, group, value: int) -> None:
        """Keep `group` in HBM if it fits, else offload it if that pays and fits the host budget (never a tag made
        inside sequence tiles), else recompute it."""
        size = self.total(group)
        fits = size <= self.hbm_left
        self.pressed |= not fits
        if fits:
            self._keep(group, size)
            tile = " (tile by tile)" if self.tiled(group) else ""
            note = f"kept in HBM{tile}: {fmt_bytes(size)} fits ({fmt_bytes(self.hbm_left + size)} left); " + \
                self._gain(size, value)
        elif self.tiled(group):   # made inside sequence tiles: kept in HBM or recomputed, never offloaded
            note = f"recomputed tile by tile: {fmt_bytes(size)} does not fit in HBM and a tiled tag is not offloaded"
        else:
            ok, why = self.hides(group, value)
            if ok and (self.host_budget is None or self.host_used + size <= self.host_budget):
                self.offload.extend(group)
                self._move(group, size)
                self.kept |= set(group)
                note = (f"offloaded: {fmt_bytes(size)} does not fit in HBM ({fmt_bytes(max(self.hbm_left, 0))} left); "
                        f"{why}; {self._gain(size, value)}")
            else:
                reason = why if not ok else f"the host budget is full ({fmt_bytes(self.host_used)} used)"
                note = (f"recomputed: {fmt_bytes(size)} does not fit in HBM ({fmt_bytes(max(self.hbm_left, 0))} left) "
                        f"and {reason}")
        for t in group:
            self.notes[t] = note

    @staticmethod
    def _gain(size: int, value: int) -> str:
        return f"saves {fmt_flops(value)} of recompute per step ({value / size:.0f} FLOP/byte)"

    def tiled(self, group) -> bool:
        return any(t in getattr(self.shapes[s], "tiled", ()) for s in self.shapes for t in group)

    def place_carry(self, offload_first: bool = False) -> None:
        """The scan carry: saved whatever the recipe says, so the only question is where: in HBM if it fits (or
        `offload_first`: on the host if it fits there and its transfer hides), else the other."""
        carry = self.total([CARRY])
        if not carry:
            return
        ok, why = self.hides([CARRY], float("inf"))   # it cannot be recomputed: offloading is the only alternative
        to_host = ok and (self.host_budget is None or carry <= self.host_budget)
        if offload_first and to_host:
            self.offload.append(CARRY)
            self.notes[CARRY] = (f"scan carry offloaded: leaves HBM to tags that save recompute; its transfers add "
                                 f"{1e3 * self.cost([CARRY]):.1f} ms per step")
            self._move([CARRY], carry)
        elif carry <= self.hbm_left:
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
            self.over += carry - max(self.hbm_left, 0)
            self.hbm_left -= carry
            self.notes[CARRY] = "scan carry kept in HBM although over budget: it cannot be recomputed and " + (
                why if not ok else "the host budget is full")

    def units(self) -> list[tuple[str, ...]]:
        """The candidates as units of placement: each tag alone, but the tags that only pay together
        (`zoo.recipe.TOGETHER`: the attention kernel's output and statistics) as one unit."""
        together = [g for g in TOGETHER if all(t in self.order for t in g)]
        grouped = {t for g in together for t in g}
        return [tuple(g) for g in together] + [(t,) for t in self.candidates if t not in grouped]

    def place_singles(self) -> list[str]:
        """Every other needed tag alone (or with the tags it only pays together with), by value (recompute FLOPs
        saved per byte, a lazy greedy: values only fall as more is kept). Returns the tags whose saving alone is
        zero, in the order they came up."""
        heap = [(-self.saving(u) / self.total(u), min(self.order[t] for t in u), u) for u in self.units()]
        heapq.heapify(heap)
        alone_useless: list[str] = []
        while heap:
            _, i, unit = heapq.heappop(heap)
            value = self.saving(unit)
            if heap and -value / self.total(unit) > heap[0][0] + 1e-12:  # stale: its value fell below the next one's
                heapq.heappush(heap, (-value / self.total(unit), i, unit))
            elif value <= 0:
                alone_useless.extend(unit)
                for tag in unit:
                    self.notes[tag] = "recomputed: keeping it alone saves no recompute, given the tags already kept"
            else:
                self.place(list(unit), value)
                if len(unit) > 1:
                    for t in unit:
                        self.notes[t] = f"with {', '.join(o for o in unit if o != t)} (they pay together): " \
                                        f"{self.notes[t]}"
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
