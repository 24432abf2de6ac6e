"""The attention kernel with named residuals (zoo.layers.attention_kernel, zoo.layers.xla_attention): the XLA kernel
against jax.nn.dot_product_attention (forward and gradients, GQA, a value head dim unlike q's), its gradients
against finite differences in float64, cuDNN's wrapper logic on a kernel with cuDNN's residuals (inputs, zero-size
placeholders, statistics, output) and on jax's own cuDNN attention traced on the CPU, the tags it emits, what a
checkpoint policy saves (never [B, H, S, S]), and the recipe rule that keeps attention_out and context together."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import zoo
from zoo.layers import attention_kernel as ak
from zoo.layers import xla_attention
from zoo.plan import measure

B, S, H, KV, D, DV = 2, 16, 4, 2, 12, 8


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
    """float32 matmuls in full precision on every device (a GPU's default rounds them to TF32): the comparisons
    below are of float32 kernels to 1e-5."""
    with jax.default_matmul_precision("highest"):
        yield


def inputs(dtype=jnp.float32, dv=DV, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, S, H, D), dtype)
    k = jax.random.normal(ks[1], (B, S, KV, D), dtype)
    v = jax.random.normal(ks[2], (B, S, KV, dv), dtype)
    g = jax.random.normal(ks[3], (B, S, H, dv), dtype)
    return q, k, v, g


def reference(q, k, v):
    """jax.nn.dot_product_attention (XLA), values zero-padded to q's head dim and the output sliced back."""
    vp = jnp.pad(v, [(0, 0)] * 3 + [(0, q.shape[-1] - v.shape[-1])])
    return jax.nn.dot_product_attention(q, k, vp, is_causal=True, implementation="xla")[..., :v.shape[-1]]


def rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("dv", [D, DV])
def test_the_xla_kernel_equals_jax_attention_forward_and_gradients(dv):
    q, k, v, g = inputs(dv=dv)
    out, vjp = jax.vjp(lambda *a: ak.causal_attention(*a, impl="xla"), q, k, v)
    ref, ref_vjp = jax.vjp(reference, q, k, v)
    assert out.shape == (B, S, H, dv) and rel(out, ref) < 1e-6
    for got, want in zip(vjp(g), ref_vjp(g)):
        assert got.shape == want.shape and rel(got, want) < 1e-5


def test_the_xla_kernel_gradients_match_finite_differences_in_float64():
    with jax.enable_x64(True):
        q, k, v, _ = inputs(jnp.float64)
        check_grads(lambda *a: ak.causal_attention(*a, impl="xla"), (q, k, v), order=1, modes=["rev"],
                    atol=1e-6, rtol=1e-6)


def test_the_xla_kernel_is_causal_and_returns_the_logsumexp():
    q, k, v, _ = inputs()
    out, lse = xla_attention.forward(q, k, v, D ** -0.5)
    assert lse.shape == (B, H, S) and lse.dtype == jnp.float32
    # the first query sees only the first key: its log-sum-exp is that one logit
    first = jnp.einsum("bhd,bhd->bh", q[:, 0], jnp.repeat(k[:, 0], H // KV, axis=1)) * D ** -0.5
    np.testing.assert_allclose(lse[:, :, 0], first, rtol=1e-5)
    later = ak.causal_attention(q, k, v.at[:, -1].set(100.0), impl="xla")
    np.testing.assert_array_equal(np.asarray(later[:, :-1]), np.asarray(out[:, :-1]))


def _cudnn_like():
    """A kernel whose VJP saves cuDNN's residuals as jax defines them (`_dot_product_attention_fwd_rule`, cited in
    zoo.layers.attention_kernel): q, k, v, seven placeholders (one shared zeros(0)), the statistics (here [B, H, S, 1])
    and the output; the scale is not differentiated."""
    @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
    def kernel(q, k, v, scale):
        return xla_attention.forward(q, k, v, scale)[0]

    def fwd(q, k, v, scale):
        out, lse = xla_attention.forward(q, k, v, scale)
        not_used = jnp.zeros(0, q.dtype)
        return out, (q, k, v, *[not_used] * len(ak.CUDNN_PLACEHOLDERS), lse[..., None], out)

    def bwd(scale, res, g):
        q, k, v, *not_used, lse, out = res
        assert [e.shape for e in not_used] == [(0,)] * len(ak.CUDNN_PLACEHOLDERS)
        return xla_attention.backward(q, k, v, out, lse[..., 0], g, scale)

    kernel.defvjp(fwd, bwd)
    return kernel


def test_the_wrapper_of_a_kernel_with_its_own_vjp_names_its_residuals_and_hands_them_back():
    """cuDNN's path on the CPU: the residual leaves are told apart by their position in cuDNN's residuals (inputs,
    placeholders, statistics, output); values are padded to q's head dim for the kernel and the saved output is the
    un-padded one."""
    q, k, v, g = inputs()
    out, res, backward = ak._vjp_with_residuals(q, k, v, D ** -0.5, attend=_cudnn_like())
    saved_q, saved_k, saved_v, saved_out, stats, empty = res
    assert saved_v.shape == v.shape and saved_out.shape == (B, S, H, DV)
    assert [s.shape for s in stats] == [(B, H, S, 1)] and [e.shape for e in empty] == [(0,)]
    assert rel(out, reference(q, k, v)) < 1e-6
    _, ref_vjp = jax.vjp(reference, q, k, v)
    for got, want in zip(backward(res, g), ref_vjp(g)):
        assert got.shape == want.shape and rel(got, want) < 1e-5


def test_jax_cudnn_attention_has_the_residuals_the_wrapper_reads(monkeypatch):
    """jax's own cuDNN attention, traced on the CPU (its cuDNN version and flash-attention checks stubbed; nothing
    runs): its residual leaves have the roles read off its definition, the kernel emits both tags, and its gradients
    trace through cuDNN's backward."""
    fa = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    if not all(hasattr(fa, f) for f in ("check_cudnn_version", "check_is_flash_attention")):
        pytest.skip("jax's cuDNN attention checks moved")
    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(fa, "check_is_flash_attention", lambda *a, **kw: None)
    q, k, v, _ = inputs(jnp.bfloat16)
    roles = []

    def forward(q, k, v):
        vp = jnp.pad(v, [(0, 0)] * 3 + [(0, D - DV)])
        out, vjp_fn = jax.vjp(lambda q, k, vp: ak._cudnn_attend(q, k, vp, D ** -0.5), q, k, vp)
        roles.extend(ak._cudnn_roles(jax.tree.leaves(vjp_fn), (q, k, vp), out))
        return out

    jax.make_jaxpr(forward)(q, k, v)
    assert roles == [("input", 0), ("input", 1), ("input", 2), ("empty", 0), ("stats", 0), ("out", None)]
    got = zoo.emitted.emitted(lambda q, k, v: ak.causal_attention(q, k, v, impl="cudnn"), q, k, v)
    assert {t: (s.shape, s.dtype) for t, s in got.items()} == {
        "attention_out": ((B, S, H, DV), jnp.bfloat16), "context": ((B, H, S), jnp.float32)}
    grads = jax.eval_shape(jax.grad(lambda *a: jnp.sum(ak.causal_attention(*a, impl="cudnn").astype(jnp.float32)),
                                    argnums=(0, 1, 2)), q, k, v)
    assert [(x.shape, x.dtype) for x in grads] == [(x.shape, x.dtype) for x in (q, k, v)]


def test_a_kernel_whose_residuals_are_not_cudnns_is_a_value_error():
    q, k, v, _ = inputs(dv=D)
    with pytest.raises(ValueError, match="not cuDNN's"):
        ak._vjp_with_residuals(q, k, v, D ** -0.5, attend=lambda q, k, v, scale: jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=True, implementation="xla"))


def test_cudnns_residuals_are_read_outside_a_trace_and_with_sequence_lengths():
    """Called eagerly, jax.vjp's residuals are arrays equal to the inputs, not the inputs themselves; given key
    lengths, the placeholders include int32 [B] lengths. Both are cuDNN's residuals; a wrong shape is not."""
    q, k, v, _ = inputs(jnp.bfloat16, dv=D)
    out, stats, lengths = jnp.zeros_like(q), jnp.zeros((B, H, S), jnp.float32), jnp.full((B,), S, jnp.int32)
    leaves = [jnp.array(q), jnp.array(k), jnp.array(v), lengths, lengths, jnp.zeros(0, q.dtype), stats, out]
    assert ak._cudnn_roles(leaves, (q, k, v), out)[-2:] == [("stats", 0), ("out", None)]
    with pytest.raises(ValueError, match="not cuDNN's"):
        ak._cudnn_roles([q[:, :1]] + leaves[1:], (q, k, v), out)


def test_the_kernel_emits_attention_out_and_context():
    q, k, v, _ = inputs()
    got = zoo.emitted.emitted(lambda q, k, v: ak.causal_attention(q, k, v, impl="xla"), q, k, v)
    assert {t: (s.shape, s.dtype) for t, s in got.items()} == {
        "attention_out": ((B, S, H, DV), jnp.float32), "context": ((B, H, S), jnp.float32)}


@pytest.mark.parametrize("recipe, saved", [
    (zoo.Recipe("keep", device=("attention_out", "context")), {"attention_out", "context"}),
    (zoo.Recipe.full(), set()),
])
def test_a_policy_saves_the_named_residuals_and_nothing_quadratic(recipe, saved):
    q, k, v, _ = inputs()

    def loss(q, k, v):
        return jnp.sum(jnp.sin(ak.causal_attention(q, k, v, impl="xla")))

    res = measure.residuals(jax.checkpoint(loss, policy=recipe.policy()), q, k, v)
    assert {r.tag for r in res if r.tag} == saved
    assert not any(S * S <= np.prod(r.shape[-2:]) for r in res if len(r.shape) >= 2), [r.shape for r in res]


def test_a_recipe_keeping_half_of_the_kernels_residuals_is_refused():
    with pytest.raises(ValueError, match=r"keeps \['context'\] but recomputes \['attention_out'\]"):
        zoo.Recipe("half", offload=("context",))
    with pytest.raises(ValueError, match=r"keeps \['attention_out'\] but recomputes \['context'\]"):
        zoo.Recipe("half", device=("attention_out",))
    zoo.Recipe("split", device=("context",), offload=("attention_out",))   # each kept, in two places: fine


def test_an_unknown_kernel_is_a_value_error():
    q, k, v, _ = inputs()
    with pytest.raises(ValueError, match=r"impl must be one of \('cudnn', 'xla', 'mosaic_cudnn'\)"):
        ak.causal_attention(q, k, v, impl="flash")


def test_attention_flops_are_causal_half_of_the_square():
    q = jax.ShapeDtypeStruct((B, S, H, D), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((B, S, KV, DV), jnp.bfloat16)
    assert ak.attention_flops(q, v) == (2 * B * S * S * H * D + 2 * B * S * S * H * DV) // 2


@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="runs cuDNN's attention: needs an NVIDIA GPU")
def test_cudnn_attention_on_a_gpu_names_its_residuals_and_matches_xla():
    """On a GPU, jax's real cuDNN attention: its residual leaves have the roles the wrapper reads, a policy keeping
    the kernel's pair saves exactly `attention_out` and `context`, and the output and gradients equal the XLA kernel's
    within bfloat16's precision (head dim 128, GQA)."""
    b, s, h, kv, d = 1, 256, 8, 2, 128
    ks = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(ks[0], (b, s, h, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, s, kv, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, s, kv, d), jnp.bfloat16)
    g = jax.random.normal(ks[3], (b, s, h, d), jnp.bfloat16)
    roles = []

    def forward(q, k, v):
        out, vjp_fn = jax.vjp(lambda q, k, v: ak._cudnn_attend(q, k, v, d ** -0.5), q, k, v)
        roles.extend(ak._cudnn_roles(jax.tree.leaves(vjp_fn), (q, k, v), out))
        return out

    jax.make_jaxpr(forward)(q, k, v)
    assert [r for r, _ in roles].count("input") == 3 and ("out", None) in roles and ("stats", 0) in roles

    def loss(impl):
        return lambda q, k, v: jnp.sum(ak.causal_attention(q, k, v, impl=impl).astype(jnp.float32) * g)

    keep = zoo.Recipe("pair", device=("attention_out", "context"))
    res = measure.residuals(jax.checkpoint(loss("cudnn"), policy=keep.policy()), q, k, v)
    assert {r.tag for r in res if r.tag} == {"attention_out", "context"}
    out_c = jax.jit(lambda q, k, v: ak.causal_attention(q, k, v, impl="cudnn"))(q, k, v).astype(jnp.float32)
    out_x = jax.jit(lambda q, k, v: ak.causal_attention(q, k, v, impl="xla"))(q, k, v).astype(jnp.float32)
    assert rel(out_c, out_x) < 2e-2
    grads_c = jax.jit(jax.grad(loss("cudnn"), argnums=(0, 1, 2)))(q, k, v)
    grads_x = jax.jit(jax.grad(loss("xla"), argnums=(0, 1, 2)))(q, k, v)
    for got, want in zip(grads_c, grads_x):
        assert rel(got.astype(jnp.float32), want.astype(jnp.float32)) < 3e-2
