"""Fitting a step to its device (`fit`): the recipe and the loss's chunks a run compiles through its `compile(recipe,
loss_chunk)`, decided from compiled peaks. Recipe "auto" is planned again with its budget lowered (`lowered`: by the
excess, or by what the compile added to the planner's estimate) while its peak is over `limit` (`ATTEMPTS` at most);
loss chunk "auto" is the whole sequence where the step fits so, else the longest divisor estimated to fit, compiled
to confirm. A step that still does not fit is returned as it is.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from zoo.plan.build import NO_HARDWARE, ONE_DEVICE, plan
from zoo.plan.inputs import Hardware, Parallelism, Training
from zoo.plan.peak import chunk_to_fit, from_compiled
from zoo.plan.types import GiB, ceil_div, fmt_bytes
from zoo.recipe import Recipe
from zoo.training import STEP

ATTEMPTS = 3
MARGIN = GiB // 2   # taken off a lowered budget beyond the excess, for the allocator's slack


def lowered(budget_gib: float | None, peak: int, limit: int, estimated: int | None = None) -> float | None:
    """The HBM budget to plan "auto" for again after its step compiled over the device's limit: the budget less the
    excess, or, where the planner's estimate of that step is known and lower, the limit less what the compile
    added to the estimate (a structure estimated within that budget compiles within the limit if the estimate errs
    as much), whichever is lower, less `MARGIN` either way.

    Args:
        budget_gib: the budget (GiB) the step was planned for; None: none given.
        peak: the compiled step's peak, in bytes.
        limit: the device memory the step must fit, in bytes.
        estimated: the planner's estimate of the compiled step's peak, in bytes (None: not known).

    Returns:
        the lowered budget, in GiB; None where there is no budget or nothing would be left.
    """
    if budget_gib is None:
        return None
    out = budget_gib - (peak - limit + MARGIN) / GiB
    if estimated is not None:
        out = min(out, (limit - (peak - estimated) - MARGIN) / GiB)
    return out if out > 0 else None


@dataclasses.dataclass(frozen=True)
class Fitted:
    """What `fit` compiled: the recipe, the loss's chunk length (None: unchunked), what `compile` returned, and one
    line per decision taken on the way; `peak_bytes` is the compiled step's peak.

    Args:
        recipe: the recipe compiled (the one planned where `fit` was asked for "auto").
        loss_chunk: the loss's chunk length compiled (None: the whole sequence).
        compiled: what `compile(recipe, loss_chunk)` returned, its compiled step first.
        notes: one line per decision taken on the way (empty where the first compile fit).

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import zoo
        >>> compiled = jax.jit(jnp.sin).lower(jnp.ones(1024)).compile()
        >>> fitted = zoo.plan.Fitted(zoo.Recipe.none(), None, (compiled,), ())
        >>> fitted.peak_bytes > 0
        True
    """
    recipe: Recipe
    loss_chunk: int | None
    compiled: Any
    notes: tuple[str, ...]

    @property
    def peak_bytes(self) -> int:
        return from_compiled(self.compiled[0]).bytes


def fit(cfg, recipe: Recipe | str, *, batch: int, seq: int, compile: Callable[[Recipe, int | None], tuple],
        limit: int | None, hardware: Hardware = NO_HARDWARE, training: Training = STEP,
        parallel: Parallelism = ONE_DEVICE) -> Fitted:
    """Compile the step of `recipe` (a Recipe, or "auto") under `training` and fit it to `limit` bytes of device
    memory (None: no limit known): see the module docstring.

    Args:
        cfg: the model's config (an `LMConfig`).
        recipe: a `zoo.Recipe`, or "auto": planned for `hardware`, and again for a lower budget while over `limit`.
        batch: the global batch, in sequences.
        seq: the sequence length.
        compile: compile(recipe, loss_chunk) -> a tuple whose first item is the compiled step (e.g.
            `zoo.train_step.compile_abstract`'s).
        limit: the device memory the step must fit, in bytes (None: no limit known: the first compile is kept).
        hardware: the device the "auto" recipe is planned for (`zoo.plan.Hardware`; its `hbm_gib`: the first
            budget).
        training: the step (`zoo.plan.Training`); its `loss_chunk` "auto": the chunk is chosen here.
        parallel: how the step is spread over devices (`zoo.plan.Parallelism`).

    Returns:
        the `Fitted`: the recipe and loss chunk compiled, what `compile` returned and the decisions taken.

    Examples:
        >>> import dataclasses
        >>> import zoo
        >>> from zoo.models.registry import family
        >>> from zoo.train_step import compile_abstract
        >>> cfg = zoo.models.LlamaConfig.preset("tiny")
        >>> training = zoo.plan.Training(optimizer="sgd", loss_chunk=None)
        >>> def compile(recipe, chunk):
        ...     return compile_abstract(family("llama3"), cfg, recipe, batch=2, seq=8,
        ...                             training=dataclasses.replace(training, loss_chunk=chunk))
        >>> fitted = zoo.plan.fit(cfg, zoo.Recipe.none(), batch=2, seq=8, compile=compile, limit=1 << 30,
        ...                       training=training)
        >>> fitted.loss_chunk, fitted.notes, fitted.peak_bytes <= 1 << 30
        (None, (), True)
    """
    auto_recipe = isinstance(recipe, str) and recipe == "auto"
    auto_loss = isinstance(training.loss_chunk, str) and training.loss_chunk == "auto"
    shard = max(1, parallel.shard)
    rows = ceil_div(batch // training.grad_accum, shard)
    budget, notes = hardware.hbm_gib, []
    chunk = None if auto_loss else training.loss_chunk
    if auto_loss and limit is not None:
        # the whole sequence where the planner expects the step to fit that way, else the fewest chunks it expects
        # to fit beside what the whole sequence's plan keeps
        first = plan(cfg, recipe, batch=batch, seq=seq, hardware=hardware, parallel=parallel,
                     training=dataclasses.replace(training, loss_chunk=None), peak="estimate")
        if first.peak_bytes > limit:
            chunk = chunk_to_fit(cfg, peak=first.peak_bytes, limit=limit, chunk=None, rows=rows, seq=seq, shard=shard)
    for attempt in range(2 * ATTEMPTS):
        r, estimated = recipe, None
        if auto_recipe:
            chosen = plan(cfg, "auto", batch=batch, seq=seq, hardware=dataclasses.replace(hardware, hbm_gib=budget),
                          parallel=parallel, training=dataclasses.replace(training, loss_chunk=chunk),
                          peak="estimate")
            r, estimated = chosen.recipe, chosen.peak_bytes
        out = compile(r, chunk)
        peak = from_compiled(out[0]).bytes
        if limit is None or peak <= limit:
            return Fitted(r, chunk, out, tuple(notes))
        over = f"compiles to a peak of {fmt_bytes(peak)}, over {fmt_bytes(limit)}"
        if auto_recipe and attempt < ATTEMPTS - 1:
            less = lowered(budget, peak, limit, estimated)
            if less is not None:
                notes.append(f"auto: the step chosen for {budget:.1f} GiB {over}: planning again for {less:.1f} GiB")
                budget = less
                continue
        if auto_loss:
            shorter = chunk_to_fit(cfg, peak=peak, limit=limit, chunk=chunk, rows=rows, seq=seq, shard=shard)
            if shorter != chunk:
                notes.append(f"loss chunks auto: the step with "
                             f"{'the whole sequence' if chunk is None else f'chunks of {chunk}'} {over}: chunks of "
                             f"{shorter} positions")
                chunk = shorter
                continue
        return Fitted(r, chunk, out, tuple(notes))
    return Fitted(r, chunk, out, tuple(notes))
