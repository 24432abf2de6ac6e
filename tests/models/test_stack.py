"""The stack's structure beyond the tags (zoo.models.stack): a recipe's `group` (layers per rematerialized group, the
layer input kept once per group) and `seq_tiles` (each layer's per-position parts in sequence tiles). For every
family, the long-context recipes of its set leave the gradients those of recipe `none` (float32, relative 1e-5);
JAX saves the layer input once per group, offloaded where the recipe says, and the planner counts the same bytes;
a group that does not divide a stack and an offloaded tiled tag are refused when the recipe is set."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import zoo
from recipes.registry import recipes_of
from tests.helpers import grads_under, max_rel_err, tiered
from zoo.models import stack as stack_lib
from zoo.models.registry import FAMILIES, family
from zoo.plan import measure

B, S = 2, 16
LONG = ("context_tiles", "context_offload_tiles", "long_context", "longest_context", "lead_context")
CARRY = ("decoder_layer_input",)
CONTEXT = ("attention_out", "context")


def tiny(name: str):
    cfg = family(name).config("tiny", dtype="float32")
    return dataclasses.replace(cfg, num_layers=4) if name in ("llama3", "qwen3") else cfg


@pytest.fixture(scope="module", params=tiered(sorted(FAMILIES), ("llama3",)))
def case(request):
    """(family name, a tiny model, tokens, the loss and gradients under `none`)."""
    cfg = tiny(request.param)
    model = family(request.param).build(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (B, S), 0, cfg.vocab_size, dtype=jnp.int32)
    return request.param, model, tokens, grads_under(model, zoo.Recipe.none(), tokens)


@pytest.fixture(scope="module", params=tiered(sorted(FAMILIES), ("llama3",)))
def built(request):
    """(family name, a tiny model)."""
    return request.param, family(request.param).build(tiny(request.param), rngs=nnx.Rngs(0))


def test_long_context_recipes_leave_the_gradients_unchanged(case):
    name, model, tokens, (loss0, grads0) = case
    named = recipes_of(family(name))
    for r in [named[n] for n in LONG if n in named]:
        loss, grads = grads_under(model, r, tokens)
        assert abs(float(loss) - float(loss0)) < 1e-5 and max_rel_err(grads, grads0) < 1e-5, r.name


def test_the_plan_of_each_long_context_recipe_is_what_jax_saves(built):
    """Per stack, the plan's saved bytes in HBM and on the host equal JAX's own residuals of the scanned stack under
    the recipe's tiles and groups, and the plan warns of nothing; every tag the recipe offloads is a host residual."""
    name, model = built
    named = recipes_of(family(name))
    for r in [named[n] for n in LONG if n in named]:
        model.set_recipe(r)
        p = zoo.plan.plan(model.config, r, batch=B, seq=S, peak=None)
        assert not p.warnings, (r.name, p.warnings)
        for sp in p.stacks:
            device, host, hoisted = measure.stack_residuals(model, sp.name, B, S, r.policy(),
                                                            group=model.stack_group(sp.name, r.group),
                                                            tiles=r.seq_tiles, layer_policy=r.layer_policy(),
                                                            lead_policy=r.lead_policy())
            assert (sp.host_bytes, sp.device_bytes) == (host, device + hoisted), (r.name, sp.name)
            assert (host > 0) == bool(r.offload), (r.name, sp.name)


@pytest.mark.parametrize("group", [2, 4])
def test_the_layer_input_is_saved_once_per_group_where_the_recipe_puts_it(group):
    """4 layers in groups of `group`: JAX saves [4 / group, B, S, D] of layer inputs (on the host when offloaded),
    the context tensors of every layer, and the planner's per-tag bytes account for exactly that."""
    cfg = tiny("llama3")
    model = zoo.models.llama3(cfg, rngs=nnx.Rngs(0))
    carry = B * S * cfg.dim * 4
    for where in ("offload", "device"):
        recipe = zoo.Recipe("g", device=CONTEXT + (CARRY if where == "device" else ()),
                            offload=CARRY if where == "offload" else (), group=group, seq_tiles=4)
        model.set_recipe(recipe)
        device, host, _ = measure.stack_residuals(model, "layers", B, S, recipe.policy(), group=group, tiles=4)
        context = 4 * sum(measure.nbytes(s) for t, s in model.tag_shapes(B, S)["layers"].tags.items() if t in CONTEXT)
        assert (host, device) == ((4 // group * carry, context) if where == "offload" else
                                  (0, context + 4 // group * carry))
        p = zoo.plan.plan(cfg, recipe, batch=B, seq=S, peak=None)
        assert (p.host_bytes, p.activation_bytes) == (host, device) and not p.warnings, p.warnings
        (carry_plan,) = [t for t in p.stacks[0].tags if t.tag == "decoder_layer_input"]
        assert carry_plan.nbytes == carry // group and f"every {group} layers" in carry_plan.note


def test_tiled_tags_are_kept_tile_by_tile_and_read_back_as_placed():
    cfg = tiny("llama3")
    recipe = zoo.Recipe("m", device=("mlpwi_0", "mlpwi_1") + CONTEXT, seq_tiles=4)
    model = zoo.models.llama3(cfg, recipe=recipe, rngs=nnx.Rngs(0))
    assert model.tag_shapes(B, S, tiles=4)["layers"].tiled == {"mlpwi_0", "mlpwi_1", "mlpwo"}
    seen = measure.placements_seen(model, "layers", B, S)
    assert seen["mlpwi_0"] == seen["mlpwi_1"] == "device" and seen["query_proj"] == "remat"


def test_bad_structures_are_refused_when_the_recipe_is_set():
    model = nnx.eval_shape(lambda: zoo.models.llama3(tiny("llama3"), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"group=3 does not divide the 4 layers of Llama.layers"):
        model.set_recipe(zoo.Recipe("g", group=3))
    with pytest.raises(ValueError, match=r"offloads \['mlpwi_0'\], which seq_tiles=2 makes inside sequence tiles"):
        model.set_recipe(zoo.Recipe("t", offload=("mlpwi_0",), seq_tiles=2))
    with pytest.raises(ValueError, match="seq_tiles must be a positive int"):
        zoo.Recipe("t", seq_tiles=0)
    with pytest.raises(ValueError, match="recomputes nothing"):
        dataclasses.replace(zoo.Recipe.none(), group=2)
    with pytest.raises(ValueError, match="seq_tiles=3 does not divide the sequence length 16"):
        zoo.plan.plan(tiny("llama3"), zoo.Recipe.full(seq_tiles=3), batch=B, seq=S, peak=None)
    assert model.recipe == zoo.Recipe.none()


def test_a_groups_backward_holds_its_layer_inputs_and_what_they_keep_not_their_residuals():
    """Two-level checkpoints: differentiating one group of 4 layers (as its backward recomputes it), JAX keeps the 4
    layer inputs (the group's, named, and 3 more) and each layer's `group_keep` tensors, and nothing else of the
    layers; with the layers run plainly inside the group (no inner checkpoints) it keeps their intermediates."""
    model = nnx.eval_shape(lambda: zoo.models.llama3(tiny("llama3"), rngs=nnx.Rngs(0)))
    stack, x = model.layers, model.layers.abstract_input(B, S)
    recipe = zoo.Recipe("g", offload=CARRY, group=4, group_keep=CONTEXT)

    def saved(layer_policy):
        fn, state = stack.layer_fn(group=4, layer_policy=layer_policy)
        res = measure.residuals(lambda s, x: measure.sum_outputs(fn(s, x)), state, x)
        return [r for r in res if not r.source.startswith("from a constant") and "(module_at." not in r.source]

    two_level = saved(recipe.layer_policy())
    kept = sorted(r.tag for r in two_level if r.tag is not None)
    assert kept == sorted(["decoder_layer_input"] + 4 * list(CONTEXT))
    inputs = [r for r in two_level if r.tag is None]
    assert len(inputs) == 3 and all(r.shape == x.shape for r in inputs)
    plain = saved(jax.checkpoint_policies.everything_saveable)
    assert sum(r.nbytes for r in plain) > 2 * sum(r.nbytes for r in two_level)


SUBGROUPS = (zoo.Recipe.full("full_sub", group=4, subgroup=2, seq_tiles=2),
             zoo.Recipe("carry_sub", offload=CARRY, group=4, subgroup=2, group_keep=CONTEXT))


def test_subgroups_leave_the_gradients_unchanged_and_the_plan_is_what_jax_saves():
    """Three-level checkpoints (4 layers in one group, in subgroups of 2): the loss and gradients of recipe `none`
    (float32, relative 1e-5); the plan's saved bytes in HBM and on the host equal JAX's own residuals of the scanned
    stack, with no warning; and the recompute the plan counts grows by the subgroups' forward pass."""
    cfg = dataclasses.replace(tiny("llama3"), num_layers=8)   # two groups: the stack's scan runs
    model = zoo.models.llama3(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (B, S), 0, cfg.vocab_size, dtype=jnp.int32)
    loss0, grads0 = grads_under(model, zoo.Recipe.none(), tokens)
    for r in SUBGROUPS:
        loss, grads = grads_under(model, r, tokens)
        assert abs(float(loss) - float(loss0)) < 1e-5 and max_rel_err(grads, grads0) < 1e-5, r.name
        p = zoo.plan.plan(cfg, r, batch=B, seq=S, peak=None)
        assert not p.warnings, (r.name, p.warnings)
        device, host, hoisted = measure.stack_residuals(model, "layers", B, S, r.policy(), group=4,
                                                        tiles=r.seq_tiles, layer_policy=r.layer_policy(), subgroup=2)
        assert (p.host_bytes, p.activation_bytes) == (host, device + hoisted), r.name
        assert (host > 0) == bool(r.offload), r.name   # the offloaded layer inputs are host residuals
        two_levels = zoo.plan.plan(cfg, dataclasses.replace(r, subgroup=1), batch=B, seq=S, peak=None)
        assert p.remat_flops > two_levels.remat_flops, r.name


def test_a_group_in_subgroups_holds_its_subgroups_inputs_and_a_subgroup_its_layers_inputs():
    """Differentiating one group of 4 layers in subgroups of 2 (as the group's backward recomputes it), JAX keeps the
    group's input (named), its other subgroup's input and each layer's `group_keep` tensors: two layer inputs fewer
    than two levels; one subgroup's backward keeps its other layer's input. The planner's working bytes of the group
    are one layer input fewer than two levels'."""
    model = nnx.eval_shape(lambda: zoo.models.llama3(tiny("llama3"), rngs=nnx.Rngs(0)))
    stack, x = model.layers, model.layers.abstract_input(B, S)
    recipe = SUBGROUPS[1]

    def saved(group, subgroup=1):
        fn, state = stack.layer_fn(group=group, layer_policy=recipe.layer_policy(), subgroup=subgroup)
        res = measure.residuals(lambda s, x: measure.sum_outputs(fn(s, x)), state, x)
        return [r for r in res if not r.source.startswith("from a constant") and "(module_at." not in r.source
                and "(grouped." not in r.source]

    two_levels, three_levels = saved(4), saved(4, 2)
    context = sum(measure.nbytes(s) for t, s in model.tag_shapes(B, S)["layers"].tags.items() if t in CONTEXT)
    assert sum(r.nbytes for r in three_levels) == measure.nbytes(x) * 2 + 4 * context
    assert sum(r.nbytes for r in two_levels) - sum(r.nbytes for r in three_levels) == 2 * measure.nbytes(x)
    assert [r.shape for r in saved(2) if r.tag is None] == [x.shape]
    working = {sub: measure.working_bytes(model, "layers", B, S, dataclasses.replace(recipe, subgroup=sub), 4)
               for sub in (1, 2)}
    assert working[1] - working[2] == measure.nbytes(x)


def lead_recipe(where: str = "offload") -> zoo.Recipe:
    """Groups of 2, the layer input offloaded, each layer keeping the kernel's pair while its group's backward runs
    and the first layer of each group keeping it between the passes, `where` ("device" or "offload")."""
    return zoo.Recipe(f"lead_{where}", offload=CARRY, seq_tiles=2, group=2, group_keep=CONTEXT,
                      **{f"lead_{where}": CONTEXT})


def test_a_groups_first_layer_keeping_the_pair_leaves_the_gradients_unchanged(case):
    name, model, tokens, (loss0, grads0) = case
    for r in (lead_recipe("device"), lead_recipe("offload")):
        loss, grads = grads_under(model, r, tokens)
        assert abs(float(loss) - float(loss0)) < 1e-5 and max_rel_err(grads, grads0) < 1e-5, r.name


def test_the_plan_of_a_groups_first_layer_keeping_the_pair_is_what_jax_saves(built):
    """Per stack, the plan's bytes in HBM and on the host equal JAX's residuals of the scanned stack with each group's
    first layer keeping the kernel's pair (one layer in 2: its `@lead` rows hold half a layer's pair per layer,
    where the recipe puts them), with no warning; and the plan prices one attention forward fewer per group."""
    name, model = built
    for where in ("device", "offload"):
        r = lead_recipe(where)
        model.set_recipe(r)
        p = zoo.plan.plan(model.config, r, batch=B, seq=S, peak=None)
        assert not p.warnings, (r.name, p.warnings)
        without = zoo.plan.plan(model.config, dataclasses.replace(r, **{f"lead_{where}": ()}), batch=B, seq=S,
                                peak=None)
        for sp, sp0 in zip(p.stacks, without.stacks):
            group = model.stack_group(sp.name, r.group)
            device, host, hoisted = measure.stack_residuals(model, sp.name, B, S, r.policy(), group=group,
                                                            tiles=r.seq_tiles, layer_policy=r.layer_policy(),
                                                            lead_policy=r.lead_policy())
            assert (sp.host_bytes, sp.device_bytes) == (host, device + hoisted), (r.name, sp.name)
            lead = {t.tag: t for t in sp.tags if t.tag.endswith("@lead")}
            if group == 1 or "attention_out" not in {t.tag for t in sp.tags}:
                assert not lead, sp.name
                continue
            pair = {t.tag: t.nbytes for t in sp0.tags if t.tag in CONTEXT}
            assert {t: (lp.placement, lp.nbytes) for t, lp in lead.items()} == {
                f"{t}@lead": (where, pair[t] // group) for t in CONTEXT}
            assert sp0.remat_attention_flops - sp.remat_attention_flops == sp.attention_flops // group, sp.name


def test_a_groups_first_layer_under_query_tiles_is_refused_by_name():
    cfg = dataclasses.replace(tiny("llama3"), attention_tiles=2)
    model = nnx.eval_shape(lambda: zoo.models.llama3(cfg, rngs=nnx.Rngs(0)))
    r = zoo.Recipe("lead", offload=CARRY, group=2, lead_device=CONTEXT)
    with pytest.raises(ValueError, match=r"keeps or offloads \['attention_out', 'context'\], which attention_tiles=2"):
        model.set_recipe(r)


def test_subgroups_must_divide_the_group_and_be_smaller():
    for group, subgroup in ((4, 3), (4, 4), (1, 2)):
        with pytest.raises(ValueError, match=f"subgroup={subgroup} must divide group={group} and be smaller"):
            zoo.Recipe.full(group=group, subgroup=subgroup)
    with pytest.raises(ValueError, match="subgroup must be a positive int, got True"):
        zoo.Recipe.full(group=4, subgroup=True)
    assert "the layer input kept every 4 layers, in subgroups of 2" in str(SUBGROUPS[0])


def test_group_keep_is_refused_without_groups_and_named_in_the_recipe():
    with pytest.raises(ValueError, match="group_keep=.* needs layer groups"):
        zoo.Recipe("k", group_keep=CONTEXT)
    with pytest.raises(ValueError, match="only pay together"):
        zoo.Recipe("k", group=2, group_keep=("context",))
    assert "['attention_out', 'context'] kept while a group's backward runs" in str(
        zoo.Recipe("k", group=2, group_keep=CONTEXT))


@pytest.mark.slow
def test_two_level_groups_compile_to_fewer_temporaries_than_one_level():
    """The structure the stack keeps is the one that measures lower: 8 layers of width 1,024 at 1,024 positions in
    groups of 4, differentiated and compiled for the CPU; each layer rematerialized inside its group (two levels) takes
    under 60% of XLA's temporaries of the layers run plainly inside the group (one level), under a recipe keeping the
    kernel's pair and under `full`. (With CSE allowed between the group's recompute and each layer's, XLA merges them
    and the two levels keep 95% of one level's.)"""
    cfg = zoo.models.LlamaConfig.preset("tiny", num_layers=8, dim=1024, num_heads=8, num_kv_heads=2, head_dim=128,
                                        mlp_dim=4096, dtype="float32", param_dtype="float32")
    stack = nnx.eval_shape(lambda: zoo.models.llama3(cfg, rngs=nnx.Rngs(0))).layers
    graphdef, state = nnx.split(stack)
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)

    def temporaries(recipe, layer_policy):
        body = stack_lib.remat(lambda m, x: stack_lib.group_body(m, x, 1, layer_policy), recipe.policy())

        def loss(s, x):
            layers = stack_lib.grouped(nnx.merge(graphdef, s).layers, 4)
            y, _ = nnx.scan(body, in_axes=(0, nnx.Carry), out_axes=(nnx.Carry, 0))(layers, x)
            return jnp.sum(y.astype(jnp.float32) ** 2)
        compiled = jax.jit(jax.grad(loss)).lower(state, stack.abstract_input(1, 1024)).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    for recipe in (zoo.Recipe("ctx", device=CONTEXT, group=4), zoo.Recipe.full(group=4)):
        assert temporaries(recipe, recipe.layer_policy()) < 0.6 * temporaries(recipe, None), recipe.name


@pytest.mark.parametrize("group", [1, 2])
def test_the_forward_pass_leaves_the_stacks_parameters_the_ones_it_was_given(group):
    """After the stack runs, its layers hold the very arrays they held before (the traced function returns its input
    variables unchanged), not the stacked state `nnx.scan` returns: were they that output, everything after the
    forward pass (the optimizer's update) would read a copy of every layer's parameters, held in HBM from the forward
    pass to the update."""
    from zoo.layers import MLP

    stack = stack_lib.Stack(lambda rngs: MLP(dim=8, hidden=16, rngs=rngs), num_layers=4, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(stack)

    def forward(state, x):
        s = nnx.merge(graphdef, state)
        s(x, jax.checkpoint_policies.nothing_saveable, group=group)
        return nnx.state(s)

    jaxpr = jax.make_jaxpr(forward)(state, jnp.ones((2, 4, 8))).jaxpr
    n = len(jax.tree.leaves(state))
    assert len(jaxpr.outvars) == n and all(o is i for o, i in zip(jaxpr.outvars, jaxpr.invars[:n]))
