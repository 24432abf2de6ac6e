"""The mixture-of-experts layer (zoo.layers.moe.layer, with zoo.layers.moe.experts) as a unit, DeepSeek-V3's
(group-limited router with its bias, a shared expert) and Qwen3-MoE's (softmax top-k, norm_topk_prob, no shared
expert): output and aux shapes, the tags and their shapes for each dispatch backend, the output against every
(token, expert) pair computed on its own, gradients of the output w.r.t. the input and the parameters against
finite differences in float64, and against transformers' `DeepseekV3MoE` and `Qwen3MoeSparseMoeBlock` under torch
autograd (float32, relative 1e-5)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

from tests.helpers import tiered
from tests.layers import reference as ref
from tests.layers.random_layers import jitted, random_layer
from zoo.emitted import emitted_by
from zoo.hf.keymap import ROUTED_EXPERTS
from zoo.layers import MLP
from zoo.layers.moe import Experts, GroupLimitedRouter, MoE, SoftmaxRouter, capacity
from zoo.models.deepseek_v3.hf import MOE as DEEPSEEK_MOE

B, S, D, E, K, F = 2, 8, 16, 8, 2, 12
ROWS = B * S * K                                 # token copies
CAPACITY_FACTOR = 1.25
C = capacity(ROWS, E, CAPACITY_FACTOR)           # rows per expert under capacity dispatch
GROUPED = dict(n_group=4, topk_group=2, routed_scaling_factor=2.5)

# The tags the layer emits for an input [B, S, D], by backend: {tag: shape}, in the layer's dtype. This is the one
# place to update when the layer's tags change. (Compared as a dict: the order is not asserted.)
EXPERT_TAGS = {
    "ragged_dot": {"moe_mlpwi_0": (ROWS, F), "moe_mlpwi_1": (ROWS, F), "moe_mlpwo": (ROWS, D)},   # sorted copies
    "capacity": {"moe_mlpwi_0": (E, C, F), "moe_mlpwi_1": (E, C, F), "moe_mlpwo": (E, C, D)},    # [E, C] buffers
}
SHARED_TAGS = {"shared_mlpwi_0": (B, S, F), "shared_mlpwi_1": (B, S, F), "shared_mlpwo": (B, S, D)}
KINDS = ("deepseek-v3", "qwen3-moe")


def make_moe(kind, backend="ragged_dot", dtype=jnp.float32, seed=0, capacity_factor=CAPACITY_FACTOR) -> MoE:
    """The layer with random weights and (DeepSeek-V3) a random routing bias."""
    def make():
        rngs = nnx.Rngs(seed)
        common = dict(dim=D, num_experts=E, k=K, param_dtype=dtype, rngs=rngs)
        if kind == "deepseek-v3":
            router = GroupLimitedRouter(**common, **GROUPED)
            shared = MLP(dim=D, hidden=F, tag_prefix="shared_", dtype=dtype, param_dtype=dtype, rngs=rngs)
        else:
            router, shared = SoftmaxRouter(**common, norm_topk_prob=True), None
        experts = Experts(num_experts=E, dim=D, hidden=F, dtype=dtype, param_dtype=dtype, rngs=rngs)
        return MoE(dim=D, router=router, experts=experts, shared=shared, backend=backend,
                   capacity_factor=capacity_factor, dtype=dtype)
    return random_layer(make, seed)


def inputs(dtype=np.float32, seed=1):
    return np.random.default_rng(seed).normal(size=(B, S, D)).astype(dtype)


def reference(moe, x):
    """The layer's output from the reference router's choice and every (token, expert) pair on its own."""
    router, ex = moe.gate, moe.experts
    flat = x.reshape(B * S, D)
    logits = flat @ router.kernel[...]
    if isinstance(router, GroupLimitedRouter):
        scores = ref.sigmoid(logits)
        idx = ref.group_limited_choice(scores, router.e_score_correction_bias[...], k=K, **{
            k: GROUPED[k] for k in ("n_group", "topk_group")})
        weights = ref.chosen_weights(scores, idx, normalise=True, scale=GROUPED["routed_scaling_factor"])
    else:
        scores = ref.softmax(logits)
        idx = ref.softmax_choice(scores, k=K)
        weights = ref.chosen_weights(scores, idx, normalise=True)
    y = ref.moe(flat, idx, weights, ex.gate_proj[...], ex.up_proj[...], ex.down_proj[...]).reshape(B, S, D)
    if moe.shared_experts is not None:
        sh = moe.shared_experts
        y = y + ref.swiglu(x, sh.gate_proj.kernel[...], sh.up_proj.kernel[...], sh.down_proj.kernel[...])
    return y, idx


@pytest.mark.parametrize("case", tiered([f"{k}/{b}" for k in KINDS for b in sorted(EXPERT_TAGS)],
                                         fast=("deepseek-v3/capacity", "qwen3-moe/ragged_dot")))
def test_shapes_and_tags(case):
    kind, backend = case.split("/")
    moe = make_moe(kind, backend)
    y, aux = jax.eval_shape(moe, jax.ShapeDtypeStruct((B, S, D), jnp.float32))
    assert y.shape == (B, S, D)
    assert (aux.load.shape, aux.balance_loss.shape, aux.dropped.shape) == ((E,), (), ())
    for dtype in (jnp.float32, jnp.bfloat16):
        layer = make_moe(kind, backend, dtype)
        want = EXPERT_TAGS[backend] | (SHARED_TAGS if kind == "deepseek-v3" else {})
        got = emitted_by(layer, jax.ShapeDtypeStruct((B, S, D), dtype))
        assert {t: (s.shape, s.dtype) for t, s in got.items()} == {t: (s, jnp.dtype(dtype)) for t, s in want.items()}
        assert layer.tag_shapes(B, S) == got


@pytest.mark.parametrize("kind", KINDS)
def test_matches_reference_and_gradients_float64(kind):
    with ref.float64():
        moe, x = make_moe(kind, dtype=jnp.float64), jnp.asarray(inputs(np.float64))
        y, aux = jitted(moe)(x)
        want, idx = reference(moe, x)
        assert y.dtype == jnp.float64
        assert ref.rel_err(y, want) < 1e-12
        np.testing.assert_array_equal(aux.load, np.bincount(idx.reshape(-1), minlength=E))
        assert int(aux.dropped) == 0
        graphdef, params, rest = nnx.split(moe, nnx.Param, ...)
        apply = jax.jit(lambda p, x: nnx.merge(graphdef, p, rest, copy=True)(x)[0])
        check_grads(apply, (params, x), order=1, modes=("rev",))


@pytest.mark.parametrize("kind", tiered(KINDS, fast=("deepseek-v3",)))
def test_capacity_backend_equals_dropless_when_nothing_drops(kind):
    x = jnp.asarray(inputs())
    dropless, _ = jitted(make_moe(kind))(x)
    roomy, aux = jitted(make_moe(kind, "capacity", capacity_factor=E / K))(x)   # C = every token: none can drop
    assert int(aux.dropped) == 0
    assert ref.rel_err(roomy, dropless) < 1e-6
    _, tight = jitted(make_moe(kind, "capacity", capacity_factor=0.5))(x)
    assert int(tight.dropped) > 0


def _torch_moe(kind, moe):
    import transformers
    if kind == "deepseek-v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
        cfg = transformers.DeepseekV3Config(hidden_size=D, num_attention_heads=2, n_routed_experts=E,
                                            num_experts_per_tok=K, moe_intermediate_size=F, n_shared_experts=1,
                                            norm_topk_prob=True, **GROUPED)
        return DeepseekV3MoE(cfg), DEEPSEEK_MOE
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    cfg = transformers.Qwen3MoeConfig(hidden_size=D, num_attention_heads=2, num_experts=E, num_experts_per_tok=K,
                                      moe_intermediate_size=F, norm_topk_prob=True)
    return Qwen3MoeSparseMoeBlock(cfg), ROUTED_EXPERTS


@pytest.mark.parametrize("kind", KINDS)
def test_matches_transformers_under_torch_autograd(hf, kind):
    moe, x = make_moe(kind), inputs()
    ct = inputs(seed=2)
    theirs, table = _torch_moe(kind, moe)
    rows = hf.unit_rows(table, "mlp.", "mlp.")
    hf.load(theirs, moe, rows)
    out, dx = hf.torch_vjp(theirs, x, ct)
    got, got_dx, got_params = hf.jax_vjp(moe, x, ct, forward=lambda m, x: m(x)[0])
    assert ref.rel_err(got, out) < 1e-5
    assert ref.rel_err(got_dx, dx) < 1e-5
    want = hf.grads(theirs, moe, rows)
    assert set(want) == set(got_params)
    for path in want:
        assert ref.rel_err(got_params[path], want[path]) < 1e-5, path
