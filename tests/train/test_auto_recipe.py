"""`--recipe auto` in the main job (recipes.train.step.fit): the planner's choice for the device, from inputs that say
where they came from (re-planned while the compiled step does not fit: zoo.plan.fitting, tests/plan/test_fitting.py),
and refused with a message naming the flag when an input is missing."""
from __future__ import annotations

import jax
import pytest

import zoo
from recipes import train
from recipes.train import loop
from recipes.train.step import fit
from zoo.models.registry import family
from zoo.plan import links

GiB = 1 << 30
LLAMA = family("llama3")


def test_inputs_say_where_they_come_from_and_name_the_missing_flag():
    cpu = jax.devices()[0]
    ins = fit.inputs(cpu, hbm_gib=2.0, link_gbps=20.0, tflops=3.0)
    assert (ins.hbm_gib, ins.link_gbps, ins.overlap, ins.tflops) == (2.0, 20.0, links.Overlap(0.0, 0.0), 3.0)
    assert "--hbm-limit" in ins.describe() and "--link" in ins.describe() and "--peak-tflops" in ins.describe()
    with pytest.raises(ValueError, match="needs an HBM budget: .* pass --hbm-limit"):
        fit.inputs(cpu, link_gbps=20.0, tflops=3.0)
    with pytest.raises(ValueError, match="needs a host link: none is measured for .*pass --link"):
        fit.inputs(cpu, hbm_gib=2.0, tflops=3.0)
    with pytest.raises(ValueError, match="needs a FLOP rate"):
        fit.inputs(cpu, hbm_gib=2.0, link_gbps=20.0)


def test_a_smaller_budget_keeps_less_in_hbm():
    """The choice follows the budget: with less HBM the planner keeps fewer tags on the device."""
    cfg = LLAMA.config("tiny", num_layers=2)
    roomy = fit.choose(cfg, fit.Inputs(8.0, "t", 10.0, 0.0, "t", 1.0, "t"), batch=8, seq=64)
    tight = fit.choose(cfg, fit.Inputs(0.0025, "t", 10.0, 0.0, "t", 1.0, "t"), batch=8, seq=64)
    assert isinstance(roomy, zoo.Recipe) and set(tight.device) < set(roomy.device)


def test_the_chosen_recipe_in_words_names_what_a_groups_first_layer_keeps():
    pair = ("attention_out", "context")
    r = zoo.Recipe("auto", device=("decoder_layer_input",), group=4, group_keep=pair, lead_offload=pair)
    assert fit.summary(r) == ("keeps [decoder_layer_input] in HBM, offloads [none], the first layer of each group "
                              "offloads [attention_out, context], recomputes every other tag")


def test_the_main_job_trains_with_recipe_auto(capsys):
    rc = train.main(["--recipe", "auto", "--steps", "2", "--batch", "2", "--seq", "16", "--set", "num_layers=1",
                     "--hbm-limit", "1", "--link", "10", "--peak-tflops", "1", "--log-every", "1",
                     "--xla-flags", "none"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "recipe auto for HBM 1.0 GiB (--hbm-limit), link 10 GB/s with overlap 0 (--link), 1 TFLOP/s " \
           "(--peak-tflops): keeps [" in out
    assert "step      2" in out


def test_recipe_auto_without_a_budget_on_the_cpu_is_refused_before_compiling(capsys):
    rc = train.main(["--recipe", "auto", "--steps", "2", "--batch", "2", "--seq", "16", "--link", "10",
                     "--peak-tflops", "1", "--xla-flags", "none"])
    err = capsys.readouterr().err
    assert rc == 2 and "--recipe auto needs an HBM budget" in err and "--hbm-limit" in err
    with pytest.raises(ValueError, match="--overlap must be in"):
        loop.RunConfig(overlap=1.5)


def test_recipe_auto_on_the_cpu_names_every_missing_input_at_once(capsys):
    """Given none of its three inputs on the CPU, the main job's refusal names all three flags in one message,
    before it says it is compiling."""
    rc = train.main(["--recipe", "auto", "--steps", "2", "--batch", "2", "--seq", "16", "--xla-flags", "none"])
    out, err = capsys.readouterr()
    assert rc == 2 and "--recipe auto needs an HBM budget" in err and "compiling" not in out + err
    assert all(flag in err for flag in ("--hbm-limit", "--link", "--peak-tflops")), err
    with pytest.raises(ValueError, match="--hbm-limit GIB; and a host link: .*--link GBPS; and a FLOP rate: .*"
                                         "--peak-tflops TFLOPS"):
        fit.inputs(jax.devices()[0])
