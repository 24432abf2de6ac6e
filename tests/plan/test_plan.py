"""The memory planner: the study's figures, exactness against JAX's own residuals, recompute FLOPs, model state,
warnings, the automatic recipe and the direction of imports (the command line, `python -m recipes.train.plan`:
tests/train/test_plan_cli.py)."""
import dataclasses
import io
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rich.console
from flax import nnx

import zoo
from recipes.deepseek_v3 import RECIPES as DS_RECIPES
from recipes.llama3 import RECIPES as LLAMA_RECIPES
from recipes.registry import recipes_of
from tests.helpers import assert_unbroken, cpu_env, fake_gpu, plain, tiered
from zoo.models import registry
from zoo.plan import Hardware, Parallelism, Training, measure
from zoo.plan import build as planner
from zoo.plan import state as plan_state

ROOT = Path(__file__).resolve().parents[2]
MiB, GiB = 1 << 20, 1 << 30
B, S = 3, 8  # batch differs from the tiny models' layer counts, so stacked residuals are told apart by shape
LLAMA_TINY = zoo.models.LlamaConfig.preset("tiny")
L405 = zoo.models.LlamaConfig.preset("llama3_1_405b")


def extra_recipes():
    """Recipes beyond RECIPES: the offloaded scan carry, and all three placements in one recipe."""
    return {"carry_offload": zoo.Recipe("carry_offload", offload=("decoder_layer_input",)),
            "mixed": zoo.Recipe("mixed", offload=("decoder_layer_input", "mlpwi_0"), device=("key_proj",))}


def families():
    """Every family of the model table, tiny, with its recipes and the extra ones."""
    return [(f.name, f.config("tiny"), f.build, {**recipes_of(f), **extra_recipes()})
            for f in registry.FAMILIES.values()]


# the recipes of tags alone; tiles and groups: tests/models/test_stack.py
CASES = [(fam, name) for fam, _, _, recipes in families() for name in recipes if plain(recipes[name])]
# The default set keeps, per family, `none` (a special recipe), `mixed` (all three placements in one recipe) and the
# recipe offloading the most tags (every offloadable kind of tag the family emits); the family's other recipes are
# further cases of the same byte-for-byte check (slow set).
FAST_CASES = {("llama3", "none"), ("llama3", "mixed"), ("llama3", "minimal_offload"),
              ("qwen3", "none"), ("qwen3", "mixed"), ("qwen3", "minimal_offload"),
              ("deepseek_v3", "none"), ("deepseek_v3", "mixed"), ("deepseek_v3", "lowrank_context_offload"),
              ("qwen3_moe", "none"), ("qwen3_moe", "mixed"), ("qwen3_moe", "qkv_context_moe_offload")}


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


# -- the study's figures ----------------------------------------------------------------------------------------
def test_study_figures_llama_405b_qkv_offload(monkeypatch):
    monkeypatch.delenv(zoo.plan.POOL_ENV, raising=False)
    p = zoo.plan.plan(L405, LLAMA_RECIPES["qkv_offload"], batch=2, seq=8192)
    (stack,) = p.stacks
    tags = {t.tag: t for t in stack.tags}
    assert {t: tags[t].host_bytes for t in ("query_proj", "key_proj", "value_proj")} == {
        "query_proj": 512 * MiB, "key_proj": 32 * MiB, "value_proj": 32 * MiB}
    assert stack.num_layers == 126 and stack.host_bytes_per_layer == 576 * MiB == 603_979_776
    assert p.host_bytes == 126 * 576 * MiB == 76_101_451_776
    assert planner.fmt_bytes(p.host_bytes) == "70.9 GiB"
    # the scan carry stays in HBM, every other tag is recomputed, the MLP's down projection is never saved
    assert tags["decoder_layer_input"].device_bytes == 2 * 8192 * 16384 * 2
    assert stack.device_bytes_per_layer == tags["decoder_layer_input"].device_bytes
    assert not tags["mlpwo"].residual and tags["mlpwo"].nbytes == 0
    assert {t.tag for t in stack.tags if t.placement == "remat"} == {
        "attention_out", "context", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo"}
    assert any("pinned host pool of 64.0 GiB" in w for w in p.warnings)


def test_shapes_are_the_published_405b_shapes():
    """The planner's tag shapes (traced from the layers) against the shapes the 405B config implies, written out
    from its published sizes: D 16384, 128 query heads and 8 key/value heads of 128, F 53248."""
    b, s, d, h, kv, hd, f = 2, 8192, 16384, 128, 8, 128, 53248
    p = zoo.plan.plan(L405, LLAMA_RECIPES["qkv_offload"], batch=b, seq=s)
    assert {t.tag: t.shape for t in p.stacks[0].tags} == {
        "decoder_layer_input": (b, s, d), "query_proj": (b, s, h, hd), "key_proj": (b, s, kv, hd),
        "value_proj": (b, s, kv, hd), "attention_out": (b, s, h, hd), "context": (b, h, s), "out_proj": (b, s, d),
        "mlpwi_0": (b, s, f), "mlpwi_1": (b, s, f), "mlpwo": (b, s, d)}
    # the softmax statistics are float32 (the attention kernel's), every other tag the activations' bf16
    assert {t.tag: t.dtype for t in p.stacks[0].tags if t.dtype != "bfloat16"} == {"context": "float32"}


def test_shard_splits_batch_and_model_state():
    one = zoo.plan.plan(L405, LLAMA_RECIPES["qkv_offload"], batch=2, seq=8192)
    many = zoo.plan.plan(L405, LLAMA_RECIPES["qkv_offload"], batch=256, seq=8192, parallel=Parallelism(shard=128))
    assert many.host_bytes == one.host_bytes and many.activation_bytes == one.activation_bytes
    assert many.state.params == math.ceil(one.state.params / 128)
    assert many.state.optimizer == math.ceil(one.state.optimizer / 128)
    assert many.remat_flops == one.remat_flops


# -- exactness against JAX --------------------------------------------------------------------------------------
@pytest.mark.parametrize("family, name", [pytest.param(*c, marks=() if c in FAST_CASES else (pytest.mark.slow,))
                                          for c in CASES])
def test_planned_bytes_equal_the_residuals_jax_saves(family, name):
    _, cfg, build, recipes = next(f for f in families() if f[0] == family)
    recipe = recipes[name]
    p = zoo.plan.plan(cfg, recipe, batch=B, seq=S)
    model = nnx.eval_shape(lambda: build(cfg, recipe=recipe, rngs=nnx.Rngs(0)))  # JAX answers from shapes alone
    for sp in p.stacks:
        res = measure.layer_residuals(model, sp.name, B, S)
        # one layer: the host residuals are the offloaded tags, byte for byte
        assert sum(r.nbytes for r in res if r.host) == sp.host_bytes_per_layer
        if recipe.special is None:  # `none` may save an alias of a tag (the query reshaped for GQA) instead
            for t in sp.tags:
                if t.tag != "decoder_layer_input":  # the carry is saved by the scan, checked below
                    assert sum(r.nbytes for r in res if r.tag == t.tag and not r.host) == t.device_bytes, t.tag
            assert sp.untagged_bytes == 0
    # the whole model: residuals stacked over each scan's layers, on the device and on the host, for a loss that
    # also differentiates the stacks' aux (the MoE balance loss), as training does
    tokens = jax.ShapeDtypeStruct((B, S), jnp.int32)
    graphdef, state = nnx.split(model)

    def loss(state, tokens):
        logits, aux = nnx.merge(graphdef, state)(tokens, return_aux=True)
        return jnp.mean(logits.astype(jnp.float32)) + sum(jnp.sum(a.astype(jnp.float32)) for a in jax.tree.leaves(aux))

    res = measure.residuals(loss, state, tokens)
    lengths = {(sp.num_layers,) for sp in p.stacks}
    assert B not in {sp.num_layers for sp in p.stacks}  # the last carry [B, S, D] is no stacked residual
    stacked = [r for r in res if r.host or (r.source.startswith("output of scan") and r.shape[:1] in lengths)]
    assert sum(r.nbytes for r in stacked if r.host) == p.host_bytes
    assert sum(r.nbytes for r in stacked if not r.host) == sum(sp.num_layers * sp.device_bytes_per_layer
                                                               for sp in p.stacks)
    assert not any("the plan is off" in w for w in p.warnings)


@pytest.mark.parametrize("name", ["qkv_offload", "full", "save_qkv"])
def test_a_one_layer_model_is_planned_as_it_runs(name):
    """One layer runs without a scan: its input is the rematerialized body's argument, which its backward reads. The
    plan counts it where the recipe places the layer input, and JAX's own account agrees (no "plan is off" warning,
    the debugging user's `--set num_layers=1`)."""
    cfg = dataclasses.replace(LLAMA_TINY, num_layers=1)
    p = zoo.plan.plan(cfg, LLAMA_RECIPES[name], batch=4, seq=32, peak=None)
    assert not p.warnings, p.warnings
    (carry,) = [t for t in p.stacks[0].tags if t.tag == "decoder_layer_input"]
    assert carry.device_bytes == 4 * 32 * cfg.dim * jnp.dtype(cfg.dtype).itemsize


def test_none_counts_what_jax_saves_beyond_the_tags():
    p = zoo.plan.plan(LLAMA_TINY, LLAMA_RECIPES["none"], batch=B, seq=S)
    (sp,) = p.stacks
    assert sp.untagged_bytes > 0 and sp.remat_flops == 0
    assert any("recipe 'none' keeps every intermediate" in w for w in p.warnings)


# -- recompute FLOPs --------------------------------------------------------------------------------------------
def test_recompute_flops_follow_the_layer():
    c = LLAMA_TINY
    tokens = B * S
    down = 2 * tokens * c.mlp_dim * c.dim
    qkv = 2 * tokens * c.dim * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    # causal attention, counted from the shapes whatever kernel runs: half of 2 x 2 B H S^2 d
    attention = 2 * 2 * B * S * S * c.num_heads * c.head_dim // 2
    flops = {n: zoo.plan.plan(c, LLAMA_RECIPES[n], batch=B, seq=S).stacks[0]
             for n in ("none", "full", "save_qkv", "minimal", "minimal_no_context", "context_offload")}
    assert flops["none"].remat_flops == 0
    assert all(f.attention_flops == attention for f in flops.values())
    # full remat re-runs the whole forward pass but the down projection, whose output nothing needs
    assert flops["full"].remat_flops == flops["full"].forward_flops - down
    assert flops["full"].remat_attention_flops == attention
    # keeping q, k, v skips their projections
    assert flops["save_qkv"].remat_flops == flops["full"].remat_flops - qkv
    # keeping every matmul output and the kernel's statistics leaves nothing but elementwise work
    assert flops["minimal"].remat_flops == 0
    # without the kernel's residuals the attention forward runs again
    assert flops["minimal_no_context"].remat_flops == flops["minimal_no_context"].remat_attention_flops == attention
    # keeping only them leaves everything else: full remat but the attention
    assert flops["context_offload"].remat_flops == flops["full"].remat_flops - attention


# -- model state ------------------------------------------------------------------------------------------------
def test_model_state():
    full = LLAMA_RECIPES["full"]
    n = zoo.models.count_params(planner.abstract_model(LLAMA_TINY))
    p = zoo.plan.plan(LLAMA_TINY, full, batch=B, seq=S)
    assert (p.state.num_params, p.state.params, p.state.grads, p.state.optimizer) == (n, 4 * n, 4 * n, 8 * n)
    assert p.hbm_bytes == p.activation_bytes + p.state.total
    sgd = zoo.plan.plan(LLAMA_TINY, full, batch=B, seq=S, parallel=Parallelism(shard=3),
                        training=Training(optimizer="sgd"))
    assert sgd.state.optimizer == 0 and sgd.state.params == math.ceil(4 * n / 3)
    bf16 = zoo.plan.plan(dataclasses.replace(LLAMA_TINY, param_dtype="bfloat16"), full, batch=B, seq=S,
                         training=Training(opt_dtype="bfloat16"))
    assert (bf16.state.params, bf16.state.optimizer) == (2 * n, 4 * n)
    planned = zoo.plan.plan(L405, full, batch=1, seq=8).state.num_params
    assert zoo.models.count_params(planner.abstract_model(L405)) == planned


# -- warnings ---------------------------------------------------------------------------------------------------
def test_warnings_pool_ram_and_hbm(monkeypatch):
    def warnings(**kw):
        return zoo.plan.plan(L405, LLAMA_RECIPES["qkv_offload"], batch=2, seq=8192, **kw).warnings

    monkeypatch.setenv(zoo.plan.POOL_ENV, "128")
    monkeypatch.setattr(plan_state, "machine_ram_bytes", lambda: 1 << 50)
    assert warnings() == ()
    monkeypatch.setenv(zoo.plan.POOL_ENV, "32")
    assert any("pinned host pool of 32.0 GiB" in w and zoo.plan.POOL_ENV in w for w in warnings())
    monkeypatch.setenv(zoo.plan.POOL_ENV, "lots")
    assert any("not an integer" in w for w in warnings())
    monkeypatch.setenv(zoo.plan.POOL_ENV, "128")
    monkeypatch.setattr(plan_state, "machine_ram_bytes", lambda: 16 * GiB)
    assert not [w for w in warnings() if "RAM" in w]   # the CPU has no pinned host memory to bound
    # planned on the accelerator present, this machine's RAM bounds its pinned host memory
    monkeypatch.setattr(planner, "device_target", lambda kind: ("NVIDIA H200", True, fake_gpu()))
    assert [w for w in warnings() if "this machine's RAM (16.0 GiB)" in w]
    monkeypatch.setattr(plan_state, "machine_ram_bytes", lambda: 1 << 50)
    assert [w for w in warnings(hardware=Hardware(hbm_gib=141)) if "over the budget of 141.0 GiB" in w]


# -- bad input --------------------------------------------------------------------------------------------------
def test_bad_names_and_values_raise():
    full = LLAMA_RECIPES["full"]
    with pytest.raises(ValueError, match="no model family for a str"):
        zoo.plan.plan("llama4", full, batch=1, seq=8)
    with pytest.raises(ValueError, match="recipe must be a zoo.Recipe or 'auto', got 'qkv'"):
        zoo.plan.plan(LLAMA_TINY, "qkv", batch=1, seq=8)
    with pytest.raises(ValueError, match="optimizer='adagrad'.*adamw"):
        zoo.plan.plan(LLAMA_TINY, full, batch=1, seq=8, training=Training(optimizer="adagrad"))
    with pytest.raises(ValueError, match="batch must be a positive int"):
        zoo.plan.plan(LLAMA_TINY, full, batch=0, seq=8)
    with pytest.raises(ValueError, match="batch=3 does not split evenly over shard=2"):
        zoo.plan.plan(LLAMA_TINY, full, batch=3, seq=8, parallel=Parallelism(shard=2))
    with pytest.raises(ValueError, match="auto' needs hbm_gib, link_gbps"):
        zoo.plan.plan(LLAMA_TINY, "auto", batch=1, seq=8, hardware=Hardware(tflops=1.0))
    with pytest.raises(ValueError, match="matches no tag that Llama emits"):
        zoo.plan.plan(LLAMA_TINY, zoo.Recipe("moe", offload=("moe_*",)), batch=1, seq=8)


# -- the automatic recipe ---------------------------------------------------------------------------------------
# These tests check the link model where a transfer that fits under compute is free (overlap=1: a mechanism
# proven to hide copies); with overlap 0 (XLA on the H200 today) see test_peak.py.
def _tight_budget(cfg, **kw) -> float:
    """An HBM budget (GiB) that holds the model state, the scan carry and the step's temporaries as the planner
    expects them (the estimated peak of full remat) but no other tag."""
    return zoo.plan.plan(cfg, zoo.Recipe.full(), peak="estimate", hardware=Hardware(device_kind="H200"),
                         **kw).peak_bytes / GiB + 0.25


@pytest.fixture
def roomy_pool(monkeypatch):
    """A pinned pool of 256 GiB: the 405B's q, k and v take 71 GiB per device, over the default 64."""
    monkeypatch.setenv(zoo.plan.POOL_ENV, "256")


STUDY_405B = dict(batch=256, seq=8192, parallel=Parallelism(shard=128))  # batch 2 per device, FSDP over 128 GPUs


@pytest.mark.parametrize("link", tiered([450, 55], fast=(55,)))
def test_auto_offloads_qkv_of_405b_at_the_study_link_and_on_pcie(link, roomy_pool):
    p = zoo.plan.plan(L405, "auto", hardware=Hardware(hbm_gib=_tight_budget(L405, **STUDY_405B), link_gbps=link,
                                                      overlap=1, tflops=800), **STUDY_405B)
    assert isinstance(p.recipe, zoo.Recipe)
    assert {"query_proj", "key_proj", "value_proj"} <= set(p.recipe.offload)
    assert p.hbm_bytes <= p.hbm_budget
    reasons = {t.tag: t.note for t in p.stacks[0].tags}
    assert "hides" in reasons["query_proj"] and f"at {link} GB/s" in reasons["query_proj"]


def test_auto_recomputes_what_a_slow_link_cannot_hide(roomy_pool):
    p = zoo.plan.plan(L405, "auto", hardware=Hardware(hbm_gib=_tight_budget(L405, **STUDY_405B), link_gbps=1, overlap=1,
                                                      tflops=800), **STUDY_405B)
    assert "query_proj" not in p.recipe.offload and p.recipe.placement("query_proj") == "remat"
    assert "would not hide" in {t.tag: t.note for t in p.stacks[0].tags}["query_proj"]
    assert "key_proj" in p.recipe.offload  # 32 MiB per layer still hides at 1 GB/s


def test_auto_keeps_on_device_what_fits_and_respects_a_host_budget(monkeypatch):
    """auto keeps everything in HBM where it fits, and offloads nothing past a host budget. Where XLA's pinned pool
    is what stopped it (a host budget over the pool does nothing), the plan says to raise the pool's variable."""
    roomy = zoo.plan.plan(L405, "auto", hardware=Hardware(hbm_gib=10_000, link_gbps=55, overlap=1, tflops=800),
                          **STUDY_405B)
    needed = {t.tag for t in roomy.stacks[0].tags if t.residual}
    assert set(roomy.recipe.device) == needed and roomy.recipe.offload == ()
    no_host = zoo.plan.plan(L405, "auto", hardware=Hardware(hbm_gib=_tight_budget(L405, **STUDY_405B), link_gbps=450,
                                                            overlap=1, tflops=800, host_gib=1), **STUDY_405B)
    assert no_host.recipe.offload == () and no_host.host_bytes == 0
    assert not any(zoo.plan.POOL_ENV in w for w in no_host.warnings)   # the budget given bound it, not the pool
    monkeypatch.setenv(zoo.plan.POOL_ENV, "1")
    pool_bound = zoo.plan.plan(L405, "auto", hardware=Hardware(
        hbm_gib=_tight_budget(L405, **STUDY_405B), link_gbps=450, overlap=1, tflops=800, host_gib=100), **STUDY_405B)
    assert pool_bound.recipe.offload == () and pool_bound.host_bytes == 0
    said = [w for w in pool_bound.warnings if zoo.plan.POOL_ENV in w]
    assert len(said) == 1 and "pool holds (1.0 GiB" in said[0] and "host budget of 100 GiB is over it" in said[0]
    both = zoo.plan.plan(L405, "auto", hardware=Hardware(       # --host as small as the pool: raising it alone is idle
        hbm_gib=_tight_budget(L405, **STUDY_405B), link_gbps=450, overlap=1, tflops=800, host_gib=1), **STUDY_405B)
    assert both.recipe.offload == () and not any(zoo.plan.POOL_ENV in w for w in both.warnings)


@pytest.mark.slow
def test_auto_recipe_builds_and_trains_the_tiny_model():
    """The chosen recipe is one JAX honours (placements read back from the residuals), and the model trains under
    it: a few Adam steps on one batch lower the loss."""
    # a budget that holds the model state, the scan carry and the temporaries, nothing more; at a slow FLOP rate
    # every transfer hides
    budget = _tight_budget(LLAMA_TINY, batch=B, seq=S) - 0.25
    recipe = planner.auto_recipe(LLAMA_TINY, batch=B, seq=S,
                                 hardware=Hardware(hbm_gib=budget, link_gbps=55, overlap=1, tflops=1e-6))
    assert "decoder_layer_input" in recipe.device and {"mlpwi_0", "mlpwi_1"} <= set(recipe.offload)
    model = nnx.jit(lambda: zoo.models.llama3(LLAMA_TINY, recipe=recipe, rngs=nnx.Rngs(0)))()
    seen = measure.placements_seen(model, "layers", B, S)
    assert {t: seen[t] for t in measure.residual_tags(model, "layers")} == {
        t: recipe.placement(t) for t in measure.residual_tags(model, "layers")}

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jax.random.randint(jax.random.key(0), (B, S + 1), 0, LLAMA_TINY.vocab_size)

    def loss_fn(params):
        logp = jax.nn.log_softmax(nnx.merge(graphdef, params, rest)(tokens[:, :-1]).astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    @jax.jit
    def sgd_step(params):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        return loss, jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)

    losses = []
    for _ in range(6):
        loss, params = sgd_step(params)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0], losses


def test_zoo_plan_is_a_package_with_the_planner_whatever_is_imported_first():
    code = ("import zoo.plan.measure, zoo; from zoo.plan import build; assert zoo.plan.plan is build.plan; "
            "from recipes.llama3 import RECIPES; "
            "p = zoo.plan.plan(zoo.models.LlamaConfig.preset('tiny'), RECIPES['qkv_offload'], batch=1, seq=8); "
            "print(p.host_bytes)")
    r = _run("-c", code)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) > 0


def test_zoo_never_imports_recipes():
    """The library does not depend on the application: no module under zoo/ imports recipes, and importing all of
    zoo (planner, Hugging Face interop, the model table) loads nothing of recipes."""
    for path in (ROOT / "zoo").rglob("*.py"):
        for line in path.read_text().splitlines():
            words = line.split()
            assert not (words[:1] in (["import"], ["from"]) and words[1].split(".")[0] == "recipes"), (path, line)
            assert not ("import_module" in line and "recipes" in line), (path, line)
    r = _run("-c", "import sys, zoo, zoo.plan.measure, zoo.hf, zoo.models.registry; "
                   "print(sorted(m for m in sys.modules if m.split('.')[0] == 'recipes'))")
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


# -- DeepSeek-V3 ------------------------------------------------------------------------------------------------
DS_SLICE = dict(batch=4, seq=4096)  # the DeepSeek-shaped slice of ANCHORS.md


def test_deepseek_study_bytes_per_token():
    RECIPES = DS_RECIPES
    cfg = zoo.models.DeepSeekV3Config.preset("deepseek_v3_671b")
    tokens = DS_SLICE["batch"] * DS_SLICE["seq"]
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    moe_up = 2 * cfg.num_experts_per_tok * cfg.moe_mlp_dim
    study = 2 * (2 * cfg.num_heads * qk + cfg.num_heads * cfg.v_head_dim + moe_up)
    lowrank = 2 * (cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim + moe_up)
    p = zoo.plan.plan(cfg, RECIPES["mla_moe_offload"], **DS_SLICE)
    moe = {s.name: s for s in p.stacks}["moe_layers"]
    assert moe.num_layers == cfg.num_moe_layers and moe.host_bytes_per_layer == study * tokens
    assert study == 192 * 1024  # ANCHORS.md: ~192 KiB per token and layer
    p = zoo.plan.plan(cfg, RECIPES["lowrank_wa_offload"], **DS_SLICE)
    assert {s.name: s for s in p.stacks}["moe_layers"].host_bytes_per_layer == lowrank * tokens
    assert round(lowrank / 1024) == 68  # ~68 KiB


@pytest.mark.slow   # auto's link model: test_step_time.py checks it at the H200's link on the 405B slice by default
def test_auto_deepseek_is_link_aware(monkeypatch):
    """At the study's 450 GB/s the study's tensors hide under a MoE layer's forward pass; at PCIe's 55 GB/s they
    cannot, and the low-rank tensors (MLA down-projections, MoE up-projections) are saved instead (offloaded, or kept
    where HBM holds them). The pinned
    pool is roomy (512 GiB): on this slice auto offloads 338 GiB per device at 450 GB/s, and the link is what is
    tested here, not the host budget."""
    monkeypatch.setenv(zoo.plan.POOL_ENV, "512")
    from recipes.deepseek_v3 import RECIPES, STUDY
    cfg = zoo.models.DeepSeekV3Config.preset("deepseek_v3_671b")
    budget = _tight_budget(cfg, **DS_SLICE)
    fast = zoo.plan.plan(cfg, "auto", hardware=Hardware(hbm_gib=budget, link_gbps=450, overlap=1, tflops=600),
                         **DS_SLICE)
    assert set(STUDY) <= set(fast.recipe.offload)
    slow = zoo.plan.plan(cfg, "auto", hardware=Hardware(hbm_gib=budget, link_gbps=55, overlap=1, tflops=600),
                         **DS_SLICE)
    assert set(RECIPES["lowrank_wa_offload"].offload) <= set(slow.recipe.offload) | set(slow.recipe.device)
    assert {"query_proj", "key_proj", "value_proj"}.isdisjoint(slow.recipe.offload)
    notes = {t.tag: t.note for s in slow.stacks for t in s.tags}
    assert "would not hide" in notes["query_proj"] and "at 55 GB/s" in notes["query_proj"]
    # the estimate agrees: on PCIe the study's recipe is link-bound, the low-rank one is not
    link = Hardware(link_gbps=55, overlap=1, tflops=600)
    est = {n: zoo.plan.plan(cfg, RECIPES[n], hardware=link, **DS_SLICE).step_time()
           for n in ("mla_moe_offload", "lowrank_wa_offload")}
    assert est["mla_moe_offload"]["exposed_transfer_s"] > 0 == est["lowrank_wa_offload"]["exposed_transfer_s"]


def test_the_model_table_plans_deepseek():
    fam = registry.family("deepseek_v3")
    p = zoo.plan.plan(fam.config("tiny"), recipes_of(fam)["mla_moe_offload"], batch=B, seq=S)
    assert [s.name for s in p.stacks] == ["dense_layers", "moe_layers"] and p.host_bytes > 0
    assert registry.family_of(fam.config("tiny")) is fam and recipes_of(fam) is DS_RECIPES


def test_a_cudnn_config_is_planned_on_the_xla_path():
    qkv = LLAMA_RECIPES["qkv_offload"]
    cudnn = zoo.plan.plan(dataclasses.replace(LLAMA_TINY, attention_impl="cudnn"), qkv, batch=B, seq=S)
    xla = zoo.plan.plan(LLAMA_TINY, qkv, batch=B, seq=S)
    assert (cudnn.host_bytes, cudnn.activation_bytes, cudnn.remat_flops) == (xla.host_bytes, xla.activation_bytes,
                                                                            xla.remat_flops)


def test_tags_are_traced_once_per_stack_and_shape(monkeypatch):
    """Building a model, planning it and measuring it trace each layer's tags once per input shape, and measuring
    a recipe never changes the model's own."""
    from zoo.models import stack
    calls = []
    real = stack.emitted_lib.read_tags
    monkeypatch.setattr(stack.emitted_lib, "read_tags", lambda *a: calls.append(a[-1].shape) or real(*a))
    cfg = dataclasses.replace(LLAMA_TINY, dim=48)  # a layer no other test has traced
    model = nnx.eval_shape(lambda: zoo.models.llama3(cfg, recipe=LLAMA_RECIPES["full"], rngs=nnx.Rngs(0)))
    zoo.plan.plan(cfg, LLAMA_RECIPES["qkv_offload"], batch=B, seq=S)
    measure.residual_tags(model, "layers")
    measure.placements_seen(model, "layers", B, S, recipe=LLAMA_RECIPES["qkv_offload"])
    assert calls == [(1, 8, 48), (B, S, 48)]
    assert model.recipe == LLAMA_RECIPES["full"]


def test_a_split_plan_shows_one_devices_shapes_beside_one_devices_bytes():
    """Split over devices, the table's shape column is one device's part (the bytes beside it are per device)."""
    recipe = LLAMA_RECIPES["qkv_offload"]
    whole = zoo.plan.plan(LLAMA_TINY, recipe, batch=4, seq=S, peak=None)
    assert all(tp.device_shape is None for tp in whole.stacks[0].tags)
    halves = zoo.plan.plan(LLAMA_TINY, recipe, batch=4, seq=S, peak=None, parallel=Parallelism(shard=2))
    meshed = zoo.plan.plan(LLAMA_TINY, recipe, batch=4, seq=S, peak=None,
                           parallel=Parallelism(mesh={"fsdp": 2, "tp": 2}))
    heads = {tp.tag: tp for tp in meshed.stacks[0].tags}
    for p, rows in ((halves, 2), (meshed, 2)):
        for tp in p.stacks[0].tags:
            assert tp.device_shape[0] == tp.shape[0] // rows
            if tp.residual:
                assert tp.nbytes == math.prod(tp.device_shape) * jnp.dtype(tp.dtype).itemsize
    # tp splits the heads of the queries (4 heads -> 2 per device)
    assert heads["query_proj"].shape[2] == 4 and heads["query_proj"].device_shape[2] == 2
    text = io.StringIO()
    zoo.plan.render(meshed, console=rich.console.Console(file=text, width=200))
    assert "shape per device" in text.getvalue() and "2x8x2x16 f32" in text.getvalue()


def test_render_sent_to_a_file_prints_tables_at_their_natural_width(tmp_path):
    """The README's snippet with its output redirected (a cluster job's log): `zoo.plan.render`'s default console
    prints each table at its natural width, not squeezed to rich's 80 columns (`host/lay…`, `dense_la…`), whatever
    COLUMNS says; a warning is one line."""
    snippet = ("import zoo, recipes\n"
               "cfg = zoo.models.DeepSeekV3Config.preset('tiny')\n"
               "recipe = recipes.deepseek_v3.RECIPES['mla_moe_offload']\n"
               "hardware = zoo.plan.Hardware(hbm_gib=1e-3)\n"   # a budget it is over: a warning
               "zoo.plan.render(zoo.plan.plan(cfg, recipe, batch=8, seq=64, hardware=hardware))\n")
    log = tmp_path / "plan.log"
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, "-c", snippet], cwd=ROOT, env=cpu_env(COLUMNS="80"), stdout=f,
                           stderr=subprocess.PIPE, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert_unbroken(log.read_text(), "│ dense_layers │", "│ moe_layers   │", "recomputed per step",
                    "│ peak HBM of the step, estimate",
                    "warning: peak HBM ... is over the budget of 1.0 MiB")


def test_auto_tries_subgroups_after_every_two_level_structure_and_only_where_none_fits(monkeypatch):
    """`structures` lists each group in subgroups (`subgroup_of`: the fewest layer inputs held) after every structure of
    two levels; `choose_structure` asks the placer for the structures of two levels first and for those in subgroups
    only where none of the first fits, keeping the first's choice where none of either fits."""
    from types import SimpleNamespace

    from zoo.plan import auto
    assert [(g, auto.subgroup_of(g)) for g in (1, 2, 4, 8, 16)] == [(1, 1), (2, 1), (4, 2), (8, 4), (16, 4)]
    model = nnx.eval_shape(lambda: zoo.models.llama3(dataclasses.replace(LLAMA_TINY, num_layers=8), rngs=nnx.Rngs(0)))
    found = auto.structures(model, 65536)
    subgroups = [c[3] for c in found]
    assert subgroups == sorted(subgroups) and {(g, s) for _, g, _, s in found if s > 1} == {(4, 2), (8, 4)}
    asked = []

    def fake_choose(layout_of, *, candidates, **_):
        asked.append([c[3] for c in candidates])
        return SimpleNamespace(fits=any(c[3] > 1 for c in candidates) and fits_in_subgroups, decisions=())

    monkeypatch.setattr(auto, "choose", fake_choose)
    for fits_in_subgroups in (True, False):
        asked.clear()
        best, _ = auto.choose_structure(None, candidates=found, state=None, shard=1, hbm_budget=0, host_budget=None,
                                        link=1.0, rate=1.0, overlap=1.0, reserve=None)
        assert best.fits == fits_in_subgroups
        assert asked == [[1] * subgroups.count(1), [s for s in subgroups if s > 1]]


def test_auto_keeps_the_pair_for_a_groups_first_layer_where_no_room_holds_every_layers():
    """Groups of 2 of the tiny model at 512 positions, the placer's own figures: where HBM holds the layer inputs and
    every layer's attention pair, every layer keeps it (and the first layer of a group not a second copy); where it
    holds half of that and the host nothing, the first layer of each group keeps it in HBM (`lead_device`); where HBM
    holds a quarter and the host half, it offloads it (`lead_offload`). Each saves one attention forward per group, as
    the plan prices it."""
    from types import SimpleNamespace

    from zoo.plan import costs, links, placer
    cfg, seq, pair = dataclasses.replace(LLAMA_TINY, num_layers=4), 512, ("attention_out", "context")
    structure = (1, 2, pair, 1)
    lay = planner.layout(cfg, 1, seq, None, 1, *structure)
    model = costs.CostModel(lay.shapes, lay.needed, lay.costs, 1, 1e12, 1e12, links.Overlap.of(1), groups=lay.groups)
    carry, every = model.total([measure.CARRY]), model.total(pair)
    lead = tuple(zoo.tags.role_name(t, zoo.tags.LEAD) for t in pair)
    assert model.total(lead) == every // 2

    def chosen(hbm, host, structure=structure):
        return placer.choose(lambda *c: planner.layout(cfg, 1, seq, None, 1, *c), candidates=[structure],
                             state=SimpleNamespace(total=0), shard=1, hbm_budget=carry + hbm, host_budget=host,
                             link=1e12, rate=1e12, overlap=1, reserve=lambda *_: 0).recipe

    assert chosen(every, 1).device == (measure.CARRY,) + pair and not chosen(every, 1).resolve().lead
    # without group_keep the first layer's pair saves more per byte than every layer's, and is placed first: every
    # layer's, placed after it, takes its place
    roomy = chosen(2 * every, 1, (1, 2, (), 1))
    assert set(pair) <= set(roomy.device) and not roomy.resolve().lead
    r = chosen(every // 2, 1)
    assert (r.lead_device, r.lead_offload, r.group_keep) == (pair, (), pair)
    assert chosen(every // 4, every // 2 + 1).lead_offload == pair
    p, without = (zoo.plan.plan(cfg, x, batch=1, seq=seq, peak=None).stacks[0]
                  for x in (r, dataclasses.replace(r, lead_device=())))
    assert without.remat_attention_flops - p.remat_attention_flops == p.attention_flops // 2


@pytest.mark.slow   # four plans of auto at 65,536 positions
def test_auto_takes_subgroups_only_where_no_two_level_structure_fits(monkeypatch):
    """4 tiny layers at 65,536 positions, a host budget of 1.5 layer inputs: at 25 layer inputs of HBM no structure of
    two levels fits (the best needs 25.5) and auto chooses groups of 4 in subgroups of 2, whose estimate fits; at 26,
    groups of 2 fit and auto keeps to two levels."""
    from zoo.plan import auto
    cfg = dataclasses.replace(zoo.models.LlamaConfig.preset("tiny", num_layers=4), max_seq_len=65536)
    x = 65536 * cfg.dim * 4

    def chosen(inputs, subgroups=True):
        if not subgroups:
            monkeypatch.setattr(auto, "subgroup_of", lambda group: 1)
        p = zoo.plan.plan(cfg, "auto", batch=1, seq=65536, peak="estimate", hardware=Hardware(
            hbm_gib=inputs * x / GiB, host_gib=1.5 * x / GiB, link_gbps=10, tflops=100))
        monkeypatch.undo()
        return p.recipe, p.peak_bytes <= inputs * x

    recipe, fits = chosen(25)
    assert fits and (recipe.group, recipe.subgroup) == (4, 2)
    assert not chosen(25, subgroups=False)[1]
    recipe, fits = chosen(26)
    assert fits and (recipe.group, recipe.subgroup) == (2, 1)
    assert [(g, auto.subgroup_of(g)) for g in (2, 4, 8, 16)] == [(2, 1), (4, 2), (8, 4), (16, 4)]


@pytest.mark.slow
def test_where_no_structure_fits_auto_shows_the_first_one_tried(monkeypatch):
    """Over a budget no candidate structure (tiles, groups) fits, auto's plan is the first candidate tried (one tile,
    no groups), not the one needing the least HBM: the training command sizes the loss's chunks from the whole
    sequence's plan, and the smaller peak of a structure that recomputes more gave longer chunks and, on the H200, a
    slower 8B step at 131,072 (docs/planner.md)."""
    from zoo.plan import placer
    tried, choice = [], placer.Choice
    monkeypatch.setattr(placer, "Choice", lambda *a: tried.append(choice(*a)) or tried[-1])
    cfg = dataclasses.replace(LLAMA_TINY, max_seq_len=32768)   # long enough that sequence tiles lower the peak
    p = zoo.plan.plan(cfg, "auto", batch=1, seq=32768, peak="estimate",
                      hardware=Hardware(hbm_gib=1e-3, link_gbps=55, overlap=1, tflops=800))
    assert len({(c.recipe.seq_tiles, c.recipe.group) for c in tried}) > 1 and not any(c.fits for c in tried)
    assert (p.recipe.seq_tiles, p.recipe.group) == (tried[0].recipe.seq_tiles, tried[0].recipe.group) == (1, 1)
    assert min(tried, key=lambda c: c.costs.hbm).costs.hbm < tried[0].costs.hbm
