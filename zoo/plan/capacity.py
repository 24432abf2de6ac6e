"""Capacity: the largest batch (a power of two) whose training step fits an HBM budget.

    c = zoo.plan.largest_batch(cfg, recipe, seq=4096, hardware=zoo.plan.Hardware(hbm_gib=104.9))
    c.batch, c.tried   # the largest batch whose peak fits (0: none does); each batch planned, its peak, whether it fits

Each batch is one `zoo.plan.plan`, walked up the powers of two from `start` (down if `start` does not fit): a `start`
near the answer saves compiles (about 30 s a batch for a 4-layer slice of a 671B MoE on an H200).
"""
from __future__ import annotations

import dataclasses

from zoo import renames
from zoo.plan.build import NO_HARDWARE, plan
from zoo.plan.inputs import Hardware, Training, check_positive
from zoo.plan.peak import allocator_limit
from zoo.plan.target import device_target
from zoo.plan.types import GiB, fmt_bytes
from zoo.recipe import Recipe
from zoo.training import STEP

DEFAULT_CAP = 1024


@dataclasses.dataclass(frozen=True)
class Tried:
    """One batch planned: its peak device bytes, where the figure comes from, whether it fits the budget."""
    batch: int
    peak_bytes: int
    peak_source: str
    fits: bool


@dataclasses.dataclass(frozen=True)
class Capacity:
    """The largest batch whose training step fits an HBM budget, the result of `zoo.plan.largest_batch`, and how it
    was found: each batch planned, its peak and whether it fits (`peaks`, `render()`).

    Args:
        recipe: the recipe's name.
        seq: the sequence length.
        batch: the largest batch tried whose peak fits the budget (0: none of those tried).
        budget_bytes: the HBM budget per device, bytes.
        budget_source: where the budget comes from: "hbm_gib" or "<device kind>'s bytes_limit".
        tried: one `Tried` per batch planned, in the order planned: its peak bytes, their source, whether it fits.
        capped: whether the largest candidate fits (then the true largest may be larger).

    Examples:
        >>> import zoo
        >>> from zoo.models import LlamaConfig
        >>> c = zoo.plan.largest_batch(LlamaConfig.preset("tiny"), zoo.Recipe.none(), seq=8, start=4,
        ...                            hardware=zoo.plan.Hardware(hbm_gib=0.004), peak="estimate")
        >>> c.batch, list(c.peaks), c.capped
        (8, [4, 8, 16], False)
    """
    recipe: str
    seq: int
    batch: int
    budget_bytes: int
    budget_source: str
    tried: tuple[Tried, ...]
    capped: bool

    @property
    def peaks(self) -> dict[int, int]:
        """{batch: peak bytes} for every batch planned."""
        return {t.batch: t.peak_bytes for t in self.tried}

    @property
    def peak_bytes(self) -> int | None:
        """The peak of the batch returned (None if none fits)."""
        return self.peaks.get(self.batch)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def render(self) -> str:
        """A few lines of text: the answer, then each batch planned."""
        head = (f"largest batch that fits: {self.batch}" + (" (the largest tried: may fit more)" if self.capped else "")
                + f"  (recipe {self.recipe}, seq {self.seq}, budget {fmt_bytes(self.budget_bytes)}: "
                  f"{self.budget_source})")
        rows = [f"  {'batch':>6}  {'peak':>11}  fits  source"]
        rows += [f"  {t.batch:>6}  {fmt_bytes(t.peak_bytes):>11}  {'yes' if t.fits else 'no ':3}   {t.peak_source}"
                 for t in sorted(self.tried, key=lambda t: t.batch)]
        return "\n".join([head, *rows])


def budget(hbm_gib: float | None, device_kind: str | None) -> tuple[int, str]:
    """(bytes, where from): `hbm_gib`, else the present device's allocator limit when planning for it."""
    if hbm_gib is not None:
        check_positive("hbm_gib", hbm_gib, float)
        return int(hbm_gib * GiB), "hbm_gib"
    kind, same, present = device_target(device_kind)
    if not same:
        raise ValueError(f"hbm_gib is needed: planning for {kind!r}, not the device present "
                         f"({present.device_kind}), so its memory limit is unknown here")
    limit = allocator_limit(present)
    if not limit:
        raise ValueError(f"hbm_gib is needed: the device present ({present.device_kind}, {present.platform}) "
                         f"reports no allocator limit (memory_stats()['bytes_limit'])")
    return int(limit), f"{present.device_kind}'s bytes_limit"


def candidates(cap: int = DEFAULT_CAP, batches=None) -> tuple[int, ...]:
    """The batches a walk may try, ascending: `batches` (positive ints), else the powers of two up to `cap`."""
    if batches is None:
        check_positive("cap", cap)
        return tuple(1 << i for i in range(cap.bit_length()) if 1 << i <= cap)
    batches = tuple(batches)
    if not batches:
        raise ValueError("batches is empty: give at least one batch to try")
    for b in batches:
        check_positive("every entry of batches", b)
    return tuple(sorted(set(batches)))


@renames.keywords(hbm_gib="hardware=zoo.plan.Hardware(hbm_gib=...)",
                  device_kind="hardware=zoo.plan.Hardware(device_kind=...)",
                  optimizer="training=zoo.plan.Training(optimizer=...)",
                  opt_dtype="training=zoo.plan.Training(opt_dtype=...)")
def largest_batch(cfg, recipe: Recipe, *, seq: int, hardware: Hardware = NO_HARDWARE, training: Training = STEP,
                  peak: str = "auto", batches=None, start: int | None = None, cap: int = DEFAULT_CAP) -> Capacity:
    """The largest batch whose training step's planned peak HBM fits the budget: each candidate batch is one
    `zoo.plan.plan` of `recipe` at `seq`, walked up from `start` while the peak fits (down while it does not). A batch
    the model cannot take raises `zoo.plan.plan`'s ValueError.

    Args:
        cfg: the model's config (or a built model).
        recipe: the `zoo.Recipe` (not "auto": it chooses a recipe per batch, so has no single capacity).
        seq: the sequence length.
        hardware: the device (`zoo.plan.Hardware`): its `hbm_gib` is the budget; without it, the allocator limit of
            the device present (`zoo.plan.allocator_limit`), when it is the one planned for.
        training: what the step keeps and how it updates (`zoo.plan.Training`).
        peak: how each peak is found, as `zoo.plan.plan`'s: "auto", "compile" or "estimate".
        batches: the batches to try (positive ints; None: the powers of two up to `cap`).
        start: the candidate planned first (None: the smallest); one near the answer saves compiles.
        cap: the largest power of two tried when `batches` is None.

    Returns:
        the `Capacity`.

    Examples:
        >>> import zoo
        >>> from zoo.models import LlamaConfig
        >>> c = zoo.plan.largest_batch(LlamaConfig.preset("tiny"), zoo.Recipe.none(), seq=8, batches=(1, 2),
        ...                            hardware=zoo.plan.Hardware(hbm_gib=1), peak="estimate")
        >>> c.batch, c.capped, c.budget_source
        (2, True, 'hbm_gib')
    """
    if not isinstance(recipe, Recipe):
        raise ValueError(f"recipe must be a zoo.Recipe, got {recipe!r} (a front end looks names up in the model "
                         f"family's recipes; 'auto' chooses a recipe per batch and has no single capacity)")
    check_positive("seq", seq)
    if peak not in ("auto", "compile", "estimate"):
        raise ValueError(f"peak={peak!r}: choose 'auto', 'compile' or 'estimate' (a capacity needs a peak)")
    limit, source = budget(hardware.hbm_gib, hardware.device_kind)
    order = candidates(cap, batches)
    if start is None:
        i = 0
    else:
        check_positive("start", start)
        if start not in order:
            raise ValueError(f"start={start} is not a batch to try ({', '.join(map(str, order))})")
        i = order.index(start)

    tried: list[Tried] = []

    def fits(b: int) -> bool:
        # the peak at the default loss chunk: the budget is the walk's, not the plan's (no chunk fitted to it)
        p = plan(cfg, recipe, batch=b, seq=seq, hardware=Hardware(device_kind=hardware.device_kind),
                 training=training, peak=peak)
        tried.append(Tried(b, int(p.peak_bytes), p.peak_source, p.peak_bytes <= limit))
        return tried[-1].fits

    best = 0
    if fits(order[i]):
        best = order[i]
        for b in order[i + 1:]:
            if not fits(b):
                break
            best = b
    else:
        for b in reversed(order[:i]):
            if fits(b):
                best = b
                break
    return Capacity(recipe=recipe.name, seq=seq, batch=best, budget_bytes=limit, budget_source=source,
                    tried=tuple(tried), capped=best == order[-1])
