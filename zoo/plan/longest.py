"""The longest sequence (a power of two) whose training step fits an HBM budget and a host budget.

    l = zoo.plan.longest_seq(cfg, "auto", batch=1, hardware=Hardware(hbm_gib=133, tflops=760),
                             training=Training(opt_state="host", params="host", opt_dtype="bfloat16"))
    l.seq, l.tried   # the longest that fits (0: none does); each length planned, its peak, host bytes and recipe

Each length is one `zoo.plan.plan` (a recipe, or "auto" per length); a compiled walk starts at the estimates' answer,
compiles no length whose estimate is over a budget by half again (`HOPELESS`), and stops at the config's
`max_seq_len`. Where "auto"'s step at a length compiles over the HBM budget, that length is planned again for a lower
budget (`zoo.plan.fitting.lowered`), as a run fits its step (`zoo.plan.fit`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from zoo.plan.build import NO_HARDWARE, plan
from zoo.plan.capacity import budget
from zoo.plan.fitting import ATTEMPTS, lowered
from zoo.plan.inputs import Hardware, Training, check_positive
from zoo.plan.state import host_budget, host_pool_bytes, machine_ram_bytes
from zoo.plan.target import device_target
from zoo.plan.types import POOL_ENV, fmt_bytes
from zoo.recipe import Recipe
from zoo.training import STEP

DEFAULT_SEQ_CAP = 1 << 20
FIRST = 1024   # the shortest sequence a walk tries
# A length whose estimate is this far over a budget is not compiled: it cannot fit (estimates fall within a few
# percent of compiled peaks on the GPU, and below them on the CPU), and XLA can spend many minutes trying to fit it.
HOPELESS = 1.5


@dataclasses.dataclass(frozen=True)
class TriedSeq:
    """One length planned: its peak, its pinned host bytes, the recipe planned, where the peak comes from, and
    whether both fit."""
    seq: int
    peak_bytes: int
    host_bytes: int
    recipe: str
    peak_source: str
    fits: bool


@dataclasses.dataclass(frozen=True)
class Longest:
    """The longest sequence that fits, and how it was found (`longest_seq`); `render()` writes it as text,
    `to_dict()` as a dict.

    Args:
        seq: the longest length tried that fits (0: none of those tried).
        batch: the batch planned, in sequences.
        hbm_budget: the HBM budget, in bytes.
        hbm_source: where the HBM budget comes from ("hbm_gib", or the present device's "bytes_limit").
        host_budget: the pinned host memory budget, in bytes.
        tried: each length planned (`TriedSeq`), in the order planned.
        capped: why longer was not tried: "cap" or "max_seq_len" (None: a longer one did not fit).
        warnings: what the answer assumes that the device present does not bear out (empty where nothing).

    Examples:
        >>> import zoo
        >>> cfg = zoo.models.LlamaConfig.preset("tiny")
        >>> found = zoo.plan.longest_seq(cfg, zoo.Recipe.none(), hardware=zoo.plan.Hardware(hbm_gib=1),
        ...                              peak="estimate", cap=4096)
        >>> print(found.render().splitlines()[0])
        longest sequence that fits: 4096 (the longest tried: may fit longer) ...
    """
    seq: int                     # the longest tried that fits (0: none of those tried)
    batch: int
    hbm_budget: int
    hbm_source: str
    host_budget: int
    tried: tuple[TriedSeq, ...]  # in the order planned
    capped: str | None           # why longer was not tried: "cap" or "max_seq_len" (None: a longer one did not fit)
    warnings: tuple[str, ...] = ()   # what the answer assumes that the device present does not bear out

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def render(self) -> str:
        """A few lines of text: the answer, then each length planned."""
        more = {"cap": " (the longest tried: may fit longer)",
                "max_seq_len": " (the config's max_seq_len: raise it to plan longer)"}.get(self.capped, "")
        head = (f"longest sequence that fits: {self.seq}{more}  (batch {self.batch}, HBM budget "
                f"{fmt_bytes(self.hbm_budget)}: {self.hbm_source}; host budget {fmt_bytes(self.host_budget)})")
        rows = [f"  {'seq':>8}  {'peak':>10}  {'host':>10}  fits  recipe; source"]
        best = {}
        for t in self.tried:   # a compiled figure replaces the estimate of the same length, one that fits the others
            old = best.get(t.seq)
            if old is None or "estimate" in old.peak_source or (t.fits and not old.fits):
                best[t.seq] = t
        rows += [f"  {t.seq:>8}  {fmt_bytes(t.peak_bytes):>10}  {fmt_bytes(t.host_bytes):>10}  "
                 f"{'yes' if t.fits else 'no ':3}   {t.recipe}; {t.peak_source}" for _, t in sorted(best.items())]
        return "\n".join([head, *rows, *(f"warning: {w}" for w in self.warnings)])


def longest_seq(cfg, recipe: Recipe | str, *, batch: int = 1, hardware: Hardware = NO_HARDWARE,
                training: Training = STEP, peak: str = "auto", start: int | None = None,
                cap: int = DEFAULT_SEQ_CAP, progress: Callable[[TriedSeq], None] | None = None) -> Longest:
    """The longest power-of-two sequence (from `FIRST` up to `cap` and the config's `max_seq_len`) whose step fits
    the budgets, for `recipe` (a Recipe, or "auto": chosen per length) at `batch`. `peak`: as `zoo.plan.plan`'s
    ("auto": compiled on an accelerator, estimated on the CPU). `start`: the first length planned (default: where
    the estimates' walk ends; then a length whose estimate is over a budget by half again is not compiled).
    ValueError before anything compiles when the model state alone exceeds a budget.

    Args:
        cfg: the model's config (an `LMConfig`).
        recipe: a `zoo.Recipe`, or "auto": planned for each length.
        batch: the batch, in sequences.
        hardware: the device (`zoo.plan.Hardware`): its `hbm_gib` the HBM budget (None: the present device's
            allocator limit); the host budget: the least of XLA's pinned pool, `host_gib` and, planning for an
            accelerator present, this machine's RAM.
        training: the step (`zoo.plan.Training`).
        peak: "auto", "compile" or "estimate", as `zoo.plan.plan`'s.
        start: the first length planned, a power of two from `FIRST` (None: where the estimates' walk ends).
        cap: the longest length tried.
        progress: called with each length's `TriedSeq` as soon as it is planned (a compile of a long step takes a
            minute or more; the command line prints each one as it comes).

    Returns:
        the `Longest`: the longest length that fits, the budgets and each length planned.

    Raises:
        ValueError: a bad argument, or model state alone over a budget (no sequence fits).

    Examples:
        >>> import zoo
        >>> cfg = zoo.models.LlamaConfig.preset("tiny")
        >>> found = zoo.plan.longest_seq(cfg, zoo.Recipe.none(), hardware=zoo.plan.Hardware(hbm_gib=1),
        ...                              peak="estimate", cap=4096)
        >>> found.seq, found.capped, [t.seq for t in found.tried]
        (4096, 'cap', [1024, 2048, 4096])
    """
    check_positive("batch", batch)
    check_positive("cap", cap)
    if peak not in ("auto", "compile", "estimate"):
        raise ValueError(f"peak={peak!r}: choose 'auto', 'compile' or 'estimate' (the longest needs a peak)")
    hbm, hbm_source = budget(hardware.hbm_gib, hardware.device_kind)
    _, here, present = device_target(hardware.device_kind)
    pool, _ = host_pool_bytes()
    host = host_budget(hardware.host_gib, pool, machine_ram_bytes() if here and present.platform != "cpu" else None)
    limit = min(cap, getattr(cfg, "max_seq_len", None) or cap)
    lengths = [s for s in (FIRST << i for i in range(32)) if s <= limit]
    if not lengths:
        raise ValueError(f"no sequence of at least {FIRST} positions is within cap={cap} and max_seq_len="
                         f"{getattr(cfg, 'max_seq_len', None)}")
    _check_state(cfg, recipe, batch, lengths[0], hardware, training, hbm, host)
    hardware = dataclasses.replace(hardware, hbm_gib=hbm / (1 << 30))
    tried: list[TriedSeq] = []

    def hopeless(seq: int) -> bool:
        """Its estimate (planned on the walk) is far over a budget: not worth a compile."""
        return any(t.seq == seq and "estimate" in t.peak_source
                   and (t.peak_bytes > HOPELESS * hbm or t.host_bytes > HOPELESS * host) for t in tried)

    def fits(seq: int, mode: str) -> bool:
        """Whether the step at `seq` fits; "auto" whose compiled step is over the HBM budget is planned again for
        a lower budget (`zoo.plan.fitting.lowered`) with the loss chunk it compiled, as a run fits it
        (`zoo.plan.fit`), `ATTEMPTS` times at most."""
        if mode != "estimate" and hopeless(seq):
            return False
        chosen_for, held = hardware, training
        for _ in range(ATTEMPTS):
            p = plan(cfg, recipe, batch=batch, seq=seq, hardware=chosen_for, training=held, peak=mode)
            ok = p.peak_bytes <= hbm and p.host_total <= host
            tried.append(TriedSeq(seq, int(p.peak_bytes), int(p.host_total), str(p.recipe), p.peak_source, ok))
            if progress is not None:
                progress(tried[-1])
            if ok or recipe != "auto" or "estimate" in p.peak_source or p.host_total > host:
                return ok
            # a run keeps the loss chunk it compiled while it plans "auto" again (`zoo.plan.fit`): a shorter chunk
            # lowers the estimate, not a compiled peak the loss is not part of, so the structure must change
            held = dataclasses.replace(held, loss_chunk=p.loss_chunk)
            estimated = plan(cfg, p.recipe, batch=batch, seq=seq, hardware=chosen_for, training=held,
                             peak="estimate").peak_bytes
            less = lowered(chosen_for.hbm_gib, p.peak_bytes, hbm, estimated)
            if less is None:
                return False
            chosen_for = dataclasses.replace(chosen_for, hbm_gib=less)
        return False

    def walk(i: int, mode: str) -> int:
        """The longest that fits, walking up from lengths[i] while they fit, or down while they do not (-1: none)."""
        if fits(lengths[i], mode):
            while i + 1 < len(lengths) and fits(lengths[i + 1], mode):
                i += 1
            return i
        while i > 0:
            i -= 1
            if fits(lengths[i], mode):
                return i
        return -1

    if start is not None:
        check_positive("start", start)
        if start not in lengths:
            raise ValueError(f"start={start} is not a length to try ({', '.join(map(str, lengths))})")
        first = lengths.index(start)
    else:
        first = 0
    if peak != "estimate" and start is None:   # compiles are slow: start them where the estimates end
        first = max(walk(0, "estimate"), 0)
    best = walk(first, peak)
    found = lengths[best] if best >= 0 else 0
    capped = None
    if best == len(lengths) - 1:
        capped = "max_seq_len" if limit < cap and limit == getattr(cfg, "max_seq_len", None) else "cap"
    warnings = ()
    if found and here and peak == "auto" and any("estimate" in t.peak_source for t in tried if t.seq == found):
        warnings = _check_here(cfg, recipe, batch, found, hardware, training, hbm, present)
    return Longest(seq=found, batch=batch, hbm_budget=hbm, hbm_source=hbm_source, host_budget=host,
                   tried=tuple(tried), capped=capped, warnings=warnings)


def _check_here(cfg, recipe, batch, seq, hardware, training, hbm, present) -> tuple[str, ...]:
    """Where the answer comes from estimates and the device present is the one planned for: its step compiled here at
    the answer, and a warning when that step would not fit (the estimates model a GPU's kernels)."""
    p = plan(cfg, recipe, batch=batch, seq=seq, hardware=hardware, training=training, peak="compile")
    if p.peak_bytes <= hbm:
        return ()
    return (f"the answer is estimated for a GPU's kernels (cuDNN's flash attention, which keeps no [S, S] scores); "
            f"compiled for the device present ({present.device_kind}), the step at {seq} peaks at "
            f"{fmt_bytes(p.peak_bytes)}, over the budget of {fmt_bytes(hbm)}: peak='compile' answers for it",)


def _check_state(cfg, recipe, batch, seq, hardware, training, hbm, host) -> None:
    """ValueError when the model state alone (no activations) is over the HBM or the host budget."""
    probe = recipe if isinstance(recipe, Recipe) else Recipe.full()
    state = plan(cfg, probe, batch=batch, seq=seq, hardware=hardware, training=training, peak=None).state
    if state.total > hbm:
        raise ValueError(f"the model state alone takes {fmt_bytes(state.total)} of HBM (parameters, gradients and "
                         f"what lives on the device), over the budget of {fmt_bytes(hbm)}: no sequence fits. Put "
                         f"the optimizer state or a float32 master on the host (--opt-state host, --params host), "
                         f"or plan for more devices")
    if state.host > host:
        raise ValueError(f"the state kept in pinned host memory takes {fmt_bytes(state.host)}, over the host budget "
                         f"of {fmt_bytes(host)}: no sequence fits. Raise {POOL_ENV} (an integer, GiB) or keep "
                         f"less on the host")
