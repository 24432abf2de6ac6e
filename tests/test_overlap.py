"""The stack's explicit offload (zoo/models/offload_scan.py): same gradients and aux as recipe `none`, the same
host placements as JAX's own offload, one layer per copy, no extra recomputation, and the one-layer stack."""
import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import zoo
from recipes import deepseek_v3 as ds_recipes
from recipes import llama3 as llama_recipes
from tests.helpers import cuda_lowering, hlo_type, loss_fn, max_rel_err, pinned_host_shapes, placed_shapes
from zoo.models import offload_scan
from zoo.models.deepseek import total_balance_loss as balance_loss
from zoo.plan import measure as audit

B, S = 2, 8
LLAMA = zoo.models.LlamaConfig.tiny(num_layers=2)
# One dense layer (a stack applied without a scan) and two MoE layers (a scanned stack); the balance loss weighs
# enough that its gradient, which only reaches the router through the aux output, is not lost in rounding.
DEEPSEEK = zoo.models.DeepSeekV3Config.tiny(num_layers=3, first_dense_layers=1, balance_loss_weight=0.1)


def with_impl(model, impl: str):
    """The same model (same parameters) applied with another offload mechanism."""
    cfg = dataclasses.replace(model.config, offload_impl=impl)
    build = zoo.models.llama3 if isinstance(cfg, zoo.models.LlamaConfig) else zoo.models.deepseek_v3
    abstract = nnx.eval_shape(lambda: build(cfg, recipe=model.recipe, rngs=nnx.Rngs(0)))
    return nnx.merge(nnx.graphdef(abstract), nnx.state(model))


def grads_and_aux(model, recipe, tokens):
    """(loss, balance loss, grads of loss + balance loss, aux) under `recipe`."""
    model.set_recipe(recipe)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def f(p):
        logits, aux = nnx.merge(graphdef, p, rest, copy=True)(tokens, return_aux=True)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        lm = -jnp.mean(jnp.take_along_axis(logp, jnp.roll(tokens, -1, axis=1)[..., None], axis=-1))
        bal = balance_loss(aux)
        return lm + bal, (lm, bal, aux)

    (_, (lm, bal, aux)), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
    return lm, bal, grads, aux


@pytest.fixture(scope="module")
def llama():
    return zoo.models.llama3(LLAMA, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(1), (B, S), 0, LLAMA.vocab_size, dtype=jnp.int32)


@pytest.fixture(scope="module")
def llama_ref(llama, tokens):
    llama.set_recipe(llama_recipes.RECIPES["none"])
    graphdef, params, rest = nnx.split(llama, nnx.Param, ...)
    return jax.jit(jax.value_and_grad(lambda p: loss_fn(graphdef, nnx.merge_state(p, rest), tokens)))(params)


def test_placements_are_read_off_the_policy():
    r = zoo.Recipe("r", offload=("query_proj", "mlpwi_0"), device=("key_proj",))
    assert offload_scan.placements(r.policy()) == (("key_proj",), ("query_proj", "mlpwi_0"))
    assert offload_scan.placements(zoo.Recipe.full().policy()) == ((), ())
    assert offload_scan.placements(zoo.Recipe.none().policy()) == (zoo.tags.NAMES, ())
    # an offload anywhere but pinned host memory moves nothing in JAX, and nothing here
    p = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["query_proj"], offload_src="device",
        offload_dst="host")
    assert offload_scan.placements(p) == ((), ())


def test_recipes_that_offload_nothing_take_the_ordinary_path(llama):
    for name in ("none", "full", "save_qkv", "minimal"):
        x = jnp.zeros((B, S, LLAMA.dim))
        assert offload_scan.apply(llama.layers, x, llama_recipes.RECIPES[name].policy(), "explicit") is None


@pytest.mark.parametrize("impl, name", [("explicit", "minimal_offload"), ("explicit", "qkv_offload"),
                                        ("explicit_prefetch", "minimal_offload")])
def test_llama_gradients_equal_none(llama, tokens, llama_ref, impl, name):
    """A reload one layer early or a store one layer late (an off-by-one in the double buffering) would give
    each layer another layer's tensors: these gradients would be wrong by O(1)."""
    model = with_impl(llama, impl)
    model.set_recipe(llama_recipes.RECIPES[name])
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss, grads = jax.jit(jax.value_and_grad(lambda p: loss_fn(graphdef, nnx.merge_state(p, rest), tokens)))(params)
    ref_loss, ref = llama_ref
    assert abs(float(loss) - float(ref_loss)) < 1e-6
    assert max_rel_err(grads, ref) < 1e-5


@pytest.fixture(scope="module")
def deepseek():
    model = zoo.models.deepseek_v3(DEEPSEEK, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(2), (B, S), 0, DEEPSEEK.vocab_size, dtype=jnp.int32)
    return model, tokens, grads_and_aux(model, ds_recipes.RECIPES["none"], tokens)


@pytest.mark.parametrize("impl, name", [("explicit", "mla_moe_offload"), ("explicit_prefetch", "lowrank_wa_offload")])
def test_deepseek_gradients_and_aux_equal_none(deepseek, impl, name):
    """The balance loss reaches the router only through the aux output: were its cotangent lost in the custom VJP,
    the router's gradient would be off by ~17% (checked by breaking it on purpose)."""
    model, tokens, (ref_loss, ref_bal, ref, ref_aux) = deepseek
    loss, bal, got, aux = grads_and_aux(with_impl(model, impl), ds_recipes.RECIPES[name], tokens)
    assert float(ref_bal) > 1e-3  # the aux path carries a real gradient
    assert abs(float(loss) - float(ref_loss)) < 1e-6
    assert max_rel_err(got, ref) < 1e-5
    assert jax.tree.structure(aux) == jax.tree.structure(ref_aux)
    assert aux["moe_layers"]["load"].shape == (2, DEEPSEEK.num_experts)
    assert max_rel_err(aux, ref_aux) < 1e-6


@pytest.mark.parametrize("name", ["minimal_offload", "qkv_offload"])
def test_cuda_lowering_moves_each_offloaded_tag_to_pinned_host(llama, tokens, name):
    """For CUDA: one copy to pinned host per offloaded tag (in the forward loop), one back per tag (in the backward
    loop): the same set of tensors JAX's own offload moves."""
    recipe = llama_recipes.RECIPES[name]
    shapes = llama.tag_shapes(B, S)["layers"].tags
    needed = offload_scan.needed_tags(*_abstract_layer(llama), recipe.offload)
    want = collections.Counter(hlo_type(shapes[t].shape, shapes[t].dtype) for t in recipe.offload if t in needed)
    assert "mlpwo" not in needed  # the backward pass never reads it: it does not move
    model = with_impl(llama, "explicit")
    model.set_recipe(recipe)
    text = cuda_lowering(model, tokens)
    assert pinned_host_shapes(text) == want
    assert _device_shapes(text) == want
    llama.set_recipe(recipe)
    assert pinned_host_shapes(cuda_lowering(llama, tokens)) == want  # what JAX's mechanism moves


def test_host_residuals_are_one_stacked_array_per_offloaded_tag(llama, tokens):
    """Between the passes: each offloaded tag is a [layers, ...] host array (slot 0 unused: layer i's tensors
    are written in iteration i+1), the last layer's stay on the device, nothing else is on the host."""
    recipe = llama_recipes.RECIPES["qkv_offload"]
    model = with_impl(llama, "explicit")
    model.set_recipe(recipe)
    shapes = llama.tag_shapes(B, S)["layers"].tags
    res = audit.model_residuals(model, tokens)
    host = collections.Counter(r.shape for r in res if r.host)
    assert host == collections.Counter((LLAMA.num_layers,) + shapes[t].shape for t in recipe.offload)
    device = collections.Counter(r.shape for r in res if not r.host)
    assert all(device[shapes[t].shape] >= 1 for t in recipe.offload)


def test_no_more_recomputation_than_jax(llama, tokens):
    """The saved tensors stand in for their recomputation, which XLA then drops: the compiled gradient has as many
    matmuls as under JAX's mechanism with the same recipe."""
    def dots(model):
        model.set_recipe(llama_recipes.RECIPES["minimal_offload"])
        graphdef, state = nnx.split(model)
        text = jax.jit(jax.grad(lambda s: loss_fn(graphdef, s, tokens))).lower(state).compile().as_text()
        return len(re.findall(r"= \S+ dot\(", text))

    assert dots(with_impl(llama, "explicit")) == dots(llama) > 0


def test_one_layer_stack():
    """No scan for one layer (XLA would drop the loop and the copies): the tags still go to pinned host memory."""
    cfg = dataclasses.replace(LLAMA, num_layers=1)
    tokens = jax.random.randint(jax.random.key(3), (B, S), 0, cfg.vocab_size, dtype=jnp.int32)
    model = zoo.models.llama3(cfg, rngs=nnx.Rngs(0))
    recipe = llama_recipes.RECIPES["qkv_offload"]
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    grad = jax.jit(jax.grad(lambda p: loss_fn(graphdef, nnx.merge_state(p, rest), tokens)))
    ref = grad(params)
    explicit = with_impl(model, "explicit")
    explicit.set_recipe(recipe)
    graphdef, params, rest = nnx.split(explicit, nnx.Param, ...)
    got = jax.jit(jax.grad(lambda p: loss_fn(graphdef, nnx.merge_state(p, rest), tokens)))(params)
    assert max_rel_err(got, ref) < 1e-5
    shapes = model.tag_shapes(B, S)["layers"].tags
    want = collections.Counter(hlo_type(shapes[t].shape, shapes[t].dtype) for t in recipe.offload)
    text = cuda_lowering(explicit, tokens)
    assert "stablehlo.while" not in text
    assert pinned_host_shapes(text) == want


def test_bad_offload_impl_raises():
    with pytest.raises(ValueError, match="offload_impl must be one of"):
        dataclasses.replace(LLAMA, offload_impl="fast")
    with pytest.raises(ValueError, match="offload_impl must be one of"):
        dataclasses.replace(DEEPSEEK, offload_impl="host")
    # the removed mechanisms (one did not compile on the GPU, the other offloaded nothing): named, with the valid ones
    for removed in ("explicit_stream", "explicit_unrolled"):
        with pytest.raises(ValueError, match=rf"'xla', 'explicit', 'explicit_prefetch'.*got '{removed}'"):
            dataclasses.replace(LLAMA, offload_impl=removed)


def _abstract_layer(model):
    graphdef, state = model.layers.abstract_layer()
    return graphdef, state, jax.ShapeDtypeStruct((B, S, model.config.dim), jnp.float32)


def _device_shapes(text: str) -> collections.Counter:
    return placed_shapes(text, '_xla_buffer_placement = "device"')
