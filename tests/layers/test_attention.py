"""Grouped-query attention (zoo.layers.attention) as a unit, Llama 3.1's (GQA, causal, Llama 3.1 RoPE scaling) and
Qwen3's (per-head q/k RMSNorm before RoPE): output shape, the tags and their shapes, the output against an explicit
masked softmax, gradients of the output w.r.t. the input and the parameters against finite differences in float64,
and against transformers' `LlamaAttention` and `Qwen3Attention` under torch autograd (float32, relative 1e-5)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

from tests.layers import reference as ref
from tests.layers.random_layers import jitted, random_layer
from zoo.emitted import emitted_by
from zoo.hf.keymap import GQA
from zoo.layers import Attention, Rope, WavelengthScaling
from zoo.models.qwen3_moe.hf import QK_NORMS

B, S, D, H, KV, HD = 2, 8, 32, 4, 2, 8
EPS = 1e-6

# The tags the layer emits for an input [B, S, D]: {tag: (shape, dtype)}, dtype None meaning the layer's dtype.
# This is the one place to update when the layer's tags change. (Compared as a dict: the order is not asserted.)
TAGS = {
    "query_proj": ((B, S, H, HD), None),       # after the q norm (Qwen3) and RoPE
    "key_proj": ((B, S, KV, HD), None),        # after the k norm (Qwen3) and RoPE
    "value_proj": ((B, S, KV, HD), None),
    "attention_out": ((B, S, H, HD), None),    # the attention kernel's output
    "context": ((B, H, S), jnp.float32),       # the kernel's softmax statistics (log-sum-exp), float32
    "out_proj": ((B, S, D), None),
}
# How check_grads checks the layer in float64: reverse mode (what training runs; a custom_vjp kernel has no forward
# mode), and, since jax.nn.dot_product_attention's softmax runs in float32 whatever the input dtype, the finite
# differences carry float32 rounding: a larger step and tolerance than the float64 defaults (a wrong gradient is off
# by order one, not 1e-4).
GRAD_CHECK = dict(modes=("rev",), eps=3e-4, atol=1e-4, rtol=1e-4)

LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)
VARIANTS = {"llama": dict(qk_norm_eps=None), "qwen3": dict(qk_norm_eps=EPS)}


def make_attention(variant, dtype=jnp.float32, seed=0) -> Attention:
    rope = Rope(dim=HD, theta=10000.0, scaling=WavelengthScaling(**LLAMA3) if variant == "llama" else None)
    return random_layer(lambda: Attention(dim=D, num_heads=H, num_kv_heads=KV, head_dim=HD, rope=rope, dtype=dtype,
                                          param_dtype=dtype, implementation="xla", rngs=nnx.Rngs(seed),
                                          **VARIANTS[variant]), seed)


def inputs(dtype=np.float32, seed=1, shape=(B, S, D)):
    return np.random.default_rng(seed).normal(size=shape).astype(dtype)


def ref_params(attn):
    p = {n: getattr(attn, f"{n}_proj").kernel[...] for n in "qkvo"}
    if attn.q_norm is not None:
        p |= {"q_norm": attn.q_norm.scale[...], "k_norm": attn.k_norm.scale[...]}
    return p


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_shape_and_tags(variant):
    attn = make_attention(variant)
    assert jax.eval_shape(attn, jax.ShapeDtypeStruct((B, S, D), jnp.float32)).shape == (B, S, D)
    for dtype in (jnp.float32, jnp.bfloat16):
        layer = make_attention(variant, dtype)
        got = emitted_by(layer, jax.ShapeDtypeStruct((B, S, D), dtype))
        assert {t: (s.shape, s.dtype) for t, s in got.items()} == {
            t: (shape, jnp.dtype(dt or dtype)) for t, (shape, dt) in TAGS.items()}
        assert layer.tag_shapes(B, S) == got


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_matches_reference_and_gradients_float64(variant):
    with ref.float64():
        attn, x = make_attention(variant, jnp.float64), jnp.asarray(inputs(np.float64))
        out = jitted(attn)(x)
        assert out.dtype == jnp.float64
        want = jax.jit(lambda x, p: ref.gqa(x, p, inv_freq=attn.rope.inv_freq(),
                                            q_norm_eps=VARIANTS[variant]["qk_norm_eps"]))(x, ref_params(attn))
        assert ref.rel_err(out, want) < 1e-6    # the kernel's float32 softmax
        graphdef, params = nnx.split(attn)
        check_grads(jax.jit(lambda p, x: nnx.merge(graphdef, p)(x)), (params, x), order=1, **GRAD_CHECK)


def test_causal():
    """Changing a later token changes nothing before it."""
    attn, x = make_attention("llama"), inputs()
    y = x.copy()
    y[:, 5:] += 1.0
    apply = jitted(attn)
    out_x, out_y = np.asarray(apply(x)), np.asarray(apply(y))
    np.testing.assert_array_equal(out_x[:, :5], out_y[:, :5])
    assert not np.allclose(out_x[:, 5:], out_y[:, 5:])


def _check_against_torch(hf, attn, theirs, rotary, rows):
    import torch
    hf.load(theirs, attn, rows)
    x, ct = inputs(), inputs(seed=2)
    pos = torch.arange(S)[None]

    def forward(xt):
        return theirs(xt, position_embeddings=rotary(xt, pos), attention_mask=hf.causal_mask(S))[0]
    out, dx = hf.torch_vjp(forward, x, ct)
    got, got_dx, got_params = hf.jax_vjp(attn, x, ct)
    assert ref.rel_err(got, out) < 1e-5
    assert ref.rel_err(got_dx, dx) < 1e-5
    want = hf.grads(theirs, attn, rows)
    assert set(want) == set(got_params)
    for path in want:
        assert ref.rel_err(got_params[path], want[path]) < 1e-5, path


def test_matches_llama_attention_under_torch_autograd(hf):
    import transformers
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
    cfg = transformers.LlamaConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=KV, head_dim=HD,
                                   rope_theta=10000.0, rope_scaling=dict(rope_type="llama3", **LLAMA3),
                                   attention_bias=False, max_position_embeddings=64, attn_implementation="eager")
    _check_against_torch(hf, make_attention("llama"), LlamaAttention(cfg, layer_idx=0).eval(),
                         LlamaRotaryEmbedding(cfg), hf.unit_rows(GQA, "attn.", "self_attn."))


def test_matches_qwen3_attention_under_torch_autograd(hf):
    import transformers
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding
    cfg = transformers.Qwen3Config(hidden_size=D, num_attention_heads=H, num_key_value_heads=KV, head_dim=HD,
                                   rope_theta=10000.0, rms_norm_eps=EPS, attention_bias=False, use_sliding_window=False,
                                   max_position_embeddings=64, attn_implementation="eager")
    _check_against_torch(hf, make_attention("qwen3"), Qwen3Attention(cfg, layer_idx=0).eval(),
                         Qwen3RotaryEmbedding(cfg), hf.unit_rows(GQA + QK_NORMS, "attn.", "self_attn."))
