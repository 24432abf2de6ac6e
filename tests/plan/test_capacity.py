"""Capacity: `zoo.plan.largest_batch`, the largest power-of-two batch whose planned peak HBM fits a budget.
Estimate mode (the CPU's default) except one compiled walk. (`python -m recipes.train.plan --max-batch`:
tests/train/test_plan_cli.py.)"""
import pytest

import zoo
from recipes.deepseek_v3 import RECIPES as DS_RECIPES
from recipes.llama3 import RECIPES as LLAMA_RECIPES
from zoo.models import registry
from zoo.plan import Hardware, Training

GiB = 1 << 30
LLAMA = registry.family("llama3").config("tiny")
DEEPSEEK = registry.family("deepseek_v3").config("tiny")
SEQ = 64
SGD = Training(optimizer="sgd")


def peak(cfg, recipe, batch, seq=SEQ, peak_mode="estimate"):
    return zoo.plan.plan(cfg, recipe, batch=batch, seq=seq, peak=peak_mode,
                         training=Training(optimizer="sgd")).peak_bytes


def test_the_largest_batch_fits_and_the_next_power_of_two_does_not():
    """The budget sits between the planned peaks of batches 4 and 8: the answer is 4, its peak (by an independent
    zoo.plan call) is within the budget, 8's is over it, and the walk stopped at 8."""
    recipe = LLAMA_RECIPES["full"]
    p4, p8 = peak(LLAMA, recipe, 4), peak(LLAMA, recipe, 8)
    assert p4 < p8
    budget = (p4 + p8) / 2 / GiB
    c = zoo.plan.largest_batch(LLAMA, recipe, seq=SEQ, hardware=Hardware(hbm_gib=budget), training=SGD)
    assert c.batch == 4 and not c.capped
    assert c.peaks[4] == p4 <= c.budget_bytes < c.peaks[8] == p8
    assert [t.batch for t in c.tried] == [1, 2, 4, 8] and [t.fits for t in c.tried] == [True, True, True, False]
    assert c.peak_bytes == p4 and c.budget_source == "hbm_gib"
    assert all(t.peak_source.startswith("estimate") for t in c.tried)
    assert "largest batch that fits: 4" in c.render()


@pytest.mark.slow   # a property of the walk the other tests check at one budget
def test_a_bigger_budget_never_gives_a_smaller_batch():
    recipe = LLAMA_RECIPES["save_qkv"]
    peaks = [peak(LLAMA, recipe, b) for b in (1, 2, 4, 8, 16)]
    budgets = [peaks[0] * 0.5] + [p * 1.001 for p in peaks]
    found = [zoo.plan.largest_batch(LLAMA, recipe, seq=SEQ, hardware=Hardware(hbm_gib=b / GiB), training=SGD,
                                    cap=16).batch for b in budgets]
    assert found == sorted(found)
    assert found == [0, 1, 2, 4, 8, 16]   # each budget just over a batch's peak admits exactly that batch


@pytest.mark.slow   # likewise
def test_the_walk_from_a_start_gives_the_same_answer_up_or_down():
    recipe = LLAMA_RECIPES["full"]
    budget = peak(LLAMA, recipe, 4) * 1.001 / GiB
    base = zoo.plan.largest_batch(LLAMA, recipe, seq=SEQ, hardware=Hardware(hbm_gib=budget), training=SGD)
    up = zoo.plan.largest_batch(LLAMA, recipe, seq=SEQ, hardware=Hardware(hbm_gib=budget), training=SGD, start=2)
    down = zoo.plan.largest_batch(LLAMA, recipe, seq=SEQ, hardware=Hardware(hbm_gib=budget), training=SGD, start=16)
    assert base.batch == up.batch == down.batch == 4
    assert [t.batch for t in up.tried] == [2, 4, 8]
    assert [t.batch for t in down.tried] == [16, 8, 4]
    assert zoo.plan.largest_batch(LLAMA, recipe, seq=SEQ, hardware=Hardware(hbm_gib=budget), training=SGD,
                                  batches=(3, 5)).batch == 3


@pytest.mark.slow   # a case of the walk the other capacity tests check
def test_offloading_fits_more_than_its_save_on_device_twin():
    """The study's capacity claim, in the planner: with the budget at the offload recipe's peak at batch 4, the
    save-on-device twin (same tags kept in HBM) fits a smaller batch."""
    off, twin = DS_RECIPES["mla_moe_offload"], DS_RECIPES["save_mla_moe"]
    assert peak(DEEPSEEK, twin, 4) > peak(DEEPSEEK, off, 4)   # the premise: saving the tags costs HBM here
    budget = peak(DEEPSEEK, off, 4) / GiB
    c_off = zoo.plan.largest_batch(DEEPSEEK, off, seq=SEQ, hardware=Hardware(hbm_gib=budget), training=SGD)
    c_twin = zoo.plan.largest_batch(DEEPSEEK, twin, seq=SEQ, hardware=Hardware(hbm_gib=budget), training=SGD)
    assert c_off.batch == 4
    assert 0 < c_twin.batch < c_off.batch
    for more in (1.5 * budget, 3 * budget):  # and never fewer, whatever the budget
        roomier = Hardware(hbm_gib=more)
        assert (zoo.plan.largest_batch(DEEPSEEK, off, seq=SEQ, hardware=roomier, training=SGD).batch
                >= zoo.plan.largest_batch(DEEPSEEK, twin, seq=SEQ, hardware=roomier, training=SGD).batch)


@pytest.mark.parametrize("kwargs, match", [
    (dict(hbm_gib=0), "hbm_gib must be a positive number"),
    (dict(hbm_gib=-1.0), "hbm_gib must be a positive number"),
    (dict(hbm_gib=1.0, seq=0), "seq must be a positive int"),
    (dict(hbm_gib=1.0, start=3), "start=3 is not a batch to try"),
    (dict(hbm_gib=1.0, peak="none"), "peak='none'"),
    (dict(hbm_gib=1.0, batches=()), "batches is empty"),
    (dict(hbm_gib=1.0, batches=(2, 0)), "every entry of batches must be a positive int"),
    (dict(), "hbm_gib is needed: the device present"),                 # the CPU has no allocator limit
    (dict(device_kind="NVIDIA H200"), "hbm_gib is needed: planning for 'NVIDIA H200'"),
])
def test_bad_input_is_a_clear_value_error(kwargs, match):
    hardware = {k: kwargs.pop(k) for k in ("hbm_gib", "device_kind") if k in kwargs}
    kwargs = {"seq": SEQ, **kwargs}
    with pytest.raises(ValueError, match=match):
        zoo.plan.largest_batch(LLAMA, LLAMA_RECIPES["full"], hardware=Hardware(**hardware), **kwargs)


def test_a_recipe_the_model_cannot_take_is_a_value_error():
    with pytest.raises(ValueError, match="recipe must be a zoo.Recipe"):
        zoo.plan.largest_batch(LLAMA, "auto", seq=SEQ, hardware=Hardware(hbm_gib=1.0))
    with pytest.raises(ValueError, match="mla_q"):  # a DeepSeek tag on a Llama: zoo.plan's own refusal
        zoo.plan.largest_batch(LLAMA, DS_RECIPES["lowrank_offload"], seq=SEQ, hardware=Hardware(hbm_gib=1.0))
    with pytest.raises(ValueError, match="not_a_tag"):
        zoo.plan.largest_batch(LLAMA, zoo.Recipe("typo", offload=("not_a_tag",)), seq=SEQ,
                               hardware=Hardware(hbm_gib=1.0))


def test_the_compiled_walk_runs_on_the_cpu():
    """peak="compile" compiles the main job's step for the CPU at each batch tried."""
    c = zoo.plan.largest_batch(LLAMA, LLAMA_RECIPES["full"], seq=16, hardware=Hardware(hbm_gib=64.0), training=SGD,
                               peak="compile", batches=(1, 2))
    assert c.batch == 2 and c.capped
    assert all(t.peak_source == "compiled for cpu" for t in c.tried)
    assert 0 < c.peaks[1] < c.peaks[2]
    assert c.peaks[2] == peak(LLAMA, LLAMA_RECIPES["full"], 2, seq=16, peak_mode="compile")
