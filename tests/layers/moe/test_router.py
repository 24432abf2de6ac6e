"""The routers (zoo.layers.moe.router) as units: DeepSeek-V3's group-limited top-k with its selection bias, and the
softmax top-k of Qwen3-MoE / Mixtral (with and without norm_topk_prob). Shapes, no tags, the choice against a
per-token NumPy reference, the weights and their gradients (w.r.t. the tokens and the router kernel) against the
reference's in float64 and finite differences, both balance losses and their gradients, and transformers'
`DeepseekV3TopkRouter`, `Qwen3MoeTopKRouter` and `load_balancing_loss_func` under torch autograd (float32)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

from tests.helpers import tiered
from tests.layers import reference as ref
from tests.layers.random_layers import jitted, random_layer
from zoo.emitted import emitted
from zoo.hf.keymap import ROUTED_EXPERTS
from zoo.layers.moe import GroupLimitedRouter, SoftmaxRouter, sequence_balance_loss, switch_balance_loss
from zoo.models.deepseek_v3.hf import MOE as DEEPSEEK_MOE

T, D, E, K = 16, 16, 8, 2
GROUPED = dict(num_experts=E, k=K, n_group=4, topk_group=2, routed_scaling_factor=2.5)


def make_router(kind, dtype=jnp.float32, seed=0, **kw):
    """A router with random weights and, for the group-limited one, a random bias (zero would hide a bias ignored
    or used in the weights)."""
    if kind == "group-limited":
        return random_layer(lambda: GroupLimitedRouter(dim=D, param_dtype=dtype, rngs=nnx.Rngs(seed),
                                                       **{**GROUPED, **kw}), seed)
    return random_layer(lambda: SoftmaxRouter(dim=D, num_experts=E, k=K, param_dtype=dtype, rngs=nnx.Rngs(seed),
                                              **kw), seed)


def tokens(dtype=np.float32, seed=1):
    return np.random.default_rng(seed).normal(size=(T, D)).astype(dtype)


def reference_route(router, x, kernel=None, idx=None):
    """(scores, chosen indices [T, k], weights) of the reference for `router`'s settings, bias and kernel (or
    `kernel`); given `idx`, those experts' weights (differentiable: the choice is NumPy's)."""
    logits = x @ (router.kernel[...] if kernel is None else kernel)
    if isinstance(router, GroupLimitedRouter):
        scores = ref.sigmoid(logits)
        if idx is None:
            idx = ref.group_limited_choice(scores, router.e_score_correction_bias[...], k=router.k,
                                           n_group=router.n_group, topk_group=router.topk_group)
        return scores, idx, ref.chosen_weights(scores, idx, normalise=router.norm_topk_prob,
                                               scale=router.routed_scaling_factor)
    probs = ref.softmax(logits)
    idx = ref.softmax_choice(probs, k=router.k) if idx is None else idx
    return probs, idx, ref.chosen_weights(probs, idx, normalise=router.norm_topk_prob)


def dense(weights, idx):
    """[T, k] weights of the chosen experts -> [T, E] (zero elsewhere): independent of the order of the k."""
    return jnp.zeros((weights.shape[0], E), weights.dtype).at[jnp.arange(weights.shape[0])[:, None], idx].set(weights)


ROUTERS = {"group-limited": {}, "group-limited-unnormalised": dict(norm_topk_prob=False),
           "softmax": {}, "softmax-unnormalised": dict(norm_topk_prob=False)}


def _make(name, dtype=jnp.float32):
    return make_router(name.split("-unnormalised")[0], dtype, **ROUTERS[name])


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_shapes_and_no_tags(name):
    router = _make(name)
    x = jnp.asarray(tokens())
    scores, weights, idx = jitted(router)(x)
    assert (scores.shape, weights.shape, idx.shape) == ((T, E), (T, K), (T, K))
    assert (scores.dtype, weights.dtype, idx.dtype) == (jnp.float32, jnp.float32, jnp.int32)
    assert emitted(lambda x: router(x), x.astype(jnp.bfloat16)) == {}


@pytest.mark.parametrize("name", tiered(sorted(ROUTERS), fast=("group-limited", "softmax-unnormalised")))
def test_choice_weights_and_gradients_float64(name):
    with ref.float64():
        router, x = _make(name, jnp.float64), jnp.asarray(tokens(np.float64))
        scores, weights, idx = jitted(router)(x)
        want_scores, want_idx, want_weights = reference_route(router, x)
        np.testing.assert_array_equal(np.sort(idx, axis=1), np.sort(want_idx, axis=1))
        assert ref.rel_err(scores, want_scores) < 1e-13
        assert ref.rel_err(dense(weights, idx), dense(want_weights, want_idx)) < 1e-13
        graphdef, params, rest = nnx.split(router, nnx.Param, ...)

        def route(p, x):
            scores, weights, idx = nnx.merge(graphdef, p, rest, copy=True)(x)
            return scores, dense(weights, idx)
        check_grads(jax.jit(route), (params, x), order=1, modes=("rev",))
        ct = np.random.default_rng(2).normal(size=(T, E))
        got = jax.jit(jax.grad(lambda p, x: jnp.sum(route(p, x)[1] * ct), argnums=(0, 1)))(params, x)
        want = jax.jit(jax.grad(lambda w, x: jnp.sum(dense(reference_route(router, x, w, want_idx)[2], want_idx) * ct),
                                argnums=(0, 1)))(router.kernel[...], x)
        assert ref.rel_err((got[0]["kernel"][...], got[1]), want) < 1e-13


def test_choice_is_sharp():
    """The bias and the group limit both change some choices (the reference comparison would see either ignored)."""
    router, x = make_router("group-limited"), jnp.asarray(tokens())
    _, _, idx = jitted(router)(x)
    scores = np.asarray(jax.nn.sigmoid(x @ router.kernel[...]))
    bias = np.asarray(router.e_score_correction_bias[...])
    unbiased = ref.group_limited_choice(scores, np.zeros(E), k=K, n_group=4, topk_group=2)
    plain = np.argsort(-(scores + bias), axis=1)[:, :K]
    for other in (unbiased, plain):
        assert (np.sort(other, 1) != np.sort(np.asarray(idx), 1)).any()


def test_balance_losses_and_gradients_float64():
    batch = 2
    with ref.float64():
        rng = np.random.default_rng(3)
        logits = jnp.asarray(rng.normal(size=(T, E)))
        idx = ref.softmax_choice(np.asarray(logits), k=K)                           # NumPy: the references count
        seq = lambda s: sequence_balance_loss(s, jnp.asarray(idx), batch=batch, weight=0.3)   # noqa: E731
        seq_ref = lambda s: ref.sequence_balance_loss(s, idx, batch=batch, weight=0.3)       # noqa: E731
        sw = lambda p: switch_balance_loss(p, jnp.asarray(idx), weight=0.3)                  # noqa: E731
        sw_ref = lambda p: ref.switch_balance_loss(p, idx, weight=0.3)                      # noqa: E731
        for loss, want, scores in ((seq, seq_ref, jax.nn.sigmoid(logits)), (sw, sw_ref, jax.nn.softmax(logits))):
            loss, want = jax.jit(loss), jax.jit(want)
            assert ref.rel_err(loss(scores), want(scores)) < 1e-13
            assert ref.rel_err(jax.jit(jax.grad(loss))(scores), jax.jit(jax.grad(want))(scores)) < 1e-13
            check_grads(loss, (scores,), order=1, modes=("rev",))


@pytest.mark.parametrize("name", tiered(["group-limited", "softmax", "softmax-unnormalised"],
                                         fast=("group-limited", "softmax")))
def test_matches_transformers_router_under_torch_autograd(hf, name):
    import transformers
    router, x = _make(name), tokens()
    ct = np.random.default_rng(2).normal(size=(T, E)).astype(np.float32)
    if name.startswith("group-limited"):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
        cfg = transformers.DeepseekV3Config(hidden_size=D, num_attention_heads=2, n_routed_experts=E,
                                            num_experts_per_tok=K, n_group=4, topk_group=2,
                                            routed_scaling_factor=2.5, norm_topk_prob=router.norm_topk_prob)
        theirs = DeepseekV3TopkRouter(cfg)
        rows = hf.unit_rows(DEEPSEEK_MOE, "mlp.gate.", "mlp.gate.")
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
        cfg = transformers.Qwen3MoeConfig(hidden_size=D, num_attention_heads=2, num_experts=E, num_experts_per_tok=K,
                                          norm_topk_prob=router.norm_topk_prob)
        theirs = Qwen3MoeTopKRouter(cfg)
        rows = hf.unit_rows(ROUTED_EXPERTS, "mlp.gate.", "mlp.gate.")
    hf.load(theirs, router, rows)

    def forward(xt):
        import torch
        _, weights, idx = theirs(xt)
        return torch.zeros(T, E).scatter(1, idx, weights)
    out, dx = hf.torch_vjp(forward, x, ct)
    got, got_dx, got_params = hf.jax_vjp(router, x, ct, forward=lambda m, x: dense(*m(x)[1:]))
    np.testing.assert_array_equal(np.asarray(got) != 0, out != 0)     # the same experts chosen
    assert ref.rel_err(got, out) < 1e-5
    assert ref.rel_err(got_dx, dx) < 1e-5
    assert ref.rel_err(got_params, hf.grads(theirs, router, rows)) < 1e-5


def test_switch_loss_matches_transformers(hf):
    import torch
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    logits = np.random.default_rng(4).normal(size=(T, E)).astype(np.float32)
    lt = torch.tensor(logits, requires_grad=True)
    theirs = load_balancing_loss_func((lt,), num_experts=E, top_k=K)
    theirs.backward()

    def ours(lg):
        probs = jax.nn.softmax(lg, axis=-1)
        return switch_balance_loss(probs, jax.lax.top_k(probs, K)[1], weight=1.0)
    value, grad = jax.jit(jax.value_and_grad(ours))(jnp.asarray(logits))
    assert float(value) == pytest.approx(float(theirs.detach()), rel=1e-6)
    assert ref.rel_err(grad, lt.grad.numpy()) < 1e-5
