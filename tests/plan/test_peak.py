"""Peak HBM with XLA's temporaries: the planner compiles the main job's own step; the main job refuses a
step that cannot fit (exit 2, before a step runs) unless --force; the per-preset training defaults; the optimizer
state's dtype; `auto`'s link model with and without overlap."""
import jax
import jax.numpy as jnp
import optax
import pytest

import zoo
from recipes import train
from recipes.llama3 import RECIPES as LLAMA_RECIPES
from recipes.train import cli, defaults, loop, prepare
from tests.helpers import tiered
from zoo.optim import make_tx
from zoo.plan import Hardware, Parallelism, links
from zoo.plan import peak as peak_lib

GiB = 1 << 30
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
    cfg = loop.RunConfig(model=family, preset="tiny", steps=1, batch=2, seq=16)
    loop.run(cfg)
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


def test_another_device_is_an_estimate_and_cannot_be_compiled_here():
    cfg, recipe = zoo.models.LlamaConfig.preset("tiny"), LLAMA_RECIPES["qkv_offload"]
    p = zoo.plan.plan(cfg, recipe, batch=2, seq=16, hardware=Hardware(device_kind="H200"))
    assert not p.peak.compiled and p.peak_source.startswith("estimate") and "H200" in p.peak_source
    assert p.peak_bytes > p.hbm_bytes == p.peak.detail["floor"]
    assert p.to_dict()["peak_source"] == p.peak_source
    with pytest.raises(ValueError, match="compiles for the device present"):
        zoo.plan.plan(cfg, recipe, batch=2, seq=16, peak="compile", hardware=Hardware(device_kind="H200"))
    assert zoo.plan.plan(cfg, recipe, batch=2, seq=16, peak=None).peak_bytes is None


def test_the_main_job_refuses_a_step_over_the_budget_before_running_it(capsys):
    rc = train.main(RUN + ["--hbm-limit", "0.001"])
    out = capsys.readouterr()
    assert rc == 2
    assert "error: the step needs" in out.err and "over the 1.0 MiB of --hbm-limit" in out.err
    assert "temporaries" in out.err and "--batch (now 2)" in out.err and "--force" in out.err
    assert "step      1" not in out.out and "compiled the step" not in out.out   # nothing ran
    assert "peak HBM of the step, compiled for cpu" in out.out                  # the plan is printed


def test_force_launches_anyway(capsys):
    rc = train.main(RUN + ["--hbm-limit", "0.001", "--force"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "launching anyway (--force)" in out.out and "step      2" in out.out


def test_a_step_that_fits_is_not_refused(capsys):
    assert train.main(RUN + ["--hbm-limit", "1"]) == 0
    assert "peak device memory" in capsys.readouterr().out


def test_training_defaults_per_preset():
    tiny = loop.RunConfig()
    assert (tiny.peak_lr, tiny.total_warmup) == (3e-3, 6)   # the README's CPU run, unchanged
    assert loop.RunConfig(model="llama3", preset="llama3_1_8b").peak_lr == 3e-4
    assert loop.RunConfig(model="llama3", preset="llama3_1_70b").peak_lr == 1.5e-4
    big = loop.RunConfig(model="llama3", preset="llama3_1_405b", steps=1_200_000)
    assert (big.peak_lr, big.total_warmup) == (8e-5, 8000)   # the Llama 3 paper's 405B run
    assert loop.RunConfig(model="deepseek_v3", preset="deepseek_v3_671b", steps=100).total_warmup == 10
    assert loop.RunConfig(model="deepseek_v3", preset="deepseek_v3_671b", steps=10**6).total_warmup == 2000
    assert loop.RunConfig(model="deepseek_v3", preset="deepseek_v3_671b").peak_lr == 2.2e-4
    assert loop.RunConfig(preset="llama3_1_8b", lr=1e-3, warmup=3).peak_lr == 1e-3   # explicit wins
    assert loop.RunConfig(preset="llama3_1_8b", lr=1e-3, warmup=3).total_warmup == 3
    assert loop.RunConfig(preset="llama3_1_8b").identity()["lr"] == 3e-4
    assert defaults.for_preset("llama3", "some_new_preset").lr == defaults.FULL_SIZE[0]
    # a family's published schedules are its own: a preset of one family is not another's
    assert loop.RunConfig(model="qwen3", preset="qwen3_8b").peak_lr == defaults.FULL_SIZE[0]
    assert defaults.for_preset("deepseek_v3", "tiny").lr == 3e-3
    with pytest.raises(ValueError, match="--opt-dtype"):
        loop.RunConfig(opt_dtype="int8")


@pytest.mark.parametrize("param, moments", [(jnp.bfloat16, "float32"), (jnp.float32, "bfloat16")])
def test_optimizer_state_dtype_is_kept_across_steps(param, moments):
    params = {"w": jnp.ones((4, 3), param)}
    tx = make_tx(optax.constant_schedule(1e-2), opt_dtype=moments)
    state = tx.init(params)
    dtypes = lambda s: {x.dtype for x in jax.tree.leaves(s) if jnp.issubdtype(x.dtype, jnp.floating)}  # noqa: E731
    assert dtypes(state) == {jnp.dtype(moments)}
    grads = {"w": jnp.full((4, 3), 0.5, param)}
    updates, state = jax.jit(tx.update)(grads, state, params)
    assert dtypes(state) == {jnp.dtype(moments)} and optax.apply_updates(params, updates)["w"].dtype == param
    assert float(jnp.abs(updates["w"]).max()) > 0


STUDY_405B = dict(batch=256, seq=8192, parallel=Parallelism(shard=128))


def test_auto_offloads_only_what_pays_when_copies_do_not_overlap():
    """With overlap 1 (copies hidden under compute) the 405B's q, k, v are offloaded at 55 GB/s; with overlap 0
    (XLA on the H200: copies serialised on the compute stream) each would add its link time to the step, far more
    than recomputing it, so they are recomputed, and the reasons say so."""
    cfg = zoo.models.LlamaConfig.preset("llama3_1_405b")
    budget = zoo.plan.plan(cfg, zoo.Recipe.full(), peak=None, **STUDY_405B).hbm_bytes / GiB + 0.25
    kw = dict(link_gbps=55, tflops=800, hbm_gib=budget)
    hidden = zoo.plan.plan(cfg, "auto", hardware=Hardware(overlap=1, **kw), peak=None, **STUDY_405B)
    serial = zoo.plan.plan(cfg, "auto", hardware=Hardware(overlap=0, **kw), peak=None, **STUDY_405B)
    assert {"query_proj", "key_proj", "value_proj"} <= set(hidden.recipe.offload)
    assert serial.recipe.offload == () and serial.recipe.placement("query_proj") == "remat"
    note = {t.tag: t.note for t in serial.stacks[0].tags}["query_proj"]
    assert "overlap 0" in note and "would add" in note and "recompute it saves" in note
    # the step-time estimate: with overlap 0 a fixed offload recipe pays every transfer, both ways
    qkv = LLAMA_RECIPES["qkv_offload"]
    p0 = zoo.plan.plan(cfg, qkv, peak=None, hardware=Hardware(link_gbps=55, tflops=800, overlap=0), **STUDY_405B)
    p1 = zoo.plan.plan(cfg, qkv, peak=None, hardware=Hardware(link_gbps=55, tflops=800, overlap=1), **STUDY_405B)
    (s,) = p0.stacks
    assert p0.step_time()["exposed_transfer_s"] == pytest.approx(s.num_layers * 2 * s.host_bytes_per_layer / 55e9)
    assert p1.step_time()["exposed_transfer_s"] == 0


def test_the_link_defaults_to_the_measured_one():
    h200 = links.measured("NVIDIA H200")
    measured = links.Overlap(0.634, 0.475)   # per direction, with the step's copies off the compute stream
    assert (h200.rate_gbps, h200.overlap) == (55.3, measured) and "offload-pays" in h200.source
    assert "command buffers off" in h200.setting and h200.date
    assert links.measured("cpu") is None
    cfg = zoo.models.LlamaConfig.preset("tiny")
    p = zoo.plan.plan(cfg, "auto", batch=2, seq=16, peak=None,
                      hardware=Hardware(hbm_gib=1, tflops=800, device_kind="H200"))
    assert (p.link_gbps, p.overlap) == (55.3, measured) and "measured on H200" in p.link_source
    given = zoo.plan.plan(cfg, "auto", batch=2, seq=16, peak=None,
                          hardware=Hardware(hbm_gib=1, tflops=800, link_gbps=450))
    assert (given.link_gbps, given.overlap) == (450, links.Overlap(0.0, 0.0))   # none measured on the CPU
    with pytest.raises(ValueError, match="no link is measured for 'cpu'"):
        zoo.plan.plan(cfg, "auto", batch=2, seq=16, peak=None, hardware=Hardware(hbm_gib=1, tflops=800))
    with pytest.raises(ValueError, match="overlap must be a fraction"):
        zoo.plan.plan(cfg, LLAMA_RECIPES["qkv_offload"], batch=2, seq=16, peak=None, hardware=Hardware(overlap=2))


def test_the_abstract_step_allocates_nothing():
    """compile_abstract builds model and optimizer from shapes: a 405B layer compiles without its memory."""
    from zoo.train_step import abstract_step
    cfg = zoo.models.LlamaConfig.preset("llama3_1_405b", num_layers=2, vocab_size=1024)
    _, _, state = abstract_step(zoo.models.registry.family("llama3"), cfg, LLAMA_RECIPES["qkv_offload"])
    leaves = jax.tree.leaves(state)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert sum(x.size for x in leaves) > 2 * 16384 * 53248 * 3   # the MLP weights of two 405B layers, unallocated


def test_the_plan_command_line_reports_the_peak_and_the_measured_link(capsys, monkeypatch):
    import json

    monkeypatch.setenv("COLUMNS", "300")   # one table row per line

    from recipes.train import plan as plan_cli
    tiny = ["--model", "llama3", "--preset", "tiny", "--batch", "2", "--seq", "16"]
    assert plan_cli.main(tiny + ["--recipe", "qkv_offload", "--peak", "compile", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    d = out["peak"]["detail"]
    assert out["peak_source"] == "compiled for cpu"
    assert out["peak_bytes"] == d["argument"] + d["output"] - d["alias"] + d["temp"]
    assert plan_cli.main(tiny + ["--recipe", "auto", "--hbm", "1", "--flops", "800", "--device", "H200"]) == 0
    text = " ".join(capsys.readouterr().out.split())   # rich wraps lines at the terminal's width
    assert "overlap d2h 0.634 / h2d 0.475 (measured on H200" in text and "estimate (planned for H200 on cpu)" in text


def test_the_estimate_counts_one_chunk_of_the_loss():
    """Chunked (the default at Llama 3.1's vocabulary and 32K: 1,024 positions), the estimate holds one chunk's
    float32 logits and gradient (and, for 16-bit parameters, the float32 sum of the head's gradient beyond the
    gradient itself); unchunked, the whole sequence's."""
    kw = dict(batch=1, seq=32768, shard=1, vocab=128256, dim=4096, layer_bytes=0, why="test")
    whole = peak_lib.estimate(0, loss_chunk=None, **kw)
    chunked = peak_lib.estimate(0, **kw)
    assert whole.detail["loss_chunk"] is None and whole.bytes == 8 * 32768 * 128256
    assert chunked.detail["loss_chunk"] == 1024 and chunked.bytes == 8 * 1024 * 128256
    assert peak_lib.estimate(0, param_bytes=2, **kw).bytes == 8 * 1024 * 128256 + 2 * 4096 * 128256
    with pytest.raises(ValueError, match="loss_chunk 1000 does not divide the sequence length 32768"):
        peak_lib.estimate(0, loss_chunk=1000, **kw)
    cfg = zoo.models.LlamaConfig.preset("tiny")
    p = zoo.plan.plan(cfg, LLAMA_RECIPES["full"], batch=2, seq=16, hardware=Hardware(device_kind="H200"),
                 training=zoo.plan.Training(loss_chunk=4))
    assert p.peak.detail["loss_chunk"] == 4 and p.peak.detail["logits_f32_and_grad"] == 8 * 2 * 4 * cfg.vocab_size
