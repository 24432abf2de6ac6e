"""Sharding: meshes, rules, parameters created sharded, activation constraints at the tag sites, expert parallelism.

The multi-device checks run in subprocesses with 8 fake CPU devices (the device count is fixed when JAX starts, and
every other test file sees one device): Llama tiny under fsdp=8, fsdp=4 x tp=2 and tp=2 (x dp=4), DeepSeek-V3 tiny
under fsdp=4 x tp=2 (dropless ragged_dot), ep=8 and fsdp=2 x ep=4 (capacity dispatch, GShard-style). Each compares the
loss and every gradient of a float32 training step under the offload recipe with one device's (relative error
< 1e-5), checks every parameter's sharding against the rules, and reads the lowered CUDA program to check that each
value moved to pinned host memory is the constrained (sharded) activation. XLA never falls back to replicating a
tensor to reshard it (no "Involuntary full rematerialization" while compiling any of these steps).
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import zoo
from tests.helpers import cpu_env
from zoo import sharding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- one device ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec,match", [
    ("fsdp=2,pp=4", "unknown axis 'pp'"),
    ("fsdp=3", "product of the axes is 3, but there are 8 devices"),
    ({"fsdp": 2, "tp": 2}, "product of the axes is 4, but there are 8 devices"),
    ("fsdp", "axis=size pairs"),
    ("fsdp=0,tp=8", "mesh: fsdp must be a positive int, got 0"),
])
def test_bad_mesh_specs_raise(spec, match):
    with pytest.raises(ValueError, match=match):
        sharding.parse_mesh(spec, 8)


def test_mesh_spec_defaults_to_fsdp_and_fills_missing_axes():
    assert sharding.parse_mesh(None, 8) == {"dp": 1, "fsdp": 8, "tp": 1, "ep": 1}
    assert sharding.parse_mesh("fsdp=2,tp=1,ep=4", 8) == {"dp": 1, "fsdp": 2, "tp": 1, "ep": 4}
    mesh = sharding.make_mesh()  # one device here
    assert mesh.axis_names == sharding.MESH_ORDER and mesh.devices.size == 1
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_rules_merge_the_parallelisms_and_name_every_logical_axis():
    rules = dict(sharding.rules_for(jax.sharding.AbstractMesh((1, 4, 2, 2), sharding.MESH_ORDER)))
    assert set(rules) == set(sharding.LOGICAL)
    assert rules["batch"] == ("fsdp", "ep") and rules["exp_batch"] == "fsdp" and rules["embed"] == "fsdp"
    assert rules["heads"] == rules["mlp"] == rules["vocab"] == "tp" and rules["experts"] == "ep"
    assert rules["layers"] is rules["head_dim"] is rules["q_lora"] is rules["seq"] is None
    assert all(v is None for v in dict(sharding.rules_for(sharding.make_mesh())).values())


@pytest.mark.parametrize("model", ["llama", "deepseek"])
def test_every_parameter_axis_has_a_rule(model):
    """The rules cover every logical name the parameters carry (an unnamed one would silently stay whole)."""
    if model == "llama":
        m = nnx.eval_shape(lambda: zoo.models.llama3(zoo.models.LlamaConfig.preset("tiny"), rngs=nnx.Rngs(0)))
    else:
        m = nnx.eval_shape(lambda: zoo.models.deepseek_v3(zoo.models.DeepSeekV3Config.preset("tiny"), rngs=nnx.Rngs(0)))
    names = {n for spec in jax.tree.leaves(sharding.logical_specs(nnx.state(m)),
                                           is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
             for n in spec}
    assert names and names <= set(sharding.LOGICAL), names - set(sharding.LOGICAL)


@pytest.mark.parametrize("cfg,mesh,batch,match", [
    (zoo.models.LlamaConfig.preset("tiny"), {"tp": 8}, None, r"tp=8 does not divide LlamaConfig.num_heads=4"),
    (zoo.models.LlamaConfig.preset("tiny", num_heads=8), {"tp": 4}, None,
     r"tp=4 does not divide LlamaConfig.num_kv_heads=2"),
    (zoo.models.LlamaConfig.preset("tiny", mlp_dim=129), {"tp": 2, "fsdp": 4}, None,
     r"tp=2 does not divide LlamaConfig.mlp_dim=129"),
    (zoo.models.LlamaConfig.preset("tiny"), {"fsdp": 8}, 4, r"the batch 4 is not divisible by dp x fsdp x ep = 8"),
    (zoo.models.LlamaConfig.preset("tiny", dim=60, num_heads=4, head_dim=16), {"fsdp": 8}, None,
     r"fsdp=8 does not divide LlamaConfig.dim=60"),
    (zoo.models.DeepSeekV3Config.preset("tiny"), {"ep": 16}, None,
     r"ep=16 does not divide DeepSeekV3Config.num_experts=8"),
    (zoo.models.DeepSeekV3Config.preset("tiny"), {"fsdp": 2, "ep": 4}, 6,
     r"the batch 6 is not divisible by dp x fsdp x ep = 8"),
    (zoo.models.DeepSeekV3Config.preset("tiny"), {"tp": 8}, None, r"tp=8 does not divide DeepSeekV3Config.num_heads=4"),
])
def test_bad_meshes_for_a_model_raise_naming_both_numbers(cfg, mesh, batch, match):
    with pytest.raises(ValueError, match=match):
        sharding.check_mesh(cfg, mesh, batch=batch)


def test_per_device_shapes_on_an_abstract_mesh():
    """The planner's view: per-device shapes under a mesh of no devices (fsdp=4 x tp=2 x ep=2 of 16)."""
    mesh = jax.sharding.AbstractMesh((1, 4, 2, 2), sharding.MESH_ORDER)
    assert sharding.shard_shape((8, 128, 4, 16), sharding.BSH, mesh) == (1, 128, 2, 16)   # batch / (fsdp x ep)
    assert sharding.shard_shape((126, 16384, 128, 128), ("layers", "embed", "heads", "head_dim"), mesh) == (
        126, 4096, 64, 128)
    assert sharding.shard_shape((8, 64, 40), ("experts", "exp_batch", "moe_mlp"), mesh) == (4, 16, 20)
    with sharding.use(mesh):
        assert sharding.size_of("batch") == 8 and sharding.size_of("experts") == 2 and sharding.size_of("seq") == 1


def test_rules_apply_in_order_and_use_a_mesh_axis_once_per_array():
    """Priority semantics (fsdp=4 x tp=2 x ep=2 of 16): an activation [batch, seq, embed] gives fsdp to `batch`, whose
    rule comes first, and keeps `embed` whole; a parameter's `embed` takes fsdp; the constraint a tag site applies
    says the same. With `embed`'s rule first, `embed` takes fsdp and `batch`, whose rule needs fsdp too, stays whole.
    (A plain name lookup would give the activation P(('fsdp', 'ep'), None, 'fsdp'), which JAX rejects.)"""
    P = jax.sharding.PartitionSpec
    mesh = sharding.abstract_mesh("fsdp=4,tp=2,ep=2", 16)
    rules = sharding.rules_for(mesh)
    assert sharding.mesh_spec(sharding.BSD, rules) == P(("fsdp", "ep"), None, None)
    assert sharding.mesh_spec(("embed", "mlp"), rules) == P("fsdp", "tp")
    assert sharding.shard_shape((8, 16, 64), sharding.BSD, mesh) == (1, 16, 64)
    assert sharding.shard_shape((64, 32), ("embed", "mlp"), mesh) == (16, 16)
    with sharding.use(mesh):
        jaxpr = jax.make_jaxpr(lambda x: sharding.constrain(x, sharding.BSD))(jax.ShapeDtypeStruct((8, 16, 64),
                                                                                                  jnp.float32))
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "sharding_constraint"]
    assert eqn.params["sharding"].spec == P(("fsdp", "ep"), None, None)
    embed_first = (("embed", "fsdp"), ("batch", ("fsdp", "ep")))
    assert sharding.mesh_spec(sharding.BSD, embed_first) == P(None, None, "fsdp")


@pytest.mark.parametrize("model,spec", [("llama", "fsdp=4,tp=2"), ("llama", "dp=2,fsdp=4"),
                                        ("deepseek", "fsdp=2,ep=4"), ("deepseek", "ep=8")])
def test_offloaded_bytes_per_device_are_the_plan_over_the_shards(model, spec):
    """Traced on an abstract 8-device mesh: every tag the offload recipe moves to host memory is split over all 8
    devices (per-device bytes = one device's plan / 8); read from the constraint at each tag site."""
    if model == "llama":
        from recipes.llama3 import RECIPES
        recipe = RECIPES["qkv_offload"]
        m = nnx.eval_shape(lambda: zoo.models.llama3(zoo.models.LlamaConfig.preset("tiny"), rngs=nnx.Rngs(0)))
    else:
        from recipes.deepseek_v3 import RECIPES
        recipe = RECIPES["mla_moe_offload"]
        cfg = zoo.models.DeepSeekV3Config.preset("tiny", moe_backend="capacity", capacity_factor=4.0)
        m = nnx.eval_shape(lambda: zoo.models.deepseek_v3(cfg, rngs=nnx.Rngs(0)))
    mesh = sharding.abstract_mesh(spec, 8)
    per_device = sharding.tag_shard_shapes(m, 8, 16, mesh)
    offloaded = 0
    for stack, st in m.tag_shapes(8, 16).items():
        for tag, sds in st.tags.items():
            if recipe.placement(tag) == "offload":
                offloaded += 1
                shard = per_device[stack][tag]
                assert 8 * math.prod(shard) == math.prod(sds.shape), (stack, tag, shard)
    assert offloaded >= 3


def test_constraints_are_no_ops_without_a_mesh():
    """Outside `sharding.use` the tag sites add no sharding constraint; inside, each tagged value gets one."""
    model = zoo.models.llama3(zoo.models.LlamaConfig.preset("tiny"), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros((2, 8), jnp.int32)
    plain = str(jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(tokens))(state))
    assert "sharding_constraint" not in plain
    with sharding.use(sharding.make_mesh()):
        constrained = str(jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(tokens))(state))
    assert constrained.count("sharding_constraint") >= 9  # decoder_layer_input, q, k, v, attention_out, ... per layer


def test_create_without_a_mesh_is_the_plain_build():
    cfg = zoo.models.LlamaConfig.preset("tiny")
    a = sharding.create(zoo.models.llama3, cfg, seed=3)
    b = zoo.models.llama3(cfg, rngs=nnx.Rngs(3))
    pairs = zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b)))
    assert all(bool(jnp.array_equal(x, y)) for x, y in pairs)


# -- 8 fake devices ----------------------------------------------------------------------------------------------------
REMAT = "Involuntary full rematerialization"


def run_8(case: str) -> str:
    # No compilation cache: XLA's SPMD partitioner warns only while it compiles, and every program is new here.
    out = subprocess.run([sys.executable, "-m", "tests.sharded_steps", case],
                         env=cpu_env(8, JAX_ENABLE_COMPILATION_CACHE="false"), cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout[-3000:] + out.stderr[-3000:]
    # A resharding XLA cannot do replicates the whole tensor on every device: a layout the zoo must avoid.
    assert REMAT not in out.stderr, [line[:400] for line in out.stderr.splitlines() if REMAT in line]
    return out.stdout


@pytest.mark.slow   # the main job's mesh runs in tests/train/test_mesh_train.py compare the same
@pytest.mark.multidevice
def test_llama_sharded_training_step_equals_one_device():
    """fsdp=8, fsdp=4 x tp=2, dp=4 x tp=2 under qkv_offload, and fsdp=4 x tp=2 with each group's first layer
    offloading the attention kernel's pair: loss and gradients as on one device, parameters on the rules' shardings
    (never whole on one device), the offloaded tensors as batch/heads-sharded values."""
    print(run_8("llama"))


@pytest.mark.slow   # the full set (-m 'slow or not slow'); see docs/testing.md
@pytest.mark.multidevice
def test_deepseek_sharded_training_step_equals_one_device():
    """fsdp=4 x tp=2 (ragged_dot), ep=8 and fsdp=2 x ep=4 (capacity, experts over ep) under mla_moe_offload: loss,
    gradients and the global expert load as on one device; the offloaded MoE buffers are sharded experts->ep."""
    print(run_8("deepseek"))


@pytest.mark.slow   # the default set streams on one device (tests/test_params_stream.py)
@pytest.mark.multidevice
def test_streamed_parameters_under_fsdp_equal_one_device():
    """--params stream under fsdp=8: loss and state as on one device, the stacks' parameters sharded in pinned host
    memory (tests/sharded_steps.py stream)."""
    print(run_8("stream"))
