"""The automatic recipe's cost model: what a placement of one candidate structure's tags costs. Given the layout of a
structure (its sequence tiles, layers per group and what a group's layers keep: the tags' shapes, which the backward
pass needs, their recompute FLOPs) and a placement (which tags are kept in HBM, which offloaded), it gives the bytes
in HBM and on the host and the seconds per step (recompute and exposed copies), and what one more decision would add.
Figures only: `zoo.plan.placer` chooses with them, `zoo.plan.auto` words the choice (docs/internals.md, "The
automatic recipe").
"""
from __future__ import annotations

import dataclasses

from zoo.plan.links import Overlap
from zoo.plan.measure import LayerCost
from zoo.plan.measure import nbytes as sds_nbytes
from zoo.plan.types import CARRY, ceil_div
from zoo.tags import split_name


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a structure's tags are saved: kept in HBM or offloaded to host memory; every other tag is recomputed
    (the scan carry, which cannot be, is in one or the other).

    Args:
        device: the tags kept in HBM, in the order they were placed.
        offload: the units offloaded (a tag, or tags placed together), in the order they were placed: their transfer
            times add up in that order.
    """
    device: tuple[str, ...] = ()
    offload: tuple[tuple[str, ...], ...] = ()

    def offloaded(self) -> tuple[str, ...]:
        """The offloaded tags, in the order they were placed.

        Returns:
            The tags of `offload`'s units, flattened.
        """
        return tuple(t for unit in self.offload for t in unit)

    def saved(self) -> frozenset[str]:
        """The tags the backward pass does not recompute (kept in HBM or offloaded), the scan carry aside.

        Returns:
            The tags as a frozenset.
        """
        return frozenset(self.device + self.offloaded()) - {CARRY}


@dataclasses.dataclass(frozen=True)
class Costs:
    """What a placement costs per device.

    Args:
        hbm: bytes in HBM: the model state and the step's reserve (`CostModel.fixed_hbm`) and the tags kept there.
        host: bytes of the offloaded tags in host memory.
        seconds: seconds per step the placement adds: the recompute it leaves and its exposed copies.
    """
    hbm: int
    host: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class Transfer:
    """What offloading some tags would add to the step, beside the recompute it saves (`CostModel.transfer`).

    Args:
        pays: whether offloading pays: nothing to move, or a transfer that hides under the forward pass (full overlap),
            or one that adds less time than the recompute it saves.
        added: seconds per step the transfers add.
        saved: seconds per step of recompute that saving the tags avoids.
        worst: the stack whose transfer per layer outgrows its forward pass most (None: nothing to move).
        per_layer: seconds of transfer per layer in `worst`, those chosen before included.
        forward: seconds of forward per layer in `worst`.
        link: the host link, bytes per second per direction.
        overlap: the fraction of copy time hidden under compute.
    """
    pays: bool
    added: float
    saved: float
    worst: str | None
    per_layer: float
    forward: float
    link: float
    overlap: Overlap


@dataclasses.dataclass(frozen=True)
class CostModel:
    """The costs of placements of one structure's tags (one `Layout`: its sequence tiles, layers per group and what a
    group's layers keep), per device.

    Args:
        shapes: {stack: its tags' shapes} (the layout's `shapes`).
        needed: {stack: the tags its backward pass needs} (the layout's `needed`).
        costs: {stack: its layer's FLOP counts} (`zoo.plan.measure.LayerCost`).
        shard: devices the batch and the tags are split over.
        link: the host link, bytes per second per direction.
        rate: the FLOP rate recompute is priced at, FLOP/s.
        overlap: the fraction of copy time hidden under compute.
        fixed_hbm: bytes in HBM whatever the placement: the model state and the step's reserve.
        groups: {stack: layers per group} (the scan carry is saved once per group; None: one).
    """
    shapes: dict
    needed: dict
    costs: dict[str, LayerCost]
    shard: int
    link: float
    rate: float
    overlap: Overlap
    fixed_hbm: int = 0
    groups: dict | None = None

    def _group(self, s: str) -> int:
        return self.groups[s] if self.groups else 1

    def _needed(self, name: str, s: str) -> str | None:
        """The tag behind the checkpoint name `name` where stack `s`'s backward pass needs it (a group's first layer's
        name, `zoo.tags.role_name(tag, LEAD)`, only where `s` runs in groups), else None."""
        tag, role = split_name(name)
        needed = tag in self.shapes[s].tags and tag in self.needed[s]
        return tag if needed and (not role or self._group(s) > 1) else None

    def nbytes(self, tags, s: str) -> int:
        """Bytes per layer of stack `s` that saving `tags` takes (those its backward pass needs): the scan carry and a
        group's first layer's tags once per group.

        Args:
            tags: tag names (a group's first layer's as `zoo.tags.role_name(tag, LEAD)`).
            s: a stack's name.

        Returns:
            Bytes per device, each tag rounded up to its share.
        """
        out = 0
        for name in tags:
            tag = self._needed(name, s)
            if tag is not None:
                once = name == CARRY or name != tag   # the carry, or a group's first layer's
                out += ceil_div(sds_nbytes(self.shapes[s].tags[tag]), self.shard * (self._group(s) if once else 1))
        return out

    def total(self, tags) -> int:
        """Bytes per step that saving `tags` takes, over every stack's layers.

        Args:
            tags: tag names.

        Returns:
            Bytes per device.
        """
        return sum(self.shapes[s].num_layers * self.nbytes(tags, s) for s in self.shapes)

    def tiled(self, tags) -> bool:
        """Whether any of `tags` is made inside sequence tiles (then kept in HBM or recomputed, never offloaded).

        Args:
            tags: tag names.

        Returns:
            True if one is.
        """
        return any(split_name(t)[0] in getattr(self.shapes[s], "tiled", ()) for s in self.shapes for t in tags)

    def forward(self, s: str) -> float:
        """Seconds of forward per layer of stack `s` (the window a transfer hides under).

        Args:
            s: a stack's name.

        Returns:
            Seconds per device.
        """
        return self.costs[s].forward_flops / self.shard / self.rate

    def moved(self, placement: Placement) -> dict[str, float]:
        """Seconds of transfer per layer, each way, of a placement's offloaded units.

        Args:
            placement: the placement.

        Returns:
            {stack: seconds per layer}.
        """
        moved = {s: 0.0 for s in self.shapes}
        for unit in placement.offload:
            for s in self.shapes:
                moved[s] += self.nbytes(unit, s) / self.link
        return moved

    def exposed(self, s: str, moved_s: float) -> float:
        """Seconds per layer of stack `s` that `moved_s` seconds of transfer each way add to the step (a store hides
        under the forward pass, a reload under the backward: twice the forward).

        Args:
            s: a stack's name.
            moved_s: seconds of transfer per layer, each way.

        Returns:
            Seconds per layer.
        """
        fwd = self.forward(s)
        return self.overlap.exposed(moved_s, fwd, 2 * fwd)

    def added(self, tags, moved: dict[str, float]) -> float:
        """Seconds per step that offloading `tags` adds beside the transfers `moved` already chosen.

        Args:
            tags: tag names.
            moved: {stack: seconds of transfer per layer already chosen} (`moved`).

        Returns:
            Seconds per step.
        """
        return sum(self.shapes[s].num_layers * (self.exposed(s, moved[s] + self.nbytes(tags, s) / self.link)
                                                - self.exposed(s, moved[s])) for s in self.shapes)

    def saving(self, tags, saved: frozenset[str]) -> int:
        """Recompute FLOPs per step that saving `tags` avoids, beside the tags `saved` already.

        Args:
            tags: tag names.
            saved: the tags already saved (`Placement.saved`).

        Returns:
            FLOPs per device.
        """
        return sum(self.shapes[s].num_layers * ceil_div(self.costs[s].remat_flops(saved)
                                                        - self.costs[s].remat_flops(saved | set(tags)), self.shard)
                   for s in self.shapes if any(self._needed(t, s) for t in tags))

    def transfer(self, tags, value: float, moved: dict[str, float]) -> Transfer:
        """What offloading `tags` adds, weighed against `value` FLOPs of recompute it saves.

        Args:
            tags: tag names.
            value: recompute FLOPs per step that saving them avoids (inf: they cannot be recomputed).
            moved: {stack: seconds of transfer per layer already chosen} (`moved`).

        Returns:
            A `Transfer`.
        """
        extra, saved = self.added(tags, moved), value / self.rate
        worst = max((s for s in self.shapes if self.nbytes(tags, s)),
                    key=lambda s: moved[s] + self.nbytes(tags, s) / self.link - self.forward(s), default=None)
        if worst is None:
            return Transfer(True, extra, saved, None, 0.0, 0.0, self.link, self.overlap)
        full = min(self.overlap.d2h, self.overlap.h2d) >= 1
        return Transfer(extra < saved or (full and extra <= 0), extra, saved, worst,
                        moved[worst] + self.nbytes(tags, worst) / self.link, self.forward(worst), self.link,
                        self.overlap)

    def seconds(self, placement: Placement) -> float:
        """Seconds per step a placement costs: the recompute it leaves and its exposed copies.

        Args:
            placement: the placement.

        Returns:
            Seconds per step.
        """
        saved, moved = placement.saved(), self.moved(placement)
        remat = sum(self.shapes[s].num_layers * ceil_div(self.costs[s].remat_flops(saved), self.shard)
                    for s in self.shapes) / self.rate
        return remat + sum(self.shapes[s].num_layers * self.exposed(s, moved[s]) for s in self.shapes)

    def of(self, placement: Placement) -> Costs:
        """A placement's costs: HBM, host memory, step time.

        Args:
            placement: the placement.

        Returns:
            Its `Costs`.
        """
        return Costs(hbm=self.fixed_hbm + self.total(placement.device),
                     host=sum(self.total(unit) for unit in placement.offload), seconds=self.seconds(placement))
