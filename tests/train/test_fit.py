"""Does the step fit (recipes.train.step.fit, recipes.train.step.prepare): the main job's compiled step is the one the
planner compiles (`zoo.plan.plan(peak="compile")`: XLA's memory analysis of both is equal, field by field); a step over
the budget is refused (exit 2, before a step runs, the plan printed) unless --force, and a budget the model state alone
is over before anything compiles, as the planner refuses it; a step that fits runs."""
import pytest

import zoo
from recipes import train
from recipes.train import loop
from recipes.train.settings import cli
from recipes.train.step import prepare
from tests.helpers import tiered
from zoo.plan import peak as peak_lib

RUN = ["--xla-flags", "none", "--steps", "2", "--batch", "2", "--seq", "16", "--log-every", "1"]


@pytest.mark.parametrize("family", tiered(["llama3", "deepseek_v3"], fast=("llama3",)))
def test_the_planners_compiled_peak_is_the_main_jobs_own_step(family, monkeypatch):
    """zoo.plan.plan(peak="compile") compiles the same step the main job runs: XLA's memory analysis of both is equal,
    field by field, and the peak is arguments + outputs - donated + temporaries."""
    seen = {}
    real = prepare.compile_for_shapes

    def spy(*args, **kwargs):
        seen["compiled"], graphdef, abstract = real(*args, **kwargs)
        return seen["compiled"], graphdef, abstract

    monkeypatch.setattr(prepare, "compile_for_shapes", spy)   # where the main job calls it
    settings = loop.RunConfig(model=family, preset="tiny", steps=1, batch=2, seq=16)
    loop.run(settings)
    job = peak_lib.from_compiled(seen["compiled"])
    fam = zoo.models.registry.family(family)
    recipe = cli.recipe(fam, None)
    planned = zoo.plan.plan(fam.config("tiny"), recipe, batch=2, seq=16, peak="compile")
    assert planned.peak_source == "compiled for cpu" and planned.peak.compiled
    assert planned.peak.detail == job.detail
    d = job.detail
    assert planned.peak_bytes == job.bytes == d["argument"] + d["output"] - d["alias"] + d["temp"]
    # the state is donated: its updated copy aliases the input, and the peak is above the planner's floor
    assert d["alias"] >= planned.state.params and planned.peak_bytes > planned.hbm_bytes


def test_the_main_job_refuses_a_step_over_the_budget_before_running_it(capsys):
    rc = train.main(RUN + ["--hbm-limit", "0.0018"])   # the model state (1.6 MiB) fits, the step's peak does not
    out = capsys.readouterr()
    assert rc == 2
    assert "error: the step needs" in out.err and "over the 1.8 MiB of --hbm-limit" in out.err
    assert "temporaries" in out.err and "--batch (now 2)" in out.err and "--force" in out.err
    assert "step      1" not in out.out and "compiled the step" not in out.out   # nothing ran
    assert "peak HBM of the step, compiled for cpu" in out.out                  # the plan is printed


def test_a_budget_under_the_model_state_is_refused_alike_by_both_commands_before_compiling(capsys):
    """`train --hbm-limit 0.001` and `plan --hbm 0.001`: the model state alone (1.6 MiB) is over the budget, so
    both exit 2 with the same one line (but the budget's flag), before anything is planned or compiled."""
    from recipes.train import plan
    assert train.main(RUN + ["--hbm-limit", "0.001"]) == 2
    out = capsys.readouterr()
    assert "compiling" not in out.out and "peak" not in out.out and out.err.count("\n") == 1, out
    with pytest.raises(SystemExit) as e:
        plan.main(["--preset", "tiny", "--batch", "2", "--seq", "16", "--hbm", "0.001"])
    planned = capsys.readouterr()
    assert e.value.code == 2 and planned.out == "" and planned.err.count("\n") == 1, planned
    assert out.err.startswith("error: the model state alone needs 1.6 MiB of device memory per device (parameters "
                              "417.2 KiB + gradients 417.2 KiB + optimizer state 834.5 KiB), over the 1.0 MiB of "
                              "--hbm-limit: no recipe, batch or sequence length fits it; to fit: a larger --hbm-limit")
    assert planned.err == out.err.replace("--hbm-limit", "--hbm")


def test_force_launches_anyway(capsys):
    rc = train.main(RUN + ["--hbm-limit", "0.001", "--force"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "launching anyway (--force)" in out.out and "step      2" in out.out


def test_a_step_that_fits_is_not_refused(capsys):
    assert train.main(RUN + ["--hbm-limit", "1"]) == 0
    assert "peak device memory" in capsys.readouterr().out


def test_host_bytes_over_the_pool_or_the_ram_are_refused_naming_what_sets_them(monkeypatch):
    """On a GPU (a stand-in: the checks read its platform and memory limit) the offloaded values and the state kept
    on the host are checked against XLA's pinned pool, naming its variable, and against the machine's RAM."""
    from recipes.train.settings import job
    from recipes.train.step import fit
    from tests.helpers import fake_gpu
    from zoo.plan.peak import Peak
    gpu = fake_gpu()
    gpu.memory_stats = lambda: {"bytes_limit": 100 * 2 ** 30}
    peak = Peak(bytes=2 ** 30, source="compiled for NVIDIA H200 (gpu)", compiled=True,
                detail=dict(argument=2 ** 30, output=0, alias=0, temp=0))
    problems, _ = fit.check(peak, host=70 * 2 ** 30, pool=64 * 2 ** 30, device=gpu, budget=job.budget(gpu, None),
                            hbm_limit_gib=None)
    assert len(problems) == 1 and "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB" in problems[0]
    monkeypatch.setattr(fit, "ram_bytes", lambda: (60 * 2 ** 30, 50 * 2 ** 30))
    problems, _ = fit.check(peak, host=70 * 2 ** 30, pool=110 * 2 ** 30, device=gpu, budget=job.budget(gpu, None),
                            hbm_limit_gib=None)
    assert len(problems) == 1 and "over this machine's 60.0 GiB of RAM" in problems[0]
    assert fit.check(peak, host=50 * 2 ** 30, pool=110 * 2 ** 30, device=gpu, budget=job.budget(gpu, None),
                     hbm_limit_gib=None)[0] == []
