"""`zoo.plan.fit`: the recipe and the loss's chunks a run compiles, decided from compiled peaks. Compiles are stood
in for by fakes whose memory analysis says a chosen peak, so each decision is checked without compiling."""
from __future__ import annotations

import types

import pytest

import zoo
from zoo.plan import fitting
from zoo.plan.peak import chunk_to_fit, loss_bytes

GiB = 1 << 30
LLAMA_8B = zoo.models.LlamaConfig.preset("llama3_1_8b", num_layers=2)


def compiled_at(peak_bytes: int):
    """A stand-in for a compiled step whose memory analysis gives `peak_bytes` at its peak."""
    analysis = types.SimpleNamespace(argument_size_in_bytes=int(peak_bytes), output_size_in_bytes=0,
                                     alias_size_in_bytes=0, temp_size_in_bytes=0)
    return types.SimpleNamespace(memory_analysis=lambda: analysis)


class Compiles:
    """`compile(recipe, chunk)` for `fit`: each call takes the next peak, and the calls are kept."""

    def __init__(self, *peaks):
        self.peaks, self.calls = iter(peaks), []

    def __call__(self, recipe, chunk):
        self.calls.append((recipe, chunk))
        return compiled_at(next(self.peaks)), "graphdef", "state"


def test_a_step_that_fits_is_compiled_once_as_asked():
    compiles = Compiles(1 * GiB)
    fitted = zoo.plan.fit(LLAMA_8B, zoo.Recipe.full(), batch=1, seq=8192, compile=compiles, limit=2 * GiB,
                          training=zoo.plan.Training(loss_chunk=512))
    assert compiles.calls == [(zoo.Recipe.full(), 512)] and fitted.loss_chunk == 512 and fitted.notes == ()
    assert fitted.compiled[1:] == ("graphdef", "state") and fitted.peak_bytes == GiB


def test_the_loss_stays_whole_where_the_step_fits_that_way():
    """--loss-chunk auto: one compile of the unchunked step, which fits, and it runs."""
    compiles = Compiles(10 * GiB)
    fitted = zoo.plan.fit(LLAMA_8B, zoo.Recipe.full(), batch=2, seq=8192, compile=compiles, limit=100 * GiB,
                          training=zoo.plan.Training(loss_chunk="auto"))
    assert compiles.calls == [(zoo.Recipe.full(), None)] and fitted.loss_chunk is None


def test_a_loss_that_does_not_fit_whole_takes_the_fewest_chunks_that_fit():
    """The unchunked step compiles 4 GiB over the limit: the chunk is the longest whose estimated peak (the compiled
    one less the logits it no longer holds) fits, and that step, compiled, runs."""
    whole = loss_bytes(LLAMA_8B, None, 2, 8192, 1)
    limit = 100 * GiB
    compiles = Compiles(limit + 4 * GiB, limit - GiB)
    fitted = zoo.plan.fit(LLAMA_8B, zoo.Recipe.full(), batch=2, seq=8192, compile=compiles, limit=limit,
                          training=zoo.plan.Training(loss_chunk="auto"))
    chunk = fitted.loss_chunk
    assert [c for _, c in compiles.calls] == [None, chunk] and chunk is not None and 8192 % chunk == 0
    assert limit + 4 * GiB - whole + loss_bytes(LLAMA_8B, chunk, 2, 8192, 1) <= limit   # it fits, estimated
    assert limit + 4 * GiB - whole + loss_bytes(LLAMA_8B, 2 * chunk, 2, 8192, 1) > limit  # twice as long does not
    assert "chunks of" in fitted.notes[0] and "over" in fitted.notes[0]


def test_chunk_to_fit_is_the_longest_divisor_that_fits():
    whole = loss_bytes(LLAMA_8B, None, 1, 32768, 1)
    # a peak just over: half the sequence
    assert chunk_to_fit(LLAMA_8B, peak=whole + 1, limit=whole, chunk=None, rows=1, seq=32768) == 16384
    # room for a quarter of the whole sequence's logits beside the rest of the step: the longest chunk under it
    room = whole // 4
    got = chunk_to_fit(LLAMA_8B, peak=whole + 10 * whole, limit=10 * whole + room, chunk=None, rows=1, seq=32768)
    assert loss_bytes(LLAMA_8B, got, 1, 32768, 1) <= room < loss_bytes(LLAMA_8B, 2 * got, 1, 32768, 1)


def test_where_no_chunk_fits_the_loss_takes_the_default_chunk_not_the_shortest():
    """At 262,144 positions a step over its limit by more than its logits: the chunk whose float32 logits take at most
    512 MiB (1,024 positions of Llama 3.1's vocabulary: 256 chunks), not 64 positions (4,096 chunks); asked again
    from there, it stays (shorter chunks would not bring the step under)."""
    seq = 262144
    whole = loss_bytes(LLAMA_8B, None, 1, seq, 1)
    assert chunk_to_fit(LLAMA_8B, peak=3 * whole, limit=whole, chunk=None, rows=1, seq=seq) == 1024
    assert chunk_to_fit(LLAMA_8B, peak=3 * whole, limit=whole, chunk=1024, rows=1, seq=seq) == 1024


def test_an_automatic_recipe_over_the_limit_is_planned_again_with_a_lower_budget(monkeypatch):
    """The first choice, estimated at 9 GiB, compiles to 12 over the limit of 10 (XLA's temporaries): `fit` plans again
    for the limit less what the compile added to the estimate (3 GiB) and a margin, which is lower than the budget less
    the excess (2 GiB), and the second choice, which fits, is the one that runs."""
    budgets, recipes = [], iter([zoo.Recipe("a", device=("query_proj",)), zoo.Recipe.full()])
    real_plan = fitting.plan

    def plan(cfg, recipe, **kw):
        if kw.get("peak") == "estimate" and recipe == "auto":
            budgets.append(kw["hardware"].hbm_gib)
            return types.SimpleNamespace(recipe=next(recipes), peak_bytes=9 * GiB)
        return real_plan(cfg, recipe, **kw)

    monkeypatch.setattr(fitting, "plan", plan)
    compiles = Compiles(12 * GiB, 9.5 * GiB)
    fitted = zoo.plan.fit(LLAMA_8B, "auto", batch=1, seq=1024, compile=compiles, limit=10 * GiB,
                          hardware=zoo.plan.Hardware(hbm_gib=10.0, link_gbps=55, tflops=800),
                          training=zoo.plan.Training(loss_chunk=None))
    assert budgets == [10.0, pytest.approx(10.0 - 3.0 - fitting.MARGIN / GiB)]
    assert fitted.recipe == zoo.Recipe.full() and len(compiles.calls) == 2
    assert len(fitted.notes) == 1 and "compiles to a peak of 12.0 GiB, over 10.0 GiB" in fitted.notes[0]


def test_the_lowered_budget_takes_the_larger_of_the_excess_and_the_estimates_error():
    """Over a limit of 10 GiB by 2 (a budget of 10): 10 - 2 - margin, unless the compile added more than that to the
    planner's estimate of the step (9 GiB: 3 added), then the limit less that; None where nothing is left."""
    margin = fitting.MARGIN / GiB
    assert fitting.lowered(10.0, 12 * GiB, 10 * GiB) == pytest.approx(8.0 - margin)
    assert fitting.lowered(10.0, 12 * GiB, 10 * GiB, estimated=11 * GiB) == pytest.approx(8.0 - margin)
    assert fitting.lowered(10.0, 12 * GiB, 10 * GiB, estimated=9 * GiB) == pytest.approx(7.0 - margin)
    assert fitting.lowered(None, 12 * GiB, 10 * GiB) is None
    assert fitting.lowered(10.0, 30 * GiB, 10 * GiB) is None
