"""The MoE layer's grouped-matmul backends: host offload with a loop-holding grouped matmul inside the layer (a
stand-in for tokamax's kernel, plain and through `zoo.layers.grouped_matmul`'s custom VJP) lands as planned and
computes what ragged_dot does; the auto backend per device."""
import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zoo
from tests.helpers import cuda_lowering, fake_gpu, hlo_type, pinned_host_shapes, tiered
from zoo.layers.moe import backend as moe
from zoo.plan import measure

CPU = jax.devices()[0]
# The recipes these tests place tensors by (the library's tests build their own values, not the application's sets):
# DeepSeek-V3's study recipe and its low-rank variant.
MOE_UP = ("moe_mlpwi_0", "moe_mlpwi_1")
RECIPES = {"mla_moe_offload": zoo.Recipe("mla_moe_offload", offload=("query_proj", "key_proj", "value_proj") + MOE_UP),
           "lowrank_wa_offload": zoo.Recipe("lowrank_wa_offload", offload=("query_wa_proj", "kv_wa_proj") + MOE_UP)}


def scan_grouped_matmul(rows, weights, group_sizes):
    """A stand-in for tokamax's kernel: `jax.lax.ragged_dot`'s contract computed by a scan over the experts (each
    step multiplies the rows of its group), with no tag and no offload inside, as tokamax's jaxpr has."""
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    row = jnp.arange(rows.shape[0])

    def step(acc, e):
        mine = ((row >= starts[e]) & (row < ends[e]))[:, None]
        return acc + jnp.where(mine, rows @ weights[e], 0).astype(acc.dtype), None

    out, _ = jax.lax.scan(step, jnp.zeros((rows.shape[0], weights.shape[-1]), rows.dtype),
                          jnp.arange(weights.shape[0]))
    return out


@pytest.fixture
def scan_backend(monkeypatch):
    """moe_backend='tokamax' served by the scan stand-in (whether or not tokamax is installed)."""
    monkeypatch.setitem(moe.GROUPED_MATMULS, "tokamax", lambda: scan_grouped_matmul)
    monkeypatch.setattr(moe, "tokamax_status", lambda: (True, "scan stand-in"))


def _stand_in_op_for(problem, k, n):
    """The three problems of `zoo.layers.grouped_matmul.make` as the GPU runs them, on the CPU: the forward and the
    rows' gradient through the looping stand-in, the experts' gradient as a ragged contraction."""
    if problem == "drhs":
        return lambda lhs, rhs, *, group_sizes, ragged_dot_dimension_numbers: jax.lax.ragged_dot_general(
            lhs, rhs, group_sizes, ragged_dot_dimension_numbers)
    return lambda lhs, rhs, *, group_sizes: scan_grouped_matmul(lhs, rhs, group_sizes)


@pytest.fixture
def tiled_backend(monkeypatch):
    """moe_backend='tokamax' as it runs on the H200 with measured tiles: `grouped_matmul.make`'s custom VJP, each
    problem a looping stand-in for the kernel."""
    from zoo.layers import grouped_matmul
    monkeypatch.setitem(moe.GROUPED_MATMULS, "tokamax", lambda: grouped_matmul.make(_stand_in_op_for))
    monkeypatch.setattr(moe, "tokamax_status", lambda: (True, "custom-VJP stand-in"))


CFG = zoo.models.DeepSeekV3Config.preset("tiny")
B, S = 2, 8
STACKS = ("dense_layers", "moe_layers")


def test_the_stand_in_equals_ragged_dot_and_really_loops():
    rows = jax.random.normal(jax.random.key(0), (12, 5))
    w = jax.random.normal(jax.random.key(1), (3, 5, 4))
    sizes = jnp.array([5, 0, 7], jnp.int32)
    np.testing.assert_allclose(np.asarray(scan_grouped_matmul(rows, w, sizes)),
                               np.asarray(jax.lax.ragged_dot(rows, w, sizes)), rtol=1e-5, atol=1e-5)
    assert "scan[" in str(jax.make_jaxpr(scan_grouped_matmul)(rows, w, sizes))


@pytest.mark.parametrize("backend", ["scan_backend", "tiled_backend"])
@pytest.mark.parametrize("name", ["mla_moe_offload", "lowrank_wa_offload"])
def test_offload_lands_as_planned_with_a_looping_grouped_matmul(backend, name, request):
    request.getfixturevalue(backend)
    recipe = RECIPES[name]
    model = zoo.models.deepseek_v3(dataclasses.replace(CFG, moe_backend="tokamax"), recipe=recipe, rngs=nnx.Rngs(0))
    # the MoE layer really holds a loop now, and the guard lets it through
    graphdef, state = model.moe_layers.abstract_layer()
    x = jax.ShapeDtypeStruct((B, S, CFG.dim), jnp.float32)
    assert "scan[" in str(jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, x))
    tokens = jax.random.randint(jax.random.key(1), (B, S), 0, CFG.vocab_size, dtype=jnp.int32)
    want_host, want_hlo = collections.Counter(), collections.Counter()
    for stack in STACKS:
        needed = measure.residual_tags(model, stack)
        seen = measure.placements_seen(model, stack, B, S)
        assert {t: seen[t] for t in needed} == {t: recipe.placement(t) for t in needed}, stack
        st = model.tag_shapes(B, S)[stack]
        offloaded = [t for t in recipe.offload if t in needed]
        assert stack == "dense_layers" or {"moe_mlpwi_0", "moe_mlpwi_1"} <= set(offloaded)
        want_host.update((st.num_layers,) + st.tags[t].shape for t in offloaded)
        want_hlo.update(hlo_type(st.tags[t].shape, st.tags[t].dtype) for t in offloaded)
    res = measure.model_residuals(model, tokens)
    assert collections.Counter(r.shape for r in res if r.host) == want_host
    assert pinned_host_shapes(cuda_lowering(model, tokens)) == want_hlo


@pytest.mark.parametrize("backend", tiered(["scan_backend", "tiled_backend"], fast=("scan_backend",)))
def test_the_stand_in_backend_matches_ragged_dot_in_the_model(backend, request):
    """Outputs, and for the custom-VJP path every gradient, equal the ragged_dot backend's."""
    request.getfixturevalue(backend)
    tokens = jax.random.randint(jax.random.key(1), (B, S), 0, CFG.vocab_size, dtype=jnp.int32)
    ref = zoo.models.deepseek_v3(CFG, rngs=nnx.Rngs(0))
    got = zoo.models.deepseek_v3(dataclasses.replace(CFG, moe_backend="tokamax"), rngs=nnx.Rngs(0))
    forward = nnx.jit(lambda m: m(tokens))   # compiled: op-by-op dispatch through the scan is the slow part
    np.testing.assert_allclose(np.asarray(forward(got)), np.asarray(forward(ref)), rtol=1e-5, atol=1e-5)
    if backend == "tiled_backend":
        grad = nnx.jit(nnx.grad(lambda m: jnp.sum(m(tokens) ** 2)))
        g_ref, g_got = grad(ref), grad(got)
        for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_got)):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-4, atol=2e-5)


def test_moe_auto_backend_per_device(monkeypatch):
    assert moe.backend_choice("auto", device=CPU)[0] == "ragged_dot"
    monkeypatch.setattr(moe, "tokamax_status", lambda: (True, "tokamax 0.0.17"))
    assert moe.backend_choice("auto", dtype=jnp.bfloat16, device=fake_gpu())[0] == "tokamax"
    name, why = moe.backend_choice("auto", dtype=jnp.float32, device=fake_gpu())
    assert name == "capacity" and "bf16/fp16" in why
    monkeypatch.setattr(moe, "tokamax_status", lambda: (False, "tokamax does not import"))
    name, why = moe.backend_choice("auto", dtype=jnp.bfloat16, device=fake_gpu())
    assert name == "capacity" and "does not import" in why
    assert moe.backend_choice("capacity", device=fake_gpu())[0] == "capacity"  # explicit wins
