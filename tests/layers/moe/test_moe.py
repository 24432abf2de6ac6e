"""DeepSeek-V3 MoE: the router against NumPy, every dispatch backend against a dense reference, capacity drops,
gradients to the router, the balance loss and the auxiliary-loss-free bias update."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zoo
from zoo.layers import MLP
from zoo.layers.moe import (
    Experts,
    GroupLimitedRouter,
    MoE,
    RoutingBias,
    SoftmaxRouter,
    capacity,
    route,
    routing_bias_delta,
    tokamax_available,
    update_routing_bias,
)

D, E, K, F, G, TOPK_GROUP = 32, 16, 4, 24, 4, 2
B, S = 2, 16
ROUTING = dict(k=K, n_group=G, topk_group=TOPK_GROUP, routed_scaling_factor=2.5)


def make_moe(backend="ragged_dot", capacity_factor=1.25, seed=0, **routing):
    """DeepSeek-V3's MoE from its parts: the group-limited router, the experts, one shared expert."""
    rngs = nnx.Rngs(seed)
    router = GroupLimitedRouter(dim=D, num_experts=E, rngs=rngs, **{**ROUTING, **routing})
    experts = Experts(num_experts=E, dim=D, hidden=F, rngs=rngs)
    shared = MLP(dim=D, hidden=F, tag_prefix="shared_", rngs=rngs)
    return MoE(dim=D, router=router, experts=experts, shared=shared, backend=backend, capacity_factor=capacity_factor)


def inputs(seed=1):
    return jax.random.normal(jax.random.key(seed), (B, S, D))


# -- the router ---------------------------------------------------------------------------------------------
def numpy_route(scores, bias, *, k, n_group, topk_group, routed_scaling_factor):
    """DeepSeek-V3's routing, one token at a time, as the paper and the published inference code describe it."""
    t, e = scores.shape
    per = e // n_group
    idx = np.zeros((t, k), np.int64)
    weights = np.zeros((t, k))
    for i in range(t):
        biased = scores[i] + bias
        group_score = [np.sort(biased[g * per:(g + 1) * per])[-2:].sum() for g in range(n_group)]
        kept = np.argsort(group_score)[::-1][:topk_group]
        allowed = np.concatenate([np.arange(g * per, (g + 1) * per) for g in kept])
        chosen = allowed[np.argsort(biased[allowed])[::-1][:k]]
        w = scores[i, chosen]
        idx[i], weights[i] = chosen, w / w.sum() * routed_scaling_factor
    return weights, idx


def test_router_matches_numpy_reference():
    rng = np.random.default_rng(0)
    scores = jax.nn.sigmoid(rng.normal(size=(64, E)) * 2).astype(np.float32)
    bias = (rng.normal(size=E) * 0.3).astype(np.float32)
    weights, idx = route(jnp.asarray(scores), jnp.asarray(bias), **ROUTING)
    ref_w, ref_idx = numpy_route(np.asarray(scores, np.float64), np.asarray(bias, np.float64), **ROUTING)
    order = np.argsort(np.asarray(idx), axis=1)
    ref_order = np.argsort(ref_idx, axis=1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(idx), order, 1),
                                  np.take_along_axis(ref_idx, ref_order, 1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, 1),
                               np.take_along_axis(ref_w, ref_order, 1), rtol=1e-6)
    # the test is sharp: the bias and the group limit both change some choices
    _, unbiased = numpy_route(np.asarray(scores, np.float64), np.zeros(E), **ROUTING)
    assert (np.sort(unbiased, 1) != np.sort(ref_idx, 1)).any()
    plain_topk = np.argsort(scores + bias, axis=1)[:, ::-1][:, :K]
    assert (np.sort(plain_topk, 1) != np.sort(ref_idx, 1)).any()
    assert all(len(set(row // (E // G))) <= TOPK_GROUP for row in np.asarray(idx))


def test_router_weights_are_unbiased_and_scaled():
    scores = jax.nn.sigmoid(jax.random.normal(jax.random.key(0), (8, E)))
    weights, idx = route(scores, jnp.full((E,), 5.0), **ROUTING)  # a constant bias changes nothing
    w0, idx0 = route(scores, jnp.zeros((E,)), **ROUTING)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(idx0))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(w0), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(weights.sum(-1)), 2.5, rtol=1e-6)


# -- dispatch and combine --------------------------------------------------------------------------------------
def dense_reference(moe, x, keep=None):
    """Every expert on every token, masked by the routing: sum_e w_te * expert_e(x_t), plus the shared expert.

    `keep` [T, K] (bool) masks out token copies (those capacity dispatch drops)."""
    flat = x.reshape(-1, D)
    _, weights, idx = moe.gate(flat)
    w_gate, w_up, w_down = (np.asarray(w, np.float64) for w in moe.experts.weights())
    xs = np.asarray(flat, np.float64)
    gate = np.einsum("td,edf->etf", xs, w_gate)
    every = np.einsum("etf,efd->etd", gate / (1 + np.exp(-gate)) * np.einsum("td,edf->etf", xs, w_up), w_down)
    mask = np.zeros((flat.shape[0], E))
    w = np.asarray(weights, np.float64) * (np.ones_like(idx) if keep is None else keep)
    np.put_along_axis(mask, np.asarray(idx), w, axis=1)
    routed = np.einsum("te,etd->td", mask, every).reshape(x.shape)
    return routed + np.asarray(moe.shared_experts(x), np.float64)


def backends():
    out = ["ragged_dot", "capacity", "auto"]
    if tokamax_available():
        out.append("tokamax")
    return out


@pytest.mark.parametrize("backend", backends())
def test_dispatch_backends_match_dense_reference(backend):
    moe = make_moe(backend, capacity_factor=float(E))  # capacity = every copy: nothing can be dropped
    x = inputs()
    y, aux = moe(x)
    chex.assert_shape(y, (B, S, D))
    chex.assert_trees_all_close(np.asarray(y, np.float64), dense_reference(moe, x), rtol=2e-5, atol=2e-5)
    if backend == "capacity":  # the only backend that can drop (the dropless ones report a constant 0)
        assert int(aux.dropped) == 0
    assert float(aux.load.sum()) == B * S * K


def loop_reference(moe, x) -> np.ndarray:
    """The MoE layer one token at a time in NumPy (float64), from its weights alone: the router of the paper
    (`numpy_route`), then the k chosen SwiGLU experts weighted, plus the shared expert. Shares no code with the
    layer."""
    p = {k: np.asarray(v, np.float64) for k, v in [
        ("router", moe.gate.kernel[...]), ("bias", moe.gate.e_score_correction_bias[...]),
        ("gate", moe.experts.gate_proj[...]), ("up", moe.experts.up_proj[...]), ("down", moe.experts.down_proj[...]),
        ("s_gate", moe.shared_experts.gate_proj.kernel[...]), ("s_up", moe.shared_experts.up_proj.kernel[...]),
        ("s_down", moe.shared_experts.down_proj.kernel[...])]}

    def swiglu(v, gate, up, down):
        g = v @ gate
        return (g / (1 + np.exp(-g)) * (v @ up)) @ down

    flat = np.asarray(x, np.float64).reshape(-1, D)
    scores = 1 / (1 + np.exp(-flat @ p["router"]))
    weights, idx = numpy_route(scores, p["bias"], **ROUTING)
    out = np.zeros_like(flat)
    for t, v in enumerate(flat):
        for w, e in zip(weights[t], idx[t]):
            out[t] += w * swiglu(v, p["gate"][e], p["up"][e], p["down"][e])
        out[t] += swiglu(v, p["s_gate"], p["s_up"], p["s_down"])
    return out.reshape(x.shape)


@pytest.mark.parametrize("backend", backends())
def test_backends_match_a_per_token_loop(backend):
    """Each backend against the layer computed token by token in NumPy, with a routing bias that changes choices."""
    moe = make_moe(backend, capacity_factor=float(E))
    moe.gate.e_score_correction_bias[...] = jax.random.normal(jax.random.key(3), (E,)) * 0.3
    x = inputs()
    y, _ = moe(x)
    chex.assert_trees_all_close(np.asarray(y, np.float64), loop_reference(moe, x), rtol=1e-4, atol=1e-5)


def test_capacity_dispatch_drops_and_reports_the_dropped_copies():
    moe = make_moe("capacity", capacity_factor=0.5)
    x = inputs()
    y, aux = moe(x)
    load = np.asarray(aux.load).astype(int)
    c = capacity(B * S * K, E, 0.5)
    assert int(aux.dropped) == np.maximum(load - c, 0).sum() > 0
    # which copies are dropped: each expert keeps its first c copies in token order
    _, _, idx = moe.gate(x.reshape(-1, D))
    flat = np.asarray(idx).reshape(-1)
    rank = np.array([(flat[:i] == flat[i]).sum() for i in range(flat.size)])
    keep = (rank < c).reshape(-1, K)
    np.testing.assert_allclose(np.asarray(y), dense_reference(moe, x, keep), rtol=2e-5, atol=2e-5)


def test_tags_per_backend():
    x = jax.ShapeDtypeStruct((B, S, D), jnp.float32)
    got = {t: s.shape for t, s in zoo.emitted.emitted_by(make_moe("ragged_dot"), x).items()}
    assert got == {"moe_mlpwi_0": (B * S * K, F), "moe_mlpwi_1": (B * S * K, F), "moe_mlpwo": (B * S * K, D),
                   "shared_mlpwi_0": (B, S, F), "shared_mlpwi_1": (B, S, F), "shared_mlpwo": (B, S, D)}
    c = capacity(B * S * K, E, 1.25)
    got = {t: s.shape for t, s in zoo.emitted.emitted_by(make_moe("capacity"), x).items()}
    assert got["moe_mlpwi_0"] == got["moe_mlpwi_1"] == (E, c, F) and got["moe_mlpwo"] == (E, c, D)


# -- gradients and balance -------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["ragged_dot", "capacity"])
def test_gradients_reach_the_router_and_every_expert_weight(backend):
    moe = make_moe(backend, balance_loss_weight=0.0)  # the routing weights alone must carry gradient
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)

    def loss(p):
        y, aux = nnx.merge(graphdef, p, rest)(inputs())
        return jnp.mean(y ** 2) + aux.balance_loss

    grads = jax.grad(loss)(params)
    assert float(jnp.abs(grads["gate"]["kernel"][...]).max()) > 0
    for w in ("gate_proj", "up_proj", "down_proj"):
        assert float(jnp.abs(grads["experts"][w][...]).max()) > 0
    assert not jax.tree.leaves(nnx.state(moe, nnx.Param).filter(RoutingBias))  # the bias is not a Param
    assert nnx.state(moe, RoutingBias)["gate"]["e_score_correction_bias"].shape == (E,)


def test_balance_loss_matches_the_paper_formula():
    moe = make_moe(balance_loss_weight=0.3)
    x = inputs()
    _, aux = moe(x)
    scores, _, idx = moe.gate(x.reshape(-1, D))
    scores, idx = np.asarray(scores, np.float64).reshape(B, S, E), np.asarray(idx).reshape(B, S, K)
    total = 0.0
    for b in range(B):
        f = np.bincount(idx[b].reshape(-1), minlength=E) * E / (K * S)
        p = (scores[b] / scores[b].sum(-1, keepdims=True)).mean(0)
        total += (f * p).sum()
    np.testing.assert_allclose(float(aux.balance_loss), 0.3 * total / B, rtol=1e-5)
    # it rewards balance: a router that sends every token to the same experts pays more
    assert float(aux.balance_loss) > 0


def test_bias_update_moves_load_toward_balance():
    moe = make_moe()
    # a skewed input: every token leans toward experts 0 and 1
    kernel = moe.gate.kernel[...]
    direction = jnp.ones((D,)) / np.sqrt(D)
    moe.gate.kernel[...] = kernel.at[:, :2].add(4.0 * direction[:, None])
    x = inputs() + direction

    def imbalance(load):
        return float(jnp.max(load) / jnp.mean(load))

    _, aux = moe(x)
    start = imbalance(aux.load)
    assert start > 2.0
    np.testing.assert_array_equal(np.asarray(routing_bias_delta(aux.load, 0.1)),
                                  0.1 * np.sign(np.asarray(aux.load).mean() - np.asarray(aux.load)))
    for _ in range(40):
        _, aux = moe(x)
        update_routing_bias(moe, aux, rate=0.02)
    assert imbalance(aux.load) < start / 2
    bias = np.asarray(moe.gate.e_score_correction_bias[...])
    assert bias[:2].max() < 0 < bias[2:].max()  # the hot experts were pushed down


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_group=5), "n_group=5 must divide num_experts=16"),
    (dict(topk_group=5), "topk_group=5"),
    (dict(k=9), "num_experts_per_tok=9"),
    (dict(backend="megablox"), "moe_backend must be one of"),
])
def test_bad_moe_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_moe(**kwargs)


@pytest.mark.skipif(tokamax_available(), reason="tokamax is installed")
def test_tokamax_backend_without_tokamax_is_a_clear_error():
    with pytest.raises(ValueError, match="needs the tokamax package"):
        make_moe("tokamax")


# -- the softmax top-k router (Mixtral, Qwen3-MoE) ---------------------------------------------------------------
@pytest.mark.parametrize("norm", [True, False])
def test_softmax_router_matches_numpy(norm):
    router = SoftmaxRouter(dim=D, num_experts=E, k=K, norm_topk_prob=norm, balance_loss_weight=0.01,
                           rngs=nnx.Rngs(0))
    x = inputs().reshape(-1, D)
    probs, weights, idx = router(x)
    logits = np.asarray(x, np.float64) @ np.asarray(router.kernel[...], np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref_idx = np.argsort(-p, axis=1)[:, :K]
    ref_w = np.take_along_axis(p, ref_idx, 1)
    if norm:
        ref_w /= ref_w.sum(-1, keepdims=True)
    np.testing.assert_array_equal(np.sort(np.asarray(idx), 1), np.sort(ref_idx, 1))
    np.testing.assert_allclose(np.sort(np.asarray(weights), 1), np.sort(ref_w, 1), rtol=1e-5)
    # Switch Transformer's loss as transformers computes it: E * sum_i (copies to i / tokens) * mean prob of i
    f = np.bincount(ref_idx.reshape(-1), minlength=E) / x.shape[0]
    want = 0.01 * E * float((f * p.mean(0)).sum())
    np.testing.assert_allclose(float(router.balance_loss(probs, idx, batch=B)), want, rtol=1e-5)


def test_a_moe_without_shared_expert_under_the_softmax_router_matches_a_per_token_loop():
    rngs = nnx.Rngs(0)
    router = SoftmaxRouter(dim=D, num_experts=E, k=K, rngs=rngs)
    moe = MoE(dim=D, router=router, experts=Experts(num_experts=E, dim=D, hidden=F, rngs=rngs), backend="ragged_dot")
    x = inputs()
    y, aux = moe(x)
    flat = np.asarray(x, np.float64).reshape(-1, D)
    _, weights, idx = router(x.reshape(-1, D))
    w_gate, w_up, w_down = (np.asarray(w, np.float64) for w in moe.experts.weights())
    out = np.zeros_like(flat)
    for t, v in enumerate(flat):
        for w, e in zip(np.asarray(weights[t], np.float64), np.asarray(idx[t])):
            g = v @ w_gate[e]
            out[t] += w * ((g / (1 + np.exp(-g)) * (v @ w_up[e])) @ w_down[e])
    np.testing.assert_allclose(np.asarray(y, np.float64), out.reshape(x.shape), rtol=1e-4, atol=1e-5)
    assert float(aux.load.sum()) == B * S * K and "shared_mlpwo" not in zoo.emitted.emitted_by(moe, x)
