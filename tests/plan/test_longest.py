"""`zoo.plan.longest_seq` (and `python -m recipes.train.plan --max-seq`): the longest power-of-two sequence whose
step fits, decided by the compiled peak where it compiles; the walk stops at `max_seq_len`; a budget the model state
alone is over, or a host budget the state kept on the host is over, is refused before anything is planned."""
from __future__ import annotations

import dataclasses

import pytest

import zoo
from zoo.plan import Hardware, Training

GiB = 1 << 30
TINY = zoo.models.LlamaConfig.preset("tiny", num_layers=1)


@pytest.mark.slow   # four compiles of the tiny step; the walk itself is checked on estimates below
def test_the_longest_is_the_longest_length_whose_compiled_peak_fits():
    """A budget between the compiled peaks at 1,024 and 2,048 positions: the answer is 1,024, from compiles (walked
    down from where the estimates ended: on the CPU they leave out the XLA kernel's [S, S] temporaries)."""
    full = zoo.Recipe.full()
    peaks = {s: zoo.plan.plan(TINY, full, batch=1, seq=s, peak="compile").peak_bytes for s in (1024, 2048)}
    assert peaks[1024] < peaks[2048]
    budget = (peaks[1024] + peaks[2048]) / 2 / GiB
    found = zoo.plan.longest_seq(TINY, full, hardware=Hardware(hbm_gib=budget), peak="compile", cap=8192)
    assert found.seq == 1024 and found.capped is None
    compiled = {t.seq: t.fits for t in found.tried if t.peak_source.startswith("compiled")}
    assert compiled[1024] and not compiled[2048] and not any(fits for s, fits in compiled.items() if s > 1024)
    assert "longest sequence that fits: 1024" in found.render()


def test_the_walk_goes_up_while_lengths_fit_and_stops_at_the_budget():
    """On estimates: every length up to the answer fits, the next does not, and the answer is the longest."""
    probe = zoo.plan.plan(TINY, zoo.Recipe.full(), batch=1, seq=4096, peak="estimate").peak_bytes
    found = zoo.plan.longest_seq(TINY, zoo.Recipe.full(), hardware=Hardware(hbm_gib=probe / GiB), peak="estimate",
                                 cap=16384)
    fits = {t.seq: t.fits for t in found.tried}
    assert found.seq == 4096 and fits[4096] and not fits[8192] and all(fits[s] for s in (1024, 2048))


def test_the_walk_stops_at_the_configs_context():
    capped = dataclasses.replace(TINY, max_seq_len=2048)
    found = zoo.plan.longest_seq(capped, zoo.Recipe.full(), hardware=Hardware(hbm_gib=1000), peak="estimate")
    assert found.seq == 2048 and found.capped == "max_seq_len"
    assert "raise it to plan longer" in found.render()


def test_budgets_the_state_alone_is_over_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="the model state alone takes .* over the budget .*no sequence fits"):
        zoo.plan.longest_seq(TINY, zoo.Recipe.full(), hardware=Hardware(hbm_gib=1e-6), peak="estimate")
    monkeypatch.setenv(zoo.plan.POOL_ENV, "0")
    with pytest.raises(ValueError, match="pinned host memory takes .* over the host budget .*XLA_PJRT_GPU_HOST_MEMORY"):
        zoo.plan.longest_seq(TINY, zoo.Recipe.full(), hardware=Hardware(hbm_gib=1000), peak="estimate",
                             training=Training(opt_state="host"))


@pytest.mark.slow   # compiles the tiny step at 16,384 positions for the CPU
def test_an_estimated_answer_warns_where_the_device_present_would_not_fit_it():
    """On the CPU, `peak="auto"` answers from estimates, which model a GPU's kernels; where the step compiled for the
    CPU at the answer is over the budget, the answer says so and how to ask for the CPU's own (`peak='compile'`)."""
    r = zoo.Recipe("long", device=("attention_out", "context"), offload=("decoder_layer_input",), seq_tiles=16,
                   group=2)
    found = zoo.plan.longest_seq(dataclasses.replace(TINY, num_layers=2), r, hardware=Hardware(hbm_gib=0.25),
                                 cap=16384)
    assert found.seq == 16384 and len(found.warnings) == 1
    assert "estimated for a GPU's kernels" in found.warnings[0] and "peak='compile'" in found.warnings[0]
    assert found.render().splitlines()[-1] == "warning: " + found.warnings[0]


@pytest.mark.parametrize("budget_gib, compiled", [(4.5, [4096]), (6.0, [4096, 8192])])
def test_the_compiled_walk_compiles_no_length_whose_estimate_is_far_over_the_budget(monkeypatch, budget_gib, compiled):
    """The compiled walk starts where the estimates ended and goes up while lengths fit; a length whose estimate is
    over a budget by half again (`HOPELESS`) is answered "no" from its estimate, not compiled. Peaks here are
    1 GiB per 1,024 positions estimated, 0.9 compiled: a budget of 4.5 GiB leaves 8,192 (8 GiB estimated) hopeless,
    one of 6 GiB compiles it and finds it over."""
    from types import SimpleNamespace

    from zoo.plan import longest

    calls = []

    def fake_plan(cfg, recipe, *, seq, peak, **_):
        if peak is not None and peak != "estimate":
            calls.append(seq)
        scale = 1.0 if peak in ("estimate", None) else 0.9
        return SimpleNamespace(peak_bytes=int(scale * seq / 1024 * GiB), host_total=0, recipe="full",
                               peak_source="estimate" if peak in ("estimate", None) else "compiled for cpu",
                               state=SimpleNamespace(total=0, host=0))

    monkeypatch.setattr(longest, "plan", fake_plan)
    found = longest.longest_seq(TINY, zoo.Recipe.full(), hardware=Hardware(hbm_gib=budget_gib), peak="compile",
                                cap=16384)
    assert found.seq == 4096 and calls == compiled
    assert {t.seq: t.fits for t in found.tried}[8192] is False


def test_auto_compiled_over_the_budget_is_planned_again_for_a_lower_one(monkeypatch):
    """"auto" at a length whose compiled step is over the HBM budget is planned again for a lower budget (as a run fits
    its step, `zoo.plan.fit`): the limit less what the compile added to the planner's estimate and half a GiB, where
    that is below the budget less the excess. Here a step planned for the whole budget of 6 GiB compiles 3 GiB over
    its estimate of 1 GiB per 1,024 positions, one planned for less only 1 GiB over. So 4,096 fits on its second plan
    (for 2.5 GiB: 6 - 3 - 0.5; the excess alone would give 4.5), and 8,192 on none; a recipe given is compiled once
    per length. Each plan again keeps the loss chunk the first compile of its length chose (the planner's own choice
    for the loss chunk "auto" here: seq / 8), as a run does: a shorter chunk would lower the estimate, not the
    compiled peak."""
    from types import SimpleNamespace

    from zoo.plan import longest

    compiled, chunks = [], []

    def fake_plan(cfg, recipe, *, seq, peak, hardware, training, **_):
        estimate = peak in ("estimate", None)
        peak_gib = seq / 1024 + (0 if estimate else 3 if hardware.hbm_gib >= 6 else 1)
        chunk = seq // 8 if training.loss_chunk == "auto" else training.loss_chunk
        if not estimate:
            compiled.append((seq, hardware.hbm_gib))
            chunks.append((seq, training.loss_chunk))
        return SimpleNamespace(peak_bytes=int(peak_gib * GiB), host_total=0, recipe=str(recipe),
                               peak_source="estimate" if estimate else "compiled for cpu", loss_chunk=chunk,
                               state=SimpleNamespace(total=0, host=0))

    monkeypatch.setattr(longest, "plan", fake_plan)
    found = longest.longest_seq(TINY, "auto", hardware=Hardware(hbm_gib=6.0), peak="compile", cap=16384,
                                training=zoo.plan.Training(loss_chunk="auto"))
    assert found.seq == 4096
    assert compiled[:2] == [(4096, 6.0), (4096, 2.5)] and [s for s, _ in compiled[2:]] == [8192, 8192]
    assert chunks == [(4096, "auto"), (4096, 512), (8192, "auto"), (8192, 1024)]
    assert "    4096     5.0 GiB" in found.render()   # the length's row is the plan that fits
    compiled.clear()
    given = longest.longest_seq(TINY, zoo.Recipe.full(), hardware=Hardware(hbm_gib=6.0), peak="compile", cap=16384)
    assert given.seq == 2048 and compiled == [(4096, 6.0), (2048, 6.0)]
