"""The automatic recipe's placer: where each tag of a candidate structure goes (kept in HBM, offloaded to host memory,
or recomputed), placed greedily on the figures of the cost model (`zoo.plan.costs`), and which structure is best
(`choose`). Each decision is kept as a `Decision`, with the figures it was taken on; `zoo.plan.auto` words them
(docs/internals.md, "The automatic recipe").

The rule `choose` picks the best by: structures are tried in the order given (simplest first), each with the scan
carry placed in HBM first, then again with it offloaded first. The first one tried is the best until another does
better: one that fits the HBM budget replaces a best that does not fit, and a best that fits only by costing less
than `1 - TIE` of its seconds per step, less a millisecond (a larger structure must pay for itself). Once the best
fits and kept every tag that saves recompute in HBM (none was pressed for room), the rest are not tried: more tiles or
layers per group could only add recompute.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
from typing import Literal

from zoo.plan.costs import CostModel, Costs, Placement, Transfer
from zoo.plan.links import Overlap
from zoo.plan.types import CARRY, ModelState
from zoo.recipe import TOGETHER, Recipe
from zoo.tags import LEAD, role_name, split_name

TIE = 0.005   # candidates are tried simplest first; a later one wins only if this much cheaper

# What a decision placed, and on which ground: a tag (or a unit of tags) kept in HBM because it fits; recomputed tile
# by tile (made inside sequence tiles: never offloaded); offloaded (no room in HBM, and its transfer pays); recomputed
# (no room, and offloading does not pay or the host budget is full); recomputed as it saves nothing alone. The scan
# carry: offloaded first (to leave HBM to tags that save recompute); kept in HBM as it fits; offloaded as it does not;
# kept in HBM over the budget (it cannot be recomputed, and cannot be offloaded).
Why = Literal["kept", "tiled", "offloaded", "recomputed", "useless",
              "carry first", "carry kept", "carry offloaded", "carry over"]


@dataclasses.dataclass(frozen=True)
class Decision:
    """One decision of the placer and the figures it was taken on.

    Args:
        tags: the tags placed together.
        why: what was decided, and on which ground (`Why`).
        size: bytes per step the tags take, per device.
        left: bytes of the HBM budget left before the decision (negative: already over it).
        value: recompute FLOPs per step that saving the tags avoids.
        transfer: what offloading them would add (None where it was not weighed).
        host_used: bytes of host memory used before the decision.
        tiled: whether a tag is made inside sequence tiles.
        how: "" (placed alone), "together" (tags that only pay together: `zoo.recipe.TOGETHER`) or "pair" (tags that
            each save nothing alone).
    """
    tags: tuple[str, ...]
    why: Why
    size: int = 0
    left: int = 0
    value: float = 0
    transfer: Transfer | None = None
    host_used: int = 0
    tiled: bool = False
    how: Literal["", "together", "pair"] = ""

    @property
    def host_full(self) -> bool:
        """Whether the host budget is what stopped it: recomputed (or the carry kept over the HBM budget) although
        its transfer pays."""
        return self.why in ("recomputed", "carry over") and self.transfer is not None and self.transfer.pays


@dataclasses.dataclass(frozen=True)
class Choice:
    """A structure's placement as the placer chose it (`choose` returns the best one).

    Args:
        recipe: the placement as a recipe, with its structure (sequence tiles, group, what a group's layers keep).
        costs: its `zoo.plan.costs.Costs`.
        fits: whether it fits the HBM budget.
        pressed: whether some tag that saves recompute found no room in HBM.
        decisions: the placer's decisions, in the order taken.
    """
    recipe: Recipe
    costs: Costs
    fits: bool
    pressed: bool
    decisions: tuple[Decision, ...]

    @property
    def host_full(self) -> bool:
        """Whether the host budget stopped some tag from being offloaded (`Decision.host_full`)."""
        return any(d.host_full for d in self.decisions)


def choose(layout_of, *, candidates, state: ModelState, shard: int, hbm_budget: int, host_budget: int | None,
           link: float, rate: float, overlap, reserve) -> Choice:
    """The best placement over the candidate structures, by the rule in this module's docstring.

    Args:
        layout_of: `layout_of(tiles, group, keep, subgroup)`: the planner's `Layout` of a structure.
        candidates: the structures, (tiles, group, keep, subgroup) each, simplest first
            (`zoo.plan.auto.structures`).
        state: the model state (its bytes are in HBM whatever the placement).
        shard: devices the batch and the tags are split over.
        hbm_budget: the HBM budget per device, bytes.
        host_budget: the host memory the offloaded tags may take per device, bytes (None: unbounded).
        link: the host link, bytes per second per direction.
        rate: the FLOP rate recompute is priced at, FLOP/s.
        overlap: the fraction of copy time hidden under compute (a number, a (d2h, h2d) pair or an `Overlap`).
        reserve: `reserve(layout, recipe)`: HBM the step needs beside the saved bytes (the loss's logits, one group's
            backward).

    Returns:
        The best `Choice`; where none fits, the first candidate's (one tile, no groups).
    """
    best, layouts = None, {}
    for (tiles, group, keep, subgroup), carry_out in itertools.product(candidates, (False, True)):
        if best is not None and best.fits and not best.pressed:
            break   # a simpler structure kept in HBM every tag that saves recompute: more tiles or layers only cost
        if (tiles, group, keep, subgroup) not in layouts:
            layouts[(tiles, group, keep, subgroup)] = layout_of(tiles, group, keep, subgroup)
        lay = layouts[(tiles, group, keep, subgroup)]
        # the reserve depends on what is kept (a kept tensor is not remade): start from keeping the tags that pay
        # together, then from the choice itself
        probe = Recipe("probe", device=tuple(t for g in TOGETHER for t in g), seq_tiles=tiles, group=group,
                       group_keep=keep, subgroup=subgroup)
        for _ in range(2):
            model = CostModel(lay.shapes, lay.needed, lay.costs, shard, link, rate, Overlap.of(overlap),
                              fixed_hbm=state.total + reserve(lay, probe), groups=lay.groups)
            placer = _Placer(model, hbm_budget, host_budget, lead=subgroup == 1)
            placer.place_carry(offload_first=carry_out)
            placer.place_pairs(placer.place_singles())
            recipe = placer.recipe(tiles, group, keep, subgroup)
            if recipe == probe:
                break
            probe = recipe
        if carry_out and CARRY not in placer.placement.offloaded():
            continue   # the carry cannot go to the host: the first pass covered this structure
        costs = model.of(placer.placement)
        choice = Choice(recipe, costs, costs.hbm <= hbm_budget, placer.pressed, tuple(placer.decisions))
        if best is None or (choice.fits and (not best.fits or _cheaper(choice.costs, best.costs))):
            best = choice
    return best


def _cheaper(costs: Costs, than: Costs) -> bool:
    """Whether a later structure's costs beat the best so far's: by more than `TIE` of its step time, and 1 ms."""
    return costs.seconds < than.seconds * (1 - TIE) - 1e-3


class _Placer:
    """The placement of one structure's tags as it is built: what is placed, HBM and host memory left, and each
    decision. Each step (`place_carry`, `place_singles`, `place_pairs`) places tags through `place`."""

    def __init__(self, model: CostModel, hbm_budget: int, host_budget: int | None, lead: bool = True):
        self.model = model
        self.lead = lead   # a group's first layer may keep what the others recompute (two levels)
        self.host_budget = host_budget
        self.hbm_left = hbm_budget - model.fixed_hbm
        self.host_used = 0
        self.pressed = False   # some tag that saves recompute found no room in HBM
        self.placement = Placement()
        self.decisions: list[Decision] = []
        shapes, needed = model.shapes, model.needed
        # the needed tags but the carry, first seen first
        self.candidates = [t for t in dict.fromkeys(t for s in shapes for t in shapes[s].tags)
                           if t != CARRY and any(t in needed[s] for s in shapes)]
        self.order = {t: i for i, t in enumerate(self.candidates)}

    def recipe(self, tiles: int = 1, group: int = 1, keep: tuple[str, ...] = (), subgroup: int = 1) -> Recipe:
        """The placement so far as a recipe (with the structure it was made for: `keep`, what a group's layers keep
        while its backward runs, less what the placement keeps anyway; a group's first layer's tags as its lead
        tags)."""
        def split(names):   # (every layer's tags, the first layer's of each group)
            return (tuple(t for t in names if not split_name(t)[1]),
                    tuple(split_name(t)[0] for t in names if split_name(t)[1] == LEAD))
        (device, lead_device), (offload, lead_offload) = split(self.placement.device), split(self.placement.offloaded())
        keep = tuple(t for t in keep if t not in offload and t not in device)
        return Recipe("auto", offload=offload, device=device, seq_tiles=tiles, group=group, group_keep=keep,
                      subgroup=subgroup, lead_device=lead_device, lead_offload=lead_offload,
                      description="chosen by zoo.plan for an HBM budget, a link and a FLOP rate")

    def _decide(self, decision: Decision) -> None:
        self.decisions.append(decision)

    def _offload(self, unit: tuple[str, ...], size: int) -> None:
        self.placement = dataclasses.replace(self.placement, offload=self.placement.offload + (unit,))
        self.host_used += size

    def _keep(self, unit: tuple[str, ...], size: int) -> None:
        self.placement = dataclasses.replace(self.placement, device=self.placement.device + unit)
        self.hbm_left -= size

    def _transfer(self, unit, value: float) -> Transfer:
        return self.model.transfer(unit, value, self.model.moved(self.placement))

    def place(self, unit, value: float, how: Literal["", "together", "pair"] = "") -> None:
        """Keep `unit` in HBM if it fits, else offload it if that pays and fits the host budget (never a tag made
        inside sequence tiles), else recompute it. Where every layer keeps a unit a group's first layer kept
        already, the first layer's copy is given back first (and kept where the unit is recomputed)."""
        unit = tuple(unit)
        before = (self.placement, self.hbm_left, self.host_used)
        self._give_back(tuple(role_name(t, LEAD) for t in unit))
        self._decide_on(unit, value, how)
        if self.decisions[-1].why in ("recomputed", "tiled"):
            self.placement, self.hbm_left, self.host_used = before

    def _give_back(self, lead: tuple[str, ...]) -> None:
        """Take the unit `lead` (a group's first layer's tags) out of the placement, its bytes back to the budgets."""
        size = self.model.total(lead)
        if lead in self.placement.offload:
            self.placement = dataclasses.replace(self.placement,
                                                 offload=tuple(u for u in self.placement.offload if u != lead))
            self.host_used -= size
        elif lead and all(t in self.placement.device for t in lead):
            self.placement = dataclasses.replace(self.placement,
                                                 device=tuple(t for t in self.placement.device if t not in lead))
            self.hbm_left += size

    def _decide_on(self, unit: tuple[str, ...], value: float, how) -> None:
        size = self.model.total(unit)
        fits = size <= self.hbm_left
        self.pressed |= not fits
        tiled = self.model.tiled(unit)
        common = dict(size=size, left=self.hbm_left, value=value, host_used=self.host_used, tiled=tiled, how=how)
        if fits:
            self._keep(unit, size)
            self._decide(Decision(unit, "kept", **common))
        elif tiled:
            self._decide(Decision(unit, "tiled", **common))
        else:
            transfer = self._transfer(unit, value)
            if transfer.pays and (self.host_budget is None or self.host_used + size <= self.host_budget):
                self._offload(unit, size)
                self._decide(Decision(unit, "offloaded", transfer=transfer, **common))
            else:
                self._decide(Decision(unit, "recomputed", transfer=transfer, **common))

    def place_carry(self, offload_first: bool = False) -> None:
        """The scan carry: saved whatever the recipe says, so the only question is where: in HBM if it fits (or
        `offload_first`: on the host if it fits there and its transfer hides), else the other."""
        carry = self.model.total([CARRY])
        if not carry:
            return
        # it cannot be recomputed: offloading is the only alternative
        transfer = self._transfer((CARRY,), float("inf"))
        to_host = transfer.pays and (self.host_budget is None or carry <= self.host_budget)
        common = dict(size=carry, left=self.hbm_left, value=float("inf"), transfer=transfer, host_used=self.host_used)
        if offload_first and to_host:
            self._decide(Decision((CARRY,), "carry first", **common))
            self._offload((CARRY,), carry)
        elif carry <= self.hbm_left:
            self._decide(Decision((CARRY,), "carry kept", **common))
            self._keep((CARRY,), carry)
        elif to_host:
            self._decide(Decision((CARRY,), "carry offloaded", **common))
            self._offload((CARRY,), carry)
        else:
            self._decide(Decision((CARRY,), "carry over", **common))
            self._keep((CARRY,), carry)

    def units(self) -> list[tuple[str, ...]]:
        """The candidates as units of placement: each tag alone, but the tags that only pay together
        (`zoo.recipe.TOGETHER`: the attention kernel's output and statistics) as one unit; and, where layers run in
        groups (two levels), those tags as the first layer of each group keeps them (`lead_units`), last."""
        together = [g for g in TOGETHER if all(t in self.order for t in g)]
        grouped = {t for g in together for t in g}
        return ([tuple(g) for g in together] + [(t,) for t in self.candidates if t not in grouped]
                + self.lead_units(together))

    def lead_units(self, together) -> list[tuple[str, ...]]:
        """The tags that only pay together, as the first layer of each group keeps them (`zoo.tags.role_name(tag,
        LEAD)`: one layer's in k, where HBM and the host cannot hold every layer's); none where no stack runs in
        groups of two levels."""
        units = [tuple(role_name(t, LEAD) for t in g) for g in together] if self.lead else []
        return [u for u in units if self.model.total(u) and not self.model.tiled(u)]

    def _saving(self, unit) -> int:
        return self.model.saving(unit, self.placement.saved())

    def place_singles(self) -> list[str]:
        """Every other needed tag alone (or with the tags it only pays together with), by value (recompute FLOPs
        saved per byte, a lazy greedy: values only fall as more is kept). Returns the tags whose saving alone is
        zero, in the order they came up."""
        total = self.model.total
        units = self.units()
        # ties: the unit that came up first (a group's first layer's after every tag)
        heap = [(-self._saving(u) / total(u), min(self.order.get(t, len(self.order) + n) for t in u), u)
                for n, u in enumerate(units)]
        heapq.heapify(heap)
        alone_useless: list[str] = []
        while heap:
            _, i, unit = heapq.heappop(heap)
            value = self._saving(unit)
            if heap and -value / total(unit) > heap[0][0] + 1e-12:  # stale: its value fell below the next one's
                heapq.heappush(heap, (-value / total(unit), i, unit))
            elif value <= 0 and split_name(unit[0])[1]:
                continue   # a group's first layer's, where every layer keeps the tags: nothing to decide
            elif value <= 0:
                alone_useless.extend(unit)
                self._decide(Decision(unit, "useless", value=value))
            else:
                self.place(unit, value, how="together" if len(unit) > 1 else "")
        return alone_useless

    def place_pairs(self, alone_useless: list[str]) -> None:
        """Tags that only pay off together, in pairs, by value (ties: the pair that came up first)."""
        alone_useless = list(alone_useless)
        while len(alone_useless) > 1:
            pairs = [(self._saving(pair), pair) for pair in itertools.combinations(alone_useless, 2)]
            pairs = [(v / self.model.total(pair), v, pair) for v, pair in pairs if v > 0]
            if not pairs:
                break
            _, value, pair = max(pairs, key=lambda p: (p[0], -self.order[p[2][0]], -self.order[p[2][1]]))
            self.place(pair, value, how="pair")
            for t in pair:
                alone_useless.remove(t)
