"""Peak HBM with XLA's temporaries: the planner compiles the library's training step (the main job's: its refusal of
a step that cannot fit is tests/train/test_fit.py), or estimates it for another device; the optimizer state's
dtype; `auto`'s link model with and without overlap; the abstract step; the estimate's loss chunk."""
import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest

import zoo
from recipes.llama3 import RECIPES as LLAMA_RECIPES
from zoo.optim import make_tx
from zoo.plan import Hardware, Parallelism, Training, links
from zoo.plan import peak as peak_lib
from zoo.train_step import compile_abstract

GiB = 1 << 30


def test_the_planners_compiled_peak_is_the_library_steps_memory_analysis():
    """zoo.plan.plan(peak="compile") compiles the library's training step (`zoo.train_step.compile_abstract`, what
    the main job compiles too: tests/train/test_fit.py): XLA's memory analysis of it, field by field, and the peak is
    arguments + outputs - donated + temporaries."""
    fam = zoo.models.registry.family("llama3")
    # test_capacity.py's compiled walk compiles this step too (the run's compilation cache serves the second)
    recipe, sgd = LLAMA_RECIPES["full"], Training(optimizer="sgd")
    compiled, _, _ = compile_abstract(fam, fam.config("tiny"), recipe, batch=2, seq=16,
                                      training=Training(optimizer="sgd"))
    step = peak_lib.from_compiled(compiled)
    planned = zoo.plan.plan(fam.config("tiny"), recipe, batch=2, seq=16, peak="compile", training=sgd)
    assert planned.peak_source == "compiled for cpu" and planned.peak.compiled
    assert planned.peak.detail == step.detail
    d = step.detail
    assert planned.peak_bytes == step.bytes == d["argument"] + d["output"] - d["alias"] + d["temp"]
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


@pytest.mark.slow
def test_auto_offloads_only_what_pays_when_copies_do_not_overlap(monkeypatch):
    """With overlap 1 (copies hidden under compute) the 405B's q, k, v are offloaded at 55 GB/s; with overlap 0
    (XLA on the H200: copies serialised on the compute stream) each would add its link time to the step, far more
    than recomputing it, so they are recomputed, and the reasons say so. The budget leaves 0.25 GiB beside what full
    remat takes at its estimated peak (its saved bytes and the step's temporaries); the pinned pool holds 256 GiB
    (the 71 GiB of q, k, v per device are over the default 64)."""
    monkeypatch.setenv(zoo.plan.POOL_ENV, "256")
    cfg = zoo.models.LlamaConfig.preset("llama3_1_405b")
    budget = zoo.plan.plan(cfg, zoo.Recipe.full(), peak="estimate", hardware=Hardware(device_kind="H200"),
                           **STUDY_405B).peak_bytes / GiB + 0.25
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


def test_the_estimate_counts_one_chunk_of_the_loss():
    """Chunked (the default at Llama 3.1's vocabulary and 32K: 1,024 positions), the estimate holds one chunk's
    float32 logits and gradient (and, for 16-bit parameters, the float32 sum of the head's gradient beyond the
    gradient itself); unchunked, the whole sequence's; and one group's backward pass beyond the floor."""
    f32 = zoo.models.LlamaConfig.preset("llama3_1_8b", num_layers=1)
    bf16 = dataclasses.replace(f32, param_dtype="bfloat16")
    kw = dict(batch=1, seq=32768, shard=1, working=5, why="test")
    whole = peak_lib.estimate(0, cfg=f32, loss_chunk=None, **kw)
    chunked = peak_lib.estimate(0, cfg=f32, **kw)
    assert whole.detail["loss_chunk"] is None and whole.bytes == 8 * 32768 * 128256 + 5
    assert chunked.detail["loss_chunk"] == 1024 and chunked.bytes == 8 * 1024 * 128256 + 5
    assert peak_lib.estimate(0, cfg=bf16, **kw).bytes == 8 * 1024 * 128256 + 2 * 4096 * 128256 + 5
    with pytest.raises(ValueError, match="loss_chunk 1000 does not divide the sequence length 32768"):
        peak_lib.estimate(0, cfg=f32, loss_chunk=1000, **kw)
    cfg = zoo.models.LlamaConfig.preset("tiny")
    p = zoo.plan.plan(cfg, LLAMA_RECIPES["full"], batch=2, seq=16, hardware=Hardware(device_kind="H200"),
                      training=zoo.plan.Training(loss_chunk=4))
    assert p.peak.detail["loss_chunk"] == 4 == p.loss_chunk
    assert p.peak.detail["loss_f32_logits_and_grads"] == 8 * 2 * 4 * cfg.vocab_size
